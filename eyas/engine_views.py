"""What each engine captures for a draft config (the doctor's view): read a draft's config.json exactly as SGLang
(per release and target architecture, eyas/aux_rules.py) or vLLM (per release, eyas/engines.py) reads it, and
the fix to write when the captured streams are not the trained ones. The conventions themselves are
eyas/conventions.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .aux_rules import capture, rules_for
from .conventions import (
    AUX_SEMANTICS,
    IDS_KEY,
    SEMANTICS_KEY,
    default_aux_indices,
    eagle_config,
    from_engine_ids,
    sglang_config_ids,
    to_engine_ids,
)
from .errors import LayoutError


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
    if eagle_config(cfg).get("use_aux_hidden_state") is False:
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
    rules = rules_for("sglang", release)
    nested = _ids(eagle_config(cfg).get(IDS_KEY))
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
    top, nested = _ids(cfg.get(IDS_KEY)), _ids(eagle_config(cfg).get(IDS_KEY))
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


