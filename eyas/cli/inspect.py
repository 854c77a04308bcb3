"""eyas inspect: describe a target, a shard folder or a draft (eyas/inspect.py)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from ..option import DEFAULT_TARGET
from .common import ChatTemplateOpt, DeviceOpt, DtypeOpt, fail, user_errors


def inspect(
    what: str = typer.Argument(None, help="a target (name, HF folder, .gguf), a shard folder or a draft "
                               "[default: smollm2-135m]"),
    target: str = typer.Option(None, "--target", help="the target, as every other command names it (the same as "
                               "WHAT)"),
    json_out: bool = typer.Option(False, "--json", help="emit JSON"),
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    chat_template: str = ChatTemplateOpt,
    raw: bool = typer.Option(False, "--raw", help="measure stream norms on plain-text prompts (no template; base "
                             "models)"),
) -> None:
    """Describe a target (layout in every engine's convention, stream norms), a shard folder or a draft."""
    from ..inspect import inspect_path, inspect_target, render

    if what is not None and target is not None and what != target:
        fail(f"inspect got two things to describe: {what} and --target {target}; pass one of them")
    what = what or target or DEFAULT_TARGET
    with user_errors():
        info = inspect_path(Path(what)) if Path(what).is_dir() else None
        if info is None:
            info = inspect_target(what, dtype=dtype, device=device, chat_template=chat_template, raw=raw)
    if json_out:
        typer.echo(json.dumps(info, indent=2, default=str))
    else:
        render(info)

