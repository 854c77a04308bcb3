"""Rotary position embeddings in the Llama half-rotation layout, shared by the draft and its native kernel."""

from __future__ import annotations

import torch


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """position_ids [B, S] -> cos, sin [B, 1, S, head_dim] (Llama half-rotation layout)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim))
    ang = position_ids.float()[..., None] * inv  # [B, S, hd/2]
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
