"""`eyas ngram`: count the target's own regenerated replies (shard folders) into an n-gram table (eyas.engine.ngram)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..engine.ngram import NgramError, count_ngrams, write_ngram
from ..files import portable_command
from ..interrupt import Interrupted, StoppedNow, stop_on_signals
from .shards import ShardSet


@dataclass
class NgramConfig:
    data: list[str] = field(default_factory=list)  # eyas shard folders (regenerated replies)
    out: str = "runs/ngram"
    order: int = 3  # longest context, in tokens
    min_count: int = 2  # keep a context only when its top next token was seen this often

    def validate(self) -> None:
        if not self.data:
            raise NgramError("no --data: give one or more eyas shard folders (from `eyas datagen --regenerate`)")
        if not 1 <= self.order <= 8:
            raise NgramError(f"--order {self.order}: expected 1..8 context tokens")
        if self.min_count < 1:
            raise NgramError(f"--min-count {self.min_count}: expected >= 1")


def build_ngram(cfg: NgramConfig, log: Callable[[str], None] = print) -> Path:
    """Count the table over cfg.data's reply tokens (loss-masked positions) and write it to cfg.out."""
    cfg.validate()
    t0 = time.perf_counter()
    ss = ShardSet(cfg.data)  # one layout, hence one target, across the folders (checked)
    sources = []
    for f, m in zip(ss.folders, ss.manifests, strict=True):
        regen = bool((m.get("config") or {}).get("regenerate"))
        if not regen:
            log(f"[ngram] warning: {f} holds original replies, not the target's own (`eyas datagen "
                "--regenerate`): the table will predict human text, which the target does not write")
        sources.append({"folder": str(f), "regenerated": regen, "samples": sum(s["samples"] for s in m["shards"]),
                        "tokens": sum(s["tokens"] for s in m["shards"])})
    reply_tokens = 0

    def rows() -> Iterable[tuple[list[int], list[bool]]]:
        nonlocal reply_tokens
        for ids, mask in ss.token_rows():
            reply_tokens += int(mask.sum())
            yield ids.tolist(), mask.tolist()

    try:
        with stop_on_signals("eyas ngram", at_once=True):
            table = count_ngrams(rows(), cfg.order, cfg.min_count)
            if not any(table.values()):
                raise NgramError(f"no context reached --min-count {cfg.min_count} in {reply_tokens} reply tokens of "
                                 f"{', '.join(cfg.data)}: regenerate more replies or lower --min-count")
            seconds = round(time.perf_counter() - t0, 1)
            assert ss.layout.target is not None  # datagen records the target in every shard folder's layout
            out = write_ngram(cfg.out, table, {
                "target": ss.layout.target.to_dict(), "config": asdict(cfg), "sources": sources,
                "data_hash": ss.hash(), "reply_tokens": reply_tokens, "command": portable_command(),
                "seconds": seconds})
    except StoppedNow as stop:
        raise Interrupted(f"eyas ngram: stopped by {stop.signal_name}; nothing was written ({cfg.out} is as it was: "
                          "the table is written whole, at the end). Rerun to count again: "
                          f"{portable_command()}") from None
    log(f"[ngram] {sum(len(v) for v in table.values())} contexts (order <= {cfg.order}, min count "
        f"{cfg.min_count}) from {reply_tokens} reply tokens -> {out} ({seconds} s)")
    return out
