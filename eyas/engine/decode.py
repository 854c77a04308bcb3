"""Lossless speculative decoding with an EAGLE-3 draft: plain, chain and EAGLE-2 dynamic tree, one KV cache;
and method lookup, which verifies the lookup chain (eyas.engine.lookup) alone, with no draft.

One round (target cache holds x_0..x_{n-1}; the root x_n is accepted but not yet run by the target):
  1. draft step 0 over the rows accepted since the last round (fc(features), next token, position = row),
     appended to the draft's KV cache; its last row proposes depth 1 (docs/CONTRACTS.md, draft alignment);
  2. deeper draft steps feed back the parent's output with the node's token at position (n-1)+depth;
  3. the target verifies root + candidates in one forward (tree mask, positions n + depth) and captures
     the layout's streams at every candidate;
  4. the longest accepted path plus one bonus token is committed; its KV entries are compacted into the
     contiguous prefix and its features feed the next round's step 0.

Tree definition (`SpecParams.tokens` counts the root, like SGLang's num_draft_tokens): depth 1 is the
top-`topk` draft tokens after the root; each further depth expands the best `topk` frontier nodes by
cumulative log-prob into `topk` children each; the best `tokens - 1` candidates overall (ties: shallower
first, so every kept node's parent is kept) are verified with the root. Candidate pool =
topk + (depth-1)*topk^2. A chain of `steps` is the tree with topk 1, depth steps, tokens steps+1.

Sampling (lossless, see eyas/engine/sampling.py): the tree's candidates are chosen deterministically (top-k),
so each is verified as a point-mass proposal: accept child x with probability p(x), else remove x from
p, renormalise and try the next sibling; if all fail, draw the bonus from what is left. Using the draft's
softmax as q with deterministically chosen tokens would NOT be lossless (q(x)=0.6, p(x)=0.3 would emit x
half the time). The chain (and a topk-1 tree, which is one) samples its candidates from the draft's
warped distribution q (same temperature/top-k/top-p as p) and accepts with min(1, p/q), residual
norm(max(p-q, 0)) — the classic scheme, which gains when the draft spreads mass like the target."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..draft import DraftCheckpoint, check_draft_for_target
from ..native import kernels
from ..native.quant import quantize_draft_q8
from ..target.device import sync_device as _sync
from ..target.load import Target, end_token_ids
from ..text import stop_cut
from .forward import KVCache, compact
from .lookup import lookup_chain
from .ngram import NgramTable, check_ngram_for_target
from .params import DRAFT_METHODS, EngineError, SamplingParams, SpecParams
from .sampling import rejection_step, sample, warp
from .stats import GenResult, GenStats
from .weights import engine_model


@dataclass
class _Tree:
    tokens: list[int]  # [S] target ids, 0 = root
    parents: list[int]  # [S] tree index of the parent, -1 for the root
    depths: list[int]  # [S]
    children: list[list[int]]  # per node, in the draft's preference order
    q: list[torch.Tensor | None]  # per node: draft distribution (target vocab) it was sampled from, or None
    origin: list[str] = field(default_factory=list)  # per node: "root", "draft", or "lookup" / "ngram" (only they)

    @staticmethod
    def rooted(root: int) -> _Tree:
        return _Tree(tokens=[root], parents=[-1], depths=[0], children=[[]], q=[None], origin=["root"])

    def add(self, parent: int, token: int, q: torch.Tensor | None = None, origin: str = "draft") -> int:
        i = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.children.append([])
        self.children[parent].append(i)
        self.q.append(q)
        self.origin.append(origin)
        return i


class Engine:
    def __init__(self, target: Target, draft: DraftCheckpoint | None = None, spec: SpecParams | None = None,
                 ngram: NgramTable | None = None, model=None):
        """`model`: the forward to run instead of engine_model(target, spec.weights), with TargetModel's interface
        (eyas.replay.recorded.RecordedModel answers from a recording, so `target` may hold no weights)."""
        self.target = target
        self.spec = spec or SpecParams()
        if ngram is not None:
            check_ngram_for_target(ngram, target)
        # proposes where context lookup finds nothing, so only methods with lookup candidates consult it
        self.ngram = ngram if self.spec.lookup else None
        self.model = model if model is not None else engine_model(target, self.spec.weights)
        native = self.model.native
        # the mode auto resolved to
        self.weights = "fp32" if native is None else "native" if native.act == "q8" else "native-bf16"
        self.weights_note: str | None = self.model.fallback  # why auto did not run native, if it did not
        self.device = self.model.device
        self.draft = None
        self.draft_layer: kernels.DraftLayer | None = None  # a q8 draft's layer in one C call
        self.draft_manifest: dict | None = draft.manifest if draft is not None else None  # its training record
        self.draft_weights: str | None = None  # what auto resolved to, with a draft
        self.spec.validate(draft.model.config.draft_vocab_size if draft is not None else None)
        if draft is not None:
            check_draft_for_target(draft, target)
            d = draft.model
            d.to(device=self.device, dtype=self.model.dtype)
            d.eval()
            d.requires_grad_(False)
            d.set_embeddings(self.model.embed_weight)
            dw = self.spec.draft_weights
            if dw == "auto":
                dw = "fp32" if self.weights == "fp32" else "q8"
            if dw == "q8":
                if self.device.type != "cpu" or self.model.dtype != torch.float32:
                    raise EngineError("--draft-weights q8 runs on the CPU in fp32; use --draft-weights fp32")
                d = quantize_draft_q8(d)
                self.draft_layer = kernels.DraftLayer(d)
            self.draft_weights = dw
            self.draft = d
            self.aux_indices = list(draft.layout.aux_indices)
            self.draft_ids = d.target_token_ids()  # [Vd] target id of each draft token
        self.eos = set(end_token_ids(target.tokenizer, target.model))
        self.max_positions = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        self.last_result: GenResult | None = None
        # prompt tokens per prefill forward (0: the whole prompt in one). A server sets it: stream() then yields
        # an empty round between chunks, where other requests' rounds run, so a long prompt does not hold the
        # engine for its whole prefill
        self.prefill_chunk = 0

    @property
    def speculative(self) -> bool:
        return self.spec.method != "plain"

    @property
    def lookup_depth(self) -> int:
        """The longest chain lookup merges into a round's tree: the context's, or the n-gram table's."""
        return max(self.spec.lookup, self.spec.ngram_tokens if self.ngram is not None else 0)

    @property
    def drafts(self) -> bool:
        """An EAGLE-3 draft proposes (tree, chain); method lookup verifies the lookup chain alone."""
        return self.spec.method in DRAFT_METHODS

    # -- public API --------------------------------------------------------------------------------
    def generate(self, input_ids: list[int], params: SamplingParams | None = None) -> GenResult:
        for _ in self.stream(input_ids, params):
            pass
        assert self.last_result is not None
        return self.last_result

    def stream(self, input_ids: list[int], params: SamplingParams | None = None) -> Iterator[list[int]]:
        """Yield the new token ids of each round; afterwards `last_result` holds the GenResult."""
        params = params or SamplingParams()
        params.validate()
        prompt = [int(t) for t in input_ids]
        if not prompt:
            raise EngineError("empty prompt: at least one input token is needed")
        V = self.model.config.vocab_size
        if min(prompt) < 0 or max(prompt) >= V:
            raise EngineError(f"prompt token ids must be in 0..{V - 1}; found {min(prompt)}..{max(prompt)}")
        depth, topk, ntok = self.spec.shape()
        margin = ntok + self.lookup_depth + 1 if self.speculative else 1
        need = len(prompt) + params.max_new_tokens + margin
        if len(prompt) + params.max_new_tokens > self.max_positions:
            raise EngineError(f"prompt ({len(prompt)}) + max_new_tokens ({params.max_new_tokens}) exceeds the "
                              f"target's {self.max_positions} positions; shorten one of them")
        gen = None
        if params.temperature > 0:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed if params.seed is not None else int(torch.seed() % (1 << 62)))
        self.last_result = None
        return self._iterate(_Run(self, prompt, params, gen, need, depth, topk, ntok))

    def _iterate(self, run: _Run) -> Iterator[list[int]]:
        # a separate generator so that stream() validates its arguments when called, not at the first next()
        yield from run.loop()
        self.last_result = run.result()


