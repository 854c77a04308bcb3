"""One generation per bench method: HF greedy and prompt lookup, the eyas engine, llama.cpp (its Python binding's
`Llama` and its C API); each a runner (input ids, max new tokens) -> Output, timed over the whole call (prefill
included)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..draft import DraftCheckpoint
from ..engine.load import EngineParts, make_engine
from ..engine.ngram import NgramTable
from ..target.device import sync_device
from ..target.load import Target, end_token_ids
from .config import BenchConfig
from .load import bench_spec
from .vllm_peer import VLLM_METHODS


@dataclass
class Output:
    token_ids: list[int]  # content tokens (a trailing end token stripped)
    seconds: float
    target_forwards: int
    finish: str  # "stop" | "length"
    stats: dict[str, Any] | None = None  # eyas GenStats fields
    prefill_s: float | None = None  # peers that can tell: the prompt's forward and the first token (eyas: stats)


def stop_ids(target: Target) -> list[int]:
    """What both HF and eyas stop on: the target's end-of-turn tokens (eyas.target.end_token_ids)."""
    return end_token_ids(target.tokenizer, target.model, "the bench cannot know where a reply ends")


def _strip_end(ids: list[int], end_ids: list[int]) -> tuple[list[int], str | None]:
    if ids and ids[-1] in end_ids:
        return ids[:-1], "stop"
    return ids, None


def hf_runner(target: Target, end_ids: list[int], lookup_tokens: int | None = None) -> Callable[..., Output]:
    """HF `generate` greedy, or prompt-lookup decoding when lookup_tokens is set. Target forwards are
    counted with a forward pre-hook (each verification of a lookup candidate is one forward)."""
    from transformers import GenerationConfig

    model: Any = target.model  # a *ForCausalLM: generate comes from GenerationMixin, not PreTrainedModel
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else end_ids[0]

    @torch.no_grad()
    def run(input_ids: list[int], max_new_tokens: int) -> Output:
        x = torch.tensor([input_ids], device=target.device)
        calls = [0]
        hook = model.register_forward_pre_hook(lambda mod, args: calls.__setitem__(0, calls[0] + 1))
        kw: dict[str, Any] = {"prompt_lookup_num_tokens": lookup_tokens} if lookup_tokens else {}
        # a model's generation_config (repetition penalty, no-repeat n-grams, ...) is merged into every
        # generate call, even one given its own config: swap in a neutral one so this is pure argmax
        saved = model.generation_config
        model.generation_config = GenerationConfig()
        try:
            sync_device(target.device)
            t0 = time.perf_counter()
            out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, temperature=None,
                                 top_p=None, top_k=None, max_new_tokens=max_new_tokens, eos_token_id=end_ids,
                                 pad_token_id=pad, **kw)
            sync_device(target.device)
            dt = time.perf_counter() - t0
        finally:
            hook.remove()
            model.generation_config = saved
        ids, finish = _strip_end(out[0, len(input_ids):].tolist(), end_ids)
        return Output(ids, dt, calls[0], finish or "length")

    return run


def _llama_cpp_absent(method: str, target: Target) -> bool:
    """True, with a one-line note, when llama-cpp-python is not installed or the target is not a GGUF."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print(f"bench: skipping {method}: llama-cpp-python is not installed (make llama-cpp builds it, ~20 min)",
              file=sys.stderr)
        return True
    if target.gguf is None:
        print(f"bench: skipping {method}: {target.source!r} is not a GGUF target", file=sys.stderr)
        return True
    return False


def llama_cpp_runner(target: Target, end_ids: list[int], threads: int | None,
                     n_ctx: int = 4096) -> Callable[..., Output] | None:
    """llama.cpp through llama-cpp-python's high-level `Llama` (logits copied to numpy and sampled in Python each
    step) greedy on the target's own GGUF, fed the same prompt token ids. None when absent (_llama_cpp_absent)."""
    if _llama_cpp_absent("llama-cpp", target):
        return None
    import llama_cpp

    nt = threads or torch.get_num_threads()
    llm = llama_cpp.Llama(model_path=str(target.gguf), n_ctx=n_ctx, n_threads=nt, n_threads_batch=nt,
                          n_batch=512, verbose=False)

    def run(input_ids: list[int], max_new_tokens: int) -> Output:
        llm.reset()
        t0 = time.perf_counter()
        first = None
        out: list[int] = []
        forwards = 0
        for tok in llm.generate(input_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                reset=True):
            first = first or time.perf_counter()
            forwards += 1
            out.append(int(tok))
            if tok in end_ids or len(out) >= max_new_tokens:
                break
        dt = time.perf_counter() - t0
        ids, finish = _strip_end(out, end_ids)
        return Output(ids, dt, forwards, finish or "length", prefill_s=first - t0 if first else None)

    return run


