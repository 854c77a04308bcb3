"""DeepSeek's multi-head latent attention (MLA; DeepSeek-V2/V3, Kimi-K2) for the engine forward, over the HF
module's weights.

Keys and values come from one compressed latent per token: kv_a_proj_with_mqa maps the hidden state to
[latent (kv_lora_rank) | rope key (qk_rope_head_dim)]; the latent is RMS-normed and kv_b_proj expands it into
every head's no-position key part (qk_nope_head_dim) and value (v_head_dim); the rope key, rotated, is shared by
all heads. The cache stores what MLA needs, per layer and slot: the normed latent in KVCache.k [B, 1, T, rank]
and the rotated rope key in KVCache.v [B, 1, T, rope_dim] (slot index == position as everywhere, so truncate
and compact work unchanged). kv_b_proj is absorbed into the query and the output (see mla_attention), so no
forward expands the cached latents into per-head keys and values.

RoPE as HF applies it for this family: with `rope_interleave` (DeepSeek's checkpoints) the rotated pairs are
(x0, x1), (x2, x3), ... and the result is laid out evens-then-odds — the same permutation for q and k, so the
dot products are those of the interleaved rotation.

With eyas's row-invariant ops (eyas/engine/rowwise.py: fp32 on the CPU) every product runs per row: the projections
and the absorbed kv_b_proj per head through the native matmuls, attention through the native kernel that walks each
row's visible latents in slot order, so a verified row's output is the bits it gets alone."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..native import kernels
from ..target.family import ModelError
from .rowwise import TORCH_OPS, Ops


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@dataclass
class MLA:
    """One layer's MLA weights (references to the HF tensors) and shapes."""
    q: nn.Linear | None  # without q_lora_rank: hidden -> heads * (nope + rope)
    q_a: nn.Linear | None  # with q_lora_rank: hidden -> rank, normed, then q_b -> heads * (nope + rope)
    q_a_norm: nn.Module | None
    q_b: nn.Linear | None
    kv_a: nn.Linear  # hidden -> kv_lora_rank + rope
    kv_norm: nn.Module
    kv_b: nn.Linear  # kv_lora_rank -> heads * (nope + v)
    o: nn.Linear
    heads: int
    nope: int
    rope: int
    v_dim: int
    rank: int
    scale: float  # 1/sqrt(nope + rope), times YaRN's mscale^2 where rope_scaling says so (HF's own value)
    interleave: bool
    ops: Ops = TORCH_OPS


def mla_of(cfg, attn: Any, ops: Ops = TORCH_OPS) -> MLA:  # attn: HF's MLA attention (Any: its projections)
    if attn.kv_b_proj.bias is not None:
        raise ModelError("this MLA target's kv_b_proj has a bias, which eyas's absorbed attention does not carry")
    return MLA(q=getattr(attn, "q_proj", None), q_a=attn.q_a_proj, q_a_norm=attn.q_a_layernorm, q_b=attn.q_b_proj,
               kv_a=attn.kv_a_proj_with_mqa, kv_norm=attn.kv_a_layernorm, kv_b=attn.kv_b_proj, o=attn.o_proj,
               heads=int(cfg.num_attention_heads), nope=int(cfg.qk_nope_head_dim), rope=int(cfg.qk_rope_head_dim),
               v_dim=int(cfg.v_head_dim), rank=int(cfg.kv_lora_rank), scale=float(attn.scaling),
               interleave=bool(getattr(cfg, "rope_interleave", True)), ops=ops)


def _norm(m: Any, x: torch.Tensor) -> torch.Tensor:  # m: HF's RMSNorm (weight, variance_epsilon)
    return _rms(x, m.weight, float(m.variance_epsilon))  # MLA's own norms keep their own eps (1e-6 in HF)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x [..., S, rope], cos/sin [B, 1, S, rope] (HF's halves repeated)."""
    h = x.shape[-1] // 2
    if interleave:
        c, s = cos[..., :h], sin[..., :h]
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.cat([a * c - b * s, b * c + a * s], dim=-1)
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin


def mla_attention(w: MLA, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ck: torch.Tensor,
                  cv: torch.Tensor, start: int, mask: torch.Tensor | None, rows: torch.Tensor | None,
                  slots: torch.Tensor | None) -> torch.Tensor:
    """Normed h [B, S, H] -> o_proj output [B, S, H]. ck [B, 1, max_len, rank] / cv [B, 1, max_len, rope] are the
    layer's cache; the new tokens' latents and rope keys go to slots [start, start+S) (or slots[b], S = 1)."""
    B, S, _ = h.shape
    T = start + S

    def lin(m: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return w.ops.linear(x, m.weight, m.bias)

    if w.q_a is None:
        assert w.q is not None  # mla_of: without q_lora_rank there is q_proj
        q = lin(w.q, h)
    else:
        assert w.q_b is not None and w.q_a_norm is not None  # with q_lora_rank: q_a, its norm and q_b together
        q = lin(w.q_b, _norm(w.q_a_norm, lin(w.q_a, h)))
    q = q.view(B, S, w.heads, w.nope + w.rope).transpose(1, 2)  # [B, nh, S, nope + rope]
    q_nope, q_rot = q.split([w.nope, w.rope], dim=-1)
    latent, k_rot = lin(w.kv_a, h).split([w.rank, w.rope], dim=-1)  # [B, S, rank], [B, S, rope]
    latent = _norm(w.kv_norm, latent)
    cos, sin = rope
    q_rot = _rotate(q_rot, cos, sin, w.interleave)
    k_rot = _rotate(k_rot[:, None], cos, sin, w.interleave)  # [B, 1, S, rope]
    if rows is None:
        ck[:, 0, start:T] = latent
        cv[:, 0, start:T] = k_rot[:, 0]
    else:
        ck[rows, 0, slots] = latent[:, 0]
        cv[rows, 0, slots] = k_rot[:, 0, 0]
    # kv_b_proj absorbed: q_nope . (W_uk c) = (q_nope W_uk) . c, and p @ (W_uv c) = W_uv (p @ c), so attention runs
    # over the cached latents themselves, one shared key/value head, whatever the number of new rows
    wkv = w.kv_b.weight.view(w.heads, w.nope + w.v_dim, w.rank)
    k = torch.cat([ck[:, :, :T], cv[:, :, :T]], dim=-1)  # [B, 1, T, rank + rope]
    if w.ops.row_invariant:
        # per head, so each row's products are its own (a batched einsum's bmm blocks by the row count)
        q_lat = torch.stack([w.ops.matmul(q_nope[:, i], wkv[i, :w.nope]) for i in range(w.heads)], dim=1)
        qk = torch.cat([q_lat, q_rot], dim=-1).transpose(1, 2)  # [B, S, nh, rank + rope]
        o = kernels.attention_kv(qk, k, ck, start, mask, w.scale)  # [B, S, nh, rank]
        o = torch.stack([w.ops.linear(o[:, :, i], wkv[i, w.nope:], None) for i in range(w.heads)], dim=2)
    else:
        q_lat = torch.einsum("bhsn,hnr->bhsr", q_nope, wkv[:, :w.nope])  # [B, nh, S, rank]
        o = F.scaled_dot_product_attention(torch.cat([q_lat, q_rot], dim=-1), k, ck[:, :, :T], attn_mask=mask,
                                           scale=w.scale, enable_gqa=True)  # [B, nh, S, rank]
        o = torch.einsum("bhsr,hvr->bshv", o, wkv[:, w.nope:])  # [B, S, nh, v]
    return lin(w.o, o.reshape(B, S, w.heads * w.v_dim))
