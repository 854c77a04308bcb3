"""What `eyas train` shows and draws: the progress bar and metric tables on the console (main rank, unless
--quiet), and curves.png from train_log.jsonl and metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..files import atomic_write
from .ttt import STEP_DECAY


def metrics_table(m: dict[str, Any], title: str):
    from rich.table import Table

    tab = Table(title=title)
    tab.add_column("TTT step", justify="right")
    tab.add_column("held-out loss", justify="right")
    tab.add_column("held-out acc", justify="right")
    tab.add_column("train acc", justify="right")
    tr = m.get("train_acc") or []
    for j, (lo, ac) in enumerate(zip(m["heldout_loss"], m["heldout_acc"], strict=True)):
        tab.add_row(str(j), f"{lo:.4f}", f"{ac:.4f}", f"{tr[j]:.4f}" if j < len(tr) else "-")
    # the measure the train loss, the log and curves.png use: Σ_j 0.8^j × the step-j loss, so the numbers compare
    tab.caption = ("held-out loss as the train loss weighs it (Σ 0.8^j × step j): "
                   f"{weighted_loss(m['heldout_loss']):.4f}")
    if "replay_tau" in m:  # what a served chain of k would reach: the number to pick a checkpoint by
        tab.caption += "\n" + (f"served chain k={m['replay_k']}: replay τ {m['replay_tau']:.3f} on {m['replay_rows']} "
                               f"held-out replies (accepted per position {m['replay_per_pos']} over "
                               f"{m['replay_drafts']} drafts); simulated from accuracy {m.get('simulated_tau', 0):.3f}")
    return tab


def weighted_loss(per_step: list[float]) -> float:
    """The per-TTT-step losses summed with the training objective's weights (0.8^j): what the train loss is."""
    return sum(STEP_DECAY ** j * x for j, x in enumerate(per_step))


def write_curves(metrics_path: Path, log_path: Path, png: Path) -> None:
    import matplotlib.pyplot as plt

    evals = [json.loads(ln) for ln in metrics_path.read_text().splitlines() if ln.strip()] \
        if metrics_path.exists() else []
    log = [json.loads(ln) for ln in log_path.read_text().splitlines() if ln.strip()] if log_path.exists() else []
    fig = curves_figure(evals, log)
    atomic_write(png, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)


def curves_figure(evals: list[dict[str, Any]], log: list[dict[str, Any]]) -> Any:
    """curves.png's figure: the loss (train log and held-out) and the held-out accuracy per TTT step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    if log:
        a1.plot([r["step"] for r in log], [r["loss"] for r in log], lw=0.6, alpha=0.6, label="train loss")
    if evals:
        a1.plot([e["step"] for e in evals], [weighted_loss(e["heldout_loss"]) for e in evals], "o-",
                 label="held-out loss")
        for j in range(len(evals[0]["heldout_acc"])):
            a2.plot([e["step"] for e in evals], [e["heldout_acc"][j] for e in evals], "o-", ms=3, label=f"step {j}")
    # short titles (a long one ran into the other panel), whole-number steps at any run length, and a legend only
    # where something was drawn (matplotlib warns for an empty one)
    a1.set_title("loss (sum over TTT steps j of 0.8^j x soft CE)", fontsize=10)
    a2.set_title("held-out accuracy per TTT step", fontsize=10)
    a2.set_ylim(0, 1)
    for ax in (a1, a2):
        ax.set_xlabel("optimizer step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


class Report:
    """The run's console: a progress bar and metric tables when `show` (the main rank without --quiet), else
    silent, so that the training loop never asks which rank it is or whether it is quiet."""

    def __init__(self, show: bool, total: int, done: int) -> None:
        self.progress = None
        if not show:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                 TextColumn("{task.fields[info]}"))
        self.progress.start()
        self.task = self.progress.add_task("train", total=total, completed=done, info="")

    def print(self, text: str) -> None:
        if self.progress is not None:
            self.progress.console.print(text)

    def table(self, m: dict[str, Any] | None, title: str) -> None:
        if m is not None and self.progress is not None:
            self.progress.console.print(metrics_table(m, title))

    def advance(self, step: int, info: str) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=step, info=info)

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def print_done(step: int, tokens: int, seconds: float, out: Path, final: dict[str, Any] | None) -> None:
    from rich.console import Console

    con = Console()
    con.print(f"[bold green]done[/]: {step} steps, {tokens} tokens in {seconds:.1f}s of training "
              f"({tokens / max(seconds, 1e-9):.0f} tok/s), draft -> {out / 'draft'}, curves -> {out / 'curves.png'}")
    if final:
        con.print(metrics_table(final, "final held-out metrics"))
