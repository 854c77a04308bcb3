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

from dataclasses import dataclass, field
from typing import Any

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
    from .aux_rules import newest, sglang_ids

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

def _eagle_config(cfg: dict[str, Any]) -> dict[str, Any]:
    return cfg["eagle_config"] if isinstance(cfg.get("eagle_config"), dict) else {}


def has_aux_ids(cfg: dict[str, Any]) -> bool:
    """Whether a config carries aux ids where any engine reads them (an EAGLE-3 marker)."""
    return IDS_KEY in cfg or IDS_KEY in _eagle_config(cfg)


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


# ---- what each engine captures for a draft config (the doctor's view) ----------------------------

@dataclass
class EngineView:
    """What one engine captures for this draft: stream indices, or None = no aux capture (final state only)."""

    engine: str
    indices: list[int] | None
    source: str  # how the engine arrived at them
    when: str = ""  # the engine versions this applies to ('' = all)
    unknown: bool = False  # the engine's rule for this target is not known: indices is None, not "no capture"


def _ids(x: Any) -> list[int] | None:
    # lenient, as the engines are: anything but a non-empty list counts as absent
    return [int(v) for v in x] if isinstance(x, (list, tuple)) and len(x) > 0 else None


def _view_ids(ids: list[int], eng: str, L: int, what: str) -> tuple[list[int] | None, str]:
    try:
        return from_engine_ids(ids, eng, L), what
    except LayoutError as e:
        return None, f"{what}: {str(e).split(';')[0]} — the engine fails to start or captures garbage"


def engine_views(cfg: dict[str, Any], engine: str, num_layers: int, semantics: str | None = None,
                 reads_semantics: bool | None = None, architecture: str | None = None,
                 release: Any = None) -> list[EngineView]:
    """Read a draft config.json as `engine` does. More than one view means engine versions disagree.
    semantics: vLLM's `eagle_aux_layer_semantics` given in --speculative-config (overrides config.json's).
    reads_semantics: whether the vLLM version reads that key (eyas/engines.py; 0.32 does not); None = unknown,
    so both readings are shown. architecture, release: the target's model class and the SGLang release, whose
    rule decides what SGLang's ids mean (eyas/aux_rules.py; default: the newest release read)."""
    if _eagle_config(cfg).get("use_aux_hidden_state") is False:
        return [EngineView(engine, None, "eagle_config.use_aux_hidden_state is false: no aux capture, the "
                                         "draft gets the final 1xH state")]
    if engine == "sglang":
        return _sglang_views(cfg, num_layers, architecture, release)
    if engine == "vllm":
        if reads_semantics is False:  # the key is never read: the ids are taken as they are
            cfg, semantics = {k: v for k, v in cfg.items() if k != SEMANTICS_KEY}, None
        views = _vllm_views(cfg, num_layers, semantics)
        return views[:1] if reads_semantics and len(views) > 1 and SEMANTICS_KEY in views[0].when else views
    raise LayoutError(f"engine {engine!r}: expected 'sglang' or 'vllm'")


def _sglang_views(cfg: dict[str, Any], L: int, architecture: str | None, release: Any) -> list[EngineView]:
    from .aux_rules import capture, rules_for

    rules = rules_for("sglang", release)
    nested = _ids(_eagle_config(cfg).get(IDS_KEY))
    top = _ids(cfg.get(IDS_KEY))
    ignored = f" (the top-level ids {top} are vLLM's; SGLang never reads them)" if top is not None and \
        nested is None else ""
    c = capture(rules, architecture, nested, L)
    if c.status == "unknown":
        # an architecture named but not listed is unknown; none named: a reading every read rule agrees on is
        # no guess
        oks = [x for x in (capture(rules, a, nested, L) for a in rules.rules) if x.status == "ok"]
        if architecture is not None or len({(tuple(x.streams or ()), tuple(x.lost)) for x in oks}) != 1:
            return [EngineView("sglang", None, f"{c.note}; {rules.label()}'s rules read these ids differently "
                               "per architecture", unknown=True)]
        c = oks[0]
        c.source = f"{architecture or 'target architecture unknown'}: every {rules.label()} rule reads them alike"
    if c.status == "refused":
        return [EngineView("sglang", None, c.note)]
    what = (f"eagle_config.{IDS_KEY} {nested} ({c.note.split(':')[0]}, {c.source})" if nested is not None
            else f"{c.note} ({c.source}){ignored}")
    if c.lost:
        what += (f"; layers {c.lost} are outside what the target's forward captures, so they are never captured "
                 f"and fc gets {len(c.streams or [])} states")
    return [EngineView("sglang", [x for x in c.layers or [] if x not in c.lost], what)]  # as listed


