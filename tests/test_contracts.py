"""docs/CONTRACTS.md stays true: every dotted `eyas.` name it cites imports (a module, or a name inside one)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "CONTRACTS.md"


def cited() -> list[str]:
    return sorted(set(re.findall(r"(?<![\w/.])(eyas(?:\.[A-Za-z_]\w*)+)", DOC.read_text())))


def resolve(name: str) -> object:
    """The module of the longest importable prefix, then the attributes after it."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(name)


def test_every_cited_name_imports():
    names = cited()
    assert len(names) >= 40, names  # the file cites its owners by dotted name; fewer means the pattern broke
    missing = []
    for name in names:
        try:
            resolve(name)
        except (ModuleNotFoundError, AttributeError) as e:
            missing.append(f"{name} ({e})")
    assert not missing, "docs/CONTRACTS.md cites names that do not exist:\n" + "\n".join(missing)


def spliced(doc: str) -> str:
    """docs/CONTRACTS.md with its metadata tables replaced by the ones the schemas generate now."""
    from eyas.metadata import BEGIN, END, contracts_section

    head, _, rest = doc.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return head + contracts_section() + tail


def test_metadata_tables_are_the_schemas():
    from eyas.metadata import BEGIN, END

    doc = DOC.read_text()
    assert doc.count(BEGIN) == 1 and doc.count(END) == 1, "docs/CONTRACTS.md lost its metadata-table markers"
    assert spliced(doc) == doc, "docs/CONTRACTS.md's metadata tables differ from eyas/metadata.py: run `make contracts`"
    assert "| `shards[i].file` | a file name inside the folder |" in doc  # nested entries are listed too


if __name__ == "__main__":  # `make contracts`: regenerate the tables after a schema change
    DOC.write_text(spliced(DOC.read_text()))
    print(f"wrote {DOC}")
