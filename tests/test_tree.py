"""eyas.engine.tree on hand-made tensors: a Tree's parents, depths, children order and ancestor mask; the
TreeDrafter's EAGLE-2 selection (the best `tokens - 1` candidates by cumulative draft log-prob, ties shallower
then pool order, kept parents-first; depth and topk bounding the pool; min_prob pruning and stopping early),
the positions, cache rows and attention masks of every draft step, a sampled chain's q carried into target
vocab; and merge_lookup sharing the draft's prefix and adding the rest as a lookup / n-gram branch.

The draft here is a bigram table (its distribution depends only on the token a row was fed) behind a drafter
whose `step` records its arguments, so every expected tree is worked out by hand below."""

from __future__ import annotations

import math

import pytest
import torch

from eyas.engine.forward import KVCache
from eyas.engine.params import SamplingParams, SpecParams
from eyas.engine.sequence import DraftCache, Sequence
from eyas.engine.stats import GenStats
from eyas.engine.tree import Node, Tree, TreeDrafter, merge_lookup

VOCAB = 16  # the target's
DRAFT_IDS = torch.tensor([10, 11, 12, 13])  # draft token j is target token 10 + j
ROOT = 5
# draft distribution after each fed target token, over the 4 draft tokens (no ties inside a top-2)
PROBS = {ROOT: [0.5, 0.3, 0.15, 0.05], 10: [0.1, 0.2, 0.64, 0.06], 11: [0.7, 0.15, 0.1, 0.05],
         12: [0.4, 0.3, 0.2, 0.1], 13: [0.25, 0.25, 0.25, 0.25], 7: [0.25, 0.25, 0.25, 0.25],
         8: [0.25, 0.25, 0.25, 0.25]}


class BigramDraft:
    """The two calls draft_tree makes on the draft besides `step`: features pass through, and a row's logits
    are the log of PROBS for the token written in its output's channel 0."""

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        return features

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        rows = [torch.tensor(PROBS[int(t)]).log() for t in out[0, :, 0].tolist()]
        return torch.stack(rows)[None]


class RecordingDrafter(TreeDrafter):
    """A step that writes (fed token, cache row) as its output and records what it was given, so tests read the
    positions, masks and fed-back parent outputs of every draft forward."""

    def __init__(self, shape: tuple[int, int, int], min_prob: float = 0.0):
        super().__init__(BigramDraft(), None, DRAFT_IDS, VOCAB, shape, min_prob, torch.device("cpu"))
        self.calls: list[dict] = []

    def step(self, seq, hidden, ids, pos, slot, mask):
        self.calls.append(dict(hidden=hidden.clone(), ids=ids.clone(), pos=pos.clone(), slot=slot, mask=mask.clone()))
        R = ids.shape[1]
        return torch.stack([ids[0].float(), torch.arange(slot, slot + R).float()], -1)[None]  # [1, R, 2]


def make_seq(rows_tokens: list[int], committed_before: int = 3, temperature: float = 0.0,
             prompt: list[int] | None = None, max_new: int = 64) -> Sequence:
    gen = None
    if temperature > 0:
        gen = torch.Generator().manual_seed(0)
    cache = KVCache(torch.zeros(1, 1, 1, 64, 1), torch.zeros(1, 1, 1, 64, 1))
    draft_cache = DraftCache.empty(1, 1, 64, torch.float32, torch.device("cpu"))
    draft_cache.length = committed_before
    seq = Sequence(prompt or [1, 2, 3], SamplingParams(temperature=temperature, max_new_tokens=max_new), gen, cache,
                   draft_cache, GenStats())
    seq.root = rows_tokens[-1]
    seq.rows_tokens = rows_tokens
    seq.features = torch.zeros(1, len(rows_tokens), 2)
    return seq


def shape_of(tree: Tree) -> list[tuple[int, int, int]]:
    return [(n.token, n.parent, n.depth) for n in tree.nodes]


# -- Tree ------------------------------------------------------------------------------------------

