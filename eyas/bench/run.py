"""`eyas bench`: Hugging Face baselines and eyas decoding side by side, one process, same prompts, greedy.

Methods: hf-greedy (HF `generate`, do_sample=False), plain / chain / tree (the eyas engine), hf-lookup
(HF prompt-lookup decoding). Every method is warmed up once, then the prompts run interleaved
(prompt 1: every method, prompt 2: every method, ...; the method order rotates by one each prompt) so
machine noise and cache warmth hit all methods alike. Outputs are compared token for token with eyas
plain greedy (the reference; HF greedy is the reference when plain is not run).

Counting: a trailing end-of-turn token is stripped before counting and comparing (HF returns it, and
it is not content); tok/s = content tokens / wall seconds of the whole call (prefill included);
tau = tokens per target forward after the prefill, bonus included (the prefill's token and forward are
not counted, so plain greedy is exactly 1.0), as eyas's GenStats.tau defines it: HF forwards are counted
with a forward hook on the model, eyas methods report theirs in GenStats. Stop tokens: HF and eyas both
stop on the target's end-of-turn tokens (eyas.target.end_token_ids, what the engine stops on).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..draft import DraftCheckpoint
from ..engine.load import EngineOptions, EngineParts, EngineUse, check_options, load_parts, make_engine
from ..engine.ngram import NgramTable, describe_ngram
from ..engine.params import LOOKUP_ALONE, SpecParams
from ..errors import EyasError
from ..files import atomic_write, atomic_write_json
from ..target.convert import file_fingerprint
from ..target.device import sync_device
from ..target.load import Target, end_token_ids
from ..target.template import ChatTemplate, raw_ids, resolve_template
from ..text import parse_int_list as parse_ints
from .prompts import BenchPrompt, load_prompts
from .vllm_peer import VLLM_METHODS, check_vllm, finish_vllm, reference_specs, render_vllm, run_vllm_phase
from .vllm_peer import accept_rates as vllm_accept_rates

METHODS = ("hf-greedy", "plain", "chain", "tree", "tree-lookup", "lookup", "lookup-context", "hf-lookup")
OPTIONAL_METHODS = ("llama-cpp",)  # peers outside the default install: asked for by name, skipped when absent
ENGINE_METHODS = ("plain", "chain", "tree", "tree-lookup", "lookup", "lookup-context")
DRAFT_METHODS = ("chain", "tree", "tree-lookup")  # tree-lookup: the EAGLE-3 tree with lookup candidates merged in
# lookup: the lookup chain alone, with the n-gram table where the context has no match (as `eyas generate --method
# lookup`); lookup-context: the same without the table, to measure what the table adds in one run
LOOKUP_METHODS = ("lookup", "lookup-context")
SPEC_METHODS = (*DRAFT_METHODS, *LOOKUP_METHODS)  # speculative, so checked lossless
HF_METHODS = ("hf-greedy", "hf-lookup")
PEER_METHODS = (*HF_METHODS, "llama-cpp")  # other engines: compared for speed, not expected to be token-identical
WARMUP_TOKENS = 16
SKIP_SPEC = "--methods hf-greedy,plain,hf-lookup to skip the speculative methods"  # a run without a draft
# the closest path for a target the engine forward cannot run
HF_ONLY = "bench's HF baselines run on it alone with --methods hf-greedy,hf-lookup"
BENCH_USE = EngineUse(f"bench's eyas methods ({', '.join(ENGINE_METHODS)})", HF_ONLY, SKIP_SPEC)


class BenchError(EyasError):
    pass


# ---- configuration -------------------------------------------------------------------------------

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
    weights: str = "auto"  # eyas methods' target forward (eyas.model.engine_model)
    draft_weights: str = "auto"  # the draft's matrices (eyas.engine.SpecParams.draft_weights)
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    steps: int = 4  # chain
    depth: int = 4  # tree
    topk: int = 4
    tokens: int = 16
    lookup_tokens: int = 10  # HF prompt_lookup_num_tokens
    lookup: int = 8  # tree-lookup: lookup candidates merged into the EAGLE-3 tree per round
    lookup_alone: int = LOOKUP_ALONE  # method lookup: the chain's length
    ngram: str = "auto"  # the n-gram table of lookup and tree-lookup (eyas.ngram.resolve_ngram)
    min_prob: float = 0.0  # chain/tree: verify only candidates with at least this cumulative draft probability
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
RESUME_KEYS = ("bench", "limit", "turn", "max_new_tokens", "target", "draft", "dtype", "device", "weights",
               "draft_weights", "methods",
               "steps", "depth", "topk", "tokens", "lookup_tokens", "lookup", "lookup_alone", "ngram", "min_prob",
               "chat_template", "raw", "vllm_k")
SWEEP_RESUME_KEYS = ("bench", "limit", "turn", "max_new_tokens", "target", "draft", "dtype", "device", "weights",
                     "sweep_limit", "grid", "chat_template", "raw")


# ---- draft ---------------------------------------------------------------------------------------

def draft_summary(ckpt: DraftCheckpoint | None, spec: str) -> dict[str, Any] | None:
    if ckpt is None:
        return None
    m = ckpt.manifest
    c = ckpt.model.config
    weights = ckpt.path / "model.safetensors" if ckpt.path else None
    trained_record = any(k in m for k in ("training", "train", "train_config", "metrics"))
    untrained = bool(m.get("untrained", False))
    return {
        "spec": spec,
        "path": str(ckpt.path) if ckpt.path else None,
        "untrained": untrained,
        "status": ("UNTRAINED (random weights): speed and acceptance numbers are meaningless" if untrained
                   else "trained" if trained_record else "no training record in the manifest"),
        "note": m.get("note"),
        "fingerprint": file_fingerprint([weights]) if weights and weights.exists() else None,
        "aux_indices": ckpt.layout.aux_indices,
        "hidden_size": c.hidden_size,
        "draft_vocab_size": c.draft_vocab_size,
        "manifest_keys": sorted(m),
    }


# ---- one generation per method -------------------------------------------------------------------

@dataclass
class Output:
    token_ids: list[int]  # content tokens (a trailing end token stripped)
    seconds: float
    target_forwards: int
    finish: str  # "stop" | "length"
    stats: dict[str, Any] | None = None  # eyas GenStats fields


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

    model = target.model
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


def llama_cpp_runner(target: Target, end_ids: list[int], threads: int | None,
                     n_ctx: int = 4096) -> Callable[..., Output] | None:
    """llama.cpp (llama-cpp-python, `make llama-cpp`) greedy on the target's own GGUF, fed the same prompt
    token ids. None, with a one-line note, when it is not installed or the target is not a GGUF."""
    try:
        import llama_cpp
    except ImportError:
        print("bench: skipping llama-cpp: llama-cpp-python is not installed (make llama-cpp builds it, ~20 min)",
              file=sys.stderr)
        return None
    if target.gguf is None:
        print(f"bench: skipping llama-cpp: {target.source!r} is not a GGUF target", file=sys.stderr)
        return None
    nt = threads or torch.get_num_threads()
    llm = llama_cpp.Llama(model_path=str(target.gguf), n_ctx=n_ctx, n_threads=nt, n_threads_batch=nt,
                          n_batch=512, verbose=False)

    def run(input_ids: list[int], max_new_tokens: int) -> Output:
        llm.reset()
        t0 = time.perf_counter()
        out: list[int] = []
        forwards = 0
        for tok in llm.generate(input_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                reset=True):
            forwards += 1
            out.append(int(tok))
            if tok in end_ids or len(out) >= max_new_tokens:
                break
        dt = time.perf_counter() - t0
        ids, finish = _strip_end(out, end_ids)
        return Output(ids, dt, forwards, finish or "length")

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

    run.engine = engine  # what --weights auto resolved to is read from it (results["weights"])
    return run


# ---- rows and summaries --------------------------------------------------------------------------

def first_diff(a: list[int], b: list[int]) -> int | None:
    """First position where two token lists differ (the shorter length if one is a prefix); None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def make_row(p: BenchPrompt, method: str, o: Output) -> dict[str, Any]:
    row: dict[str, Any] = {
        "prompt": p.id, "category": p.category, "method": method, "new_tokens": len(o.token_ids),
        "seconds": round(o.seconds, 6), "tok_s": len(o.token_ids) / o.seconds if o.seconds > 0 else 0.0,
        "target_forwards": o.target_forwards, "finish": o.finish, "token_ids": o.token_ids,
    }
    if o.stats is not None:
        row["stats"] = o.stats
        row["tau"] = o.stats["tau"]
    else:  # GenStats.tau's definition: tokens after the prefill's (an end token included) per later forward
        generated = len(o.token_ids) + (1 if o.finish == "stop" else 0)
        row["tau"] = (generated - 1) / (o.target_forwards - 1) if o.target_forwards > 1 else None
    return row


