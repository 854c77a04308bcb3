"""Wiring faults eyas can plant in its own copy of a draft, each replayed to see whether it reproduces what a
server counted: the founding failures of mis-served EAGLE-3 drafts, as one-line causes with their fixes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Fault:
    name: str
    cause: str  # one line: what the server does wrong, and the fix
    plant: Callable[[Any, int], None]  # (DraftCheckpoint, target layers) -> None, in place


def _shift(delta: int) -> Callable[[Any, int], None]:
    def plant(ck, L: int) -> None:
        ck.layout.aux_indices = [min(max(k + delta, 0), L) for k in ck.layout.aux_indices]
    return plant


def _embedding_first(ck, L: int) -> None:
    ck.layout.aux_indices = [0, *ck.layout.aux_indices[1:]]


def _drop_d2t(ck, L: int) -> None:
    ck.model.d2t.zero_()  # what vLLM's Eagle3 loader keeps when the weights carry no d2t: draft id = target id


def _untrained(ck, L: int) -> None:
    """Fresh random weights, the vocab map kept: a draft that was never trained, or another model's."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in ck.model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)


FAULTS: list[Fault] = [
    Fault("aux_ids_minus_1", "likely the aux layer ids: the server feeds the draft the layers one below the trained "
          "ones (SGLang's output-of ids read by vLLM as input-of); export with `eyas export --format vllm`",
          _shift(-1)),
    Fault("aux_ids_plus_1", "likely the aux layer ids: the server feeds the draft the layers one above the trained "
          "ones (input-of ids given +1 again, e.g. eagle_aux_layer_semantics \"sglang\" on vLLM ids); export with "
          "`eyas export --format vllm`", _shift(+1)),
    Fault("embedding_mixed_in", "likely the aux layer ids: the server feeds the draft the embedding output (id 0) "
          "in place of its lowest aux layer; the draft was trained on the layer states only; export with `eyas "
          "export --format vllm`, which writes the trained ids", _embedding_first),
    Fault("d2t_missing", "likely the draft->target vocab map: the server's draft has no d2t (vLLM then reads draft "
          "id i as target token i), so every drafted token is the wrong one; export with `eyas export --format "
          "vllm`, which writes d2t", _drop_d2t),
    Fault("untrained", "likely an untrained or foreign draft: the server's draft weights are not this draft's (random "
          "init, another checkpoint or another target's draft); point the server at the export of this draft",
          _untrained),
]

FAULT_NAMES = [f.name for f in FAULTS]
