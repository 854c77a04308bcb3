"""The on-disk hidden-state dump: packed safetensors shards + one manifest.json per folder.

A shard packs many samples back to back (one tensor per field, sliced by `offsets`):
  input_ids [N] int32, loss_mask [N] uint8, aux [N, n_aux*H] (bf16 default), final [N, H] (pre-norm,
  stream index L), offsets [n+1] int64, row_ids [n] int64 (index of the source row each sample came from).
The manifest (kind "eyas-shards") holds the layout, the datagen config, the committed shard list and
counts. Writers commit a shard file first (tmp + rename), then the manifest (tmp + rename): a shard
file the manifest does not list is an orphan of a kill and is ignored (and removed on resume).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..errors import EyasError
from ..files import atomic_write, damaged, file_digest, note_unverified, recorded_digest, save_safetensors
from ..layout import Layout, check_layouts
from ..metadata import SHARD_MANIFEST, read_metadata
from ..target.template import describe_record, same_template
from ..vocab import check_token_ids

MANIFEST = "manifest.json"
KIND = "eyas-shards"
FORMAT_VERSION = 1


class ShardError(EyasError):
    pass


@dataclass
class Sample:
    row_id: int
    input_ids: torch.Tensor  # [S] long
    loss_mask: torch.Tensor  # [S] bool
    aux: torch.Tensor  # [S, n_aux*H]
    final: torch.Tensor  # [S, H] pre-norm final state

    def __len__(self) -> int:
        return self.input_ids.numel()


def write_shard(path: Path, samples: list[Sample], dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """Write samples packed into one safetensors file atomically; returns its manifest entry."""
    if not samples:
        raise ShardError("refusing to write an empty shard")
    lens = [len(s) for s in samples]
    offsets = torch.zeros(len(samples) + 1, dtype=torch.long)
    offsets[1:] = torch.tensor(lens).cumsum(0)
    tensors = {
        "input_ids": torch.cat([s.input_ids.reshape(-1) for s in samples]).to(torch.int32),
        "loss_mask": torch.cat([s.loss_mask.reshape(-1) for s in samples]).to(torch.uint8),
        "aux": torch.cat([s.aux.reshape(len(s), -1) for s in samples]).to(dtype),
        "final": torch.cat([s.final.reshape(len(s), -1) for s in samples]).to(dtype),
        "offsets": offsets,
        "row_ids": torch.tensor([s.row_id for s in samples], dtype=torch.long),
    }
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    atomic_write(path, lambda tmp: save_safetensors(tensors, tmp, metadata={"producer": "eyas", "kind": KIND}))
    return {
        "file": path.name,
        "samples": len(samples),
        "tokens": int(offsets[-1]),
        "loss_tokens": int(tensors["loss_mask"].sum()),
        "row_ids": [int(samples[0].row_id), int(samples[-1].row_id)],
        "bytes": path.stat().st_size,
        "digest": file_digest(path),  # checked when training opens the shard and when datagen resumes
    }


# a shard whose ids do not fit its target was captured for another one (or edited): recapture it
BAD_IDS_FIX = ("capture the folder again with `eyas datagen --target` set to the model it is meant for, into a "
               "new --out")
# what a shard's listing in its manifest is: (the manifest, the entry's index, the entry)
Listing = tuple[Path, int, dict[str, Any]]


def read_fields(path: Path, need: tuple[str, ...], vocab: int | None = None,
                listed: Listing | None = None) -> dict[str, torch.Tensor]:
    """The shard's tensors named in `need` (only those are read); a corrupt file, a missing field, tensors that do
    not agree with each other or (given its listing) with what the manifest records of it is one error.
    vocab: when input_ids are read, every id must be < vocab (eyas.vocab.check_token_ids, naming the file and the
    source row); every reader of a shard's token ids passes it (None only where none is recorded)."""
    check = vocab is not None and "input_ids" in need
    want = tuple(dict.fromkeys(need + (("input_ids", "offsets", "row_ids") if check else ())))
    try:
        with safe_open(str(path), framework="pt") as f:
            missing = sorted(set(want) - set(f.keys()))
            if missing:
                raise ShardError(f"{path} lacks fields {missing}; it was not written by eyas datagen")
            t = {k: f.get_tensor(k) for k in want}
    except ShardError:
        raise
    except Exception as e:
        raise ShardError(f"{path} is not a readable eyas shard ({e}); delete it and re-run datagen to resume") from e
    why = shard_misfit(t, listed)
    if why is not None:
        raise ShardError(f"{path}: {why}; the shard is damaged or was edited: rerun the `eyas datagen` that wrote "
                         "it into a new --out")
    if check:
        assert vocab is not None  # check implies it
        check_token_ids(t["input_ids"], t["offsets"].tolist(), int(vocab), path, t["row_ids"].tolist(), BAD_IDS_FIX)
    return {k: t[k] for k in need}


