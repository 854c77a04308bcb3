"""`eyas train`: the EAGLE-3 training loop over captured shards (or features captured on the fly).

One step = one global batch of whole samples (right-padded, at most --batch-tokens padded tokens) ->
ttt_forward -> AdamW (warmup + cosine, grad clip). Data-parallel under torchrun: every rank plans the same
global batches and takes samples [rank::world]; each rank's loss is divided by the *global* valid-row count
per TTT step, so summing gradients over ranks reproduces the one-process gradient.

OUT/ holds: checkpoint/ (draft + optimizer/RNG/cursor state, replaced atomically as one folder; what
--resume reads), draft/ (the draft alone, for serving/export), train_log.jsonl (one line per step),
metrics.jsonl (one line per eval), curves.png, run.json.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..data.shards import ShardSet, is_heldout
from ..draft import MANIFEST as DRAFT_MANIFEST
from ..draft import DraftConfig, Eagle3Draft, save_draft
from ..layout import Layout, check_layouts
from ..vocab import DraftVocab, count_tokens, end_token_ids, select_draft_vocab
from .ttt import STEP_DECAY, TTTOutput, step_counts, target_labels, ttt_forward

STATE_FILE = "trainer_state.json"
OPT_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"
KILL_ENV = "EYAS_TRAIN_KILL_AT_STEP"  # tests: SIGKILL this process right after the given step


class TrainError(ValueError):
    pass


@dataclass
class TrainConfig:
    data: list[str]
    out: str
    target: str | None = None  # default: the shards manifest's target_source
    online: bool = False
    num_samples: int | None = None  # online: conversations to read
    aux_indices: list[int] | None = None  # online: stream indices (default EAGLE-3)
    draft_vocab: int = 8192
    ttt_steps: int = 7
    epochs: float = 1.0
    max_steps: int | None = None
    lr: float = 1e-4
    warmup_ratio: float = 0.05
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    batch_tokens: int = 4096
    max_len: int = 2048
    bf16: bool = False
    seed: int = 0
    eval_every: int = 200
    save_every: int = 500
    heldout_pct: float = 5.0
    eval_samples: int = 256
    intermediate_size: int | None = None
    fc_init: str = "scaled"  # scaled | default (see init_draft)
    init_from: str | None = None  # warm start from this eyas draft (its weights and its draft vocabulary)
    refresh_vocab: bool = False  # with init_from: re-choose the draft vocab from this data (shared rows kept)
    device: str = "cpu"
    target_dtype: str = "fp32"  # online capture dtype
    resume: bool = False
    buffer_mb: int = 2048  # shard bytes held in memory at once (shuffling window)
    quiet: bool = False
    threads: int = 0  # torch CPU threads (0 = torch's default); on a busy CPU 1 can be several times faster

    # fields whose change breaks "resume gives the same run"
    TRAJECTORY = ("ttt_steps", "lr", "warmup_ratio", "min_lr_ratio", "weight_decay", "grad_clip", "batch_tokens",
                  "max_len", "bf16", "seed", "heldout_pct", "intermediate_size", "fc_init", "draft_vocab",
                  "online", "num_samples", "aux_indices", "buffer_mb", "init_from", "refresh_vocab")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---- distributed --------------------------------------------------------------------------------

@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t


def init_dist(device: str) -> tuple[Dist, torch.device]:
    """torchrun sets WORLD_SIZE/RANK/LOCAL_RANK; gloo on CPU, nccl on CUDA (one GPU per local rank)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    from ..target import resolve_device

    dev = resolve_device(device)
    if world <= 1:
        return Dist(), dev
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if dev.type == "cuda":
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
    return Dist(rank=rank, world=world, local_rank=local), dev


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

    def __init__(self, folders: list[str], heldout_pct: float, buffer_mb: int, max_len: int = 1 << 30):
        self.set = ShardSet(folders)  # refuses folders whose layouts differ, naming the fields
        self.layout = self.set.layout
        self.paths = self.set.shard_paths()
        self.bytes = [p.stat().st_size for p in self.paths]
        self.buffer = buffer_mb << 20
        self.tokens: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.train: list[Item] = []
        self.heldout: list[Item] = []
        self.skipped: dict[str, int] = {}
        for si, p in enumerate(self.paths):
            with safe_open(str(p), framework="pt") as f:
                off = f.get_tensor("offsets").tolist()
                rows = f.get_tensor("row_ids").tolist()
                ids, mask = f.get_tensor("input_ids").long(), f.get_tensor("loss_mask").bool()
            for i, row in enumerate(rows):
                a, b = off[i], off[i + 1]
                if not has_rows(mask[a:b], max_len):
                    self.skipped["no_loss_rows_within_max_len"] = self.skipped.get("no_loss_rows_within_max_len", 0) + 1
                    continue
                self.tokens[(si, i)] = (ids[a:b], mask[a:b])
                it = Item(key=(si, i), length=b - a, row_id=int(row))
                (self.heldout if is_heldout(int(row), heldout_pct) else self.train).append(it)
        self._cache: dict[int, dict[str, torch.Tensor]] = {}
        self._cache_order: list[int] = []

    def hash(self) -> str:
        return self.set.hash()

    def describe(self) -> dict[str, Any]:
        return {"kind": "shards", "folders": [str(f) for f in self.set.folders], "hash": self.hash(),
                "skipped": self.skipped,
                "target_source": self.set.manifests[0].get("target_source"),
                "config": self.set.manifests[0].get("config")}

    def groups(self) -> list[tuple[int, int]]:
        """(group id, bytes) per shard: the planner shuffles whole shards, then samples within windows."""
        return list(enumerate(self.bytes))

    def _shard(self, si: int) -> dict[str, torch.Tensor]:
        if si not in self._cache:
            while self._cache_order and sum(self.bytes[s] for s in self._cache_order) + self.bytes[si] > self.buffer:
                del self._cache[self._cache_order.pop(0)]
            with safe_open(str(self.paths[si]), framework="pt") as f:
                self._cache[si] = {k: f.get_tensor(k) for k in ("aux", "final", "offsets")}
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
                 aux_indices: list[int] | None):
        from ..data.conversations import load_conversations, tokenize_conversation  # another module; imported when used
        from ..target import stream_norms

        self.target = target
        convs, skipped = load_conversations(source, num)
        self.skipped = dict(skipped)
        self.tokens: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.train: list[Item] = []
        self.heldout: list[Item] = []
        import hashlib

        h = hashlib.sha256()
        for i, conv in enumerate(convs):
            ids, mask = tokenize_conversation(target.tokenizer, conv.messages, max_len)
            if not has_rows(mask, max_len):
                self.skipped["no_loss_rows_within_max_len"] = self.skipped.get("no_loss_rows_within_max_len", 0) + 1
                continue
            self.tokens[(-1, i)] = (ids.long(), mask.bool())
            h.update(ids.to(torch.int64).numpy().tobytes() + mask.to(torch.uint8).numpy().tobytes())
            it = Item(key=(-1, i), length=ids.numel(), row_id=int(conv.row_id))
            (self.heldout if is_heldout(int(conv.row_id), heldout_pct) else self.train).append(it)
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
        from ..target import capture

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


