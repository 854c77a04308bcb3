"""The aux-id rule of the engine installed here, read from its own files (eyas/engine_source.py), against eyas's
table (eyas/aux_rules.py): `doctor flags` and `export` use what the installed engine does when the two differ, and
say so; without an installed engine they use the table and say which release it was read from."""

from __future__ import annotations

from dataclasses import replace

from ..aux_rules import AuxRules, rules_for
from ..engine_source import Source, SourceError, classify, find_source, sglang_tapped, vllm_tapped
from ..vllm.env import vllm_python_path
from .checklist import Check


def installed_source(engine: str) -> Source | None:
    """The engine's files where this machine has them: $EYAS_SGLANG_SOURCE / $EYAS_VLLM_SOURCE, vLLM's venv
    (`make vllm`, $EYAS_VLLM_PYTHON), or an sglang importable here. None when there is none."""
    py = vllm_python_path() if engine == "vllm" else None
    try:
        return find_source(engine, python=str(py) if py else None)
    except SourceError:
        return None


def derived_rules(src: Source, architecture: str, base: AuxRules) -> AuxRules:
    """`base` with the architecture's rule replaced by what the installed engine's code does."""
    tap = sglang_tapped if src.engine == "sglang" else vllm_tapped
    t = tap(src, architecture, [1, 5, 9], 12)
    if t.layers is None:
        kind, source = "none", t.source
    else:
        kind, source = classify(lambda ids, L: tap(src, architecture, ids, L).layers), t.source
    final = set(base.final) - {architecture} | ({architecture} if t.final and kind != "none" else set())
    return replace(base, release=f"{src.version} (installed)", how=src.where,
                   rules={**base.rules, architecture: (kind, source)}, final=frozenset(final))


def installed_check(engine: str, src: Source | None, architecture: str | None,
                    release: str | None) -> tuple[Check, AuxRules | None]:
    """One check naming where the aux-id rule comes from, and the rules to use when the installed engine's
    differ from the table's (None: use the table)."""
    table = rules_for(engine, release or (src.version if src else None))
    if src is None:
        return Check("engine_source", "pass", f"no {engine} installed here: the table's {table.label()} rules "
                     f"(read from {table.how})"), None
    if architecture is None:
        return Check("engine_source", "pass", f"{engine} {src.version} installed ({src.where}); the target's "
                     "architecture is unknown, so its rule was not compared"), None
    mine = derived_rules(src, architecture, table)
    got, want = mine.rules[architecture], table.rules.get(architecture)
    where = f"{engine} {src.version} (installed, {src.where})"
    if want is not None and (got[0], architecture in mine.final) == (want[0], architecture in table.final):
        return Check("engine_source", "pass", f"{where} maps ids for {architecture} as the table's "
                     f"{table.label()} does ({got[0]}, {got[1]})"), None
    was = f"the table's {table.label()} ({want[0]})" if want else f"the table's {table.label()} (not listed)"
    if got[0] == "other":
        return Check("engine_source", "warn", f"{where} has a rule for {architecture} that eyas cannot name "
                     f"({got[1]}), unlike {was}: judged by the table", numbers={"installed": got}), None
    return Check("engine_source", "warn", f"{where} maps ids for {architecture} unlike {was}: {got[0]} "
                 f"({got[1]}); using what the installed engine does", numbers={"installed": got}), mine
