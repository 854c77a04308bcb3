"""Never 30 s without a sign of life: when a command has written nothing for QUIET_S seconds, one line on stderr
says what it is doing and for how long.

The `eyas` command starts the watch (eyas/__main__.py) before it imports torch; stages name what the command is
doing (`stage("loading the target smollm2-135m")`), and a stage of None is quiet (a server waiting for requests is
not silent, it is idle). Any write to stdout or stderr counts as life, so a command that reports its own progress
never sees these lines; one whose progress bar stalls, or whose library works without a word (a model load, a
conversion, a compile), does. Library use (tests, `import eyas`) never starts the watch: `stage` is then a no-op
record. EYAS_HEARTBEAT=1 or 0 forces it on or off (see `wanted`).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from .text import duration

QUIET_S = 30.0  # the longest silence a user should see
POLL_S = 2.0


class _State:
    def __init__(self) -> None:
        self.command = "eyas"
        self.what: str | None = None
        self.since = time.monotonic()  # when the stage began
        self.last = time.monotonic()  # the last write to stdout or stderr, or the last heartbeat line
        self.err: TextIO = sys.stderr
        self.running = False


_state = _State()
_lock = threading.Lock()


def stage(what: str | None) -> None:
    """What the command is doing from now on, as the heartbeat line names it ("loading the target X"); None: it
    is idle on purpose (waiting for requests), so say nothing."""
    with _lock:
        _state.what = what
        _state.since = time.monotonic()


@contextmanager
def during(what: str) -> Iterator[None]:
    """Stage `what` for the block, then the stage before it again."""
    before = _state.what
    stage(what)
    try:
        yield
    finally:
        stage(before)


class _Tap:
    """A stream that forwards everything and notes when it was last written to."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, s: str) -> int:
        if s:
            _state.last = time.monotonic()
        return self._stream.write(s)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def line(now: float | None = None) -> str | None:
    """The heartbeat line due now (None when there was output within QUIET_S, or the command is idle)."""
    now = time.monotonic() if now is None else now
    with _lock:
        if _state.what is None or now - _state.last < QUIET_S:
            return None
        return f"{_state.command}: still {_state.what} ({duration(now - _state.since)} so far)"


def _watch(poll_s: float) -> None:
    while True:
        time.sleep(poll_s)
        msg = line()
        if msg is None:
            continue
        _state.last = time.monotonic()
        try:
            from tqdm import tqdm  # clears and redraws any bar on the line, so a stalled bar stays whole

            tqdm.write(msg, file=_state.err)
        except Exception:  # noqa: BLE001 - a closed stream at exit must not end the command
            return


def wanted(env: str | None, tty: bool) -> bool:
    """EYAS_HEARTBEAT=1 turns the watch on, 0 off; unset, it is on where stderr is a terminal (a person waiting),
    and off where it is a pipe (a script or test reading the output, which the lines would change)."""
    return env == "1" if env in ("0", "1") else tty


def start(command: str, first: str = "starting (importing torch)", poll_s: float = POLL_S) -> None:
    """Watch this process's stdout and stderr from now on (once; the `eyas` command calls it), where `wanted`."""
    if _state.running or not wanted(os.environ.get("EYAS_HEARTBEAT"), sys.stderr.isatty()):
        return
    _state.running = True
    _state.command = command
    _state.err = sys.stderr
    sys.stdout = _Tap(sys.stdout)  # type: ignore[assignment]  # a TextIO in all but name
    sys.stderr = _Tap(sys.stderr)  # type: ignore[assignment]
    stage(first)
    threading.Thread(target=_watch, args=(poll_s,), name="eyas-heartbeat", daemon=True).start()
