"""The draft folder as SGLang and vLLM see it: config.json (what the engines read their aux ids from; how they
read them is eyas/conventions.py), the eyas manifest's trained layout, and the safetensors tensor names and
shapes (what each engine version loads: eyas/doctor/traps.py). Pure parsing: no model is loaded. Errors are
raised as the caller's error class (the flags lint passes FlagsError)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..conventions import has_aux_ids
from ..errors import EyasError
from ..files import check_file, note_unverified
from ..metadata import DRAFT_CONFIG, EXPORT_MANIFEST, read_metadata
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
    weight_shapes: dict[str, list[int]] | None = None  # their shapes, from the same headers
    target_vocab: int | None = None  # the target's vocabulary (eyas manifest)
    engine_versions: dict[str, str] | None = None  # the engine versions an eyas export targets (its manifest)
    target_arch: str | None = None  # the target's model class (the manifest's, or the launch's --model-path config)
    target_arch_from: str = ""  # where target_arch was read
    aux_rules: Any = None  # the installed engine's aux-id rules when they differ from the table (AuxRules)


def read_draft_dir(path: str | Path, num_layers: int | None, error: type[EyasError]) -> DraftInfo:
    """Read a draft folder; every problem is raised as `error`."""
    p = Path(path)
    cfg_path = p / "config.json"
    if not cfg_path.is_file():
        raise error(f"--draft {p}: no config.json there. Expected a draft folder (an eyas draft, or an "
                         "SGLang/vLLM EAGLE-3 checkpoint) — the engines read their aux ids from that file.")
    cfg = read_metadata(cfg_path, DRAFT_CONFIG, error, "the draft folder is corrupt — re-export or re-save it")
    layout = arch = None
    target_hidden = target_vocab = None
    versions = None
    man = p / "eyas_manifest.json"
    if man.is_file():
        m = read_metadata(man, EXPORT_MANIFEST, error, "the draft folder is corrupt — re-export or re-save it")
        # eyas drafts and exports record each tensor file's size and digest; a folder without records is not checked
        if not m.get("files"):
            note_unverified(f"the draft folder {p}", p)
        for name, rec in (m.get("files") or {}).items():  # names: files inside p (the schema)
            check_file(p / name, rec, error, "the draft folder is damaged — copy it again, or rerun "
                       "the command that wrote it")
        lay = m.get("layout") or {}
        layout = [int(k) for k in lay.get("aux_indices", [])] or None
        t = lay.get("target") or {}
        if num_layers is None and t.get("num_layers"):
            num_layers = int(t["num_layers"])
        target_hidden = t.get("hidden_size")
        target_vocab = t.get("vocab_size")
        arch = t.get("architecture") if isinstance(t.get("architecture"), str) else None
        versions = m.get("engine_versions") if isinstance(m.get("engine_versions"), dict) else None
    archs = [str(a) for a in cfg.get("architectures") or []]
    is_eagle3 = (man.is_file() or any("eagle3" in a.lower() for a in archs) or has_aux_ids(cfg)
                 or str(cfg.get("speculators_model_type", "")).lower() == "eagle3")
    shapes = weight_shapes(p, error)
    return DraftInfo(path=p, config=cfg, layout=layout, num_layers=num_layers, target_hidden=target_hidden,
                     is_eagle3=is_eagle3, weight_names=None if shapes is None else list(shapes),
                     weight_shapes=shapes, target_vocab=target_vocab, engine_versions=versions, target_arch=arch,
                     target_arch_from="the draft's eyas manifest" if arch else "")


def weight_shapes(folder: Path, error: type[EyasError]) -> dict[str, list[int]] | None:
    """The tensor names and shapes in the folder's *.safetensors files, read from their JSON headers only (no
    tensor is loaded). None when there are no safetensors files (e.g. a pickled checkpoint), so nothing is claimed."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    shapes: dict[str, list[int]] = {}
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
        shapes.update({k: [int(x) for x in v.get("shape", [])] for k, v in header.items()
                       if k != "__metadata__" and isinstance(v, dict)})
    return shapes


def launch_target_arch(info: DraftInfo, model: str | None) -> str | None:
    """Take the target's model class from the launch's --model-path when it is a local folder (what the server
    loads decides the engine's aux-id rule); a note when it differs from the draft's manifest, else None."""
    from ..target.family import TargetError, read_config

    cfg_path = Path(model) / "config.json" if model else None
    if cfg_path is None or not cfg_path.is_file():
        return None
    try:
        archs = read_config(cfg_path.parent).get("architectures") or []
    except TargetError:  # an unreadable target config: the server fails on it itself; the manifest's class stands
        return None
    if not archs or not isinstance(archs[0], str):
        return None
    note = None
    if info.target_arch and info.target_arch != archs[0]:
        note = (f"the launch's target {model} is a {archs[0]}, the draft was trained on a {info.target_arch} "
                f"({info.target_arch_from}): judged as the launch's")
    info.target_arch, info.target_arch_from = archs[0], str(cfg_path)
    return note


def path_check(checks: list[Check], path: str | None, info: DraftInfo, flag: str) -> None:
    if path is None:
        checks.append(Check("draft_path", "fail", f"no {flag}: the server has no draft to load",
                            fix=f"{flag} {info.path}"))
    elif Path(path).exists() and Path(path).resolve() != info.path.resolve():
        checks.append(Check("draft_path", "warn", f"the command loads {path}, but the folder linted is {info.path}; "
                            "the config.json findings below are about the latter", fix=f"{flag} {info.path}"))
    else:
        checks.append(Check("draft_path", "pass", f"draft {path}"))
