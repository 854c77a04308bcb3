"""Where training samples come from: captured shards (ShardSource) or conversations captured on the fly
(OnlineSource); both hand out padded batches. plan_epoch orders them into deterministic global batches."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..data.shards import ShardSet, heldout_rows
from .config import TrainError

# ---- data -----------------------------------------------------------------------------------------

@dataclass
class Item:
    key: tuple[int, int]  # (shard index, sample index) or (-1, conversation index)
    length: int
    row_id: int


@dataclass
class Batch:
    aux: torch.Tensor  # [B, S, nA*H]
    final: torch.Tensor  # [B, S, H]
    input_ids: torch.Tensor  # [B, S]
    loss_mask: torch.Tensor  # [B, S] bool
    tokens: int  # real (unpadded) tokens


def _pad_stack(seqs: list[torch.Tensor], S: int, value=0) -> torch.Tensor:
    out = seqs[0].new_full((len(seqs), S, *seqs[0].shape[1:]), value)
    for i, s in enumerate(seqs):
        out[i, :s.shape[0]] = s
    return out


def has_rows(loss_mask: torch.Tensor, max_len: int) -> bool:
    """A sample trains only if some row has a label: TTT step 0 row t needs loss_mask[t+2] within max_len.
    Samples without (e.g. the reply starts past --max-len) would make all-padding steps that still move
    AdamW's weights through its momentum, so they are skipped and counted."""
    return bool(loss_mask[2:max_len].any())


