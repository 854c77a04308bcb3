"""--dtype and --device parsing, and the clock barrier for queued CUDA work."""

from __future__ import annotations

import torch

from .family import TargetError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise TargetError(f"--dtype {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


def resolve_device(name: str) -> torch.device:
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise TargetError(f"--device {name!r}: expected cpu, cuda or cuda:N")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise TargetError(f"--device {name} asked for, but torch sees no CUDA device "
                          f"(torch {torch.__version__}); use --device cpu")
    return torch.device(name)


def sync_device(device: torch.device) -> None:
    """Wait for queued CUDA work, so a wall-clock reading covers it (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