def _vllm_views(cfg: dict[str, Any], L: int, semantics: str | None) -> list[EngineView]:
    sem, sem_src = semantics, "--speculative-config"
    if sem is None and SEMANTICS_KEY in cfg:
        sem, sem_src = cfg[SEMANTICS_KEY], "config.json"
    if sem is not None and sem not in AUX_SEMANTICS:
        return [EngineView("vllm", None, f"{SEMANTICS_KEY} {sem!r} in {sem_src}: vLLM knows only "
                                         f"{' and '.join(repr(x) for x in AUX_SEMANTICS)}")]
    top, nested = _ids(cfg.get(IDS_KEY)), _ids(_eagle_config(cfg).get(IDS_KEY))
    if top is not None:
        what = f"top-level {IDS_KEY} {top}"
        if sem == "sglang":
            idx, src = _view_ids(top, "sglang", L, f'{what} (+1: {SEMANTICS_KEY} "sglang" in {sem_src})')
            if semantics is not None:  # the override lives in the launch command, not in the folder
                return [EngineView("vllm", idx, src)]
            old, old_src = _view_ids(top, "vllm", L, f"{what} (as-is)")
            return [EngineView("vllm", idx, src, f"vLLM builds that read {SEMANTICS_KEY}"),
                    EngineView("vllm", old, old_src + ": the key is ignored", f"older vLLM (no {SEMANTICS_KEY})")]
        how = f'as-is: {SEMANTICS_KEY} "vllm" in {sem_src}' if sem == "vllm" else "as-is"
        idx, src = _view_ids(top, "vllm", L, f"{what} ({how})")
        return [EngineView("vllm", idx, src)]
    default = default_aux_indices(L)
    views = [EngineView("vllm", default, f"no top-level ids: vLLM default {default} (input-of)",
                        "vLLM builds that read top-level ids only" if nested is not None else "")]
    if nested is not None:
        idx, src = _view_ids(nested, "vllm", L, f"eagle_config ids {nested} used as-is (no +1)")
        views.append(EngineView("vllm", idx, src, "vLLM builds that fall back to eagle_config ids"))
    return views


def config_fix(engine: str, layout: list[int], num_layers: int, architecture: str | None = None) -> str:
    """The config.json edit that pins `layout` for `engine` (ids in that engine's own convention; SGLang's as
    the newest release read maps them on an `architecture` target)."""
    if engine == "sglang":
        try:
            ids = sglang_config_ids(layout, num_layers, architecture)["eagle_config"][IDS_KEY]
        except LayoutError:
            return (f"SGLang cannot capture stream {layout} (its ids mean output-of, so neither the embedding 0 nor "
                    f"the final state {num_layers} is expressible): serve this draft with vLLM or eyas, or retrain")
        how = "output-of: stream - 1" if ids == [k - 1 for k in layout] else f"as the {architecture} rule reads them"
        return (f'set "eagle_config": {{"{IDS_KEY}": {ids}, "use_aux_hidden_state": true}} '
                f"in the draft's config.json (SGLang ids {how})")
    return (f'set top-level "{IDS_KEY}": {to_engine_ids(layout, "vllm", num_layers)} '
            f'and "{SEMANTICS_KEY}": "vllm" in the draft\'s config.json (vLLM ids mean input-of = eyas '
            'stream indices; the explicit semantics keeps newer vLLM from adding 1)')


