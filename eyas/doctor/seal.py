"""`eyas doctor seal FOLDER`: record the size and digest of each tensor file an eyas artifact holds, for artifacts
written before eyas recorded them (their readers print "not verified"), so every later read checks the bytes.

A seal records the files as they are now: it proves that later reads see these bytes, not that these bytes are the
ones first written. So it refuses a file that no longer matches the size its manifest records, or whose
safetensors header does not parse, and it never replaces a digest that is already recorded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from safetensors import safe_open

from ..data.shards import MANIFEST as SHARD_MANIFEST_FILE
from ..data.shards import ShardError, load_manifest
from ..draft import MANIFEST
from ..errors import EyasError
from ..files import atomic_write_json, damaged, file_record, recorded_digest
from ..metadata import ANY_MANIFEST, TRAINER_STATE, read_metadata
from ..train.config import STATE_FILE


class SealError(EyasError):
    """The folder is not an eyas artifact, or one of its files cannot be sealed as it is."""


FIX = "restore the file from where it was copied, or rerun the command that wrote it; a seal records only intact files"


def readable(path: Path) -> None:
    """A tensor file sealed is at least a safetensors file whose header parses."""
    try:
        with safe_open(str(path), framework="pt") as f:
            list(f.keys())
    except Exception as e:  # safetensors raises several types on a corrupt header
        raise SealError(f"{path} is not a readable safetensors file ({e}); {FIX}") from e


def record(folder: Path, name: str, old: dict[str, Any] | None) -> dict[str, Any] | None:
    """The record to write for folder/name: None when it already has a digest (kept as it is)."""
    if recorded_digest(old):
        return None
    why = damaged(folder / name, old)  # a size recorded without a digest is still checked
    if why is not None:
        raise SealError(f"{folder / name}: {why}; {FIX}")
    readable(folder / name)
    return file_record(folder / name)


def seal_shards(folder: Path) -> list[str]:
    m = load_manifest(folder)
    done = []
    for e in m["shards"]:
        new = record(folder, e["file"], e)
        if new is not None:
            e.update(new)
            done.append(e["file"])
    if done:
        atomic_write_json(folder / SHARD_MANIFEST_FILE, m)
    return done


def seal_manifest(folder: Path) -> list[str]:
    """A draft, export, checkpoint or n-gram table: every *.safetensors in the folder gets a record in
    eyas_manifest.json's `files`, but a checkpoint's optimizer and RNG state, which trainer_state.json records."""
    fix = "the folder's manifest is damaged: rerun the command that wrote it"
    m = read_metadata(folder / MANIFEST, ANY_MANIFEST, SealError, fix)
    state = read_metadata(folder / STATE_FILE, TRAINER_STATE, SealError, fix) \
        if (folder / STATE_FILE).is_file() else None
    done = []
    for path in sorted(folder.glob("*.safetensors")):
        owner = m
        if state is not None and path.name != "model.safetensors":
            owner = state
        files = owner.setdefault("files", {})
        if not isinstance(files, dict):
            raise SealError(f"{folder}: its 'files' record is a {type(files).__name__}, expected an object; {fix}")
        new = record(folder, path.name, files.get(path.name))
        if new is not None:
            files[path.name] = new
            done.append(path.name)
    if done:
        # the manifest last: a reader that sees the new records finds trainer_state.json's already written
        if state is not None:
            atomic_write_json(folder / STATE_FILE, state)
        atomic_write_json(folder / MANIFEST, m)
    return done


def seal(folder: str | Path) -> list[str]:
    """Record the digest of every tensor file of the eyas artifact in `folder` that has none; returns their
    names (empty: everything was already recorded)."""
    p = Path(folder)
    if (p / SHARD_MANIFEST_FILE).is_file():
        try:
            return seal_shards(p)
        except ShardError as e:
            raise SealError(str(e)) from e
    if (p / MANIFEST).is_file():
        return seal_manifest(p)
    raise SealError(f"{p} holds neither {SHARD_MANIFEST_FILE} (a shard folder) nor {MANIFEST} (an eyas draft, "
                    "export, checkpoint or n-gram table): nothing eyas can seal")
