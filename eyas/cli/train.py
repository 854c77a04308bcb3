"""eyas train: train an EAGLE-3 draft (eyas/train)."""

from __future__ import annotations

from typing import Any

import typer

from ..option import DEFAULT_TARGET
from ..train.config import TrainConfig
from .common import config_from, config_options, fail, user_errors


@config_options(TrainConfig)
def train(
    data: list[str] = typer.Option(..., "--data", help="shard folder(s); with --online a conversation source"),
    out: str = typer.Option(..., "--out", help="output folder: OUT/draft, OUT/checkpoint, metrics, curves"),
    target: str = typer.Option(None, "--target", help="default: the shards' target_source (online: smollm2-135m)"),
    data_tokens: str = typer.Option(None, "--data-tokens", help="per --data folder, at most N training tokens "
                                    "(a fixed random subset; 0 = all), e.g. 120000,65000: mixes data at a ratio"),
    aux_indices: str = typer.Option(None, "--aux-indices", help="online: stream indices, e.g. 2,15,27"),
    **given: Any,
) -> None:
    """Train an EAGLE-3 draft with training-time test on captured shards (or --online)."""
    from ..text import parse_int_list
    from ..train.loop import train as run_train

    online = given["online"]
    if online and target is None:
        target = DEFAULT_TARGET
    with user_errors():
        aux = parse_int_list(aux_indices, "--aux-indices")
        caps = parse_int_list(data_tokens, "--data-tokens")
    if aux is not None and not online:
        fail("--aux-indices applies to --online only: shards carry their own layout")
    cfg = config_from(TrainConfig, given, data=data, out=out, target=target, data_tokens=caps, aux_indices=aux)
    with user_errors():
        run_train(cfg)