def off_by_one_note(engine: str, seen: list[int], trained: list[int]) -> str:
    """Why `engine` would capture `seen` instead of `trained` when the two differ by one: ids written in the
    other engine's convention."""
    if [k - 1 for k in seen] == trained or [k + 1 for k in seen] == trained:
        other = "vLLM (input-of)" if engine == "sglang" else "SGLang (output-of)"
        return f" — off by one: ids written in {other}'s convention"
    return ""


# ---- what a foreign config's ids could mean (the import's view) ----------------------------------

SG_READING = "sglang (eagle_config, output-of: id + 1)"
FALLBACK_READING = "vllm fallback (eagle_config used as-is, input-of)"


@dataclass
class Readings:
    """The stream indices a config's ids could mean, and how sure we are."""
    candidates: dict[str, list[int]]  # reading name -> stream indices, only readings that are valid here
    preferred: str | None  # the reading the format itself defines (None: the format defines no ids)
    ambiguous: bool  # True when more than one reading is plausible and nothing marks which
    notes: list[str] = field(default_factory=list)  # what was checked, every oddity found


def _try(ids: list[int] | None, engine: str, L: int) -> tuple[list[int] | None, str | None]:
    if ids is None:
        return None, None
    try:
        return from_engine_ids(ids, engine, L), None
    except LayoutError as e:
        return None, str(e)


def id_readings(found: IdsFound, fmt: str, L: int, explicit_format: bool) -> Readings:
    """Every valid reading of the ids in a config of format `fmt` for an L-layer target."""
    if fmt == "speculators":
        return _speculators_readings(found, L)
    if fmt == "eagle":
        name = "EAGLE reference (inputs of layers 2, L//2, L-3)"
        return Readings({name: default_aux_indices(L)}, name, not explicit_format,
                        ["no ids in the config; the EAGLE reference code captures the inputs of layers "
                         f"2, L//2, L-3 = stream {default_aux_indices(L)}, but a config without ids may come from "
                         "anywhere"])
    if fmt in ("sglang", "specforge"):
        return _sglang_readings(found, fmt, L, explicit_format)
    if fmt == "vllm":
        if found.top is None:
            return _vllm_fallback_readings(found, L, explicit_format)
        return _vllm_readings(found, L, explicit_format)
    raise FormatError(f"unknown format {fmt!r}; expected one of {IMPORT_FORMATS}")


def _speculators_readings(found: IdsFound, L: int) -> Readings:
    if found.top is None:
        return Readings({"eagle default (speculators' fallback)": default_aux_indices(L)}, None, True,
                        [f"speculators config has no {IDS_KEY}; speculators and vLLM "
                         f"would fall back to input-of [2, L//2, L-3] = {default_aux_indices(L)}"])
    s, err = _try(found.top, "speculators", L)
    if s is None:
        raise FormatError(f"speculators ids {found.top}: {err}")
    return Readings({"speculators (input-of)": s}, "speculators (input-of)", False,
                    [f"speculators ids {found.top} are input-of = stream {s}"])


def _sglang_readings(found: IdsFound, fmt: str, L: int, explicit_format: bool) -> Readings:
    if found.eagle_config is None:
        if found.top is not None:
            raise FormatError(f"--format {fmt}: the config has only top-level ids {found.top}, which SGLang "
                              "never reads; use --format vllm, or pass --aux-ids/--ids-convention")
        return Readings({"SGLang default (layers_to_capture [2, L//2, L-3])": default_aux_indices(L)}, None,
                        True, ["no eagle_config ids: SGLang would capture its default stream "
                               f"{default_aux_indices(L)}"])
    notes: list[str] = []
    s, s_err = _try(found.eagle_config, "sglang", L)
    v, v_err = _try(found.eagle_config, "vllm", L)
    cands: dict[str, list[int]] = {}
    if s is not None:
        cands[SG_READING] = s
    if v is not None and v != s:
        cands[FALLBACK_READING] = v
    if s is None:
        notes.append(f"eagle_config ids {found.eagle_config} are impossible in SGLang's output-of convention "
                     f"({s_err}); only the as-is (input-of) reading is valid: they were written for vLLM")
        if v is None:
            raise FormatError(f"eagle_config ids {found.eagle_config} are out of range for a {L}-layer target "
                              f"in every convention ({v_err}); the draft was made for another model")
        return Readings(cands, None, False, notes)
    notes.append(f"eagle_config ids {found.eagle_config} read by SGLang as output-of = stream {s}")
    if found.top is not None:
        tv, _ = _try(found.top, "vllm", L)
        if tv == s:
            notes.append(f"top-level ids {found.top} (input-of) agree: stream {s}")
            return Readings({SG_READING: s}, SG_READING, False, notes)
    if found.eagle_config == default_aux_indices(L) and L >= 4:
        notes.append(f"eagle_config ids {found.eagle_config} equal the EAGLE-3 default stream indices "
                     "(input-of): possibly vLLM-convention ids placed where SGLang reads output-of ids")
    return Readings(cands, SG_READING, not explicit_format, notes)