def mark_lossless(rows: list[dict[str, Any]], reference: str | None) -> None:
    """Set same_as_ref / first_diff on every row of one prompt (rows of all methods)."""
    ref = next((r for r in rows if r["method"] == reference), None)
    for r in rows:
        if ref is None or r["method"] == reference:
            r["same_as_ref"], r["first_diff"] = None, None
        else:
            d = first_diff(ref["token_ids"], r["token_ids"])
            r["same_as_ref"], r["first_diff"] = d is None, d


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    tokens = sum(r["new_tokens"] for r in rows)
    secs = sum(r["seconds"] for r in rows)
    s: dict[str, Any] = {"prompts": len(rows), "new_tokens": tokens, "seconds": round(secs, 4),
                         "tok_s": tokens / secs if secs > 0 else 0.0}
    stats = [r["stats"] for r in rows if "stats" in r]
    if stats:  # eyas: tau over all rounds, acceptance per depth pooled over prompts
        rounds = sum(st["rounds"] for st in stats)
        s["tau"] = sum(st["new_tokens"] - 1 for st in stats) / rounds if rounds else None
        depth = max(len(st["proposed_per_depth"]) for st in stats)
        acc = [sum(st["accepted_per_depth"][d] for st in stats if d < len(st["accepted_per_depth"]))
               for d in range(depth)]
        prop = [sum(st["proposed_per_depth"][d] for st in stats if d < len(st["proposed_per_depth"]))
                for d in range(depth)]
        s["accept_per_depth"] = [a / p if p else None for a, p in zip(acc, prop, strict=True)]
        draft_s = sum(st["draft_s"] for st in stats)
        round_s = sum(st["total_s"] - st["prefill_s"] for st in stats)
        s["draft_s"] = round(draft_s, 4)
        # tokens accepted from lookup-only tree nodes: tau minus this share is what EAGLE-3 alone accepted
        s["lookup_accepted"] = sum(st.get("lookup_accepted", 0) for st in stats)
        s["lookup_share"] = s["lookup_accepted"] / max(sum(st["new_tokens"] for st in stats), 1)
        s["ngram_accepted"] = sum(st.get("ngram_accepted", 0) for st in stats)
        s["ngram_proposed"] = sum(st.get("ngram_proposed", 0) for st in stats)
        s["ngram_share"] = s["ngram_accepted"] / max(sum(st["new_tokens"] for st in stats), 1)
        s["draft_overhead"] = draft_s / round_s if round_s > 0 and depth else None
    else:
        fwd = sum(r["target_forwards"] - 1 for r in rows)
        gen = sum(r["new_tokens"] + (r["finish"] == "stop") - 1 for r in rows)
        s["tau"] = gen / fwd if fwd else None
        s["accept_per_depth"] = vllm_accept_rates(rows)  # vllm-eagle3: from vLLM's own counters; else None
        s["draft_overhead"] = None
    compared = [r for r in rows if r.get("same_as_ref") is not None]
    s["identical"] = sum(bool(r["same_as_ref"]) for r in compared)
    s["compared"] = len(compared)
    s["mismatches"] = [{"prompt": r["prompt"], "first_diff": r["first_diff"]} for r in compared
                       if not r["same_as_ref"]]
    return s


