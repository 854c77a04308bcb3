"""Build and call eyas's batch-invariant CPU kernels (the .c files beside this one) through ctypes.

The C sources need no torch headers, so the first build takes about a second with the machine's compiler
(`$CC`, else cc/gcc) and is cached under $EYAS_CACHE/kernels by a hash of the sources (header included),
compiler and flags.
`-march=native`: the cached object is tied to this CPU, which the hash's machine tag records.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import torch

from ..errors import EyasError
from ..files import atomic_write, cache_dir
from ..rope import rope_cos_sin

_DIR = Path(__file__).parent
# one shared library from these files, one concern each (kernels.h says which); kernels.h holds what they share
_SOURCES = tuple(_DIR / f for f in ("attention.c", "layer_ops.c", "matmul_head.c", "matmul_q4.c", "matmul_q8.c",
                                    "q4_layers.c", "draft_layer.c"))
_HEADERS = (_DIR / "kernels.h",)
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


class KernelError(EyasError):
    pass


def _compiler() -> str:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    raise KernelError("the native CPU mode builds a small C kernel at first use and found no C compiler "
                      "(cc, gcc or clang; or set $CC); install one (Debian: apt install gcc) or run with "
                      "--weights fp32")


def build(cc: str, sources: Sequence[Path], out: Path) -> None:
    """Compile and link `sources` (each finds kernels.h beside itself) into the shared library `out`."""
    r = subprocess.run([cc, *_FLAGS, *map(str, sources), "-o", str(out), "-lm"], capture_output=True, text=True)
    if r.returncode != 0:
        raise KernelError(f"building eyas's CPU kernel with {cc} failed: {r.stderr.strip()[:400]}; "
                          "run with --weights fp32 to avoid it")


def _source_hash() -> bytes:
    """Every source and header, named, so that any edit (or a renamed file) gives another cache entry."""
    return b"".join(p.name.encode() + b"\0" + p.read_bytes() for p in (*_SOURCES, *_HEADERS))


@cache
def lib() -> ctypes.CDLL:
    cc = _compiler()
    tag = hashlib.sha256(_source_hash() + cc.encode() + " ".join(_FLAGS).encode() + platform.node().encode()
                         + platform.machine().encode()).hexdigest()[:16]
    out = cache_dir() / "kernels" / f"eyas_kernels-{tag}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(out, lambda tmp: build(cc, _SOURCES, tmp))
    so = ctypes.CDLL(str(out))
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    so.eyas_attention.argtypes = [p, p, p, i64, i32, i32, i32, i32, i32, i32, p, i64, f32, p, i32]
    so.eyas_attention.restype = None
    so.eyas_q8_matmul.argtypes = [p, p, p, p, i32, i32, i32, i32]
    so.eyas_q8_matmul.restype = None
    so.eyas_f32_matmul.argtypes = [p, p, p, i32, i32, i32, i32]
    so.eyas_f32_matmul.restype = None
    so.eyas_add_rms_bf16.argtypes = [p, p, p, p, i32, i32, f32, i32]
    so.eyas_add_rms_bf16.restype = None
    so.eyas_silu_mul_bf16.argtypes = [p, p, i32, i32, i32]
    so.eyas_silu_mul_bf16.restype = None
    so.eyas_rope_attend.argtypes = [p, p, p, p, p, i64, i32, i32, i32, i32, i32, i32, p, p, i64, f32, p, p, p, i32]
    so.eyas_rope_attend.restype = None
    so.eyas_q4_matmul_bf16.argtypes = [p, p, p, i32, i32, i32, i32]
    so.eyas_q4_matmul_bf16.restype = None
    so.eyas_q4_layers.argtypes = [p, i32, i32, i32, p, p, p, p, p, p, f32, p, p, p, p, i64, i32, i32, i32, i32, i32,
                                  i32, i32, p, p, p, f32, p, i32]
    so.eyas_q4_layers.restype = None
    so.eyas_q8q8_matmul.argtypes = [p, p, p, i32, i32, i32, i32]
    so.eyas_q8q8_matmul.restype = None
    so.eyas_draft_layer.argtypes = [p] * 11 + [f32, p, p, i64] + [i32] * 7 + [p, f32, p, i32]
    so.eyas_draft_layer.restype = None
    return so


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _mask_bytes(mask: torch.Tensor | None, S: int, T: int) -> tuple[torch.Tensor | None, int]:
    """bool mask [B|1, 1, S, T] -> (contiguous [B|1, S, T] view the caller keeps alive during the call, batch
    stride in bytes; 0 = one mask for every sequence). torch stores bool as one 0/1 byte: no conversion."""
    if mask is None:
        return None, 0
    m = mask.to(torch.bool).reshape(-1, S, T).contiguous()
    return m, (S * T if m.shape[0] > 1 else 0)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int,
              mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q [B, S, nh, hd] fp32; one layer's cache [B, kvh, max_len, hd] holding keys 0..start+S-1;
    mask None (causal) or bool [B|1, 1|-, S, start+S]. -> [B, S, nh, hd], identical bits for a row whatever
    the other rows, S or the positions of masked keys."""
    B, S, nh, hd = q.shape
    kvh, max_len = k_cache.shape[1], k_cache.shape[2]
    if q.dtype != torch.float32 or k_cache.dtype != torch.float32 or q.device.type != "cpu":
        raise KernelError(f"the invariant attention kernel takes fp32 CPU tensors, got {q.dtype} on {q.device}")
    q = q.contiguous()
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise KernelError("the KV cache slices passed to the attention kernel must be contiguous")
    out = torch.empty_like(q)
    T = start + S
    m, m_stride = _mask_bytes(mask, S, T)
    lib().eyas_attention(_ptr(q), _ptr(k_cache), _ptr(v_cache), max_len, B, S, nh, kvh, hd, start,
                         None if m is None else _ptr(m), m_stride, float(scale), _ptr(out), torch.get_num_threads())
    return out


