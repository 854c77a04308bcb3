"""`eyas train` options (TrainConfig), its error class, and the data-parallel process group under torchrun."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..errors import EyasError
from ..option import DEVICE_HELP, option

STATE_FILE = "trainer_state.json"
OPT_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"


class TrainError(EyasError):
    pass


@dataclass
class TrainConfig:
    """The options of `eyas train`: each field declared with `option` is its flag, help and default."""

    data: list[str]  # --data: shard folder(s); with --online a conversation source
    out: str  # --out: OUT/draft, OUT/checkpoint, metrics, curves
    target: str | None = None  # --target; default: the shards manifest's target_source (online: smollm2-135m)
    online: bool = option("--online", "capture features on the fly from conversations", False)
    num_samples: int | None = option("--num-samples", "online: conversations to read")
    data_tokens: list[int] | None = None  # --data-tokens: per --data folder, at most this many training tokens
    aux_indices: list[int] | None = None  # --aux-indices, online: stream indices (default EAGLE-3)
    draft_vocab: int = option("--draft-vocab", "draft vocabulary size (clamped to the target's)", 8192)
    ttt_steps: int = option("--ttt-steps", "training-time-test steps (the draft's own tokens fed back)", 7)
    epochs: float = option("--epochs", "passes over the training samples", 1.0)
    max_steps: int | None = option("--max-steps", "optimizer steps (overrides --epochs)")
    # a time budget: the step that uses it up is the run's last (evaluated and saved); the learning rate anneals by
    # the share of the budget spent when that is ahead of the steps (eyas.train.step.schedule_step)
    max_time: float | None = option("--max-time", "seconds of training steps, then the run ends as if at its last "
                                    "step; the learning rate anneals within them (with --epochs or --max-steps: "
                                    "whichever ends first)")
    lr: float = option("--lr", "peak learning rate", 1e-4)
    warmup_ratio: float = option("--warmup-ratio", "share of the steps warming the learning rate up", 0.05)
    min_lr_ratio: float = 0.0
    weight_decay: float = option("--weight-decay", "AdamW weight decay", 0.0)
    grad_clip: float = option("--grad-clip", "gradient norm clip", 0.5)
    batch_tokens: int = option("--batch-tokens", "padded tokens per global batch", 4096)
    max_len: int = option("--max-len", "samples are cut to this many tokens", 2048)
    bf16: bool = option("--bf16", "bf16 autocast for the draft (CPU and CUDA)", False)
    seed: int = option("--seed", "data order and initialisation seed", 0)
    eval_every: int = option("--eval-every", "steps between held-out evaluations", 200)
    save_every: int = option("--save-every", "steps between checkpoints", 500)
    heldout_pct: float = option("--heldout-pct", "held-out share of the samples, by row id", 5.0)
    eval_samples: int = option("--eval-samples", "held-out samples per eval (0 = all)", 256)
    # each eval also replays a served chain of k on held-out replies (0 = off): eyas.replay.heldout
    replay_k: int = option("--replay-k", "each eval replays a served chain of k (vLLM's num_speculative_tokens) on "
                           "held-out replies and logs its τ (0 = off)", 3)
    replay_samples: int = option("--replay-samples", "held-out samples the replay uses", 16)
    intermediate_size: int | None = option("--intermediate-size", "draft MLP width (default: the target's)")
    fc_init: str = option("--fc-init", "scaled (by the layout's stream norms) | default", "scaled")
    # EAGLE 3.1: eyas/draft.py Eagle3Draft.fuse; exports write "fc_norm": true and fc_norm.{i}.weight
    fc_norm: bool = option("--fc-norm", "EAGLE 3.1: an RMSNorm per aux state before fc (served by vLLM >= 0.32; "
                           "SGLang as verified ignores it)", False)
    init_from: str | None = option("--init-from", "warm start from an eyas draft (keeps its vocabulary): continue a "
                                   "shipped draft on more data")
    refresh_vocab: bool = option("--refresh-vocab", "with --init-from: re-choose the draft vocabulary from this data "
                                 "(rows of kept tokens carried over)", False)
    device: str = option("--device", DEVICE_HELP, "cpu")
    target_dtype: str = option("--dtype", "online: target dtype for capture", "fp32")
    resume: bool = option("--resume", "continue from OUT/checkpoint", False)
    buffer_mb: int = 2048  # shard bytes held in memory at once (shuffling window)
    quiet: bool = option("--quiet", "no progress bar or tables", False)
    threads: int = option("--threads", "CPU threads (0 = torch default; 1 is faster on a busy CPU)", 0)
    chat_template: str | None = option("--chat-template", "--online: Jinja FILE or built-in NAME (chatml | gemma | "
                                       "llama3); shards record the template they were rendered with")
    raw: bool = option("--raw", "--online: rows as plain text, no chat template (base models; every token but a BOS "
                       "is a loss token, like `datagen --raw --no-regenerate`)", False)

    # fields whose change breaks "resume gives the same run"
    TRAJECTORY = ("ttt_steps", "lr", "warmup_ratio", "min_lr_ratio", "weight_decay", "grad_clip", "batch_tokens",
                  "max_len", "bf16", "seed", "heldout_pct", "intermediate_size", "fc_init", "fc_norm", "draft_vocab",
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