def summarize(rows: list[dict[str, Any]], methods: list[str]) -> dict[str, Any]:
    """{"methods": {m: summary}, "categories": {cat: {m: summary}}} with speedups vs HF greedy and plain."""

    def block(sub: list[dict[str, Any]]) -> dict[str, Any]:
        out = {m: _summary([r for r in sub if r["method"] == m]) for m in methods}
        for base, key in (("hf-greedy", "speedup_vs_hf"), ("plain", "speedup_vs_plain")):
            b = out.get(base, {}).get("tok_s")
            for s in out.values():
                s[key] = s["tok_s"] / b if b else None
        return out

    cats = sorted({r["category"] for r in rows})
    return {"methods": block(rows), "categories": {c: block([r for r in rows if r["category"] == c]) for c in cats}}


# ---- output --------------------------------------------------------------------------------------

def environment(target: Target) -> dict[str, Any]:
    import transformers

    dev = target.device
    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "platform": platform.platform(), "threads": torch.get_num_threads(), "device": str(dev),
           "dtype": str(target.dtype).replace("torch.", ""), "cpu": _cpu_name(), "cpu_count": os.cpu_count(),
           # other work on the machine skews tok/s: the load when the results were written says how much
           "loadavg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None}
    if dev.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(dev)
    try:
        env["eyas_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                            cwd=Path(__file__).parent, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["eyas_commit"] = None
    return env


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def fmt(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "n/a" if x is None else f"{x:{spec}}{suffix}"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summ = results["summary"]["methods"]
    cfg = results["config"]
    methods = list(summ)
    setting = {"chain": f"steps {cfg['steps']}", "tree": f"d{cfg['depth']} k{cfg['topk']} t{cfg['tokens']}",
               "tree-lookup": f"d{cfg['depth']} k{cfg['topk']} t{cfg['tokens']} +{cfg.get('lookup', 0)}",
               "lookup": f"{cfg.get('lookup_alone', 0)} tokens" + (" + table" if results.get("ngram") else ""),
               "lookup-context": f"{cfg.get('lookup_alone', 0)} tokens", "hf-lookup": f"{cfg['lookup_tokens']} tokens",
               "vllm-eagle3": f"k {(results.get('vllm') or {}).get('k')}"}
    ticks = [f"{m}\n{setting[m]}" if m in setting else m for m in methods]
    toks = [summ[m]["tok_s"] for m in methods]
    base = "speedup_vs_hf" if "hf-greedy" in summ else "speedup_vs_plain"
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    bars = a.bar(ticks, toks, color=["#888888" if m in HF_METHODS + VLLM_METHODS else "#2a6fb0"
                                     for m in methods])
    for bar, m in zip(bars, methods, strict=True):
        sp = summ[m].get(base)
        a.annotate(fmt(sp, ".2f", "x"), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                   ha="center", va="bottom", fontsize=9)
    a.set_ylabel("tokens / s")
    a.set_title(f"throughput (speedup vs {'HF greedy' if base == 'speedup_vs_hf' else 'eyas plain'})")
    taus = [summ[m]["tau"] or 0.0 for m in methods]
    bars = b.bar(ticks, taus, color="#4f9a5a")
    for bar, m in zip(bars, methods, strict=True):
        b.annotate(fmt(summ[m]["tau"]), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                   ha="center", va="bottom", fontsize=9)
    b.set_ylabel("tokens per target forward (tau)")
    b.set_title("tau")
    env = results["environment"]
    draft = results.get("draft") or {}
    flag = " — UNTRAINED draft" if draft.get("untrained") else ""
    fig.suptitle(f"{cfg['bench']} x{results['num_prompts']}, {cfg['max_new_tokens']} new tokens, "
                 f"{results['target']['name']} {env['dtype']} on {env['device']} ({env['threads']} threads){flag}",
                 fontsize=10)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)


def wide_console():
    from rich.console import Console

    con = Console()
    if not con.is_terminal:  # piped or logged: do not squeeze the tables into 80 columns
        con.width = 150
    return con


def render(results: dict[str, Any]) -> None:
    from rich.table import Table

    con = wide_console()
    summ = results["summary"]["methods"]
    ref = results["reference"]
    draft = results.get("draft") or {}
    title = f"eyas bench: {results['config']['bench']} x{results['num_prompts']} prompts"
    if draft.get("untrained"):
        title += " [red](UNTRAINED draft: numbers meaningless)[/red]"
    t = Table(title=title)
    for col in ("method", "tok/s", "vs HF greedy", "vs plain", "tau", "accept per depth", "draft overhead",
                f"= {ref or 'ref'}"):
        t.add_column(col, justify="left" if col in ("method", "accept per depth") else "right")
    for m, s in summ.items():
        acc = " ".join(fmt(a, ".2f") for a in s["accept_per_depth"]) if s["accept_per_depth"] else "-"
        same = "ref" if m == ref else (f"{s['identical']}/{s['compared']}" if s["compared"] else "n/a")
        t.add_row(m, f"{s['tok_s']:.1f}", fmt(s["speedup_vs_hf"], ".2f", "x"), fmt(s["speedup_vs_plain"], ".2f", "x"),
                  fmt(s["tau"]), acc, fmt(s["draft_overhead"], ".0%"), same)
    con.print(t)
    cats = results["summary"]["categories"]
    if len(cats) > 1:
        ct = Table(title="tok/s per category (speedup vs HF greedy)")
        ct.add_column("category")
        for m in summ:
            ct.add_column(m, justify="right")
        for c, block in cats.items():
            ct.add_row(c, *[f"{block[m]['tok_s']:.1f} ({fmt(block[m]['speedup_vs_hf'], '.2f', 'x')})"
                            for m in summ])
        con.print(ct)
    for m, s in summ.items():
        if m in PEER_METHODS and s["compared"]:
            con.print(f"{m}: {s['identical']}/{s['compared']} prompts token-identical to {ref} (another engine's "
                      "numerics; not a lossless check)")
            continue
        if m in VLLM_METHODS:
            continue  # compared with eyas fp32 plain, not with ref: render_vllm says so
        for mm in s["mismatches"]:
            con.print(f"[yellow]{m} differs from {ref} on {mm['prompt']} at token {mm['first_diff']}[/yellow]")
    for m, s in summ.items():
        if m in SPEC_METHODS and s["compared"]:
            ok = s["identical"] == s["compared"]
            extra = f", {s['lookup_share']:.0%} of tokens from lookup candidates" if s.get("lookup_accepted") else ""
            if s.get("ngram_proposed"):
                extra += (f", {s['ngram_share']:.0%} from the n-gram table ({s['ngram_accepted']} of "
                          f"{s['ngram_proposed']} accepted)")
            con.print(f"{m}: lossless: {'yes' if ok else '[red]NO[/red]'} ({s['identical']}/{s['compared']} prompts "
                      f"token-identical to {ref}); tau {fmt(s['tau'])}{extra}")
    used = results.get("weights") or {}
    for w in sorted({(v["target"], v["note"]) for v in used.values()}, key=str):
        con.print(f"weights: target {w[0]} for {', '.join(m for m, v in used.items() if (v['target'], v['note']) == w)}"
                  + (f" (--weights auto: {w[1]})" if w[1] else ""))
    if results.get("vllm"):
        render_vllm(results["vllm"], con)
    con.print(f"results: {results['out']}")


# ---- the run -------------------------------------------------------------------------------------

def default_out(prefix: str = "bench") -> Path:
    return Path("runs") / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}"


