"""The target writes the replies: batched generation for `eyas datagen --regenerate`.

Llama-family targets run through eyas's own forward (eyas/model.py) with a static KV cache. Each batch's
prompts are left-padded to one length. A per-row key mask hides the padding, and each row's positions start
at 0, so a row computes what it would alone. Rows that finished leave the batch: the cache is compacted
once a quarter of the rows are done, so the batch does not keep computing finished rows. Sampling draws
every row from one generator seeded per batch, so a rerun repeats it. Families the engine forward does not
cover fall back to Hugging Face `generate`.

The engine runs the HF weights in --target-dtype (`--weights fp32`), whatever serving uses: at 16-64 rows a
step is bound by compute, where fp32 matmuls beat the int4 kernel's bf16 path (192 vs 150 tok/s at 64 rows).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import torch

from ..model import KVCache, ModelError, TargetModel, engine_model
from ..sampling import warp
from ..target import Target, end_token_ids
from .conversations import Conversation, loop_end, render

Reply = tuple[list[int], str]  # reply tokens without the end token; why it ended: eos | repetition | length


def stop_token_ids(target: Target) -> list[int]:
    """Where a regenerated reply ends: the target's end-of-turn tokens (eyas.target.end_token_ids)."""
    return end_token_ids(target.tokenizer, target.model,
                         "regeneration could never stop: use --no-regenerate or fix the config")


def regen_engine(target: Target) -> TargetModel | None:
    """The engine forward regeneration runs on, or None when the family needs HF generate."""
    try:
        return engine_model(target, "fp32")
    except ModelError:
        return None


class _LoopWatch:
    """Incremental eyas.data.conversations.loop_end for one growing reply."""

    def __init__(self, n: int):
        self.n = n
        self.seen: set[tuple[int, ...]] = set()

    def closes_loop(self, reply: list[int]) -> bool:
        if self.n <= 0 or len(reply) < self.n:
            return False
        w = tuple(reply[-self.n:])
        if w in self.seen:
            return True
        self.seen.add(w)
        return False


def _compact(model: TargetModel, cache: KVCache, keep: torch.Tensor) -> KVCache:
    """A cache holding only the batch rows `keep` (committed slots only are copied)."""
    n = cache.length
    new = model.new_cache(int(keep.numel()), cache.max_len)
    new.k[:, :, :, :n] = cache.k[:, keep, :, :n]
    new.v[:, :, :, :n] = cache.v[:, keep, :, :n]
    new.length = n
    return new


