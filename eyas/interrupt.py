"""How a long job (datagen, train, ngram, recipe) stops on Ctrl-C or SIGTERM without losing work: the first
signal asks it to stop at its next safe point (a step or a chunk committed), the job saves what it has and raises
Interrupted with one line saying what is saved and the command that resumes; a second signal stops at once
(KeyboardInterrupt: only what was already committed is kept, which the atomic writes guarantee)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

EXIT_CODE = 130  # what a shell reports for a job ended by SIGINT


class StoppedNow(KeyboardInterrupt):
    """The first signal to a job that stops at once (stop_on_signals(at_once=True)): the job says what it had
    committed and raises Interrupted. A KeyboardInterrupt, so code between the signal and the job's handler unwinds
    as it does for Ctrl-C."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal_name = signal_name


class Interrupted(Exception):
    """A job stopped by a signal after saving its work; the message says what is saved and how to resume. Not an
    EyasError: nothing was wrong with the input."""


@dataclass
class StopRequest:
    requested: bool = False
    signal_name: str = ""


@contextmanager
def stop_on_signals(what: str, say=None, at_once: bool = False) -> Iterator[StopRequest]:
    """SIGINT and SIGTERM set request.requested for the job to check at its safe points; `say` (a print-like
    callable) is told once that the job is stopping. at_once: the first signal raises StoppedNow (a job whose safe
    points are minutes apart, whose commits are atomic: datagen's chunks). Outside the main thread (signal
    handlers cannot be set there) the request never fires and the default handling stays."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return

    def handler(signum: int, _frame) -> None:
        if request.requested:  # the second signal: stop now
            raise KeyboardInterrupt
        request.requested, request.signal_name = True, signal.Signals(signum).name
        if at_once:
            raise StoppedNow(request.signal_name)
        if say is not None:
            say(f"{request.signal_name}: {what} stops after the current step and saves its work "
                "(send it again to stop at once)")

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield request
    finally:
        for s, h in old.items():
            signal.signal(s, h)
