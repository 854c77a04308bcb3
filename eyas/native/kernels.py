"""Call eyas's batch-invariant CPU kernels (the .c files beside this one) through ctypes.

The C sources need no torch headers, so the first build takes about a second with the machine's compiler
(`$CC`, else cc/gcc); eyas/native/build.py caches it under $EYAS_CACHE/kernels, keyed by the sources, the
compiler's identity, the flags and the CPU's features, and verifies it before every load. Every wrapper checks its
tensors against the kernel's assumptions first (eyas/native/boundary.py): bad input is a KernelError, not a crash.
"""

from __future__ import annotations

import ctypes
import os
from functools import cache
from pathlib import Path
from typing import Any

import torch

from ..rope import rope_cos_sin
from . import boundary as bd
from . import build as _build
from .boundary import KernelError

__all__ = ["KernelError"]

_DIR = Path(__file__).parent
# one shared library from these files, one concern each (kernels.h says which); kernels.h holds what they share
SOURCES = tuple(_DIR / f for f in ("attention.c", "layer_ops.c", "matmul_head.c", "matmul_q4.c", "matmul_q8.c",
                                    "q4_layers.c", "draft_layer.c", "isa.c"))
HEADERS = (_DIR / "kernels.h",)
# no -march: the library runs on any CPU of its architecture and picks its instruction-set variant at run time
# (isa.c); -ffp-contract=off keeps every variant's float operations those the C spells out (same bits on each)
FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


@cache
def lib() -> ctypes.CDLL:
    """The kernel library: built or taken from the verified cache, every entry point declared and the argument
    structs compared with the library's (boundary.declare)."""
    so, _ = _build.cached_library(_build.compiler(), (*SOURCES, *HEADERS), FLAGS)
    return _isa_from_env(bd.declare(so))


def library_key() -> dict[str, str]:
    """The kernel library's cache key (build.cache_key): what a record about this library is filed under."""
    return _build.cache_key(_build.compiler(), (*SOURCES, *HEADERS), FLAGS)


# ---- instruction-set variants (isa.c): the best the CPU has, or $EYAS_ISA ----------------------------------------

def _isa_from_env(so: ctypes.CDLL) -> ctypes.CDLL:
    so.eyas_isa_select.argtypes = so.eyas_isa_supported.argtypes = [ctypes.c_char_p]
    so.eyas_isa_select.restype = so.eyas_isa_supported.restype = ctypes.c_int
    so.eyas_isa_name.restype = so.eyas_isa_names.restype = ctypes.c_char_p
    want = os.environ.get("EYAS_ISA", "").strip()
    if want:
        _select(so, want, "EYAS_ISA=")
    return so


def _select(so: ctypes.CDLL, name: str, how: str = "") -> None:
    rc = so.eyas_isa_select(name.encode())
    if rc == 0:
        return
    known = so.eyas_isa_names().decode().split(",")
    if rc == 1:
        raise KernelError(f"{how}{name}: no such instruction-set variant; eyas's kernels have {', '.join(known)}")
    here = [n for n in known if so.eyas_isa_supported(n.encode())]
    raise KernelError(f"{how}{name}: this CPU lacks the instructions of that variant; it runs {', '.join(here)} "
                      f"(unset EYAS_ISA for the best of them)")


def isa() -> str:
    """The instruction-set variant the kernels run: portable, avx2 or avx512vnni."""
    return lib().eyas_isa_name().decode()


def supported_isas() -> list[str]:
    """The variants this CPU runs, best last."""
    so = lib()
    return [n for n in so.eyas_isa_names().decode().split(",") if so.eyas_isa_supported(n.encode())]


