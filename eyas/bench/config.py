"""`eyas bench`'s settings: the method names and their groups, BenchConfig and the --sweep grid, and the flag checks
that run before anything loads."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..engine.load import EngineUse
from ..engine.params import TreeSettings
from ..errors import EyasError
from ..option import (
    CHAT_TEMPLATE_HELP,
    DEFAULT_TARGET,
    DEVICE_HELP,
    DRAFT_WEIGHTS_HELP,
    DTYPE_HELP,
    NGRAM_HELP,
    TARGET_HELP,
    WEIGHTS_HELP,
    option,
)
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
    out = parse_ints(text, what, ranges=True, minimum=minimum, error=BenchError)
    assert out is not None  # with a minimum, parse_ints returns a list (no text is refused)
    return out


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
    """The options of `eyas bench`: each field declared with `option` is its flag, help and default; limit,
    methods, threads and the sweep grid are parsed by the command from their flags."""

    bench: str = option("--bench", "mt-bench | humaneval | a JSONL of prompts", "mt-bench")
    limit: int | None = 10  # --limit: prompts (a deterministic subset; None = all)
    turn: int = option("--turn", "MT-bench turn (2 = the target's greedy first answer in context)", 1)
    max_new_tokens: int = option("--max-new-tokens", "new tokens per prompt and method", 256)
    target: str = option("--target", TARGET_HELP, DEFAULT_TARGET)
    draft: str = option("--draft", "eyas draft folder, 'default' (bundled) or 'random' (untrained, in memory)",
                        "default")
    dtype: str = option("--dtype", DTYPE_HELP, "fp32")
    device: str = option("--device", DEVICE_HELP, "cpu")
    weights: str = option("--weights", WEIGHTS_HELP, "auto")  # eyas methods' target forward
    draft_weights: str = option("--draft-weights", DRAFT_WEIGHTS_HELP, "auto")
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    # the eyas methods' knobs as given; unset ones are the device's defaults, as for generate and serve
    # (eyas.bench.load.bench_spec). --lookup: tree-lookup's merged candidates and method lookup's chain alike
    tree: TreeSettings = field(default_factory=TreeSettings)
    lookup_tokens: int = option("--lookup-tokens", "HF prompt_lookup_num_tokens", 10)
    ngram: str = option("--ngram", NGRAM_HELP, "auto")  # the table of lookup and tree-lookup
    threads: int | None = None  # --threads: torch threads (None = torch's default)
    out: str | None = option("--out", "results folder (default runs/bench-<time>/)")
    resume: bool = option("--resume", "continue an interrupted run in --out", False)
    repeat_plain: bool = option("--repeat-plain/--no-repeat-plain", "run plain twice per prompt: the two runs' "
                                "spread is this run's noise, and a speedup inside it is flagged", True)
    sweep: bool = option("--sweep", "try the grid below and report the fastest setting", False)
    sweep_limit: int = option("--sweep-limit", "prompts used by --sweep", 3)
    grid: SweepGrid = field(default_factory=SweepGrid)
    chat_template: str | None = option("--chat-template", CHAT_TEMPLATE_HELP)
    raw: bool = option("--raw", "send each prompt's text as is, without a chat template (base models; single-turn "
                       "prompts only)", False)
    vllm_python: str | None = option("--vllm-python", "methods vllm, vllm-eagle3: the python of a vLLM environment "
                                     "(default $EYAS_VLLM_PYTHON, then ./.venv-vllm from `make vllm`)")
    vllm_k: int | None = option("--vllm-k", "vllm-eagle3: num_speculative_tokens (default --steps); compared with "
                                "eyas chain of the same steps on the fp32 weights")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# the fields that must agree for `--resume` to continue an earlier run's rows

