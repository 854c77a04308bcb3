"""curves.png reads at any run length: whole-number step ticks for a 3-step run, titles that fit their panel,
and no legend (nor matplotlib's warning about an empty one) where nothing was drawn."""

from __future__ import annotations

import warnings

from eyas.train.progress import curves_figure, write_curves


def test_a_three_step_run_has_whole_number_steps_and_no_empty_legend(tmp_path):
    log = [{"step": s, "loss": 3.0 - s * 0.1} for s in (1, 2, 3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "No artists with labels found to put in legend" would fail here
        fig = curves_figure([], log)
    a1, a2 = fig.axes
    assert all(float(t).is_integer() for t in a1.get_xticks())
    assert a1.get_legend() is not None and a2.get_legend() is None  # the accuracy panel has no evaluations yet
    fig.canvas.draw()
    left, right = (ax.title.get_window_extent(fig.canvas.get_renderer()) for ax in (a1, a2))
    assert left.x1 < right.x0, "the left title runs into the right panel's"


def test_curves_png_is_written(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 2, "heldout_loss": [1.0, 2.0], "heldout_acc": [0.5, 0.25]}\n')
    (tmp_path / "log.jsonl").write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.5}\n')
    write_curves(metrics, tmp_path / "log.jsonl", tmp_path / "curves.png")
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
