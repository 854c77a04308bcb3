"""What every command shares: the typer options several commands take, and how a user error becomes one line
and exit 2."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import typer

from ..engine.params import LOOKUP_ALONE, default_help
from ..errors import EyasError
from ..files import write_fault

TargetOpt = typer.Option("smollm2-135m", "--target", help="smollm2-135m, a HF model folder, or a .gguf file")
DtypeOpt = typer.Option("fp32", "--dtype", help="fp32 | bf16 | fp16")
DeviceOpt = typer.Option("cpu", "--device", help="cpu | cuda | cuda:N")
DraftWeightsOpt = typer.Option("auto", "--draft-weights", help="draft matrices: q8 (8-bit blocks, CPU) | fp32 | "
                               "auto (q8 with native target weights)")
WeightsOpt = typer.Option("auto", "--weights", help="target forward: native (a GGUF's own quantized weights, "
                          "8-bit activations, CPU) | native-bf16 (the same weights, bf16 activations) | "
                          "fp32 (the dequantized copy in --dtype) | auto (native where possible)")
ChatTemplateOpt = typer.Option(None, "--chat-template", help="render chats with this template: a Jinja FILE or a "
                               "built-in NAME (chatml | gemma | llama3); default: the tokenizer's own")
# generate, serve and bench: unset tree settings come from eyas.engine.params.TREE_DEFAULTS for the device
TreeDepthOpt = typer.Option(None, "--depth", help=f"tree: draft depth ({default_help('depth')})")
TreeTopkOpt = typer.Option(None, "--topk", help="tree: children per expanded node and frontier width "
                           f"({default_help('topk')})")
TreeTokensOpt = typer.Option(None, "--tokens", help="tree: tokens verified per round, root included "
                             f"({default_help('tokens')})")
TreeLookupOpt = typer.Option(None, "--lookup", help="lookup candidates merged into the tree per round (0 = off; "
                             f"{default_help('lookup')}; method lookup: the chain's length, default {LOOKUP_ALONE})")
MethodHelp = ("tree | chain (EAGLE-3) | lookup (no draft: verify what followed the context's last n-gram "
              "before; --lookup tokens) | plain (default tree; plain with --draft none)")
NgramOpt = typer.Option("auto", "--ngram", help="n-gram table (eyas ngram) proposing where context lookup finds "
                        "nothing, with method lookup or --lookup > 0: auto (the bundled one when counted for this "
                        "target) | default | none | PATH")
TreeMinProbOpt = typer.Option(None, "--min-prob", help="tree: verify only candidates whose cumulative draft "
                              f"probability reaches this ({default_help('min_prob')})")


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
    except EyasError as e:
        fail(str(e))
    except OSError as e:
        fault = write_fault(e)
        if fault is None:
            raise
        fail(str(fault))
