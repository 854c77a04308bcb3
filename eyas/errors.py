"""The one base class for errors a user can fix (bad flags, a mismatched artifact, a corrupt file), and
LayoutError, the contract error both layout.py and conventions.py raise.

The CLI prints an EyasError as one line and exits 2; anything else is a bug in eyas (or in a library it
calls) and keeps its traceback. EyasError subclasses ValueError so that library callers (and tests) that
catch ValueError around eyas calls keep working.
"""

from __future__ import annotations


class EyasError(ValueError):
    """A user-facing error: the message says what was found, what was expected and the fix."""


class LayoutError(EyasError):
    """A layout mismatch or an id an engine cannot express; the message always carries the fix. Here rather than
    in layout.py because conventions.py, which layout.py builds on, raises it too (eyas.layout re-exports it)."""
