"""The target replaced by its recording: answers eyas's engine forwards from one replay row.

eyas's engine runs with this in place of its forward (make_engine(..., model=RecordedModel)), so a replay
drafts, merges lookup candidates, verifies, commits and counts with the engine's own code; only the target's
answers come from the recording. A verified row is on the recorded path when its token and every ancestor's
token equal the recorded tokens at their positions: there the target's greedy next token is the recorded next
token and its stream states are the recorded ones. Rows off that path get all-zero logits and states: greedy
verification never reads them (it walks from the root along matching children only), and their states never
reach a draft (only accepted rows feed the next round).
"""

from __future__ import annotations

import torch

from ..engine.forward import ForwardOut, KVCache
from .rows import ReplayError, ReplayRows


class RecordedModel:
    native = None  # the engine's weights mode reads as fp32: the draft runs in fp32, unquantized
    fallback = None

    def __init__(self, rows: ReplayRows, config, embed_weight: torch.Tensor, device: torch.device | str = "cpu"):
        self.rows, self.config = rows, config
        self.device = torch.device(device)
        self.dtype = torch.float32
        self.embed_weight = embed_weight.to(device=self.device, dtype=self.dtype)
        self.vocab = int(config.vocab_size)
        self.row = -1
        self.x: list[int] = []
        self.states: torch.Tensor | None = None

    def use(self, i: int) -> None:
        """Answer from row i from now on."""
        self.row, self.x = i, self.rows.tokens[i]
        self.states = self.rows.states[i].to(device=self.device, dtype=self.dtype)  # [T, n_streams, H]

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        empty = torch.empty(1, batch, 1, max_len, 0)  # the engine's cache bookkeeping with no keys to keep
        return KVCache(empty, empty.clone())

    def _on_path(self, ids: list[int], pos: list[int], tree_mask: torch.Tensor | None) -> list[bool]:
        x = self.x
        match = [p < len(x) and t == x[p] for t, p in zip(ids, pos, strict=True)]
        if tree_mask is None:  # causal rows: row i is on the path when rows 0..i all match
            out, ok = [], True
            for m in match:
                ok = ok and m
                out.append(ok)
            return out
        anc = tree_mask.cpu()
        return [all(match[j] for j in anc[i].nonzero().flatten().tolist()) for i in range(len(ids))]

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache,
                tree_mask: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
                capture: list[int] | None = None, logits: str | torch.Tensor = "last",
                slots: torch.Tensor | None = None) -> ForwardOut:
        if input_ids.shape[0] != 1 or attn_mask is not None or slots is not None:
            raise ReplayError("a replay runs one sequence at a time")
        ids, pos = input_ids[0].tolist(), position_ids[0].tolist()
        on = self._on_path(ids, pos, tree_mask)
        if not on[0]:
            where = pos[0]
            raise ReplayError(f"row {self.row}: the engine ran token {ids[0]} at position {where}, where the "
                              f"recording holds {self.x[where] if where < len(self.x) else 'nothing'}: a replay "
                              "can only follow the target's greedy reply (temperature 0, no stop strings)")
        if tree_mask is None and not all(on):
            i = on.index(False)
            raise ReplayError(f"row {self.row}: the engine ran token {ids[i]} at position {pos[i]}, where the "
                              f"recording holds {self.x[pos[i]] if pos[i] < len(self.x) else 'nothing'}")
        S = len(ids)
        out_logits = None
        if not (isinstance(logits, str) and logits == "none"):
            rows = [S - 1] if isinstance(logits, str) and logits == "last" else \
                list(range(S)) if isinstance(logits, str) else logits.tolist()
            out_logits = torch.zeros(1, len(rows), self.vocab, device=self.device, dtype=self.dtype)
            for r, i in enumerate(rows):
                if not on[i]:
                    continue
                nxt = pos[i] + 1
                if nxt >= len(self.x):
                    raise ReplayError(f"row {self.row}: a verify needs the target's token at position {nxt}, past "
                                      f"the recording's {len(self.x)} tokens; capture the rows with a longer "
                                      "--lookahead (at least the tree depth + 1) or replay fewer --max-new-tokens")
                out_logits[0, r, self.x[nxt]] = 1.0
        aux = None
        if capture:
            cols = []
            for k in capture:
                if k not in self.rows.streams:
                    self.rows.check_streams(list(capture), "this replay")
                cols.append(self.rows.streams.index(k))
            assert self.states is not None
            T, _, H = self.states.shape
            aux = torch.zeros(1, S, len(cols) * H, device=self.device, dtype=self.dtype)
            for i in range(S):
                if on[i] and pos[i] < T:
                    aux[0, i] = self.states[pos[i], cols].reshape(-1)
        return ForwardOut(logits=out_logits, aux=aux, final=None)