def test_tree_add_keeps_parents_depths_and_children_in_order():
    t = Tree.rooted(4)
    a = t.add(0, 9)
    b = t.add(0, 8, origin="lookup")
    c = t.add(a, 7, score=-1.5)
    assert shape_of(t) == [(4, -1, 0), (9, 0, 1), (8, 0, 1), (7, 1, 2)]
    assert t.nodes[0].children == [a, b] and t.nodes[a].children == [c]
    assert t.nodes[0].origin == "root" and t.nodes[b].origin == "lookup" and t.nodes[c].score == -1.5
    assert t.child(0, 8) == b and t.child(0, 7) is None and t.child(a, 7) == c


def test_child_finds_the_first_sibling_with_the_token():
    t = Tree.rooted(0)
    first = t.add(0, 3)
    t.add(0, 3)
    assert t.child(0, 3) == first


def test_ancestor_mask_sees_self_and_ancestors_only():
    t = Tree.rooted(0)
    a = t.add(0, 1)
    b = t.add(0, 2)
    t.add(a, 3)
    t.add(b, 4)
    expected = torch.tensor([[1, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0],
                             [1, 0, 1, 0, 0],
                             [1, 1, 0, 1, 0],
                             [1, 0, 1, 0, 1]], dtype=torch.bool)
    assert torch.equal(t.ancestor_mask(), expected)


# -- TreeDrafter: selection --------------------------------------------------------------------------

def test_depth_one_tree_is_the_root_and_its_topk_children_best_first():
    tree = RecordingDrafter((1, 3, 10)).draft_tree(make_seq([7, 8, ROOT]))
    assert shape_of(tree) == [(ROOT, -1, 0), (10, 0, 1), (11, 0, 1), (12, 0, 1)]
    assert [n.score for n in tree.nodes[1:]] == pytest.approx([math.log(0.5), math.log(0.3), math.log(0.15)])
    assert tree.nodes[0].children == [1, 2, 3]


def test_kept_set_is_the_best_scores_across_depths_ordered_parents_first():
    # pool: d1 10 (.5), 11 (.3); d2 10->12 (.32), 10->11 (.10), 11->10 (.21), 11->11 (.045).
    # 4 tokens keep 10, 10->12, 11: a depth-2 node beats a depth-1 one, yet depth 1 comes first in the tree
    tree = RecordingDrafter((2, 2, 4)).draft_tree(make_seq([7, 8, ROOT]))
    assert shape_of(tree) == [(ROOT, -1, 0), (10, 0, 1), (11, 0, 1), (12, 1, 2)]
    assert tree.nodes[3].score == pytest.approx(math.log(0.5 * 0.64), abs=1e-6)
    tree = RecordingDrafter((2, 2, 5)).draft_tree(make_seq([7, 8, ROOT]))
    assert shape_of(tree) == [(ROOT, -1, 0), (10, 0, 1), (11, 0, 1), (12, 1, 2), (10, 2, 2)]
    # within a depth, best score first: 11->10 (.21) is drafted after 10->11 (.10) but comes before it
    tree = RecordingDrafter((2, 2, 6)).draft_tree(make_seq([7, 8, ROOT]))
    assert shape_of(tree) == [(ROOT, -1, 0), (10, 0, 1), (11, 0, 1), (12, 1, 2), (10, 2, 2), (11, 1, 2)]


def test_pool_is_topk_plus_depth_minus_one_topk_squared_and_depth_bounded():
    d, k = 3, 2
    tree = RecordingDrafter((d, k, 100)).draft_tree(make_seq([7, 8, ROOT]))
    assert len(tree.nodes) - 1 == k + (d - 1) * k * k
    assert max(n.depth for n in tree.nodes) == d
    assert all(len(n.children) <= k for n in tree.nodes)
    assert all(tree.nodes[n.parent].depth == n.depth - 1 for n in tree.nodes[1:])
    # every node's parent comes before it, and depths never decrease along the list
    assert all(n.parent < i for i, n in enumerate(tree.nodes) if i)
    assert [n.depth for n in tree.nodes] == sorted(n.depth for n in tree.nodes)


@pytest.mark.parametrize("tokens", [1, 2, 3, 6])
def test_token_budget_counts_the_root(tokens):
    tree = RecordingDrafter((3, 2, tokens)).draft_tree(make_seq([7, 8, ROOT]))
    assert len(tree.nodes) == tokens


