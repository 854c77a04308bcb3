"""One round's candidate tree: the EAGLE-3 draft's dynamic tree (EAGLE-2 style: expand the best frontier nodes by
cumulative log-prob, keep the best `tokens - 1` overall) and the lookup / n-gram chain merged into it.

Token-identical output depends on the exact float ops and ordering here: scores stay the draft's fp32
log-probs summed as tensors, the kept set is sorted on those floats with ties broken by depth then by pool
order, and min_prob is compared in log space against the same floats."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..draft import Eagle3Draft
from ..native import kernels
from .lookup import lookup_chain
from .ngram import NgramTable
from .params import SpecParams
from .sampling import sample, warp
from .sequence import Sequence


@dataclass
class Node:
    """A token of a round's tree: a draft candidate in the pool while drafting, a verified row once selected."""
    token: int  # target vocab id
    parent: int  # index of the parent in the same list; -1: the root (or none, for the root itself)
    depth: int  # 0 for the root
    score: float = 0.0  # cumulative draft log-prob of the path to it (0 for the root and lookup / n-gram nodes)
    # the draft distribution it was sampled from (draft vocab in the pool, target vocab in a Tree);
    # None: a point-mass proposal (top-k or lookup), verified by trying siblings in turn
    q: torch.Tensor | None = None
    origin: str = "draft"  # "root", "draft", "lookup" or "ngram"
    children: list[int] = field(default_factory=list)  # in the draft's preference order (Tree only)


@dataclass
class Tree:
    """The rows a round verifies: node 0 is the root and every parent comes before its children."""
    nodes: list[Node]

    @staticmethod
    def rooted(root: int) -> Tree:
        return Tree([Node(token=root, parent=-1, depth=0, origin="root")])

    def add(self, parent: int, token: int, q: torch.Tensor | None = None, origin: str = "draft",
            score: float = 0.0) -> int:
        i = len(self.nodes)
        self.nodes.append(Node(token, parent, self.nodes[parent].depth + 1, score, q, origin))
        self.nodes[parent].children.append(i)
        return i

    def child(self, node: int, token: int) -> int | None:
        """The first child of `node` that proposes `token`."""
        return next((c for c in self.nodes[node].children if self.nodes[c].token == token), None)

    def ancestor_mask(self) -> torch.Tensor:
        """[S, S] bool on the CPU: row i sees itself and its ancestors (the verify forward's tree attention)."""
        mask = torch.zeros(len(self.nodes), len(self.nodes), dtype=torch.bool)
        for i, node in enumerate(self.nodes):
            if node.parent >= 0:
                mask[i] = mask[node.parent]
            mask[i, i] = True
        return mask


@dataclass
class _Drafting:
    """One round's drafting in progress."""
    committed: int  # draft rows of the committed sequence (== the target cache length; the root's position)
    front_score: torch.Tensor  # [F] cumulative log-probs of the rows run last
    front_hidden: torch.Tensor  # [1, F, H] their draft-layer outputs
    slot: int  # next free draft-cache row for tree rows
    front: list[int] = field(default_factory=lambda: [-1])  # pool index of each row run last (-1: the root)
    pool: list[Node] = field(default_factory=list)  # every candidate; parent = pool index, -1 for the root
    rows: dict[int, list[int]] = field(default_factory=dict)  # pool index -> cache rows of it and its run ancestors


