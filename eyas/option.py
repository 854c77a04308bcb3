"""A config dataclass field that is also a command-line option: its flag and help live on the field, so the
dataclass is the one source of both (eyas.cli.common.config_options builds the typer options from it)."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def option(flag: str, help: str, default: Any = None) -> Any:
    """A dataclass field offered on the command line as `flag` (with `help`); the CLI's default is the field's."""
    return field(default=default, metadata={"flag": flag, "help": help})
