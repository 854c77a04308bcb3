"""Atomic writes: the one place that writes a temporary file (or folder) and renames it into place.

A reader (or a resumed run) sees either the old content or the new one, never a torn file: a kill
mid-write leaves only a `*.tmp-<pid>` sibling behind, which the next write from that pid replaces and
`remove_stale_temps` clears once the pid is gone. `read_json` is the
matching reader: a file that is not JSON is one error line naming the file and the fix.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import EyasError


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> Path:
    """`write(tmp)` fills a sibling temporary file, which then replaces `path` in one rename. The temporary is
    `<name>.tmp-<pid>` (no longer matching `*.safetensors`-style globs), so a writer that infers a format from
    the suffix must be told it (matplotlib: savefig(..., format="png"))."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
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


def atomic_folder(out: str | Path, write: Callable[[Path], None]) -> Path:
    """`write(tmp)` fills a fresh temporary folder, which then replaces `out` (see swap_folder)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written is left behind
        raise
    return swap_folder(tmp, out)


def remove_stale_temps(out: str | Path) -> list[Path]:
    """Delete the `<out>.tmp-<pid>` siblings that a killed writer left (its pid no longer runs on this machine);
    a live writer's temporary is kept. Returns what was removed. For outputs that are rebuilt on demand (the
    target cache), where a kill mid-write would otherwise leave a large folder behind for good."""
    out = Path(out)
    removed = []
    for tmp in out.parent.glob(f"{out.name}.tmp-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or _running(int(pid)):
            continue
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        removed.append(tmp)
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


def cache_dir() -> Path:
    """Where eyas keeps converted targets and built kernels ($EYAS_CACHE, else ~/.cache/eyas)."""
    return Path(os.environ.get("EYAS_CACHE", Path.home() / ".cache" / "eyas"))
