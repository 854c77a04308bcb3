"""The wheels of the GPU run kit: eyas itself (built from the commit or the working tree) and every distribution eyas
needs that the GPU machine lacks, for that machine's Python (benchmarks/gpu_kit.py uses this module).

Which distributions a machine has comes from a list (benchmarks/configs/h200-packages.txt for the H200: one name a
line, `name==version` where the version was read); the versions carried are the ones installed here, where eyas's
tests pass with them. They come from the package index (`pip download --only-binary=:all:` for the machine's Python
and platforms) or, for this machine's own Python, are repacked from the installed files, with no network at all.
torch and the CUDA libraries are never carried: they are gigabytes, and the machine has its own build.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.metadata as md
import io
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
H200_HAVE = ROOT / "benchmarks" / "configs" / "h200-packages.txt"
# manylinux tags pip accepts for the GPU machine (glibc 2.39): pip matches each tag exactly, so name them all
PLATFORMS = ([f"manylinux_2_{n}_x86_64" for n in range(39, 16, -1)] + ["manylinux2014_x86_64", "manylinux1_x86_64"])
NEVER_CARRY = re.compile(r"^(torch|torchvision|torchaudio|triton|nvidia-.*|cuda-.*)$")


class WheelError(Exception):
    """A wheel the kit needs that cannot be had: one line saying which and how to fix it."""


def read_have(spec: str) -> dict[str, str | None]:
    """The distributions a machine has: 'none', or a file of names (`name` or `name==version`, # comments)."""
    if spec == "none":
        return {}
    path = Path(spec)
    if not path.is_file():
        raise WheelError(f"--have {spec!r}: no such file; expected 'none' or a file of distribution names "
                         f"like {H200_HAVE.relative_to(ROOT)}")
    have: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            have[canonicalize_name(name)] = version.strip() or None
    return have


def _needs(dist: str, python_version: str) -> list[str]:
    """The distributions `dist` (installed here) requires on `python_version`, extras left out."""
    env = {"python_version": python_version, "python_full_version": f"{python_version}.0", "extra": ""}
    out = []
    for line in md.requires(dist) or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(env):
            out.append(canonicalize_name(req.name))
    return out


def missing_dists(have: dict[str, str | None], python_version: str, root: str = "eyas") -> list[tuple[str, str]]:
    """(name, version installed here) of every distribution `root` needs, directly or not, that `have` lacks;
    what `have` holds is taken as it is there (its own needs are the machine's business)."""
    seen, todo, missing = set(), list(_needs(root, python_version)), []
    while todo:
        name = todo.pop()
        if name in seen or name in have:
            continue
        seen.add(name)
        if NEVER_CARRY.match(name):
            raise WheelError(f"{name} is needed but missing from the machine's list; it is never carried (GBs, "
                             "CUDA builds): add it to the --have list if the machine has it")
        try:
            version = md.version(name)
        except md.PackageNotFoundError as e:
            raise WheelError(f"{name} (needed by eyas) is not installed here; run `make setup` first") from e
        missing.append((name, version))
        todo += _needs(name, python_version)
    return sorted(missing)


def download_wheels(dists: list[tuple[str, str]], out: Path, python_version: str) -> list[Path]:
    """Binary wheels of `dists` for the machine's Python and platforms, from the package index."""
    if not dists:
        return []
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp", "-d", str(out)]
    cmd += [a for p in PLATFORMS for a in ("--platform", p)] + [f"{n}=={v}" for n, v in dists]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        last = (run.stderr.strip().splitlines() or ["pip gave no message"])[-1]
        raise WheelError(f"pip download of {', '.join(f'{n}=={v}' for n, v in dists)} for Python {python_version} "
                         f"failed: {last}")
    return sorted(out.glob("*.whl"))


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def repack_wheel(name: str, out: Path) -> Path:
    """A wheel of the installed distribution `name`, made from its installed files (its own WHEEL tags kept): the
    way to carry it to a Python like this one without the network. Scripts and data installed outside
    site-packages are left out (eyas runs as `python -m eyas`)."""
    dist = md.distribution(name)
    info = next((f for f in dist.files or [] if f.name == "WHEEL" and f.parent.name.endswith(".dist-info")), None)
    if info is None:
        raise WheelError(f"{name}: its installed files hold no WHEEL record; it cannot be repacked (use --deps "
                         "download)")
    wheel_meta = info.read_text()
    tag = next(line.split(":", 1)[1].strip() for line in wheel_meta.splitlines() if line.startswith("Tag:"))
    stem = f"{re.sub(r'[-_.]+', '_', dist.metadata['Name'])}-{dist.version}"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}-{tag}.whl"
    skip = {"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"}
    rows = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for f in dist.files or []:
            rel = f.as_posix()
            if rel.startswith("..") or "__pycache__" in f.parts or f.suffix == ".pyc" or \
                    (f.parent.name.endswith(".dist-info") and f.name in skip):
                continue
            data = Path(f.locate()).read_bytes()
            z.writestr(rel, data)
            rows.append((rel, _record_hash(data), str(len(data))))
        record = f"{info.parent.as_posix()}/RECORD"
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(rows + [(record, "", "")])
        z.writestr(record, buf.getvalue())
    return path


def _source_tree(dest: Path, worktree: bool) -> str:
    """The repository's files into `dest`: the commit (HEAD) or the working tree (tracked and untracked files git
    does not ignore); returns what it was, for the manifest."""
    def git(*args: str) -> bytes:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, check=True).stdout

    commit = git("rev-parse", "--short", "HEAD").decode().strip()
    dest.mkdir(parents=True, exist_ok=True)
    if not worktree:
        with tarfile.open(fileobj=io.BytesIO(git("archive", "--format=tar", "HEAD"))) as t:
            t.extractall(dest, filter="data")
        return commit
    for rel in git("ls-files", "-z", "--cached", "--others", "--exclude-standard").decode().split("\0"):
        if rel and (ROOT / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            (dest / rel).write_bytes((ROOT / rel).read_bytes())
    return f"{commit}+worktree"


def eyas_wheel(tmp: Path, worktree: bool) -> tuple[Path, str]:
    """eyas's own wheel (pure Python, its assets and C sources inside), built offline with the setuptools here;
    returns (wheel, the commit it was built from)."""
    source = _source_tree(tmp / "src", worktree)
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                          "--no-index", "-w", str(tmp / "dist"), str(tmp / "src")], capture_output=True, text=True)
    wheels = sorted((tmp / "dist").glob("eyas-*.whl"))
    if run.returncode != 0 or len(wheels) != 1:
        last = (run.stderr.strip().splitlines() or ["no wheel written"])[-1]
        raise WheelError(f"building eyas's wheel failed: {last}")
    with zipfile.ZipFile(wheels[0]) as z:
        names = z.namelist()
    if not any(n.startswith("eyas/assets/drafts/default/") and n.endswith(".safetensors") for n in names):
        raise WheelError(f"{wheels[0].name} lacks the shipped draft (eyas/assets/drafts/default); check "
                         "pyproject.toml's package-data")
    return wheels[0], source
