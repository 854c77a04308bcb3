"""How each engine numbers the aux layers an EAGLE-3 draft reads, and how it reads them from a draft config.

The one module that knows the engines' conventions: the draft's own config, export/import, the doctor and the
layout helpers all ask it. It sits in the core stage (next to layout.py) because the draft and the doctor, both
below interop in the import layers, need it too. Facts read in the engines' own code (stored public copies, read
for facts only; no code copied):

eyas        stream index k in 0..L (eyas/layout.py): 0 = embedding output, i = output of layer i-1 =
            input of layer i, L = last layer output before the final norm.
SGLang      draft config `eagle_config.eagle_aux_hidden_state_layer_ids` only; a top-level list is never read. What
            the ids mean depends on the release and the TARGET's model class (eyas/aux_rules.py, read in each
            release's files): +1 on the llama family (id x = output of layer x = stream x+1, 1..L-1), +1 only
            when ids[0] == 1 on deepseek_v2 since 0.5.14; no ids -> stream [2, L//2, L-3], silently.
SpecForge   trains and saves in SGLang's convention (configs/*-eagle3.json: `eagle_config` ids, default
            output-of ids [1, L//2-1, L-4]).
vLLM        top-level `eagle_aux_hidden_state_layer_ids` first; if absent some builds fall back to
            `eagle_config`'s list used AS-IS (vllm/v1/worker/gpu_model_runner.py
            `_get_eagle3_aux_layers_from_config`, vllm-ascend; older vllm/model_executor/models/eagle3 utils read
            the top level only); none -> the model default (2, L//2, L-3). The target captures before running
            layer idx (vllm/model_executor/models/interfaces.py `EagleModelMixin._maybe_add_hidden_state`, which
            takes the bare hidden state when there is no residual yet): id x = input of layer x = stream x,
            0 = embedding. Newer vLLM also reads `eagle_aux_layer_semantics`
            (vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py resolve_eagle3_aux_layer_semantics /
            apply_eagle3_aux_layer_semantics: the --speculative-config value first, then the draft config's key,
            default "vllm" = as-is; "sglang" adds 1 to every id, method eagle3 only); builds older than the key
            ignore it, so eyas writes "vllm" explicitly.
speculators (0.9.0: speculators/models/eagle3/config.py `Eagle3SpeculatorConfig`, models/utils.py
            `resolve_target_layer_ids`): top-level `eagle_aux_hidden_state_layer_ids`, input-of like vLLM,
            valid 0..L (L = final state).
EAGLE ref.  (SafeAILab/EAGLE eagle/model/modeling_llama_kv.py): captures the inputs of layers 2, L//2,
            L-3, hard-coded; configs carry no ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .aux_rules import newest, sglang_ids
from .errors import EyasError, LayoutError

IDS_KEY = "eagle_aux_hidden_state_layer_ids"  # the key, at the top level (vLLM, speculators) or in eagle_config
SEMANTICS_KEY = "eagle_aux_layer_semantics"  # vLLM's: how to read the top-level ids
AUX_SEMANTICS = ("vllm", "sglang")  # its values: "vllm" = ids as-is (input-of), "sglang" = output-of (vLLM adds 1)
ENGINES = ("eyas", "eagle", "sglang", "vllm", "speculators")  # the columns of engine_ids_table
IMPORT_FORMATS = ("auto", "sglang", "specforge", "vllm", "speculators", "eagle")  # configs id_readings reads


class FormatError(EyasError):
    """A foreign checkpoint that eyas cannot read faithfully; the message says what and why."""


@dataclass(frozen=True)
class Convention:
    """What one system's aux-layer id means."""

    engine: str
    meaning: str  # "input-of": id x = input of layer x = stream x; "output-of": id x = output of layer x
    offset: int  # engine id = stream index + offset
    reads: str  # where its ids come from

    def stream_range(self, num_layers: int) -> tuple[int, int]:
        """Inclusive range of stream indices it can express. Output-of engines capture before each layer inside
        the layer loop, so neither the embedding (0) nor the final pre-norm state (L) exists for them."""
        return (0, num_layers) if self.meaning == "input-of" else (1, num_layers - 1)