# ---- model, schedule, checkpoint -------------------------------------------------------------------

def init_draft(cfg: DraftConfig, vocab: DraftVocab, embed_weight: torch.Tensor, seed: int, fc_init: str,
               feat_norm: float | None = None) -> Eagle3Draft:
    """Build the draft deterministically from `seed`.

    fc_init 'scaled': the aux features are huge (SmolLM2 stream norms ~80-1100, one channel ~355) while the
    token embedding is ~3, so a default-initialised fc gives a residual h far larger than the attention/MLP
    outputs and the layer barely changes it. With fc ~ N(0, 1/|f|^2), |f| the RMS norm of the concatenated
    features measured on the data, each fc output element starts with RMS ~1, the scale the layer's own
    outputs have."""
    torch.manual_seed(seed)
    draft = Eagle3Draft(cfg)
    draft.set_vocab_map(vocab.ids)
    draft.set_embeddings(embed_weight)
    if fc_init == "scaled":
        if not feat_norm or not math.isfinite(feat_norm):
            raise TrainError(f"fc_init 'scaled' needs the features' measured norm, got {feat_norm}")
        with torch.no_grad():
            draft.fc.weight.normal_(0.0, 1.0 / feat_norm)
    elif fc_init != "default":
        raise TrainError(f"--fc-init {fc_init!r}: expected 'scaled' or 'default'")
    return draft


