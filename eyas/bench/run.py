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

This module runs the interleaved loop and writes the results; config, load, methods, rows, report and outdir
beside it hold the settings, the loading, the runners, the summaries, the report and the results folder.
"""


from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ..draft import DraftCheckpoint
from ..engine.ngram import describe_ngram
from ..files import atomic_write_json, portable_command
from ..interrupt import Interrupted, StoppedNow, stop_on_signals
from ..target.load import Target
from .config import BENCH_USE, ENGINE_METHODS, WARMUP_TOKENS, BenchConfig, BenchError, check_threads
from .environment import draft_summary, environment
from .load import bench_parts, bench_spec, prompt_ids
from .methods import Output, build_runners, greedy_answer, stop_ids
from .outdir import default_out, prepare_out
from .prompts import BenchPrompt, load_prompts
from .render import plot, render
from .rows import make_row, mark_lossless, summarize
from .vllm_peer import VLLM_METHODS, check_vllm, finish_vllm, reference_specs, run_vllm_phase


def template_warning(w: str | None, progress: bool) -> str | None:
    """A draft trained under another template than this run's: said on stderr and kept in results.json."""
    if w:
        progress_console().print(f"warning: {w}", markup=False, highlight=False, style="yellow")
    return w


def progress_console():
    """Where bench progress goes: stderr, so stdout keeps only the results."""
    from rich.console import Console

    return Console(stderr=True)


def say(progress: bool, msg: str) -> None:
    """One progress line on stderr (setup phases: warm-up, a skipped peer), unless progress is off (--quiet)."""
    if progress:
        progress_console().print(msg, markup=False, highlight=False)


