"""What every command shares: the typer options several commands take, and how a user error becomes one line
and exit 2."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import fields
from typing import Any, TypeVar

import typer

from ..errors import EyasError
from ..files import write_fault
from ..interrupt import EXIT_CODE as INTERRUPTED_EXIT
from ..interrupt import Interrupted
from ..option import (
    CHAT_TEMPLATE_HELP,
    DEFAULT_TARGET,
    DEVICE_HELP,
    DRAFT_WEIGHTS_HELP,
    DTYPE_HELP,
    NGRAM_HELP,
    TARGET_HELP,
    WEIGHTS_HELP,
)

F = TypeVar("F", bound=Callable[..., Any])
C = TypeVar("C")

TargetOpt = typer.Option(DEFAULT_TARGET, "--target", help=TARGET_HELP)
DtypeOpt = typer.Option("fp32", "--dtype", help=DTYPE_HELP)
DeviceOpt = typer.Option("cpu", "--device", help=DEVICE_HELP)
DraftWeightsOpt = typer.Option("auto", "--draft-weights", help=DRAFT_WEIGHTS_HELP)
WeightsOpt = typer.Option("auto", "--weights", help=WEIGHTS_HELP)
ChatTemplateOpt = typer.Option(None, "--chat-template", help=CHAT_TEMPLATE_HELP)
NgramOpt = typer.Option("auto", "--ngram", help=NGRAM_HELP)


def config_options(*configs: type, skip: tuple[str, ...] = ()) -> Callable[[F], F]:
    """Add to a command, after its own parameters, every field of the dataclasses `configs` declared with
    eyas.option.option: typer reads the extended signature and the command receives them in **given (build the
    dataclass with `config_from`). The dataclass stays the one source of each option's name, type, default and
    help. A field the command declares itself (a required --draft, another default) is its own; `skip` names
    fields the command does not offer (their dataclass defaults apply)."""

    def wrap(command: F) -> F:
        sig = inspect.signature(command, eval_str=True)
        own = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
        taken = {p.name for p in own} | set(skip)
        extra: list[inspect.Parameter] = []
        for cfg in configs:
            hints = typing.get_type_hints(cfg)
            extra += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=hints[f.name],
                                        default=typer.Option(f.default, f.metadata["flag"], help=f.metadata["help"]))
                      for f in fields(cfg) if "flag" in f.metadata and f.name not in taken]
            taken |= {f.name for f in fields(cfg)}
        command.__signature__ = sig.replace(parameters=own + extra)  # type: ignore[attr-defined]
        return command

    return wrap


def config_from(cfg: type[C], given: dict[str, Any], **explicit: Any) -> C:
    """The dataclass `cfg` from a command's **given (its option fields) and the fields the command sets itself."""
    names = {f.name for f in fields(cfg)}  # type: ignore[arg-type]
    return cfg(**{k: v for k, v in given.items() if k in names}, **explicit)


def fail(msg: str, code: int = 2) -> None:
    typer.secho(f"error: {msg}", fg="red", err=True)
    raise typer.Exit(code)


def warn(msg: str) -> None:
    typer.secho(f"warning: {msg}", fg="yellow", err=True)


@contextmanager
def user_errors() -> Iterator[None]:
    """An EyasError (bad input the user can fix) becomes one line and exit 2, and so does a disk fault (full,
    read-only, permission denied: eyas.files.write_fault names the file); anything else is a bug in eyas and keeps
    its traceback."""
    try:
        yield
    except Interrupted as e:  # a long job stopped by Ctrl-C or SIGTERM after saving its work: how to resume
        typer.secho(str(e), fg="yellow", err=True)
        raise typer.Exit(INTERRUPTED_EXIT) from None
    except EyasError as e:
        fail(str(e))
    except OSError as e:
        fault = write_fault(e)
        if fault is None:
            raise
        fail(str(fault))
