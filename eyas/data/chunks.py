"""datagen's chunks: the source read after the watermark a chunk of --shard-samples conversations at a time,
each chunk turned into tokenized items (regenerated, raw or chat) and, once captured, into shard files."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..target.load import Target
from ..target.template import raw_ids
from .capture import length_batches
from .conversations import (
    SELF_SOURCE,
    Conversation,
    DataError,
    Skip,
    iter_source,
    plain_text,
    raw_prompt_text,
    self_rows,
    tokenize_conversation_checked,
    tokenize_raw,
)
from .datagen_config import LISTED_SKIPS, DatagenConfig
from .regen import engine_for, generate_replies, regenerate, sample_user_turns, stop_token_ids
from .shards import Sample, write_shard

# the folder's first chunk holds this many conversations and each next one twice as many, up to --shard-samples: a
# new run commits its first shard within minutes on a CPU (a whole 64-conversation chunk of replies can take ten)
FIRST_CHUNK = 8


def chunk_size(cfg: DatagenConfig, chunks_done: int) -> int:
    """Conversations in the folder's next chunk, after `chunks_done` committed ones (the folder's, not this run's:
    a resumed run cuts the same chunks as an uninterrupted one, so their shards are the same bytes)."""
    return min(cfg.shard_samples, FIRST_CHUNK << min(chunks_done, 16))


def iter_chunks(cfg: DatagenConfig, watermark: int, remaining: int | None, chunks_done: int = 1 << 16
                ) -> Iterator[tuple[list[Conversation], Counter, int, bool, dict[str, list[int]]]]:
    """(conversations, skipped reasons, last row id covered, source exhausted, the row ids of LISTED_SKIPS reasons)
    per chunk, after the watermark; chunk sizes grow from FIRST_CHUNK (chunk_size)."""
    convs: list[Conversation] = []
    skips: Counter[str] = Counter()
    listed: dict[str, list[int]] = {}
    last = watermark
    if remaining is not None and remaining <= 0:
        return
    for item in self_rows(watermark + 1) if cfg.data == SELF_SOURCE else iter_source(cfg.data):
        if item.row_id <= watermark:
            continue
        if cfg.end_row is not None and item.row_id >= cfg.end_row:
            break  # the rows from here on belong to another folder: this one is complete
        last = item.row_id
        if isinstance(item, Skip):
            skips[item.reason] += 1
            if item.reason in LISTED_SKIPS:
                listed.setdefault(item.reason, []).append(item.row_id)
            continue
        convs.append(item)
        if remaining is not None:
            remaining -= 1
        if len(convs) >= chunk_size(cfg, chunks_done) or remaining == 0:
            yield convs, skips, last, False, listed
            convs, skips, listed = [], Counter(), {}
            chunks_done += 1
            if remaining == 0:
                return
    yield convs, skips, last, True, listed

# ---- regeneration (eyas/data/regen.py) ---------------------------------------------------------------

def limit_turns(messages: list[dict[str, str]], max_turns: int | None) -> list[dict[str, str]]:
    """Cut a conversation after its max_turns-th assistant reply."""
    if max_turns is None:
        return messages
    seen = 0
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            seen += 1
            if seen == max_turns:
                return messages[:i + 1]
    return messages


# ---- raw mode (base models) -----------------------------------------------------------------------------

RAW_DOC_PROMPT_TOKENS = 64  # raw regeneration: a document's first tokens are the prompt the target continues


def raw_items(target: Target, convs: list[Conversation], cfg: DatagenConfig, stats: Counter, skips: Counter,
               on_progress: Callable[[str], None]) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """`datagen --raw`: each row as plain text (eyas.data.conversations.plain_text), tokenized as is with the
    tokenizer's own BOS rule, no template. What a base model's draft will be asked to continue is text, so:
    without regeneration every token is a loss token (the whole document is text the target predicts; a BOS is
    not); with regeneration the target continues the row's opening (a conversation's text before its first
    reply, a document's first RAW_DOC_PROMPT_TOKENS tokens) and only the continuation (+ its end token) is a
    loss token, as when serving a raw prompt."""
    tok = target.tokenizer
    items: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    if not cfg.regenerate:
        for c in convs:
            ids, mask, cut = tokenize_raw(tok, c, cfg.max_len)
            stats["truncated"] += int(cut)
            if int(mask.sum()) < 2:
                skips["no_loss_tokens_after_truncation"] += 1
                continue
            items.append((c.row_id, ids, mask))
        return items
    stop_ids = stop_token_ids(target)
    end = tok.eos_token_id if tok.eos_token_id in stop_ids else stop_ids[0]
    prompts: list[tuple[int, list[int]]] = []
    for c in convs:
        text = raw_prompt_text(c)
        # a list of ids, not the tensor `ids` above
        prompt = raw_ids(tok, text if text is not None else plain_text(c), as_text=True)
        if text is None:
            prompt = prompt[:RAW_DOC_PROMPT_TOKENS]
        if len(prompt) >= cfg.max_len:
            skips["prompt_fills_max_len"] += 1
            continue
        prompts.append((c.row_id, prompt))
    if not prompts:
        return items
    on_progress("regen raw")
    seed = (cfg.seed * 1_000_003 + prompts[0][0] * 1_009) % (2**63)
    t0 = time.perf_counter()
    replies = generate_replies(target, [p for _, p in prompts], cfg, seed, stop_ids, engine_for(target, cfg))
    stats["regen_ms"] += int(1000 * (time.perf_counter() - t0))
    for (row_id, prompt), (reply, why) in zip(prompts, replies, strict=True):
        stats["regenerated_replies"] += 1
        stats["regenerated_tokens"] += len(reply)
        stats[f"finish_{why}"] += 1
        cont = reply + ([end] if why == "eos" else [])
        ids = torch.tensor(prompt + cont, dtype=torch.long)[:cfg.max_len]
        mask = torch.zeros(len(prompt) + len(cont), dtype=torch.bool)
        mask[len(prompt):] = True
        mask = mask[:cfg.max_len]
        if not mask.any():
            skips["no_loss_tokens_after_truncation"] += 1
            continue
        items.append((row_id, ids, mask))
    return items


def chunk_items(target: Target, convs: list[Conversation], cfg: DatagenConfig, stats: Counter, skips: Counter,
                on_progress: Callable[[str], None], on_replies: Callable[[int, int], None] | None = None
                ) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """A chunk's conversations as (row_id, input_ids, loss_mask) items to capture: raw text (raw_items), or chats
    cut to --max-turns, given self-written user turns (--data self), regenerated and tokenized with the loss
    mask; a row that yields no item is counted in skips."""
    if cfg.raw:
        items = raw_items(target, convs, cfg, stats, skips, on_progress)
        convs_chat: list[Conversation] = []
    else:
        convs_chat = [c for c in convs if c.text is None]
        if len(convs_chat) < len(convs):  # {"text"} document rows have no chat to render
            skips["text_row_needs_raw"] += len(convs) - len(convs_chat)
        convs_chat = [Conversation(c.row_id, limit_turns(c.messages, cfg.max_turns), c.dropped_turns)
                      for c in convs_chat]
        if cfg.data == SELF_SOURCE:
            convs_chat = sample_user_turns(target, convs_chat, cfg, stats, skips, on_progress)
        items = []
    if cfg.regenerate and convs_chat:
        convs_chat = regenerate(target, convs_chat, cfg, stats,
                                lambda lens: length_batches(lens, cfg.gen_batch, cfg.gen_tokens), on_progress,
                                on_replies=on_replies)
    for c in convs_chat:
        try:
            ids, mask, exact = tokenize_conversation_checked(target.tokenizer, c.messages)
        except DataError:
            skips["template_error"] += 1
            continue
        stats["mask_boundary_inexact"] += int(not exact)
        stats["truncated"] += int(len(ids) > cfg.max_len)
        stats["dropped_leading_assistant"] += int(c.dropped_turns > 0)
        ids, mask = ids[:cfg.max_len], mask[:cfg.max_len]
        if not mask.any():
            skips["no_loss_tokens_after_truncation"] += 1
            continue
        items.append((c.row_id, ids, mask))
    return items


def write_chunk_shards(out: Path, first: int, samples: list[Sample], shard_tokens: int,
                       store_dtype: torch.dtype) -> list[dict[str, Any]]:
    """A chunk's samples written as shard files numbered from `first`; returns their manifest entries."""
    # shards hold samples in source order, split so none exceeds shard_tokens
    entries: list[dict[str, Any]] = []
    group: list[Sample] = []
    group_tokens = 0
    for s in sorted(samples, key=lambda s: s.row_id):
        if group and group_tokens + len(s) > shard_tokens:
            entries.append(write_shard(out / f"shard-{first + len(entries):05d}.safetensors",
                                       group, store_dtype))
            group, group_tokens = [], 0
        group.append(s)
        group_tokens += len(s)
    if group:
        entries.append(write_shard(out / f"shard-{first + len(entries):05d}.safetensors",
                                   group, store_dtype))
    return entries