def shard_misfit(t: dict[str, torch.Tensor], listed: Listing | None) -> str | None:
    """How a shard's tensors disagree with each other or with its manifest entry (None when they agree): cheap
    checks on the offsets, so a slice never runs past its tensor and a manifest's counts are the file's."""
    off = t.get("offsets")
    if off is None:
        return None
    if off.dim() != 1 or off.numel() < 2 or off.is_floating_point() or int(off[0]) != 0 or \
            bool((off[1:] < off[:-1]).any()):
        return "its offsets are not sample boundaries (a rising run of whole numbers from 0)"
    tokens, samples = int(off[-1]), off.numel() - 1
    for k in ("input_ids", "loss_mask", "aux", "final"):
        if k in t and (t[k].dim() == 0 or t[k].shape[0] != tokens):
            return f"its {k} holds {tuple(t[k].shape)}, its offsets end at {tokens} tokens"
    if "row_ids" in t and t["row_ids"].shape != (samples,):
        return f"its row_ids hold {tuple(t['row_ids'].shape)}, its offsets bound {samples} samples"
    if listed is not None:
        manifest, i, e = listed
        if (e["tokens"], e["samples"]) != (tokens, samples):
            return (f"{manifest} 'shards[{i}]' records {e['tokens']} tokens in {e['samples']} samples, the file "
                    f"holds {tokens} in {samples}")
    return None


def read_shard(path: Path, vocab: int | None = None, listed: Listing | None = None) -> list[Sample]:
    t = read_fields(path, ("input_ids", "loss_mask", "aux", "final", "offsets", "row_ids"), vocab, listed)
    off = t["offsets"].tolist()
    out = []
    for i, row in enumerate(t["row_ids"].tolist()):
        a, b = off[i], off[i + 1]
        out.append(Sample(row_id=int(row), input_ids=t["input_ids"][a:b].long(),
                          loss_mask=t["loss_mask"][a:b].bool(), aux=t["aux"][a:b], final=t["final"][a:b]))
    return out


def load_manifest(folder: str | Path) -> dict[str, Any]:
    p = Path(folder) / MANIFEST
    if not p.exists():
        raise ShardError(f"{folder} has no {MANIFEST}: not an eyas shard folder (make one with `eyas datagen`)")
    fix = f"the folder's manifest is damaged: rerun the `eyas datagen` that wrote {folder} into a new --out"
    m = read_metadata(p, SHARD_MANIFEST, ShardError, fix, kind=KIND)
    if m["format_version"] != FORMAT_VERSION:
        raise ShardError(f"{p}: format_version {m['format_version']} but this eyas reads {FORMAT_VERSION}")
    return m


def manifest_hash(m: dict[str, Any]) -> str:
    """Identity of a dataset's content: layout + committed shards (names, sizes, rows)."""
    key = json.dumps({"layout": m.get("layout"), "shards": m.get("shards")}, sort_keys=True)
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()[:24]


def _row_hash(row_id: int) -> int:
    return int(hashlib.sha256(str(row_id).encode()).hexdigest()[:8], 16)


def is_heldout(row_id: int, heldout_pct: float) -> bool:
    """Deterministic split by source row: the same row is held out in every run and every process, however much
    data there is (heldout_rows decides for a known set of rows, small ones included)."""
    return (_row_hash(row_id) % 10000) < heldout_pct * 100


# below this many held-out rows asked for, the hash rule's count is too noisy (4 rows at 5% hold out none, at 25%
# often two): the split takes exactly the rows the rule ranks first
SMALL_SPLIT = 20


def heldout_rows(row_ids: Iterable[int], heldout_pct: float) -> set[int]:
    """The held-out rows of a known set of source rows. With at least SMALL_SPLIT rows asked for, is_heldout's
    (stable as data grows); below that, exactly max(1, floor(n * pct / 100)) of them, never all (training needs
    one), in is_heldout's order, so a small split is never empty nor larger than asked (beyond the one row a
    split needs). heldout_pct 0, or fewer than 2 rows: none."""
    rows = sorted(set(int(r) for r in row_ids))
    asked = len(rows) * heldout_pct / 100
    if heldout_pct <= 0 or len(rows) < 2:
        return set()
    if asked >= SMALL_SPLIT:
        return {r for r in rows if is_heldout(r, heldout_pct)}
    k = min(max(1, int(asked)), len(rows) - 1)
    return set(sorted(rows, key=lambda r: (_row_hash(r) % 10000, _row_hash(r), r))[:k])


