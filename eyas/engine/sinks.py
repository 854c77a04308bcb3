"""Attention with per-head sinks (gpt-oss): each head's softmax has one extra logit, a learned constant with no
value, so a query can put weight on "nothing"; the weights over real keys then sum to less than one."""

from __future__ import annotations

import torch


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                   sinks: torch.Tensor) -> torch.Tensor:
    """q [B, nh, S, hd], k/v [B, nkv, T, hd], mask bool [B|1, 1, S, T] (True = may attend; None = all), sinks [nh]
    -> [B, nh, S, hd]. SDPA has no sink term, hence the explicit softmax."""
    B, nh, S, _ = q.shape
    rep = nh // k.shape[1]
    if rep > 1:  # grouped-query attention: each kv head serves rep query heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    logits = torch.matmul(q, k.transpose(2, 3)) * scale  # [B, nh, S, T]
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    sink = sinks.to(logits.dtype).view(1, nh, 1, 1).expand(B, nh, S, 1)
    both = torch.cat([logits, sink], dim=-1)
    both = both - both.max(dim=-1, keepdim=True).values  # HF's order: in bf16 the shift itself rounds
    p = torch.softmax(both, dim=-1)[..., :-1]  # drop the sink's share
    return torch.matmul(p, v)
