"""eyas recipe: the whole pipeline for a bundled target (eyas/recipe.py)."""

from __future__ import annotations

from typing import Any

import typer

from ..option import DEFAULT_TARGET
from ..recipe import STAGES, RecipeConfig
from .common import DeviceOpt, config_from, config_options, user_errors


@config_options(RecipeConfig)
def recipe(
    name: str = typer.Argument(DEFAULT_TARGET, help="the recipe (target) to run"),
    stages: str = typer.Option(",".join(STAGES), "--stages", help=f"subset of {','.join(STAGES)}"),
    device: str = DeviceOpt,
    **given: Any,
) -> None:
    """Run the whole pipeline (datagen -> ngram -> train -> bench -> ship) for a bundled target; resumable at every
    stage."""
    from ..recipe import run_recipe

    with user_errors():
        run_recipe(config_from(RecipeConfig, given, name=name, stages=tuple(s for s in stages.split(",") if s),
                               device=device))
