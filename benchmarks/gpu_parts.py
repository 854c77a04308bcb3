"""The GPU run kit's parts: files cut into parts that fit one transfer, and put back together with every digest
checked. Standard library only: benchmarks/gpu_sprint.py runs it on the GPU machine before eyas is installed.

A kit folder holds call1/, call2/, ... (what each transfer carries), each with a copy of kit.json, the manifest:
every item's destination, size and sha256, whether its bytes are xz-compressed, and its parts in order (each part
with its own size and sha256, so a damaged or missing part is named with the transfer that must be redone).
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MANIFEST = "kit.json"
KIND = "eyas-gpu-kit"
FORMAT_VERSION = 1
BLOCK = 1 << 20
MANIFEST_ROOM = 256 << 10  # bytes each call keeps free for its copy of kit.json


class KitError(Exception):
    """A kit or a returned file that cannot be used: one line saying what is wrong and what to do."""


@dataclass
class Part:
    path: str  # relative to the folder the parts lie in (the kit folder: callN/<name>.partK)
    size: int
    sha256: str


@dataclass
class Item:
    dest: str  # where the item goes, relative to the unpacked kit (wheels/x.whl, pkgs/..., data/prompts.jsonl)
    size: int  # bytes once put back (after xz decompression)
    sha256: str
    xz: bool
    parts: list[Part] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Item:
        return cls(dest=d["dest"], size=d["size"], sha256=d["sha256"], xz=d["xz"],
                   parts=[Part(**p) for p in d["parts"]])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            h.update(block)
    return h.hexdigest()


def _blocks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            yield block


class Packer:
    """Writes items into part files, filling call1/, call2/, ... up to `capacity` bytes each before the next one
    opens: an item that does not fit the call in progress continues in a new part in the next call."""

    def __init__(self, root: Path, capacity: int, prefix: str = "call"):
        if capacity <= MANIFEST_ROOM:
            raise KitError(f"a call must carry more than {mib(MANIFEST_ROOM)}, got {mib(capacity)}")
        self.root, self.capacity, self.prefix = root, capacity - MANIFEST_ROOM, prefix
        self.call, self.used = 1, 0
        self.items: list[Item] = []

    def call_dir(self, n: int) -> str:
        return f"{self.prefix}{n}"

    def add(self, src: Path, dest: str, xz_preset: int | None = None) -> Item:
        """Pack the file `src` as the item `dest` (xz-compressed at `xz_preset` unless None)."""
        whole = hashlib.sha256()
        size = 0
        item = Item(dest=dest, size=0, sha256="", xz=xz_preset is not None)
        comp = lzma.LZMACompressor(preset=xz_preset) if xz_preset is not None else None
        writer = _PartWriter(self, item)
        try:
            for block in _blocks(src):
                whole.update(block)
                size += len(block)
                writer.write(comp.compress(block) if comp else block)
            if comp:
                writer.write(comp.flush())
        finally:
            writer.close()
        item.size, item.sha256 = size, whole.hexdigest()
        self.items.append(item)
        return item

    @property
    def calls(self) -> int:
        return self.call  # a call is opened only when bytes need it, so the last one is never empty


class _PartWriter:
    """The open part of one item: bytes go to the current call's part until the call is full."""

    def __init__(self, packer: Packer, item: Item):
        self.p, self.item = packer, item
        self.f = None
        self.h = hashlib.sha256()
        self.size = 0

    def _open(self) -> None:
        # the item's index keeps two items of one name (two __init__.py) apart
        name = f"{len(self.p.items):02d}-{Path(self.item.dest).name}"
        rel = f"{self.p.call_dir(self.p.call)}/{name}.part{len(self.item.parts):03d}"
        (self.p.root / rel).parent.mkdir(parents=True, exist_ok=True)
        self.f = open(self.p.root / rel, "wb")
        self.item.parts.append(Part(path=rel, size=0, sha256=""))
        self.h, self.size = hashlib.sha256(), 0

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self.p.used >= self.p.capacity:  # the call is full: the next call takes the rest
                self.close()
                self.p.call, self.p.used = self.p.call + 1, 0
            if self.f is None:
                self._open()
            take = min(len(view), self.p.capacity - self.p.used)
            self.f.write(view[:take])
            self.h.update(view[:take])
            self.size += take
            self.p.used += take
            view = view[take:]

    def close(self) -> None:
        if self.f is None:
            if not self.item.parts:  # an empty file still gets its (empty) part
                self._open()
            else:
                return
        self.f.close()
        self.f = None
        self.item.parts[-1].size, self.item.parts[-1].sha256 = self.size, self.h.hexdigest()


