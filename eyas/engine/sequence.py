"""One generation's state: its tokens, both KV caches, the inputs of its next round, its stop-string search, its
sampling generator and its statistics. Everything the engine keeps per sequence lives here, so a batch of
sequences is a list of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch

from ..text import stop_cut
from .forward import KVCache
from .params import SamplingParams
from .sampling import sample, warp
from .stats import GenResult, GenStats

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class DraftCache:
    """The draft layer's keys/values: rows [0, length) are the committed sequence's step-0 rows (row == position);
    a round's tree rows go past them as scratch and are overwritten by the next round."""
    keys: torch.Tensor  # [1, kv_heads, max_rows, head_dim]
    values: torch.Tensor  # [1, kv_heads, max_rows, head_dim]
    length: int = 0

    @staticmethod
    def empty(kv_heads: int, head_dim: int, rows: int, dtype: torch.dtype, device: torch.device) -> DraftCache:
        shape = (1, kv_heads, rows, head_dim)
        return DraftCache(torch.empty(shape, dtype=dtype, device=device),
                          torch.empty(shape, dtype=dtype, device=device))


@dataclass
class Sequence:
    prompt: list[int]
    params: SamplingParams
    gen: torch.Generator | None  # None: greedy
    cache: KVCache  # the target's: slots [0, length) hold x_0..x_{n-1}
    draft_cache: DraftCache | None  # None when no EAGLE-3 draft proposes
    stats: GenStats
    out: list[int] = field(default_factory=list)  # new tokens committed so far
    finish: str | None = None  # "stop" | "length" once the generation has ended
    text_checked: int = 0  # tokens already searched for stop strings
    stop_text: str | None = None  # the text cut before a matched stop string
    # the next round's inputs: the root x_n is accepted but not yet run by the target; draft step 0 reads the
    # target's features at the rows accepted since the last round with the token that followed each row
    root: int = -1
    features: torch.Tensor | None = None  # [1, rows, nA*H]
    rows_tokens: list[int] = field(default_factory=list)  # [rows]

    @property
    def context(self) -> list[int]:
        return self.prompt + self.out

    @property
    def room(self) -> int:
        """Tokens that may still be committed."""
        return self.params.max_new_tokens - len(self.out)

    # -- token choice ------------------------------------------------------------------------------
    def pick(self, logits: torch.Tensor) -> int:
        """Plain choice from target logits [V] (greedy or warped sampling)."""
        if self.gen is None:
            return int(logits.argmax())
        return sample(self.target_probs(logits), self.gen)

    def target_probs(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        return warp(logits, p.temperature, p.top_k, p.top_p)

    # -- committing --------------------------------------------------------------------------------
    def commit(self, tokens: list[int], eos: set[int], tokenizer: PreTrainedTokenizerBase) -> list[int]:
        """Append accepted tokens up to EOS / max_new_tokens / a stop string; set `finish`. Returns what the caller
        may emit (a stop string and what follows are cut)."""
        new: list[int] = []
        for t in tokens:
            new.append(t)
            self.out.append(t)
            if t in eos:
                self.finish = "stop"
                break
            if len(self.out) >= self.params.max_new_tokens:
                self.finish = "length"
                break
        if self.params.stop:
            cut = self.find_stop(tokenizer)
            if cut is not None:
                keep_new = len(new) - (len(self.out) - cut)
                del self.out[cut:]
                new = new[:max(keep_new, 0)]
                self.finish = "stop"
        self.stats.new_tokens = len(self.out)
        return new

    def find_stop(self, tokenizer: PreTrainedTokenizerBase) -> int | None:
        """Smallest token count whose text contains a stop string (only counts not yet searched)."""
        # decode of one id list is a str (transformers types it str | list[str], for batches too)
        hit = stop_cut(lambda ids: cast(str, tokenizer.decode(ids, skip_special_tokens=True)), self.out,
                       self.params.stop, self.text_checked + 1)
        if hit is not None:
            k, self.stop_text = hit
            return k
        self.text_checked = len(self.out)
        return None

    def result(self, tokenizer: PreTrainedTokenizerBase) -> GenResult:
        text = self.stop_text if self.stop_text is not None else \
            cast(str, tokenizer.decode(self.out, skip_special_tokens=True))
        return GenResult(token_ids=list(self.out), text=text, finish_reason=self.finish or "length",
                         stats=self.stats)
