"""Mixture-of-experts MLPs for the engine forward: Qwen3-MoE, gpt-oss and DeepSeek-V3 (Kimi-K2) layers, over
the HF module's own expert tensors (no copies).

Each token is routed on its own: its experts and weights are a function of its hidden state only (no capacity
limits, no batch-wide choice), so a verified row's output does not depend on the other rows of the batch — the
property lossless speculation needs. With eyas's row-invariant kernels (eyas/engine/rowwise.py: fp32 on the CPU) it
holds to the bit: every product runs one operation sequence per row however many rows chose the expert, and a
token's k expert outputs are added in expert order by elementwise adds. The rules follow transformers' modeling
files for each family:

- qwen3_moe: softmax over all experts, top-k, optionally renormalised over the k (`norm_topk_prob`); sparse
  layers are every `decoder_sparse_step`-th one not in `mlp_only_layers`.
- gpt_oss: router with a bias; top-k on the logits, softmax over the k selected; experts with biases and a
  clamped SwiGLU (gate * sigmoid(alpha * gate) * (up + 1)); every layer is sparse.
- deepseek_v3: sigmoid scores; the choice adds `e_score_correction_bias` (noaux_tc) and keeps only the
  `topk_group` best of `n_group` groups (a group's score: the sum of its two best); the weights are the
  uncorrected scores of the chosen, optionally renormalised, times `routed_scaling_factor`; shared experts added;
  the first `first_k_dense_replace` layers are dense."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..target.family import ModelError
from .rowwise import TORCH_OPS, Ops

Router = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # x [N, H] -> experts [N, k], weights [N, k]
Expert = Callable[[int, torch.Tensor], torch.Tensor]  # (expert e, x [n, H]) -> [n, H]


@dataclass
class MoE:
    """A routed MLP: h [B, S, H] -> [B, S, H], plus the shared experts' output where the family has them."""
    route: Router
    expert: Expert
    shared: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        B, S, H = h.shape
        x = h.reshape(B * S, H)
        idx, wts = self.route(x)  # [N, k] each, per row
        # each row's choices in expert order, so its sum below runs in an order its own choice fixes (HF's loop
        # order too), never one that depends on which other rows share the batch
        order = idx.argsort(dim=-1)
        idx, wts = idx.gather(1, order), wts.gather(1, order)
        parts = x.new_empty(x.shape[0], idx.shape[1], H)  # [N, k, H]: row n's k weighted expert outputs
        for e in torch.unique(idx).tolist():  # only the experts some row chose run
            tok, slot = torch.where(idx == e)  # rows that chose e, and at which of their k places
            # in the weights' dtype (DeepSeek's stay fp32, as in HF), then back to the stream's; stored, not
            # accumulated (no index_add_ over a grouping the batch decides)
            parts[tok, slot] = (self.expert(e, x[tok]) * wts[tok, slot, None]).to(x.dtype)
        out = parts[:, 0]
        for j in range(1, idx.shape[1]):  # elementwise adds, slot by slot: the same order for every row
            out = out + parts[:, j]
        out = out.view(B, S, H)
        return out if self.shared is None else out + self.shared(h)


def sparse_layer(cfg, i: int) -> bool:
    """Whether layer i's MLP is routed, by the config's own rule for its family."""
    mt = cfg.model_type
    if mt == "qwen3_moe":
        return (i not in (cfg.mlp_only_layers or [])) and cfg.num_experts > 0 \
            and (i + 1) % cfg.decoder_sparse_step == 0
    if mt == "deepseek_v3":
        return i >= cfg.first_k_dense_replace
    return mt == "gpt_oss"