def split_file(src: Path, out: Path, part_bytes: int, name: str | None = None) -> Item:
    """Cut `src` into out/<name>.partK files of at most part_bytes each (the sprint's way back: no folders)."""
    name = name or src.name
    out.mkdir(parents=True, exist_ok=True)
    item = Item(dest=name, size=src.stat().st_size, sha256=sha256_file(src), xz=False)
    with open(src, "rb") as f:
        k = 0
        while True:
            chunk = f.read(part_bytes)
            if not chunk and k:
                break
            rel = f"{name}.part{k:03d}"
            (out / rel).write_bytes(chunk)
            item.parts.append(Part(path=rel, size=len(chunk), sha256=hashlib.sha256(chunk).hexdigest()))
            k += 1
            if len(chunk) < part_bytes:
                break
    return item


def part_problem(root: Path, part: Part) -> str | None:
    """Why a part cannot be used (missing, wrong size, wrong digest), or None."""
    path = root / part.path
    if not path.is_file():
        return f"{part.path} is missing"
    if path.stat().st_size != part.size:
        return f"{part.path} has {path.stat().st_size} bytes, expected {part.size}"
    if sha256_file(path) != part.sha256:
        return f"{part.path} does not match its sha256 (damaged in transfer)"
    return None


def put_back(item: Item, root: Path, dest: Path) -> Path:
    """Join an item's parts (lying under `root`) into `dest`, decompressing if it was packed with xz; the parts'
    and the whole file's digests are checked, and `dest` appears only when all match (written beside, renamed)."""
    for part in item.parts:
        if (why := part_problem(root, part)) is not None:
            raise KitError(f"{item.dest}: {why}; carry its folder again")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + f".tmp-{os.getpid()}")
    whole, size = hashlib.sha256(), 0
    dec = lzma.LZMADecompressor() if item.xz else None
    try:
        with open(tmp, "wb") as out:
            for part in item.parts:
                for block in _blocks(root / part.path):
                    data = dec.decompress(block) if dec else block
                    whole.update(data)
                    size += len(data)
                    out.write(data)
        if dec is not None and not dec.eof:
            raise KitError(f"{item.dest}: its xz stream ends early; a part is missing from the manifest")
        if size != item.size or whole.hexdigest() != item.sha256:
            raise KitError(f"{item.dest}: put back it has {size} bytes and sha256 {whole.hexdigest()[:16]}, expected "
                           f"{item.size} and {item.sha256[:16]}; rebuild the kit")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def write_manifest(root: Path, manifest: dict[str, Any], calls: int, prefix: str = "call") -> None:
    """kit.json into every call folder, so each transfer can be checked on its own."""
    text = json.dumps(manifest, indent=1)
    if len(text) > MANIFEST_ROOM:
        raise KitError(f"kit.json is {len(text)} bytes, more than the {MANIFEST_ROOM} each call keeps for it")
    for n in range(1, calls + 1):
        (root / f"{prefix}{n}").mkdir(parents=True, exist_ok=True)
        (root / f"{prefix}{n}" / MANIFEST).write_text(text)


def read_manifest(root: Path) -> dict[str, Any]:
    """The kit's manifest from any call folder under `root` (they are copies of one file)."""
    found = sorted(root.glob(f"*/{MANIFEST}"))
    if not found:
        raise KitError(f"{root}: no */{MANIFEST}; expected a kit folder written by `benchmarks/gpu_kit.py build` "
                       "(did the transfer carry its call folders?)")
    try:
        m = json.loads(found[0].read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise KitError(f"{found[0]}: not a readable kit manifest ({e}); carry that call folder again") from e
    if not isinstance(m, dict) or m.get("kind") != KIND or m.get("format_version") != FORMAT_VERSION:
        raise KitError(f"{found[0]}: not an {KIND} manifest of format {FORMAT_VERSION}; rebuild the kit")
    return m


def kit_items(manifest: dict[str, Any]) -> list[Item]:
    return [Item.from_dict(d) for d in manifest["items"]]


def staged(root: Path, manifest: dict[str, Any]) -> dict[str, list[str]]:
    """Per call folder, what is wrong with the parts it should hold ([] = all there and intact)."""
    calls = {f"{manifest['call_prefix']}{n}": [] for n in range(1, manifest["calls"] + 1)}
    for item in kit_items(manifest):
        for part in item.parts:
            if (why := part_problem(root, part)) is not None:
                calls[part.path.split("/", 1)[0]].append(why)
    return calls
