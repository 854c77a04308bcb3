"""The matrix products of the engine forward for the MoE families, two ways: torch's kernels, or eyas's row-invariant
CPU kernels (eyas/native), which TargetModel picks for a qwen3_moe, gpt_oss or deepseek_v3 target in fp32 on the CPU.

Why: verification runs many rows in one forward (a tree, a chain, several sequences) where plain decoding runs one,
and lossless decoding needs each row's logits to be the same bits either way: a near-tie that the last bit decides
flips a greedy token, and then the output depends on the batch. torch's matmul (MKL sgemm) and SDPA pick their
blocking and reduction order by the row count, and a routed MLP multiplies each expert by however many rows chose
it, so a MoE row's logits moved by up to ~1e-5 between batched and alone. The native kernels compute every output
element with one operation sequence whatever the other rows (eyas/native/kernels.h). Transcendental elementwise
functions (SiLU, sigmoid) need care too: torch runs an elementwise op in vectors of 16 or 32 floats and the last
few elements of a call through a scalar formula whose last bit can differ, so which path a row takes depends on how
many rows share the call; `pointwise` pads each row so that every element takes the vector path. The rest is
row-wise by itself: norms (exactly rounded ops, a per-row mean), routing's softmax (one row at a time) and top-k.
HF's rotary module computes cos/sin over [B, S, rope_dim], row-invariant for a rope_dim that is a multiple of 32
(every family here: 64 or 128)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import EyasError
from ..native import kernels
from ..target.family import SUPPORTED_MOE


@dataclass(frozen=True)
class Ops:
    """How the MoE families' layers multiply by a weight."""
    linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]  # x [.., K], w [N, K] -> [.., N]
    matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # x [.., K] @ w [K, N] -> [.., N]
    pointwise: Callable[[Callable[[torch.Tensor], torch.Tensor], torch.Tensor], torch.Tensor]  # (fn, x) -> fn(x)
    row_invariant: bool  # True: these products, and attention, run through the native row-invariant kernels


def _row_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    y = kernels.f32_matmul(x, w)
    return y if b is None else y + b  # the bias is added elementwise: still the row's own bits


_VEC_STEP = 64  # floats: a multiple of torch's elementwise step (2 vectors of 8 on AVX2, 2 of 16 on AVX-512)
_ONE_THREAD = 32768  # at::internal::GRAIN_SIZE: an elementwise op over fewer elements runs on one thread


def _row_pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn elementwise over x [..., D] with every element on torch's vector path: rows padded with zeros to a
    multiple of the vector step, in calls of at most one thread's share (a thread's range ends on a row end), so no
    element lands in a scalar tail whose place the batch decides."""
    D = x.shape[-1]
    width = -(-D // _VEC_STEP) * _VEC_STEP
    flat = F.pad(x.reshape(-1, D), (0, width - D))  # [N, width], a fresh contiguous tensor
    step = max(1, _ONE_THREAD // width)
    out = fn(flat) if flat.shape[0] <= step else torch.cat([fn(flat[i:i + step]) for i in range(0, len(flat), step)])
    return out[:, :D].reshape(x.shape)


TORCH_OPS = Ops(F.linear, torch.matmul, lambda fn, x: fn(x), False)
ROW_OPS = Ops(_row_linear, kernels.f32_matmul_kn, _row_pointwise, True)


def ops_for(model_type: str, dtype: torch.dtype, device: torch.device, native: bool) -> tuple[Ops, str | None]:
    """-> (the ops a target's forward runs, why they are not row-invariant; None when they are or the family is
    dense: dense fp32 targets keep torch's faster kernels, native weights are row-invariant on their own)."""
    if native or model_type not in SUPPORTED_MOE:
        return TORCH_OPS, None
    if dtype != torch.float32 or device.type != "cpu":
        return TORCH_OPS, (f"eyas's row-invariant kernels run fp32 on the CPU; this {model_type} target is {dtype} "
                           f"on {device}, so a verified row may differ in its last bits from the same row alone")
    try:
        kernels.lib()
    except EyasError as e:  # no C compiler: torch's kernels still give the right tokens but for near-ties
        return TORCH_OPS, f"eyas's row-invariant kernels are unavailable ({e}); torch's kernels run instead"
    return ROW_OPS, None