def select_isa(name: str) -> None:
    """Run the kernels' `name` variant from now on (between kernel calls); KernelError if the CPU lacks it."""
    _select(lib(), name)


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _mask_bytes(mask: torch.Tensor | None, S: int, T: int, B: int = 1) -> tuple[torch.Tensor | None, int]:
    """bool mask [B|1, 1, S, T] -> (contiguous [B|1, S, T] view the caller keeps alive during the call, batch
    stride in bytes; 0 = one mask for every sequence). torch stores bool as one 0/1 byte: no conversion."""
    if mask is None:
        return None, 0
    bd.require(isinstance(mask, torch.Tensor) and mask.device.type == "cpu",
               f"mask: expected a CPU tensor, found {type(mask).__name__}")
    bd.require(mask.numel() in (S * T, B * S * T), f"mask: expected [1 or {B}, 1, {S}, {T}] (S rows x start+S keys), "
                                                   f"found shape {tuple(mask.shape)}")
    m = mask.to(torch.bool).reshape(-1, S, T).contiguous()
    return m, (S * T if m.shape[0] > 1 else 0)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int,
              mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q [B, S, nh, hd] fp32; one layer's cache [B, kvh, max_len, hd] holding keys 0..start+S-1;
    mask None (causal) or bool [B|1, 1|-, S, start+S]. -> [B, S, nh, hd], identical bits for a row whatever
    the other rows, S or the positions of masked keys."""
    bd.tensor(q, "attention q", torch.float32, 4, contiguous=False)
    B, S, nh, hd = q.shape
    kvh, max_len = _cache_pair(k_cache, v_cache, "attention", B, hd)
    bd.heads(nh, kvh, hd, rope=False)
    _span(start, S, max_len)
    q = q.contiguous()
    out = torch.empty_like(q)
    T = start + S
    m, m_stride = _mask_bytes(mask, S, T, B)
    rc = lib().eyas_attention(_ptr(q), _ptr(k_cache), _ptr(v_cache), max_len, B, S, nh, kvh, hd, start,
                              None if m is None else _ptr(m), m_stride, float(scale), _ptr(out),
                              torch.get_num_threads())
    bd.check_status(rc, "attention")
    return out


def _span(start: int, S: int, max_len: int) -> None:
    """Rows start..start+S-1 must fit the cache the kernel writes and reads."""
    bd.require(start >= 0 and S >= 1 and start + S <= max_len,
               f"cache slots {start}..{start + S - 1}: the KV cache holds {max_len} positions (and S >= 1, start >= 0)")


def _cache_pair(k: torch.Tensor, v: torch.Tensor, what: str, B: int, hd: int) -> tuple[int, int]:
    """One layer's caches [B, kvh, max_len, hd] fp32, contiguous and alike -> (kvh, max_len)."""
    bd.tensor(k, f"{what} k cache", torch.float32, 4)
    bd.tensor(v, f"{what} v cache", torch.float32, 4)
    bd.shape(k, f"{what} k cache [B, kvh, max_len, hd]", (B, k.shape[1], k.shape[2], hd))
    bd.shape(v, f"{what} v cache", tuple(k.shape))
    return k.shape[1], k.shape[2]


def _x_rows(x: torch.Tensor, K: int, what: str) -> None:
    bd.float_input(x, f"{what} x")
    bd.require(x.dim() >= 1 and x.shape[-1] == K, f"{what}: x's last dim must be the weight's K = {K}, found shape "
                                                  f"{tuple(x.shape)}")