def build_runners(cfg: BenchConfig, target: Target, draft: DraftCheckpoint | None, end_ids: list[int],
                  ngram: NgramTable | None = None) -> dict[str, Callable[..., Output]]:
    runners: dict[str, Callable[..., Output]] = {}
    for m in cfg.methods:
        if m == "hf-greedy":
            runners[m] = hf_runner(target, end_ids)
        elif m == "hf-lookup":
            runners[m] = hf_runner(target, end_ids, lookup_tokens=cfg.lookup_tokens)
        elif m == "llama-cpp":
            run = llama_cpp_runner(target, end_ids, cfg.threads)
            if run is not None:
                runners[m] = run
        elif m in VLLM_METHODS:
            continue  # vLLM's own process runs these, after the eyas methods (eyas.bench.vllm_peer)
        else:
            engine = make_engine(EngineParts(target, draft, ngram), bench_spec(cfg, m), ngram=m != "lookup-context")
            runners[m] = engine_runner(engine, end_ids, target.device)
    return runners


def bench_options(cfg: BenchConfig) -> EngineOptions:
    """The engine options of a bench run (its tree settings already resolved by the CLI)."""
    return EngineOptions(target=cfg.target, draft=cfg.draft, steps=cfg.steps, depth=cfg.depth, topk=cfg.topk,
                         tokens=cfg.tokens, lookup=cfg.lookup, min_prob=cfg.min_prob, ngram=cfg.ngram,
                         weights=cfg.weights, draft_weights=cfg.draft_weights, dtype=cfg.dtype, device=cfg.device,
                         chat_template=cfg.chat_template, raw=cfg.raw)


