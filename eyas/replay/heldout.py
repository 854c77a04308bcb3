"""Replay rows cut from training samples, so `eyas train` reports the τ a served chain would reach beside its
held-out accuracy.

A sample's first assistant reply (its first run of loss positions) is the recorded reply and what comes before it
the prompt; the layout's own streams are the states. Where the reply was regenerated greedily by the target
(`eyas datagen`, temperature 0) this is the serving replay on the numerics that wrote it; on human replies
(--no-regenerate) it measures acceptance against that text, not serving. A verify in a reply's last rounds
compares drafts with the tokens after it, so each row replays its reply less the last depth + 1 tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from ..draft import DraftCheckpoint
from .rows import ReplayRows
from .run import chain, replay


def rows_from_samples(samples: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], target, layout,
                      depth: int) -> ReplayRows | None:
    """samples: (input_ids [S], loss_mask [S] bool, aux [S, nA*H]) -> rows of their first replies, None when no
    sample has a reply longer than depth + 2 tokens."""
    from ..target.load import end_token_ids

    H = target.hidden_size
    toks, plens, states, caps = [], [], [], []
    for ids, mask, aux in samples:
        on = mask.nonzero().flatten().tolist()
        if not on:
            continue
        p0 = on[0]
        p1 = p0
        while p1 < len(mask) and bool(mask[p1]):
            p1 += 1
        cap = (p1 - p0) - (depth + 1)
        if p0 < 1 or cap < 1:
            continue
        n = p0 + cap - 1
        toks.append([int(t) for t in ids.tolist()])
        plens.append(p0)
        states.append(aux[:n].float().reshape(n, layout.num_aux, H))
        caps.append(cap)
    if not toks:
        return None
    return ReplayRows(tokens=toks, prompt_lens=plens, states=states, streams=list(layout.aux_indices),
                      max_new_tokens=max(caps), eos=sorted(set(end_token_ids(target.tokenizer, target.model))),
                      identity=target.identity, numerics="shards", caps=caps)


def heldout_replay(draft, layout, source, items, target, k: int, limit: int) -> dict[str, Any]:
    """The replay τ of a chain of k on up to `limit` held-out samples (eyas.train.sources items)."""
    samples = []
    for it in items[:limit]:
        b = source.batch([it], torch.device("cpu"), 1 << 30)
        samples.append((b.input_ids[0], b.loss_mask[0], b.aux[0]))
    rows = rows_from_samples(samples, target, layout, k)
    if rows is None:
        return {}
    ck = DraftCheckpoint(model=draft, layout=layout, manifest={})
    was = draft.training
    try:
        res = replay(rows, target, ck, chain(k))
    finally:
        draft.train(was)
    return {"replay_k": k, "replay_tau": round(res.tau, 4), "replay_per_pos": res.per_pos,
            "replay_drafts": res.rounds, "replay_rows": len(rows)}


def simulated_length(acc: list[float], k: int) -> float:
    """The training frameworks' offline "simulated acceptance length": 1 + the sum over positions of the product
    of per-position accuracies, for a chain of k."""
    total, prod = 1.0, 1.0
    for a in acc[:k]:
        prod *= a
        total += prod
    return total