class _Run:
    """State of one generation."""

    def __init__(self, eng: Engine, prompt: list[int], params: SamplingParams, gen, max_len: int,
                 depth: int, topk: int, ntok: int):
        self.e, self.p, self.gen = eng, params, gen
        self.prompt = prompt
        self.depth, self.topk, self.ntok = depth, topk, ntok
        mp = eng.spec.min_prob
        self.log_min_prob = math.log(mp) if mp > 0 else -math.inf  # compared with cumulative draft log-probs
        self.dev = eng.device
        self.cache: KVCache = eng.model.new_cache(1, max_len)
        if eng.drafts:
            d = eng.draft.config
            dlen = max_len + max(depth - 1, 0) * topk + 1
            shape = (1, d.num_key_value_heads, dlen, d.head_dim)
            self.dk = torch.empty(shape, dtype=eng.model.dtype, device=self.dev)
            self.dv = torch.empty(shape, dtype=eng.model.dtype, device=self.dev)
            self.dlen = 0  # committed draft rows
        self.out: list[int] = []
        self.finish: str | None = None
        self.text_checked = 0  # tokens already searched for stop strings
        self.stop_text: str | None = None
        max_depth = max(depth, eng.lookup_depth) if eng.speculative else 0
        self.stats = GenStats(prompt_tokens=len(prompt), accepted_per_depth=[0] * max_depth,
                              proposed_per_depth=[0] * max_depth)

    # -- token choice ------------------------------------------------------------------------------
    def pick(self, logits: torch.Tensor) -> int:
        """Plain choice from target logits [V] (greedy or warped sampling)."""
        if self.gen is None:
            return int(logits.argmax())
        return sample(self.target_probs(logits), self.gen)

    def target_probs(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.p
        return warp(logits, p.temperature, p.top_k, p.top_p)

    # -- main loop ---------------------------------------------------------------------------------
    def loop(self) -> Iterator[list[int]]:
        e, st = self.e, self.stats
        t0 = time.perf_counter()
        n = len(self.prompt)
        step = e.prefill_chunk if 0 < e.prefill_chunk < n else n
        parts = []  # captured features of each prefill chunk
        for a in range(0, n, step):
            b = min(a + step, n)
            t1 = time.perf_counter()
            ids = torch.tensor([self.prompt[a:b]], device=self.dev)
            pos = torch.arange(a, b, device=self.dev)[None]
            # a later chunk attends to the cached earlier ones (causal over the prefix): the same prompt state
            fo = e.model.forward(ids, pos, self.cache, capture=e.aux_indices if e.drafts else None,
                                 logits="last" if b == n else "none")
            self.cache.length = b
            st.target_forwards += 1
            if e.drafts:
                parts.append(fo.aux)
            if b < n:
                _sync(self.dev)
                st.prefill_s += time.perf_counter() - t1
                yield []  # between chunks: the caller may run other requests' rounds here
        root = self.pick(fo.logits[0, -1])
        _sync(self.dev)
        st.prefill_s += time.perf_counter() - t1
        if e.drafts:
            feats = parts[0] if len(parts) == 1 else torch.cat(parts, 1)  # [1, n, nA*H]
            rows_tokens = self.prompt[1:] + [root]  # row t uses x_{t+1}
        new = self.commit([root])
        if new:
            yield new
        while self.finish is None:
            if not e.speculative:
                t1 = time.perf_counter()
                n = self.cache.length
                fo = e.model.forward(torch.tensor([[root]], device=self.dev), torch.tensor([[n]], device=self.dev),
                                     self.cache, logits="last")
                self.cache.length = n + 1
                root = self.pick(fo.logits[0, -1])
                st.verify_s += time.perf_counter() - t1
                accepted = [root]
            else:
                t1 = time.perf_counter()
                tree = self.draft_tree(feats, rows_tokens, root) if e.drafts else _Tree.rooted(root)
                if e.spec.lookup:
                    self.merge_lookup(tree)
                _sync(self.dev)
                t2 = time.perf_counter()
                path, bonus, fo = self.verify(tree)
                accepted = [tree.tokens[i] for i in path[1:]] + [bonus]
                if e.drafts:
                    feats = fo.aux[:, path]  # [1, len(path), nA*H] features at the accepted positions
                    rows_tokens = accepted
                root = bonus
                _sync(self.dev)
                st.draft_s += t2 - t1
                st.verify_s += time.perf_counter() - t2
            st.rounds += 1
            st.target_forwards += 1
            new = self.commit(accepted)
            if new:
                yield new
        st.total_s = time.perf_counter() - t0

    def commit(self, tokens: list[int]) -> list[int]:
        """Append accepted tokens up to EOS / max_new_tokens / a stop string; set `finish`."""
        new: list[int] = []
        for t in tokens:
            new.append(t)
            self.out.append(t)
            if t in self.e.eos:
                self.finish = "stop"
                break
            if len(self.out) >= self.p.max_new_tokens:
                self.finish = "length"
                break
        if self.p.stop:
            cut = self.find_stop()
            if cut is not None:
                keep_new = len(new) - (len(self.out) - cut)
                del self.out[cut:]
                new = new[:max(keep_new, 0)]
                self.finish = "stop"
        self.stats.new_tokens = len(self.out)
        return new

    def find_stop(self) -> int | None:
        """Smallest token count whose text contains a stop string (only counts not yet searched)."""
        tok = self.e.target.tokenizer
        hit = stop_cut(lambda ids: tok.decode(ids, skip_special_tokens=True), self.out, self.p.stop,
                       self.text_checked + 1)
        if hit is not None:
            k, self.stop_text = hit
            return k
        self.text_checked = len(self.out)
        return None

    def result(self) -> GenResult:
        tok = self.e.target.tokenizer
        text = self.stop_text if self.stop_text is not None else tok.decode(self.out, skip_special_tokens=True)
        return GenResult(token_ids=list(self.out), text=text, finish_reason=self.finish or "length",
                         stats=self.stats)

    # -- drafting ----------------------------------------------------------------------------------
    def draft_step(self, hidden: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, slot: int,
                   mask: torch.Tensor) -> torch.Tensor:
        """Rows hidden [1,R,H], ids/pos [1,R] written at draft-cache slots [slot, slot+R) -> layer out [1,R,H].
        mask [1,1,R,slot+R] bool over cache+new."""
        d = self.e.draft
        self.stats.draft_forwards += 1
        if self.e.draft_layer is not None:
            return self.e.draft_layer(hidden, d.embed(ids), pos, self.dk, self.dv, slot, mask)
        R = ids.shape[1]
        q, k, v = d.qkv(hidden, ids, pos)
        self.dk[:, :, slot:slot + R] = k
        self.dv[:, :, slot:slot + R] = v
        return d.finish(d.attend(q, self.dk[:, :, :slot + R], self.dv[:, :, :slot + R], mask), hidden)

    def draft_tree(self, feats: torch.Tensor, rows_tokens: list[int], root: int) -> _Tree:
        d, dev = self.e.draft, self.dev
        # step 0 over the rows accepted since the last round: fc(features), next token, position = row
        m, n0 = len(rows_tokens), self.dlen
        n = n0 + m  # == target cache length; the root x_n sits at position n
        pos = torch.arange(n0, n, device=dev)[None]
        mask = (torch.arange(n, device=dev)[None, :] <= pos[0, :, None])[None, None]  # causal [1,1,m,n]
        hid = d.fc(feats)  # [1, m, H]
        out = self.draft_step(hid, torch.tensor([rows_tokens], device=dev), pos, n0, mask)
        self.dlen = n
        h_root = out[:, -1:]  # [1, 1, H]
        logits = d.logits(h_root)[0]  # [1, Vd]
        sample_chain = self.gen is not None and self.topk == 1
        K, D = self.topk, self.depth
        # pool of candidates: score, draft id, parent pool index (-1 = root), depth; per-node q when sampled
        scores: list[torch.Tensor] = []
        toks: list[torch.Tensor] = []
        parents: list[torch.Tensor] = []
        qs: list[torch.Tensor | None] = []
        depth_of: list[int] = []
        front_idx = torch.full((1,), -1, dtype=torch.long, device=dev)  # pool index of expanded nodes
        front_score = torch.zeros(1, device=dev)
        front_h = h_root  # [1, F, H] outputs of the rows run last (whose logits made `cand`)
        scratch = n  # next free draft-cache slot for tree rows
        anc: dict[int, list[int]] = {}  # pool index -> slots of itself and its run ancestors
        for dep in range(1, D + 1):
            Fn = logits.shape[0]
            if sample_chain:
                q_d = warp(logits[0], self.p.temperature, self.p.top_k, self.p.top_p)  # [Vd]
                tok = torch.tensor([[sample(q_d, self.gen)]], device=dev)
                lp = torch.zeros(1, 1, device=dev)
                qs.append(q_d)
            else:
                lp, tok = torch.log_softmax(logits.float(), -1).clamp_max(0.0).topk(K, dim=-1)  # [F, K]
                qs.extend([None] * (Fn * K))
            cand = (front_score[:, None] + lp).reshape(-1)  # [F*K]
            base = sum(t.numel() for t in toks)
            scores.append(cand)
            toks.append(tok.reshape(-1))
            parents.append(front_idx[:, None].expand(-1, tok.shape[1]).reshape(-1))
            depth_of.extend([dep] * cand.numel())
            if dep == D:
                break
            # next frontier: the best K candidates of this depth, run as draft rows
            kf = min(K, cand.numel())
            fs, fi = cand.topk(kf)
            if float(fs[0]) < self.log_min_prob:  # no deeper node can reach min_prob: stop drafting
                break
            fi_l = fi.tolist()
            pool_par = parents[-1][fi].tolist()
            hidden = front_h[:, fi // tok.shape[1]]  # [1, kf, H]: each candidate's parent row (cand = [F, K])
            ids = self.e.draft_ids[toks[-1][fi]][None]  # [1, kf] target ids
            posd = torch.full((1, kf), n - 1 + dep, device=dev)
            T = scratch + kf
            mk = torch.zeros(1, 1, kf, T, dtype=torch.bool, device=dev)
            mk[..., :n] = True
            for r, (ci, pp) in enumerate(zip(fi_l, pool_par, strict=True)):
                slots = anc.get(pp, []) + [scratch + r]
                anc[base + ci] = slots
                mk[0, 0, r, slots] = True
            out = self.draft_step(hidden, ids, posd, scratch, mk)  # [1, kf, H]
            scratch = T
            logits = d.logits(out)[0]  # [kf, Vd]
            front_idx = fi + base
            front_score = fs
            front_h = out
        return self.select(scores, toks, parents, depth_of, qs, root)

    def select(self, scores, toks, parents, depth_of, qs, root) -> _Tree:
        """Keep the best tokens-1 candidates (ties: shallower first) and order them parents-first."""
        sc = torch.cat(scores).tolist()
        tk = self.e.draft_ids[torch.cat(toks)].tolist()
        par = torch.cat(parents).tolist()
        # a path's score never rises with depth, so the kept set stays closed under parents
        order = sorted((i for i in range(len(sc)) if sc[i] >= self.log_min_prob),
                       key=lambda i: (-sc[i], depth_of[i], i))[: self.ntok - 1]
        order.sort(key=lambda i: (depth_of[i], -sc[i], i))
        tree_idx = {-1: 0}
        tree = _Tree.rooted(root)
        for i in order:
            if par[i] not in tree_idx:
                raise AssertionError("tree selection dropped a parent")  # impossible: scores never rise with depth
            q = qs[i]
            if q is not None:  # draft-vocab distribution -> target vocab
                q = torch.zeros(self.e.model.config.vocab_size, device=self.dev).index_copy_(
                    0, self.e.draft_ids, q)
            tree_idx[i] = tree.add(tree_idx[par[i]], tk[i], q)
        return tree

    def merge_lookup(self, tree: _Tree) -> None:
        """Merge the lookup chain (or, when the context has no match, the n-gram table's) into the tree from the
        root: shared prefixes reuse the draft's nodes, the rest becomes a new branch (point-mass proposals, q
        None, so sampling stays lossless)."""
        sp, st = self.e.spec, self.stats
        room = self.p.max_new_tokens - len(self.out)  # never verify past what can be committed
        context = self.prompt + self.out
        origin, chain = "lookup", lookup_chain(context, min(sp.lookup, room), sp.lookup_ngram)
        if not chain and self.e.ngram is not None:
            origin, chain = "ngram", self.e.ngram.propose(context, min(sp.ngram_tokens, room))
        cur = 0
        for t in chain:
            nxt = next((c for c in tree.children[cur] if tree.tokens[c] == t), None)
            if nxt is None:
                nxt = tree.add(cur, t, origin=origin)
                if origin == "lookup":
                    st.lookup_proposed += 1
                else:
                    st.ngram_proposed += 1
            cur = nxt

    # -- verification ------------------------------------------------------------------------------
    def verify(self, tree: _Tree):
        e, dev, st = self.e, self.dev, self.stats
        S = len(tree.tokens)
        n = self.cache.length
        mask = torch.zeros(S, S, dtype=torch.bool)
        for i, p in enumerate(tree.parents):
            if p >= 0:
                mask[i] = mask[p]
            mask[i, i] = True
        ids = torch.tensor([tree.tokens], device=dev)
        pos = (torch.tensor(tree.depths, device=dev) + n)[None]
        fo = e.model.forward(ids, pos, self.cache, tree_mask=mask.to(dev), capture=e.aux_indices if e.drafts else None,
                             logits="all")
        logits = fo.logits[0]  # [S, V]
        path = [0]
        cur = 0
        if self.gen is None:
            best = logits.argmax(-1).tolist()
            while True:
                kids = tree.children[cur]
                if not kids:
                    break
                st.proposed_per_depth[tree.depths[cur]] += 1
                nxt = next((c for c in kids if tree.tokens[c] == best[cur]), None)
                if nxt is None:
                    break
                st.accepted_per_depth[tree.depths[cur]] += 1
                path.append(nxt)
                cur = nxt
            bonus = best[cur]
        else:
            while True:
                p = self.target_probs(logits[cur])
                kids = tree.children[cur]
                nxt = None
                if kids:
                    st.proposed_per_depth[tree.depths[cur]] += 1
                for c in kids:
                    ok, p = rejection_step(p, tree.tokens[c], tree.q[c], self.gen)
                    if ok:
                        nxt = c
                        break
                if nxt is None:
                    bonus = sample(p, self.gen)
                    break
                st.accepted_per_depth[tree.depths[cur]] += 1
                path.append(nxt)
                cur = nxt
        st.lookup_accepted += sum(tree.origin[i] == "lookup" for i in path[1:])
        st.ngram_accepted += sum(tree.origin[i] == "ngram" for i in path[1:])
        compact(self.cache, n, path)
        return path, bonus, fo
