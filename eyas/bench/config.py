"""`eyas bench`'s settings: the method names and their groups, BenchConfig and the --sweep grid, and the flag checks
that run before anything loads."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..engine.load import EngineUse
from ..engine.params import TreeSettings
from ..errors import EyasError
from ..text import parse_int_list as parse_ints
from .vllm_peer import VLLM_METHODS

METHODS = ("hf-greedy", "plain", "chain", "tree", "tree-lookup", "lookup", "lookup-context", "hf-lookup")
# peers outside the default install: asked for by name, skipped when absent. llama-cpp: llama-cpp-python's `Llama`
# (Python-side sampling per token); llama-cpp-c: llama.cpp's C API through the same package's ctypes bindings
OPTIONAL_METHODS = ("llama-cpp", "llama-cpp-c")
ENGINE_METHODS = ("plain", "chain", "tree", "tree-lookup", "lookup", "lookup-context")
DRAFT_METHODS = ("chain", "tree", "tree-lookup")  # tree-lookup: the EAGLE-3 tree with lookup candidates merged in
# lookup: the lookup chain alone, with the n-gram table where the context has no match (as `eyas generate --method
# lookup`); lookup-context: the same without the table, to measure what the table adds in one run
LOOKUP_METHODS = ("lookup", "lookup-context")
SPEC_METHODS = (*DRAFT_METHODS, *LOOKUP_METHODS)  # speculative, so checked lossless
HF_METHODS = ("hf-greedy", "hf-lookup")
PEER_METHODS = (*HF_METHODS, *OPTIONAL_METHODS)  # other engines: compared for speed, not expected to be token-identical
WARMUP_TOKENS = 16
SKIP_SPEC = "--methods hf-greedy,plain,hf-lookup to skip the speculative methods"  # a run without a draft
# the closest path for a target the engine forward cannot run
HF_ONLY = "bench's HF baselines run on it alone with --methods hf-greedy,hf-lookup"
BENCH_USE = EngineUse(f"bench's eyas methods ({', '.join(ENGINE_METHODS)})", HF_ONLY, SKIP_SPEC)


class BenchError(EyasError):
    pass


def parse_int_list(text: str, what: str, minimum: int = 1) -> list[int]:
    """'1,2,4' or '2-6' or '1-3,8' -> sorted unique ints (the sweep grid's flags)."""
    return parse_ints(text, what, ranges=True, minimum=minimum, error=BenchError)


def parse_methods(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    known = METHODS + OPTIONAL_METHODS + VLLM_METHODS
    bad = [m for m in names if m not in known]
    if bad or not names:
        raise BenchError(f"--methods {text!r}: unknown {bad}; choose from {','.join(known)}")
    return [m for m in known if m in names]  # canonical order, duplicates dropped


def check_threads(threads: int | None) -> None:
    """--threads: torch refuses a negative count with a RuntimeError; say it as a flag error instead."""
    if threads is not None and threads < 0:
        raise BenchError(f"--threads {threads}: expected a positive number of CPU threads (0 = torch's default)")


@dataclass
class SweepGrid:
    steps: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5, 6])
    depth: list[int] = field(default_factory=lambda: [2, 3, 4, 5, 6])
    topk: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    tokens: list[int] = field(default_factory=lambda: [4, 8, 16, 32])
    lookup: list[int] = field(default_factory=lambda: [0])  # lookup candidates merged into each tree setting


@dataclass
class BenchConfig:
    bench: str = "mt-bench"
    limit: int | None = 10
    turn: int = 1
    max_new_tokens: int = 256
    target: str = "smollm2-135m"
    draft: str = "default"  # an eyas draft folder, "default" (bundled) or "random" (untrained, in memory)
    dtype: str = "fp32"
    device: str = "cpu"
    weights: str = "auto"  # eyas methods' target forward (eyas.engine.weights.engine_model)
    draft_weights: str = "auto"  # the draft's matrices (eyas.engine.params.SpecParams.draft_weights)
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    # the eyas methods' knobs as given; unset ones are the device's defaults, as for generate and serve
    # (eyas.engine.load.bench_spec). --lookup: tree-lookup's merged candidates and method lookup's chain alike
    tree: TreeSettings = field(default_factory=TreeSettings)
    lookup_tokens: int = 10  # HF prompt_lookup_num_tokens
    ngram: str = "auto"  # the n-gram table of lookup and tree-lookup (eyas.engine.ngram.resolve_ngram)
    threads: int | None = None
    out: str | None = None
    resume: bool = False
    sweep: bool = False
    sweep_limit: int = 3
    grid: SweepGrid = field(default_factory=SweepGrid)
    chat_template: str | None = None  # --chat-template FILE|NAME (None: the tokenizer's own)
    raw: bool = False  # prompts as plain text, no template (base models; single-turn prompts)
    vllm_python: str | None = None  # methods vllm, vllm-eagle3: vLLM's own python (eyas.vllm.env.vllm_python)
    vllm_k: int | None = None  # vllm-eagle3: num_speculative_tokens (None: --steps, the chain's)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# the fields that must agree for `--resume` to continue an earlier run's rows

