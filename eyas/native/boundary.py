"""The checked boundary between Python and eyas's C kernels: the argument structs (mirrors of kernels.h's
typedefs), every entry point's argtypes/restype, and the tensor checks each wrapper runs before a call.

The C side trusts its arguments (a wrong shape writes past a buffer), so whatever can be wrong is caught here
and reported as one KernelError line; the structs' sizes are compared with the library's own at load time.
"""

from __future__ import annotations

import ctypes

import torch

from ..errors import EyasError


class KernelError(EyasError):
    pass


MAX_HEAD_DIM = 256  # attention.c: attend_row's accumulator is float acc[256] on the stack
BLOCK = 32  # q4/q8 weights and 8-bit activations come in blocks of 32 along K
EYAS_OK, EYAS_ENOMEM, EYAS_EARGS = 0, 1, 2  # kernels.h

_p, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class Q4LayersArgs(ctypes.Structure):
    """kernels.h: eyas_q4_layers_args, field for field."""
    _fields_ = [("struct_size", ctypes.c_size_t), ("x", _p), ("wqkv", _p), ("wo", _p), ("wgu", _p), ("wd", _p),
                ("ln1", _p), ("ln2", _p), ("cos", _p), ("sin", _p), ("kc", _p), ("vc", _p), ("slots", _p),
                ("masks", _p), ("mask_bstrides", _p), ("store", _p), ("maxlen", _i64), ("eps", _f32),
                ("scale", _f32), *[(n, _i32) for n in ("R", "H", "L", "B", "S", "nh", "kvh", "hd", "I", "start",
                                                      "nthreads")]]


class DraftLayerArgs(ctypes.Structure):
    """kernels.h: eyas_draft_layer_args, field for field."""
    _fields_ = [("struct_size", ctypes.c_size_t), *[(n, _p) for n in (
        "hidden", "emb", "cos", "sin", "wqkv", "wo", "wgu", "wd", "w_in", "w_hid", "w_post", "kc", "vc", "mask",
        "out")], ("maxlen", _i64), ("eps", _f32), ("scale", _f32),
        *[(n, _i32) for n in ("R", "H", "nh", "kvh", "hd", "I", "start", "nthreads")]]


STRUCTS = (Q4LayersArgs, DraftLayerArgs)  # eyas_args_sizes' order

# every entry point: (argtypes, restype); None = void
SIGNATURES = {
    "eyas_attention": ([_p, _p, _p, _i64, _i32, _i32, _i32, _i32, _i32, _i32, _p, _i64, _f32, _p, _i32], _i32),
    "eyas_q8_matmul": ([_p, _p, _p, _p, _i32, _i32, _i32, _i32], None),
    "eyas_f32_matmul": ([_p, _p, _p, _i32, _i32, _i32, _i32], None),
    "eyas_f32_matmul_kn": ([_p, _p, _p, _i32, _i32, _i32, _i32], None),
    "eyas_attention_kv": ([_p, _p, _i64, _p, _i64, _i32, _i32, _i32, _i32, _i32, _i32, _i32, _p, _i64, _p, _f32, _p,
                           _i32], _i32),
    "eyas_add_rms_bf16": ([_p, _p, _p, _p, _i32, _i32, _f32, _i32], None),
    "eyas_silu_mul_bf16": ([_p, _p, _i32, _i32, _i32], None),
    "eyas_rope_attend": ([_p, _p, _p, _p, _p, _i64, _i32, _i32, _i32, _i32, _i32, _i32, _p, _p, _i64, _f32, _p, _p,
                          _p, _i32], _i32),
    "eyas_q4_matmul_bf16": ([_p, _p, _p, _i32, _i32, _i32, _i32], _i32),
    "eyas_q8q8_matmul": ([_p, _p, _p, _i32, _i32, _i32, _i32], _i32),
    "eyas_q4_layers": ([ctypes.POINTER(Q4LayersArgs)], _i32),
    "eyas_draft_layer": ([ctypes.POINTER(DraftLayerArgs)], _i32),
    "eyas_args_sizes": ([ctypes.POINTER(_i64), _i32], _i32),
}


