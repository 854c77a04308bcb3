"""`eyas bench --sweep`: every chain/tree setting of a grid on a few prompts, interleaved with plain greedy as
the reference; reports the fastest lossless setting and the command that uses it (sweep.json + sweep.png)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..draft import DraftCheckpoint
from ..engine.load import EngineUse, make_engine
from ..engine.ngram import describe_ngram
from ..engine.params import EngineError, SpecParams, TreeSettings
from ..files import atomic_write, atomic_write_json
from ..target.load import Target
from .config import HF_ONLY, SKIP_SPEC, WARMUP_TOKENS, BenchConfig, SweepGrid, check_threads
from .environment import draft_summary, environment
from .load import bench_parts, prompt_ids
from .methods import Output, engine_runner, greedy_answer, stop_ids
from .outdir import SWEEP_RESUME_KEYS, default_out, prepare_out
from .prompts import load_prompts
from .render import fmt, wide_console
from .rows import summarize
from .run import interleave, say, template_warning

SWEEP_USE = EngineUse("bench --sweep", f"without --sweep, {HF_ONLY}", SKIP_SPEC)


def sweep_settings(grid: SweepGrid) -> list[dict[str, Any]]:
    """Every chain steps value and every tree (depth, topk, tokens) combination, unfiltered: the engine
    decides which are invalid, and those are reported as refused, never adjusted."""
    out = [{"method": "chain", "steps": s} for s in grid.steps]
    out += [{"method": "tree", "depth": d, "topk": k, "tokens": t, **({"lookup": n} if n else {})}
            for d in grid.depth for k in grid.topk for t in grid.tokens for n in grid.lookup]
    return out


def sweep_spec(setting: dict[str, Any], cfg: BenchConfig) -> SpecParams:
    """A grid setting's engine spec: exactly the knobs the setting names, no lookup unless it names some and no
    min-prob (the grid measures the tree shapes themselves)."""
    knobs = {k: v for k, v in setting.items() if k != "method"}
    tree = TreeSettings(**{"lookup": 0, "min_prob": 0.0, **knobs})
    return tree.spec(setting["method"], None, weights=cfg.weights, draft_weights=cfg.draft_weights)


def setting_label(s: dict[str, Any]) -> str:
    if s["method"] == "chain":
        return f"chain steps={s['steps']}"
    if s["method"] == "tree":
        extra = f" lookup={s['lookup']}" if s.get("lookup") else ""
        return f"tree depth={s['depth']} topk={s['topk']} tokens={s['tokens']}{extra}"
    return s["method"]


def setting_flags(s: dict[str, Any]) -> str:
    """The setting as `eyas bench`/`eyas generate` flags (bench takes --methods, generate --method)."""
    if s["method"] == "chain":
        return f"--steps {s['steps']}"
    extra = f" --lookup {s['lookup']}" if s.get("lookup") else ""
    return f"--depth {s['depth']} --topk {s['topk']} --tokens {s['tokens']}{extra}"


def plot_sweep(results: dict[str, Any], path: Path, top: int = 25) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = sorted(results["settings"], key=lambda r: -r["tok_s"])[:top]
    labels = [r["label"] for r in ok]
    fig, ax = plt.subplots(figsize=(10, 0.32 * len(ok) + 1.6))
    bars = ax.barh(labels[::-1], [r["tok_s"] for r in ok][::-1],
                   color=["#888888" if r["method"] == "plain" else "#2a6fb0" for r in ok][::-1])
    for bar, r in zip(bars, ok[::-1], strict=True):
        ax.annotate(f" {fmt(r['speedup_vs_plain'], '.2f', 'x')}  tau {fmt(r['tau'])}",
                    (bar.get_width(), bar.get_y() + bar.get_height() / 2), va="center", fontsize=8)
    ax.set_xlabel("tokens / s (speedup vs eyas plain, tau)")
    flag = " — UNTRAINED draft" if (results.get("draft") or {}).get("untrained") else ""
    ax.set_title(f"sweep: fastest {len(ok)} of {len(results['settings'])} settings, {results['num_prompts']} prompts"
                 f"{flag}", fontsize=10)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)


def render_sweep(results: dict[str, Any]) -> None:
    from rich.table import Table

    con = wide_console()
    title = f"eyas bench --sweep: {results['num_prompts']} prompts, {results['config']['max_new_tokens']} new tokens"
    if (results.get("draft") or {}).get("untrained"):
        title += " [red](UNTRAINED draft)[/red]"
    t = Table(title=title)
    for col in ("setting", "tok/s", "vs plain", "tau", "accept per depth", "draft overhead", "= plain"):
        t.add_column(col, justify="left" if col in ("setting", "accept per depth") else "right")
    for r in sorted(results["settings"], key=lambda r: -r["tok_s"]):
        acc = " ".join(fmt(a, ".2f") for a in r["accept_per_depth"]) if r["accept_per_depth"] else "-"
        same = f"{r['identical']}/{r['compared']}" if r["compared"] else "ref"
        t.add_row(r["label"], f"{r['tok_s']:.1f}", fmt(r["speedup_vs_plain"], ".2f", "x"), fmt(r["tau"]), acc,
                  fmt(r["draft_overhead"], ".0%"), same)
    con.print(t)
    if results["refused"]:
        con.print(f"{len(results['refused'])} settings refused by the engine (see sweep.json), e.g. "
                  f"{results['refused'][0]['label']}: {results['refused'][0]['error']}")
    best = results["best"]
    if best:
        con.print(f"[bold]fastest: {best['label']}[/bold] {best['tok_s']:.1f} tok/s "
                  f"({fmt(best['speedup_vs_plain'], '.2f', 'x')} vs plain, tau {fmt(best['tau'])})")
        con.print(f"use it: {best['command']}\n        {best['generate_command']}")
        plain = next((r for r in results["settings"] if r["method"] == "plain"), None)
        if plain and plain["tok_s"] >= best["tok_s"]:
            con.print("[yellow]plain decoding was faster than every speculative setting here[/yellow]")
        if not best["lossless"]:
            con.print("[red]no setting reproduced plain greedy on every prompt (expected in fp32; in bf16 batched "
                      "verification can round differently): check the '= plain' column[/red]")
    con.print(f"results: {results['out']}")


def run_sweep(cfg: BenchConfig, target: Target | None = None, draft: DraftCheckpoint | None = None,
              progress: bool = True, show: bool = True) -> dict[str, Any]:
    """Try every grid setting on the first `sweep_limit` prompts (interleaved, plain as the reference);
    write sweep.json + sweep.png and report the fastest setting with the command that uses it."""
    check_threads(cfg.threads)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    n = min(cfg.sweep_limit, cfg.limit or cfg.sweep_limit)
    prompts = load_prompts(cfg.bench, n) if cfg.turn == 1 else None  # bad input fails before any load
    settings = [{"method": "plain"}] + sweep_settings(cfg.grid)
    specs = [sweep_spec(s, cfg) for s in settings]
    # validate=False: the engine refuses a grid's bad settings one by one, and the sweep reports them
    parts = bench_parts(cfg, prompts, specs, SWEEP_USE, target, draft, validate=False)
    target, draft, ngram = parts.target, parts.draft, parts.ngram
    template_warning(parts.template_warning, progress)
    end_ids = stop_ids(target)
    if prompts is None:
        prompts = load_prompts(cfg.bench, n, cfg.turn, greedy_answer(target, end_ids, cfg.max_new_tokens))
    ids = prompt_ids(target, prompts)
    out = Path(cfg.out) if cfg.out else default_out("sweep")

    runners: dict[str, Callable[..., Output]] = {}
    refused = []
    for n, (s, spec) in enumerate(zip(settings, specs, strict=True)):
        label = setting_label(s)
        say(progress, f"sweep: warm-up {n + 1}/{len(settings)} {label}")
        try:
            engine = make_engine(parts, spec)
            run = engine_runner(engine, end_ids, target.device)
            run(ids[0], min(cfg.max_new_tokens, WARMUP_TOKENS))  # warm-up; also where lazy checks would fire
        except EngineError as e:
            refused.append({**s, "label": label, "error": str(e)})
            continue
        runners[label] = run
    labels = list(runners)
    done_rows = prepare_out(cfg, out, target, SWEEP_RESUME_KEYS, labels)
    rows = done_rows + interleave(prompts, ids, runners, "plain", cfg.max_new_tokens, out / "rows.jsonl",
                                  done_rows, progress, "sweep")
    summ = summarize(rows, labels)["methods"]
    by_label = {setting_label(s): s for s in settings}
    table = [{**by_label[lab], "label": lab, **{k: v for k, v in summ[lab].items() if k != "speedup_vs_hf"}}
             for lab in labels]
    spec_rows = [r for r in table if r["method"] != "plain"]
    # the fastest setting whose outputs all equal plain greedy; only if none does, the fastest at all
    lossless = [r for r in spec_rows if r["identical"] == r["compared"]]
    best = max(lossless or spec_rows, key=lambda r: r["tok_s"]) if spec_rows else None
    if best:
        flags = setting_flags(best)
        best = {**best, "lossless": bool(lossless),
                "command": f"eyas bench --bench {cfg.bench} --methods "
                           f"{'tree-lookup' if best.get('lookup') else best['method']} {flags} --draft {cfg.draft} "
                           f"--dtype {cfg.dtype} --device {cfg.device}",
                "generate_command": f"eyas generate --method {best['method']} {flags} --draft {cfg.draft} "
                                    f"--dtype {cfg.dtype} --device {cfg.device} --prompt ..."}
    results = {
        "kind": "eyas-bench-sweep", "format_version": 1, "out": str(out), "command": " ".join(sys.argv),
        "config": cfg.to_dict(),
        "environment": environment(target), "target": {**target.identity.to_dict(), "source": target.source},
        "draft": draft_summary(draft, cfg.draft), "ngram": describe_ngram(ngram, cfg.ngram),
        "num_prompts": len(prompts), "prompts": [p.id for p in prompts],
        "settings": table, "refused": refused, "best": best, "rows": rows,
    }
    atomic_write_json(out / "sweep.json", results)
    plot_sweep(results, out / "sweep.png")
    if show:
        render_sweep(results)
    return results
