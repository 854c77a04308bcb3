"""Lossless speculative decoding with an EAGLE-3 draft: plain, chain and EAGLE-2 dynamic tree, one KV cache;
and method lookup, which verifies the lookup chain (eyas.engine.lookup) alone, with no draft. This module holds
the Engine and its round loop; a generation's state is an eyas.engine.sequence.Sequence, drafting is
eyas.engine.tree and verification eyas.engine.verify.

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

import time
from collections.abc import Generator, Iterator

import torch

from ..draft import DraftCheckpoint, Eagle3Draft, check_draft_for_target
from ..native import kernels
from ..native.quant import quantize_draft_q8
from ..target.device import sync_device as _sync
from ..target.load import Target, end_token_ids
from .forward import TargetModel
from .ngram import NgramTable, check_ngram_for_target
from .params import DRAFT_METHODS, EngineError, SamplingParams, SpecParams, TreeSettings
from .sequence import DraftCache, Sequence
from .stats import GenResult, GenStats
from .tree import Tree, TreeDrafter, merge_lookup
from .verify import verify
from .weights import engine_model


class Engine:
    def __init__(self, target: Target, draft: DraftCheckpoint | None = None, spec: SpecParams | None = None,
                 ngram: NgramTable | None = None, model: TargetModel | None = None):
        """`model`: the forward to run instead of engine_model(target, spec.weights), with TargetModel's interface
        (eyas.replay.recorded.RecordedModel answers from a recording, so `target` may hold no weights)."""
        self.target = target
        self.spec = spec or TreeSettings().spec("tree", None)  # the engine's full tree
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
        self.draft: Eagle3Draft | None = None
        self.draft_layer: kernels.DraftLayer | None = None  # a q8 draft's layer in one C call
        self.draft_manifest: dict | None = draft.manifest if draft is not None else None  # its training record
        self.draft_weights: str | None = None  # what auto resolved to, with a draft
        self.spec.validate(draft.model.config.draft_vocab_size if draft is not None else None)
        if draft is not None:
            self._attach_draft(draft)
        self.eos = set(end_token_ids(target.tokenizer, target.model))
        self.max_positions = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        self.last_result: GenResult | None = None
        # prompt tokens per prefill forward (0: the whole prompt in one). A server sets it: stream() then yields
        # an empty round between chunks, where other requests' rounds run, so a long prompt does not hold the
        # engine for its whole prefill
        self.prefill_chunk = 0

    def _attach_draft(self, draft: DraftCheckpoint) -> None:
        check_draft_for_target(draft, self.target)
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

    def stream(self, input_ids: list[int], params: SamplingParams | None = None) -> Generator[list[int], None, None]:
        """Yield the new token ids of each round; afterwards `last_result` holds the GenResult."""
        params = params or SamplingParams()
        params.validate()
        prompt = [int(t) for t in input_ids]
        if not prompt:
            raise EngineError("empty prompt: at least one input token is needed")
        V = self.model.config.vocab_size
        if min(prompt) < 0 or max(prompt) >= V:
            raise EngineError(f"prompt token ids must be in 0..{V - 1}; found {min(prompt)}..{max(prompt)}")
        shape = self.spec.shape()  # (depth, topk, tokens)
        margin = shape[2] + self.lookup_depth + 1 if self.speculative else 1
        need = len(prompt) + params.max_new_tokens + margin
        if len(prompt) + params.max_new_tokens > self.max_positions:
            raise EngineError(f"prompt ({len(prompt)}) + max_new_tokens ({params.max_new_tokens}) exceeds the "
                              f"target's {self.max_positions} positions; shorten one of them")
        gen = None
        if params.temperature > 0:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed if params.seed is not None else int(torch.seed() % (1 << 62)))
        self.last_result = None
        drafter = None
        if self.drafts:
            assert self.draft is not None  # a drafting method loads its draft (__init__)
            drafter = TreeDrafter(self.draft, self.draft_layer, self.draft_ids, V, shape, self.spec.min_prob,
                                  self.device)
        return self._iterate(self._new_sequence(prompt, params, gen, need, shape), drafter)

    def _new_sequence(self, prompt: list[int], params: SamplingParams, gen: torch.Generator | None, max_len: int,
                      shape: tuple[int, int, int]) -> Sequence:
        depth, topk, _ = shape
        draft_cache = None
        if self.drafts:
            assert self.draft is not None  # a drafting method loads its draft (__init__)
            d = self.draft.config
            # the committed rows, then one round's tree rows as scratch past them
            rows = max_len + max(depth - 1, 0) * topk + 1
            draft_cache = DraftCache.empty(d.num_key_value_heads, d.head_dim, rows, self.model.dtype, self.device)
        max_depth = max(depth, self.lookup_depth) if self.speculative else 0
        stats = GenStats(prompt_tokens=len(prompt), accepted_per_depth=[0] * max_depth,
                         proposed_per_depth=[0] * max_depth)
        return Sequence(prompt, params, gen, self.model.new_cache(1, max_len), draft_cache, stats)

    # -- the round loop ----------------------------------------------------------------------------
    def _iterate(self, seq: Sequence, drafter: TreeDrafter | None) -> Generator[list[int], None, None]:
        # a separate generator so that stream() validates its arguments when called, not at the first next()
        t0 = time.perf_counter()
        yield from self._prefill(seq)
        while seq.finish is None:
            accepted = self._speculative_round(seq, drafter) if self.speculative else self._plain_step(seq)
            seq.stats.rounds += 1
            seq.stats.target_forwards += 1
            new = seq.commit(accepted, self.eos, self.target.tokenizer)
            if new:
                yield new
        seq.stats.total_s = time.perf_counter() - t0
        self.last_result = seq.result(self.target.tokenizer)

    def _prefill(self, seq: Sequence) -> Iterator[list[int]]:
        """Run the prompt (in chunks of prefill_chunk, yielding [] between them), choose the first token."""
        st, dev = seq.stats, self.device
        n = len(seq.prompt)
        step = self.prefill_chunk if 0 < self.prefill_chunk < n else n
        parts: list[torch.Tensor] = []  # captured features of each prefill chunk, [1, chunk, nA*H]
        for a in range(0, n, step):
            b = min(a + step, n)
            t1 = time.perf_counter()
            ids = torch.tensor([seq.prompt[a:b]], device=dev)
            pos = torch.arange(a, b, device=dev)[None]
            # a later chunk attends to the cached earlier ones (causal over the prefix): the same prompt state
            fo = self.model.forward(ids, pos, seq.cache, capture=self.aux_indices if self.drafts else None,
                                    logits="last" if b == n else "none")
            seq.cache.length = b
            st.target_forwards += 1
            if self.drafts:
                assert fo.aux is not None  # capture=aux_indices (a draft has at least one)
                parts.append(fo.aux)
            if b < n:
                _sync(dev)
                st.prefill_s += time.perf_counter() - t1
                yield []  # between chunks: the caller may run other requests' rounds here
        assert fo.logits is not None  # the last chunk asked for logits="last"
        seq.root = seq.pick(fo.logits[0, -1])
        _sync(dev)
        st.prefill_s += time.perf_counter() - t1
        if self.drafts:
            seq.features = parts[0] if len(parts) == 1 else torch.cat(parts, 1)  # [1, n, nA*H]
            seq.rows_tokens = seq.prompt[1:] + [seq.root]  # row t uses x_{t+1}
        new = seq.commit([seq.root], self.eos, self.target.tokenizer)
        if new:
            yield new

    def _plain_step(self, seq: Sequence) -> list[int]:
        t1 = time.perf_counter()
        n = seq.cache.length
        fo = self.model.forward(torch.tensor([[seq.root]], device=self.device),
                                torch.tensor([[n]], device=self.device), seq.cache, logits="last")
        seq.cache.length = n + 1
        assert fo.logits is not None  # logits="last"
        seq.root = seq.pick(fo.logits[0, -1])
        seq.stats.verify_s += time.perf_counter() - t1
        return [seq.root]

    def _speculative_round(self, seq: Sequence, drafter: TreeDrafter | None) -> list[int]:
        """Draft (or only look up) a tree over the root, verify it; -> the accepted tokens, bonus last."""
        t1 = time.perf_counter()
        tree = drafter.draft_tree(seq) if drafter is not None else Tree.rooted(seq.root)
        if self.spec.lookup:
            merge_lookup(tree, seq, self.spec, self.ngram)
        _sync(self.device)
        t2 = time.perf_counter()
        v = verify(self.model, seq, tree, self.aux_indices if self.drafts else None)
        accepted = [tree.nodes[i].token for i in v.path[1:]] + [v.bonus]
        if self.drafts:
            assert v.out.aux is not None  # verify captured aux_indices
            seq.features = v.out.aux[:, v.path]  # [1, len(path), nA*H] features at the accepted positions
            seq.rows_tokens = accepted
        seq.root = v.bonus
        _sync(self.device)
        seq.stats.draft_s += t2 - t1
        seq.stats.verify_s += time.perf_counter() - t2
        return accepted
