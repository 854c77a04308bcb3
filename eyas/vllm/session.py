"""A long-lived vLLM worker (eyas/vllm/capture_worker.py under vLLM's own python) that eyas sends commands to.

vLLM takes minutes to start on a CPU (and an 8-GPU target longer), so `datagen --engine vllm` starts it once
and sends it every chunk's generation and capture: one JSON line per command on the worker's stdin, one
`EYAS-RESULT {json}` line back on its stdout; every other line is vLLM's log, passed to `log`.

Stream index -> vLLM aux id: eyas/conventions.py translates (vLLM's top-level ids are input-of, so they equal the
stream indices); `aux_ids(indices, L)` asks for the layout's indices plus the final state L, sorted (vLLM returns
its states in ascending id order; eyas reorders them into the layout's order).
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..conventions import CONVENTIONS, to_engine_ids
from .env import WORKERS, VllmError, worker_env

RESULT = "EYAS-RESULT "
_ERROR_LINE = re.compile(r"\b[A-Z]\w*(Error|Exception): .*")
WORKER = "capture_worker.py"


def aux_ids(indices: list[int], num_layers: int) -> list[int]:
    """The vLLM top-level aux ids that capture eyas stream `indices` and the final pre-norm state (stream L),
    sorted, unique."""
    lo, hi = CONVENTIONS["vllm"].stream_range(num_layers)
    bad = [k for k in indices if not lo <= k <= hi]
    if bad:
        raise VllmError(f"stream indices {bad} are outside {lo}..{hi}")
    return to_engine_ids(sorted(set(indices) | {num_layers}), "vllm", num_layers)


class VllmSession:
    """The worker process: `call(op)` sends one command and returns its result dict; `close()` ends it."""

    def __init__(self, py: Path, request: dict[str, Any], work: Path, log: Callable[[str], None] | None = None,
                 start_timeout: float = 3600.0):
        work.mkdir(parents=True, exist_ok=True)
        req = work / "request.json"
        req.write_text(json.dumps(request, indent=2))
        env = worker_env()
        self.log = log
        self.tail: list[str] = []
        self.errors: list[str] = []  # the log's last exception lines (Error: ...)
        self.lines: queue.Queue[str | None] = queue.Queue()
        # its own session: vLLM spawns engine processes, and a failure here ends the whole group
        self.proc = subprocess.Popen([str(py), str(WORKERS / WORKER), str(req), str(work)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()
        self.info = self._result(start_timeout, "starting vLLM")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def _result(self, timeout: float | None, what: str) -> dict[str, Any]:
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                self.kill()
                raise VllmError(f"the vLLM worker took over {timeout:.0f} s {what}; its last lines:\n  "
                                + "\n  ".join(self.tail)) from None
            if line is None:
                rc = self.proc.wait()
                raise VllmError(f"the vLLM worker exited (code {rc}) while {what}; its last lines:\n  "
                                + "\n  ".join(self.tail))
            if line.startswith(RESULT):
                out = json.loads(line[len(RESULT):])
                if "error" in out:
                    self.kill()
                    cause = self.root_cause()
                    raise VllmError(f"the vLLM worker failed while {what}: {out['error']}"
                                    + (f" (its log: {cause})" if cause and cause not in out["error"] else ""))
                self.errors = []
                return out
            self.tail = (self.tail + [line])[-15:]
            if _ERROR_LINE.search(line):  # vLLM's engine logs the root cause; the worker only hears "EngineDead"
                self.errors = (self.errors + [line])[:5]  # the first ones since the last result: the cause
            if self.log is not None:
                self.log(line)

    def root_cause(self) -> str | None:
        """The first exception line vLLM logged (e.g. `RuntimeError: Unsupported CPU attention configuration`),
        its prefix (process, time, file) removed."""
        if not self.errors:
            return None
        m = _ERROR_LINE.search(self.errors[0])
        return m.group(0)[:300] if m else None

    def call(self, op: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(op) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError as e:
            raise VllmError("the vLLM worker is gone; its last lines:\n  " + "\n  ".join(self.tail)) from e
        return self._result(timeout, f"running {op.get('op')}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the worker's own group: it and vLLM's engine processes
            except ProcessLookupError:
                pass
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call({"op": "exit"}, timeout=120)
                self.proc.wait(timeout=120)
            except (VllmError, subprocess.TimeoutExpired):
                pass
        self.kill()

    def __enter__(self) -> VllmSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