def q8_matmul(x: torch.Tensor, qw: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x [..., K] fp32 @ (d * qw)^T for a Q8_0 weight qw int8 [N, K], d fp32 [N, K/32], fp32 activations
    -> [..., N] fp32."""
    K = x.shape[-1]
    N = qw.shape[0]
    x2 = x.reshape(-1, K).contiguous().float()
    out = torch.empty(x2.shape[0], N, dtype=torch.float32)
    lib().eyas_q8_matmul(_ptr(x2), _ptr(qw), _ptr(d), _ptr(out), x2.shape[0], N, K, torch.get_num_threads())
    return out.view(*x.shape[:-1], N)


def _tile_lanes(s: torch.Tensor, pad: int) -> torch.Tensor:
    """Per-block scales [N, nb] fp32 -> bytes [ceil(N/8), nb, 32] as a tile stores them: output j's float at byte
    4j; the pad outputs get 0."""
    s = torch.nn.functional.pad(s.float(), (0, 0, 0, pad))
    G, nb = s.shape[0] // 8, s.shape[1]
    return s.view(G, 8, nb).permute(0, 2, 1).contiguous().view(torch.uint8).view(G, nb, 32)


Q8_TILE_BYTES = 288  # one 8-output group x one 32-block: float d[8], 256 int8 weights (matmul_q8.c)


def pack_q8(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """q int8 [N, K], d fp32 [N, K/32] (w = d*q) -> uint8 [ceil(N/8), K/32, 288] tiles interleaved by 8 outputs
    (matmul_q8.c: eyas_q8q8_matmul); N is padded with zero outputs."""
    n, k = q.shape
    nb, G = k // 32, (n + 7) // 8
    pad = 8 * G - n
    qb = torch.nn.functional.pad(q.to(torch.int8), (0, 0, 0, pad)).view(G, 8, nb, 8, 4)  # [G, j, b, c, e]
    w = qb.permute(0, 2, 3, 1, 4).contiguous().view(torch.uint8).view(G, nb, 256)  # byte 32c + 4j + e
    return torch.cat([_tile_lanes(d, pad), w], dim=-1).contiguous()


def q8q8_matmul(x: torch.Tensor, tiles: torch.Tensor, n: int) -> torch.Tensor:
    """x [..., K] fp32 @ W^T for an 8-bit W [n, K] packed by pack_q8, activations quantized to 8 bits per row
    and 32-block (ggml's Q8_0 x Q8_0 dot) -> [..., n] fp32; a row's bits never depend on the other rows."""
    K = x.shape[-1]
    if tiles.shape[1] * 32 != K or tiles.shape[2] != Q8_TILE_BYTES or tiles.shape[0] != (n + 7) // 8:
        raise KernelError(f"8-bit tiles {tuple(tiles.shape)} do not fit a [{n}, {K}] matrix")
    x2 = x.reshape(-1, K).contiguous().float()
    out = torch.empty(x2.shape[0], n, dtype=torch.float32)
    lib().eyas_q8q8_matmul(_ptr(x2), _ptr(tiles), _ptr(out), x2.shape[0], n, K, torch.get_num_threads())
    return out.view(*x.shape[:-1], n)


Q4_TILE_BYTES = 192  # one 8-output group x one 32-block: float d[8], float m[8], 128 nibble bytes (matmul_q4.c)


def pack_q4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """q int [N, K] (0..15, GGUF element order), d, m fp32 [N, K/32] (w = d*q + m) -> uint8 [ceil(N/8), K/32, 192]
    tiles interleaved by 8 outputs (matmul_q4.c: eyas_q4_matmul_bf16); N is padded with zero outputs."""
    n, k = q.shape
    nb, G = k // 32, (n + 7) // 8
    pad = 8 * G - n
    q8 = torch.nn.functional.pad(q.to(torch.uint8), (0, 0, 0, pad)).view(G, 8, nb, 2, 4, 4)  # [G, j, b, half, p, e]
    nib = (q8[:, :, :, 0] | (q8[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4).reshape(G, nb, 128)  # byte 32p + 4j + e
    return torch.cat([_tile_lanes(d, pad), _tile_lanes(m, pad), nib], dim=-1).contiguous()


def q4_matmul_bf16(x: torch.Tensor, tiles: torch.Tensor, n: int) -> torch.Tensor:
    """x [..., K] bf16 @ W^T for a 4-bit W [n, K] packed by pack_q4, activations quantized to 8 bits per row
    and 32-block inside the kernel -> [..., n] bf16; a row's bits never depend on the other rows."""
    K = x.shape[-1]
    if tiles.shape[1] * 32 != K or tiles.shape[2] != Q4_TILE_BYTES or tiles.shape[0] != (n + 7) // 8:
        raise KernelError(f"4-bit tiles {tuple(tiles.shape)} do not fit a [{n}, {K}] matrix")
    x2 = x.reshape(-1, K).to(torch.bfloat16).contiguous()
    out = torch.empty(x2.shape[0], n, dtype=torch.bfloat16)
    lib().eyas_q4_matmul_bf16(_ptr(x2), _ptr(tiles), _ptr(out), x2.shape[0], n, K, torch.get_num_threads())
    return out.view(*x.shape[:-1], n)


def _slots(slots: torch.Tensor | None, B: int, S: int) -> int | None:
    """Per-row cache slots for the kernels: None, or int64 [B] with S = 1 (kept alive by the caller)."""
    if slots is None:
        return None
    if S != 1 or slots.dtype != torch.int64 or tuple(slots.shape) != (B,) or not slots.is_contiguous():
        raise KernelError(f"per-row slots need S = 1 and a contiguous int64 [{B}] tensor, found S={S}, "
                          f"{slots.dtype} {tuple(slots.shape)}")
    return slots.data_ptr()


def _ptrs(ts) -> ctypes.Array:
    return (ctypes.c_void_p * len(ts))(*[None if t is None else t.data_ptr() for t in ts])


class Q4Stack:
    """One model's 4-bit decoder stack for eyas_q4_layers: the whole stack in one C call per forward, with
    the kernels (and their order) of the per-layer loop it replaces. Pointer tables are built once."""

    def __init__(self, layers: list[dict], ln1: list[torch.Tensor], ln2: list[torch.Tensor], eps: float,
                 nh: int, kvh: int, hd: int):
        self._keep = [ln1, ln2, layers]  # the tensors behind the pointers live as long as this object
        self.L, self.H, self.I = len(layers), layers[0]["o"].n, layers[0]["d"].k
        self.nh, self.kvh, self.hd, self.eps = nh, kvh, hd, float(eps)
        self.w = [_ptrs([m[k].w for m in layers]) for k in ("qkv", "o", "gu", "d")]
        self.ln1, self.ln2 = _ptrs(ln1), _ptrs(ln2)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 start: int, masks: list[torch.Tensor | None], scale: float, want: set[int],
                 store: dict[int, torch.Tensor], slots: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, S, H] fp32 (updated in place); cos/sin [B, S, hd]; k, v caches [L, B, kvh, max_len, hd];
        per-layer masks; slots int64 [B] (S = 1): row b's K/V go to slot slots[b] instead of `start`.
        -> the final stream [B, S, H]; store[i] gets stream i for i in want."""
        B, S, H = x.shape
        T = start + S
        uniq: dict[int, tuple[torch.Tensor | None, int]] = {}
        for m in masks:
            if id(m) not in uniq:
                uniq[id(m)] = _mask_bytes(m, S, T)
        mk = [uniq[id(m)] for m in masks]
        for i in want:
            if i < self.L:  # stream L (the final one) is the returned x itself
                store[i] = torch.empty_like(x)
        lib().eyas_q4_layers(_ptr(x), B * S, H, self.L, *self.w, self.ln1, self.ln2, self.eps, _ptr(cos), _ptr(sin),
                             _ptrs([k[i] for i in range(self.L)]), _ptrs([v[i] for i in range(self.L)]), k.shape[3],
                             B, S, self.nh, self.kvh, self.hd, self.I, start, _slots(slots, B, S),
                             _ptrs([m for m, _ in mk]),
                             (ctypes.c_int64 * self.L)(*[st for _, st in mk]), float(scale),
                             _ptrs([store.get(i) for i in range(self.L)]), torch.get_num_threads())
        return x


class DraftLayer:
    """A q8-quantized EAGLE-3 draft's midlayer (native.quant.quantize_draft_q8) for eyas_draft_layer: one C call per
    draft step instead of ~60 torch ops. q|k|v and gate|up are fused once here; RoPE comes from a cached table."""

    def __init__(self, draft: torch.nn.Module):
        c, L = draft.config, draft.midlayer
        a, m = L.self_attn, L.mlp
        mats = [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]
        if any(not hasattr(x, "q") or x.bias is not None for x in mats):
            raise KernelError("the draft's one-call layer needs every matrix as an unbiased Q8Linear")
        self.wqkv = pack_q8(torch.cat([a.q_proj.q, a.k_proj.q, a.v_proj.q]), torch.cat([a.q_proj.d, a.k_proj.d,
                                                                                       a.v_proj.d]))
        self.wgu = pack_q8(torch.cat([m.gate_proj.q, m.up_proj.q]), torch.cat([m.gate_proj.d, m.up_proj.d]))
        self.wo, self.wd = a.o_proj.t, m.down_proj.t
        self.norms = [n.weight.detach().float().contiguous()
                      for n in (L.input_layernorm, L.hidden_norm, L.post_attention_layernorm)]
        self.eps = float(L.input_layernorm.eps)
        self.H, self.I, self.nh, self.kvh, self.hd = (c.hidden_size, c.intermediate_size, c.num_attention_heads,
                                                       c.num_key_value_heads, c.head_dim)
        self.scale = 1.0 / float(c.head_dim) ** 0.5  # SDPA's default, as eyas.draft attends
        self._rope = lambda n: rope_cos_sin(torch.arange(n)[None], c.head_dim, c.rope_theta, torch.float32)
        self.cos = self.sin = torch.empty(0, c.head_dim)

    def __call__(self, hidden: torch.Tensor, emb: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, start: int, mask: torch.Tensor) -> torch.Tensor:
        """hidden, emb [1, R, H] fp32; pos [1, R]; draft caches [1, kvh, max_len, hd] (rows written at start..);
        mask bool [1, 1, R, start+R] -> layer output [1, R, H]."""
        R = hidden.shape[1]
        need = int(pos.max()) + 1
        if need > self.cos.shape[0]:  # grow the RoPE table (doubling: rare)
            cos, sin = self._rope(max(need, 2 * self.cos.shape[0], 1024))
            self.cos, self.sin = cos[0, 0].contiguous(), sin[0, 0].contiguous()
        p = pos[0].long()
        cos, sin = self.cos[p].contiguous(), self.sin[p].contiguous()
        h = hidden.reshape(R, self.H).float().contiguous()
        e = emb.reshape(R, self.H).float().contiguous()
        m, _ = _mask_bytes(mask, R, start + R)
        out = torch.empty(R, self.H)
        lib().eyas_draft_layer(_ptr(h), _ptr(e), _ptr(cos), _ptr(sin), _ptr(self.wqkv), _ptr(self.wo), _ptr(self.wgu),
                               _ptr(self.wd),
                               *[_ptr(w) for w in self.norms], self.eps, _ptr(k_cache), _ptr(v_cache),
                               k_cache.shape[2], R, self.H, self.nh, self.kvh, self.hd, self.I, start, _ptr(m),
                               self.scale, _ptr(out), torch.get_num_threads())
        return out.view(1, R, self.H)


def f32_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w^T for an fp32 weight [N, K], row-invariant (MKL's sgemm is not) -> [..., N]."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K).contiguous().float()
    out = torch.empty(x2.shape[0], w.shape[0], dtype=torch.float32)
    lib().eyas_f32_matmul(_ptr(x2), _ptr(w), _ptr(out), x2.shape[0], w.shape[0], K, torch.get_num_threads())
    return out.view(*x.shape[:-1], w.shape[0])


def add_rms_bf16(x: torch.Tensor, y: torch.Tensor | None, w: torch.Tensor, eps: float) -> torch.Tensor:
    """In place x [.., H] fp32 += y (bf16, optional); returns bf16(RMSNorm(x) * w)."""
    H = x.shape[-1]
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    lib().eyas_add_rms_bf16(_ptr(x), None if y is None else _ptr(y), _ptr(w), _ptr(out), x.numel() // H, H,
                            float(eps), torch.get_num_threads())
    return out


def silu_mul_bf16(gu: torch.Tensor) -> torch.Tensor:
    """gu [.., 2I] bf16 (gate | up) -> silu(gate) * up [.., I] bf16."""
    I2 = gu.shape[-1]
    out = torch.empty(*gu.shape[:-1], I2 // 2, dtype=torch.bfloat16)
    lib().eyas_silu_mul_bf16(_ptr(gu), _ptr(out), gu.numel() // I2, I2 // 2, torch.get_num_threads())
    return out


def rope_attend(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, start: int, mask: torch.Tensor | None, scale: float, nh: int, kvh: int,
                hd: int, slots: torch.Tensor | None = None) -> torch.Tensor:
    """qkv [B, S, (nh+2kvh)hd] bf16; cos/sin [B, S, hd] fp32; one layer's cache [B, kvh, max_len, hd] fp32.
    Writes the rotated k and v at slots start.. (or row b's at slots[b], S = 1) and returns attention out
    [B, S, nh*hd] bf16."""
    B, S, _ = qkv.shape
    T = start + S
    qbuf = torch.empty(B, S, nh, hd)
    obuf = torch.empty(B, S, nh, hd)
    out = torch.empty(B, S, nh * hd, dtype=torch.bfloat16)
    m, m_stride = _mask_bytes(mask, S, T)
    lib().eyas_rope_attend(_ptr(qkv), _ptr(cos), _ptr(sin), _ptr(k_cache), _ptr(v_cache), k_cache.shape[2], B, S,
                           nh, kvh, hd, start, _slots(slots, B, S), None if m is None else _ptr(m), m_stride,
                           float(scale), _ptr(qbuf),
                           _ptr(obuf), _ptr(out),
                           torch.get_num_threads())
    return out
