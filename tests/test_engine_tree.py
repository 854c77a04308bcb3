"""eyas/engine/tree.py on hand-made nodes: a tree's parents, children and attention mask; the drafter's selection
of the best `tokens - 1` candidates (ties shallower first, parents before children, min_prob in log space); and
the lookup / n-gram chain merged from the root, sharing the draft's nodes where they agree."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from eyas.engine.stats import GenStats
from eyas.engine.tree import Node, Tree, TreeDrafter, merge_lookup


def small_tree() -> Tree:
    """root 10 -> a 11 (-> c 13), b 12: node indices 0 root, 1 a, 2 b, 3 c."""
    t = Tree.rooted(10)
    a = t.add(0, 11)
    t.add(0, 12)
    t.add(a, 13)
    return t


def test_nodes_know_their_parent_depth_and_children_in_order():
    t = small_tree()
    assert [(n.token, n.parent, n.depth) for n in t.nodes] == [(10, -1, 0), (11, 0, 1), (12, 0, 1), (13, 1, 2)]
    assert t.nodes[0].children == [1, 2] and t.nodes[1].children == [3] and t.nodes[3].children == []
    assert t.nodes[0].origin == "root" and t.nodes[1].origin == "draft"
    assert t.child(0, 12) == 2 and t.child(0, 13) is None and t.child(1, 13) == 3


def test_child_returns_the_first_sibling_with_the_token():
    t = Tree.rooted(1)
    first = t.add(0, 5)
    t.add(0, 5, origin="lookup")  # a duplicate proposal: verification tries the draft's first
    assert t.child(0, 5) == first


def test_ancestor_mask_lets_each_row_see_itself_and_its_ancestors_only():
    m = small_tree().ancestor_mask()
    want = torch.tensor([[1, 0, 0, 0],
                         [1, 1, 0, 0],
                         [1, 0, 1, 0],
                         [1, 1, 0, 1]], dtype=torch.bool)
    assert m.dtype == torch.bool and torch.equal(m, want)


def drafter(tokens: int, min_prob: float = 0.0, vocab: int = 100) -> TreeDrafter:
    """The drafter's selection needs no draft: only its shape, threshold and vocabulary."""
    d = TreeDrafter.__new__(TreeDrafter)
    d.tokens, d.vocab_size, d.device = tokens, vocab, torch.device("cpu")
    d.log_min_prob = math.log(min_prob) if min_prob > 0 else -math.inf
    d.draft_ids = torch.arange(vocab)
    return d


def pool() -> list[Node]:
    """Depth 1: 20 (-0.1), 21 (-0.5), 22 (-2.0); depth 2 under 20: 30 (-0.5, ties 21), 31 (-1.5)."""
    return [Node(20, -1, 1, -0.1), Node(21, -1, 1, -0.5), Node(22, -1, 1, -2.0),
            Node(30, 0, 2, -0.5), Node(31, 0, 2, -1.5)]


def test_selection_keeps_the_best_candidates_shallower_first_on_ties_and_parents_first():
    t = drafter(tokens=4).select(pool(), root=7)
    # the best 3 of 5: 20 (-0.1), then the tie at -0.5 broken by depth: 21 before 30
    assert [n.token for n in t.nodes] == [7, 20, 21, 30]
    assert [n.parent for n in t.nodes] == [-1, 0, 0, 1]  # 30 hangs under 20, re-indexed in the tree
    assert [n.score for n in t.nodes[1:]] == [-0.1, -0.5, -0.5]
    # room for two: of the tie at -0.5 the shallower candidate stays
    assert [n.token for n in drafter(tokens=3).select(pool(), root=7).nodes] == [7, 20, 21]


def test_selection_respects_the_token_budget_and_min_prob():
    assert [n.token for n in drafter(tokens=2).select(pool(), root=7).nodes] == [7, 20]
    # min_prob 0.3: log 0.3 = -1.20 keeps the scores -0.1, -0.5, -0.5, drops -1.5 and -2.0, whatever the budget
    t = drafter(tokens=16, min_prob=0.3).select(pool(), root=7)
    assert sorted(n.token for n in t.nodes[1:]) == [20, 21, 30]
    assert len(drafter(tokens=1).select(pool(), root=7).nodes) == 1  # the root alone: plain decoding


def test_selection_maps_a_sampled_nodes_distribution_to_target_ids():
    d = drafter(tokens=2, vocab=10)
    d.draft_ids = torch.tensor([3, 7])  # draft vocab of 2 -> target ids 3 and 7
    q = torch.tensor([0.25, 0.75])
    t = d.select([Node(7, -1, 1, 0.0, q=q)], root=1)
    assert t.nodes[1].q is not None and t.nodes[1].q.tolist() == [0, 0, 0, 0.25, 0, 0, 0, 0.75, 0, 0]


def seq_for(context: list[int], room: int = 16) -> SimpleNamespace:
    return SimpleNamespace(room=room, context=context, stats=GenStats())


def spec(lookup: int = 4, ngram_tokens: int = 4) -> SimpleNamespace:
    return SimpleNamespace(lookup=lookup, lookup_ngram=2, ngram_tokens=ngram_tokens)


def test_lookup_merges_from_the_root_sharing_the_drafts_nodes():
    # the context's last bigram (1, 2) was followed by 3, 4, 5 before: the chain is 3 4 5 (root = the token 2)
    context = [1, 2, 3, 4, 5, 9, 1, 2]
    t = Tree.rooted(2)
    a = t.add(0, 3)  # the draft proposed 3 too: shared
    t.add(a, 8)
    seq = seq_for(context)
    merge_lookup(t, seq, spec(lookup=3), None)
    assert t.child(0, 3) == a  # no duplicate of the shared token
    n4 = t.child(a, 4)
    assert n4 is not None and t.nodes[n4].origin == "lookup" and t.child(n4, 5) is not None
    assert seq.stats.lookup_proposed == 2 and seq.stats.ngram_proposed == 0


def test_lookup_never_proposes_past_the_room_left():
    context = [1, 2, 3, 4, 5, 9, 1, 2]
    t = Tree.rooted(2)
    merge_lookup(t, seq_for(context, room=1), spec(lookup=3), None)
    assert [n.token for n in t.nodes] == [2, 3]


def test_the_ngram_table_proposes_only_where_the_context_has_no_match():
    class Table:
        def __init__(self):
            self.asked = []

        def propose(self, context, n):
            self.asked.append(n)
            return [40, 41][:n]

    table = Table()
    t = Tree.rooted(9)
    seq = seq_for([5, 6, 7, 9])  # no earlier occurrence of the last n-gram
    merge_lookup(t, seq, spec(lookup=3, ngram_tokens=2), table)
    assert [(n.token, n.origin) for n in t.nodes[1:]] == [(40, "ngram"), (41, "ngram")]
    assert seq.stats.ngram_proposed == 2 and seq.stats.lookup_proposed == 0 and table.asked == [2]
    t2 = Tree.rooted(2)
    merge_lookup(t2, seq_for([1, 2, 3, 1, 2]), spec(lookup=3), table)  # a context match: the table is not asked
    assert table.asked == [2] and t2.nodes[1].origin == "lookup"