def warm_start(cfg: TrainConfig, layout: Layout, counts: torch.Tensor,
               fresh: DraftVocab | None = None) -> tuple[Eagle3Draft, DraftVocab]:
    """--init-from: the draft's fp32 weights and its draft vocabulary (so more data continues the same head);
    refused when its layout or shape does not fit these shards and options. fresh (--refresh-vocab): the
    vocabulary chosen from this data instead; lm_head rows of tokens in both are kept, rows of new tokens start
    at the mean of the old rows (an average logit), rows of dropped tokens go."""
    from ..draft import DraftError, load_draft

    try:
        ck = load_draft(cfg.init_from)
    except DraftError as e:
        raise TrainError(f"--init-from {cfg.init_from}: {e}") from e
    check_layouts(ck.layout, layout, f"the --init-from draft {cfg.init_from}", "the training data")
    d = ck.model
    if cfg.intermediate_size is not None and cfg.intermediate_size != d.config.intermediate_size:
        raise TrainError(f"--intermediate-size {cfg.intermediate_size} but the --init-from draft has "
                         f"{d.config.intermediate_size}; drop the flag or start from scratch")
    ids = d.target_token_ids().long().cpu()
    if fresh is not None:
        return _refresh_vocab(d, ids, fresh), fresh
    if cfg.draft_vocab != ids.numel():
        raise TrainError(f"--draft-vocab {cfg.draft_vocab} but the --init-from draft's vocabulary has {ids.numel()} "
                         f"tokens (a warm start keeps it); pass --draft-vocab {ids.numel()} or --refresh-vocab")
    old = ck.manifest.get("draft_vocab", {})
    vocab = DraftVocab(ids=ids, target_vocab_size=counts.numel(),
                       coverage=float(counts[ids].sum() / counts.sum().clamp_min(1)),
                       counted_tokens=int(counts.sum()), always=list(old.get("always_included", [])),
                       source_hash=old.get("source_dataset_hash", ""), requested_size=ids.numel())
    d.requires_grad_(True)
    return d.float().train(), vocab


def _refresh_vocab(d: Eagle3Draft, old_ids: torch.Tensor, fresh: DraftVocab) -> Eagle3Draft:
    from dataclasses import replace

    new = Eagle3Draft(replace(d.config, draft_vocab_size=fresh.size))
    state = {k: v for k, v in d.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
    missing, unexpected = new.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight", "d2t", "t2d"}:
        raise TrainError(f"--refresh-vocab: cannot carry the draft's weights over (missing {missing}, "
                         f"unexpected {unexpected})")
    W = d.lm_head.weight.detach().float()  # [Vd_old, H]
    row = {int(t): i for i, t in enumerate(old_ids.tolist())}
    Wn = W.mean(0, keepdim=True).repeat(fresh.size, 1)  # [Vd_new, H]
    keep = [(j, row[int(t)]) for j, t in enumerate(fresh.ids.tolist()) if int(t) in row]
    if keep:
        dst, src = (torch.tensor(x) for x in zip(*keep, strict=True))
        Wn[dst] = W[src]
    with torch.no_grad():
        new.lm_head.weight.copy_(Wn)
    new.set_vocab_map(fresh.ids)
    new.requires_grad_(True)
    return new.float().train()


@torch.no_grad()
def feature_norm(source, items: list[Item], max_len: int) -> float:
    """RMS over real tokens of |cat(aux)| on the first (up to) 16 samples: what fc's input scale is."""
    b = source.batch(items[:16], torch.device("cpu"), max_len)
    valid = torch.zeros(b.input_ids.shape, dtype=torch.bool)
    for i, it in enumerate(items[:16]):
        valid[i, :min(it.length, max_len)] = True
    sq = b.aux.cpu().float().pow(2).sum(-1)[valid]
    return float(sq.mean().sqrt())


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    """Linear warmup then cosine to min_lr_ratio * lr; `step` counts from 0."""
    warm = max(1, round(cfg.warmup_ratio * total)) if cfg.warmup_ratio > 0 else 0
    if step < warm:
        return cfg.lr * (step + 1) / warm
    prog = (step - warm) / max(1, total - warm)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(prog, 1.0))))


def save_optimizer(opt: torch.optim.Optimizer, path: Path) -> dict[str, Any]:
    """Optimizer tensors -> safetensors; hyper-parameters -> returned JSON-able dict. Never pickle."""
    sd = opt.state_dict()
    tensors = {f"state.{i}.{k}": v.detach().cpu().contiguous() for i, st in sd["state"].items()
               for k, v in st.items() if torch.is_tensor(v)}
    save_file(tensors or {"empty": torch.zeros(0)}, str(path))
    return {"param_groups": sd["param_groups"]}


def load_optimizer(opt: torch.optim.Optimizer, path: Path, meta: dict[str, Any]) -> None:
    t = load_file(str(path))
    state: dict[int, dict[str, torch.Tensor]] = {}
    for k, v in t.items():
        if k == "empty":
            continue
        _, i, name = k.split(".", 2)
        state.setdefault(int(i), {})[name] = v
    groups = meta["param_groups"]
    for g in groups:
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
    opt.load_state_dict({"state": state, "param_groups": groups})


