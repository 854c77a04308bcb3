"""The benchmark scripts use eyas's public API: no private name (leading underscore) of an eyas module is imported
or read by them, so a refactor inside eyas cannot silently break a figure's committed command."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def private_uses(source: str) -> list[str]:
    """`name (line)` for every private eyas name a script imports or reads off an imported eyas module."""
    tree = ast.parse(source)
    modules: set[str] = set()  # local names bound to eyas modules
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "eyas":
            for a in node.names:
                if a.name.startswith("_"):
                    found.append(f"{node.module}.{a.name} ({node.lineno})")
                else:
                    modules.add(a.asname or a.name)  # maybe a module (`from eyas.native import kernels`)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "eyas":
                    if any(p.startswith("_") for p in a.name.split(".")):
                        found.append(f"{a.name} ({node.lineno})")
                    modules.add(a.asname or a.name.split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in modules:
                found.append(f"{ast.unparse(node)} ({node.lineno})")
    return found


def test_the_check_finds_private_names():
    src = ("from eyas.native.kernels import _FLAGS, pack_q4\nimport eyas.engine.tree as tree\n"
           "from eyas.native import kernels\nx = tree._grow(1)\ny = kernels._SOURCES\nz = kernels.FLAGS\n")
    assert sorted(private_uses(src)) == ["eyas.native.kernels._FLAGS (1)", "kernels._SOURCES (5)", "tree._grow (4)"]


def test_benchmarks_use_public_names_only():
    scripts = sorted((ROOT / "benchmarks").glob("*.py"))
    assert len(scripts) > 10
    bad = {p.name: u for p in scripts if (u := private_uses(p.read_text()))}
    assert not bad, f"benchmarks reach into eyas's private names (make the name public or use its owner): {bad}"
