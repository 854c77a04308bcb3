"""What results.json records beside the rows: the machine (environment, cpu_name, named beside every figure) and
the draft that ran (draft_summary)."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

from ..draft import DraftCheckpoint
from ..target.convert import file_fingerprint
from ..target.load import Target


def draft_summary(ckpt: DraftCheckpoint | None, spec: str) -> dict[str, Any] | None:
    if ckpt is None:
        return None
    m = ckpt.manifest
    c = ckpt.model.config
    weights = ckpt.path / "model.safetensors" if ckpt.path else None
    trained_record = any(k in m for k in ("training", "train", "train_config", "metrics"))
    untrained = bool(m.get("untrained", False))
    return {
        "spec": spec,
        "path": str(ckpt.path) if ckpt.path else None,
        "untrained": untrained,
        "status": ("UNTRAINED (random weights): speed and acceptance numbers are meaningless" if untrained
                   else "trained" if trained_record else "no training record in the manifest"),
        "note": m.get("note"),
        "fingerprint": file_fingerprint([weights]) if weights and weights.exists() else None,
        "aux_indices": ckpt.layout.aux_indices,
        "hidden_size": c.hidden_size,
        "draft_vocab_size": c.draft_vocab_size,
        "manifest_keys": sorted(m),
    }


def environment(target: Target) -> dict[str, Any]:
    import transformers

    dev = target.device
    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "platform": platform.platform(), "threads": torch.get_num_threads(), "device": str(dev),
           "dtype": str(target.dtype).replace("torch.", ""), "cpu": cpu_name(), "cpu_count": os.cpu_count(),
           # other work on the machine skews tok/s: the load when the results were written says how much
           "loadavg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None}
    if dev.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(dev)
    try:
        env["eyas_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                            cwd=Path(__file__).parent, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["eyas_commit"] = None
    return env


def cpu_name() -> str:
    """The CPU's model name, as every reported figure names it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