def rng_tensors() -> dict[str, torch.Tensor]:
    out = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"cuda.{i}"] = s
    return out


def set_rng(t: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(t["torch"])
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            if f"cuda.{i}" in t:
                torch.cuda.set_rng_state(t[f"cuda.{i}"], i)


def _ckpt_dir(out: Path) -> Path | None:
    """The committed checkpoint; recovers from a kill between the two renames of a save."""
    ck, new, old = out / "checkpoint", out / "checkpoint.new", out / "checkpoint.old"
    if (ck / STATE_FILE).exists():
        return ck
    if (new / STATE_FILE).exists():
        return new
    if (old / STATE_FILE).exists():
        return old
    return None


def save_checkpoint(out: Path, draft: Eagle3Draft, layout: Layout, extra: dict[str, Any],
                    opt: torch.optim.Optimizer, state: dict[str, Any]) -> Path:
    """Draft + optimizer + RNG + cursor in one folder, swapped in atomically (trainer_state.json last)."""
    new, ck, old = out / "checkpoint.new", out / "checkpoint", out / "checkpoint.old"
    save_draft(new, draft, layout, extra=extra)
    state = dict(state, optimizer=save_optimizer(opt, new / OPT_FILE))
    save_file(rng_tensors(), str(new / RNG_FILE))
    tmp = new / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state, indent=2, default=str))
    os.replace(tmp, new / STATE_FILE)
    if old.exists():
        shutil.rmtree(old)
    if ck.exists():
        os.replace(ck, old)
    os.replace(new, ck)
    if old.exists():
        shutil.rmtree(old)
    return ck


def _truncate_jsonl(path: Path, step: int) -> None:
    """Drop lines logged after `step` (they belong to the killed tail of the run)."""
    if not path.exists():
        return
    keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(ln + "\n" for ln in keep))
    os.replace(tmp, path)


# ---- eval + rendering -----------------------------------------------------------------------------

@torch.no_grad()
def evaluate(draft: Eagle3Draft, source, items: list[Item], target, cfg: TrainConfig, dd: Dist,
             device: torch.device) -> dict[str, Any]:
    """Held-out loss and accuracy per TTT step (fp32: the numbers acceptance follows)."""
    steps = cfg.ttt_steps
    sums = torch.zeros(3 * steps, dtype=torch.float64, device=device)  # loss_sum, correct, count
    mine = items[dd.rank::dd.world]
    was = draft.training
    draft.eval()
    for batch_items in plan_epoch(mine, [(-1, 0)], 0, 0, cfg.batch_tokens, cfg.max_len, 1 << 62):
        b = source.batch([mine[i] for i in batch_items], device, cfg.max_len)
        o = ttt_forward(draft, b.aux, b.final, b.input_ids, b.loss_mask, target.final_norm(), target.lm_head(),
                        steps)
        sums += torch.cat([o.step_loss_sum, o.step_correct.float(), o.step_count.float()]).double()
    draft.train(was)
    dd.sum_(sums)
    loss_sum, correct, count = sums.view(3, steps).cpu()
    return {"heldout_loss": [round(float(x), 5) for x in loss_sum / count.clamp_min(1)],
            "heldout_acc": [round(float(x), 5) for x in correct / count.clamp_min(1)],
            "heldout_rows": [int(x) for x in count]}


def metrics_table(m: dict[str, Any], title: str):
    from rich.table import Table

    tab = Table(title=title)
    tab.add_column("TTT step", justify="right")
    tab.add_column("held-out loss", justify="right")
    tab.add_column("held-out acc", justify="right")
    tab.add_column("train acc", justify="right")
    tr = m.get("train_acc") or []
    for j, (lo, ac) in enumerate(zip(m["heldout_loss"], m["heldout_acc"], strict=True)):
        tab.add_row(str(j), f"{lo:.4f}", f"{ac:.4f}", f"{tr[j]:.4f}" if j < len(tr) else "-")
    return tab