def llama_cpp_c_runner(target: Target, end_ids: list[int], threads: int | None,
                       n_ctx: int = 4096) -> Callable[..., Output] | None:
    """llama.cpp's C API (eyas.bench.llama_c: one llama_decode and one llama_sampler_sample per token, no Python
    sampling) greedy on the target's own GGUF, fed the same prompt token ids; stops on the bench's end ids and on
    llama.cpp's end-of-generation tokens. None when absent (_llama_cpp_absent)."""
    if _llama_cpp_absent("llama-cpp-c", target):
        return None
    from .llama_c import LlamaC

    assert target.gguf is not None  # _llama_cpp_absent: a GGUF target
    llm = LlamaC(target.gguf, threads or torch.get_num_threads(), n_ctx)
    stop = set(end_ids)

    def run(input_ids: list[int], max_new_tokens: int) -> Output:
        g = llm.greedy(input_ids, max_new_tokens, stop)
        ids = g.token_ids[:-1] if g.stopped else g.token_ids  # the end token is not content
        return Output(ids, g.seconds, g.decodes, "stop" if g.stopped else "length", prefill_s=g.prefill_s)

    return run


def engine_runner(engine, end_ids: list[int], device: torch.device) -> Callable[..., Output]:
    from ..engine.params import SamplingParams

    def run(input_ids: list[int], max_new_tokens: int) -> Output:
        sync_device(device)
        t0 = time.perf_counter()
        res = engine.generate(input_ids, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens))
        sync_device(device)
        dt = time.perf_counter() - t0
        ids, _ = _strip_end(list(res.token_ids), end_ids)
        s = res.stats
        stats = {k: getattr(s, k) for k in ("prompt_tokens", "new_tokens", "target_forwards", "rounds", "prefill_s",
                                            "draft_s", "verify_s", "total_s", "accepted_per_depth",
                                            "proposed_per_depth", "lookup_proposed", "lookup_accepted",
                                            "ngram_proposed", "ngram_accepted", "draft_forwards")}
        stats["tau"] = s.tau
        return Output(ids, dt, int(s.target_forwards), res.finish_reason, stats)

    # what --weights auto resolved to is read from it (results["weights"]); a function attribute mypy cannot see
    run.engine = engine  # type: ignore[attr-defined]
    return run


def build_runners(cfg: BenchConfig, target: Target, draft: DraftCheckpoint | None, end_ids: list[int],
                  ngram: NgramTable | None = None) -> dict[str, Callable[..., Output]]:
    runners: dict[str, Callable[..., Output]] = {}
    for m in cfg.methods:
        if m == "hf-greedy":
            runners[m] = hf_runner(target, end_ids)
        elif m == "hf-lookup":
            runners[m] = hf_runner(target, end_ids, lookup_tokens=cfg.lookup_tokens)
        elif m in ("llama-cpp", "llama-cpp-c"):
            run = (llama_cpp_runner if m == "llama-cpp" else llama_cpp_c_runner)(target, end_ids, cfg.threads)
            if run is not None:
                runners[m] = run
        elif m in VLLM_METHODS:
            continue  # vLLM's own process runs these, after the eyas methods (eyas.bench.vllm_peer)
        else:
            engine = make_engine(EngineParts(target, draft, ngram), bench_spec(cfg, m), ngram=m != "lookup-context")
            runners[m] = engine_runner(engine, end_ids, target.device)
    return runners


def greedy_answer(target: Target, end_ids: list[int], max_new_tokens: int) -> Callable[[list[dict]], str]:
    """The target's own greedy reply (HF generate), used as the first turn of MT-bench turn 2."""
    run = hf_runner(target, end_ids)

    def answer(messages: list[dict]) -> str:
        from ..engine.prompt import chat_input_ids

        out = run(list(chat_input_ids(target.tokenizer, messages)), max_new_tokens)
        return target.tokenizer.decode(out.token_ids, skip_special_tokens=True)

    return answer

