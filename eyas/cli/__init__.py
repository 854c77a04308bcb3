"""The one `eyas` command; each subcommand maps to a module: this package's modules hold the commands by stage
(common.py the options they share), and this file registers them in the order `eyas --help` lists them."""

from __future__ import annotations

import typer

from . import data, decode, doctor, inspect, interop, recipe, replay, train

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="eyas: EAGLE-3 drafts with the hidden-state wiring checked end to end.")


def _version(value: bool) -> None:
    if value:
        from .. import __version__

        typer.echo(f"eyas {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="print eyas's version and exit")) -> None:
    """eyas: EAGLE-3 drafts with the hidden-state wiring checked end to end."""
    from ..target.offline import hub_offline

    hub_offline()  # every command: no hub access, whatever a command imports first


app.command()(inspect.inspect)
app.command()(decode.bench)
app.command()(train.train)
app.command()(data.datagen)
app.command()(decode.serve)
app.command()(interop.export)
app.command("import")(interop.import_)
app.add_typer(doctor.doctor_app, name="doctor")
app.add_typer(replay.replay_app, name="replay")
app.command()(decode.generate)
app.command()(data.ngram)
app.command()(recipe.recipe)


def whole_sentences(t: typer.Typer) -> None:
    """Each command's help as flowing text: typer keeps a docstring's line breaks, so `eyas --help` broke
    descriptions mid-sentence where the source wraps them."""
    for c in t.registered_commands:
        text = c.help or (c.callback.__doc__ if c.callback else None)
        if text:
            c.help = " ".join(text.split())
    for g in t.registered_groups:
        if g.typer_instance is not None:
            whole_sentences(g.typer_instance)


whole_sentences(app)


def misplaced(argv: list[str]) -> str | None:
    """The one-line hint for the two slips new users make most: a command's option before the command, and
    generate's prompt without --prompt (click would only say "No such option" / "unexpected extra argument")."""
    names = {c.name or (c.callback.__name__ if c.callback else "") for c in app.registered_commands}
    names |= {g.name for g in app.registered_groups if g.name}
    if argv and argv[0].startswith("-") and argv[0] not in ("--help", "--version"):
        cmd = next((a for a in argv if a in names), None)
        if cmd is not None:
            rest = [a for a in argv if a != cmd]
            return f"error: {argv[0]} is an option of `eyas {cmd}`, and a command's options go after it: eyas {cmd} " \
                   + " ".join(rest)
    if len(argv) >= 2 and argv[0] == "generate" and not argv[1].startswith("-"):
        return f"error: `eyas generate` takes its text as an option: eyas generate --prompt {argv[1]!r}" + \
               "".join(f" {a}" for a in argv[2:])
    return None


def main() -> None:
    import sys

    hint = misplaced(sys.argv[1:])
    if hint is not None:
        typer.echo(hint, err=True)
        raise SystemExit(2)
    app()
