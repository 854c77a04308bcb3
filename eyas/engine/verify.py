"""Verification (steps 3-4 of eyas.engine.decode's round): the target runs the root and every candidate in one
forward under the tree's attention mask, the acceptance walk picks the longest accepted path and a bonus token,
and the path's KV entries become the cache's contiguous prefix.

Greedy: a child is accepted when it is the target's argmax. Sampling (lossless, eyas/engine/sampling.py):
each child is a proposal tried in turn by rejection_step (point mass when its q is None, min(1, p/q) with the
residual otherwise); when every child fails the bonus is drawn from what is left of p."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .forward import ForwardOut, TargetModel, compact
from .sampling import rejection_step, sample
from .sequence import Sequence
from .stats import GenStats
from .tree import Tree


@dataclass
class Verified:
    path: list[int]  # tree indices of the accepted path, the root first
    bonus: int  # the target's token after the path
    out: ForwardOut  # the verify forward: logits and (with a draft) the captured features at every tree row


def verify(model: TargetModel, seq: Sequence, tree: Tree, capture: list[int] | None) -> Verified:
    """Run the tree through the target at positions n + depth, walk it, and compact seq.cache to the path."""
    nodes = tree.nodes
    n = seq.cache.length
    dev = model.device
    ids = torch.tensor([[c.token for c in nodes]], device=dev)  # [1, S]
    pos = (torch.tensor([c.depth for c in nodes], device=dev) + n)[None]  # [1, S]
    fo = model.forward(ids, pos, seq.cache, tree_mask=tree.ancestor_mask().to(dev), capture=capture, logits="all")
    assert fo.logits is not None  # logits="all"
    logits = fo.logits[0]  # [S, V]
    if seq.gen is None:
        path, bonus = greedy_walk(tree, logits, seq.stats)
    else:
        path, bonus = sampled_walk(tree, logits, seq)
    seq.stats.lookup_accepted += sum(nodes[i].origin == "lookup" for i in path[1:])
    seq.stats.ngram_accepted += sum(nodes[i].origin == "ngram" for i in path[1:])
    compact(seq.cache, n, path)
    return Verified(path, bonus, fo)


def greedy_walk(tree: Tree, logits: torch.Tensor, stats: GenStats) -> tuple[list[int], int]:
    """Follow the child that is the target's argmax (logits [S, V]) -> (path, bonus)."""
    best = logits.argmax(-1).tolist()
    path, cur = [0], 0
    while True:
        node = tree.nodes[cur]
        if not node.children:
            break
        stats.proposed_per_depth[node.depth] += 1
        nxt = tree.child(cur, best[cur])
        if nxt is None:
            break
        stats.accepted_per_depth[node.depth] += 1
        path.append(nxt)
        cur = nxt
    return path, best[cur]


def sampled_walk(tree: Tree, logits: torch.Tensor, seq: Sequence) -> tuple[list[int], int]:
    """Try each node's children in order by rejection sampling against the warped target distribution (logits
    [S, V]); the bonus comes from the residual where all fail -> (path, bonus)."""
    stats, gen = seq.stats, seq.gen
    path, cur = [0], 0
    while True:
        p = seq.target_probs(logits[cur])
        node = tree.nodes[cur]
        nxt = None
        if node.children:
            stats.proposed_per_depth[node.depth] += 1
        for c in node.children:
            ok, p = rejection_step(p, tree.nodes[c].token, tree.nodes[c].q, gen)
            if ok:
                nxt = c
                break
        if nxt is None:
            return path, sample(p, gen)
        stats.accepted_per_depth[node.depth] += 1
        path.append(nxt)
        cur = nxt
