"""llama.cpp through its C API (the low-level ctypes bindings of llama-cpp-python, `make llama-cpp`): one model, one
context and a greedy sampler chain, driven with one llama_decode of one token and one llama_sampler_sample per
step. The high-level `llama_cpp.Llama` copies each step's logits into numpy and samples in Python; this path leaves
the per-token work in llama.cpp, so it measures llama.cpp's own speed (the bench's `llama-cpp-c` method and
benchmarks/bench_verify.py --llama-cpp).

Context settings are llama.cpp's defaults (llama_context_default_params: flash attention "auto", f16 KV cache)
except n_ctx, n_batch = n_ubatch, and n_threads = n_threads_batch = the bench's threads."""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import BenchError


@dataclass
class CGeneration:
    token_ids: list[int]  # every sampled token, a final end token included
    prefill_s: float  # emptying the cache, the prompt's decode calls and the first token's sampling
    seconds: float  # the whole call, prefill included
    decodes: int  # llama_decode calls: the prompt's chunks, then one per later token
    stopped: bool  # the last token is an end token (the caller's stop ids or the vocab's end-of-generation)


def _free(lc: Any, model: Any, ctx: Any, sampler: Any, rows: Any) -> None:
    lc.llama_batch_free(rows)
    lc.llama_sampler_free(sampler)
    lc.llama_free(ctx)
    lc.llama_model_free(model)


class LlamaC:
    """A GGUF loaded by llama.cpp. Raises ImportError when llama-cpp-python is not installed, BenchError when
    llama.cpp cannot load the file or make the context."""

    def __init__(self, gguf: Path, threads: int, n_ctx: int = 4096, n_batch: int = 512) -> None:
        import llama_cpp as lc

        # importing llama_cpp routes llama.cpp's log to this logger; its load chatter is noise in bench output
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
        lc.llama_backend_init()
        model = lc.llama_model_load_from_file(str(gguf).encode(), lc.llama_model_default_params())
        if not model:
            raise BenchError(f"llama.cpp could not load {gguf} (llama_model_load_from_file returned NULL)")
        cp = lc.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, n_batch, n_batch
        cp.n_threads, cp.n_threads_batch = threads, threads
        ctx = lc.llama_init_from_model(model, cp)
        if not ctx:
            lc.llama_model_free(model)
            raise BenchError(f"llama.cpp could not make a context for {gguf} (n_ctx {n_ctx}, n_batch {n_batch})")
        sp = lc.llama_sampler_chain_default_params()
        sp.no_perf = True
        sampler = lc.llama_sampler_chain_init(sp)
        lc.llama_sampler_chain_add(sampler, lc.llama_sampler_init_greedy())  # the chain owns and frees it
        self.lc, self.model, self.ctx, self.sampler = lc, model, ctx, sampler
        self.vocab = lc.llama_model_get_vocab(model)
        self.mem = lc.llama_get_memory(ctx)
        self.n_ctx, self.n_batch, self.threads = n_ctx, n_batch, threads
        self._one = (lc.llama_token * 1)()
        self._step = lc.llama_batch_get_one(self._one, 1)  # reused: positions follow the KV cache
        self._rows = lc.llama_batch_init(n_batch, 0, 1)  # explicit positions and all-row outputs (decode_rows)
        self.n_past = 0
        weakref.finalize(self, _free, lc, model, ctx, sampler, self._rows)

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise BenchError(f"llama.cpp llama_decode returned {rc} on {what} (1: no KV slot, context {self.n_ctx} "
                             "tokens; -1: bad batch; other: llama.cpp error)")

    def clear(self) -> None:
        """Empty the KV cache and reset the sampler: the next decode starts at position 0."""
        self.lc.llama_memory_clear(self.mem, True)
        self.lc.llama_sampler_reset(self.sampler)
        self.n_past = 0

    def truncate(self, n: int) -> None:
        """Drop the cached positions from n on (the next decode_rows starts at n)."""
        self.lc.llama_memory_seq_rm(self.mem, 0, n, -1)
        self.n_past = n

    def prefill(self, ids: list[int]) -> int:
        """Decode ids after the cache in chunks of n_batch (only the last row's logits kept); returns the calls."""
        calls = 0
        for a in range(0, len(ids), self.n_batch):
            chunk = ids[a:a + self.n_batch]
            arr = (self.lc.llama_token * len(chunk))(*chunk)
            self._check(self.lc.llama_decode(self.ctx, self.lc.llama_batch_get_one(arr, len(chunk))),
                        f"the prompt's tokens {a}..{a + len(chunk)}")
            calls += 1
        self.n_past += len(ids)
        return calls

    def decode_rows(self, ids: list[int]) -> None:
        """One llama_decode of len(ids) <= n_batch tokens after the cache, logits for every row (a verify forward)."""
        if not 0 < len(ids) <= self.n_batch:  # the batch was allocated for n_batch rows: more would write past it
            raise BenchError(f"a llama.cpp batch holds 1..{self.n_batch} rows, got {len(ids)}")
        b = self._rows
        for i, t in enumerate(ids):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, self.n_past + i, 1, 1
            b.seq_id[i][0] = 0
        b.n_tokens = len(ids)
        self._check(self.lc.llama_decode(self.ctx, b), f"a batch of {len(ids)} rows")
        self.n_past += len(ids)

    def greedy(self, ids: list[int], max_new_tokens: int, stop: set[int]) -> CGeneration:
        """Greedy continuation of ids from an empty cache: up to max_new_tokens, ending after a stop token or one
        llama.cpp's vocab calls end-of-generation."""
        if len(ids) + max_new_tokens > self.n_ctx:
            raise BenchError(f"llama.cpp context holds {self.n_ctx} tokens; the prompt's {len(ids)} plus "
                             f"{max_new_tokens} new tokens do not fit (lower --max-new-tokens)")
        lc, ctx, smpl, vocab, one, step = self.lc, self.ctx, self.sampler, self.vocab, self._one, self._step
        decode, sample, is_eog = lc.llama_decode, lc.llama_sampler_sample, lc.llama_vocab_is_eog
        t0 = time.perf_counter()
        self.clear()
        calls = self.prefill(ids)
        tok = sample(smpl, ctx, -1)
        t1 = time.perf_counter()
        out = [tok]
        done = tok in stop or is_eog(vocab, tok)
        while not done and len(out) < max_new_tokens:
            one[0] = tok
            self._check(decode(ctx, step), f"new token {len(out)}")
            calls += 1
            tok = sample(smpl, ctx, -1)
            out.append(tok)
            done = tok in stop or is_eog(vocab, tok)
        t2 = time.perf_counter()
        self.n_past += len(out) - 1
        return CGeneration(out, t1 - t0, t2 - t0, calls, done)