def write_curves(metrics_path: Path, log_path: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evals = [json.loads(ln) for ln in metrics_path.read_text().splitlines() if ln.strip()] \
        if metrics_path.exists() else []
    log = [json.loads(ln) for ln in log_path.read_text().splitlines() if ln.strip()] if log_path.exists() else []
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    if log:
        a1.plot([r["step"] for r in log], [r["loss"] for r in log], lw=0.6, alpha=0.6, label="train loss")
    if evals:
        a1.plot([e["step"] for e in evals], [sum(STEP_DECAY ** j * x for j, x in enumerate(e["heldout_loss"]))
                                             for e in evals], "o-", label="held-out loss")
        for j in range(len(evals[0]["heldout_acc"])):
            a2.plot([e["step"] for e in evals], [e["heldout_acc"][j] for e in evals], "o-", ms=3, label=f"step {j}")
    a1.set_xlabel("optimizer step")
    a1.set_title("loss (sum over TTT steps of 0.8^j x soft CE)")
    a1.legend()
    a2.set_xlabel("optimizer step")
    a2.set_title("held-out accuracy per TTT step")
    a2.set_ylim(0, 1)
    a2.legend(fontsize=7)
    fig.tight_layout()
    tmp = png.with_name(png.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, png)


# ---- the run --------------------------------------------------------------------------------------

def train_step(draft: Eagle3Draft, opt: torch.optim.Optimizer, source, refs: list[Item], lr: float,
               cfg: TrainConfig, dd: Dist, device: torch.device, norm, head, autocast) -> torch.Tensor:
    """One optimizer step on a global batch; this rank takes refs[rank::world]. Returns the global stats
    [loss, ce_sum x steps, correct x steps, count x steps, tokens] (float64, CPU)."""
    steps = cfg.ttt_steps
    params = list(draft.parameters())
    for g in opt.param_groups:
        g["lr"] = lr
    opt.zero_grad(set_to_none=False)
    stats = torch.zeros(2 + 3 * steps, dtype=torch.float64)
    mine = refs[dd.rank::dd.world]
    if mine:
        b = source.batch(mine, device, cfg.max_len)
        denom = dd.sum_(step_counts(b.loss_mask, steps).to(device))  # global valid rows per TTT step
        # draft-vocab head rows only: the loss is unchanged; the training-batch accuracy counts the target's
        # top token within the draft vocab (held-out evaluation uses the full-vocab argmax)
        labels = target_labels(b.final, norm, head, draft.target_token_ids(), full_argmax=False)
        with autocast:
            o: TTTOutput = ttt_forward(draft, b.aux, b.final, b.input_ids, b.loss_mask, norm, head, steps,
                                       denom=denom, labels=labels)
        o.loss.backward()
        stats[0] = float(o.loss.detach())
        stats[1:1 + steps] = o.step_loss_sum.double().cpu()
        stats[1 + steps:1 + 2 * steps] = o.step_correct.double().cpu()
        stats[1 + 2 * steps:1 + 3 * steps] = o.step_count.double().cpu()
        stats[-1] = b.tokens
    else:  # more ranks than samples in this batch: zero gradients, but join every reduction
        dd.sum_(torch.zeros(steps, dtype=torch.long, device=device))
    if dd.world > 1:  # sum (not average): each rank's loss is already divided by the global counts
        flat = dd.sum_(torch.cat([p.grad.reshape(-1) for p in params]))
        off = 0
        for p in params:
            p.grad.copy_(flat[off:off + p.numel()].view_as(p))
            off += p.numel()
        stats = dd.sum_(stats.to(device)).cpu()
    torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    opt.step()
    return stats


@dataclass
class TrainResult:
    out: Path
    step: int
    losses: list[float] = field(default_factory=list)  # per step, this process's view (global loss)
    final_metrics: dict[str, Any] | None = None
    tokens_per_s: float = 0.0
    vocab: DraftVocab | None = None
    draft: Eagle3Draft | None = None


def _check_resume(ck: Path, cfg: TrainConfig, layout: Layout, vocab: DraftVocab, data_hash: str) -> dict[str, Any]:
    """Refuse a checkpoint made for other data/target/vocab or with another trajectory; name each field."""
    man = json.loads((ck / DRAFT_MANIFEST).read_text())
    state = json.loads((ck / STATE_FILE).read_text())
    check_layouts(Layout.from_dict(man["layout"]), layout, f"the checkpoint {ck}", "the training data")
    problems = []
    dv = man.get("draft_vocab", {})
    if dv.get("hash") != vocab.hash:
        problems.append(f"draft vocab: the checkpoint has {dv.get('hash')} (size {dv.get('size')}, counted on "
                        f"data {dv.get('source_dataset_hash')}), the data gives {vocab.hash} (size {vocab.size}, "
                        f"data {vocab.source_hash})")
    if man.get("data", {}).get("hash") != data_hash:
        problems.append(f"data hash: the checkpoint was trained on {man.get('data', {}).get('hash')}, "
                        f"--data is {data_hash}")
    old = state.get("config", {})
    for name in TrainConfig.TRAJECTORY:
        a, b = old.get(name), getattr(cfg, name)
        if a != b and not (isinstance(a, list) and b is not None and list(b) == a):
            problems.append(f"--{name.replace('_', '-')}: the checkpoint used {a!r}, this run {b!r}")
    if problems:
        raise TrainError(f"refusing to resume from {ck}:\n  - " + "\n  - ".join(problems) +
                         "\n  fix: resume with the original data and options, or train into a new --out")
    return state


def _load_target(cfg: TrainConfig, source_desc: dict[str, Any] | None):
    from ..target import load_target

    spec = cfg.target or (source_desc or {}).get("target_source")
    if not spec:
        raise TrainError("the shards' manifest names no target_source; pass --target (the model the shards "
                         "were captured from)")
    return load_target(spec, dtype=cfg.target_dtype if cfg.online else "fp32", device=cfg.device)


def train(cfg: TrainConfig, target=None) -> TrainResult:
    """Run (or resume) a training job. `target`: an already loaded eyas Target (tests); else loaded from
    --target or the shards manifest."""
    prev = torch.get_num_threads()
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    try:
        return _train(cfg, target)
    finally:
        torch.set_num_threads(prev)


def _train(cfg: TrainConfig, target) -> TrainResult:
    dd, device = init_dist(cfg.device)
    if cfg.ttt_steps < 1:
        raise TrainError(f"--ttt-steps must be >= 1, got {cfg.ttt_steps}")
    if cfg.batch_tokens < cfg.max_len:
        raise TrainError(f"--batch-tokens {cfg.batch_tokens} < --max-len {cfg.max_len}: a full-length sample "
                         "would not fit one batch; raise --batch-tokens or lower --max-len")
    out = Path(cfg.out)
    t_setup = time.perf_counter()

    # data + target (each rank reads the same data and derives the same plan and vocab)
    if cfg.online:
        if target is None:
            target = _load_target(cfg, None)
        if len(cfg.data) != 1:
            raise TrainError(f"--online takes one conversation source in --data, got {cfg.data}")
        source = OnlineSource(target, cfg.data[0], cfg.num_samples, cfg.max_len, cfg.heldout_pct, cfg.aux_indices)
    else:
        source = ShardSource(cfg.data, cfg.heldout_pct, cfg.buffer_mb, cfg.max_len)
        if target is None:
            target = _load_target(cfg, source.describe())
        check_layouts(source.layout, target.default_layout(source.layout.aux_indices), "the shards",
                      f"the target {target.source!r}")
    layout = source.layout
    if not source.train:
        raise TrainError(f"no training samples in {cfg.data} (after the {cfg.heldout_pct}% held-out split)")
    heldout = source.heldout[:cfg.eval_samples] if cfg.eval_samples > 0 else source.heldout
    if not heldout and cfg.heldout_pct > 0:
        raise TrainError(f"the {cfg.heldout_pct}% held-out split of {len(source.train)} samples is empty; raise "
                         "--heldout-pct or add data (or pass --heldout-pct 0 to train without evaluation)")
    data_hash = source.hash()

    # draft vocab from this run's data (never cached), or the warm-start draft's own
    V = target.identity.vocab_size
    counts = count_tokens(source.token_pairs(source.train), V)
    emb = target.embed_tokens().weight.detach().to(device=device, dtype=torch.float32)
    fnorm = feature_norm(source, source.train, cfg.max_len) if cfg.fc_init == "scaled" else None
    if cfg.refresh_vocab and not cfg.init_from:
        raise TrainError("--refresh-vocab re-chooses a warm-started draft's vocabulary: pass --init-from DRAFT too")
    if cfg.init_from:
        fresh = None
        if cfg.refresh_vocab:
            fresh = select_draft_vocab(counts, min(cfg.draft_vocab, V), end_token_ids(target.tokenizer), data_hash)
            fresh.requested_size = cfg.draft_vocab
        draft, vocab = warm_start(cfg, layout, counts, fresh)
        dcfg = draft.config
        draft = draft.to(device)
    else:
        vocab = select_draft_vocab(counts, min(cfg.draft_vocab, V), end_token_ids(target.tokenizer), data_hash)
        vocab.requested_size = cfg.draft_vocab
        dcfg = DraftConfig.from_target_config(target.config, draft_vocab_size=vocab.size, num_aux=layout.num_aux,
                                              intermediate_size=cfg.intermediate_size)
        draft = init_draft(dcfg, vocab, emb, cfg.seed, cfg.fc_init, fnorm).to(device)
    draft.set_embeddings(emb)
    if dd.world > 1:  # identical start on every rank (same seed already; broadcast makes it certain)
        for p in draft.parameters():
            dist.broadcast(p.data, 0)
    decay = [p for n, p in draft.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in draft.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)

    groups = source.groups()
    buffer_bytes = cfg.buffer_mb << 20

    def plan(ep: int) -> list[list[int]]:
        return plan_epoch(source.train, groups, cfg.seed, ep, cfg.batch_tokens, cfg.max_len, buffer_bytes)

    steps_per_epoch = len(plan(0))
    total = cfg.max_steps if cfg.max_steps else max(1, math.ceil(cfg.epochs * steps_per_epoch))

    # resume
    step, epoch, bi, tokens_seen, train_time = 0, 0, 0, 0, 0.0
    resumed_metrics = None
    ck = _ckpt_dir(out)
    if ck is not None and not cfg.resume:
        raise TrainError(f"{out} already holds a training checkpoint ({ck}); pass --resume to continue it or "
                         "choose another --out")
    if cfg.resume and ck is not None:
        state = _check_resume(ck, cfg, layout, vocab, data_hash)
        sd = load_file(str(ck / "model.safetensors"))
        draft.load_state_dict({k: v.to(device) for k, v in sd.items()})
        load_optimizer(opt, ck / OPT_FILE, state["optimizer"])
        set_rng(load_file(str(ck / RNG_FILE)))
        step, epoch, bi = state["step"], state["epoch"], state["batch_in_epoch"]
        tokens_seen, train_time = state["tokens_seen"], state["train_time_s"]
        resumed_metrics = json.loads((ck / DRAFT_MANIFEST).read_text()).get("metrics")
        if dd.main:
            _truncate_jsonl(out / "train_log.jsonl", step)
            _truncate_jsonl(out / "metrics.jsonl", step)
    else:
        if cfg.resume and dd.main and not cfg.quiet:
            print(f"--resume: no checkpoint in {out}; starting a new run")
        if dd.main:  # logs of a run killed before its first checkpoint belong to no checkpoint
            _truncate_jsonl(out / "train_log.jsonl", 0)
            _truncate_jsonl(out / "metrics.jsonl", 0)
    if dd.main:
        out.mkdir(parents=True, exist_ok=True)
        run = {"config": cfg.to_dict(), "command": sys.argv, "world_size": dd.world, "data": source.describe(),
               "draft_vocab": vocab.to_manifest(), "draft_config": dcfg.to_dict(), "total_steps": total,
               "steps_per_epoch": steps_per_epoch, "train_samples": len(source.train),
               "heldout_samples": len(heldout), "feature_norm": fnorm}
        (out / "run.json").write_text(json.dumps(run, indent=2, default=str))

    norm, head = target.final_norm(), target.lm_head()
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16)
    kill_at = int(os.environ.get(KILL_ENV, "0") or 0)
    steps = cfg.ttt_steps
    for p in draft.parameters():  # real zero grads from the start: a rank without samples still all-reduces
        p.grad = torch.zeros_like(p)
    losses: list[float] = []
    last_eval: dict[str, Any] | None = resumed_metrics
    win = torch.zeros(1 + 3 * steps, dtype=torch.float64)  # loss sum over steps, ce sums, correct, count
    win_steps, win_tokens, win_time = 0, 0, 0.0

    def manifest_extra(metrics: dict[str, Any] | None) -> dict[str, Any]:
        return {"target": {**target.identity.to_dict(), "source": target.source},
                "draft_vocab": vocab.to_manifest(), "training": {**cfg.to_dict(), "feature_norm": fnorm},
                "data": {**source.describe(), "train_samples": len(source.train), "heldout_samples": len(heldout)},
                "metrics": metrics, "step": step, "total_steps": total, "tokens_seen": tokens_seen,
                "training_time_s": round(train_time, 2), "command": " ".join(sys.argv), "world_size": dd.world,
                "versions": {"torch": torch.__version__}}

    def save() -> None:
        if not dd.main:
            return
        extra = manifest_extra(last_eval)
        save_checkpoint(out, draft, layout, extra, opt,
                        {"step": step, "epoch": epoch, "batch_in_epoch": bi, "tokens_seen": tokens_seen,
                         "train_time_s": train_time, "config": cfg.to_dict(), "world_size": dd.world})
        save_draft(out / "draft", draft, layout, extra=extra)

    def run_eval() -> dict[str, Any] | None:
        nonlocal win, win_steps, win_tokens, win_time
        if not heldout:
            return None
        m = evaluate(draft, source, heldout, target, cfg, dd, device)
        w = win.view(-1)
        cnt = w[1 + 2 * steps:].clamp_min(1)
        m = {"step": step, "epoch": epoch, "tokens_seen": tokens_seen,
             "train_loss": round(float(w[0] / max(win_steps, 1)), 5),
             "train_acc": [round(float(x), 5) for x in w[1 + steps:1 + 2 * steps] / cnt],
             **m, "tokens_per_s": round(win_tokens / max(win_time, 1e-9), 1), "lr": lr_at(max(step - 1, 0), total, cfg),
             "elapsed_s": round(train_time, 2)}
        win, win_steps, win_tokens, win_time = torch.zeros_like(win), 0, 0, 0.0
        if dd.main:
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(m) + "\n")
        return m

    progress = None
    if dd.main and not cfg.quiet:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        progress = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                            TextColumn("{task.fields[info]}"))
        progress.start()
        task = progress.add_task("train", total=total, completed=step, info="")
        progress.console.print(
            f"[bold]eyas train[/]: {len(source.train)} train / {len(heldout)} held-out samples, "
            f"{steps_per_epoch} steps/epoch, {total} steps, draft vocab {vocab.size} (coverage "
            f"{vocab.coverage:.3f}), TTT {steps}, world {dd.world}, setup {time.perf_counter() - t_setup:.1f}s"
            + (f", skipped {source.skipped}" if source.skipped else ""))
    if step == 0 and cfg.init_from:  # where the warm-started draft stands on this held-out set before training
        m0 = run_eval()
        if m0 is not None and progress is not None:
            progress.console.print(metrics_table(m0, f"step 0 (--init-from {cfg.init_from})"))
    draft.train()
    cur_plan = plan(epoch)
    try:
        while step < total:
            if bi >= len(cur_plan):
                epoch, bi = epoch + 1, 0
                cur_plan = plan(epoch)
                continue
            t0 = time.perf_counter()
            refs = [source.train[i] for i in cur_plan[bi]]
            bi += 1
            lr = lr_at(step, total, cfg)
            stats = train_step(draft, opt, source, refs, lr, cfg, dd, device, norm, head, autocast)
            step += 1
            dt = time.perf_counter() - t0
            train_time += dt
            tokens_seen += int(stats[-1])
            loss = float(stats[0])
            losses.append(loss)
            win[:1 + 3 * steps] += stats[:1 + 3 * steps]
            win_steps, win_tokens, win_time = win_steps + 1, win_tokens + int(stats[-1]), win_time + dt
            if dd.main:
                acc0 = float(stats[1 + steps] / max(float(stats[1 + 2 * steps]), 1.0))
                with open(out / "train_log.jsonl", "a") as f:
                    f.write(json.dumps({"step": step, "loss": loss, "acc0": round(acc0, 5), "lr": lr,
                                        "tokens": int(stats[-1])}) + "\n")
                if progress is not None:
                    tps = win_tokens / max(win_time, 1e-9)
                    progress.update(task, completed=step, info=f"loss {loss:.3f}  acc0 {acc0:.3f}  {tps:.0f} tok/s")
            if (cfg.eval_every and step % cfg.eval_every == 0) or step == total:
                m = run_eval()
                if m is not None:
                    last_eval = m
                    if progress is not None:
                        progress.console.print(metrics_table(m, f"step {step}/{total}  epoch {epoch}  "
                                                                f"train loss {m['train_loss']:.4f}  "
                                                                f"{m['tokens_per_s']:.0f} tok/s"))
            if (cfg.save_every and step % cfg.save_every == 0) or step == total:
                save()
            if kill_at and step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
    finally:
        if progress is not None:
            progress.stop()
    if dd.main:
        write_curves(out / "metrics.jsonl", out / "train_log.jsonl", out / "curves.png")
        if not cfg.quiet:
            from rich.console import Console

            con = Console()
            tps = tokens_seen / max(train_time, 1e-9)
            con.print(f"[bold green]done[/]: {step} steps, {tokens_seen} tokens in {train_time:.1f}s of training "
                      f"({tps:.0f} tok/s), draft -> {out / 'draft'}, curves -> {out / 'curves.png'}")
            if last_eval:
                con.print(metrics_table(last_eval, "final held-out metrics"))
    return TrainResult(out=out, step=step, losses=losses, final_metrics=last_eval,
                       tokens_per_s=tokens_seen / max(train_time, 1e-9), vocab=vocab, draft=draft)


def config_from_kwargs(**kw) -> TrainConfig:
    names = {f.name for f in fields(TrainConfig)}
    unknown = set(kw) - names
    if unknown:
        raise TrainError(f"unknown training options {sorted(unknown)}")
    return TrainConfig(**kw)