def declare(so: ctypes.CDLL) -> ctypes.CDLL:
    """Set every entry point's argtypes/restype and compare the argument structs with the library's; a library
    that lacks one or lays a struct out differently is refused (KernelError), never called."""
    for name, (args, res) in SIGNATURES.items():
        fn = getattr(so, name, None)
        if fn is None:
            raise KernelError(f"the CPU kernel library {so._name} has no {name}; remove it (it is rebuilt) or run "
                              "with --weights fp32")
        fn.argtypes, fn.restype = args, res
    sizes = (_i64 * len(STRUCTS))()
    count = so.eyas_args_sizes(sizes, len(STRUCTS))
    mine = [ctypes.sizeof(s) for s in STRUCTS]
    if count != len(STRUCTS) or list(sizes) != mine:
        raise KernelError(f"the CPU kernel's argument structs ({count} of sizes {list(sizes)[:count]} bytes) do not "
                          f"match eyas/native/boundary.py ({mine}); kernels.h and boundary.py must change together")
    return so


def check_status(rc: int, what: str) -> None:
    """A struct entry point's return code -> KernelError (EYAS_OK passes)."""
    if rc == EYAS_ENOMEM:
        raise KernelError(f"{what}: out of memory for the kernel's scratch buffers; use fewer rows or a smaller "
                          "batch, or free memory")
    if rc != EYAS_OK:
        raise KernelError(f"{what}: the kernel refused its arguments (code {rc}); kernels.h and "
                          "eyas/native/boundary.py disagree")


def tensor(t: object, name: str, dtype: torch.dtype, ndim: int | None = None, contiguous: bool = True) -> None:
    """`t` is a CPU tensor of `dtype` (and `ndim` dims; contiguous when the kernel reads or writes it in place)."""
    if not isinstance(t, torch.Tensor):
        raise KernelError(f"{name}: expected a torch tensor, found {type(t).__name__}")
    if t.device.type != "cpu":
        raise KernelError(f"{name}: the native kernels run on the CPU, found a tensor on {t.device}")
    if t.dtype != dtype:
        raise KernelError(f"{name}: expected {dtype}, found {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise KernelError(f"{name}: expected {ndim} dims, found shape {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise KernelError(f"{name}: expected a contiguous tensor (the kernel reads it by raw pointer); "
                          "call .contiguous()")


def shape(t: torch.Tensor, name: str, want: tuple[int, ...]) -> None:
    if tuple(t.shape) != want:
        raise KernelError(f"{name}: expected shape {want}, found {tuple(t.shape)}")


def require(ok: bool, what: str) -> None:
    """A kernel limit or a consistency rule; `what` says what was expected and what was found."""
    if not ok:
        raise KernelError(what)


def float_input(t: object, name: str) -> None:
    """An activation the wrapper converts and copies itself: any float dtype, on the CPU."""
    if not isinstance(t, torch.Tensor):
        raise KernelError(f"{name}: expected a torch tensor, found {type(t).__name__}")
    if t.device.type != "cpu" or not t.is_floating_point():
        raise KernelError(f"{name}: expected a floating-point CPU tensor, found {t.dtype} on {t.device}")


def heads(nh: int, kvh: int, hd: int, rope: bool = True) -> None:
    """Grouped-query heads, and a head_dim the attention kernel holds (even where it also rotates: RoPE's halves)."""
    require(nh > 0 and kvh > 0 and nh % kvh == 0, f"attention heads: {nh} query heads must be a multiple of {kvh} "
                                                  "key/value heads")
    require(0 < hd <= MAX_HEAD_DIM and (hd % 2 == 0 or not rope),
            f"head_dim {hd}: the attention kernel takes a head_dim of at most {MAX_HEAD_DIM}"
            + (", even (RoPE rotates its halves)" if rope else ""))


def blocks(K: int, name: str) -> None:
    require(K > 0 and K % BLOCK == 0, f"{name}: the 8-bit kernels take K in blocks of {BLOCK}, found K = {K}")
