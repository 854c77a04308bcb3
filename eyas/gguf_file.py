"""The tensor directory of a GGUF file, read without gguf-py (whose reader builds numpy views for every
metadata string: 8.6 s for SmolLM2's 49k-token vocabulary; this takes ~0.3 s). Also the cheap validity check
that runs before transformers converts a file: a truncated or foreign file gets one clear error."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import EyasError

GROUP = 32
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # bytes per 32-weight block of the types eyas reads


class GGUFError(EyasError):
    pass



_GGML_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 8: "Q8_0"}  # others are named by number
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


@dataclass
class GGUFTensor:
    name: str
    type_name: str
    shape: tuple[int, ...]  # ggml order: shape[0] is the row length
    data: np.ndarray  # uint8 [rows, bytes per row] for block types (a view of the memory-mapped file)


def read_gguf_tensors(path: Path) -> dict[str, GGUFTensor]:
    """The tensor directory of a GGUF v2/v3 file; a truncated or foreign file raises GGUFError."""
    import struct

    buf = np.memmap(path, dtype=np.uint8, mode="r")
    pos = 0

    def take(fmt: str):
        nonlocal pos
        size = struct.calcsize(fmt)
        if pos + size > len(buf):
            raise GGUFError(f"{path}: the GGUF header ends early at byte {pos} (a truncated download?); "
                            "fetch the file again")
        v = struct.unpack_from(fmt, buf, pos)[0]
        pos += size
        return v

    def string() -> str:
        nonlocal pos
        n = take("<Q")
        if pos + n > len(buf):
            raise GGUFError(f"{path}: the GGUF header ends early at byte {pos}; fetch the file again")
        v = bytes(buf[pos:pos + n]).decode("utf-8", "replace")
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
    align = 32
    for _ in range(n_kv):
        key, vt = string(), take("<I")
        v = skip_value(vt)
        if key == "general.alignment" and isinstance(v, int):
            align = v
    infos = []
    for _ in range(n_tensors):
        name = string()
        dims = tuple(take("<Q") for _ in range(take("<I")))
        infos.append((name, dims, take("<I"), take("<Q")))
    start = (pos + align - 1) // align * align
    out: dict[str, GGUFTensor] = {}
    for name, dims, t, off in infos:
        tname = _GGML_TYPES.get(t, f"ggml type {t}")
        rows = int(np.prod(dims[1:])) if len(dims) > 1 else 1
        if tname in BLOCK_BYTES:
            width = dims[0] // GROUP * BLOCK_BYTES[tname]
        elif tname in ("F32", "F16"):
            width = dims[0] * (4 if tname == "F32" else 2)
        else:
            out[name] = GGUFTensor(name, tname, dims, np.empty((0, 0), np.uint8))
            continue
        a = start + off
        if a + rows * width > len(buf):
            raise GGUFError(f"{path}: tensor {name} runs past the end of the file ({len(buf)} bytes); the file "
                            "is truncated, fetch it again")
        out[name] = GGUFTensor(name, tname, dims, buf[a:a + rows * width].reshape(rows, width))
    return out


def read_gguf_metadata(path: Path, keys: set[str]) -> dict[str, object]:
    """The string/scalar values of `keys` from a GGUF file's metadata, without reading the tensor directory or
    any tensor (eyas.template peeks at `tokenizer.chat_template` this way before a target loads). A key the file
    lacks is absent from the result; a truncated or foreign header raises GGUFError like read_gguf_tensors."""
    import struct

    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise GGUFError(f"{path} is not a GGUF file (no GGUF magic); pass a .gguf file or a HF folder")

        def take(fmt: str):
            size = struct.calcsize(fmt)
            b = f.read(size)
            if len(b) < size:
                raise GGUFError(f"{path}: the GGUF header ends early (a truncated download?); fetch the file again")
            return struct.unpack(fmt, b)[0]

        def value(vt: int, keep: bool) -> object:
            if vt == 8:
                n = take("<Q")
                if not keep:  # vocabularies hold 100k+ strings: seek past them
                    f.seek(n, 1)
                    return None
                b = f.read(n)
                if len(b) < n:
                    raise GGUFError(f"{path}: the GGUF header ends early; fetch the file again")
                return b.decode("utf-8", "replace")
            if vt == 9:
                et, n = take("<I"), take("<Q")
                if et in _SCALAR:
                    f.seek(struct.calcsize(_SCALAR[et]) * n, 1)
                else:
                    for _ in range(n):
                        value(et, False)
                return None
            if vt not in _SCALAR:
                raise GGUFError(f"{path}: unknown GGUF value type {vt}; not a GGUF file eyas can read")
            return take(_SCALAR[vt])

        if take("<I") not in (2, 3):
            raise GGUFError(f"{path}: a GGUF version eyas does not read (2 and 3 only)")
        take("<Q")  # tensor count
        out: dict[str, object] = {}
        for _ in range(take("<Q")):
            n = take("<Q")
            key = f.read(n).decode("utf-8", "replace")
            v = value(take("<I"), key in keys)
            if key in keys:
                out[key] = v
        return out
