"""The n-gram table: what the target itself wrote after each 1-3 token context, counted over its own replies.

Context lookup (eyas.engine.lookup) proposes only when the running text repeats itself. A small target's replies also
repeat across conversations (openings, list and markdown scaffolding, code idioms), so the most frequent next
token after the longest known 1-3 token context, counted over the target's regenerated replies (`eyas datagen
--regenerate`), is its next token about as often as an EAGLE-3 draft's top-1 for the bundled SmolLM2-135M (~0.3
on MT-bench), for a dictionary lookup instead of a draft forward. The engine proposes from the table in rounds
where context lookup finds nothing; verification keeps decoding lossless whatever proposed a token. The same idea,
fed online from served replies, is SuffixDecoding (vLLM's `suffix` method); this table is built offline and fixed.

A table folder holds ngram.safetensors (per order k: ctx{k} [E_k, k] int32 contexts, next{k} [E_k] int32 their
most frequent next token, count{k} [E_k] and total{k} [E_k] int32) and eyas_manifest.json (kind "eyas-ngram":
the target identity, order, min count, the shard folders it was counted from, the command, and the table file's
size and digest, checked before it is read).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..errors import EyasError
from ..files import atomic_folder, atomic_write_json, check_file, file_record, save_safetensors
from ..metadata import NGRAM_MANIFEST, read_metadata

KIND = "eyas-ngram"
FORMAT_VERSION = 1
TABLE = "ngram.safetensors"
MANIFEST = "eyas_manifest.json"
NGRAM_SPECS = "auto | default | none | PATH"


class NgramError(EyasError):
    pass


@dataclass
class NgramTable:
    order: int
    next: dict[tuple[int, ...], int]  # context (1..order tokens) -> its most frequent next token
    manifest: dict[str, Any]
    path: Path | None = None
    max_id: int = field(init=False)  # the largest token id anywhere in the table (checked against the vocab)

    def __post_init__(self) -> None:
        self.max_id = max((max(c) for c in self.next), default=-1)
        self.max_id = max(self.max_id, max(self.next.values(), default=-1))

    def __len__(self) -> int:
        return len(self.next)

    def propose(self, context: list[int], length: int) -> list[int]:
        """Up to `length` tokens, each the top next token of the longest known suffix (<= order tokens) of the
        context extended by the proposal so far; stops where no suffix is known."""
        out: list[int] = []
        ctx = list(context[-self.order:])
        for _ in range(length):
            tok = None
            for k in range(min(self.order, len(ctx)), 0, -1):
                tok = self.next.get(tuple(ctx[-k:]))
                if tok is not None:
                    break
            if tok is None:
                break
            out.append(tok)
            ctx = (ctx + [tok])[-self.order:]
        return out


def count_ngrams(rows: Iterable[tuple[list[int], list[bool]]], order: int,
                 min_count: int) -> dict[int, dict[tuple[int, ...], tuple[int, int, int]]]:
    """Per order k: context -> (top next token, its count, the context's total), over the positions the
    target wrote (mask true); contexts may reach back into the prompt. Ties go to the smaller token id."""
    counts: list[Counter] = [Counter() for _ in range(order + 1)]
    for ids, mask in rows:
        for t in range(1, len(ids)):
            if not mask[t]:
                continue
            for k in range(1, min(order, t) + 1):
                counts[k][tuple(ids[t - k:t + 1])] += 1
    out: dict[int, dict[tuple[int, ...], tuple[int, int, int]]] = {}
    for k in range(1, order + 1):
        best: dict[tuple[int, ...], tuple[int, int, int]] = {}
        for key, c in counts[k].items():
            ctx, tok = key[:-1], key[-1]
            top, n, total = best.get(ctx, (tok, 0, 0))
            if c > n or (c == n and tok < top):
                top, n = tok, c
            best[ctx] = (top, n, total + c)
        out[k] = {ctx: v for ctx, v in best.items() if v[1] >= min_count}
    return out


def write_ngram(out: str | Path, table: dict[int, dict[tuple[int, ...], tuple[int, int, int]]],
                manifest: dict[str, Any]) -> Path:
    """Write count_ngrams' table and its manifest (kind, format version and entry counts added) to folder `out`,
    atomically."""
    tensors: dict[str, torch.Tensor] = {}
    for k, entries in table.items():
        ctx = sorted(entries)
        tensors[f"ctx{k}"] = torch.tensor(ctx, dtype=torch.int32).reshape(len(ctx), k)
        for j, name in enumerate(("next", "count", "total")):
            tensors[f"{name}{k}"] = torch.tensor([entries[c][j] for c in ctx], dtype=torch.int32)
    manifest = {"kind": KIND, "format_version": FORMAT_VERSION, **manifest,
                "entries": {str(k): len(v) for k, v in table.items()}}

    def write(tmp: Path) -> None:
        save_safetensors(tensors, tmp / TABLE, metadata={"producer": "eyas", "kind": KIND})
        manifest["files"] = {TABLE: file_record(tmp / TABLE)}  # checked by load_ngram before the table is read
        atomic_write_json(tmp / MANIFEST, manifest)

    return atomic_folder(out, write)


def load_ngram(path: str | Path) -> NgramTable:
    p = bundled_ngram_path() if str(path) == "default" else Path(path)
    if not p.is_dir():
        raise NgramError(f"n-gram table {str(path)!r} is not a folder (make one with `eyas ngram --data DIR`)")
    man_path = p / MANIFEST
    if not man_path.exists():
        raise NgramError(f"{p} has no {MANIFEST}: not an eyas n-gram table (make one with `eyas ngram --data DIR`)")
    m = read_metadata(man_path, NGRAM_MANIFEST, NgramError, "the table is corrupt: rebuild it with `eyas ngram`",
                      kind=KIND)
    if m["format_version"] != FORMAT_VERSION:
        raise NgramError(f"{man_path}: format_version {m.get('format_version')} but this eyas reads "
                         f"{FORMAT_VERSION}; rebuild it with `eyas ngram`")
    order = m["config"]["order"]  # the schema holds it to a whole number >= 1
    # tables written before eyas recorded digests (the shipped one among them) have no `files`: read unchecked
    check_file(p / TABLE, (m.get("files") or {}).get(TABLE), NgramError,
               "the table is damaged: copy it again, or rebuild it with `eyas ngram`")
    try:
        with safe_open(str(p / TABLE), framework="pt") as f:
            t = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    except Exception as e:  # safetensors raises several types on missing or corrupt files
        raise NgramError(f"{p / TABLE} is not a readable safetensors file ({e}); rebuild it with `eyas ngram`") \
            from e
    nxt: dict[tuple[int, ...], int] = {}
    for k in range(1, order + 1):
        ctx, tok = t.get(f"ctx{k}"), t.get(f"next{k}")
        if ctx is None or tok is None or ctx.dim() != 2 or ctx.shape[1] != k or tok.shape != (ctx.shape[0],):
            raise NgramError(f"{p / TABLE}: expected ctx{k} [E, {k}] and next{k} [E] for order {order}, found "
                             f"{None if ctx is None else tuple(ctx.shape)} and "
                             f"{None if tok is None else tuple(tok.shape)}; rebuild it with `eyas ngram`")
        nxt.update(zip(map(tuple, ctx.tolist()), tok.tolist(), strict=True))
    return NgramTable(order=order, next=nxt, manifest=m, path=p)


def check_ngram_for_target(table: NgramTable, target) -> None:
    """Refuse a table counted over another target's replies (its token ids and habits are that target's)."""
    want, have = table.manifest.get("target") or {}, target.identity
    if want.get("fingerprint") != have.fingerprint or want.get("vocab_size") != have.vocab_size:
        raise NgramError(f"n-gram table {table.path} was counted over the replies of {want.get('name') or '?'} "
                         f"({want.get('fingerprint')}, vocab {want.get('vocab_size')}), but the target is "
                         f"{have.name or '?'} ({have.fingerprint}, vocab {have.vocab_size}): build one from this "
                         "target's regenerated replies (`eyas datagen --regenerate`, then `eyas ngram`) or pass "
                         "--ngram none")
    if table.max_id >= have.vocab_size:
        raise NgramError(f"n-gram table {table.path} holds token id {table.max_id}, outside the target's vocab "
                         f"({have.vocab_size}); the table is corrupt: rebuild it with `eyas ngram`")


def bundled_ngram_path(name: str = "default") -> Path:
    return Path(__file__).parent.parent / "assets" / "ngram" / name


def check_ngram_spec(spec: str) -> None:
    """Fail before any model loads on an --ngram that cannot resolve."""
    if spec in ("auto", "none"):
        return
    if spec == "default" and not bundled_ngram_path().is_dir():
        raise NgramError(f"the bundled n-gram table ({bundled_ngram_path()}) is not shipped in this install: pass "
                         "--ngram PATH (from `eyas ngram`), --ngram auto or --ngram none")
    if spec != "default" and not Path(spec).is_dir():
        raise NgramError(f"--ngram {spec!r}: expected {NGRAM_SPECS} (a folder from `eyas ngram`)")


def resolve_ngram(spec: str, target) -> NgramTable | None:
    """--ngram: 'auto' (the bundled table when it was counted for this target, else none), 'default' (the
    bundled one, which must fit), 'none', or a table folder (which must fit)."""
    check_ngram_spec(spec)
    if spec == "none":
        return None
    if spec == "auto":
        p = bundled_ngram_path()
        if not (p / MANIFEST).exists():
            return None
        m = read_metadata(p / MANIFEST, NGRAM_MANIFEST, NgramError, "the bundled table is corrupt: reinstall eyas")
        if (m.get("target") or {}).get("fingerprint") != target.identity.fingerprint:
            return None
        spec = "default"
    table = load_ngram(spec)
    check_ngram_for_target(table, target)
    return table


def describe_ngram(table: NgramTable | None, spec: str) -> dict[str, Any] | None:
    """What a bench or server result records about the table it ran with."""
    if table is None:
        return None
    m = table.manifest
    return {"spec": spec, "path": str(table.path), "entries": len(table), "order": table.order,
            "reply_tokens": m.get("reply_tokens"), "data_hash": m.get("data_hash")}
