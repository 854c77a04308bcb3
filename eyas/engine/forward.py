"""eyas's own forward for the families in ENGINE_FAMILIES (llama, mistral, qwen2, qwen3, gemma3_text; the MoE
families qwen3_moe, gpt_oss, deepseek_v3: experts in moe.py, gpt-oss's sinks in sinks.py, DeepSeek's MLA in
mla.py) over the HF weights in place.

Why not HF's forward: speculative decoding needs explicit positions, an arbitrary boolean mask over
cache + new tokens (tree verification), a KV cache whose accepted entries can be compacted, and the
layout's residual-stream states — all in one pass with no per-step reallocation, hooks or mask
builders. The weights are the HF module's own tensors (no copies), so the HF model stays usable.

Stream index k (see eyas/layout.py): k = 0 the embedding output, k = i the output of layer i-1,
k = L the last layer's output before the final norm. Capture is a by-product of the layer loop."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..native import kernels
from ..target.capture import Capture, decoder_parts

if TYPE_CHECKING:
    from ..native.quant import NativeWeights
from ..target.family import ModelError, engine_covers, family_refusal, text_config
from .mla import MLA, mla_attention, mla_of
from .moe import MoE, moe_mlp
from .rowwise import Ops, ops_for
from .sinks import sink_attention


@dataclass
class KVCache:
    """Preallocated keys/values; slots [0, length) are the committed sequence (slot index == position). MLA
    targets keep the latent in k [layers, B, 1, max_len, kv_lora_rank], the rope key in v [.., qk_rope_head_dim]."""
    k: torch.Tensor  # [layers, B, kv_heads, max_len, head_dim]
    v: torch.Tensor  # [layers, B, kv_heads, max_len, head_dim]
    length: int = 0

    @property
    def max_len(self) -> int:
        return self.k.shape[3]


def truncate(cache: KVCache, length: int) -> None:
    """Forget every slot from `length` on (the data stays; it is overwritten by the next forward)."""
    if not 0 <= length <= cache.length:
        raise ModelError(f"cannot truncate a cache of length {cache.length} to {length}")
    cache.length = length


def compact(cache: KVCache, start: int, keep: list[int] | torch.Tensor) -> None:
    """Gather slots start+keep[i] into start+i (keep ascending, relative to start), then set the length to
    start+len(keep). Used after tree verification: the accepted path becomes the contiguous prefix."""
    keep_t = torch.as_tensor(keep, dtype=torch.long, device=cache.k.device)
    n = keep_t.numel()
    if n and bool((keep_t == torch.arange(n, device=keep_t.device)).all()):
        cache.length = start + n  # already in place (always the case for a chain)
        return
    src = keep_t + start
    # advanced indexing copies first, so overlapping source/destination slots are safe
    cache.k[:, :, :, start:start + n] = cache.k[:, :, :, src]
    cache.v[:, :, :, start:start + n] = cache.v[:, :, :, src]
    cache.length = start + n


@dataclass
class ForwardOut:
    logits: torch.Tensor | None  # [B, R, V] for the requested rows
    aux: torch.Tensor | None  # [B, S, n_aux * H] stream states in capture order
    final: torch.Tensor | None  # [B, S, H] stream index L (pre-norm); only with capture


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # the same op sequence as HF's LlamaRMSNorm, so fp32 results match bit for bit
    dt = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(dt)


def _rms_gemma(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # HF's Gemma3RMSNorm: the (1 + w) scale is applied in fp32, before the cast back
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + w.float())).type_as(x)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin


@dataclass
class DenseLinear:
    """An HF weight (and bias) used in place: x [..., K] -> [..., N] through torch's own matmul, or the row-invariant
    one of a MoE family's forward (eyas/engine/rowwise.py)."""
    w: torch.Tensor  # [N, K]
    b: torch.Tensor | None = None
    lin: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] = F.linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x, self.w, self.b)


Matmul = Callable[[torch.Tensor], torch.Tensor]  # DenseLinear, or one of eyas.native.quant's QLinear kinds


