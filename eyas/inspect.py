"""`eyas inspect`: what a target, shard folder or draft checkpoint holds, layouts in every convention."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .conventions import engine_ids_table
from .errors import EyasError
from .metadata import ANY_MANIFEST, BY_KIND, read_metadata
from .native.auto import describe as describe_native
from .native.quant import native_misfit
from .target.family import text_config
from .target.gguf_config import rope_summary
from .target.open import TargetChoice
from .target.template import chat_ids, describe_record, raw_ids

INSPECT_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain speculative decoding in one paragraph.",
]


def inspect_target(spec: str, dtype: str = "fp32", device: str = "cpu", chat_template: str | None = None,
                   raw: bool = False) -> dict[str, Any]:
    """The norms are measured on INSPECT_PROMPTS rendered as chats (the template in use) or, with `raw`, as plain
    text (base models)."""
    import torch

    t = TargetChoice(spec, dtype, device, chat_template, raw).open()
    choice = t.chat_template
    cfg = text_config(t.config)
    layout = t.default_layout()
    L = t.num_layers
    ids = [torch.tensor([raw_ids(t.tokenizer, p) if choice.raw else chat_ids(t.tokenizer, [{"role": "user",
                                                                                            "content": p}])],
                        device=t.device)
           for p in INSPECT_PROMPTS]
    from .target.capture import stream_norms

    norms = stream_norms(t.model, ids, [0, *layout.aux_indices])
    return {
        "kind": "target",
        "source": spec,
        "path": str(t.path),
        "architecture": t.identity.architecture,
        "model_type": t.identity.model_type,
        "num_layers": L,
        "hidden_size": t.hidden_size,
        "num_attention_heads": int(cfg.num_attention_heads),
        "num_key_value_heads": int(getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)),
        "vocab_size": t.identity.vocab_size,
        "rope": rope_summary(cfg),
        "fingerprint": t.identity.fingerprint,
        "chat_template": describe_record(t.chat_template.record()),
        "dtype": str(t.dtype).replace("torch.", ""),
        "load_seconds": round(t.load_seconds, 2),
        "layout": layout.to_dict(),
        "aux_stream_indices": layout.aux_indices,
        "engine_ids": engine_ids_table(layout.aux_indices, L),
        "sglang_ids": engine_ids_table(layout.aux_indices, L)["sglang"],
        "vllm_ids": engine_ids_table(layout.aux_indices, L)["vllm"],
        "mean_l2_norm": {("embedding (0)" if k == "0" else (f"final pre-norm ({L})" if k == "final" else k)): v
                         for k, v in norms.items()},
        "native_kernels": describe_native(t.gguf is not None, t.dtype == torch.float32 and t.device.type == "cpu",
                                          native_misfit(t.gguf, L) if t.gguf is not None else None),
    }


def inspect_path(path: Path) -> dict[str, Any] | None:
    """A shard folder or a draft folder: its manifest; None if `path` is neither."""
    for name in ("manifest.json", "eyas_manifest.json"):
        m = path / name
        if m.exists():
            fix = "the folder is corrupt (an interrupted write?) — regenerate it"
            kind = read_metadata(m, ANY_MANIFEST, EyasError, fix)["kind"]
            if kind.startswith("eyas"):
                return read_metadata(m, BY_KIND.get(kind, ANY_MANIFEST), EyasError, fix)
    return None


def render(info: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    if info.get("kind") != "target":
        con.print_json(json.dumps(info, default=str))
        return
    t = Table(title=f"target {info['source']}", show_header=False)
    for k in ("architecture", "num_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
              "vocab_size", "rope", "fingerprint", "chat_template", "dtype", "load_seconds", "path"):
        t.add_row(k, str(info[k]))
    nk = info.get("native_kernels")
    if nk:
        t.add_row("kernel variant", f"{nk['isa']} (this CPU runs: {nk['variants']})")
        t.add_row("--weights auto", f"{nk['weights_auto']}: {nk['why']}")
    con.print(t)
    lt = Table(title="default EAGLE-3 layout, one layout in each engine's convention")
    lt.add_column("engine")
    lt.add_column("ids")
    lt.add_column("meaning")
    meaning = {"eyas": "stream index (0 = embedding, L = final pre-norm)", "eagle": "input of layer x",
               "sglang": "output of layer x (eagle_config)", "vllm": "input of layer x (top level)",
               "speculators": "input of layer x"}
    for eng, ids in info["engine_ids"].items():
        lt.add_row(eng, str(ids), meaning[eng])
    con.print(lt)
    nt = Table(title=f"mean L2 norm per captured stream index (prompts rendered with {info['chat_template']})")
    nt.add_column("stream index")
    nt.add_column("mean L2 norm", justify="right")
    for k, v in info["mean_l2_norm"].items():
        nt.add_row(k, f"{v:.2f}")
    con.print(nt)
