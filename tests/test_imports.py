"""The architecture as a test: eyas's import graph (read from the source with ast, function-level imports
included) has no cycle, and no module imports from a stage above its own.

Stages, lowest first (a module may import its own stage and any lower one; stages of equal rank may not
import each other). Each line names its modules, every one of them: test_stages_named_as_they_are holds this
list to the files.
  core     eyas/: errors, files, schema, metadata, option, interrupt, heartbeat, text, layout, rope, vocab, conventions,
           engine_views, id_readings, engines, aux_rules, engine_source -- the
           contracts every stage builds on (atomic writes, stream indices, each engine's aux-id convention and
           versioned behaviour)
  native   eyas/native: gguf_file, quant, kernels, build, boundary, auto -- the GGUF reader, quantized weights,
           C kernels
  vllm     eyas/vllm: env, vllm.session, capture_worker, generate_worker -- same rank as native: finds vLLM's own
           python and runs worker scripts under it
  target   eyas/target: offline, family, device, gguf_config, convert, capture, load, template, open -- what a
           spec names, loading it, its chat template, capture of its streams
  draft    eyas/: draft, inspect -- the EAGLE-3 module over a target; inspect over a target
  engine   eyas/engine: params, rowwise, forward, moe, mla, sinks, weights, sampling, lookup, ngram, stats, prompt,
           sequence, tree, verify, decode, load -- decoding settings, the target forward, the decode round, the one
           engine assembly
  data     eyas/data: conversations, regen, shards, datagen_config, capture, chunks, manifest, datagen_vllm,
           datagen, ngrams -- needs the target to capture
  replay   eyas/replay: rows, recorded, run, served, plants, heldout -- same rank as data: captured rows, the recorded
           target, the replay on the engine, planted faults
  train    eyas/train: config, sources, checkpoint, ttt, step, prepare, progress, loop -- reads shards
  probe    eyas/probe: samples, streams, scoring, candidates, ranking, inference -- layout inference (the draft's
           scores come from train's ttt)
  doctor   eyas/doctor: checklist, checks, features, head, identity, draft_dir, traps, launch_command, flags, seal,
           server, serving, sglang_counts, trace, aux_probe, installed --
           measured with probe; flags lint; the serving check; the served streams of a live SGLang
  interop  eyas/interop: formats, export, importer -- import asks probe's layout inference
  bench    eyas/bench: config, prompts, load, methods, rows, outdir, environment, render, run, sweep, vllm_peer,
           llama_c -- peers on the engine
  serve    eyas/serve: config, openai_schema, bounds, metrics, worker, app, launch -- same rank as bench; neither needs
           the other
  recipe   eyas/: recipe -- data -> train -> bench -> ship
  cli      eyas/cli: common, data, decode, doctor, inspect, interop, recipe, replay, train -- every command (and
           eyas/__main__.py above it)
"""

from __future__ import annotations

import ast
from pathlib import Path

import eyas

ROOT = Path(eyas.__file__).parent
RANK = {"core": 0, "native": 1, "vllm": 1, "target": 2, "draft": 3, "engine": 4, "data": 5, "replay": 5, "train": 6,
        "probe": 7, "doctor": 8, "interop": 9, "bench": 10, "serve": 10, "recipe": 11, "cli": 12, "__main__": 13}
STAGE_PACKAGES = ("native", "vllm", "target", "engine", "data", "replay", "train", "probe", "doctor", "interop",
                  "bench", "serve")
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


def source_of(node: ast.ImportFrom, module: str, path: Path) -> str:
    """The absolute module a `from X import ...` in `module` (at `path`) names, relative imports resolved."""
    if not node.level:
        return node.module or ""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    base = package.split(".")
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """eyas modules that `module` imports anywhere in its file (relative and absolute)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "eyas")
        elif isinstance(node, ast.ImportFrom):
            src = source_of(node, module, path)
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


def test_probe_is_used_through_its_package():
    """The doctor and import read the layout inference through eyas.probe's exports, so its modules can be
    rearranged without touching them."""
    bad = sorted(f"{m} imports {d}" for m, deps in graph().items() if not m.startswith("eyas.probe")
                 for d in deps if d.startswith("eyas.probe."))
    assert not bad, "import from eyas.probe (its __init__ exports the API), not its modules:\n" + "\n".join(bad)


def private_imports() -> set[tuple[str, str, str]]:
    """Every `from X import _name` (function-level ones too) where X is another eyas module than the importer's:
    (importer, X, _name). Dunders such as __version__ are public."""
    out: set[tuple[str, str, str]] = set()
    for m, p in modules().items():
        for node in ast.walk(ast.parse(p.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            src = source_of(node, m, p)
            if src.split(".")[0] != "eyas" or src == m:
                continue
            out.update((m, src, a.name) for a in node.names
                       if a.name.startswith("_") and not (a.name.startswith("__") and a.name.endswith("__")))
    return out


def test_no_private_names_cross_modules():
    """A name with a leading underscore is its module's own: a module that needs it from another gets a public
    name (and so an interface someone keeps), not a reach into the other module's internals."""
    bad = sorted(private_imports())
    assert not bad, "private names imported from another module (give them public names):\n" + "\n".join(
        f"{m}: from {src} import {name}" for m, src, name in bad)


def stated_stages() -> dict[str, tuple[str, set[str]]]:
    """The docstring's stage lines: stage -> (folder, module names)."""
    text = __doc__.split("list to the files.\n", 1)[1]
    entries: list[str] = []
    for line in text.splitlines():
        if line.startswith("  ") and not line.startswith("   "):
            entries.append(line.strip())
        elif entries:
            entries[-1] += " " + line.strip()
    out = {}
    for entry in entries:
        name, rest = entry.split(maxsplit=1)
        folder, names = rest.split(" -- ")[0].split(": ")
        # a module may be named with its package (vllm.session), which tests/test_no_history.py tells from history
        out[name] = (folder, {n.strip().rsplit(".", 1)[-1] for n in names.split(",")})
    return out


def test_stages_named_as_they_are():
    """Every stage line names the modules its folder holds (no more, no fewer), and the ranks know every stage."""
    stated = stated_stages()
    assert set(stated) == set(RANK) - {"__main__"}
    flat = {p.stem for p in ROOT.glob("*.py")} - {"__init__", "__main__"}
    for name, (folder, names) in stated.items():
        if folder == "eyas/":
            have = {m for m in flat if FLAT.get(m, "core") == name}
        else:
            have = {p.stem for p in (ROOT.parent / folder).glob("*.py")} - {"__init__"}
        assert names == have, f"{name}: the docstring says {sorted(names)}, {folder} holds {sorted(have)}"