class ShardSource:
    """Captured shards. Token ids and masks are indexed up front (small); aux/final are read per shard
    on demand and held up to `buffer_mb` (the planner keeps each shuffling window inside that budget)."""

    def __init__(self, folders: list[str], heldout_pct: float, buffer_mb: int, max_len: int = 1 << 30,
                 data_tokens: list[int] | None = None):
        self.set = ShardSet(folders)  # refuses folders whose layouts differ, naming the fields
        # every shard against its recorded size and digest, once per run, before any of it trains (xxh3_128: 4-10% of
        # an epoch's read time, benchmarks/bench_checksum.py)
        self.set.verify()
        if data_tokens is not None and (len(data_tokens) != len(folders) or min(data_tokens) < 0):
            raise TrainError(f"--data-tokens has {len(data_tokens)} values for {len(folders)} --data folders; "
                             "give one count >= 0 per folder, in --data order (0 = all of it)")
        self.data_tokens = data_tokens
        self.layout = self.set.layout
        self.paths = self.set.shard_paths()
        self.bytes = [p.stat().st_size for p in self.paths]
        self.buffer = buffer_mb << 20
        self.tokens: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.train: list[Item] = []
        self.heldout: list[Item] = []
        self.skipped: dict[str, int] = {}
        held = self.set.heldout_rows(heldout_pct)  # over every row, as the doctor splits these folders
        for si, p in enumerate(self.paths):
            # a damaged file, or an id outside the recorded vocabulary, is named with its row
            t = self.set.read(p, ("offsets", "row_ids", "input_ids", "loss_mask"))
            off, rows = t["offsets"].tolist(), t["row_ids"].tolist()
            ids, mask = t["input_ids"].long(), t["loss_mask"].bool()
            for i, row in enumerate(rows):
                a, b = off[i], off[i + 1]
                if not has_rows(mask[a:b], max_len):
                    self.skipped["no_loss_rows_within_max_len"] = self.skipped.get("no_loss_rows_within_max_len", 0) + 1
                    continue
                self.tokens[(si, i)] = (ids[a:b], mask[a:b])
                it = Item(key=(si, i), length=b - a, row_id=int(row))
                (self.heldout if int(row) in held else self.train).append(it)
        self.kept_tokens: list[int] | None = None
        if data_tokens is not None:
            self._cap(data_tokens)
        self._cache: dict[int, dict[str, torch.Tensor]] = {}
        self._cache_order: list[int] = []

    def _cap(self, caps: list[int]) -> None:
        """Keep at most caps[f] training tokens of folder f (0 = all): whole samples in an order fixed by a hash
        of the row id, so a capped folder is a random subset that is the same in every run and process, and a
        row's other copy in another folder (original vs regenerated reply) is kept or dropped independently of
        the cap there only through its own folder's budget. The held-out split is never capped."""
        folder_of = [f for f, m in enumerate(self.set.manifests) for _ in m["shards"]]  # shard index -> folder

        def order(it: Item) -> bytes:
            return hashlib.sha256(f"cap:{it.row_id}:{it.key[1]}".encode()).digest()

        kept: list[Item] = []
        self.kept_tokens = []
        for f, cap in enumerate(caps):
            mine = sorted((it for it in self.train if folder_of[it.key[0]] == f), key=order)
            total = 0
            for it in mine:
                if cap and total + it.length > cap:
                    continue  # a smaller sample later may still fit
                kept.append(it)
                total += it.length
            self.kept_tokens.append(total)
        self.train = sorted(kept, key=lambda it: it.key)

    def hash(self) -> str:
        if self.data_tokens is None:
            return self.set.hash()
        caps = ",".join(map(str, self.data_tokens))
        return "sha256:" + hashlib.sha256(f"{self.set.hash()}|tokens={caps}".encode()).hexdigest()[:24]

    def describe(self) -> dict[str, Any]:
        return {"kind": "shards", "folders": [str(f) for f in self.set.folders], "hash": self.hash(),
                "data_tokens": self.data_tokens, "kept_tokens": self.kept_tokens,
                "skipped": self.skipped,
                "target_source": self.set.manifests[0].get("target_source"),
                "config": self.set.manifests[0].get("config"),
                "configs": [m.get("config") for m in self.set.manifests],  # one per folder, in folder order
                "folder_tokens": [int((m.get("counts") or {}).get("tokens", 0)) for m in self.set.manifests]}

    def groups(self) -> list[tuple[int, int]]:
        """(group id, bytes) per shard: the planner shuffles whole shards, then samples within windows."""
        return list(enumerate(self.bytes))

    def _shard(self, si: int) -> dict[str, torch.Tensor]:
        if si not in self._cache:
            while self._cache_order and sum(self.bytes[s] for s in self._cache_order) + self.bytes[si] > self.buffer:
                del self._cache[self._cache_order.pop(0)]
            self._cache[si] = self.set.read(self.paths[si], ("aux", "final", "offsets"))
            self._cache_order.append(si)
        return self._cache[si]

    def batch(self, items: list[Item], device: torch.device, max_len: int) -> Batch:
        aux, final, ids, mask = [], [], [], []
        for it in items:
            si, i = it.key
            sh = self._shard(si)
            a = int(sh["offsets"][i])
            n = min(it.length, max_len)
            aux.append(sh["aux"][a:a + n])
            final.append(sh["final"][a:a + n])
            t_ids, t_mask = self.tokens[it.key]
            ids.append(t_ids[:n])
            mask.append(t_mask[:n])
        S = max(x.shape[0] for x in ids)
        return Batch(aux=_pad_stack(aux, S).to(device=device, dtype=torch.float32),
                     final=_pad_stack(final, S).to(device=device, dtype=torch.float32),
                     input_ids=_pad_stack(ids, S).to(device), loss_mask=_pad_stack(mask, S, False).to(device),
                     tokens=sum(x.shape[0] for x in ids))

    def token_pairs(self, items: list[Item]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for it in items:
            yield self.tokens[it.key]


class OnlineSource:
    """Conversations tokenized up front; features captured from the target per batch (no shards)."""

    def __init__(self, target, source: str, num: int | None, max_len: int, heldout_pct: float,
                 aux_indices: list[int] | None, raw: bool = False):
        # another module; imported when used
        from ..data.conversations import load_conversations, tokenize_conversation, tokenize_raw
        from ..target.capture import stream_norms

        self.target = target
        convs, skipped = load_conversations(source, num)
        self.skipped = dict(skipped)
        self.tokens: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.train: list[Item] = []
        self.heldout: list[Item] = []
        import hashlib

        h = hashlib.sha256()
        held = heldout_rows([c.row_id for c in convs], heldout_pct)
        for i, conv in enumerate(convs):
            if raw:  # base models: the row's plain text, every token a loss token (like datagen --raw)
                ids, mask, _ = tokenize_raw(target.tokenizer, conv, max_len)
            elif conv.text is not None:  # a {"text"} document has no chat to render
                self.skipped["text_row_needs_raw"] = self.skipped.get("text_row_needs_raw", 0) + 1
                continue
            else:
                ids, mask = tokenize_conversation(target.tokenizer, conv.messages, max_len)
            if not has_rows(mask, max_len):
                self.skipped["no_loss_rows_within_max_len"] = self.skipped.get("no_loss_rows_within_max_len", 0) + 1
                continue
            self.tokens[(-1, i)] = (ids.long(), mask.bool())
            h.update(ids.to(torch.int64).numpy().tobytes() + mask.to(torch.uint8).numpy().tobytes())
            it = Item(key=(-1, i), length=ids.numel(), row_id=int(conv.row_id))
            (self.heldout if int(conv.row_id) in held else self.train).append(it)
        self._hash = "sha256:" + h.hexdigest()[:24]
        self.source = source
        layout = target.default_layout(aux_indices)
        sample = [self.tokens[it.key][0][None, :256].to(target.device) for it in self.train[:8]]
        layout.norms = stream_norms(target.model, sample, layout.aux_indices) if sample else {}
        self.layout = layout

    def hash(self) -> str:
        return self._hash

    def describe(self) -> dict[str, Any]:
        return {"kind": "online", "source": self.source, "hash": self._hash, "skipped": self.skipped,
                "target_source": self.target.source}

    def groups(self) -> list[tuple[int, int]]:
        return [(-1, 0)]

    def batch(self, items: list[Item], device: torch.device, max_len: int) -> Batch:
        from ..target.capture import capture

        ids = [self.tokens[it.key][0][:max_len] for it in items]
        mask = [self.tokens[it.key][1][:max_len] for it in items]
        S = max(x.shape[0] for x in ids)
        input_ids = _pad_stack(ids, S).to(self.target.device)
        attn = _pad_stack([torch.ones_like(x) for x in ids], S).to(self.target.device)
        cap = capture(self.target.model, input_ids, self.layout, attention_mask=attn)  # right padding: causal rows
        return Batch(aux=cap.aux.to(device=device, dtype=torch.float32),
                     final=cap.final_prenorm.to(device=device, dtype=torch.float32),
                     input_ids=input_ids.to(device), loss_mask=_pad_stack(mask, S, False).to(device),
                     tokens=sum(x.shape[0] for x in ids))

    def token_pairs(self, items: list[Item]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for it in items:
            yield self.tokens[it.key]


def plan_epoch(items: list[Item], groups: list[tuple[int, int]], seed: int, epoch: int, batch_tokens: int,
               max_len: int, buffer_bytes: int, pool: int = 64) -> list[list[int]]:
    """Deterministic global batches (lists of indices into `items`) for one epoch.
    Shuffle groups (shards), merge them into windows of <= buffer_bytes, shuffle samples in a window,
    sort pools of `pool` samples by length (less padding), fill batches up to batch_tokens padded tokens,
    shuffle batch order within the window. Same (seed, epoch) -> same plan on every rank and every resume."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    by_group: dict[int, list[int]] = {}
    for i, it in enumerate(items):
        by_group.setdefault(it.key[0] if groups[0][0] != -1 else -1, []).append(i)
    order = [groups[i] for i in torch.randperm(len(groups), generator=g).tolist()]
    windows: list[list[int]] = []
    cur: list[int] = []
    cur_bytes = 0
    for gid, nbytes in order:
        if cur and cur_bytes + nbytes > buffer_bytes:
            windows.append(cur)
            cur, cur_bytes = [], 0
        cur.extend(by_group.get(gid, []))
        cur_bytes += nbytes
    if cur:
        windows.append(cur)
    plan: list[list[int]] = []
    for win in windows:
        perm = [win[i] for i in torch.randperm(len(win), generator=g).tolist()]
        batches: list[list[int]] = []
        for a in range(0, len(perm), pool):
            chunk = sorted(perm[a:a + pool], key=lambda i: (-min(items[i].length, max_len), i))
            cur_b: list[int] = []
            longest = 0
            for i in chunk:
                n = min(items[i].length, max_len)
                if cur_b and (len(cur_b) + 1) * max(longest, n) > batch_tokens:
                    batches.append(cur_b)
                    cur_b, longest = [], 0
                cur_b.append(i)
                longest = max(longest, n)
            if cur_b:
                batches.append(cur_b)
        plan.extend(batches[i] for i in torch.randperm(len(batches), generator=g).tolist())
    return plan


@torch.no_grad()
def feature_norm(source, items: list[Item], max_len: int) -> float:
    """RMS over real tokens of |cat(aux)| on the first (up to) 16 samples: what fc's input scale is."""
    b = source.batch(items[:16], torch.device("cpu"), max_len)
    valid = torch.zeros(b.input_ids.shape, dtype=torch.bool)
    for i, it in enumerate(items[:16]):
        valid[i, :min(it.length, max_len)] = True
    sq = b.aux.cpu().float().pow(2).sum(-1)[valid]
    return float(sq.mean().sqrt())