@torch.no_grad()
def engine_generate(model: TargetModel, prompts: list[list[int]], max_new: list[int], stop_ids: list[int],
                    repetition_limit: int, temperature: float = 0.0, top_p: float = 1.0,
                    seed: int = 0) -> list[Reply]:
    """Per prompt, the target's reply (greedy at temperature 0, else sampled) of at most max_new[b] tokens."""
    dev = model.device
    B = len(prompts)
    P = max(len(p) for p in prompts)
    pad = torch.tensor([P - len(p) for p in prompts], device=dev)  # [B] left padding per row
    cache = model.new_cache(B, P + max(max_new))
    ids = torch.full((B, P), stop_ids[0], dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):] = torch.tensor(p, dtype=torch.long)
    slots = torch.arange(cache.max_len, device=dev)
    key_ok = slots[None, :] >= pad[:, None]  # [B, max_len] slot j holds a real token of row b
    pos = (slots[None, :P] - pad[:, None]).clamp_min(0)  # [B, P]
    causal = slots[None, :P, None] >= slots[None, None, :P]  # [1, P, P]
    # a padding query sees only itself, so its softmax is never empty (its output is never read)
    mask = (causal & key_ok[:, None, :P]) | torch.eye(P, dtype=torch.bool, device=dev)[None]  # [B, P, P]
    logits = model.forward(ids.to(dev), pos, cache, attn_mask=mask[:, None], logits="last").logits[:, -1]
    cache.length = P
    gen = torch.Generator(device=dev).manual_seed(seed) if temperature > 0 else None
    stops = set(stop_ids)
    rows = list(range(B))  # original index of each live batch row
    replies: list[list[int]] = [[] for _ in range(B)]
    watch = [_LoopWatch(repetition_limit) for _ in range(B)]
    done: list[Reply | None] = [None] * B
    while True:
        if gen is None:
            nxt = logits.argmax(-1)  # [B_live]
        else:
            nxt = torch.multinomial(warp(logits, temperature, 0, top_p), 1, generator=gen)[:, 0]
        live = []
        for r, (b, t) in enumerate(zip(rows, nxt.tolist(), strict=True)):
            if done[b] is not None:
                continue
            if t in stops:
                done[b] = (replies[b], "eos")
                continue
            replies[b].append(t)
            if watch[b].closes_loop(replies[b]):
                done[b] = (replies[b], "repetition")
            elif len(replies[b]) >= max_new[b]:
                done[b] = (replies[b], "length")
            else:
                live.append(r)
        if not live:
            break
        if len(rows) - len(live) >= max(1, len(rows) // 4):  # drop finished rows from the batch
            keep = torch.tensor(live, device=dev)
            cache = _compact(model, cache, keep)
            rows, pad, nxt = [rows[r] for r in live], pad[keep], nxt[keep]
            key_ok = key_ok[keep]
        T = cache.length + 1
        step_pos = (cache.length - pad)[:, None]  # [B_live, 1]
        logits = model.forward(nxt[:, None], step_pos, cache, attn_mask=key_ok[:, None, None, :T],
                               logits="last").logits[:, -1]  # [B_live, V]
        cache.length = T
    return [d for d in done if d is not None]


def _loop_criteria(n: int, prompt_len: int):
    from transformers import StoppingCriteria

    class LoopStop(StoppingCriteria):
        """Per row: stop once the last n generated tokens already occurred as an earlier n-token window of the
        reply (the same rule as eyas.data.conversations.loop_end, checked after every new token)."""

        def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
            gen = input_ids[:, prompt_len:]  # [B, T]
            T = gen.shape[1]
            if T <= n:
                return torch.zeros(gen.shape[0], dtype=torch.bool, device=gen.device)
            earlier = gen[:, :T - 1].unfold(1, n, 1)  # [B, T-n, n] windows starting before the last one
            return (earlier == gen[:, None, T - n:]).all(dim=-1).any(dim=-1)  # [B]

    return LoopStop()


@torch.no_grad()
def hf_generate(target: Target, prompts: list[list[int]], max_new: int, stop_ids: list[int],
                repetition_limit: int, temperature: float = 0.0, top_p: float = 1.0,
                seed: int = 0) -> list[Reply]:
    """The fallback for families eyas's forward does not cover: one batched HF generate, left padding."""
    from transformers import GenerationConfig, StoppingCriteriaList

    dev = target.device
    pad = target.tokenizer.pad_token_id
    pad = stop_ids[0] if pad is None else int(pad)
    S = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), S), pad, dtype=torch.long)
    am = torch.zeros((len(prompts), S), dtype=torch.long)
    for b, p in enumerate(prompts):  # left padding: every row's next token lands in the last column
        ids[b, S - len(p):] = torch.tensor(p)
        am[b, S - len(p):] = 1
    sample = temperature > 0
    gc = GenerationConfig(max_new_tokens=max_new, do_sample=sample, temperature=temperature if sample else None,
                          top_p=top_p if sample else None, top_k=0 if sample else None,
                          eos_token_id=stop_ids, pad_token_id=pad)
    crit = StoppingCriteriaList([_loop_criteria(repetition_limit, S)]) if repetition_limit > 0 else None
    torch.manual_seed(seed)
    out = target.model.generate(input_ids=ids.to(dev), attention_mask=am.to(dev), generation_config=gc,
                                stopping_criteria=crit)
    stops = set(stop_ids)
    results: list[Reply] = []
    for row in out[:, S:].tolist():
        # the reply ends at the first end token, or where it first completes a loop, whichever comes first
        end = next((j for j, t in enumerate(row) if t in stops), None)
        loop = loop_end(row, repetition_limit)
        if end is not None and (loop is None or end < loop):
            results.append((row[:end], "eos"))
        elif loop is not None:
            results.append((row[:loop], "repetition"))
        else:
            results.append((row, "length"))
    return results


