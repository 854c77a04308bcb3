"""The draft folder as SGLang and vLLM see it: config.json (what the engines read their aux ids from; how they
read them is eyas/conventions.py), the eyas manifest's trained layout, and the safetensors tensor names (which
SGLang loads). Pure parsing: no model is loaded. Errors are raised as the caller's error class (the flags lint
passes FlagsError)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..conventions import has_aux_ids
from ..errors import EyasError
from ..files import check_file, read_json
from .checklist import Check


@dataclass
class DraftInfo:
    path: Path
    config: dict[str, Any]  # config.json, what the engines read
    layout: list[int] | None  # stream indices the draft was trained on (eyas manifest); None if unknown
    num_layers: int | None  # target layer count
    target_hidden: int | None
    is_eagle3: bool
    weight_names: list[str] | None = None  # tensor names in the folder's safetensors (None: no safetensors)


def read_draft_dir(path: str | Path, num_layers: int | None, error: type[EyasError]) -> DraftInfo:
    """Read a draft folder; every problem is raised as `error`."""
    p = Path(path)
    cfg_path = p / "config.json"
    if not cfg_path.is_file():
        raise error(f"--draft {p}: no config.json there. Expected a draft folder (an eyas draft, or an "
                         "SGLang/vLLM EAGLE-3 checkpoint) — the engines read their aux ids from that file.")
    cfg = read_json(cfg_path, error, "the draft folder is corrupt — re-export or re-save it")
    layout = None
    target_hidden = None
    man = p / "eyas_manifest.json"
    if man.is_file():
        m = read_json(man, error, "the draft folder is corrupt — re-export or re-save it")
        # eyas drafts and exports record each tensor file's size and digest; a folder without records is not checked
        for name, rec in (m.get("files") or {}).items():
            check_file(p / Path(name).name, rec, error, "the draft folder is damaged — copy it again, or rerun "
                       "the command that wrote it")
        lay = m.get("layout") or {}
        layout = [int(k) for k in lay.get("aux_indices", [])] or None
        t = lay.get("target") or {}
        if num_layers is None and t.get("num_layers"):
            num_layers = int(t["num_layers"])
        target_hidden = t.get("hidden_size")
    archs = [str(a) for a in cfg.get("architectures") or []]
    is_eagle3 = (man.is_file() or any("eagle3" in a.lower() for a in archs) or has_aux_ids(cfg)
                 or str(cfg.get("speculators_model_type", "")).lower() == "eagle3")
    return DraftInfo(path=p, config=cfg, layout=layout, num_layers=num_layers, target_hidden=target_hidden,
                     is_eagle3=is_eagle3, weight_names=weight_names(p, error))


def weight_names(folder: Path, error: type[EyasError]) -> list[str] | None:
    """The tensor names in the folder's *.safetensors files, read from their JSON headers only (no tensor is
    loaded). None when there are no safetensors files (e.g. a pickled checkpoint), so nothing is claimed."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    names: list[str] = []
    for f in files:
        try:
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                if not 2 <= n <= 100_000_000:
                    raise ValueError(f"header length {n}")
                header = json.loads(fh.read(n))
        except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
            raise error(f"{f} is not a readable safetensors file ({e}): truncated or foreign; re-export "
                             "the draft") from e
        names += [k for k in header if k != "__metadata__"]
    return names


def sglang_loadable(info: DraftInfo) -> Check:
    """SGLang serves EAGLE-3 drafts through LlamaForCausalLMEagle3 (python/sglang/srt/models/llama_eagle3.py),
    whose load_weights keeps a tensor only when `name` or `model.<name>` is one of its parameters and drops every
    other name without a word: a folder with `layers.0.*` names (a speculators checkpoint, or a vLLM-format
    export written by older eyas) starts, and drafts with a randomly initialised layer — acceptance near zero,
    no error anywhere."""
    if str(info.config.get("speculators_model_type", "")):
        return Check("weights", "fail", f"{info.path} is a speculators-format draft (speculators_model_type "
                     f"{info.config['speculators_model_type']!r}): SGLang has no loader for it (it reads "
                     "LlamaForCausalLMEagle3 folders)", fix="export the draft with `eyas export --format sglang` "
                     "(or serve this folder with vLLM)")
    names = info.weight_names
    if names is None:
        return Check("weights", "skip", "no *.safetensors in the draft folder: weight names not checked")
    bare = [n[len("model."):] if n.startswith("model.") else n for n in names]
    mid = [n for n in bare if n.startswith("midlayer.")]
    lay = [n for n in bare if n.startswith("layers.")]
    if lay and not mid:
        return Check("weights", "fail", f"the draft layer's weights are named layers.0.* ({len(lay)} tensors, e.g. "
                     f"{lay[0]}): SGLang's LlamaForCausalLMEagle3.load_weights silently skips them, so the server "
                     "would draft with a randomly initialised layer", numbers={"layers_0": len(lay), "midlayer": 0},
                     fix="re-export with `eyas export --format sglang` (or --format vllm: both write midlayer.*, "
                         "which vLLM renames itself), or rename layers.0. -> midlayer. in the safetensors")
    if not mid:
        return Check("weights", "fail", f"no midlayer.* weights among {len(names)} tensors (e.g. {bare[:3]}): not "
                     "an EAGLE-3 draft SGLang can load", fix="point --speculative-draft-model-path at an EAGLE-3 "
                     "draft folder (eyas export --format sglang)")
    return Check("weights", "pass", f"weights named midlayer.* ({len(mid)} tensors), as SGLang loads them")
