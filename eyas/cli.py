"""The one `eyas` command; each subcommand maps to a module."""

from __future__ import annotations

import json
from pathlib import Path

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="eyas: EAGLE-3 drafts with the hidden-state wiring checked end to end.")

TargetOpt = typer.Option("smollm2-135m", "--target", help="smollm2-135m, a HF model folder, or a .gguf file")
DtypeOpt = typer.Option("fp32", "--dtype", help="fp32 | bf16 | fp16")
DeviceOpt = typer.Option("cpu", "--device", help="cpu | cuda | cuda:N")


@app.callback()
def _root() -> None:
    """eyas: EAGLE-3 drafts with the hidden-state wiring checked end to end."""


def fail(msg: str, code: int = 2) -> None:
    typer.secho(f"error: {msg}", fg="red", err=True)
    raise typer.Exit(code)


@app.command()
def inspect(
    what: str = typer.Argument("smollm2-135m", help="a target (name, HF folder, .gguf), a shard folder or a draft"),
    json_out: bool = typer.Option(False, "--json", help="emit JSON"),
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
) -> None:
    """Describe a target (layout in every engine's convention, stream norms), a shard folder or a draft."""
    from .inspect import inspect_path, inspect_target, render

    info = inspect_path(Path(what)) if Path(what).is_dir() else None
    try:
        if info is None:
            info = inspect_target(what, dtype=dtype, device=device)
    except ValueError as e:
        fail(str(e))
    if json_out:
        typer.echo(json.dumps(info, indent=2, default=str))
    else:
        render(info)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
