"""The streams a server feeds the draft when it loads an export folder: its config.json read as that engine's
release reads it on the target's architecture (eyas.engine_views.engine_views, eyas/aux_rules.py), so a replay can
predict the τ of the export as served, a wrong id mapping included, before any server starts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..aux_rules import rules_for
from ..engine_views import engine_views
from ..metadata import DRAFT_CONFIG, read_metadata
from .rows import ReplayError


@dataclass(frozen=True)
class Served:
    streams: list[int]  # eyas stream indices the engine captures for the draft, in fc order
    line: str  # how they were read, for the report


def served_streams(export: Path, engine: str, num_layers: int, architecture: str | None,
                   release: str | None, trained: list[int]) -> Served:
    """What `engine` (release; None = the newest read) captures from `export`/config.json on an `architecture`
    target of `num_layers` layers. One reading or a ReplayError: a replay of a guess would be a guess."""
    path = Path(export) / "config.json"
    if not path.is_file():
        raise ReplayError(f"--export {export}: expected the folder the server loads (with config.json), found no "
                          "config.json there; pass the `eyas export` output folder")
    cfg = read_metadata(path, DRAFT_CONFIG, ReplayError, "write it again with `eyas export`")
    views = engine_views(cfg, engine, num_layers, architecture=architecture, release=release)

    rules = rules_for(engine, release)
    who = f"{rules.label()} on a {architecture or 'target of unknown architecture'}"
    if len(views) != 1 or views[0].indices is None:
        why = "; ".join(v.source + (f" ({v.when})" if v.when else "") for v in views)
        raise ReplayError(f"{path}: {who} has no single reading of these ids ({why}); give --engine-version, or "
                          "replay without --export")
    streams = list(views[0].indices)
    if len(streams) != len(trained):
        raise ReplayError(f"{path}: {who} captures {len(streams)} streams {streams} but the draft's fc takes "
                          f"{len(trained)}; the server would fail to load it (fix the export's ids: `eyas export`)")
    verdict = "the trained ones" if streams == list(trained) else f"NOT the trained {list(trained)}"
    return Served(streams, f"{who} reads {path}: {views[0].source} -> streams {streams}, {verdict}")
