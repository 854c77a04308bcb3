"""A GGUF target's own quantized weights for the engine forward (`--weights native`).

eyas's fp32 mode reads a dequantized fp32 copy (540 MB for SmolLM2-135M); the GGUF holds the same
matrices in 4 bits (98 MB). Native mode keeps them quantized:
- Q4_0 / Q4_1 decoder matrices run through torch's int4 CPU kernel (`_weight_int4pack_mm_for_cpu`,
  group 32) with bf16 activations. A Q4_1 block w = d*q + m is the kernel's (q - 8)*scale + zero with
  scale d and zero m + 8d; the kernel takes its scales in the activations' dtype, so d and m + 8d are
  rounded to bf16 (fp16 and fp32 activations run 10-100x slower on CPUs without bf16 units).
- Q8_0 matrices (SmolLM2's tied embedding/head) run through eyas's own kernel (eyas/native/matmul_head.c) in fp32
  with the file's exact values (w = d*q), reading a quarter of the fp32 bytes.
Every kernel here gives a row the same bits whatever the number of rows in the call (checked by tests):
that is what keeps speculative decoding token-identical to plain decoding in this mode.

Before anything runs, every quantized matrix is dequantized and compared bit for bit with the weight the
HF loader produced from the same file, which catches a wrong tensor name or row permutation (llama.cpp
stores q/k rows permuted for its RoPE layout).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch

from ..errors import EyasError
from .gguf_file import BLOCK_BYTES, GROUP, GGUFTensor, read_gguf_tensors

NATIVE_TYPES = tuple(BLOCK_BYTES)

# GGUF tensor suffix -> (HF attribute path inside a decoder layer)
_LAYER_TENSORS = {
    "attn_q": ("self_attn", "q_proj"), "attn_k": ("self_attn", "k_proj"), "attn_v": ("self_attn", "v_proj"),
    "attn_output": ("self_attn", "o_proj"), "ffn_gate": ("mlp", "gate_proj"), "ffn_up": ("mlp", "up_proj"),
    "ffn_down": ("mlp", "down_proj"),
}


class NativeError(EyasError):
    pass




@dataclass
class QLinear:
    """One quantized matrix [N, K] in the form its kernel reads; each subclass is one kind (layout of `w`).
    Called as x [..., K] fp32 -> [..., N] fp32, like torch's Linear."""
    kind: ClassVar[str] = ""
    four_bit: ClassVar[bool] = False  # the 4-bit kinds also offer mm_bf16 (the fused bf16 stack reads it)
    n: int
    k: int
    w: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None = None

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] fp32 -> [M, N] fp32, without the bias."""
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.mm(x.reshape(-1, self.k))
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.n)


@dataclass
class Q4Matrix(QLinear):
    """eyas's 4-bit x 8-bit kernel (llama.cpp's numerics): w uint8 [N/8, K/32, 192] (kernels.pack_q4)."""
    kind: ClassVar[str] = "q4"
    four_bit: ClassVar[bool] = True

    def mm_bf16(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] bf16 -> [..., N] bf16 (the kernel's own output, no casts)."""
        from . import kernels

        return kernels.q4_matmul_bf16(x, self.w, self.n)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return self.mm_bf16(x.to(torch.bfloat16)).float()


@dataclass
class Int4Matrix(QLinear):
    """torch's int4 kernel with bf16 activations: w from _convert_weight_to_int4pack_for_cpu, scales bf16
    [K/32, N, 2] (scale, zero)."""
    kind: ClassVar[str] = "int4"
    four_bit: ClassVar[bool] = True

    def mm_bf16(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, self.k), self.w, GROUP, self.scales)
        return y.view(*x.shape[:-1], self.n)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return self.mm_bf16(x.to(torch.bfloat16)).float()


@dataclass
class Q8Matrix(QLinear):
    """Q8_0: with 8-bit activations w is uint8 [N/8, K/32, 288] (kernels.pack_q8); with fp32 activations w is
    int8 [N, K] and scales fp32 [N, K/32]."""
    kind: ClassVar[str] = "q8"
    act: str = "f32"

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        from . import kernels

        return kernels.q8q8_matmul(x, self.w, self.n) if self.act == "q8" else kernels.q8_matmul(x, self.w,
                                                                                                  self.scales)


