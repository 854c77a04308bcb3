"""`eyas doctor seal FOLDER`: record the size and digest of each tensor file an eyas artifact holds, for artifacts
written before eyas recorded them (their readers print "not verified"), so every later read checks the bytes.

A seal records the files as they are now: it proves that later reads see these bytes, not that these bytes are the
ones first written. So it refuses a file that no longer matches the size its manifest records, or whose
safetensors header does not parse, and it never replaces a digest that is already recorded: it verifies it, and a
file whose bytes no longer give its recorded digest is reported (every such file, expected and found digest), the
exit nonzero, nothing written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from safetensors import safe_open

from ..data.shards import MANIFEST as SHARD_MANIFEST_FILE
from ..data.shards import ShardError, load_manifest
from ..draft import MANIFEST
from ..errors import EyasError
from ..files import atomic_write_json, damaged, file_digest, file_record, inside, recorded_digest
from ..metadata import ANY_MANIFEST, BY_KIND, CHECKPOINT_MANIFEST, TRAINER_STATE, read_metadata
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


def record(folder: Path, name: str, old: dict[str, Any] | None, bad: list[str]) -> dict[str, Any] | None:
    """The record to write for folder/name: None when it already has a digest (kept as it is, after checking the
    file still gives it: a mismatch is added to `bad`)."""
    path = folder / name
    why = inside(folder, name)  # a link out of the folder is never sealed, whatever it points to
    if why is not None:
        raise SealError(f"{path}: {why}; a sealed artifact holds its own files only: copy the file in instead")
    want = recorded_digest(old)
    if want:
        assert old is not None  # it holds the digest
        why = damaged(path, old)
        if why is not None:
            algo = want.split(":", 1)[0]
            same_size = path.is_file() and old.get("bytes") in (None, path.stat().st_size)
            # the size says what happened when it differs; else both digests, so a copy can be compared
            bad.append(f"{path}: digest {file_digest(path, algo)}, its record says {want} (the bytes changed after "
                       "they were recorded)" if same_size and algo in ("xxh3_128", "sha256") else f"{path}: {why}")
        return None
    why = damaged(path, old)  # a size recorded without a digest is still checked
    if why is not None:
        raise SealError(f"{path}: {why}; {FIX}")
    readable(path)
    return file_record(path)


def refuse_damage(bad: list[str]) -> None:
    if bad:
        raise SealError(f"{len(bad)} file(s) no longer match their digest records: {'; '.join(bad)}; {FIX} "
                        "(a seal never overwrites a record: it would bless the damage)")


def seal_shards(folder: Path) -> list[str]:
    m = load_manifest(folder)
    done: list[str] = []
    bad: list[str] = []
    for e in m["shards"]:
        new = record(folder, e["file"], e, bad)
        if new is not None:
            e.update(new)
            done.append(e["file"])
    refuse_damage(bad)
    if done:
        atomic_write_json(folder / SHARD_MANIFEST_FILE, m)
    return done


def seal_manifest(folder: Path) -> list[str]:
    """A draft, export, checkpoint or n-gram table: every *.safetensors in the folder gets a record in
    eyas_manifest.json's `files`, but a checkpoint's optimizer and RNG state, which trainer_state.json records."""
    fix = "the folder's manifest is damaged: rerun the command that wrote it"
    state = read_metadata(folder / STATE_FILE, TRAINER_STATE, SealError, fix) \
        if (folder / STATE_FILE).is_file() else None
    kind = read_metadata(folder / MANIFEST, ANY_MANIFEST, SealError, fix)["kind"]
    schema = CHECKPOINT_MANIFEST if state is not None else BY_KIND.get(kind, ANY_MANIFEST)
    m = read_metadata(folder / MANIFEST, schema, SealError, fix)  # every field, its `files` names included
    done: list[str] = []
    bad: list[str] = []
    for path in sorted(folder.glob("*.safetensors")):
        owner = m
        if state is not None and path.name != "model.safetensors":
            owner = state
        if owner.get("files") is None:
            owner["files"] = {}
        files = owner["files"]
        new = record(folder, path.name, files.get(path.name), bad)
        if new is not None:
            files[path.name] = new
            done.append(path.name)
    # a record of a file that is gone is damage too, not something to keep quiet about
    for owner in (m, state or {}):
        for name, rec in ((owner or {}).get("files") or {}).items():
            if not (folder / name).is_file() and recorded_digest(rec):
                bad.append(f"{folder / name}: it is missing")
    refuse_damage(bad)
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
