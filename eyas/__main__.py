"""`python -m eyas` and the `eyas` command. The signal handlers come first: importing the CLI takes seconds (torch),
and a Ctrl-C or SIGTERM then, or while a model loads, before a job takes over its signals, is one line and exit 130
too, never a traceback or a silent death. Writes are atomic, so nothing half-written is kept, and what earlier runs
committed stays."""

from __future__ import annotations

import signal
import sys

from . import heartbeat
from .interrupt import EXIT_CODE, StoppedNow


def stop(signum: int, _frame) -> None:
    raise StoppedNow(signal.Signals(signum).name)


def say_stopped(e: KeyboardInterrupt) -> None:
    name = e.signal_name if isinstance(e, StoppedNow) else "SIGINT"
    print(f"eyas {' '.join(sys.argv[1:2])}: stopped by {name} before its work began or between its saves; nothing "
          "half-written was kept (writes are atomic) and what earlier runs committed is untouched. Rerun the same "
          "command to continue", file=sys.stderr)


def main() -> None:
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    heartbeat.start(" ".join(["eyas", *sys.argv[1:2]]))
    try:
        from .cli import main as cli

        heartbeat.stage("working (no progress to show yet)")
        cli()
    except KeyboardInterrupt as e:  # while the CLI was imported
        say_stopped(e)
        sys.exit(EXIT_CODE)
    except SystemExit as e:  # typer turns a KeyboardInterrupt in a command into a silent exit 130
        cause = getattr(e.__context__, "__cause__", None)
        if isinstance(cause, KeyboardInterrupt):
            say_stopped(cause)
        raise


if __name__ == "__main__":
    main()
