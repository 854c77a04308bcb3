"""`eyas train` options (TrainConfig), its error class, and the data-parallel process group under torchrun."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..errors import EyasError

STATE_FILE = "trainer_state.json"
OPT_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"


class TrainError(EyasError):
    pass


@dataclass
class TrainConfig:
    data: list[str]
    out: str
    target: str | None = None  # default: the shards manifest's target_source
    online: bool = False
    num_samples: int | None = None  # online: conversations to read
    data_tokens: list[int] | None = None  # shards: per --data folder, at most this many training tokens (0 = all)
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
    replay_k: int = 3  # each eval also replays a served chain of k on held-out replies (0 = off): eyas.replay.heldout
    replay_samples: int = 16  # held-out samples that replay uses
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
    chat_template: str | None = None  # online: --chat-template FILE|NAME (shards record their own)
    raw: bool = False  # online: rows as plain text, no template (base models; shards record their own)

    # fields whose change breaks "resume gives the same run"
    TRAJECTORY = ("ttt_steps", "lr", "warmup_ratio", "min_lr_ratio", "weight_decay", "grad_clip", "batch_tokens",
                  "max_len", "bf16", "seed", "heldout_pct", "intermediate_size", "fc_init", "draft_vocab",
                  "online", "num_samples", "data_tokens", "aux_indices", "buffer_mb", "init_from", "refresh_vocab",
                  "chat_template", "raw")

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
    from ..target.device import resolve_device

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