def test_select_breaks_ties_shallower_first_then_pool_order():
    drafter = RecordingDrafter((2, 2, 3))
    pool = [Node(20, -1, 1, -1.0), Node(21, -1, 1, -2.0), Node(22, 0, 2, -1.0), Node(23, 0, 2, -2.0)]
    # scores -1 (d1), -1 (d2), -2 (d1), -2 (d2): two kept, the depth-1 -1 first, then the depth-2 -1
    assert [n.token for n in drafter.select(pool, 0).nodes] == [0, 20, 22]
    drafter.tokens = 4  # the third place is a tie at -2 between depths 1 and 2: the shallower wins
    assert [n.token for n in drafter.select(pool, 0).nodes] == [0, 20, 21, 22]
    same = [Node(30, -1, 1, -1.0), Node(31, -1, 1, -1.0), Node(32, -1, 1, -1.0)]
    drafter.tokens = 3  # equal scores at one depth: pool order
    assert [n.token for n in drafter.select(same, 0).nodes] == [0, 30, 31]


def test_select_refuses_a_pool_whose_score_rises_with_depth():
    drafter = RecordingDrafter((2, 1, 2))
    pool = [Node(20, -1, 1, -3.0), Node(21, 0, 2, -1.0)]  # the child beats its parent: only it would be kept
    with pytest.raises(AssertionError, match="dropped a parent"):
        drafter.select(pool, 0)


# -- TreeDrafter: min_prob --------------------------------------------------------------------------

def test_min_prob_drops_unlikely_paths():
    tree = RecordingDrafter((2, 2, 10), min_prob=0.25).draft_tree(make_seq([7, 8, ROOT]))
    # .5, .32 and .3 reach 0.25; .21, .10 and .045 do not
    assert shape_of(tree) == [(ROOT, -1, 0), (10, 0, 1), (11, 0, 1), (12, 1, 2)]


def test_min_prob_stops_drafting_when_no_frontier_node_reaches_it():
    full = RecordingDrafter((3, 2, 10))
    full.draft_tree(make_seq([7, 8, ROOT]))
    assert len(full.calls) == 3  # step 0 and the runs of depths 1 and 2
    early = RecordingDrafter((3, 2, 10), min_prob=0.33)
    tree = early.draft_tree(make_seq([7, 8, ROOT]))
    assert len(early.calls) == 2  # depth 2's best is .32: its children can only be lower, so none is run
    assert shape_of(tree) == [(ROOT, -1, 0), (10, 0, 1)]


def test_min_prob_above_every_candidate_leaves_the_root_alone():
    drafter = RecordingDrafter((3, 2, 10), min_prob=0.9)
    tree = drafter.draft_tree(make_seq([7, 8, ROOT]))
    assert shape_of(tree) == [(ROOT, -1, 0)]
    assert len(drafter.calls) == 1


# -- TreeDrafter: what each draft step is fed ---------------------------------------------------------

def test_step_zero_runs_the_accepted_rows_causally_at_their_positions():
    seq = make_seq([7, 8, ROOT], committed_before=3)
    drafter = RecordingDrafter((1, 2, 3))
    drafter.draft_tree(seq)
    c = drafter.calls[0]
    assert c["ids"].tolist() == [[7, 8, ROOT]] and c["pos"].tolist() == [[3, 4, 5]] and c["slot"] == 3
    causal = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(c["mask"][0, 0], causal)
    assert seq.draft_cache.length == 6  # the committed rows now match the target cache


def test_deeper_steps_see_the_committed_rows_and_their_own_ancestors():
    drafter = RecordingDrafter((3, 2, 10))
    drafter.draft_tree(make_seq([7, 8, ROOT], committed_before=3))
    _, d1, d2 = drafter.calls
    n = 6  # committed rows; the root sits at position n
    # depth 1's frontier: 10 and 11, at position (n-1)+1 in scratch rows 6, 7, each fed the root's output (row 5)
    assert d1["ids"].tolist() == [[10, 11]] and d1["pos"].tolist() == [[n, n]] and d1["slot"] == n
    assert d1["hidden"][0, :, 1].tolist() == [5, 5]
    m1 = torch.zeros(2, 8, dtype=torch.bool)
    m1[:, :n] = True
    m1[0, 6] = m1[1, 7] = True
    assert torch.equal(d1["mask"][0, 0], m1)
    # depth 2's frontier: 10->12 (.32) and 11->10 (.21), fed their parents' outputs (rows 6 and 7)
    assert d2["ids"].tolist() == [[12, 10]] and d2["pos"].tolist() == [[n + 1, n + 1]] and d2["slot"] == 8
    assert d2["hidden"][0, :, 1].tolist() == [6, 7]
    m2 = torch.zeros(2, 10, dtype=torch.bool)
    m2[:, :n] = True
    m2[0, [6, 8]] = True
    m2[1, [7, 9]] = True
    assert torch.equal(d2["mask"][0, 0], m2)


