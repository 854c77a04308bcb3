"""eyas.engine.verify on hand-made trees and logits: the greedy walk follows the child that is the target's
argmax as deep as it goes and takes the argmax after it as the bonus (nothing accepted, everything accepted,
argmax ties, siblings sharing a token), counting proposed / accepted per depth; the sampled walk tries siblings
in order, accepts a point mass with probability p(x) and never draws a rejected token as the bonus; and
verify() runs the tree at positions n + depth under its ancestor mask, compacts the cache to the accepted path
and credits lookup / n-gram acceptances."""

from __future__ import annotations

import torch

from eyas.engine.forward import ForwardOut, KVCache
from eyas.engine.params import SamplingParams
from eyas.engine.sequence import Sequence
from eyas.engine.stats import GenStats
from eyas.engine.tree import Tree
from eyas.engine.verify import greedy_walk, sampled_walk, verify

V = 8


def stats(depth: int = 4) -> GenStats:
    return GenStats(accepted_per_depth=[0] * depth, proposed_per_depth=[0] * depth)


def argmax_logits(best: list[int]) -> torch.Tensor:
    """[S, V] logits whose argmax at row i is best[i] (a clear margin, so nothing ties by accident)."""
    logits = torch.zeros(len(best), V)
    logits[torch.arange(len(best)), torch.tensor(best)] = 5.0
    return logits


def two_branch_tree() -> Tree:
    """root 0 -> a:1 -> c:3 -> e:5 ; root -> b:2 -> d:4 (tree indices 1..5 in that order)."""
    t = Tree.rooted(0)
    a = t.add(0, 1)
    b = t.add(0, 2)
    c = t.add(a, 3)
    t.add(b, 4)
    t.add(c, 5)
    return t


# -- greedy -----------------------------------------------------------------------------------------

def test_greedy_follows_the_argmax_branch_to_its_end():
    t = two_branch_tree()
    st = stats()
    # rows: root wants 1, a wants 3, b wants 4, c wants 5, d wants 7, e wants 6
    path, bonus = greedy_walk(t, argmax_logits([1, 3, 4, 5, 7, 6]), st)
    assert path == [0, 1, 3, 5] and bonus == 6  # e is a leaf: the bonus is e's argmax
    assert st.proposed_per_depth == [1, 1, 1, 0] and st.accepted_per_depth == [1, 1, 1, 0]


def test_greedy_takes_the_other_branch_when_the_target_wants_it():
    t = two_branch_tree()
    st = stats()
    path, bonus = greedy_walk(t, argmax_logits([2, 3, 4, 5, 7, 6]), st)
    assert path == [0, 2, 4] and bonus == 7
    assert st.accepted_per_depth == [1, 1, 0, 0]


def test_greedy_stops_at_the_first_mismatch_with_the_targets_token_as_bonus():
    t = two_branch_tree()
    st = stats()
    path, bonus = greedy_walk(t, argmax_logits([1, 6, 4, 5, 7, 6]), st)  # a's argmax 6 is not its child 3
    assert path == [0, 1] and bonus == 6
    assert st.proposed_per_depth == [1, 1, 0, 0] and st.accepted_per_depth == [1, 0, 0, 0]


def test_greedy_accepts_nothing_when_no_child_of_the_root_matches():
    t = two_branch_tree()
    st = stats()
    path, bonus = greedy_walk(t, argmax_logits([7, 3, 4, 5, 7, 6]), st)
    assert path == [0] and bonus == 7
    assert st.proposed_per_depth == [1, 0, 0, 0] and st.accepted_per_depth == [0, 0, 0, 0]


def test_greedy_on_the_root_alone_is_a_plain_step():
    st = stats()
    path, bonus = greedy_walk(Tree.rooted(3), argmax_logits([4]), st)
    assert path == [0] and bonus == 4
    assert st.proposed_per_depth == [0, 0, 0, 0]  # nothing was proposed, so nothing counts as rejected