@dataclass
class _Layer:
    """One decoder layer: its norms (references, no copies) and its matrices as callables: qkv (or q, k, v), o,
    gu (or g, u) and d, each DenseLinear over the HF weights or a native quantized kind."""
    ln1: torch.Tensor
    ln2: torch.Tensor
    mats: Mapping[str, Matmul]
    qn: torch.Tensor | None  # qwen3 per-head q/k RMSNorm weights
    kn: torch.Tensor | None
    act: nn.Module | None  # None = silu (fast path)
    ln_post_attn: torch.Tensor | None = None  # gemma's sandwich norms (then ln2 is the pre-MLP norm)
    ln_post_ff: torch.Tensor | None = None
    moe: MoE | None = None  # a routed MLP (then gu/d are absent)
    sinks: torch.Tensor | None = None  # gpt-oss: one softmax sink logit per head
    mla: MLA | None = None  # DeepSeek's latent attention (then q/k/v/o are absent)


def _dense(l: nn.Module, ops: Ops) -> dict[str, Matmul]:
    a, m = l.self_attn, l.mlp  # MLA attention and routed MLPs have their own modules: their names are absent
    return {n: DenseLinear(getattr(o, a_).weight, getattr(o, a_).bias, ops.linear) for n, o, a_ in (
        ("q", a, "q_proj"), ("k", a, "k_proj"), ("v", a, "v_proj"), ("o", a, "o_proj"), ("g", m, "gate_proj"),
        ("u", m, "up_proj"), ("d", m, "down_proj")) if getattr(o, a_, None) is not None}


def check_family(model: nn.Module):
    cfg = text_config(model.config)
    mt = getattr(cfg, "model_type", "?")
    if not engine_covers(mt):
        raise family_refusal(mt, f"this target ({type(model).__name__})", "eyas's decoding", loaded=True)
    return cfg


