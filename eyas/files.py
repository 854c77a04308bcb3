"""Atomic writes: the one place that writes a temporary file (or folder) and renames it into place.

A reader (or a resumed run) sees either the old content or the new one, never a torn file: a kill
mid-write leaves only a `*.tmp-<pid>` sibling behind, which the next write from that pid replaces and
`remove_stale_temps` clears once the pid is gone. `read_json` is the
matching reader: a file that is not JSON is one error line naming the file and the fix. `file_record` is what a
manifest records of each tensor file it lists (size and xxh3_128 digest); `check_file` verifies a file against it.
`portable_command` and `portable_paths` keep the paths of the machine that made an artifact out of its records.
"""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xxhash
from safetensors.torch import save_file

from .errors import EyasError


class WriteError(EyasError):
    """The disk refused a write (full, read-only, no permission): the file, the reason and the fix."""


# errno -> (reason, fix); safetensors' Rust writer reports the same faults as text, matched by `_FAULT_TEXT`
_FAULTS = {
    errno.ENOSPC: ("no space left on the device", "free disk space or write to another disk, then rerun"),
    errno.EDQUOT: ("the disk quota is exhausted", "free space in your quota or write elsewhere, then rerun"),
    errno.EROFS: ("the filesystem is read-only", "choose an output folder on a writable filesystem"),
    errno.EACCES: ("permission denied", "choose an output folder you can write, or fix its permissions"),
    errno.EPERM: ("operation not permitted", "choose an output folder you can write, or fix its permissions"),
}
_FAULT_TEXT = {"StorageFull": errno.ENOSPC, "No space left": errno.ENOSPC, "ReadOnlyFilesystem": errno.EROFS,
               "Read-only file system": errno.EROFS, "PermissionDenied": errno.EACCES,
               "Permission denied": errno.EACCES}


def write_fault(e: BaseException, path: str | Path | None = None, atomic: bool = False) -> WriteError | None:
    """A disk fault (full, read-only, permission denied) as a one-line WriteError naming the file (the error's
    own filename when it has one, else `path`); None for any other error, which stays a bug to see. `atomic`:
    the write went to a temporary that was removed, so nothing half-written remains."""
    if isinstance(e, WriteError):
        return e
    code = e.errno if isinstance(e, OSError) else None
    if code not in _FAULTS and type(e).__name__ == "SafetensorError":
        code = next((c for text, c in _FAULT_TEXT.items() if text in str(e)), None)
    if code not in _FAULTS:
        return None
    reason, fix = _FAULTS[code]
    name = getattr(e, "filename", None) or path
    # a temporary's name (<file>.tmp-<pid>) means nothing to the user: name the file it was for
    where = str(path) if path is not None and name is not None and ".tmp-" in str(name) else name
    kept = " (nothing half-written was kept)" if atomic else ""
    return WriteError(f"cannot write {where or 'the output'}: {reason}{kept}; {fix}")


def atomic_write(path: str | Path, write: Callable[[Path], object]) -> Path:  # what write returns is unused
    """`write(tmp)` fills a sibling temporary file, which then replaces `path` in one rename. The temporary is
    `<name>.tmp-<pid>` (no longer matching `*.safetensors`-style globs), so a writer that infers a format from
    the suffix must be told it (matplotlib: savefig(..., format="png"))."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except Exception as e:
        fault = write_fault(e, path, atomic=True)
        if fault is None:
            raise
        raise fault from e
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text))


def atomic_write_json(path: str | Path, data: Any) -> Path:
    return atomic_write_text(path, json.dumps(data, indent=2, default=str))


def swap_folder(new: Path, out: Path) -> Path:
    """Replace folder `out` by the complete folder `new` (two renames: out -> out.old, new -> out). A kill
    between them leaves out.old and `new` intact, both complete, for the caller's recovery to pick from."""
    old = out.with_name(out.name + ".old")
    if out.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(out, old)
    os.replace(new, out)
    if old.exists():
        shutil.rmtree(old)
    return out


def atomic_folder(out: str | Path, write: Callable[[Path], object]) -> Path:  # what write returns is unused
    """`write(tmp)` fills a fresh temporary folder, which then replaces `out` (see swap_folder). The temporaries a
    killed writer of the same `out` left behind are removed first (remove_stale_temps), so an export or a draft
    killed mid-write leaves nothing for good."""
    out = Path(out)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(out)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    except OSError as e:  # a read-only or foreign folder: name `out`, not the temporary
        fault = write_fault(e, out)
        if fault is None:
            raise
        raise fault from e
    try:
        write(tmp)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written is left behind
        fault = write_fault(e, out, atomic=True) if isinstance(e, Exception) else None
        if fault is None:
            raise
        raise fault from e
    return swap_folder(tmp, out)