def _vllm_fallback_readings(found: IdsFound, L: int, explicit_format: bool) -> Readings:
    """A vLLM config without top-level ids: the model default, or eagle_config's ids used as-is."""
    if found.eagle_config is None:
        return Readings({"vLLM default (input of layers 2, L//2, L-3)": default_aux_indices(L)}, None, True,
                        [f"no ids: vLLM would use the target model's default stream {default_aux_indices(L)}"])
    v, v_err = _try(found.eagle_config, "vllm", L)
    s, _ = _try(found.eagle_config, "sglang", L)
    if v is None:
        raise FormatError(f"eagle_config ids {found.eagle_config}: {v_err}")
    cands = {FALLBACK_READING: v}
    if s is not None and s != v:
        cands[SG_READING] = s
    return Readings(cands, FALLBACK_READING, not explicit_format,
                    [f"--format vllm with only eagle_config ids {found.eagle_config}: vLLM uses them as-is "
                     f"(stream {v}), an off-by-one if they were written for SGLang (stream {s})"])


def _vllm_readings(found: IdsFound, L: int, explicit_format: bool) -> Readings:
    """A vLLM config with top-level ids, checked against its eagle_config ids and SGLang's defaults."""
    if found.semantics == "sglang":
        # newer vLLM adds 1 to these (apply_eagle3_aux_layer_semantics): the config says they are output-of
        s, s_err = _try(found.top, "sglang", L)
        if s is None:
            raise FormatError(f"top-level ids {found.top} with {SEMANTICS_KEY} 'sglang': {s_err}")
        name = f"vllm (top level, {SEMANTICS_KEY} sglang: id + 1)"
        return Readings({name: s}, name, False, [f"top-level ids {found.top} marked {SEMANTICS_KEY} "
                                                 f"'sglang' (output-of) = stream {s}"])
    v, v_err = _try(found.top, "vllm", L)
    s_alt, _ = _try(found.top, "sglang", L)
    if v is None:
        raise FormatError(f"top-level ids {found.top}: {v_err}")
    cands = {"vllm (top level, input-of)": v}
    notes = [f"top-level ids {found.top} read by vLLM as input-of = stream {v}"]
    ambiguous = False
    if found.eagle_config is not None:
        es, _ = _try(found.eagle_config, "sglang", L)
        if es == v:
            notes.append(f"eagle_config ids {found.eagle_config} (output-of) agree: stream {v}")
        else:
            ambiguous = not explicit_format
            notes.append(f"eagle_config ids {found.eagle_config} disagree: SGLang would read stream {es}, vLLM "
                         f"reads stream {v} from the top level — the two engines would feed different layers")
            if es is not None:
                cands[SG_READING] = es
    sg_default = default_ids("sglang", L) if L >= 4 else None
    if sg_default is not None and found.top == sg_default and v != default_aux_indices(L):
        notes.append(f"top-level ids {found.top} equal SGLang's default output-of ids: if they came from "
                     f"SGLang/SpecForge they mean stream {s_alt}, not {v} (SGLang ids placed at vLLM's top level)")
        if s_alt is not None:
            cands.setdefault("sglang ids misplaced at the top level (id + 1)", s_alt)
        ambiguous = not explicit_format
    return Readings(cands, "vllm (top level, input-of)", ambiguous, notes)