class ShardSet:
    """One or more shard folders read as one dataset; all must share a layout (checked, named)."""

    def __init__(self, folders: Sequence[str | Path] | str | Path):
        if isinstance(folders, (str, Path)):
            folders = [folders]
        self.folders = [Path(f) for f in folders]
        self.manifests = [load_manifest(f) for f in self.folders]
        self.verified = False
        # each listed shard file -> its listing (manifest, index, entry), which `read` checks the file against
        self.listings: dict[Path, Listing] = {
            f / s["file"]: (f / MANIFEST, i, s) for f, m in zip(self.folders, self.manifests, strict=True)
            for i, s in enumerate(m["shards"])}
        self.layout = Layout.from_dict(self.manifests[0]["layout"])
        # the recorded target's vocabulary (one across the folders: their layouts, target included, must match)
        self.vocab: int | None = self.layout.target.vocab_size if self.layout.target is not None else None
        for f, m in zip(self.folders[1:], self.manifests[1:], strict=True):
            check_layouts(self.layout, Layout.from_dict(m["layout"]), str(self.folders[0]), str(f))
        # one template per dataset: a draft trained on chats rendered two ways serves neither well
        self.chat_template: dict[str, Any] | None = self.manifests[0].get("chat_template")
        mixed = [(f, m.get("chat_template")) for f, m in zip(self.folders, self.manifests, strict=True)
                 if not same_template(self.chat_template, m.get("chat_template"))]
        if mixed:
            raise ShardError("the shard folders were rendered with different chat templates: "
                             + "; ".join(f"{f}: {describe_record(m.get('chat_template'))}"
                                         for f, m in zip(self.folders, self.manifests, strict=True))
                             + ". Train on folders captured with one template (regenerate the odd ones with the "
                             "same --chat-template/--raw), or train them separately")

    @property
    def num_samples(self) -> int:
        return sum(s["samples"] for m in self.manifests for s in m["shards"])

    @property
    def num_tokens(self) -> int:
        return sum(s["tokens"] for m in self.manifests for s in m["shards"])

    def verify(self) -> None:
        """Check every listed shard against its manifest entry (size, and its digest where recorded): one error
        naming the first damaged file. Shards written before eyas recorded digests are checked by size, with one
        note per folder that they were not verified. Every reader of the tensors runs this first (shard_paths)."""
        for f, m in zip(self.folders, self.manifests, strict=True):
            for entry in m["shards"]:  # each file a name inside f: load_manifest's schema holds them to it
                why = damaged(f / entry["file"], entry)
                if why is not None:
                    raise ShardError(f"{f / entry['file']}: {why}; rerun the `eyas datagen` that wrote {f} (same "
                                     "--out): it redoes the damaged shard's chunk")
            bare = [e["file"] for e in m["shards"] if not recorded_digest(e)]
            if bare:
                note_unverified(f"{len(bare)} of {len(m['shards'])} shards in {f}", f)
        self.verified = True

    def shard_paths(self) -> list[Path]:
        """The listed shard files, verified (once) before the first reader gets them."""
        if not self.verified:
            self.verify()
        return [f / s["file"] for f, m in zip(self.folders, self.manifests, strict=True) for s in m["shards"]]

    def read(self, path: Path, need: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """read_fields of a listed shard, its offsets checked against its manifest entry."""
        return read_fields(path, need, self.vocab, self.listings.get(path))

    def row_ids(self) -> list[int]:
        """Every sample's source row id, in shard order (reads no tensor but the ids and their offsets)."""
        return [int(r) for p in self.shard_paths() for r in self.read(p, ("offsets", "row_ids"))["row_ids"].tolist()]

    def heldout_rows(self, heldout_pct: float) -> set[int]:
        """The held-out split of these folders' rows (heldout_rows): training's, and the doctor's."""
        return heldout_rows(self.row_ids(), heldout_pct)

    def samples(self, split: str = "all", heldout_pct: float = 5.0) -> Iterator[Sample]:
        """split: 'all' | 'train' | 'heldout' (by source row id, see heldout_rows)."""
        held = self.heldout_rows(heldout_pct) if split != "all" else set()
        for p in self.shard_paths():
            for s in read_shard(p, self.vocab, self.listings[p]):
                if split == "all" or (split == "heldout") == (int(s.row_id) in held):
                    yield s

    def token_rows(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(input_ids [S] long, loss_mask [S] bool) of every sample, reading neither hidden-state field."""
        for p in self.shard_paths():
            t = self.read(p, ("input_ids", "loss_mask", "offsets"))
            bounds = t["offsets"].tolist()
            for a, b in zip(bounds[:-1], bounds[1:], strict=True):
                yield t["input_ids"][a:b].long(), t["loss_mask"][a:b].bool()

    def hash(self) -> str:
        return "sha256:" + hashlib.sha256("".join(manifest_hash(m) for m in self.manifests).encode()).hexdigest()[:24]