def q8_matmul(x: torch.Tensor, qw: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x [..., K] fp32 @ (d * qw)^T for a Q8_0 weight qw int8 [N, K], d fp32 [N, K/32], fp32 activations
    -> [..., N] fp32."""
    bd.tensor(qw, "q8_matmul weight", torch.int8, 2)
    N, K = qw.shape
    bd.blocks(K, "q8_matmul weight")
    bd.tensor(d, "q8_matmul scales", torch.float32, 2)
    bd.shape(d, "q8_matmul scales [N, K/32]", (N, K // bd.BLOCK))
    _x_rows(x, K, "q8_matmul")
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
    bd.blocks(k, "pack_q8")
    bd.shape(d, "pack_q8 scales [N, K/32]", (n, k // 32))
    nb, G = k // 32, (n + 7) // 8
    pad = 8 * G - n
    qb = torch.nn.functional.pad(q.to(torch.int8), (0, 0, 0, pad)).view(G, 8, nb, 8, 4)  # [G, j, b, c, e]
    w = qb.permute(0, 2, 3, 1, 4).contiguous().view(torch.uint8).view(G, nb, 256)  # byte 32c + 4j + e
    return torch.cat([_tile_lanes(d, pad), w], dim=-1).contiguous()


def q8q8_matmul(x: torch.Tensor, tiles: torch.Tensor, n: int) -> torch.Tensor:
    """x [..., K] fp32 @ W^T for an 8-bit W [n, K] packed by pack_q8, activations quantized to 8 bits per row
    and 32-block (ggml's Q8_0 x Q8_0 dot) -> [..., n] fp32; a row's bits never depend on the other rows."""
    _tiles(x, tiles, n, Q8_TILE_BYTES, "8-bit")
    K = x.shape[-1]
    x2 = x.reshape(-1, K).contiguous().float()
    out = torch.empty(x2.shape[0], n, dtype=torch.float32)
    bd.check_status(lib().eyas_q8q8_matmul(_ptr(x2), _ptr(tiles), _ptr(out), x2.shape[0], n, K,
                                           torch.get_num_threads()), "8-bit matmul")
    return out.view(*x.shape[:-1], n)


def _tiles(x: torch.Tensor, tiles: torch.Tensor, n: int, tile: int, what: str) -> None:
    """x [..., K] against tiles uint8 [ceil(n/8), K/32, tile] for an [n, K] matrix."""
    bd.float_input(x, f"{what} matmul x")
    bd.tensor(tiles, f"{what} tiles", torch.uint8, 3)
    K = x.shape[-1] if x.dim() else 0
    bd.blocks(K, f"{what} matmul x")
    bd.require(n > 0 and tuple(tiles.shape) == ((n + 7) // 8, K // bd.BLOCK, tile),
               f"{what} tiles {tuple(tiles.shape)} do not fit a [{n}, {K}] matrix (expected "
               f"{((n + 7) // 8, K // bd.BLOCK, tile)})")


Q4_TILE_BYTES = 192  # one 8-output group x one 32-block: float d[8], float m[8], 128 nibble bytes (matmul_q4.c)


def pack_q4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """q int [N, K] (0..15, GGUF element order), d, m fp32 [N, K/32] (w = d*q + m) -> uint8 [ceil(N/8), K/32, 192]
    tiles interleaved by 8 outputs (matmul_q4.c: eyas_q4_matmul_bf16); N is padded with zero outputs."""
    n, k = q.shape
    bd.blocks(k, "pack_q4")
    bd.shape(d, "pack_q4 scales [N, K/32]", (n, k // 32))
    bd.shape(m, "pack_q4 minimums [N, K/32]", (n, k // 32))
    nb, G = k // 32, (n + 7) // 8
    pad = 8 * G - n
    q8 = torch.nn.functional.pad(q.to(torch.uint8), (0, 0, 0, pad)).view(G, 8, nb, 2, 4, 4)  # [G, j, b, half, p, e]
    nib = (q8[:, :, :, 0] | (q8[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4).reshape(G, nb, 128)  # byte 32p + 4j + e
    return torch.cat([_tile_lanes(d, pad), _tile_lanes(m, pad), nib], dim=-1).contiguous()


def q4_matmul_bf16(x: torch.Tensor, tiles: torch.Tensor, n: int) -> torch.Tensor:
    """x [..., K] bf16 @ W^T for a 4-bit W [n, K] packed by pack_q4, activations quantized to 8 bits per row
    and 32-block inside the kernel -> [..., n] bf16; a row's bits never depend on the other rows."""
    _tiles(x, tiles, n, Q4_TILE_BYTES, "4-bit")
    K = x.shape[-1]
    x2 = x.reshape(-1, K).to(torch.bfloat16).contiguous()
    out = torch.empty(x2.shape[0], n, dtype=torch.bfloat16)
    bd.check_status(lib().eyas_q4_matmul_bf16(_ptr(x2), _ptr(tiles), _ptr(out), x2.shape[0], n, K,
                                              torch.get_num_threads()), "4-bit matmul")
    return out.view(*x.shape[:-1], n)


def _slots(slots: torch.Tensor | None, B: int, S: int, max_len: int) -> int | None:
    """Per-row cache slots for the kernels: None, or int64 [B] with S = 1 (kept alive by the caller), each a
    position of the cache (the kernel writes row b's K/V there)."""
    if slots is None:
        return None
    bd.tensor(slots, "per-row slots", torch.int64, 1)
    if S != 1 or tuple(slots.shape) != (B,):
        raise KernelError(f"per-row slots need S = 1 and an int64 [{B}] tensor, found S={S}, {tuple(slots.shape)}")
    bd.require(B == 0 or (int(slots.min()) >= 0 and int(slots.max()) < max_len),
               f"per-row slots must lie in 0..{max_len - 1} (the KV cache's positions), found {slots.tolist()}")
    return slots.data_ptr()


def _ptrs(ts) -> ctypes.Array:
    return (ctypes.c_void_p * len(ts))(*[None if t is None else t.data_ptr() for t in ts])


def _addr(a: ctypes.Array | None) -> int | None:
    return None if a is None else ctypes.addressof(a)


def _rope_tables(cos: torch.Tensor, sin: torch.Tensor, lead: tuple[int, ...], hd: int) -> tuple[torch.Tensor, ...]:
    """cos/sin [*lead, hd] fp32 -> contiguous copies (or themselves) the kernel reads by row."""
    for name, t in (("cos", cos), ("sin", sin)):
        bd.tensor(t, f"RoPE {name}", torch.float32, contiguous=False)
        bd.shape(t, f"RoPE {name}", (*lead, hd))
    return cos.contiguous(), sin.contiguous()


class Q4Stack:
    """One model's 4-bit decoder stack for eyas_q4_layers: the whole stack in one C call per forward, with
    the kernels (and their order) of the per-layer loop it replaces. Pointer tables are built once."""

    def __init__(self, layers: list[dict], ln1: list[torch.Tensor], ln2: list[torch.Tensor], eps: float,
                 nh: int, kvh: int, hd: int):
        self._keep = [ln1, ln2, layers]  # the tensors behind the pointers live as long as this object
        self.L, self.H, self.I = len(layers), layers[0]["o"].n, layers[0]["d"].k
        self.nh, self.kvh, self.hd, self.eps = nh, kvh, hd, float(eps)
        bd.heads(nh, kvh, hd)
        for K, what in ((self.H, "hidden size"), (self.I, "intermediate size"), (nh * hd, "heads x head_dim")):
            bd.blocks(K, f"4-bit stack {what}")
        bd.require(len(ln1) == len(ln2) == self.L, f"4-bit stack: {len(ln1)}/{len(ln2)} norms for {self.L} layers")
        for i, (m, a, b) in enumerate(zip(layers, ln1, ln2, strict=True)):
            for key, (n, k) in (("qkv", ((nh + 2 * kvh) * hd, self.H)), ("o", (self.H, nh * hd)),
                                ("gu", (2 * self.I, self.H)), ("d", (self.H, self.I))):
                bd.tensor(m[key].w, f"layer {i} {key} tiles", torch.uint8, 3)
                bd.shape(m[key].w, f"layer {i} {key} tiles", ((n + 7) // 8, k // bd.BLOCK, Q4_TILE_BYTES))
            for name, t in (("ln1", a), ("ln2", b)):
                bd.tensor(t, f"layer {i} {name}", torch.float32, 1)
                bd.shape(t, f"layer {i} {name}", (self.H,))
        self.w = [_ptrs([m[k].w for m in layers]) for k in ("qkv", "o", "gu", "d")]
        self.ln1, self.ln2 = _ptrs(ln1), _ptrs(ln2)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 start: int, masks: list[torch.Tensor | None], scale: float, want: set[int],
                 store: dict[int, torch.Tensor], slots: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, S, H] fp32 (updated in place); cos/sin [B, S, hd]; k, v caches [L, B, kvh, max_len, hd];
        per-layer masks; slots int64 [B] (S = 1): row b's K/V go to slot slots[b] instead of `start`.
        -> the final stream [B, S, H]; store[i] gets stream i for i in want."""
        bd.tensor(x, "4-bit stack x", torch.float32, 3)
        B, S, H = x.shape
        bd.require(H == self.H, f"4-bit stack x: hidden size {H}, the model's is {self.H}")
        cos, sin = _rope_tables(cos, sin, (B, S), self.hd)
        for name, t in (("k", k), ("v", v)):
            bd.tensor(t, f"4-bit stack {name} cache", torch.float32, 5)
            bd.shape(t, f"4-bit stack {name} cache [L, B, kvh, max_len, hd]",
                     (self.L, B, self.kvh, k.shape[3], self.hd))
        _span(start, S, k.shape[3])
        bd.require(len(masks) == self.L, f"4-bit stack: {len(masks)} masks for {self.L} layers")
        T = start + S
        uniq: dict[int, tuple[torch.Tensor | None, int]] = {}
        for m in masks:
            if id(m) not in uniq:
                uniq[id(m)] = _mask_bytes(m, S, T, B)
        mk = [uniq[id(m)] for m in masks]
        for i in want:
            if i < self.L:  # stream L (the final one) is the returned x itself
                store[i] = torch.empty_like(x)
        tables = [_ptrs([k[i] for i in range(self.L)]), _ptrs([v[i] for i in range(self.L)]),
                  _ptrs([m for m, _ in mk]), (ctypes.c_int64 * self.L)(*[st for _, st in mk]),
                  _ptrs([store.get(i) for i in range(self.L)])]  # alive until the call returns
        a = bd.Q4LayersArgs(ctypes.sizeof(bd.Q4LayersArgs), _ptr(x), *map(_addr, self.w), _addr(self.ln1),
                            _addr(self.ln2), _ptr(cos), _ptr(sin), _addr(tables[0]), _addr(tables[1]),
                            _slots(slots, B, S, k.shape[3]), _addr(tables[2]), _addr(tables[3]), _addr(tables[4]),
                            k.shape[3], self.eps, float(scale), B * S, H, self.L, B, S, self.nh, self.kvh, self.hd,
                            self.I, start, torch.get_num_threads())
        bd.check_status(lib().eyas_q4_layers(ctypes.byref(a)), "the 4-bit decoder stack")
        return x


class DraftLayer:
    """A q8-quantized EAGLE-3 draft's midlayer (native.quant.quantize_draft_q8) for eyas_draft_layer: one C call per
    draft step instead of ~60 torch ops. q|k|v and gate|up are fused once here; RoPE comes from a cached table."""

    def __init__(self, draft: torch.nn.Module):
        # The midlayer's matrices are Q8Linear swapped in by quantize_draft_q8, so typed lookups through
        # nn.Module.__getattr__ (Tensor | Module) say nothing useful here.
        c: Any = draft.config
        L: Any = draft.midlayer
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
        bd.heads(self.nh, self.kvh, self.hd)
        nq, H, I = self.nh * self.hd, self.H, self.I
        for name, t, n, k in (("q|k|v", self.wqkv, nq + 2 * self.kvh * self.hd, 2 * H), ("o", self.wo, H, nq),
                              ("gate|up", self.wgu, 2 * I, H), ("down", self.wd, H, I)):
            bd.blocks(k, f"draft {name}")
            bd.tensor(t, f"draft {name} tiles", torch.uint8, 3)
            bd.shape(t, f"draft {name} tiles", ((n + 7) // 8, k // bd.BLOCK, Q8_TILE_BYTES))
        self.scale = 1.0 / float(c.head_dim) ** 0.5  # SDPA's default, as eyas.draft attends
        self._rope = lambda n: rope_cos_sin(torch.arange(n)[None], c.head_dim, c.rope_theta, torch.float32)
        self.cos = self.sin = torch.empty(0, c.head_dim)

    def __call__(self, hidden: torch.Tensor, emb: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, start: int, mask: torch.Tensor) -> torch.Tensor:
        """hidden, emb [1, R, H] fp32; pos [1, R]; draft caches [1, kvh, max_len, hd] (rows written at start..);
        mask bool [1, 1, R, start+R] -> layer output [1, R, H]."""
        bd.float_input(hidden, "draft hidden")
        bd.float_input(emb, "draft embedding")
        R = hidden.shape[1] if hidden.dim() == 3 else 0
        bd.shape(hidden, "draft hidden", (1, R, self.H))
        bd.shape(emb, "draft embedding", (1, R, self.H))
        bd.require(isinstance(pos, torch.Tensor) and tuple(pos.shape) == (1, R) and R > 0 and int(pos.min()) >= 0,
                   f"draft positions: expected [1, {R}] non-negative, found {getattr(pos, 'shape', pos)}")
        kvh, max_len = _cache_pair(k_cache, v_cache, "draft", 1, self.hd)
        bd.require(kvh == self.kvh, f"draft cache: {kvh} key/value heads, the draft has {self.kvh}")
        _span(start, R, max_len)
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
        a = bd.DraftLayerArgs(ctypes.sizeof(bd.DraftLayerArgs), _ptr(h), _ptr(e), _ptr(cos), _ptr(sin),
                              _ptr(self.wqkv), _ptr(self.wo), _ptr(self.wgu), _ptr(self.wd),
                              *[_ptr(w) for w in self.norms], _ptr(k_cache), _ptr(v_cache),
                              None if m is None else _ptr(m), _ptr(out), max_len, self.eps, self.scale, R, self.H,
                              self.nh, self.kvh, self.hd, self.I, start, torch.get_num_threads())
        bd.check_status(lib().eyas_draft_layer(ctypes.byref(a)), "the draft layer")
        return out.view(1, R, self.H)


def f32_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w^T for an fp32 weight [N, K], row-invariant (MKL's sgemm is not) -> [..., N]."""
    bd.tensor(w, "f32_matmul weight", torch.float32, 2)
    K = w.shape[1]
    _x_rows(x, K, "f32_matmul")
    x2 = x.reshape(-1, K).contiguous().float()
    out = torch.empty(x2.shape[0], w.shape[0], dtype=torch.float32)
    lib().eyas_f32_matmul(_ptr(x2), _ptr(w), _ptr(out), x2.shape[0], w.shape[0], K, torch.get_num_threads())
    return out.view(*x.shape[:-1], w.shape[0])


def f32_matmul_kn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w for an fp32 weight stored [K, N] (input-major), row-invariant -> [..., N]."""
    bd.tensor(w, "f32_matmul_kn weight", torch.float32, 2)
    K, N = w.shape
    _x_rows(x, K, "f32_matmul_kn")
    x2 = x.reshape(-1, K).contiguous().float()
    out = torch.empty(x2.shape[0], N, dtype=torch.float32)
    lib().eyas_f32_matmul_kn(_ptr(x2), _ptr(w), _ptr(out), x2.shape[0], N, K, torch.get_num_threads())
    return out.view(*x.shape[:-1], N)


def attention_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, mask: torch.Tensor | None,
                 scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """attention's walk with keys and values of their own sizes (MLA) and optional per-head sink logits (gpt-oss):
    q [B, S, nh, kd] fp32, k [B, kvh, kmax, kd], v [B, kvh, vmax, vd] holding keys 0..start+S-1, sinks [nh] fp32
    -> [B, S, nh, vd], a row's bits whatever the other rows, S or the slots of masked keys."""
    bd.tensor(q, "attention_kv q", torch.float32, 4, contiguous=False)
    bd.tensor(k, "attention_kv keys", torch.float32, 4)
    bd.tensor(v, "attention_kv values", torch.float32, 4)
    B, S, nh, kd = q.shape
    kvh, vd = k.shape[1], v.shape[3]
    bd.require(k.shape[0] == v.shape[0] == B and v.shape[1] == kvh and k.shape[3] == kd and vd > 0,
               f"attention_kv: keys [B={B}, kvh, kmax, {kd}] and values [B, kvh, vmax, vd] expected, found "
               f"{tuple(k.shape)} and {tuple(v.shape)}")
    bd.require(nh % kvh == 0, f"attention_kv: {nh} query heads must be a multiple of {kvh} key/value heads")
    _span(start, S, min(k.shape[2], v.shape[2]))
    if sinks is not None:
        bd.tensor(sinks, "attention_kv sinks", torch.float32, 1)
        bd.shape(sinks, "attention_kv sinks", (nh,))
    q = q.contiguous()
    out = torch.empty(B, S, nh, vd, dtype=torch.float32)
    m, m_stride = _mask_bytes(mask, S, start + S, B)
    rc = lib().eyas_attention_kv(_ptr(q), _ptr(k), k.shape[2], _ptr(v), v.shape[2], B, S, nh, kvh, kd, vd, start,
                                 None if m is None else _ptr(m), m_stride, None if sinks is None else _ptr(sinks),
                                 float(scale), _ptr(out), torch.get_num_threads())
    bd.check_status(rc, "attention_kv")
    return out


def add_rms_bf16(x: torch.Tensor, y: torch.Tensor | None, w: torch.Tensor, eps: float) -> torch.Tensor:
    """In place x [.., H] fp32 += y (bf16, optional); returns bf16(RMSNorm(x) * w)."""
    bd.tensor(x, "add_rms x (updated in place)", torch.float32)
    H = x.shape[-1] if x.dim() else 0
    bd.require(H > 0, f"add_rms x: expected [.., H] with H > 0, found {tuple(x.shape)}")
    if y is not None:
        bd.tensor(y, "add_rms y", torch.bfloat16)
        bd.shape(y, "add_rms y", tuple(x.shape))
    bd.tensor(w, "add_rms weight", torch.float32, 1)
    bd.shape(w, "add_rms weight", (H,))
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    lib().eyas_add_rms_bf16(_ptr(x), None if y is None else _ptr(y), _ptr(w), _ptr(out), x.numel() // H, H,
                            float(eps), torch.get_num_threads())
    return out


def silu_mul_bf16(gu: torch.Tensor) -> torch.Tensor:
    """gu [.., 2I] bf16 (gate | up) -> silu(gate) * up [.., I] bf16."""
    bd.tensor(gu, "silu_mul gate|up", torch.bfloat16)
    I2 = gu.shape[-1] if gu.dim() else 0
    bd.require(I2 > 0 and I2 % 2 == 0, f"silu_mul: expected [.., 2I] (gate | up), found {tuple(gu.shape)}")
    out = torch.empty(*gu.shape[:-1], I2 // 2, dtype=torch.bfloat16)
    lib().eyas_silu_mul_bf16(_ptr(gu), _ptr(out), gu.numel() // I2, I2 // 2, torch.get_num_threads())
    return out


def rope_attend(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, start: int, mask: torch.Tensor | None, scale: float, nh: int, kvh: int,
                hd: int, slots: torch.Tensor | None = None) -> torch.Tensor:
    """qkv [B, S, (nh+2kvh)hd] bf16; cos/sin [B, S, hd] fp32; one layer's cache [B, kvh, max_len, hd] fp32.
    Writes the rotated k and v at slots start.. (or row b's at slots[b], S = 1) and returns attention out
    [B, S, nh*hd] bf16."""
    bd.tensor(qkv, "rope_attend qkv", torch.bfloat16, 3)
    B, S, _ = qkv.shape
    bd.heads(nh, kvh, hd)
    bd.shape(qkv, "rope_attend qkv [B, S, (nh + 2 kvh) hd]", (B, S, (nh + 2 * kvh) * hd))
    cos, sin = _rope_tables(cos, sin, (B, S), hd)
    got_kvh, max_len = _cache_pair(k_cache, v_cache, "rope_attend", B, hd)
    bd.require(got_kvh == kvh, f"rope_attend cache: {got_kvh} key/value heads, expected {kvh}")
    _span(start, S, max_len)
    T = start + S
    qbuf = torch.empty(B, S, nh, hd)
    obuf = torch.empty(B, S, nh, hd)
    out = torch.empty(B, S, nh * hd, dtype=torch.bfloat16)
    m, m_stride = _mask_bytes(mask, S, T, B)
    rc = lib().eyas_rope_attend(_ptr(qkv), _ptr(cos), _ptr(sin), _ptr(k_cache), _ptr(v_cache), max_len, B, S, nh,
                                kvh, hd, start, _slots(slots, B, S, max_len), None if m is None else _ptr(m),
                                m_stride, float(scale), _ptr(qbuf), _ptr(obuf), _ptr(out), torch.get_num_threads())
    bd.check_status(rc, "RoPE + attention")
    return out
