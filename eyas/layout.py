"""The hidden-state layout contract: which residual-stream indices feed the draft, and of which target.

Stream index k in 0..L names the residual stream of an L-layer decoder: k = 0 is the embedding
output (input of layer 0), k = i the output of layer i-1 (input of layer i) before any norm, and
k = L the last layer's output before the final norm. Every artifact eyas writes carries a Layout;
every boundary compares them with `check_layouts`, which names each differing field and the fix.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

# what each engine's ids mean lives in conventions.py; default_aux_indices and LayoutError stay importable from here
from .conventions import default_aux_indices, to_engine_ids
from .errors import LayoutError

CONVENTION = "eyas-stream-v1"


@dataclass
class TargetIdentity:
    architecture: str
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    fingerprint: str
    name: str = ""  # informational only; never compared

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TargetIdentity:
        known = {f.name for f in fields(cls)}
        missing = [f.name for f in fields(cls) if f.name not in d and f.name != "name"]
        if missing:
            raise LayoutError(f"target identity is missing fields {missing}; found keys {sorted(d)}. "
                              "Re-create the artifact with this version of eyas.")
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass
class Layout:
    aux_indices: list[int]
    capture_final: bool = True  # the final pre-norm state (index L) is also stored
    convention: str = CONVENTION
    target: TargetIdentity | None = None
    # mean L2 norm per captured stream index (keys are str(k), plus "final"), measured at capture
    norms: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.aux_indices = [int(k) for k in self.aux_indices]
        if self.convention != CONVENTION:
            raise LayoutError(
                f"layout convention {self.convention!r} is not eyas's {CONVENTION!r}; convert ids with "
                "eyas.conventions.from_engine_ids(ids, engine, num_layers) or `eyas import`.")
        if self.target is not None:
            L = self.target.num_layers
            bad = [k for k in self.aux_indices if not 0 <= k <= L]
            if bad:
                raise LayoutError(f"aux stream indices {bad} are outside 0..{L} for a {L}-layer target")

    @classmethod
    def default_for(cls, target: TargetIdentity, aux_indices: list[int] | None = None) -> Layout:
        return cls(aux_indices=list(aux_indices or default_aux_indices(target.num_layers)), target=target)

    @property
    def num_aux(self) -> int:
        return len(self.aux_indices)

    def to_dict(self) -> dict[str, Any]:
        return {
            "convention": self.convention,
            "aux_indices": list(self.aux_indices),
            "capture_final": self.capture_final,
            "target": self.target.to_dict() if self.target else None,
            "norms": dict(self.norms),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Layout:
        if not isinstance(d, dict) or "aux_indices" not in d:
            raise LayoutError(f"not an eyas layout: expected a dict with 'aux_indices', found {str(d)[:200]}")
        conv = d.get("convention")
        if conv is None:
            raise LayoutError("layout has no 'convention' tag; eyas cannot know what its ids mean. "
                              "Import it with `eyas import` (which infers the layout) instead.")
        t = d.get("target")
        return cls(
            aux_indices=list(d["aux_indices"]),
            capture_final=bool(d.get("capture_final", True)),
            convention=conv,
            target=TargetIdentity.from_dict(t) if t else None,
            norms={str(k): float(v) for k, v in (d.get("norms") or {}).items()},
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, s: str) -> Layout:
        return cls.from_dict(json.loads(s))

    def engine_ids(self, engine: str) -> list[int]:
        if self.target is None:
            raise LayoutError("layout has no target identity; the layer count is needed to translate ids")
        return to_engine_ids(self.aux_indices, engine, self.target.num_layers)


def layout_diff(expected: Layout, found: Layout) -> list[tuple[str, Any, Any]]:
    """Every field (norms excluded: those drift legitimately and the doctor judges them) that differs."""
    diffs: list[tuple[str, Any, Any]] = []
    for name in ("convention", "aux_indices", "capture_final"):
        a, b = getattr(expected, name), getattr(found, name)
        if a != b:
            diffs.append((name, a, b))
    te, tf = expected.target, found.target
    if (te is None) != (tf is None):
        diffs.append(("target", te.to_dict() if te else None, tf.to_dict() if tf else None))
    elif te is not None and tf is not None:
        for f in fields(TargetIdentity):
            if f.name == "name":
                continue
            a, b = getattr(te, f.name), getattr(tf, f.name)
            if a != b:
                diffs.append((f"target.{f.name}", a, b))
    return diffs


_FIXES = {
    "aux_indices": "capture/train with the same --aux-indices, or import the draft so its ids are "
                   "translated (`eyas import`); never shift ids by hand",
    "convention": "convert the ids with `eyas import` into eyas's stream convention",
    "capture_final": "re-run datagen with the same --capture-final setting",
    "target.fingerprint": "the target's weights changed (another quantization, fine-tune or file); use "
                          "the exact target the artifact was made with, or re-capture and retrain",
    "target.num_layers": "this artifact was made for another model; use its target or retrain",
    "target.hidden_size": "this artifact was made for another model; use its target or retrain",
    "target.vocab_size": "this artifact was made for another model or tokenizer; use its target or retrain",
    "target.architecture": "this artifact was made for another model family; use its target or retrain",
    "target.model_type": "this artifact was made for another model family; use its target or retrain",
    "target": "record the target identity (re-create the artifact with eyas)",
}


def check_layouts(expected: Layout, found: Layout, expected_what: str = "expected",
                  found_what: str = "found", ignore: tuple[str, ...] = ()) -> None:
    """Raise LayoutError naming every differing field with both values and a fix; return if equal."""
    diffs = [d for d in layout_diff(expected, found) if d[0] not in ignore]
    if not diffs:
        return
    lines = [f"layout mismatch between {expected_what} and {found_what} ({len(diffs)} field(s) differ):"]
    for name, a, b in diffs:
        lines.append(f"  - {name}: {expected_what} has {a!r}, {found_what} has {b!r}")
        lines.append(f"    fix: {_FIXES.get(name, 'make both sides agree')}")
    raise LayoutError("\n".join(lines))
