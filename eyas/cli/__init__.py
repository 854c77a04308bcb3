"""The one `eyas` command; each subcommand maps to a module: this package's modules hold the commands by stage
(common.py the options they share), and this file registers them in the order `eyas --help` lists them."""

from __future__ import annotations

import typer

from . import data, decode, doctor, inspect, interop, recipe, replay, train

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="eyas: EAGLE-3 drafts with the hidden-state wiring checked end to end.")


@app.callback()
def _root() -> None:
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


def main() -> None:
    app()
