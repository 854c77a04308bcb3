"""The one base class for errors a user can fix (bad flags, a mismatched artifact, a corrupt file),
LayoutError, the contract error both layout.py and conventions.py raise, and `about`, which names the file an
error's content came from.

The CLI prints an EyasError as one line and exits 2; anything else is a bug in eyas (or in a library it
calls) and keeps its traceback. EyasError subclasses ValueError so that library callers (and tests) that
catch ValueError around eyas calls keep working.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class EyasError(ValueError):
    """A user-facing error: the message says what was found, what was expected and the fix."""


class LayoutError(EyasError):
    """A layout mismatch or an id an engine cannot express; the message always carries the fix. Here rather than
    in layout.py because conventions.py, which layout.py builds on, raises it too (eyas.layout re-exports it)."""


@contextmanager
def about(what: str | Path) -> Iterator[None]:
    """Any EyasError raised inside is about `what` (the file being read): its message names it, unless it already
    does. A check deep in a reader (a token id, a shape) knows the value, not the file it came from; the reader
    that opened the file wraps its use in this, so the one error line says which file holds the bad content."""
    try:
        yield
    except EyasError as e:
        if str(what) not in str(e):
            e.args = (f"{what}: {e}", *e.args[1:])  # the same error, type and traceback kept, only named
        raise