class TreeDrafter:
    """Drafts a round's tree with the EAGLE-3 draft (one round, steps 1-2 of eyas.engine.decode's round).

    Step 0 runs the rows accepted since the last round (fc(features), next token, position = row) into the
    sequence's draft cache; its last row proposes depth 1. Deeper steps feed back the parent's output with the
    node's token at position (n-1)+depth, attending to the committed rows and the node's own ancestors."""

    def __init__(self, draft: Eagle3Draft, layer: kernels.DraftLayer | None, draft_ids: torch.Tensor,
                 vocab_size: int, shape: tuple[int, int, int], min_prob: float, device: torch.device):
        self.draft = draft
        self.layer = layer  # a q8 draft's layer in one C call, or None: the torch modules
        self.draft_ids = draft_ids  # [Vd] target id of each draft token
        self.vocab_size = vocab_size  # the target's
        self.depth, self.topk, self.tokens = shape
        self.log_min_prob = math.log(min_prob) if min_prob > 0 else -math.inf  # compared with cumulative log-probs
        self.device = device

    def step(self, seq: Sequence, hidden: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, slot: int,
             mask: torch.Tensor) -> torch.Tensor:
        """Rows hidden [1,R,H], ids/pos [1,R] written at draft-cache rows [slot, slot+R) -> layer out [1,R,H].
        mask [1,1,R,slot+R] bool over cache+new."""
        d, cache = self.draft, seq.draft_cache
        assert cache is not None  # the drafter runs on sequences that have a draft
        seq.stats.draft_forwards += 1
        if self.layer is not None:
            return self.layer(hidden, d.embed(ids), pos, cache.keys, cache.values, slot, mask)
        R = ids.shape[1]
        q, k, v = d.qkv(hidden, ids, pos)
        cache.keys[:, :, slot:slot + R] = k
        cache.values[:, :, slot:slot + R] = v
        return d.finish(d.attend(q, cache.keys[:, :, :slot + R], cache.values[:, :, :slot + R], mask), hidden)

    def draft_tree(self, seq: Sequence) -> Tree:
        """The round's tree over seq.root: step 0, up to `depth` expansions, then the best `tokens - 1` kept."""
        committed, h_root = self._catch_up(seq)
        state = _Drafting(committed=committed, front_score=torch.zeros(1, device=self.device), front_hidden=h_root,
                          slot=committed)
        logits = self.draft.logits(h_root)[0]  # [1, Vd]
        for depth in range(1, self.depth + 1):
            scores, tokens = self._grow(seq, state, logits, depth)
            if depth == self.depth:
                break
            # next frontier: the best topk candidates of this depth, run as draft rows
            best_scores, best = scores.topk(min(self.topk, scores.numel()))
            if float(best_scores[0]) < self.log_min_prob:  # no deeper node can reach min_prob: stop drafting
                break
            logits = self._expand(seq, state, best_scores, best, tokens, depth)  # [kf, Vd]
        return self.select(state.pool, seq.root)

    def _catch_up(self, seq: Sequence) -> tuple[int, torch.Tensor]:
        """Step 0 over the rows accepted since the last round -> (committed rows n, the root's output [1, 1, H])."""
        d, dev, cache = self.draft, self.device, seq.draft_cache
        assert cache is not None and seq.features is not None  # a drafted sequence: its prefill set both
        m, n0 = len(seq.rows_tokens), cache.length
        n = n0 + m  # == target cache length; the root x_n sits at position n
        pos = torch.arange(n0, n, device=dev)[None]
        mask = (torch.arange(n, device=dev)[None, :] <= pos[0, :, None])[None, None]  # causal [1,1,m,n]
        hidden = d.fuse(seq.features)  # [1, m, H] (fc_norm then fc for an EAGLE 3.1 draft)
        out = self.step(seq, hidden, torch.tensor([seq.rows_tokens], device=dev), pos, n0, mask)
        cache.length = n
        return n, out[:, -1:]

    def _grow(self, seq: Sequence, state: _Drafting, logits: torch.Tensor,
              depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the frontier's children to the pool: the top-k of each row's distribution (logits [F, Vd]), or a
        token sampled from the warped distribution for a sampled chain. -> (cumulative log-probs [F*K], draft
        ids [F, K])."""
        q = None
        if seq.gen is not None and self.topk == 1:  # a sampled chain proposes from q, accepted with min(1, p/q)
            p = seq.params
            q = warp(logits[0], p.temperature, p.top_k, p.top_p)  # [Vd]
            tokens = torch.tensor([[sample(q, seq.gen)]], device=self.device)
            logp = torch.zeros(1, 1, device=self.device)
        else:
            logp, tokens = torch.log_softmax(logits.float(), -1).clamp_max(0.0).topk(self.topk, dim=-1)  # [F, K]
        scores = (state.front_score[:, None] + logp).reshape(-1)  # [F*K]
        width = tokens.shape[1]
        target_ids = self.draft_ids[tokens.reshape(-1)].tolist()
        for j, (score, token) in enumerate(zip(scores.tolist(), target_ids, strict=True)):
            state.pool.append(Node(token=token, parent=state.front[j // width], depth=depth, score=score, q=q))
        return scores, tokens

    def _expand(self, seq: Sequence, state: _Drafting, best_scores: torch.Tensor, best: torch.Tensor,
                tokens: torch.Tensor, depth: int) -> torch.Tensor:
        """Run the chosen candidates of `depth` (indices `best` [kf] into this depth's [F*K]) as draft rows, each
        attending to the committed rows and its own run ancestors -> their logits [kf, Vd]."""
        dev, kf = self.device, best.numel()
        base = len(state.pool) - tokens.numel()  # pool index of this depth's first candidate
        chosen = best.tolist()
        hidden = state.front_hidden[:, best // tokens.shape[1]]  # [1, kf, H]: each candidate's parent row
        ids = self.draft_ids[tokens.reshape(-1)[best]][None]  # [1, kf] target ids
        pos = torch.full((1, kf), state.committed - 1 + depth, device=dev)
        end = state.slot + kf
        mask = torch.zeros(1, 1, kf, end, dtype=torch.bool, device=dev)
        mask[..., :state.committed] = True
        for r, i in enumerate(chosen):
            rows = state.rows.get(state.pool[base + i].parent, []) + [state.slot + r]
            state.rows[base + i] = rows
            mask[0, 0, r, rows] = True
        out = self.step(seq, hidden, ids, pos, state.slot, mask)  # [1, kf, H]
        state.slot = end
        state.front = [base + i for i in chosen]
        state.front_score = best_scores
        state.front_hidden = out
        return self.draft.logits(out)[0]

    def select(self, pool: list[Node], root: int) -> Tree:
        """Keep the best tokens-1 candidates (ties: shallower first) and order them parents-first."""
        # a path's score never rises with depth, so the kept set stays closed under parents
        kept = sorted((i for i, c in enumerate(pool) if c.score >= self.log_min_prob),
                      key=lambda i: (-pool[i].score, pool[i].depth, i))[: self.tokens - 1]
        kept.sort(key=lambda i: (pool[i].depth, -pool[i].score, i))
        tree_index = {-1: 0}
        tree = Tree.rooted(root)
        for i in kept:
            c = pool[i]
            if c.parent not in tree_index:
                raise AssertionError("tree selection dropped a parent")  # impossible: scores never rise with depth
            q = c.q
            if q is not None:  # draft-vocab distribution -> target vocab
                q = torch.zeros(self.vocab_size, device=self.device).index_copy_(0, self.draft_ids, q)
            tree_index[i] = tree.add(tree_index[c.parent], c.token, q, score=c.score)
        return tree


def merge_lookup(tree: Tree, seq: Sequence, spec: SpecParams, ngram: NgramTable | None) -> None:
    """Merge the lookup chain (or, when the context has no match, the n-gram table's) into the tree from the
    root: shared prefixes reuse the draft's nodes, the rest becomes a new branch (point-mass proposals, q
    None, so sampling stays lossless)."""
    room = seq.room  # never verify past what can be committed
    context = seq.context
    origin, chain = "lookup", lookup_chain(context, min(spec.lookup, room), spec.lookup_ngram)
    if not chain and ngram is not None:
        origin, chain = "ngram", ngram.propose(context, min(spec.ngram_tokens, room))
    cur = 0
    for t in chain:
        nxt = tree.child(cur, t)
        if nxt is None:
            nxt = tree.add(cur, t, origin=origin)
            if origin == "lookup":
                seq.stats.lookup_proposed += 1
            else:
                seq.stats.ngram_proposed += 1
        cur = nxt
