"""The candidate layouts the inference ranks: around each base layout (recorded, engine-configured, default), the
miswirings that really happen (shifted ids, the embedding in place of an id, permutations, the final state alone)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

from ..layout import default_aux_indices

FINAL_ONLY = "final state only"  # the [] candidate; the doctor names an engine view without aux ids by it too


def layout_candidates(recorded: Sequence[int] | None, num_layers: int, num_aux: int,
                      configured: Mapping[str, Sequence[int] | None] | None = None) -> list[tuple[list[int], str]]:
    """Candidate layouts around each base (the recorded layout, every engine-configured one, the default):
    the base; every id shifted +1 / -1 together and one at a time; the embedding (0) in place of each id;
    permutations; plus the final state alone (indices []). Labels say how each relates to its base; a
    candidate reached from two bases carries both labels."""
    L = num_layers
    bases: list[tuple[str, list[int]]] = []
    if recorded is not None:
        bases.append(("recorded", list(recorded)))
    for name, ids in (configured or {}).items():
        if ids is not None:
            bases.append((name, list(ids)))
    dflt = default_aux_indices(L)
    if len(dflt) == num_aux:
        bases.append(("default", dflt))
    labels: dict[tuple[int, ...], list[str]] = {}

    def add(ids: list[int], label: str, allow_dup: bool = False) -> None:
        if len(ids) != num_aux or not all(0 <= k <= L for k in ids):
            return
        if not allow_dup and len(set(ids)) != len(ids):
            return
        labels.setdefault(tuple(ids), [])
        if label not in labels[tuple(ids)]:
            labels[tuple(ids)].append(label)

    for name, b in bases:
        add(b, f"{name} {b}", allow_dup=True)
    for name, b in bases:
        add([k + 1 for k in b], f"{name} shifted +1")
        add([k - 1 for k in b], f"{name} shifted -1")
        for i, k in enumerate(b):
            for d in (1, -1):
                add(b[:i] + [k + d] + b[i + 1:], f"{name} with {k}->{k + d}")
            if k != 0:
                add(b[:i] + [0] + b[i + 1:], f"{name} with the embedding (0) in place of {k}")
        perms = itertools.permutations(range(len(b))) if len(b) <= 4 else \
            [tuple(reversed(range(len(b))))] + [tuple(j + 1 if j == i else j - 1 if j == i + 1 else j
                                                      for j in range(len(b))) for i in range(len(b) - 1)]
        for p in perms:
            if list(p) != list(range(len(b))):
                add([b[j] for j in p], f"{name} permuted {list(p)}")
    out = [(list(k), " = ".join(v[:2])) for k, v in labels.items()]
    out.append(([], f"{FINAL_ONLY} (1xH post-norm, no fc: EAGLE instead of EAGLE3)"))
    return out