@dataclass
class F32Matrix(QLinear):
    """An fp32 weight [N, K] through eyas's row-invariant fp32 kernel (a head type the others do not cover)."""
    kind: ClassVar[str] = "f32"

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        from . import kernels

        return kernels.f32_matmul(x, self.w)


def _blocks(t: GGUFTensor, name: str) -> tuple[str, np.ndarray, int, int]:
    kind = t.type_name
    if kind not in BLOCK_BYTES:
        # --weights native adds "use --weights fp32"; --weights auto says it ran fp32 for this reason
        raise NativeError(f"GGUF tensor {name} is {kind}; native weights cover {', '.join(NATIVE_TYPES)}")
    raw = np.asarray(t.data)
    n = raw.shape[0]
    nb = raw.shape[1] // BLOCK_BYTES[kind]
    return kind, raw.reshape(n, nb, BLOCK_BYTES[kind]), n, nb * GROUP


def _f16(raw: np.ndarray, at: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw[..., at:at + 2]).view(np.float16)[..., 0].astype(np.float32))


def _quantized(t, name: str) -> tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (kind, q int [N, K] (Q4: 0..15, Q8: -128..127), d fp32 [N, K/32], m fp32 [N, K/32] (Q8: zeros))."""
    kind, raw, n, k = _blocks(t, name)
    d = _f16(raw, 0)
    if kind == "Q8_0":
        q = torch.from_numpy(np.ascontiguousarray(raw[..., 2:]).view(np.int8).reshape(n, k))
        return kind, q, d, torch.zeros_like(d)
    off = 4 if kind == "Q4_1" else 2
    qs = torch.from_numpy(np.ascontiguousarray(raw[..., off:]))  # [N, nb, 16]
    q = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(n, k)  # element t: low nibble of byte t, t+16: high
    m = _f16(raw, 2) if kind == "Q4_1" else -8 * d  # Q4_0: w = d * (q - 8)
    return kind, q, d, m


def _dequant(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    # the same op sequence as gguf-py's dequantize (what transformers' loader ran): d * q, then + m
    w = d[:, :, None] * q.view(n, k // GROUP, GROUP).float()
    return (w + m[:, :, None]).view(n, k) if bool((m != 0).any()) else w.view(n, k)


def _llama_unpermute(rows: int, heads: int) -> torch.Tensor:
    """Row order transformers' GGUF loader applies to llama attn_q/attn_k (undoing llama.cpp's permute)."""
    dim = rows // heads // 2
    return torch.arange(rows).view(heads, dim, 2).transpose(1, 2).reshape(rows)


def _match(name: str, q, d, m, hf_weight: torch.Tensor, heads: list[int]):
    """Find the row order under which the GGUF matrix equals the HF weight bit for bit."""
    w = _dequant(q, d, m)
    ref = hf_weight.detach().float().cpu()
    if tuple(w.shape) != tuple(ref.shape):
        raise NativeError(f"GGUF tensor {name} is {tuple(w.shape)} but the loaded weight is {tuple(ref.shape)}; "
                          "use --weights fp32")
    for h in [0, *heads]:
        order = None if h == 0 else _llama_unpermute(w.shape[0], h)
        if torch.equal(w if order is None else w[order], ref):
            return order
    raise NativeError(f"GGUF tensor {name} does not equal the weight transformers loaded from the same file "
                      "under any known row order; the native path would compute a different model. "
                      "Use --weights fp32")


def _cat_bias(parts: list[tuple]) -> torch.Tensor | None:
    if all(p[4] is None for p in parts):
        return None
    return torch.cat([p[4] if p[4] is not None else torch.zeros(p[1].shape[0]) for p in parts])


def _pack(act: str, kind: str, q, d, m, bias) -> QLinear:
    from . import kernels

    n, k = q.shape
    if kind == "Q8_0":
        if act == "q8":  # 8-bit activations: tiles interleaved by 8 outputs (kernels.pack_q8)
            return Q8Matrix(n, k, kernels.pack_q8(q, d), torch.empty(0), bias, "q8")
        return Q8Matrix(n, k, q.contiguous(), d.contiguous(), bias, "f32")
    if act == "q8":  # the file's exact d and m, in fp32
        return Q4Matrix(n, k, kernels.pack_q4(q, d, m), torch.empty(0), bias)
    w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 2)
    sz = torch.stack([d.t(), (m + 8 * d).t()], dim=-1).to(torch.bfloat16).contiguous()  # [K/32, N, 2]
    return Int4Matrix(n, k, w, sz, bias)


@dataclass
class NativeWeights:
    layers: list[dict[str, QLinear]]  # per decoder layer: qkv (or q, k, v), o, gu (or g, u), d(own)
    head: QLinear  # Q8_0 through the q8 kernel, else the fp32 weight through the invariant fp32 kernel
    types: dict[str, int]  # GGUF tensor type -> count, for reports
    act: str = "q8"  # 4-bit matrices' activations: q8 (eyas kernel) | bf16 (torch's int4 kernel)

    def describe(self) -> str:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.types.items()))
        if self.act == "q8":
            return f"native GGUF weights ({kinds}); 4- and 8-bit matrices with 8-bit activations"
        return f"native GGUF weights ({kinds}); int4 kernel with bf16 activations, Q8_0 in fp32"


ACTS = ("q8", "bf16")


def native_misfit(gguf: Path, num_layers: int) -> str | None:
    """Why load_native would refuse this file, read from its tensor headers (no matrix is read): a layer matrix
    missing or of a type the kernels do not cover. None when it would load. `eyas inspect` says what --weights auto
    runs with it, as generate then does."""
    tensors = read_gguf_tensors(gguf)
    for i in range(num_layers):
        for g in _LAYER_TENSORS:
            name = f"blk.{i}.{g}.weight"
            if name not in tensors:
                return f"{gguf.name} has no tensor {name} (native weights need the llama.cpp layout)"
            if tensors[name].type_name not in BLOCK_BYTES:
                return (f"GGUF tensor {name} is {tensors[name].type_name}; native weights cover "
                        f"{', '.join(NATIVE_TYPES)}")
    return None


# head_module: HF's output head, Any because its bias is None or a Tensor by family (nn.Module's __getattr__
# types both Tensor | Module)
def load_native(gguf: Path, layers: Iterable[torch.nn.Module], head_module: Any, num_heads: int,
                num_kv_heads: int, act: str = "q8") -> NativeWeights:
    """Read `gguf`'s quantized matrices for `layers` and `head_module` (the decoder layers and output head of
    the HF model transformers loaded from that file).
    act: the 4-bit matrices' activations: q8 (eyas/native/matmul_q4.c, llama.cpp's Q8_1 per-block quantization, the
    file's exact scales) or bf16 (torch's int4 kernel, scales rounded to bf16)."""
    if act not in ACTS:
        raise NativeError(f"native activations {act!r}: expected one of {', '.join(ACTS)}")
    tensors = read_gguf_tensors(gguf)
    types: dict[str, int] = {}
    out: list[dict[str, QLinear]] = []
    t: GGUFTensor | None  # a layer's tensor below, then the head's, which may be absent
    short = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o", "ffn_gate": "g",
             "ffn_up": "u", "ffn_down": "d"}
    for i, layer in enumerate(layers):
        parts: dict[str, tuple] = {}
        for g, (a, b) in _LAYER_TENSORS.items():
            name = f"blk.{i}.{g}.weight"
            if name not in tensors:
                raise NativeError(f"{gguf.name} has no tensor {name}; native weights need the llama.cpp layout "
                                  "(use --weights fp32)")
            t = tensors[name]
            types[t.type_name] = types.get(t.type_name, 0) + 1
            lin = getattr(getattr(layer, a), b)
            heads = {"attn_q": [num_heads], "attn_k": [num_kv_heads, num_heads]}.get(g, [])
            kind, q, d, m = _quantized(t, name)
            order = _match(name, q, d, m, lin.weight, heads)
            if order is not None:
                q, d, m = q[order], d[order], m[order]
            bias = None if lin.bias is None else lin.bias.detach().float()
            parts[short[g]] = (kind, q, d, m, bias)
        mats: dict[str, QLinear] = {"o": _pack(act, *parts["o"]), "d": _pack(act, *parts["d"])}
        # one kernel call for q|k|v and one for gate|up: fewer calls, one bf16 cast of the shared input
        for fused, names in (("qkv", "qkv"), ("gu", "gu")):
            kinds = {parts[c][0] for c in names}
            if len(kinds) == 1:
                q, d, m = (torch.cat([parts[c][j] for c in names]) for j in (1, 2, 3))
                mats[fused] = _pack(act, kinds.pop(), q, d, m, _cat_bias([parts[c] for c in names]))
            else:
                mats.update({c: _pack(act, *parts[c]) for c in names})
        out.append(mats)
    hname = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    t = tensors.get(hname)
    head = None
    if t is not None and t.type_name == "Q8_0":
        kind, q, d, m = _quantized(t, hname)
        _match(hname, q, d, m, head_module.weight, [])
        head = _pack(act, kind, q, d, m, None)
        types["Q8_0"] = types.get("Q8_0", 0) + 1
    if head is None:  # other head types keep the loader's exact fp32 values
        w = head_module.weight.detach().float().contiguous()
        head = F32Matrix(w.shape[0], w.shape[1], w, torch.empty(0), None)
    if head_module.bias is not None:
        head.bias = head_module.bias.detach().float()
    return NativeWeights(out, head, types, act)


# ---- the draft in 8 bits -------------------------------------------------------------------------

class Q8Linear(torch.nn.Module):
    """An nn.Linear whose weight is stored as int8 blocks of 32 with one fp32 scale each (d = max|w| / 127,
    Q8_0's rule), multiplied by eyas's q8 kernel with 8-bit activations: a quarter of the bytes of an fp32
    draft per step, and integer dot products.
    The draft only proposes tokens, so this cannot change what the target accepts, only how often."""

    q: torch.Tensor  # buffers registered in __init__ (nn.Module's __getattr__ alone types them Tensor | Module)
    d: torch.Tensor
    t: torch.Tensor

    def __init__(self, lin: torch.nn.Linear):
        super().__init__()
        w = lin.weight.detach().float().cpu()
        n, k = w.shape
        if k % GROUP:
            raise NativeError(f"cannot quantize a linear with {k} inputs to blocks of {GROUP}")
        blk = w.view(n, k // GROUP, GROUP)
        d = blk.abs().amax(-1) / 127
        q = torch.where(d[..., None] > 0, blk / d.clamp_min(1e-30)[..., None], torch.zeros_like(blk))
        self.register_buffer("q", q.round().clamp(-127, 127).to(torch.int8).view(n, k))
        self.register_buffer("d", d.contiguous())
        from . import kernels

        self.register_buffer("t", kernels.pack_q8(self.q, self.d), persistent=False)  # what the kernel reads
        self.bias = None if lin.bias is None else torch.nn.Parameter(lin.bias.detach().float(), requires_grad=False)
        self.in_features, self.out_features = k, n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from . import kernels

        y = kernels.q8q8_matmul(x, self.t, self.out_features)
        return y if self.bias is None else y + self.bias


_M = TypeVar("_M", bound=torch.nn.Module)


def quantize_draft_q8(model: _M) -> _M:
    """A copy of a draft with every nn.Linear replaced by Q8Linear (CPU, fp32 activations)."""
    import copy

    emb = getattr(model, "embed_weight", None)  # the target's embeddings: shared, never copied
    out = copy.deepcopy(model, memo={id(emb): emb} if emb is not None else None)
    for mod in list(out.modules()):
        for child_name, child in list(mod.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(mod, child_name, Q8Linear(child))
    return out
