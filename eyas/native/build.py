"""Build eyas's C kernels and keep the result in a verified cache ($EYAS_CACHE/kernels).

A cached library is tied to what it was built from: every source and header (named), the compiler's identity
(`cc --version`, so an upgraded gcc behind the same name builds anew), the flags and this CPU's feature set (a
home folder shared by machines of different CPUs must never hand one an object built for the other). These make
the cache key. Next to each `eyas_kernels-<tag>.so` a sidecar `eyas_kernels-<tag>.json` records the full key and
the digest of the .so (eyas.files.file_digest); a library is loaded only when its sidecar records the current
key and its bytes hash to the recorded digest, so a stale or damaged file is rebuilt, never loaded by name.
Check, build and load happen under a lock on the cache folder, so two processes starting at once build once and
never read a half-written pair.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import time
from collections.abc import Sequence
from functools import cache
from pathlib import Path

from ..files import atomic_write, atomic_write_json, cache_dir, file_digest
from ..heartbeat import during
from .boundary import KernelError

COMPILE_TIMEOUT_S = 300  # a cold build takes about a second; five minutes means a wedged compiler
STALE_AGE_S = 24 * 3600
PREFIX = "eyas_kernels-"


def compiler() -> str:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    raise KernelError("the native CPU mode builds a small C kernel at first use and found no C compiler "
                      "(cc, gcc or clang; or set $CC); install one (Debian: apt install gcc) or run with "
                      "--weights fp32")


@cache
def compiler_identity(cc: str) -> str:
    """`cc --version` as printed (gcc 12 and gcc 13 both answer to `cc`)."""
    try:
        r = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelError(f"{cc} --version did not answer ({e}); set $CC to a working C compiler or run with "
                          "--weights fp32") from e
    return (r.stdout or r.stderr).strip()


def cpu_features() -> tuple[str, ...]:
    """This CPU's instruction-set features, sorted: /proc/cpuinfo's flags (x86) or Features (arm) on Linux,
    sysctl's machdep.cpu feature lists on macOS, else platform.processor()."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() in ("flags", "Features"):
                return tuple(sorted(set(value.split())))
    except OSError:
        pass
    if platform.system() == "Darwin":
        try:
            r = subprocess.run(["sysctl", "-n", "machdep.cpu.features", "machdep.cpu.leaf7_features",
                                "hw.optional.arm64"], capture_output=True, text=True, timeout=10)
            if r.stdout.strip():
                return tuple(sorted(set(r.stdout.lower().split())))
        except (OSError, subprocess.TimeoutExpired):
            pass
    return (platform.processor() or platform.machine(),)


def cache_key(cc: str, sources: Sequence[Path], flags: Sequence[str]) -> dict[str, str]:
    """What a built library depends on, each part hashed; `tag` names the files."""
    src = hashlib.sha256(b"".join(p.name.encode() + b"\0" + p.read_bytes() + b"\0" for p in sources)).hexdigest()
    parts = {"sources": src, "compiler": hashlib.sha256(compiler_identity(cc).encode()).hexdigest(),
             "flags": " ".join(flags), "cpu": hashlib.sha256(" ".join(cpu_features()).encode()).hexdigest(),
             "machine": platform.machine()}
    parts["tag"] = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]
    return parts


def compile_library(cc: str, flags: Sequence[str], sources: Sequence[Path], out: Path) -> None:
    """Compile and link the .c files among `sources` (each finds kernels.h beside itself) into `out`."""
    cmd = [cc, *flags, *(str(p) for p in sources if p.suffix == ".c"), "-o", str(out), "-lm"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise KernelError(f"building eyas's CPU kernel with {cc} took over {COMPILE_TIMEOUT_S} s and was stopped; "
                          "check the compiler (or set $CC), or run with --weights fp32") from e
    if r.returncode != 0:
        msg = " ".join(r.stderr.split())[:400]
        raise KernelError(f"building eyas's CPU kernel with {cc} failed: {msg}; run with --weights fp32 to avoid it")


def _sidecar(so: Path) -> Path:
    return so.with_suffix(".json")


def verified(so: Path, key: dict[str, str]) -> str | None:
    """Why the cached `so` may not be loaded for `key` (None: it may)."""
    if not so.is_file():
        return "not built yet"
    try:
        rec = json.loads(_sidecar(so).read_text())
    except (OSError, ValueError):
        return "its record is missing or unreadable"
    if not isinstance(rec, dict) or rec.get("key") != key:
        return "it was built for another source, compiler, flag set or CPU"
    if rec.get("digest") != file_digest(so):
        return "its bytes differ from those recorded when it was built"
    return None


def remove_stale(folder: Path, keep: str, now: float | None = None) -> list[Path]:
    """Delete the other variants' files (eyas_kernels-<tag>.*, tag != keep) unused for a day.

    Why age and not simply "another key": a cache folder may be shared by an older eyas install or, through a
    shared home, by a machine with another CPU; their libraries have other keys but are in use, and deleting them
    would make each side rebuild on every start. Loading a library refreshes its sidecar's mtime (see
    cached_library), so a day-old sidecar means no process has loaded that variant for a day, and none is about
    to (that would happen under the lock we hold). A process that still has it mapped is unaffected: unlinking
    an open file keeps its pages until the last user goes. A library without a record (written by an eyas from
    before the records) is aged by its own mtime."""
    now = time.time() if now is None else now
    removed = []
    tags = {p.name[len(PREFIX):].split(".")[0] for p in folder.glob(f"{PREFIX}*.so")}
    tags |= {p.name[len(PREFIX):-len(".json")] for p in folder.glob(f"{PREFIX}*.json")}
    for tag in tags:
        if tag == keep or "." in tag:  # "." in tag: <tag>.speed.json, a record about a variant, not the variant's own
            continue
        side, so = folder / f"{PREFIX}{tag}.json", folder / f"{PREFIX}{tag}.so"
        try:
            if now - (side if side.exists() else so).stat().st_mtime < STALE_AGE_S:
                continue
        except OSError:
            continue
        for f in folder.glob(f"{PREFIX}{tag}.*"):
            f.unlink(missing_ok=True)
            removed.append(f)
    return removed


def cached_library(cc: str, sources: Sequence[Path], flags: Sequence[str]) -> tuple[ctypes.CDLL, dict[str, str]]:
    """The library built from `sources` with `cc` and `flags` (built now when the cache holds no verified one),
    loaded, and its key. Loaded under the lock, right after its check: no other process replaces it between."""
    key = cache_key(cc, sources, flags)
    folder = cache_dir() / "kernels"
    so = folder / f"{PREFIX}{key['tag']}.so"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = open(folder / ".lock", "a")  # closed (and the lock released) by the with below
    except OSError as e:
        raise KernelError(f"cannot use the kernel cache {folder} ({e.strerror or e}); set $EYAS_CACHE to a writable "
                          "folder or run with --weights fp32") from e
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if verified(so, key) is not None:
            with during("compiling eyas's CPU kernels (first use on this CPU and compiler only)"):
                atomic_write(so, lambda tmp: compile_library(cc, flags, sources, tmp))
            atomic_write_json(_sidecar(so), {"key": key, "digest": file_digest(so)})
            remove_stale(folder, key["tag"])
            why = verified(so, key)
            if why is not None:  # the folder changed under the lock: a broken filesystem, not a race
                raise KernelError(f"the kernel just built at {so} fails its check ({why}); remove {folder} and "
                                  "rerun, or run with --weights fp32")
        else:
            os.utime(_sidecar(so))  # "in use": see remove_stale
        return ctypes.CDLL(str(so)), key
