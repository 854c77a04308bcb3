"""The tensor directory of a GGUF file, read without gguf-py (whose reader builds numpy views for every
metadata string: 8.6 s for SmolLM2's 49k-token vocabulary; this takes ~0.3 s). Also the cheap validity check
that runs before transformers converts a file: a truncated or foreign file gets one clear error."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import EyasError

GROUP = 32
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # bytes per 32-weight block of the types eyas reads


class GGUFError(EyasError):
    pass



# ggml type id -> (name, weights per block, bytes per block): ggml's own table (gguf-py's GGML_QUANT_SIZES, which
# tests/test_native.py compares this with; not imported here because importing gguf-py costs ~0.3 s). Every tensor's
# byte extent is checked against the file size with it, so a truncated file is caught whatever its quantization.
_GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
}
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


@dataclass
class GGUFTensor:
    name: str
    type_name: str
    shape: tuple[int, ...]  # ggml order: shape[0] is the row length
    data: np.ndarray  # uint8 [rows, bytes per row] for block types (a view of the memory-mapped file)


def read_gguf_tensors(path: Path) -> dict[str, GGUFTensor]:
    """The tensor directory of a GGUF v2/v3 file; a truncated or foreign file raises GGUFError."""
    return _read(path)[1]


def read_gguf_metadata(path: Path, keys: Collection[str] | None = None) -> dict[str, object]:
    """The scalar and string metadata of a GGUF v2/v3 file (arrays such as the vocabulary are skipped), all of it
    or only `keys` (a key the file lacks is absent): what the checks that run before any load read
    (`general.architecture` for target.family.target_family, `tokenizer.chat_template` for target.template). The
    tensor directory is checked too (every tensor's extent against the file size; no tensor data is read, ~0.1 s),
    so a truncated or foreign file raises GGUFError here, before any verdict drawn from its metadata."""
    meta = _read(path)[0]
    return meta if keys is None else {k: v for k, v in meta.items() if k in keys}


def _read(path: Path) -> tuple[dict[str, object], dict[str, GGUFTensor]]:
    import struct

    buf = np.memmap(path, dtype=np.uint8, mode="r") if Path(path).stat().st_size else np.zeros(0, np.uint8)
    pos = 0

    def take(fmt: str):
        nonlocal pos
        size = struct.calcsize(fmt)
        if pos + size > len(buf):
            raise GGUFError(f"{path}: the GGUF header ends early at byte {pos} (a truncated download?); "
                            "fetch the file again")
        v = struct.unpack_from(fmt, buf, pos)[0]  # type: ignore[arg-type]  # numpy types __buffer__ on 3.12+ only
        pos += size
        return v

    def string(decode: bool = True) -> str:
        nonlocal pos
        n = take("<Q")
        if pos + n > len(buf):
            raise GGUFError(f"{path}: the GGUF header ends early at byte {pos}; fetch the file again")
        v = bytes(buf[pos:pos + n]).decode("utf-8", "replace") if decode else ""
        pos += n
        return v

    def skip_value(vt: int) -> object:
        nonlocal pos
        if vt == 8:
            return string()
        if vt == 9:
            et, n = take("<I"), take("<Q")
            if et in _SCALAR:
                pos += struct.calcsize(_SCALAR[et]) * n
            elif et == 8:  # e.g. a 262k-token vocabulary: lengths only, no decoding
                for _ in range(n):
                    string(decode=False)
            else:
                for _ in range(n):
                    skip_value(et)
            return None
        if vt not in _SCALAR:
            raise GGUFError(f"{path}: unknown GGUF value type {vt}; not a GGUF file eyas can read")
        return take(_SCALAR[vt])

    if len(buf) < 24 or bytes(buf[:4]) != b"GGUF":
        raise GGUFError(f"{path} is not a GGUF file (no GGUF magic); pass a .gguf file or a HF folder")
    pos = 4
    version = take("<I")
    if version not in (2, 3):
        raise GGUFError(f"{path}: GGUF version {version}; eyas reads versions 2 and 3")
    n_tensors, n_kv = take("<Q"), take("<Q")
    meta: dict[str, object] = {}
    for _ in range(n_kv):
        key, vt = string(), take("<I")
        v = skip_value(vt)
        if v is not None:
            meta[key] = v
    align = meta.get("general.alignment", 32)
    align = align if isinstance(align, int) and align > 0 else 32
    infos = []
    for _ in range(n_tensors):
        name = string()
        dims = tuple(take("<Q") for _ in range(take("<I")))
        infos.append((name, dims, take("<I"), take("<Q")))
    start = (pos + align - 1) // align * align
    out: dict[str, GGUFTensor] = {}
    for name, dims, t, off in infos:
        if t not in _GGML_TYPES:  # a type newer than this table: its extent is unknown, so it is not checked
            out[name] = GGUFTensor(name, f"ggml type {t}", dims, np.empty((0, 0), np.uint8))
            continue
        tname, per_block, block_bytes = _GGML_TYPES[t]
        rows = int(np.prod(dims[1:])) if len(dims) > 1 else 1
        width = dims[0] // per_block * block_bytes if dims else 0
        a = start + off
        if a + rows * width > len(buf):
            raise GGUFError(f"{path}: tensor {name} runs past the end of the file ({len(buf)} bytes); the file "
                            "is truncated, fetch it again")
        out[name] = GGUFTensor(name, tname, dims, buf[a:a + rows * width].reshape(rows, width))
    return meta, out
