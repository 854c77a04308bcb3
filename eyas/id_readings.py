"""What a foreign draft config's aux ids could mean (the import's view): every reading of its ids the formats
allow, which one the format defines, and whether the choice is ambiguous (eyas import decides with the doctor's
layout inference then). The conventions themselves are eyas/conventions.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from .conventions import (
    IDS_KEY,
    IMPORT_FORMATS,
    SEMANTICS_KEY,
    FormatError,
    IdsFound,
    default_aux_indices,
    default_ids,
    from_engine_ids,
)
from .errors import LayoutError

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