def bench_spec(cfg: BenchConfig, m: str) -> SpecParams:
    """An eyas method's engine spec: tree-lookup is the tree with --lookup candidates merged in, tree and chain
    merge none, lookup and lookup-context run the chain of lookup_alone tokens; min-prob for the draft's."""
    method = {"tree-lookup": "tree", "lookup-context": "lookup"}.get(m, m)
    lookup = cfg.lookup if m == "tree-lookup" else cfg.lookup_alone if method == "lookup" else 0
    return SpecParams(method=method, steps=cfg.steps, depth=cfg.depth, topk=cfg.topk, tokens=cfg.tokens,
                      lookup=lookup, weights=cfg.weights, draft_weights=cfg.draft_weights,
                      min_prob=cfg.min_prob if m in DRAFT_METHODS else 0.0)


def bench_template(cfg: BenchConfig, prompts: list[BenchPrompt] | None) -> ChatTemplate:
    """--chat-template / --raw, checked before anything loads: raw sends single-turn prompts only."""
    choice = resolve_template(cfg.chat_template, cfg.raw)
    if choice.raw:
        if cfg.turn != 1:
            raise BenchError("--raw sends one plain-text prompt, but MT-bench --turn 2 is a chat (it holds the first "
                             "answer): use --turn 1, or drop --raw and pass --chat-template NAME")
        multi = [p.id for p in prompts or [] if len(p.messages) != 1]
        if multi:
            raise BenchError(f"--raw sends each prompt's text as is, but prompts {multi[:3]} are multi-message chats; "
                             "give single-turn rows ({\"prompt\": ...}), or drop --raw and pass --chat-template NAME")
    return choice


