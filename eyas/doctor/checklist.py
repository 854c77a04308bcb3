"""What every doctor command reports: a named `Check` (status, numbers, fix), rendered as a table or JSON."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import EyasError

STATUSES = ("pass", "warn", "fail", "skip")


class DoctorError(EyasError):
    """A file the doctor reads that it cannot judge (a damaged draft config.json): one line, not a check."""


def pct(x: float | None) -> str:
    """A share in [0, 1] as a percentage with one decimal; n/a for a missing or NaN measurement."""
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"


@dataclass
class Check:
    """One named doctor result: status, the measured numbers behind it, and the fix."""

    name: str
    status: str  # pass | warn | fail | skip
    summary: str
    numbers: dict[str, Any] = field(default_factory=dict)
    fix: str = ""
    details: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"check status {self.status!r} is not one of {STATUSES}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def jsonable(obj: Any) -> Any:
    """NaN/inf -> None, tuples -> lists, recursively: strict JSON for --json output."""
    if isinstance(obj, float):
        return obj if obj == obj and obj not in (float("inf"), float("-inf")) else None
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


STYLE = {"pass": "green", "warn": "yellow", "fail": "red", "skip": "dim"}


def render_checks(checks: list[Check], title: str, con) -> None:
    """The checks as a table (name, colored status, finding); fixes are printed by the caller."""
    from rich.table import Table

    t = Table(title=title)
    t.add_column("check")
    t.add_column("status")
    t.add_column("finding", overflow="fold")
    for c in checks:
        t.add_row(c.name, f"[{STYLE[c.status]}]{c.status}[/]", c.summary)
    con.print(t)


def render_fixes(checks: list[Check], con) -> None:
    for c in checks:
        if c.status in ("fail", "warn") and c.fix:
            con.print(f"[{STYLE[c.status]}]{c.name}[/]: fix: {c.fix}")
