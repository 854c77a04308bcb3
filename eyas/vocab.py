"""Draft vocabulary: the most frequent target tokens at assistant (loss-mask) positions of the training data.

Computed from the data of every run (never read from a cache), always includes the end-of-turn tokens
(eyas.target.end_token_ids: a draft that cannot propose the stop token never accepts the end of a reply), and
recorded in the checkpoint by hash with the hash of the dataset it was counted on.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from .errors import EyasError


class VocabError(EyasError):
    pass


@dataclass
class DraftVocab:
    ids: torch.Tensor  # [Vd] long, target ids sorted ascending
    target_vocab_size: int
    coverage: float  # fraction of counted assistant tokens whose id is in the draft vocab
    counted_tokens: int
    always: list[int]  # ids forced in (EOS / end of turn)
    source_hash: str  # identity of the data the counts came from
    requested_size: int

    @property
    def size(self) -> int:
        return self.ids.numel()

    @property
    def hash(self) -> str:
        return vocab_hash(self.ids)

    def to_manifest(self) -> dict[str, Any]:
        return {"size": self.size, "requested_size": self.requested_size, "hash": self.hash,
                "source_dataset_hash": self.source_hash, "coverage": round(self.coverage, 6),
                "counted_tokens": self.counted_tokens, "always_included": self.always,
                "target_vocab_size": self.target_vocab_size}


class TokenIdError(VocabError):
    """Stored token ids outside the vocabulary they claim: one line naming the file, the row and the fix."""


def check_token_ids(ids: torch.Tensor, offsets: list[int], vocab_size: int, file: object,
                    rows: list[int] | None, fix: str) -> None:
    """The one range check of stored token ids, for every reader of them (shards, replay rows): ids packed back
    to back (row i is ids[offsets[i]:offsets[i+1]]) must lie in 0..vocab_size-1. A digest only proves a file is
    what was written, not that its ids fit the target: an embedding lookup past the table crashes, and counted
    ids (an n-gram table) are refused only later, by whoever uses them, blaming the wrong artifact. rows: the
    source row id of each row, to name it as the user knows it (None: the row's index)."""
    flat = ids.reshape(-1)
    bad = ((flat < 0) | (flat >= vocab_size)).nonzero()
    if not bad.numel():
        return
    at = int(bad[0])
    i = min(bisect.bisect_right(offsets, at) - 1, len(offsets) - 2)  # the row whose span holds position `at`
    row = f"row {rows[i]} (sample {i})" if rows is not None else f"row {i}"
    raise TokenIdError(f"{file}: {row} holds token id {int(flat[at])} at position {at - offsets[i]}, "
                       f"{bad.numel()} id(s) in all outside the vocabulary; expected ids < {vocab_size} (the "
                       f"target's vocab_size); {fix}")


def vocab_hash(ids: torch.Tensor) -> str:
    return "sha256:" + hashlib.sha256(ids.long().cpu().numpy().tobytes()).hexdigest()[:24]


def count_tokens(batches: Iterable[tuple[torch.Tensor, torch.Tensor]], vocab_size: int) -> torch.Tensor:
    """(input_ids [S], loss_mask [S]) pairs -> counts [V] long of tokens at loss-mask positions."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in batches:
        sel = ids.reshape(-1)[mask.reshape(-1).bool()].long()
        # a backstop: every shard reader has checked its ids already (read_fields), naming file and row
        check_token_ids(sel, [0, sel.numel()], vocab_size, "the counted tokens", None,
                        "the data was tokenized for another target")
        counts += torch.bincount(sel, minlength=vocab_size)
    return counts


def select_draft_vocab(counts: torch.Tensor, size: int, always: list[int] | None = None,
                       source_hash: str = "") -> DraftVocab:
    """The `size` most frequent ids (ties by lower id, deterministic), `always` forced in; size is
    clamped to the target vocab."""
    V = counts.numel()
    always = sorted({int(a) for a in (always or [])})
    bad = [a for a in always if not 0 <= a < V]
    if bad:
        raise VocabError(f"forced draft-vocab ids {bad} are outside the target vocab 0..{V - 1}")
    requested = int(size)
    if requested < 1:
        raise VocabError(f"--draft-vocab must be >= 1, got {requested}")
    n = min(requested, V)
    if n < len(always):
        raise VocabError(f"--draft-vocab {n} cannot hold the {len(always)} end-of-turn ids {always}; raise it")
    total = int(counts.sum())
    if total == 0:
        raise VocabError("no assistant (loss-mask) tokens in the training data: cannot choose a draft vocab; "
                         "check the data's loss masks (datagen marks assistant replies)")
    # stable sort by -count keeps lower ids first among ties
    order = torch.sort(-counts, stable=True).indices
    keep = set(always)
    for i in order.tolist():
        if len(keep) >= n:
            break
        keep.add(i)
    ids = torch.tensor(sorted(keep), dtype=torch.long)
    coverage = float(counts[ids].sum()) / total
    return DraftVocab(ids=ids, target_vocab_size=V, coverage=coverage, counted_tokens=total, always=always,
                      source_hash=source_hash, requested_size=requested)


STALE_COVERAGE = 0.02  # a kept vocabulary this far below a fresh one's coverage is worth re-choosing


def stale_vocab_warning(kept: DraftVocab, fresh: DraftVocab, heldout: torch.Tensor) -> str | None:
    """A warm start keeps its draft's vocabulary (`kept`), chosen on earlier data; `fresh` is the one this run's
    training rows would choose. Both are scored on the held-out rows' reply tokens (`heldout`, counts [V]), which
    neither was chosen on: scored on the training rows, fresh always looks better, since it was picked to cover
    them (SmolLM2-135M's own replies, 2026-12: 98.2% vs 94.0% there, 92.6% vs 93.1% on held-out rows). When fresh
    covers clearly more held-out tokens, a one-line warning naming --refresh-vocab (every miss is a position the
    draft cannot get right); else None, and None without held-out tokens to judge on."""
    total = int(heldout.sum())
    if total == 0:
        return None
    k, f = (float(heldout[v.ids].sum()) / total for v in (kept, fresh))
    if f - k <= STALE_COVERAGE:
        return None
    return (f"warning: the --init-from draft's {kept.size}-token vocabulary covers {k:.1%} of the held-out rows' "
            f"reply tokens; {fresh.size} chosen from this data's training rows would cover {f:.1%}: pass "
            "--refresh-vocab to re-choose it (rows of the tokens both share are kept)")