def remove_stale_temps(out: str | Path, inside: bool = False) -> list[Path]:
    """Delete the `<out>.tmp-<pid>` siblings that a killed writer left (its pid no longer runs on this machine),
    and with `inside` the `*.tmp-<pid>` files inside folder `out` (a shard or log killed mid-write); a live
    writer's temporary is kept. Says so in one stderr line, and returns what was removed."""
    out = Path(out)
    found = list(out.parent.glob(f"{out.name}.tmp-*"))
    if inside and out.is_dir():
        found += list(out.glob("*.tmp-*"))
    removed, size = [], 0
    for tmp in found:
        pid = tmp.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or _running(int(pid)):
            continue
        if tmp.is_dir():
            size += sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file())
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            size += tmp.stat().st_size
            tmp.unlink(missing_ok=True)
        removed.append(tmp)
    if removed:
        names = ", ".join(t.name for t in removed[:3]) + (f" and {len(removed) - 3} more" if len(removed) > 3 else "")
        print(f"note: removed {len(removed)} temporary file(s) a killed eyas run left by {out} ({names}; "
              f"{size / 1e6:.1f} MB)", file=sys.stderr)
    return removed


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def read_json(path: str | Path, error: type[EyasError], fix: str) -> Any:
    """The JSON in `path`; a file that is not UTF-8 JSON raises `error` with the parser's reason and `fix`."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path} is not valid JSON ({e}); {fix}") from e


def inside(folder: str | Path, name: str) -> str | None:
    """Why `name`, a path an artifact's metadata records, does not name a file inside `folder` (None when it
    does): the one rule for every such path. An artifact names its own files only, so a copied, downloaded or
    edited manifest can never make eyas read (or seal, or count) a file elsewhere: an absolute path, a '..' step,
    or a link inside the folder that leads out of it is refused, whatever the file it reaches holds."""
    if not name:
        return "an empty name"
    if "\x00" in name:
        return "a NUL byte in the name"
    if name.startswith(("/", "\\")) or re.match(r"[A-Za-z]:", name):
        return "an absolute path"
    if ".." in re.split(r"[/\\]", name):
        return "a '..' step out of the folder"
    base = Path(folder).resolve()
    try:
        real = (base / name).resolve()
    except (OSError, RuntimeError) as e:  # a link loop
        return f"a path that does not resolve ({e})"
    if real == base or not real.is_relative_to(base):
        return f"a link that leads to {real}, outside the folder"
    return None


def member(folder: str | Path, name: str, what: str, error: type[EyasError], fix: str) -> Path:
    """folder/name, after `inside`'s rule; anything else raises `error` naming `what` (the metadata file and its
    entry, e.g. "WORK/latest-train.json 'train_dir'") and `fix`."""
    why = inside(folder, name)
    if why is not None:
        raise error(f"{what} should be a file name inside {folder}, found {name!r} ({why}); {fix}")
    return Path(folder) / name


def cache_dir() -> Path:
    """Where eyas keeps converted targets and built kernels ($EYAS_CACHE, else ~/.cache/eyas)."""
    return Path(os.environ.get("EYAS_CACHE", Path.home() / ".cache" / "eyas"))


# ---- digests: what a manifest records of each tensor file it lists, checked before the file is used ------

DIGEST_CHUNK = 8 << 20
DIGEST = "xxh3_128"  # what new records use; "sha256:" records (drafts written before 2026-12) still verify


def _hasher(algo: str) -> Any:
    if algo == "xxh3_128":
        return xxhash.xxh3_128()
    if algo == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown digest algorithm {algo!r} (this eyas knows xxh3_128 and sha256)")


def bytes_digest(data: bytes | bytearray | memoryview, algo: str = DIGEST) -> str:
    """'<algo>:<hex>' of bytes already in memory (the same value file_digest gives for a file holding them)."""
    h = _hasher(algo)
    h.update(data)
    return f"{algo}:{h.hexdigest()}"


def file_digest(path: str | Path, algo: str = DIGEST) -> str:
    """'<algo>:<hex>' of a file's bytes. xxh3_128 hashes ~18 GB/s in memory on one core, ~5 GB/s through the
    mapping (page faults dominate), so checking a shard folder before training costs 11-12% of the CPU time of
    reading it for one epoch where sha256 costs 70-80% (benchmarks/bench_checksum.py, AMD EPYC Zen 4, quiet). The
    file is mapped rather than read into a buffer, which saves a copy that would cost more than the hash."""
    h = _hasher(algo)
    with open(path, "rb") as f:
        try:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                h.update(m)
        except (ValueError, OSError):  # an empty file, or a filesystem that cannot map: read it in chunks
            f.seek(0)
            while chunk := f.read(DIGEST_CHUNK):
                h.update(chunk)
    return f"{algo}:{h.hexdigest()}"


def recorded_digest(record: dict[str, Any] | None) -> str | None:
    """The digest a manifest record holds: "digest" (any algorithm) or, in records written before 2026-12,
    "sha256"."""
    if not record:
        return None
    return record.get("digest") or record.get("sha256")


def file_record(path: str | Path) -> dict[str, Any]:
    """What a manifest records of a file it lists: its size and digest."""
    return {"bytes": Path(path).stat().st_size, "digest": file_digest(path)}


def damaged(path: str | Path, record: dict[str, Any] | None) -> str | None:
    """Why `path` does not match its manifest record ({"bytes", "digest"} or the older {"bytes", "sha256"}), or
    None when it matches. A record without a digest (artifacts written before eyas recorded them) is checked by
    size only, when it has one."""
    if not record:
        return None
    path = Path(path)
    if not path.is_file():
        return "it is missing"
    size = path.stat().st_size
    if record.get("bytes") is not None and size != record["bytes"]:
        return f"it is {size} bytes, {record['bytes']} were written (truncated or overwritten)"
    want = recorded_digest(record)
    if want:
        algo = want.split(":", 1)[0]
        try:
            got = file_digest(path, algo)
        except ValueError:
            return f"its recorded digest {want[:24]}... uses {algo!r}, which this eyas cannot check (upgrade eyas)"
        if got != want:
            return (f"its {algo} digest differs from the {want[:len(algo) + 13]}... recorded when it was written "
                    "(damaged bytes)")
    return None


def check_file(path: str | Path, record: dict[str, Any] | None, error: type[EyasError], fix: str) -> None:
    """Raise `error` (one line: the file, what is wrong, `fix`) when `path` does not match its record; a file its
    manifest records no digest of is read, with one note that it was not verified."""
    why = damaged(path, record)
    if why is not None:
        raise error(f"{path}: {why}; {fix}")
    if not recorded_digest(record):
        note_unverified(str(path), Path(path).parent)


NOTED: set[str] = set()  # what this process has already said was not verified


def note_unverified(what: str, folder: str | Path) -> None:
    """One stderr line per file (or group of files) per process: read without a digest to check it against, and
    the command that records one."""
    if what in NOTED:
        return
    NOTED.add(what)
    print(f"note: {what} not verified: its manifest records no digest (written before eyas recorded them); "
          f"`eyas doctor seal {folder}` records the files as they are now", file=sys.stderr)


def save_safetensors(tensors: dict[str, Any], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' save_file, with the header's metadata in sorted key order. The library writes the metadata
    from a hash map, in an order that changes from process to process, so identical tensors would give files
    (and digests) that differ between identical runs."""
    save_file(tensors, str(path), metadata=metadata)
    if metadata and len(metadata) > 1:
        _sort_metadata(Path(path))


