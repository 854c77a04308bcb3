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


@app.command()
def bench(
    bench_set: str = typer.Option("mt-bench", "--bench", help="mt-bench | humaneval | a JSONL of prompts"),
    limit: int = typer.Option(10, "--limit", help="prompts (deterministic subset; 0 = all)"),
    turn: int = typer.Option(1, "--turn", help="MT-bench turn (2 = the target's greedy first answer in context)"),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens"),
    target: str = TargetOpt,
    draft: str = typer.Option("default", "--draft", help="eyas draft folder, 'default' (bundled) or 'random'"),
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    methods: str = typer.Option("hf-greedy,plain,chain,tree,hf-lookup", "--methods", help="comma-separated subset"),
    steps: int = typer.Option(4, "--steps", help="chain: draft steps per round"),
    depth: int = typer.Option(4, "--depth", help="tree: depth"),
    topk: int = typer.Option(4, "--topk", help="tree: children per node"),
    tokens: int = typer.Option(16, "--tokens", help="tree: nodes verified per round"),
    lookup_tokens: int = typer.Option(10, "--lookup-tokens", help="HF prompt_lookup_num_tokens"),
    threads: int = typer.Option(0, "--threads", help="torch threads (0 = torch's default)"),
    out: str = typer.Option(None, "--out", help="results folder (default runs/bench-<time>/)"),
    resume: bool = typer.Option(False, "--resume", help="continue an interrupted run in --out"),
    sweep: bool = typer.Option(False, "--sweep", help="try the grid below and report the fastest setting"),
    sweep_limit: int = typer.Option(3, "--sweep-limit", help="prompts used by --sweep"),
    sweep_steps: str = typer.Option("1-6", "--sweep-steps"),
    sweep_depth: str = typer.Option("2-6", "--sweep-depth"),
    sweep_topk: str = typer.Option("1,2,4,8", "--sweep-topk"),
    sweep_tokens: str = typer.Option("4,8,16,32", "--sweep-tokens"),
) -> None:
    """HF greedy, eyas plain/chain/tree and HF prompt lookup side by side: tok/s, speedup, tau, acceptance,
    draft overhead, lossless check; JSON + PNG in --out. --sweep searches steps/depth/topk/tokens."""
    from .bench import BenchConfig, BenchError, SweepGrid, parse_int_list, parse_methods, run_bench, run_sweep
    from .draft import DraftError
    from .layout import LayoutError
    from .prompts import PromptError
    from .target import TargetError

    errors: tuple[type[Exception], ...] = (BenchError, PromptError, TargetError, DraftError, LayoutError)
    try:
        from .engine import EngineError

        errors += (EngineError,)
    except ImportError:
        pass
    try:
        grid = SweepGrid(parse_int_list(sweep_steps, "--sweep-steps"), parse_int_list(sweep_depth, "--sweep-depth"),
                         parse_int_list(sweep_topk, "--sweep-topk"), parse_int_list(sweep_tokens, "--sweep-tokens"))
        cfg = BenchConfig(bench=bench_set, limit=limit or None, turn=turn, max_new_tokens=max_new_tokens,
                          target=target, draft=draft, dtype=dtype, device=device, methods=parse_methods(methods),
                          steps=steps, depth=depth, topk=topk, tokens=tokens, lookup_tokens=lookup_tokens,
                          threads=threads or None, out=out, resume=resume, sweep=sweep, sweep_limit=sweep_limit,
                          grid=grid)
        (run_sweep if sweep else run_bench)(cfg)
    except errors as e:
        fail(str(e))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