def bench_parts(cfg: BenchConfig, prompts: list[BenchPrompt] | None, specs: list[SpecParams], use: EngineUse,
                target: Target | None, draft: DraftCheckpoint | None, *, validate: bool = True,
                ngram: bool | None = None) -> EngineParts:
    """Every engine option checked before anything loads (eyas.engine.load), then the target unless given (with
    the template installed), the draft unless given, and the n-gram table; the template warning is said."""
    choice = bench_template(cfg, prompts)
    opts = bench_options(cfg)
    check_options(opts, use, specs, validate=validate, target_loaded=target is not None,
                  draft_loaded=draft is not None)
    return load_parts(opts, use, choice, specs, target=target, draft=draft, ngram=ngram)


def prompt_ids(target: Target, prompts: list[BenchPrompt]) -> list[list[int]]:
    """Each prompt's token ids: through the installed chat template, or as plain text under --raw."""
    from ..engine.decode import chat_input_ids

    if target.chat_template is not None and target.chat_template.raw:
        return [raw_ids(target.tokenizer, p.messages[0]["content"]) for p in prompts]
    return [list(chat_input_ids(target.tokenizer, p.messages)) for p in prompts]


def template_warning(w: str | None, progress: bool) -> str | None:
    """A draft trained under another template than this run's: said on stderr and kept in results.json."""
    if w:
        progress_console().print(f"warning: {w}", markup=False, highlight=False, style="yellow")
    return w


def greedy_answer(target: Target, end_ids: list[int], max_new_tokens: int) -> Callable[[list[dict]], str]:
    """The target's own greedy reply (HF generate), used as the first turn of MT-bench turn 2."""
    run = hf_runner(target, end_ids)

    def answer(messages: list[dict]) -> str:
        from ..engine.decode import chat_input_ids

        out = run(list(chat_input_ids(target.tokenizer, messages)), max_new_tokens)
        return target.tokenizer.decode(out.token_ids, skip_special_tokens=True)

    return answer


