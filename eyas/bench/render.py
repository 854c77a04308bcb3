"""How a bench run is shown: the tables printed after it and bench.png."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..files import atomic_write
from .config import HF_METHODS, PEER_METHODS, SPEC_METHODS
from .rows import within_noise
from .vllm_peer import VLLM_METHODS, render_vllm


def fmt(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "n/a" if x is None else f"{x:{spec}}{suffix}"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig = bench_figure(results)
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)


def bench_figure(results: dict[str, Any]) -> Any:
    """bench.png's figure: tok/s with each method's speedup (hatched where within the run's own noise), τ, and
    the busy-machine warning when the text report gives it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summ = results["summary"]["methods"]
    cfg = results["config"]
    methods = list(summ)
    sp = results.get("specs") or {}  # each eyas method's knobs as it ran
    setting = {"hf-lookup": f"{cfg['lookup_tokens']} tokens",
               "vllm-eagle3": f"k {(results.get('vllm') or {}).get('k')}"}
    for m, s in sp.items():
        tree = f"d{s['depth']} k{s['topk']} t{s['tokens']}"
        setting[m] = {"chain": f"steps {s['steps']}", "tree": tree, "tree-lookup": f"{tree} +{s['lookup']}",
                      "lookup": f"{s['lookup']} tokens" + (" + table" if results.get("ngram") else ""),
                      "lookup-context": f"{s['lookup']} tokens"}.get(m, "")
    ticks = [f"{m}\n{setting[m]}" if m in setting else m for m in methods]
    toks = [summ[m]["tok_s"] for m in methods]
    base = "speedup_vs_hf" if "hf-greedy" in summ else "speedup_vs_plain"
    # one label per bar, rotated when many: eight methods' two-line labels no longer run into each other
    fig, (a, b) = plt.subplots(1, 2, figsize=(max(11.0, 1.5 * len(methods)), 4.8))
    bars = a.bar(ticks, toks, color=["#888888" if m in HF_METHODS + VLLM_METHODS else "#2a6fb0"
                                     for m in methods])
    noise = results["summary"].get("noise")
    for bar, m in zip(bars, methods, strict=True):
        sp = summ[m].get(base)
        # a speedup plain's own repeat spans is no measured difference: hatched, and said on the bar
        vague = m != "plain" and within_noise(summ[m].get("speedup_vs_plain"), noise)
        if vague:
            bar.set_hatch("//")
            bar.set_alpha(0.6)
        a.annotate(fmt(sp, ".2f", "x") + ("\nwithin noise" if vague else ""),
                   (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=9)
    a.set_ylabel("tokens / s")
    a.set_title(f"throughput (speedup vs {'HF greedy' if base == 'speedup_vs_hf' else 'eyas plain'})")
    taus = [summ[m]["tau"] or 0.0 for m in methods]
    bars = b.bar(ticks, taus, color="#4f9a5a")
    for bar, m in zip(bars, methods, strict=True):
        b.annotate(fmt(summ[m]["tau"]), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                   ha="center", va="bottom", fontsize=9)
    b.set_ylabel("tokens per target forward (tau)")
    b.set_title("tau")
    for ax in (a, b):
        ax.tick_params(axis="x", labelsize=8, labelrotation=30 if len(methods) > 5 else 0)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right" if len(methods) > 5 else "center")
    env = results["environment"]
    draft = results.get("draft") or {}
    flag = " — UNTRAINED draft" if draft.get("untrained") else ""
    fig.suptitle(f"{cfg['bench']} x{results['num_prompts']}, {cfg['max_new_tokens']} new tokens, "
                 f"{results['target']['name']} {weights_ran(results, env)} on {env['device']} ({env['threads']} "
                 f"threads){flag}", fontsize=10)
    busy = load_note(env)
    if busy:  # the figure travels without the text report: the warning goes with it
        fig.text(0.5, 0.005, busy.removeprefix("warning: "), ha="center", va="bottom", fontsize=8, color="#b35c00",
                 wrap=True)
    fig.tight_layout(rect=(0, 0.06 if busy else 0, 1, 1))
    return fig


def weights_ran(results: dict[str, Any], env: dict[str, Any]) -> str:
    """What the eyas methods' target forward ran, as the title names it: 'native 4-bit weights' where --weights
    auto chose the GGUF's own, not the dtype of the dequantized copy that was loaded beside them."""
    modes = sorted({v["target"] for v in (results.get("weights") or {}).values()})
    if not modes or modes == ["fp32"]:
        return env["dtype"]
    names = {"native": "native quantized weights", "native-bf16": "native quantized weights, bf16 activations"}
    return " / ".join(names.get(m, m) for m in modes)


def wide_console():
    from rich.console import Console

    con = Console()
    if not con.is_terminal:  # piped or logged: do not squeeze the tables into 80 columns
        con.width = 150
    return con


def drafted_depths(rates: list[float | None] | None) -> list[float | None]:
    """Acceptance per depth up to the deepest depth any round drafted: a depth never attempted (None) after the
    last attempted one is not a measurement."""
    rates = list(rates or [])
    while rates and rates[-1] is None:
        rates.pop()
    return rates


def summary_row(m: str, s: dict[str, Any], ref: str | None) -> list[str]:
    acc = " ".join(fmt(a, ".2f") for a in drafted_depths(s["accept_per_depth"])) or "-"
    same = "ref" if m == ref else (f"{s['identical']}/{s['compared']}" if s["compared"] else "n/a")
    # decode tok/s: after the prefill, where the method times it (n/a for HF and vLLM)
    return [m, f"{s['tok_s']:.1f}", fmt(s.get("decode_tok_s"), ".1f"), fmt(s["speedup_vs_hf"], ".2f", "x"),
            fmt(s["speedup_vs_plain"], ".2f", "x"), fmt(s["tau"]), acc, fmt(s["draft_overhead"], ".0%"), same]


def render(results: dict[str, Any]) -> None:
    from rich.table import Table

    con = wide_console()
    summ = results["summary"]["methods"]
    ref = results["reference"]
    draft = results.get("draft") or {}
    title = f"eyas bench: {results['config']['bench']} x{results['num_prompts']} prompts"
    if draft.get("untrained"):
        title += " [red](UNTRAINED draft: numbers meaningless)[/red]"
    cols = ("method", "tok/s", "decode tok/s", "vs HF greedy", "vs plain", "tau", "accept per depth",
            "draft overhead", f"= {ref or 'ref'}")
    rows = [summary_row(m, s, ref) for m, s in summ.items()]
    # a column no method fills (vs HF greedy without hf-greedy, ...) says nothing
    keep = [i for i in range(len(cols)) if i == 0 or any(r[i] not in ("n/a", "-") for r in rows)]
    t = Table(title=title)
    for i in keep:
        t.add_column(cols[i], justify="left" if cols[i] in ("method", "accept per depth") else "right")
    for r in rows:
        t.add_row(*(r[i] for i in keep))
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
    noise_lines(summ, results["summary"].get("noise"), con)
    used = results.get("weights") or {}
    for w in sorted({(v["target"], v["note"]) for v in used.values()}, key=str):
        con.print(f"weights: target {w[0]} for {', '.join(m for m, v in used.items() if (v['target'], v['note']) == w)}"
                  + (f" (--weights auto: {w[1]})" if w[1] else ""))
    if results.get("vllm"):
        render_vllm(results["vllm"], con)
    busy = load_note(results["environment"])
    if busy:
        con.print(f"[yellow]{busy}[/yellow]")
    con.print(f"results: {results['out']}")


def noise_lines(summ: dict[str, Any], noise: dict[str, Any] | None, con) -> None:
    """plain against itself (bench --repeat-plain), and a warning for each speedup inside that spread."""
    if not noise:
        return
    same = "" if noise["same"] == noise["prompts"] else \
        f"; [red]its repeat gave other tokens on {noise['prompts'] - noise['same']} prompt(s)[/red]"
    con.print(f"plain against itself: {noise['ratio']:.3f}x over {noise['prompts']} prompts: this run's noise is "
              f"±{noise['spread']:.1%}{same}")
    for m, s in summ.items():
        if m != "plain" and within_noise(s.get("speedup_vs_plain"), noise):
            con.print(f"[yellow]warning: {m}'s {s['speedup_vs_plain']:.2f}x vs plain lies within plain's spread "
                      f"against itself (±{noise['spread']:.1%}): not a measured difference; rerun on a quiet "
                      "machine or with more prompts[/yellow]")


def load_note(env: dict[str, Any]) -> str | None:
    """A warning when other work shared the CPUs (the 1-minute load when results were written above half the
    cores): tok/s and speedups then carry that noise (a 0.4x at τ 1.00 is the machine, not the method); τ,
    acceptance and the lossless checks are counts and do not."""
    load, cpus = env.get("loadavg_1m"), env.get("cpu_count") or 1
    if load is None or load <= cpus / 2 or env.get("device", "cpu") != "cpu":
        return None
    return (f"warning: the machine was busy (load {load:.1f} on {cpus} CPUs): speeds and speedups carry that noise; "
            "τ, acceptance and the lossless checks are counts and do not. Compare speeds on a quiet machine")