CONVENTIONS = {c.engine: c for c in (
    Convention("eyas", "input-of", 0, "the eyas manifest's layout.aux_indices (stream indices)"),
    Convention("eagle", "input-of", 0, "nowhere: the inputs of layers 2, L//2, L-3 are hard-coded"),
    Convention("sglang", "output-of", -1, f"eagle_config.{IDS_KEY} only (+1 internally)"),
    Convention("specforge", "output-of", -1, f"eagle_config.{IDS_KEY}, as SGLang"),
    Convention("vllm", "input-of", 0, f"top-level {IDS_KEY} (as-is unless {SEMANTICS_KEY} is 'sglang'); "
                                      "some builds fall back to eagle_config's ids as-is"),
    Convention("speculators", "input-of", 0, f"top-level {IDS_KEY}"),
)}
ID_CONVENTIONS = tuple(CONVENTIONS)  # the --ids-convention choices


def default_aux_indices(num_layers: int) -> list[int]:
    """EAGLE-3 default: inputs of layers {2, L//2, L-3}, i.e. stream indices [2, L//2, L-3]; every engine's
    default is this stream, written in its own ids (`default_ids`). Always distinct and strictly increasing:
    a repeated stream would feed the draft the same hidden state twice."""
    L = num_layers
    if L < 1:
        raise LayoutError(f"a target with {L} layers has no hidden-state stream to capture; expected at least 1 "
                          "decoder layer (check the config's num_hidden_layers)")
    if L < 4:
        # fewer than 3 inner streams (1..L-1) exist: as many distinct ones as fit, the last stream for L = 1
        return sorted({min(1, L), max(1, L // 2), L - 1 if L > 1 else L})
    if 2 < L // 2 < L - 3:  # L >= 7: the published default
        return [2, L // 2, L - 3]
    # L = 4..6: [2, L//2, L-3] repeats a stream; early, middle and late inner streams instead, all within
    # 1..L-1 so every engine's convention (SGLang's output-of ids included) can express them
    return [1, L // 2, L - 1]


def convention(engine: str) -> Convention:
    if engine not in CONVENTIONS:
        raise LayoutError(f"unknown engine {engine!r}; expected one of {ENGINES + ('specforge',)}")
    return CONVENTIONS[engine]


# ---- translators between eyas stream indices and each engine's ids ------------------------------

def to_engine_ids(indices: list[int], engine: str, num_layers: int) -> list[int]:
    """Stream indices -> `engine`'s ids; refuses (never shifts) what the engine cannot express."""
    c = convention(engine)
    lo, hi = c.stream_range(num_layers)
    bad = [k for k in indices if not lo <= k <= hi]
    if bad:
        why = ""
        if c.meaning == "output-of":
            why = (" SGLang's ids mean 'output of layer x' and it captures inside the layer loop, so it "
                   "cannot express the embedding (stream 0) or the final pre-norm state "
                   f"(stream {num_layers}).")
        raise LayoutError(
            f"stream indices {bad} cannot be expressed in {engine}'s convention (expressible: {lo}..{hi} "
            f"for a {num_layers}-layer target).{why} Refusing to shift them: retrain with indices in "
            f"{lo}..{hi}, or serve with an engine that can express them (vLLM takes 0..{num_layers}).")
    return [k + c.offset for k in indices]


def from_engine_ids(ids: list[int], engine: str, num_layers: int) -> list[int]:
    """`engine`'s ids -> stream indices; refuses ids outside what the engine can capture."""
    c = convention(engine)
    shift = -c.offset
    lo, hi = c.stream_range(num_layers)
    out = [int(x) + shift for x in ids]
    bad = [x for x, k in zip(ids, out, strict=True) if not lo <= k <= hi]
    if bad:
        raise LayoutError(
            f"{engine} layer ids {bad} are out of range for a {num_layers}-layer target "
            f"(valid {engine} ids: {lo - shift}..{hi - shift}); the draft was made for another model "
            "or the ids are in another engine's convention")
    return out


def default_ids(engine: str, num_layers: int) -> list[int]:
    """The ids `engine` assumes when a config has none (the EAGLE-3 default stream in its own convention)."""
    return to_engine_ids(default_aux_indices(num_layers), engine, num_layers)


def engine_ids_table(indices: list[int], num_layers: int) -> dict[str, list[int] | str]:
    """The same layout in every engine's convention; an engine that cannot express it says why."""
    out: dict[str, list[int] | str] = {}
    for eng in ENGINES:
        try:
            out[eng] = to_engine_ids(indices, eng, num_layers)
        except LayoutError as e:
            out[eng] = f"not expressible: {str(e).split('.')[0]}"
    return out


# ---- writing ids into a draft config -------------------------------------------------------------

def sglang_config_ids(indices: list[int], num_layers: int, architecture: str | None = None) -> dict[str, Any]:
    """The config entry SGLang (and SpecForge) read: eagle_config ids, written so that the newest SGLang read
    captures `indices` on an `architecture` target (its rule: eyas/aux_rules.py); output-of (+1) ids when no
    release read lists the architecture. Raises LayoutError when SGLang cannot express the layout."""
    if architecture in newest("sglang").rules:
        ids = sglang_ids(indices, num_layers, architecture)[0]
    else:
        ids = to_engine_ids(indices, "sglang", num_layers)
    return {"eagle_config": {IDS_KEY: ids, "use_aux_hidden_state": True}}


def vllm_config_ids(indices: list[int], num_layers: int, semantics: bool = True) -> dict[str, Any]:
    """The entries vLLM reads: top-level ids, input-of; with `semantics`, the explicit "vllm" so that a newer
    vLLM never adds 1 (a copied "sglang" value or a changed default would shift them by one)."""
    out: dict[str, Any] = {IDS_KEY: to_engine_ids(indices, "vllm", num_layers)}
    if semantics:
        out[SEMANTICS_KEY] = "vllm"
    return out


def speculators_config_ids(indices: list[int], num_layers: int) -> dict[str, Any]:
    return {IDS_KEY: to_engine_ids(indices, "speculators", num_layers)}


# ---- reading ids from a draft config -------------------------------------------------------------

def eagle_config(cfg: dict[str, Any]) -> dict[str, Any]:
    return cfg["eagle_config"] if isinstance(cfg.get("eagle_config"), dict) else {}


def has_aux_ids(cfg: dict[str, Any]) -> bool:
    """Whether a config carries aux ids where any engine reads them (an EAGLE-3 marker)."""
    return IDS_KEY in cfg or IDS_KEY in eagle_config(cfg)


@dataclass
class IdsFound:
    top: list[int] | None  # top-level eagle_aux_hidden_state_layer_ids
    eagle_config: list[int] | None  # eagle_config.eagle_aux_hidden_state_layer_ids
    semantics: str | None = None  # vLLM's eagle_aux_layer_semantics for the top-level ids (None: absent = "vllm")

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {IDS_KEY: self.top, f"eagle_config.{IDS_KEY}": self.eagle_config}
        if self.semantics is not None:
            d[SEMANTICS_KEY] = self.semantics
        return d


def _int_list(v: Any, where: str) -> list[int] | None:
    if v is None:
        return None
    if not isinstance(v, list | tuple) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise FormatError(f"{where} must be a list of integers, found {v!r}")
    return [int(x) for x in v] or None


def read_ids(config: dict[str, Any]) -> IdsFound:
    """Every place a config holds ids, strictly: a malformed value is a FormatError (import refuses it)."""
    ec = config.get("eagle_config")
    if ec is not None and not isinstance(ec, dict):
        raise FormatError(f"eagle_config must be an object, found {type(ec).__name__}: {str(ec)[:120]}")
    sem = config.get(SEMANTICS_KEY)
    if sem is not None and sem not in AUX_SEMANTICS:
        raise FormatError(f"{SEMANTICS_KEY} is {sem!r}; vLLM knows only 'vllm' (ids as-is, input-of) and "
                          "'sglang' (ids output-of, vLLM adds 1) — fix the config")
    return IdsFound(top=_int_list(config.get(IDS_KEY), IDS_KEY),
                    eagle_config=_int_list((ec or {}).get(IDS_KEY), f"eagle_config.{IDS_KEY}"),
                    semantics=sem)