def _softmax_topk(w: torch.Tensor, k: int, renorm: bool, ops: Ops) -> Router:
    def route(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = F.softmax(ops.linear(x, w, None), dim=-1, dtype=torch.float32)  # [N, E]
        top, idx = torch.topk(p, k, dim=-1)
        if renorm:
            top = top / top.sum(dim=-1, keepdim=True)
        return idx, top.to(x.dtype)  # HF casts the weights to the stream's dtype before using them
    return route


def _topk_softmax(w: torch.Tensor, b: torch.Tensor, k: int, ops: Ops) -> Router:
    def route(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, idx = torch.topk(ops.linear(x, w, b), k, dim=-1)  # [N, k] logits of the chosen
        return idx, F.softmax(top, dim=-1)
    return route


def _grouped_sigmoid(w: torch.Tensor, bias: torch.Tensor, k: int, groups: int, keep_groups: int, renorm: bool,
                     scale: float, ops: Ops) -> Router:
    def route(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = ops.pointwise(torch.sigmoid, ops.linear(x.float(), w.float(), None))  # [N, E]
        choice = scores + bias  # the correction bias steers the choice only, never the weights
        N, E = choice.shape
        # a group's score is the sum of its two best experts; only the keep_groups best groups stay eligible
        g = choice.view(N, groups, E // groups).topk(2, dim=-1)[0].sum(dim=-1)  # [N, groups]
        gsel = torch.topk(g, keep_groups, dim=-1, sorted=False)[1]
        allowed = torch.zeros_like(g, dtype=torch.bool).scatter_(1, gsel, True)  # [N, groups]
        allowed = allowed[:, :, None].expand(N, groups, E // groups).reshape(N, E)
        idx = torch.topk(choice.masked_fill(~allowed, float("-inf")), k, dim=-1, sorted=False)[1]  # [N, k]
        top = scores.gather(1, idx)
        if renorm:
            top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, top * scale
    return route


def _glu_experts(gate_up: torch.Tensor, down: torch.Tensor, act: Callable, ops: Ops) -> Expert:
    """Experts stored as gate_up [E, 2I, H] (gate rows first) and down [E, H, I]."""
    def expert(e: int, x: torch.Tensor) -> torch.Tensor:
        g, u = ops.linear(x, gate_up[e], None).chunk(2, dim=-1)  # [n, I] each
        return ops.linear(ops.pointwise(act, g) * u, down[e], None)
    return expert


def _clamped_swiglu_experts(ex: Any, ops: Ops) -> Expert:  # ex: HF's experts module (Any: family attributes)
    """gpt-oss: gate_up [E, H, 2I] with gate and up interleaved by column, down [E, I, H], both biased."""
    alpha, limit = float(ex.alpha), float(ex.limit)

    def expert(e: int, x: torch.Tensor) -> torch.Tensor:
        gu = ops.matmul(x, ex.gate_up_proj[e]) + ex.gate_up_proj_bias[e]  # [n, 2I]
        gate = gu[..., ::2].clamp(max=limit)
        up = gu[..., 1::2].clamp(-limit, limit)
        glu = gate * ops.pointwise(torch.sigmoid, gate * alpha)
        return ops.matmul((up + 1) * glu, ex.down_proj[e]) + ex.down_proj_bias[e]
    return expert


def _dense_mlp(m: Any, ops: Ops) -> Callable[[torch.Tensor], torch.Tensor]:  # m: HF's gated MLP module
    def mlp(h: torch.Tensor) -> torch.Tensor:
        g = ops.pointwise(m.act_fn, ops.linear(h, m.gate_proj.weight, None))
        return ops.linear(g * ops.linear(h, m.up_proj.weight, None), m.down_proj.weight, None)
    return mlp


def moe_mlp(cfg, i: int, layer: nn.Module, ops: Ops = TORCH_OPS) -> MoE | None:
    """Layer i's routed MLP over its HF weights, or None for a dense layer (the engine's gated MLP runs it)."""
    if not sparse_layer(cfg, i):
        return None
    m: Any = layer.mlp  # HF's MoE block: gate, router, shared_experts vary by family
    ex = getattr(m, "experts", None)
    if ex is None or not isinstance(getattr(ex, "gate_up_proj", None), torch.Tensor):
        raise ModelError(f"{cfg.model_type} layer {i}: expected HF's fused expert tensors (experts.gate_up_proj), "
                         f"found {type(ex).__name__}; this transformers version lays the experts out differently")
    k = int(cfg.num_experts_per_tok)
    if cfg.model_type == "qwen3_moe":
        return MoE(_softmax_topk(m.gate.weight, k, bool(cfg.norm_topk_prob), ops),
                   _glu_experts(ex.gate_up_proj, ex.down_proj, ex.act_fn, ops))
    if cfg.model_type == "gpt_oss":
        return MoE(_topk_softmax(m.router.weight, m.router.bias, k, ops), _clamped_swiglu_experts(ex, ops))
    gate = m.gate
    return MoE(_grouped_sigmoid(gate.weight, gate.e_score_correction_bias, k, int(cfg.n_group), int(cfg.topk_group),
                                bool(cfg.norm_topk_prob), float(cfg.routed_scaling_factor), ops),
               _glu_experts(ex.gate_up_proj, ex.down_proj, ex.act_fn, ops), _dense_mlp(m.shared_experts, ops))
