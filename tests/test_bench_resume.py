"""A bench stopped by Ctrl-C keeps every finished prompt-method run and says the command that continues it; the
continued run does only what is missing and ends with the rows an uninterrupted run gives (lossless marks across
the two runs included)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eyas.bench.methods import Output
from eyas.bench.outdir import _load_rows
from eyas.bench.prompts import BenchPrompt
from eyas.bench.run import interleave, stopped_line
from eyas.interrupt import StoppedNow

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [BenchPrompt(f"p{i}", "c", [{"role": "user", "content": "x"}]) for i in range(3)]


def runners(stop_after: int | None = None) -> tuple[dict, list]:
    """plain and tree answering [ids[0], 1, 2] (tree differs on p2); the call numbered stop_after raises the
    signal a Ctrl-C raises."""
    calls: list[str] = []

    def make(name: str):
        def run(ids, n):
            calls.append(name)
            if stop_after is not None and len(calls) == stop_after:
                raise StoppedNow("SIGINT")
            tail = [9] if name == "tree" and ids[0] == 2 else [2]
            return Output([ids[0], 1, *tail], 0.1, 3, "length")
        return run

    return {"plain": make("plain"), "tree": make("tree")}, calls


def test_a_stopped_interleave_keeps_each_finished_run_and_the_rerun_does_the_rest(tmp_path):
    ids = [[0], [1], [2]]
    rows_path = tmp_path / "rows.jsonl"
    run, calls = runners(stop_after=4)  # p0 plain and tree, p1's first method, then the signal
    with pytest.raises(StoppedNow):
        interleave(PROMPTS, ids, run, "plain", 4, rows_path, [], False, "bench")
    kept = _load_rows(rows_path, ["plain", "tree"])
    assert [(r["prompt"], r["method"]) for r in kept] == [("p0", "plain"), ("p0", "tree"), ("p1", "tree")]
    run2, calls2 = runners()
    new = interleave(PROMPTS, ids, run2, "plain", 4, rows_path, kept, False, "bench")
    assert len(calls2) == 3 and sorted((r["prompt"], r["method"]) for r in new) == [
        ("p1", "plain"), ("p2", "plain"), ("p2", "tree")]
    whole = {(r["prompt"], r["method"]): r for r in kept + new}
    # the marks span both runs: p1's tree (kept) is compared with p1's plain (new)
    assert whole[("p1", "tree")]["same_as_ref"] is True and whole[("p2", "tree")]["same_as_ref"] is False
    fresh_run, _ = runners()
    fresh = interleave(PROMPTS, ids, fresh_run, "plain", 4, tmp_path / "fresh.jsonl", [], False, "bench")
    assert {(r["prompt"], r["method"]): r["token_ids"] for r in fresh} == {k: r["token_ids"] for k, r in whole.items()}
    assert len(rows_path.read_text().splitlines()) == 6  # one line per run, none written twice


def test_the_stop_line_names_what_is_kept_and_the_command_that_continues(tmp_path, monkeypatch):
    (tmp_path / "rows.jsonl").write_text('{"prompt": "p0", "method": "plain"}\n' * 2)
    monkeypatch.setattr(sys, "argv", ["/venv/bin/eyas", "bench", "--limit", "8"])
    line = stopped_line("SIGINT", tmp_path)
    assert "2 finished prompt-method runs are kept" in line
    assert f"Continue with: eyas bench --limit 8 --out {tmp_path} --resume" in line and "make demo" in line
    monkeypatch.setattr(sys, "argv", ["eyas", "bench", "--out", str(tmp_path), "--resume"])
    assert stopped_line("SIGTERM", tmp_path).count("--resume") == 1


@pytest.mark.integration
@pytest.mark.slow
def test_ctrl_c_on_a_real_bench_then_resume(tmp_path):
    """The bundled target, 3 prompts x 2 methods: SIGINT once the first run is on disk, exit 130 with the line,
    then the printed command completes the folder."""
    out = tmp_path / "b"
    argv = [sys.executable, "-m", "eyas", "bench", "--bench", "mt-bench", "--limit", "3", "--methods",
            "plain,lookup", "--max-new-tokens", "48", "--threads", "1", "--quiet", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600
    while time.time() < deadline and p.poll() is None:
        if (out / "rows.jsonl").is_file() and (out / "rows.jsonl").read_text().strip():
            break
        time.sleep(0.05)
    assert p.poll() is None, f"the bench ended before it could be stopped: {p.stderr.read()[-2000:]}"
    p.send_signal(signal.SIGINT)
    err = p.communicate(timeout=120)[1]
    assert p.returncode == 130, err[-2000:]
    line = next(ln for ln in err.splitlines() if "finished prompt-method runs are kept" in ln)
    kept = len((out / "rows.jsonl").read_text().splitlines())
    assert 1 <= kept < 6 and f"{kept} finished" in line
    again = line.split("Continue with: ", 1)[1].split("  (make demo")[0].split()
    assert again[:2] == ["eyas", "bench"] and again[-1] == "--resume"
    done = subprocess.run([sys.executable, "-m", "eyas", *again[1:]], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    res = json.loads((out / "results.json").read_text())
    assert sorted((r["prompt"], r["method"]) for r in res["rows"]) == sorted(
        {(r["prompt"], r["method"]) for r in res["rows"]}) and len(res["rows"]) == 6
    assert all(r["same_as_ref"] for r in res["rows"] if r["method"] == "lookup")  # lossless across the two runs