def test_sampled_chain_carries_its_draft_distribution_in_target_vocab():
    one_hot = {ROOT: [1.0, 0.0, 0.0, 0.0], 10: [0.0, 0.0, 1.0, 0.0]}
    saved = {t: PROBS[t] for t in one_hot}
    PROBS.update(one_hot)
    try:
        tree = RecordingDrafter((2, 1, 3)).draft_tree(make_seq([7, 8, ROOT], temperature=1.0))
    finally:
        PROBS.update(saved)
    assert shape_of(tree) == [(ROOT, -1, 0), (10, 0, 1), (12, 1, 2)]
    for node, token in zip(tree.nodes[1:], [10, 12], strict=True):
        assert node.q is not None and node.q.shape == (VOCAB,)
        assert float(node.q[token]) == pytest.approx(1.0) and float(node.q.sum()) == pytest.approx(1.0)
        assert node.score == 0.0
    assert tree.nodes[0].q is None


def test_greedy_top_k_nodes_are_point_mass_proposals():
    tree = RecordingDrafter((2, 2, 5)).draft_tree(make_seq([7, 8, ROOT]))
    assert all(n.q is None for n in tree.nodes)


# -- merge_lookup -----------------------------------------------------------------------------------

def draft_tree_over(root: int) -> Tree:
    t = Tree.rooted(root)
    a = t.add(0, 40)
    t.add(a, 41)
    t.add(0, 50)
    return t


def test_lookup_chain_shares_the_draft_prefix_and_branches_off():
    # the context ends in 7 9, which last came before 40 41 42: the lookup proposes those; 40 41 are drafted
    seq = make_seq([9], prompt=[7, 9, 40, 41, 42, 7, 9])
    tree = draft_tree_over(9)
    merge_lookup(tree, seq, SpecParams(lookup=3), None)
    assert [(n.token, n.parent, n.origin) for n in tree.nodes[4:]] == [(42, 2, "lookup")]
    assert tree.nodes[2].origin == "draft"  # a shared node keeps its draft origin
    assert seq.stats.lookup_proposed == 1 and seq.stats.ngram_proposed == 0


def test_lookup_chain_is_cut_to_the_room_left():
    seq = make_seq([9], prompt=[7, 9, 60, 61, 62, 7, 9], max_new=2)
    tree = Tree.rooted(9)
    merge_lookup(tree, seq, SpecParams(lookup=3), None)
    assert shape_of(tree) == [(9, -1, 0), (60, 0, 1), (61, 1, 2)]
    assert seq.stats.lookup_proposed == 2


class FixedNgram:
    def __init__(self, chain: list[int]):
        self.chain = chain
        self.asked: list[int] = []

    def propose(self, context: list[int], length: int) -> list[int]:
        self.asked.append(length)
        return self.chain[:length]


def test_ngram_table_proposes_only_where_lookup_finds_nothing():
    ngram = FixedNgram([50, 51, 52])
    seq = make_seq([9], prompt=[1, 2, 3, 9])  # no earlier match of the context's tail
    tree = draft_tree_over(9)
    merge_lookup(tree, seq, SpecParams(lookup=3, ngram_tokens=2), ngram)  # type: ignore[arg-type]
    assert ngram.asked == [2]
    assert [(n.token, n.parent, n.origin) for n in tree.nodes[4:]] == [(51, 3, "ngram")]
    assert seq.stats.ngram_proposed == 1 and seq.stats.lookup_proposed == 0
    found = make_seq([9], prompt=[7, 9, 40, 7, 9])  # a match: the table is not consulted
    unused = FixedNgram([70])
    merge_lookup(draft_tree_over(9), found, SpecParams(lookup=2), unused)  # type: ignore[arg-type]
    assert unused.asked == [] and found.stats.ngram_proposed == 0
