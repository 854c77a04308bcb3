"""The draft folder as SGLang and vLLM read it: which stream indices each engine captures for a config.json
(engine versions that disagree give several views), and the config edit that pins a layout. Every rule is a
fact read in the engines' code, cited where it is applied. Pure parsing: no model is loaded."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import EyasError
from ..files import read_json
from ..layout import LayoutError, default_aux_indices, from_engine_ids, to_engine_ids

# the values vLLM's eagle_aux_layer_semantics takes: "vllm" = ids are input-of (as-is), "sglang" = ids are
# output-of (vLLM adds 1); see engine_views
AUX_SEMANTICS = ("vllm", "sglang")


class FlagsError(EyasError):
    """The command or the draft folder cannot be read; the message says what was expected."""


@dataclass
class DraftInfo:
    path: Path
    config: dict[str, Any]  # config.json, what the engines read
    layout: list[int] | None  # stream indices the draft was trained on (eyas manifest); None if unknown
    num_layers: int | None  # target layer count
    target_hidden: int | None
    is_eagle3: bool
    weight_names: list[str] | None = None  # tensor names in the folder's safetensors (None: no safetensors)


def read_draft_dir(path: str | Path, num_layers: int | None = None) -> DraftInfo:
    p = Path(path)
    cfg_path = p / "config.json"
    if not cfg_path.is_file():
        raise FlagsError(f"--draft {p}: no config.json there. Expected a draft folder (an eyas draft, or an "
                         "SGLang/vLLM EAGLE-3 checkpoint) — the engines read their aux ids from that file.")
    cfg = read_json(cfg_path, FlagsError, "the draft folder is corrupt — re-export or re-save it")
    layout = None
    target_hidden = None
    man = p / "eyas_manifest.json"
    if man.is_file():
        m = read_json(man, FlagsError, "the draft folder is corrupt — re-export or re-save it")
        lay = m.get("layout") or {}
        layout = [int(k) for k in lay.get("aux_indices", [])] or None
        t = lay.get("target") or {}
        if num_layers is None and t.get("num_layers"):
            num_layers = int(t["num_layers"])
        target_hidden = t.get("hidden_size")
    archs = [str(a) for a in cfg.get("architectures") or []]
    eagle_cfg = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
    is_eagle3 = (man.is_file() or any("eagle3" in a.lower() for a in archs)
                 or "eagle_aux_hidden_state_layer_ids" in cfg or "eagle_aux_hidden_state_layer_ids" in eagle_cfg
                 or str(cfg.get("speculators_model_type", "")).lower() == "eagle3")
    return DraftInfo(path=p, config=cfg, layout=layout, num_layers=num_layers, target_hidden=target_hidden,
                     is_eagle3=is_eagle3, weight_names=weight_names(p))


def weight_names(folder: Path) -> list[str] | None:
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
            raise FlagsError(f"{f} is not a readable safetensors file ({e}): truncated or foreign; re-export "
                             "the draft") from e
        names += [k for k in header if k != "__metadata__"]
    return names


@dataclass
class EngineView:
    """What one engine captures for this draft: stream indices, or None = no aux capture (final state only)."""

    engine: str
    indices: list[int] | None
    source: str  # how the engine arrived at them
    when: str = ""  # the engine versions this applies to ('' = all)


def _ids(x: Any) -> list[int] | None:
    return [int(v) for v in x] if isinstance(x, (list, tuple)) and len(x) > 0 else None


def engine_views(cfg: dict[str, Any], engine: str, num_layers: int,
                 semantics: str | None = None) -> list[EngineView]:
    """Read a draft config.json as `engine` does. More than one view means engine versions disagree.
    semantics: vLLM's `eagle_aux_layer_semantics` given in --speculative-config (overrides config.json's)."""
    L = num_layers
    eagle_cfg = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
    nested = _ids(eagle_cfg.get("eagle_aux_hidden_state_layer_ids"))
    top = _ids(cfg.get("eagle_aux_hidden_state_layer_ids"))
    default = default_aux_indices(L)
    if eagle_cfg.get("use_aux_hidden_state") is False:
        # sglang/srt/speculative/eagle_worker.py: eagle_use_aux_hidden_state = eagle_config.get(
        # "use_aux_hidden_state", True); vllm (v1 eagle proposer, vllm-ascend) reads the same key.
        return [EngineView(engine, None, "eagle_config.use_aux_hidden_state is false: no aux capture, the "
                                         "draft gets the final 1xH state")]

    def conv(ids: list[int], eng: str, what: str) -> tuple[list[int] | None, str]:
        try:
            return from_engine_ids(ids, eng, L), what
        except LayoutError as e:
            return None, f"{what}: {str(e).split(';')[0]} — the engine fails to start or captures garbage"

    if engine == "sglang":
        # python/sglang/srt/model_executor/model_runner.py ModelRunner.__init__: the ids come from
        # `eagle_config["eagle_aux_hidden_state_layer_ids"]` only (None when eagle_config or the key is absent);
        # a top-level list is never read. python/sglang/srt/models/llama.py set_eagle3_layers_to_capture:
        # layers_to_capture = [id + 1 for id in layer_ids] (ids mean "output of layer id");
        # layer_ids=None -> [2, L//2, L-3] as capture points.
        if nested is not None:
            idx, src = conv(nested, "sglang", f"eagle_config.eagle_aux_hidden_state_layer_ids {nested} (+1)")
            return [EngineView(engine, idx, src)]
        ignored = f" (the top-level ids {top} are vLLM's; SGLang never reads them)" if top is not None else ""
        return [EngineView(engine, default, f"no eagle_config ids: SGLang default "
                                            f"{to_engine_ids(default, 'sglang', L)} (output-of){ignored}")]
    if engine == "vllm":
        # vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py get_eagle3_aux_layers_from_config: top-level
        # ids, used as "input of layer id" (models/llama.py appends hidden_states + residual before layer idx);
        # none -> model default get_eagle3_aux_hidden_state_layers() = (2, L//2, L-3).
        # resolve_eagle3_aux_layer_semantics / apply_eagle3_aux_layer_semantics (newer vLLM, method eagle3):
        # the --speculative-config "eagle_aux_layer_semantics" first, then the draft config's key, default
        # "vllm" (ids as-is); "sglang" adds 1 to every id. Builds older than the key ignore it.
        sem, sem_src = semantics, "--speculative-config"
        if sem is None and "eagle_aux_layer_semantics" in cfg:
            sem, sem_src = cfg["eagle_aux_layer_semantics"], "config.json"
        if sem is not None and sem not in AUX_SEMANTICS:
            return [EngineView(engine, None, f"eagle_aux_layer_semantics {sem!r} in {sem_src}: vLLM knows only "
                                             f"{' and '.join(repr(x) for x in AUX_SEMANTICS)}")]
        if top is not None:
            if sem == "sglang":
                idx, src = conv(top, "sglang", f"top-level eagle_aux_hidden_state_layer_ids {top} (+1: "
                                               f'eagle_aux_layer_semantics "sglang" in {sem_src})')
                if semantics is not None:  # the override lives in the launch command, not in the folder
                    return [EngineView(engine, idx, src)]
                old, old_src = conv(top, "vllm", f"top-level eagle_aux_hidden_state_layer_ids {top} (as-is)")
                return [EngineView(engine, idx, src, "vLLM builds that read eagle_aux_layer_semantics"),
                        EngineView(engine, old, old_src + ": the key is ignored",
                                   "older vLLM (no eagle_aux_layer_semantics)")]
            how = f'as-is: eagle_aux_layer_semantics "vllm" in {sem_src}' if sem == "vllm" else "as-is"
            idx, src = conv(top, "vllm", f"top-level eagle_aux_hidden_state_layer_ids {top} ({how})")
            return [EngineView(engine, idx, src)]
        views = [EngineView(engine, default, f"no top-level ids: vLLM default {default} (input-of)",
                            "vLLM builds that read top-level ids only" if nested is not None else "")]
        if nested is not None:
            # some vLLM model runners (e.g. vllm-ascend) fall back to eagle_config ids, used as-is (no +1)
            idx, src = conv(nested, "vllm", f"eagle_config ids {nested} used as-is (no +1)")
            views.append(EngineView(engine, idx, src, "vLLM builds that fall back to eagle_config ids"))
        return views
    raise FlagsError(f"engine {engine!r}: expected 'sglang' or 'vllm'")


def config_fix(engine: str, layout: list[int], num_layers: int) -> str:
    """The config.json edit that pins `layout` for `engine` (ids in that engine's own convention)."""
    if engine == "sglang":
        try:
            ids = to_engine_ids(layout, "sglang", num_layers)
        except LayoutError:
            return (f"SGLang cannot capture stream {layout} (its ids mean output-of, so neither the embedding 0 nor "
                    f"the final state {num_layers} is expressible): serve this draft with vLLM or eyas, or retrain")
        return (f'set "eagle_config": {{"eagle_aux_hidden_state_layer_ids": {ids}, "use_aux_hidden_state": true}} '
                f"in the draft's config.json (SGLang ids mean output-of: stream {layout} - 1)")
    return (f'set top-level "eagle_aux_hidden_state_layer_ids": {to_engine_ids(layout, "vllm", num_layers)} '
            'and "eagle_aux_layer_semantics": "vllm" in the draft\'s config.json (vLLM ids mean input-of = eyas '
            'stream indices; the explicit semantics keeps newer vLLM from adding 1)')
