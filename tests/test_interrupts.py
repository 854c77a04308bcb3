"""Each long command stopped at random moments, by SIGINT (Ctrl-C) or SIGTERM (a scheduler), as `python -m eyas`
runs it: the command exits 0 (it finished first) or 130 with one line that names the signal and how to resume, never
a traceback; whatever it had committed before the signal (polled while it ran) is still there; and rerunning the
command (train with --resume, which then says the step it continues at) ends with what an uninterrupted run gives.

The moments are drawn from the uninterrupted run's duration with a fixed seed: EYAS_INTERRUPT_SEED and
EYAS_INTERRUPT_MOMENTS (per command) choose others, and every failure names its moment and signal.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.test_datagen import _args, _cfg
from tests.test_train import world  # noqa: F401 (fixture)

REPO = Path(__file__).resolve().parents[1]
SEED = int(os.environ.get("EYAS_INTERRUPT_SEED", "20261205"))
MOMENTS = int(os.environ.get("EYAS_INTERRUPT_MOMENTS", "1"))
ENV = dict(os.environ, OMP_NUM_THREADS="1")

pytestmark = pytest.mark.slow


def eyas(*argv: str, cwd: Path = REPO) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "eyas", *argv], cwd=cwd, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(argv: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    p = eyas(*argv)
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, f"{argv}: {err[-3000:]}"
    return time.perf_counter() - t0, err


def moments(name: str, duration: float) -> list[tuple[float, str]]:
    """(seconds after the start, signal) per moment: early (starting, loading) to near the end of the run."""
    rng = random.Random(f"{SEED}-{name}")
    first = rng.randrange(2)  # which signal comes first, so one moment per command still tries both across them
    return [(rng.uniform(0.2, 0.9 * duration), ("SIGINT", "SIGTERM")[(first + i) % 2]) for i in range(MOMENTS)]


def stop_at(argv: list[str], delay: float, sig: str, committed: Callable[[], Any]) -> tuple[int, str, Any]:
    """Run argv, polling `committed()` until `delay`, then send `sig`: (exit code, stderr, the last state polled
    before the signal)."""
    p = eyas(*argv)
    seen, t0 = committed(), time.perf_counter()
    while time.perf_counter() - t0 < delay and p.poll() is None:
        seen = committed() or seen
        time.sleep(0.05)
    seen = committed() or seen
    if p.poll() is None:
        p.send_signal(getattr(signal, sig))
    _, err = p.communicate(timeout=600)
    return p.returncode, err, seen


def check_stop(rc: int, err: str, sig: str, where: str) -> str | None:
    """The stop line of a run stopped by `sig` (None if it finished before the signal)."""
    print(f"{where}: exit {rc}", *[ln for ln in err.splitlines() if "stopped by" in ln][-1:])  # shown with -s
    if rc == 0:
        return None
    assert rc == 130 and "Traceback" not in err, f"{where}: exit {rc}\n{err[-3000:]}"
    said = [ln for ln in err.splitlines() if "stopped by" in ln]
    assert len(said) == 1 and sig in said[0], f"{where}: {err[-3000:]}"
    assert any(w in said[0] for w in ("Rerun", "rerun", "Resume with", "resume")), said[0]
    return said[0]


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # not there yet
        return None


# ---- datagen: committed shards stay listed and intact; the rerun gives the uninterrupted run's samples ---------

def shard_samples(folder: Path) -> list[tuple[int, list[int]]]:
    from eyas.data.shards import ShardSet

    return [(s.row_id, s.input_ids.tolist()) for s in ShardSet(folder).samples()]


def test_datagen_stopped_at_random_moments(tmp_path, tiny_dir, conv_file):  # noqa: F811
    def argv(out: Path) -> list[str]:
        return _args(_cfg(out, tiny_dir, conv_file, num=16, regenerate=True, max_len=160, max_new_tokens=8,
                          shard_samples=4))

    took, _ = finish(argv(tmp_path / "straight"))
    want = shard_samples(tmp_path / "straight")
    for k, (delay, sig) in enumerate(moments("datagen", took)):
        out, where = tmp_path / f"stopped-{k}", f"datagen {sig} at {delay:.2f} s (seed {SEED})"

        def committed(out=out) -> set[str] | None:
            m = read_json(out / "manifest.json")
            return {s["digest"] for s in m["shards"]} if m else None

        rc, err, seen = stop_at(argv(out), delay, sig, committed)
        check_stop(rc, err, sig, where)
        if seen:  # every shard committed before the signal is still listed, with its bytes
            from eyas.data.shards import ShardSet

            after = read_json(out / "manifest.json")
            assert seen <= {s["digest"] for s in after["shards"]}, where
            ShardSet(out).verify()
        finish(argv(out))
        assert shard_samples(out) == want, where


# ---- train: the checkpoint never goes back; the resume says its step; the losses are the uninterrupted run's ---

def train_argv(root: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--data", str(root / "shards"), "--out", str(out), "--draft-vocab", "64", "--ttt-steps", "3",
            "--lr", "3e-3", "--batch-tokens", "512", "--max-len", "64", "--heldout-pct", "20", "--quiet",
            "--threads", "1", "--max-steps", "12", "--save-every", "3", "--eval-every", "3", *extra]


def losses(out: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (out / "train_log.jsonl").read_text().splitlines()]


def test_train_stopped_at_random_moments(world):  # noqa: F811
    root, _ = world
    took, _ = finish(train_argv(root, root / "int-straight"))
    want = losses(root / "int-straight")
    for k, (delay, sig) in enumerate(moments("train", took)):
        out, where = root / f"int-stopped-{k}", f"train {sig} at {delay:.2f} s (seed {SEED})"

        def committed(out=out) -> int | None:
            state = read_json(out / "checkpoint" / "trainer_state.json")
            return state["step"] if state else None

        rc, err, seen = stop_at(train_argv(root, out), delay, sig, committed)
        line = check_stop(rc, err, sig, where)
        step = committed()
        assert seen is None or (step is not None and step >= seen), (where, seen, step)
        if line and "at step" in line:  # stopped inside the loop: the checkpoint is the step it names
            assert f"at step {step}/12" in line, (where, line)
        _, resumed = finish(train_argv(root, out, "--resume"))
        said = " ".join(resumed.split())
        if step is not None and step < 12:
            assert f"at step {step}/12" in said and "continuing" in said, (where, said[-2000:])
        assert losses(out) == want, where


# ---- ngram: the table is written whole or not at all; the rerun writes the uninterrupted run's bytes ---------

def test_ngram_stopped_at_random_moments(world):  # noqa: F811
    from eyas.files import file_digest

    root, _ = world
    argv = ["ngram", "--data", str(root / "shards"), "--min-count", "1"]
    took, _ = finish([*argv, "--out", str(root / "ngram-straight")])
    want = file_digest(root / "ngram-straight" / "ngram.safetensors")
    for k, (delay, sig) in enumerate(moments("ngram", took)):
        out, where = root / f"ngram-stopped-{k}", f"ngram {sig} at {delay:.2f} s (seed {SEED})"
        rc, err, _ = stop_at([*argv, "--out", str(out)], delay, sig, lambda: None)
        check_stop(rc, err, sig, where)
        if (out / "ngram.safetensors").exists():  # written whole (an atomic folder) or not at all
            assert file_digest(out / "ngram.safetensors") == want, where
        finish([*argv, "--out", str(out)])
        assert file_digest(out / "ngram.safetensors") == want, where


# ---- recipe (the real target): its data stage stopped once; the rerun finishes it with the same samples --------

@pytest.mark.integration
def test_recipe_stopped_at_a_random_moment(tmp_path, smollm2):
    def argv(work: Path) -> list[str]:
        return ["recipe", "smollm2-135m", "--work", str(work), "--stages", "data", "--orig-num", "3",
                "--threads", "1"]

    took, _ = finish(argv(tmp_path / "straight"))
    folders = ("data-orig",)
    want = {f: shard_samples(tmp_path / "straight" / f) for f in folders}
    for k, (delay, sig) in enumerate(moments("recipe", took)[:1]):
        work, where = tmp_path / f"stopped-{k}", f"recipe {sig} at {delay:.2f} s (seed {SEED})"
        rc, err, _ = stop_at(argv(work), delay, sig, lambda: None)
        check_stop(rc, err, sig, where)
        finish(argv(work))
        assert {f: shard_samples(work / f) for f in folders} == want, where