def _sort_metadata(path: Path) -> None:
    # rewritten in place: the same keys and values serialize to the same length, so no tensor byte moves
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        ordered = {"__metadata__": dict(sorted(header.pop("__metadata__").items())), **header}
        text = json.dumps(ordered, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) > n:  # the library escaped differently: keep its header rather than move the data
            return
        f.seek(8)
        f.write(text + b" " * (n - len(text)))  # safetensors pads its header with spaces


# ---- lineage records: what an artifact says about how it was made, without the paths of one machine --------

def portable_command(argv: list[str] | None = None) -> str:
    """The command line as it can be typed again elsewhere: the program by its name (`eyas`), not the path of the
    environment it ran from (`/home/me/.venv/bin/eyas`)."""
    args = list(sys.argv if argv is None else argv)
    if args:
        args[0] = "eyas" if Path(args[0]).name == "__main__.py" else Path(args[0]).name  # python -m eyas
    return " ".join(args)


def portable_paths(value: Any, folder: str | Path, name: str) -> Any:
    """`value` (a manifest's strings, lists and dicts) with `folder` and every path under it, alone or as one word
    of a command line, written as `name`/...: a shipped artifact says where things were inside its work folder
    ('WORK/data-self-from-2000'), not where that folder was on the machine that made it."""
    roots = {str(Path(folder)), str(Path(folder).resolve())}

    def word(w: str) -> str:
        for r in roots:
            if w == r or w.startswith(r + "/"):
                return name + w[len(r):]
        return w

    if isinstance(value, str):
        return " ".join(word(w) for w in value.split(" "))
    if isinstance(value, list):
        return [portable_paths(v, folder, name) for v in value]
    if isinstance(value, dict):
        return {k: portable_paths(v, folder, name) for k, v in value.items()}
    return value