class TargetModel:
    """The engine's forward over a HF Llama-family *ForCausalLM (weights shared, not copied).

    With `native` (see eyas/native/quant.py) the decoder matrices and the head run from the GGUF's quantized
    weights and attention runs through eyas's row-invariant kernel; everything else is shared."""

    # model: a HF *ForCausalLM; its submodules vary by family, which nn.Module's __getattr__ (Tensor | Module)
    # cannot say, so it and its parts are Any here
    def __init__(self, model: Any, native: NativeWeights | None = None, kernel_attention: bool = False):
        cfg = check_family(model)
        self.hf = model
        self.native = native
        self.fallback: str | None = None  # why --weights auto ran fp32 instead of native (set by engine_model)
        # eyas's C attention for masked fp32 forwards (native weights always use it): it skips masked keys
        # without reading them, which pays when rows of one batch hold sequences of very different lengths
        # (datagen's regeneration)
        self.kernel_attention = kernel_attention
        if kernel_attention and (model.dtype != torch.float32 or model.device.type != "cpu"):
            raise ModelError(f"eyas's attention kernel runs fp32 on the CPU; this target is {model.dtype} on "
                             f"{model.device}")
        if native is not None and (model.dtype != torch.float32 or model.device.type != "cpu"):
            raise ModelError(f"native GGUF weights run on the CPU with an fp32 residual stream; this target is "
                             f"{model.dtype} on {model.device} (use --weights fp32, or --dtype fp32 --device cpu)")
        self.config = cfg
        # the MoE families in fp32 on the CPU run every product and attention through eyas's row-invariant
        # kernels, so a verified row is the bits of the same row alone (rowwise.py); row_note says why not
        self.ops, self.row_note = ops_for(cfg.model_type, model.dtype, model.device, native is not None)
        embed: Any
        norm: Any
        layers: Any
        embed, layers, norm = decoder_parts(model)
        self.embed_weight: torch.Tensor = embed.weight
        self.norm_weight = norm.weight
        self.eps = float(cfg.rms_norm_eps)
        head = model.get_output_embeddings()
        self.lm_weight, self.lm_bias = head.weight, head.bias
        inner = model.get_decoder()
        self.rotary = inner.rotary_emb  # HF's own RoPE module: every rope_type it knows stays exact
        self.num_layers = len(layers)
        self.hidden_size = int(cfg.hidden_size)
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or self.hidden_size // self.num_heads)
        self.scale = float(layers[0].self_attn.scaling)
        self.windows = [getattr(l.self_attn, "sliding_window", None) for l in layers]
        if not self.windows[0] and getattr(cfg, "model_type", "") == "mistral":
            self.windows = [getattr(cfg, "sliding_window", None)] * self.num_layers
        gemma = cfg.model_type == "gemma3_text"
        if getattr(cfg, "attn_logit_softcapping", None):
            raise ModelError(f"this {cfg.model_type} target caps attention logits (attn_logit_softcapping "
                             f"{cfg.attn_logit_softcapping}), which eyas's attention does not implement")
        self._norm = _rms_gemma if gemma else _rms
        scale = getattr(embed, "embed_scale", None)  # gemma multiplies the embedding by sqrt(hidden)
        self.embed_scale = scale if isinstance(scale, torch.Tensor) else None
        self.softcap = float(getattr(cfg, "final_logit_softcapping", None) or 0.0)
        # gemma: local (sliding) and global layers have their own RoPE base; HF's rotary takes the layer type
        self.rope_keys = list(cfg.layer_types) if gemma else [None] * len(layers)
        self.half_rope = cfg.model_type == "gpt_oss"  # its rotary returns cos/sin for one half of the head dim
        self.layers: list[_Layer] = []
        for i, l in enumerate(layers):
            a = l.self_attn
            act_name = getattr(cfg, "hidden_act", None) or getattr(cfg, "hidden_activation", "silu")
            self.layers.append(_Layer(
                ln1=l.input_layernorm.weight,
                ln2=(l.pre_feedforward_layernorm if gemma else l.post_attention_layernorm).weight,
                ln_post_attn=l.post_attention_layernorm.weight if gemma else None,
                ln_post_ff=l.post_feedforward_layernorm.weight if gemma else None,
                mats=native.layers[i] if native is not None else _dense(l, self.ops),
                qn=a.q_norm.weight if hasattr(a, "q_norm") else None,
                kn=a.k_norm.weight if hasattr(a, "k_norm") else None,
                act=None if act_name == "silu" else getattr(l.mlp, "act_fn", None),
                moe=moe_mlp(cfg, i, l, self.ops), sinks=getattr(a, "sinks", None),
                mla=mla_of(cfg, a, self.ops) if hasattr(a, "kv_a_proj_with_mqa") else None,
            ))
        qn = getattr(layers[0].self_attn, "q_norm", None)
        self.qk_eps = float(getattr(qn, "variance_epsilon", None) or qn.eps) if qn is not None \
            else self.eps
        self.stack = self._fused_stack()

    def _fused_stack(self) -> kernels.Q4Stack | Bf16Stack | None:
        """The decoder stack as one object when native weights cover the plain llama layer (4-bit matrices, no
        biases, no q/k norms, SiLU): every matrix in eyas's 4-bit kernel runs the whole stack as one C call
        (kernels.Q4Stack); int4 ones run a few calls per layer (Bf16Stack). Anything else: the layer loop."""
        nat = self.native
        if nat is None or self.embed_scale is not None or any(
                L.qn is not None or L.act is not None or L.ln_post_attn is not None for L in self.layers):
            return None
        if not all({"qkv", "o", "gu", "d"} <= set(m) and all(q.four_bit and q.bias is None for q in m.values())
                   for m in nat.layers):
            return None
        if all(q.kind == "q4" for m in nat.layers for q in m.values()):
            return kernels.Q4Stack(nat.layers, [L.ln1.float().contiguous() for L in self.layers],
                                   [L.ln2.float().contiguous() for L in self.layers], self.eps, self.num_heads,
                                   self.num_kv_heads, self.head_dim)
        return Bf16Stack(nat.layers, self.layers, self.eps, self.num_heads, self.num_kv_heads, self.head_dim)

    @property
    def device(self) -> torch.device:
        return self.embed_weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_weight.dtype

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        shape = (self.num_layers, batch, self.num_kv_heads, max_len, self.head_dim)
        mla = self.layers[0].mla
        k_shape, v_shape = (shape, shape) if mla is None else ((*shape[:2], 1, max_len, mla.rank),
                                                                (*shape[:2], 1, max_len, mla.rope))
        return KVCache(torch.empty(k_shape, dtype=self.dtype, device=self.device),
                       torch.empty(v_shape, dtype=self.dtype, device=self.device))

    def _mask(self, cache: KVCache, S: int, T: int, tree_mask, attn_mask):
        """-> bool [B|1, 1, S, T] (True = may attend) or None (every query sees all T keys)."""
        start = cache.length
        dev = self.device
        if attn_mask is not None:
            if attn_mask.dim() != 4 or attn_mask.shape[-2:] != (S, T):
                raise ModelError(f"attn_mask must be bool [B, 1, {S}, {T}] (new tokens x cache+new), "
                                 f"found {tuple(attn_mask.shape)}")
            mask = attn_mask.to(dev, torch.bool)
        elif tree_mask is not None:
            if tuple(tree_mask.shape) != (S, S):
                raise ModelError(f"tree_mask must be bool [{S}, {S}] over the new tokens, found "
                                 f"{tuple(tree_mask.shape)}")
            mask = torch.cat([torch.ones(S, start, dtype=torch.bool, device=dev),
                              tree_mask.to(dev, torch.bool)], dim=1)[None, None]
        elif S == 1:
            mask = None
        else:
            q = torch.arange(start, start + S, device=dev)
            mask = (torch.arange(T, device=dev)[None, :] <= q[:, None])[None, None]
        return mask

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache,
                tree_mask: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
                capture: list[int] | None = None, logits: str | torch.Tensor = "last",
                slots: torch.Tensor | None = None) -> ForwardOut:
        """Run S new tokens after the cache's committed slots and write their K/V into slots
        [length, length+S) (the caller commits them with `cache.length += S` or `compact`).
        slots [B] (S = 1 only): row b writes its key/value at slot slots[b] < length + 1 instead, and attn_mask
        says which slots each row sees (rows of different lengths in one cache).

        input_ids, position_ids [B, S]. Mask: tree_mask [S, S] (the prefix is fully visible) or
        attn_mask [B|1, 1, S, length+S], else causal. capture: stream indices to return (concatenated
        in that order) plus the final pre-norm state. logits: 'last' | 'all' | 'none' | row index tensor."""
        B, S = input_ids.shape
        start = cache.length
        T = start + S
        if T > cache.max_len:
            raise ModelError(f"KV cache holds {cache.max_len} slots; {start} used + {S} new does not fit")
        if tuple(position_ids.shape) != (B, S):
            raise ModelError(f"position_ids must be [{B}, {S}], found {tuple(position_ids.shape)}")
        mask = self._mask(cache, S, T, tree_mask, attn_mask)
        rows = None
        if slots is not None:
            if S != 1 or attn_mask is None or tuple(slots.shape) != (B,):
                raise ModelError(f"per-row slots need one new token per row, slots [{B}] and an attn_mask; found "
                                 f"S={S}, slots {tuple(slots.shape)}")
            rows = torch.arange(B, device=self.device)
        want = set(capture or [])
        # native and the row-invariant MoE forward: always the row-invariant kernel; fp32 asks for it for masked
        # steps only (a causal prefill runs faster through SDPA's flash path)
        kernel = self.native is not None or self.ops.row_invariant or (self.kernel_attention and mask is not None)
        store: dict[int, torch.Tensor] = {}
        x = F.embedding(input_ids, self.embed_weight)  # [B, S, H]
        if self.embed_scale is not None:
            x = x * self.embed_scale.to(x.dtype)
        rope = {}  # per rope kind (gemma: one per layer type) -> cos, sin [B, 1, S, hd]
        for key in dict.fromkeys(self.rope_keys):
            cos, sin = self.rotary(x, position_ids) if key is None else self.rotary(x, position_ids, key)
            if self.half_rope:
                cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
            rope[key] = cos[:, None], sin[:, None]
        window_masks = self._window_masks(mask, position_ids, start, T, rows is not None)
        masks = [window_masks.get(w, mask) for w in self.windows]
        if self.stack is not None:
            cos, sin = rope[None]
            x = self.stack(x.float().contiguous(), cos[:, 0].contiguous(), sin[:, 0].contiguous(), cache.k, cache.v,
                           start, masks, self.scale, want, store, None if slots is None else
                           slots.to(torch.int64).contiguous())
        else:
            for i, L in enumerate(self.layers):
                if i in want:
                    store[i] = x
                h = self._attention(i, L, self._norm(x, L.ln1, self.eps), rope[self.rope_keys[i]], cache, start,
                                    masks[i], kernel, rows, slots)
                x = x + (self._norm(h, L.ln_post_attn, self.eps) if L.ln_post_attn is not None else h)
                y = self._mlp(L, self._norm(x, L.ln2, self.eps))
                x = x + (self._norm(y, L.ln_post_ff, self.eps) if L.ln_post_ff is not None else y)
        aux = final = None
        if capture is not None:
            store[self.num_layers] = x
            aux = torch.cat([store[k] for k in capture], dim=-1) if capture else None
            final = x
        return ForwardOut(self._logits(x, logits), aux, final)

    def _attention(self, i: int, L: _Layer, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                   cache: KVCache, start: int, m: torch.Tensor | None, kernel: bool, rows: torch.Tensor | None,
                   slots: torch.Tensor | None) -> torch.Tensor:
        """Layer i's attention block: normed h [B, S, H] -> o_proj output [B, S, H]; writes its K/V to the cache."""
        B, S, _ = h.shape
        T = start + S
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        if L.mla is not None:
            return mla_attention(L.mla, h, rope, cache.k[i], cache.v[i], start, m, rows, slots)
        w = L.mats
        if "qkv" in w:
            q, k, v = w["qkv"](h).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        else:
            q, k, v = w["q"](h), w["k"](h), w["v"](h)
        q, k, v = q.view(B, S, nh, hd), k.view(B, S, nkv, hd), v.view(B, S, nkv, hd)
        if L.qn is not None:
            assert L.kn is not None  # q_norm and k_norm come together (qwen3)
            q, k = self._norm(q, L.qn, self.qk_eps), self._norm(k, L.kn, self.qk_eps)
        cos, sin = rope
        q = _rotate(q.transpose(1, 2), cos, sin)  # [B, nh, S, hd]
        k = _rotate(k.transpose(1, 2), cos, sin)  # [B, nkv, S, hd]
        if rows is None:
            cache.k[i, :, :, start:T] = k
            cache.v[i, :, :, start:T] = v.transpose(1, 2)
        else:
            cache.k[i][rows, :, slots] = k[:, :, 0]  # [B, nkv, hd] at (b, :, slots[b])
            cache.v[i][rows, :, slots] = v[:, 0]
        if L.sinks is not None and kernel:  # the native kernel with the sink in its softmax
            o = kernels.attention_kv(q.transpose(1, 2), cache.k[i], cache.v[i], start, m, self.scale, L.sinks.float())
            o = o.reshape(B, S, nh * hd)  # from [B, S, nh, hd]
        elif L.sinks is not None:  # no sink term in SDPA
            o = sink_attention(q, cache.k[i, :, :, :T], cache.v[i, :, :, :T], m, self.scale, L.sinks)
            o = o.transpose(1, 2).reshape(B, S, nh * hd)
        elif kernel:
            o = kernels.attention(q.transpose(1, 2), cache.k[i], cache.v[i], start, m, self.scale)
            o = o.reshape(B, S, nh * hd)  # from [B, S, nh, hd]
        else:
            o = F.scaled_dot_product_attention(q, cache.k[i, :, :, :T], cache.v[i, :, :, :T], attn_mask=m,
                                               scale=self.scale, enable_gqa=nh != nkv)  # [B, nh, S, hd]
            o = o.transpose(1, 2).reshape(B, S, nh * hd)
        return w["o"](o)

    def _mlp(self, L: _Layer, h: torch.Tensor) -> torch.Tensor:
        """Gated MLP: normed h [B, S, H] -> [B, S, H]."""
        if L.moe is not None:
            return L.moe(h)
        w = L.mats
        g, u = w["gu"](h).chunk(2, dim=-1) if "gu" in w else (w["g"](h), w["u"](h))
        g = self.ops.pointwise(F.silu if L.act is None else L.act, g)
        return w["d"](g * u)

    def _logits(self, x: torch.Tensor, logits: str | torch.Tensor) -> torch.Tensor | None:
        if isinstance(logits, torch.Tensor):
            return self.head(x[:, logits])
        if logits == "last":
            return self.head(x[:, -1:])
        if logits == "all":
            return self.head(x)
        if logits != "none":
            raise ModelError(f"logits={logits!r}: expected 'last', 'all', 'none' or a row index tensor")
        return None

    def _window_masks(self, mask: torch.Tensor | None, position_ids: torch.Tensor, start: int, T: int,
                      slot_is_position: bool) -> dict[int | None, torch.Tensor]:
        """Per sliding-window size w that some key falls outside of: the mask [B|1, 1, S, T] of `mask` (None =
        all T keys) with keys w or more positions behind the query hidden (HF: kv > q - w). Committed slots
        hold position == slot; new rows hold position_ids (every slot, with per-row slots)."""
        out: dict[int | None, torch.Tensor] = {}  # keyed like self.windows, whose None (no window) is never set
        dev = self.device
        for w in {w for w in self.windows if w}:
            if T <= w:  # the query at the last position is at most T-1 < w positions past any key
                continue
            B = position_ids.shape[0]
            kpos = torch.arange(T, device=dev).expand(B, T)
            if not slot_is_position:
                kpos = torch.cat([kpos[:, :start], position_ids], dim=1)  # [B, T]
            near = (position_ids[:, :, None] - kpos[:, None, :]) < w  # [B, S, T]
            out[w] = near[:, None] if mask is None else mask & near[:, None]
        return out

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """stream L states [.., H] -> logits [.., V] (final norm + lm_head)."""
        h = self._norm(x, self.norm_weight, self.eps)
        logits = self.native.head(h) if self.native is not None else self.ops.linear(h, self.lm_weight, self.lm_bias)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @torch.no_grad()
    def capture(self, input_ids: torch.Tensor, indices: list[int], logits: str = "none") -> Capture:
        """Capture through the engine's own forward (same contract as eyas.target.capture; causal, no padding)."""
        bad = [k for k in indices if not 0 <= k <= self.num_layers]
        if bad:
            raise ModelError(f"stream indices {bad} are outside 0..{self.num_layers}")
        B, S = input_ids.shape
        cache = self.new_cache(B, S)
        pos = torch.arange(S, device=self.device).expand(B, S)
        out = self.forward(input_ids.to(self.device), pos, cache, capture=list(indices), logits=logits)
        assert out.final is not None  # capture= was passed
        post = self._norm(out.final, self.norm_weight, self.eps)
        # aux is None only for no indices (eyas.probe.streams asks for stream L alone, then never reads aux)
        return Capture(aux=cast(torch.Tensor, out.aux), final_prenorm=out.final, final_postnorm=post,
                       logits=out.logits)


