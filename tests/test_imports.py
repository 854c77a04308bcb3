"""The architecture as a test: eyas's import graph (read from the source with ast, function-level imports
included) has no cycle, and no module imports from a stage above its own.

Stages, lowest first (a module may import its own stage and any lower one; stages of equal rank may not
import each other):
  core     the flat modules under eyas/: errors, files, text, layout, vocab, template, rope (the contracts every
           stage builds on)
  native   eyas/native: the GGUF reader, quantized weights, C kernels
  vllm     eyas/vllm (same rank as native): finds vLLM's own python and runs worker scripts under it
  target   eyas/target: family policy, device, conversion, load, capture
  draft    eyas/draft.py and eyas/inspect.py: the EAGLE-3 module over a target; inspect over a target
  engine   eyas/engine: params, forward, weights, sampling, lookup, ngram, stats, prompt, decode, load, report
  data     eyas/data: conversations, regen, shards, datagen_config, capture, chunks, manifest, datagen_vllm,
           datagen, ngrams (needs the target to capture)
  replay   eyas/replay (same rank as data): rows, the recorded target, the replay on the engine, planted faults
  train    eyas/train: config, sources, checkpoint, ttt, step, prepare, report, loop (reads shards)
  doctor   eyas/doctor: checks, inference, flags lint, trace (measures with ttt)
  interop  eyas/interop: conventions, formats, export, import (import asks the doctor's layout inference)
  bench, serve   eyas/bench, eyas/serve: peers on the engine; neither needs the other
  recipe   eyas/recipe.py: data -> train -> bench -> ship
  cli      eyas/cli/ and eyas/__main__.py: every command
"""

from __future__ import annotations

import ast
from pathlib import Path

import eyas

ROOT = Path(eyas.__file__).parent
RANK = {"core": 0, "native": 1, "vllm": 1, "target": 2, "draft": 3, "engine": 4, "data": 5, "replay": 5, "train": 6,
        "doctor": 7, "interop": 8, "bench": 9, "serve": 9, "recipe": 10, "cli": 11, "__main__": 12}
STAGE_PACKAGES = ("native", "vllm", "target", "engine", "data", "replay", "train", "doctor", "interop", "bench",
                  "serve")
FLAT = {"draft": "draft", "inspect": "draft", "recipe": "recipe", "cli": "cli", "__main__": "__main__"}


def module_name(path: Path) -> str:
    parts = ["eyas", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def stage(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "core"  # the package itself (__version__)
    if parts[1] in STAGE_PACKAGES:
        return parts[1]
    return FLAT.get(parts[1], "core")


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """eyas modules that `module` imports anywhere in its file (relative and absolute)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "eyas")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            if src.split(".")[0] != "eyas":
                continue
            subs = {f"{src}.{a.name}" for a in node.names} & known  # `from pkg import module`
            out.update(subs or {src})
    return {m for m in out if m in known and m != module}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: imports_of(m, p, set(mods)) for m, p in mods.items()}


def test_every_module_has_a_stage():
    for m in modules():
        assert stage(m) in RANK, m


def test_no_upward_imports():
    bad = []
    for m, deps in graph().items():
        for d in deps:
            a, b = stage(m), stage(d)
            if a != b and RANK[b] >= RANK[a]:
                bad.append(f"{m} ({a}) imports {d} ({b})")
    assert not bad, "imports from a stage at or above the importer's:\n" + "\n".join(sorted(bad))


def test_no_import_cycles():
    g = graph()
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    cycles: list[list[str]] = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(g[m]):
            if state.get(d) == 1:
                cycles.append(path[path.index(d):] + [d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_graph_is_read():
    """Guard against a parser that silently finds nothing: known edges must be there."""
    g = graph()
    assert "eyas.draft" in g["eyas.engine.decode"]
    assert "eyas.doctor.inference" in g["eyas.interop.importer"]
    assert "eyas.serve.openai_schema" in g["eyas.serve.app"]
    assert not any(m.startswith("eyas.engine") for m in g["eyas.target.load"])
    assert "eyas.native.kernels" in g["eyas.engine.forward"]