def test_greedy_argmax_tie_goes_to_the_lower_token_id():
    t = Tree.rooted(0)
    t.add(0, 5)
    t.add(0, 2)
    logits = torch.zeros(3, V)
    logits[0, [2, 5]] = 3.0  # the root ties between 2 and 5: torch's argmax, the first maximum, picks 2
    path, bonus = greedy_walk(t, logits, stats())
    assert path == [0, 2] and bonus == 0


def test_greedy_with_duplicate_siblings_follows_the_first():
    t = Tree.rooted(0)
    first = t.add(0, 3)
    second = t.add(0, 3)
    t.add(second, 6)
    path, bonus = greedy_walk(t, argmax_logits([3, 1, 6, 2]), stats())
    assert path == [0, first] and bonus == 1


# -- sampling ---------------------------------------------------------------------------------------

def sampling_seq(seed: int, temperature: float = 1.0) -> Sequence:
    cache = KVCache(torch.zeros(1, 1, 1, 16, 1), torch.zeros(1, 1, 1, 16, 1))
    return Sequence([1], SamplingParams(temperature=temperature), torch.Generator().manual_seed(seed), cache, None,
                    stats())


def peaked(rows: list[dict[int, float]]) -> torch.Tensor:
    """[S, V] logits whose softmax (temperature 1) puts the given probabilities on the given tokens, ~0 elsewhere."""
    logits = torch.full((len(rows), V), -1e4)
    for i, row in enumerate(rows):
        for tok, p in row.items():
            logits[i, tok] = float(torch.tensor(p).log())
    return logits


def test_sampled_walk_tries_siblings_in_order_and_skips_impossible_ones():
    t = Tree.rooted(0)
    t.add(0, 4)  # p(4) = 0: always rejected
    t.add(0, 6)  # p(6) = 1: always accepted
    for seed in range(20):
        seq = sampling_seq(seed)
        path, bonus = sampled_walk(t, peaked([{6: 1.0}, {1: 1.0}, {3: 1.0}]), seq)
        assert path == [0, 2] and bonus == 3
        assert seq.stats.proposed_per_depth[0] == 1 and seq.stats.accepted_per_depth[0] == 1


def test_sampled_walk_gives_the_first_uniform_draw_to_the_first_sibling():
    t = Tree.rooted(0)
    t.add(0, 2)
    t.add(0, 5)
    for seed in range(40):
        u = float(torch.rand((), generator=torch.Generator().manual_seed(seed)))
        path, _ = sampled_walk(t, peaked([{2: 0.5, 5: 0.5}, {7: 1.0}, {7: 1.0}]), sampling_seq(seed))
        # 2 is accepted on u < p(2); else the residual is 5 alone, which is then sure to be accepted
        assert path == ([0, 1] if u < 0.5 else [0, 2])


def test_sampled_walk_never_draws_a_rejected_token_as_the_bonus():
    t = Tree.rooted(0)
    t.add(0, 2)
    outcomes = set()
    for seed in range(200):
        path, bonus = sampled_walk(t, peaked([{2: 0.5, 5: 0.5}, {7: 1.0}]), sampling_seq(seed))
        if path == [0]:
            assert bonus == 5  # 2 was tried and rejected, so the residual holds 5 alone
        else:
            assert path == [0, 1] and bonus == 7
        outcomes.add(len(path))
    assert outcomes == {1, 2}  # p(2) = 0.5: both outcomes happen


def test_sampled_walk_accepts_a_candidate_drawn_from_the_target_itself():
    t = Tree.rooted(0)
    q = torch.zeros(V)
    q[[2, 5]] = 0.5
    t.add(0, 2, q=q)  # q == p: min(1, p/q) = 1
    for seed in range(20):
        path, _ = sampled_walk(t, peaked([{2: 0.5, 5: 0.5}, {7: 1.0}]), sampling_seq(seed))
        assert path == [0, 1]


def test_sampled_walk_draws_the_bonus_from_the_residual_of_a_distribution_proposal():
    t = Tree.rooted(0)
    q = torch.zeros(V)
    q[3] = 1.0  # the draft was sure of 3; the target gives it 0
    t.add(0, 3, q=q)
    for seed in range(30):
        path, bonus = sampled_walk(t, peaked([{1: 0.5, 4: 0.5}, {7: 1.0}]), sampling_seq(seed))
        assert path == [0] and bonus in (1, 4)