def interleave(prompts: list[BenchPrompt], ids: list[list[int]], runners: dict[str, Callable[..., Output]],
               reference: str | None, max_new_tokens: int, rows_path: Path, done_rows: list[dict[str, Any]],
               progress: bool, what: str, repeat: str | None = None) -> list[dict[str, Any]]:
    """Prompt by prompt, every runner not in `done_rows` (an earlier run's, --resume) on the prompt (the order
    rotates by one per prompt); each finished prompt-method run is appended to rows_path at once (the resume
    unit), and once a prompt's runs are all there every row of it (earlier ones too) is marked lossless or not
    against `reference`. Returns the new rows. `repeat` (plain) runs a second time after the others: its row
    records that run's seconds and whether its tokens were the same, so the run measures its own noise
    (eyas.bench.rows.repeat_spread).

    progress: on a terminal a live bar names the prompt (i/N) and the method running; when stderr is a file or a
    pipe (a logged run, where a live bar would print nothing until the end) one line per finished method run."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    names = list(runners)
    rows: list[dict[str, Any]] = []
    earlier: dict[str, dict[str, dict[str, Any]]] = {}
    for r in done_rows:
        earlier.setdefault(r["prompt"], {})[r["method"]] = r
    todo = [i for i, p in enumerate(prompts) if set(names) - set(earlier.get(p.id, {}))]
    con = progress_console()
    live = progress and con.is_terminal
    lines = progress and not live
    first = len(prompts) - len(todo)  # prompts finished by an earlier run (--resume)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=con, disable=not live, transient=True) as bar:
        task = bar.add_task(what, total=sum(len(set(names) - set(earlier.get(prompts[i].id, {}))) for i in todo))
        for n, i in enumerate(todo):
            p = prompts[i]
            prow = dict(earlier.get(p.id, {}))
            where = f"{what}: prompt {first + n + 1}/{len(prompts)} ({p.id})"
            for m in names[n % len(names):] + names[:n % len(names)]:
                if m in prow:
                    continue
                bar.update(task, description=f"{where} {m}")
                prow[m] = r = make_row(p, m, runners[m](ids[i], max_new_tokens))
                bar.advance(task)
                if lines:
                    con.print(f"{where} {m}: {r['new_tokens']} tokens in {r['seconds']:.1f}s ({r['tok_s']:.1f} "
                              "tok/s)", markup=False, highlight=False)
                if m != repeat:  # the repeated run's row waits for its second run, after the others
                    append_row(rows_path, r)
                    rows.append(r)
            if repeat in prow and "repeat_seconds" not in prow[repeat]:
                r = prow[repeat]
                bar.update(task, description=f"{where} {repeat} (again)")
                again = runners[repeat](ids[i], max_new_tokens)
                r["repeat_seconds"] = round(again.seconds, 6)
                r["repeat_same"] = again.token_ids == r["token_ids"]
                append_row(rows_path, r)
                rows.append(r)
    for p in prompts:  # marks need every run of a prompt, earlier ones included, so they come last
        runs = [r for r in (*earlier.get(p.id, {}).values(), *(r for r in rows if r["prompt"] == p.id))
                if r["method"] in runners]
        if {r["method"] for r in runs} >= set(names):
            mark_lossless(runs, reference)
    return rows


def append_row(path: Path, row: dict[str, Any]) -> None:
    """One finished prompt-method run, on disk before the next starts (a kill loses at most the run going on)."""
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def stopped_line(signal_name: str, out: Path) -> str:
    """What a stopped bench kept, and the command that continues it in the same folder."""
    rows = out / "rows.jsonl"
    kept = sum(1 for line in rows.read_text().splitlines() if line.strip()) if rows.is_file() else 0
    argv = sys.argv[1:]
    more = ([] if "--out" in argv else ["--out", str(out)]) + ([] if "--resume" in argv else ["--resume"])
    again = portable_command([*sys.argv[:1], *argv, *more])
    return (f"eyas bench: stopped by {signal_name}; {kept} finished prompt-method runs are kept in {rows} (the run "
            f"going on is redone). Continue with: {again}" + (f"  (make demo: make demo BENCH_ARGS=\"--out {out} "
                                                               "--resume\")" if "--out" not in argv else ""))


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
    done_rows = prepare_out(cfg, out, target)
    done = {r["prompt"] for r in done_rows}  # prompts with an earlier run (vLLM's phase: those with all its methods)
    runners = build_runners(cfg, target, draft, end_ids, ngram)
    # an optional peer that is not installed is skipped
    cfg.methods = [m for m in cfg.methods if m in runners or m in VLLM_METHODS]
    reference = "plain" if "plain" in cfg.methods else ("hf-greedy" if "hf-greedy" in cfg.methods else None)

    say(progress, f"bench: {len(prompts)} prompts x {len(runners)} methods ({', '.join(runners)}), "
                  f"{cfg.max_new_tokens} new tokens each" + (f"; {len(done)} prompts done earlier" if done else ""))
    say(progress, "bench: " + "; ".join(f"{m}: {bench_spec(cfg, m).describe()}" for m in runners
                                        if m in ENGINE_METHODS and m != "plain"))
    for m, run in runners.items():  # warm-up: allocations, lazy init, kernel selection
        say(progress, f"bench: warm-up {m}")
        run(ids[0], min(cfg.max_new_tokens, WARMUP_TOKENS))
    try:
        with stop_on_signals("bench", at_once=True):
            rows = done_rows + (interleave(prompts, ids, runners, reference, cfg.max_new_tokens, out / "rows.jsonl",
                                           done_rows, progress, "bench", "plain" if cfg.repeat_plain else None)
                                if runners else [])
    except StoppedNow as stop:
        raise Interrupted(stopped_line(stop.signal_name, out)) from None
    vllm_info = None
    if vllm_py is not None:
        vdone = {p.id for p in prompts if {m for m in VLLM_METHODS if m in cfg.methods}
                 <= {r["method"] for r in done_rows if r["prompt"] == p.id}}
        todo = [i for i, p in enumerate(prompts) if p.id not in vdone]
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
        # each eyas method's knobs as they ran (config.tree holds what was given; the device filled in the rest)
        "specs": {m: asdict(bench_spec(cfg, m)) for m in cfg.methods if m in ENGINE_METHODS},
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