def _load_rows(path: Path, methods: list[str]) -> list[dict[str, Any]]:
    """Rows of prompts that finished every method; a torn last line (a kill mid-write) is dropped."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    done = {p for p in {r["prompt"] for r in rows} if {r["method"] for r in rows if r["prompt"] == p} >= set(methods)}
    return [r for r in rows if r["prompt"] in done]


def _prepare_out(cfg: BenchConfig, out: Path, target: Target, keys: tuple[str, ...] = RESUME_KEYS,
                 methods: list[str] | None = None) -> list[dict[str, Any]]:
    """Create `out`, or continue it with --resume; returns the rows already done (whole prompts only)."""
    rows_path, cfg_path = out / "rows.jsonl", out / "config.json"
    if out.exists() and not out.is_dir():
        raise BenchError(f"--out {out} is a file; expected a results folder (new, or an earlier run's to --resume)")
    me = {**{k: cfg.to_dict()[k] for k in keys}, "target_fingerprint": target.identity.fingerprint}
    if rows_path.exists() and rows_path.stat().st_size > 0:
        if not cfg.resume:
            raise BenchError(f"{out} already holds rows of a bench run; pass --resume to continue it, or another --out")
        try:
            old = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        except json.JSONDecodeError as e:
            raise BenchError(f"--resume {out}: {cfg_path} is not valid JSON ({e}), so the earlier run's settings "
                             "are unknown; start over in another --out") from e
        diff = [f"{k}: {old.get(k)!r} there, {v!r} now" for k, v in me.items() if old.get(k) != v]
        if diff:
            raise BenchError(f"--resume {out}: the run there used other settings ({'; '.join(diff)}); "
                             "rerun with the same settings or choose another --out")
        rows = _load_rows(rows_path, methods or cfg.methods)
        rows_path.write_text("".join(json.dumps(r) + "\n" for r in rows))  # drop partial prompts
        return rows
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(cfg_path, me)
    rows_path.write_text("")
    return []


def progress_console():
    """Where bench progress goes: stderr, so stdout keeps only the results."""
    from rich.console import Console

    return Console(stderr=True)


def say(progress: bool, msg: str) -> None:
    """One progress line on stderr (setup phases: warm-up, a skipped peer), unless progress is off (--quiet)."""
    if progress:
        progress_console().print(msg, markup=False, highlight=False)


def interleave(prompts: list[BenchPrompt], ids: list[list[int]], runners: dict[str, Callable[..., Output]],
               reference: str | None, max_new_tokens: int, rows_path: Path, done: set[str],
               progress: bool, what: str) -> list[dict[str, Any]]:
    """Prompt by prompt, every runner on the prompt (the order rotates by one per prompt), lossless marks
    against `reference`; each prompt's rows are appended to rows_path in one write (resume unit).

    progress: on a terminal a live bar names the prompt (i/N) and the method running; when stderr is a file or a
    pipe (a logged run, where a live bar would print nothing until the end) one line per finished method run."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    names = list(runners)
    rows: list[dict[str, Any]] = []
    todo = [i for i, p in enumerate(prompts) if p.id not in done]
    con = progress_console()
    live = progress and con.is_terminal
    lines = progress and not live
    first = len(prompts) - len(todo)  # prompts finished by an earlier run (--resume)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=con, disable=not live, transient=True) as bar:
        task = bar.add_task(what, total=len(todo) * len(names))
        for n, i in enumerate(todo):
            p = prompts[i]
            prow = {}
            where = f"{what}: prompt {first + n + 1}/{len(prompts)} ({p.id})"
            for m in names[n % len(names):] + names[:n % len(names)]:
                bar.update(task, description=f"{where} {m}")
                prow[m] = make_row(p, m, runners[m](ids[i], max_new_tokens))
                bar.advance(task)
                if lines:
                    r = prow[m]
                    con.print(f"{where} {m}: {r['new_tokens']} tokens in {r['seconds']:.1f}s ({r['tok_s']:.1f} "
                              "tok/s)", markup=False, highlight=False)
            prow_list = [prow[m] for m in names]
            mark_lossless(prow_list, reference)
            with open(rows_path, "a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in prow_list))
                f.flush()
                os.fsync(f.fileno())
            rows += prow_list
    return rows


def run_bench(cfg: BenchConfig, target: Target | None = None, draft: DraftCheckpoint | None = None,
              progress: bool = True, show: bool = True) -> dict[str, Any]:
    """Run the side-by-side benchmark; writes results.json, rows.jsonl and bench.png into cfg.out."""
    check_threads(cfg.threads)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.max_new_tokens < 1:
        raise BenchError(f"--max-new-tokens must be >= 1, got {cfg.max_new_tokens}")
    prompts = load_prompts(cfg.bench, cfg.limit) if cfg.turn == 1 else None  # bad input fails before any load
    vllm_py = check_vllm(cfg.methods, cfg.vllm_python)  # no vLLM: one line naming `make vllm`, before any load
    # the vllm methods' eyas fp32 reference engines are checked and their draft loaded like the eyas methods'
    specs = [bench_spec(cfg, m) for m in cfg.methods if m in ENGINE_METHODS] + reference_specs(cfg)
    parts = bench_parts(cfg, prompts, specs, BENCH_USE, target, draft,
                        ngram=bool({"lookup", "tree-lookup"} & set(cfg.methods)))
    target, draft, ngram = parts.target, parts.draft, parts.ngram
    mismatch = template_warning(parts.template_warning, progress)
    end_ids = stop_ids(target)
    if prompts is None:
        prompts = load_prompts(cfg.bench, cfg.limit, cfg.turn, greedy_answer(target, end_ids, cfg.max_new_tokens))
    ids = prompt_ids(target, prompts)
    out = Path(cfg.out) if cfg.out else default_out()
    done_rows = _prepare_out(cfg, out, target)
    done = {r["prompt"] for r in done_rows}
    runners = build_runners(cfg, target, draft, end_ids, ngram)
    # an optional peer that is not installed is skipped
    cfg.methods = [m for m in cfg.methods if m in runners or m in VLLM_METHODS]
    reference = "plain" if "plain" in cfg.methods else ("hf-greedy" if "hf-greedy" in cfg.methods else None)

    say(progress, f"bench: {len(prompts)} prompts x {len(runners)} methods ({', '.join(runners)}), "
                  f"{cfg.max_new_tokens} new tokens each" + (f"; {len(done)} prompts done earlier" if done else ""))
    for m, run in runners.items():  # warm-up: allocations, lazy init, kernel selection
        say(progress, f"bench: warm-up {m}")
        run(ids[0], min(cfg.max_new_tokens, WARMUP_TOKENS))
    rows = done_rows + (interleave(prompts, ids, runners, reference, cfg.max_new_tokens, out / "rows.jsonl", done,
                                   progress, "bench") if runners else [])
    vllm_info = None
    if vllm_py is not None:
        todo = [i for i, p in enumerate(prompts) if p.id not in done]
        vouts, vllm_info = run_vllm_phase(cfg, vllm_py, target, draft, end_ids, prompts, ids, todo, out,
                                          lambda s: say(progress, s))
        vrows = [{**make_row(o["prompt"], o["method"], Output(o["token_ids"], o["seconds"], o["target_forwards"],
                                                             o["finish"])), "vllm": o["vllm"]} for o in vouts]
        rows += vrows
        vllm_info = finish_vllm(cfg, target, draft, end_ids, prompts, ids, runners, rows, vllm_info,
                                lambda s: say(progress, s))
        with open(out / "rows.jsonl", "a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in vrows))
    rows.sort(key=lambda r: ([p.id for p in prompts].index(r["prompt"]), cfg.methods.index(r["method"])))
    results = {
        "kind": "eyas-bench", "format_version": 1, "out": str(out), "command": " ".join(sys.argv),
        "config": cfg.to_dict(),
        "environment": environment(target), "target": {**target.identity.to_dict(), "source": target.source},
        "draft": draft_summary(draft, cfg.draft), "ngram": describe_ngram(ngram, cfg.ngram), "stop_ids": end_ids,
        "reference": reference,
        "chat_template": target.chat_template.record(), "template_warning": mismatch,
        "num_prompts": len(prompts), "prompts": [asdict(p) for p in prompts],
        "summary": summarize(rows, cfg.methods), "rows": rows,
        "vllm": vllm_info,  # vLLM's version, k, draft export, reference, wiring (eyas.bench.vllm_peer)
        # per eyas method: the weights mode that ran (auto resolves per target) and why auto did not run native
        "weights": {m: {"target": r.engine.weights, "draft": r.engine.draft_weights, "note": r.engine.weights_note}
                    for m, r in runners.items() if hasattr(r, "engine")},
    }
    atomic_write_json(out / "results.json", results)
    plot(results, out / "bench.png")
    if show:
        render(results)
    return results