# -- verify() ---------------------------------------------------------------------------------------

class TableModel:
    """A target whose next-token argmax depends only on the fed token (NEXT), recording each forward; it writes
    each row's key as 100 + its tree index into its cache slot, as a real forward writes slots n..n+S-1."""

    device = torch.device("cpu")

    def __init__(self, nxt: dict[int, int]):
        self.nxt = nxt
        self.calls: list[dict] = []

    def forward(self, ids, pos, cache, tree_mask=None, capture=None, logits="all"):
        self.calls.append(dict(ids=ids.clone(), pos=pos.clone(), mask=tree_mask.clone(), capture=capture))
        S, n = ids.shape[1], cache.length
        cache.k[:, :, :, n:n + S] = (100 + torch.arange(S, dtype=torch.float32))[:, None]
        cache.v[:, :, :, n:n + S] = (200 + torch.arange(S, dtype=torch.float32))[:, None]
        return ForwardOut(argmax_logits([self.nxt[t] for t in ids[0].tolist()])[None], torch.zeros(1, S, 3), None)


def greedy_seq(n: int) -> Sequence:
    cache = KVCache(torch.zeros(1, 1, 1, 32, 1), torch.zeros(1, 1, 1, 32, 1))
    cache.k[:, :, :, :n] = -1.0  # the committed prefix, which verification must leave alone
    cache.length = n
    return Sequence([1] * n, SamplingParams(), None, cache, None, stats())


def test_verify_runs_rows_at_n_plus_depth_under_the_ancestor_mask():
    t = two_branch_tree()
    model = TableModel({0: 1, 1: 3, 2: 4, 3: 5, 4: 7, 5: 6})
    seq = greedy_seq(4)
    v = verify(model, seq, t, capture=[1, 2])  # type: ignore[arg-type]
    c = model.calls[0]
    assert c["ids"].tolist() == [[0, 1, 2, 3, 4, 5]]
    assert c["pos"].tolist() == [[4, 5, 5, 6, 6, 7]]
    assert torch.equal(c["mask"], t.ancestor_mask()) and c["capture"] == [1, 2]
    assert v.path == [0, 1, 3, 5] and v.bonus == 6 and v.out.aux is not None


def test_verify_compacts_the_cache_to_the_accepted_path():
    t = two_branch_tree()
    seq = greedy_seq(4)
    v = verify(TableModel({0: 2, 1: 3, 2: 4, 3: 5, 4: 7, 5: 6}), seq, t, None)  # type: ignore[arg-type]
    assert v.path == [0, 2, 4]
    assert seq.cache.length == 4 + 3
    assert seq.cache.k[0, 0, 0, :4, 0].tolist() == [-1.0] * 4
    assert seq.cache.k[0, 0, 0, 4:7, 0].tolist() == [100.0, 102.0, 104.0]  # rows 0, 2, 4 moved together
    assert seq.cache.v[0, 0, 0, 4:7, 0].tolist() == [200.0, 202.0, 204.0]


def test_verify_with_nothing_accepted_keeps_only_the_root():
    seq = greedy_seq(2)
    v = verify(TableModel({0: 7, 1: 3, 2: 4, 3: 5, 4: 7, 5: 6}), seq, two_branch_tree(), None)  # type: ignore[arg-type]
    assert v.path == [0] and v.bonus == 7 and seq.cache.length == 3
    assert seq.cache.k[0, 0, 0, 2, 0] == 100.0


def test_verify_credits_lookup_and_ngram_nodes_on_the_path_only():
    t = Tree.rooted(0)
    a = t.add(0, 1, origin="lookup")
    t.add(a, 2, origin="ngram")
    t.add(0, 3, origin="lookup")  # a sibling that is not accepted
    seq = greedy_seq(1)
    v = verify(TableModel({0: 1, 1: 2, 2: 4, 3: 4}), seq, t, None)  # type: ignore[arg-type]
    assert v.path == [0, 1, 2]
    assert seq.stats.lookup_accepted == 1 and seq.stats.ngram_accepted == 1