def generate_replies(target: Target, prompts: list[list[int]], cfg, seed: int, stop_ids: list[int],
                     engine: TargetModel | None = None) -> list[Reply]:
    """Replies to `prompts` under cfg's (DatagenConfig) max_new_tokens, max_len, repetition_limit,
    temperature and top_p: through `engine` when given, else HF generate."""
    caps = [max(1, min(cfg.max_new_tokens, cfg.max_len - len(p))) for p in prompts]
    opts = dict(repetition_limit=cfg.repetition_limit, temperature=cfg.temperature, top_p=cfg.top_p, seed=seed)
    if engine is not None:
        return engine_generate(engine, prompts, caps, stop_ids, **opts)
    return hf_generate(target, prompts, max(caps), stop_ids, **opts)


def regenerate(target: Target, convs: list[Conversation], cfg, stats: Counter, batches,
               on_progress: Callable[[str], None] | None = None) -> list[Conversation]:
    """Replace every assistant reply with the target's own, given the conversation so far (its own earlier
    replies, the original user turns). Turn by turn, batched across conversations by prompt length
    (`batches(lengths) -> index groups`). A turn whose prompt already fills max_len is dropped with everything
    after it (truncation would cut it anyway)."""
    tok = target.tokenizer
    stop_ids = stop_token_ids(target)
    engine = regen_engine(target)
    msgs = [[dict(m) for m in c.messages] for c in convs]
    turns = [[i for i, m in enumerate(ms) if m["role"] == "assistant"] for ms in msgs]
    cut = [len(ms) for ms in msgs]  # messages kept per conversation
    for r in range(max((len(t) for t in turns), default=0)):
        jobs: list[tuple[int, int, list[int]]] = []
        for ci, t in enumerate(turns):
            if r >= len(t) or t[r] >= cut[ci]:
                continue
            i = t[r]
            prompt = tok(render(tok, msgs[ci][:i], add_generation_prompt=True), add_special_tokens=False)["input_ids"]
            if len(prompt) >= cfg.max_len:
                cut[ci] = i
                stats["turns_dropped_context_full"] += len(t) - r
                continue
            jobs.append((ci, i, prompt))
        lens = [len(p) + min(cfg.max_new_tokens, cfg.max_len - len(p)) for _, _, p in jobs]
        for bi, batch in enumerate(batches(lens)):
            if on_progress:
                on_progress(f"regen turn {r + 1} batch {bi + 1}")
            first_row = convs[jobs[batch[0]][0]].row_id
            seed = (cfg.seed * 1_000_003 + first_row * 1_009 + r) % (2**63)
            t0 = time.perf_counter()
            replies = generate_replies(target, [jobs[j][2] for j in batch], cfg, seed, stop_ids, engine)
            stats["regen_ms"] += int(1000 * (time.perf_counter() - t0))
            for j, (reply, why) in zip(batch, replies, strict=True):
                ci, i, _ = jobs[j]
                msgs[ci][i] = {"role": "assistant", "content": tok.decode(reply, skip_special_tokens=False)}
                stats["regenerated_replies"] += 1
                stats["regenerated_tokens"] += len(reply)
                stats[f"finish_{why}"] += 1
    return [Conversation(row_id=c.row_id, messages=ms[:n], dropped_turns=c.dropped_turns)
            for c, ms, n in zip(convs, msgs, cut, strict=True)]
