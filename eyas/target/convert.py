"""Weight fingerprints, and the one-time GGUF -> safetensors conversion."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch
from torch import nn

from ..files import atomic_folder, remove_stale_temps
from .family import TargetError, check_gguf_architecture
from .gguf_config import gguf_overrides
from .offline import hub_offline


def file_fingerprint(paths: list[Path]) -> str:
    """sha256 over the weight files; large files are sampled (size + 32 spread 1 MiB chunks), which any
    re-quantization or fine-tune still changes, while hashing a multi-GB file would take minutes."""
    h = hashlib.sha256()
    for p in sorted(paths, key=lambda p: p.name):
        size = p.stat().st_size
        h.update(p.name.encode() + b"\0" + str(size).encode())
        with open(p, "rb") as f:
            if size <= 64 << 20:
                h.update(f.read())
            else:
                for i in range(32):
                    f.seek((size - (1 << 20)) * i // 31)
                    h.update(f.read(1 << 20))
    return "sha256:" + h.hexdigest()[:32]


def tensor_fingerprint(model: nn.Module) -> str:
    """For in-memory models without files: hash of strided samples of every parameter in fp32."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        flat = p.detach().reshape(-1)
        idx = torch.linspace(0, flat.numel() - 1, min(flat.numel(), 4096)).long()
        h.update(name.encode() + str(tuple(p.shape)).encode())
        h.update(flat[idx].float().cpu().numpy().tobytes())
    return "tensors:" + h.hexdigest()[:32]


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF once to a safetensors HF folder, written atomically (tmp dir + rename): a failure or a
    kill leaves no folder at `out`, and the next conversion clears a killed one's temporary folder."""
    hub_offline()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    remove_stale_temps(out)
    check_gguf_architecture(gguf)

    def unreadable(e: Exception) -> TargetError:
        return TargetError(f"transformers could not read {gguf} ({type(e).__name__}: {e}); the file is damaged or "
                           "of an architecture transformers cannot load from GGUF: fetch it again, or pass a Hugging "
                           "Face model folder")

    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as e:  # noqa: BLE001 - transformers' GGUF reader raises many types on a file it cannot read
        # (struct.error, KeyError, ValueError "architecture ... not supported"); all are about the user's file
        raise unreadable(e) from e
    # what transformers' reader drops (RoPE scaling, head size, window, attention scale), or a refusal
    overrides = gguf_overrides(gguf)
    for k, v in overrides.items():
        setattr(config, k, v)
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, config=config,
                                                     dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - as above
        raise unreadable(e) from e
    # the quantizer would otherwise be saved into config.json and demand the GGUF again at load
    model.hf_quantizer = None  # type: ignore[assignment]  # set by transformers' loader, undeclared on the model
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / "eyas_source.json").write_text(json.dumps(
            {"gguf": str(gguf), "fingerprint": file_fingerprint([gguf]), "converted_at": time.time(),
             "config_overrides": overrides}, indent=2))

    atomic_folder(out, write)