class Bf16Stack:
    """The decoder stack over torch's int4 kernel with bf16 activations, a few calls per layer: the same call
    shape as kernels.Q4Stack (x [B, S, H] fp32 -> stream L [B, S, H]; store[i] gets stream i for i in want)."""

    def __init__(self, mats: list[dict], layers: list[_Layer], eps: float, nh: int, nkv: int, hd: int):
        self.mats, self.layers, self.eps = mats, layers, eps
        self.nh, self.nkv, self.hd = nh, nkv, hd

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 start: int, masks: list[torch.Tensor | None], scale: float, want: set[int],
                 store: dict[int, torch.Tensor], slots: torch.Tensor | None = None) -> torch.Tensor:
        pending = None  # the previous layer's MLP output, added by the next norm
        for i, (L, w) in enumerate(zip(self.layers, self.mats, strict=True)):
            h = kernels.add_rms_bf16(x, pending, L.ln1, self.eps)  # [B, S, H] bf16; x is now stream i
            if i in want:
                store[i] = x.clone()
            qkv = w["qkv"].mm_bf16(h)  # [B, S, (nh + 2 nkv) hd] bf16
            o = kernels.rope_attend(qkv, cos, sin, k[i], v[i], start, masks[i], scale, self.nh, self.nkv, self.hd,
                                    slots)
            h = kernels.add_rms_bf16(x, w["o"].mm_bf16(o), L.ln2, self.eps)
            pending = w["d"].mm_bf16(kernels.silu_mul_bf16(w["gu"].mm_bf16(h)))
        assert pending is not None  # the stack has at least one layer
        return x + pending.float()
