"""eyas/engine/verify.py on hand-made trees and logits: the greedy walk accepts the longest path of children that
are the target's argmax and adds the target's next token as the bonus (nothing accepted, everything accepted,
duplicates); the sampled walk tries siblings by rejection and draws the bonus from what is left; `verify` runs
the tree at positions n + depth under its ancestor mask and leaves the accepted path as the cache's prefix."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from eyas.engine.forward import ForwardOut, KVCache
from eyas.engine.params import SamplingParams
from eyas.engine.stats import GenStats
from eyas.engine.tree import Tree
from eyas.engine.verify import greedy_walk, sampled_walk, verify

V = 16


def stats() -> GenStats:
    return GenStats(accepted_per_depth=[0] * 4, proposed_per_depth=[0] * 4)


def argmax_logits(best: list[int]) -> torch.Tensor:
    """[S, V] logits whose row i has its argmax at best[i]."""
    x = torch.zeros(len(best), V)
    x[torch.arange(len(best)), torch.tensor(best)] = 5.0
    return x


def branchy() -> Tree:
    """root 1 -> 2 (-> 4 -> 6), 3 (-> 5): indices 0 root, 1 '2', 2 '3', 3 '4', 4 '5', 5 '6'."""
    t = Tree.rooted(1)
    a, b = t.add(0, 2), t.add(0, 3)
    c = t.add(a, 4)
    t.add(b, 5)
    t.add(c, 6)
    return t


def test_greedy_walk_follows_the_argmax_children_and_takes_the_bonus():
    s = stats()
    # the target wants 3 after the root, then 5, then 9: the path is root -> 3 -> 5, the bonus 9
    path, bonus = greedy_walk(branchy(), argmax_logits([3, 0, 5, 0, 9, 0]), s)
    assert (path, bonus) == ([0, 2, 4], 9)
    assert s.proposed_per_depth[:3] == [1, 1, 0] and s.accepted_per_depth[:3] == [1, 1, 0]


def test_greedy_walk_with_nothing_accepted_is_one_plain_token():
    s = stats()
    path, bonus = greedy_walk(branchy(), argmax_logits([7, 0, 0, 0, 0, 0]), s)
    assert (path, bonus) == ([0], 7)
    assert s.proposed_per_depth[0] == 1 and sum(s.accepted_per_depth) == 0


def test_greedy_walk_accepts_a_whole_chain():
    t = Tree.rooted(1)
    cur = 0
    for tok in (2, 3, 4):
        cur = t.add(cur, tok)
    s = stats()
    path, bonus = greedy_walk(t, argmax_logits([2, 3, 4, 8]), s)
    assert (path, bonus) == ([0, 1, 2, 3], 8)
    assert s.accepted_per_depth[:3] == [1, 1, 1] and s.proposed_per_depth[:3] == [1, 1, 1]


def test_greedy_walk_on_the_root_alone_proposes_nothing():
    s = stats()
    assert greedy_walk(Tree.rooted(1), argmax_logits([6]), s) == ([0], 6)
    assert sum(s.proposed_per_depth) == 0


def sampling_seq(seed: int) -> SimpleNamespace:
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=1.0)

    def target_probs(logits):
        return torch.softmax(logits.float(), -1)

    return SimpleNamespace(stats=stats(), gen=gen, params=params, target_probs=target_probs)


def test_sampled_walk_accepts_a_child_the_target_is_sure_of():
    t = Tree.rooted(1)
    t.add(0, 2)
    logits = torch.full((2, V), -1e4)
    logits[0, 2] = 0.0  # p = point mass on 2 after the root
    logits[1, 9] = 0.0
    for seed in range(5):
        assert sampled_walk(t, logits, sampling_seq(seed)) == ([0, 1], 9)


def test_sampled_walk_draws_the_bonus_from_what_the_rejected_siblings_leave():
    t = Tree.rooted(1)
    t.add(0, 2)
    t.add(0, 3)
    logits = torch.zeros(3, V)
    logits[0, 2] = logits[0, 3] = -1e4  # the target never wants either child
    seen = set()
    for seed in range(40):
        seq = sampling_seq(seed)
        path, bonus = sampled_walk(t, logits, seq)
        assert path == [0] and bonus not in (2, 3)
        seen.add(bonus)
        assert seq.stats.proposed_per_depth[0] == 1 and sum(seq.stats.accepted_per_depth) == 0
    assert len(seen) > 5  # a draw from the residual, not one fixed token


class StandIn:
    """A target whose argmax after token t is `nxt[t]`; it records what verify asked and writes, at each cache
    slot it fills, the tree row's index (so the compacted cache shows which rows were kept)."""

    device = torch.device("cpu")

    def __init__(self, nxt: dict[int, int]):
        self.nxt, self.calls = nxt, []

    def forward(self, ids, pos, cache, tree_mask=None, capture=None, logits="last"):
        self.calls.append((ids.clone(), pos.clone(), tree_mask.clone()))
        n, S = cache.length, ids.shape[1]
        cache.k[:, :, :, n:n + S] = torch.arange(S, dtype=torch.float32)[None, None, None, :, None]
        x = torch.zeros(1, S, V)
        for i, t in enumerate(ids[0].tolist()):
            x[0, i, self.nxt.get(t, 0)] = 1.0
        return ForwardOut(logits=x, aux=None, final=None)


def test_verify_runs_the_tree_at_its_depths_and_keeps_the_accepted_path_in_the_cache():
    t = branchy()
    t.nodes[2].origin = "lookup"  # the accepted '3' came from context lookup
    model = StandIn({1: 3, 3: 5, 5: 11})
    cache = KVCache(torch.full((1, 1, 1, 32, 1), -1.0), torch.zeros(1, 1, 1, 32, 1), length=7)
    seq = SimpleNamespace(cache=cache, gen=None, stats=stats())
    v = verify(model, seq, t, capture=None)
    assert (v.path, v.bonus) == ([0, 2, 4], 11)
    ids, pos, mask = model.calls[0]
    assert ids[0].tolist() == [1, 2, 3, 4, 5, 6]
    assert pos[0].tolist() == [7 + n.depth for n in t.nodes]  # the root sits at the cache's length
    assert torch.equal(mask, t.ancestor_mask())
    # the path's rows (0, 2, 4) are now slots 7, 8, 9, and the cache ends after them
    assert cache.length == 10 and cache.k[0, 0, 0, 7:10, 0].tolist() == [0.0, 2.0, 4.0]
    assert seq.stats.lookup_accepted == 1 and seq.stats.ngram_accepted == 0
