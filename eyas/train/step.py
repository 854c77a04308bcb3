"""One optimizer step and one held-out evaluation of the EAGLE-3 draft, and the statistics they report.

Data-parallel under torchrun: every rank plans the same global batches and takes samples [rank::world]; each
rank's loss is divided by the *global* valid-row count per TTT step, so summing gradients over ranks reproduces
the one-process gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, cast

import torch

from ..draft import DraftConfig, Eagle3Draft
from ..vocab import DraftVocab
from .config import Dist, TrainConfig, TrainError
from .sources import Item, plan_epoch
from .ttt import TTTOutput, step_counts, target_labels, ttt_forward

# ---- model, schedule -------------------------------------------------------------------

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


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    """Linear warmup then cosine to min_lr_ratio * lr; `step` counts from 0."""
    warm = max(1, round(cfg.warmup_ratio * total)) if cfg.warmup_ratio > 0 else 0
    if step < warm:
        return cfg.lr * (step + 1) / warm
    prog = (step - warm) / max(1, total - warm)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(prog, 1.0))))


def schedule_step(step: int, total: int, spent_s: float, max_time: float | None) -> int:
    """The step lr_at takes the rate at: `step`, or under a time budget the share of it spent (counted in the run's
    steps) when that is further along, so a run the budget ends early still warms up and anneals within it."""
    if not max_time:
        return step
    return max(step, int(total * spent_s / max_time))


# ---- one step ----------------------------------------------------------------------------------

@dataclass
class StepStats:
    """One optimizer step, over all ranks: the global loss, per TTT step the soft-CE sum, the rows whose
    top-1 was right and the valid rows, and the real (unpadded) tokens."""

    loss: float
    ce_sum: torch.Tensor  # [steps] float64
    correct: torch.Tensor  # [steps] float64
    count: torch.Tensor  # [steps] float64
    tokens: int

    @classmethod
    def zeros(cls, steps: int) -> StepStats:
        z = torch.zeros(steps, dtype=torch.float64)
        return cls(0.0, z, z.clone(), z.clone(), 0)

    @property
    def acc0(self) -> float:
        return float(self.correct[0] / max(float(self.count[0]), 1.0))

    def all_reduce(self, dd: Dist, device: torch.device) -> StepStats:
        """Sum over ranks, packed into one tensor so that it costs one reduction."""
        steps = self.ce_sum.numel()
        head = torch.tensor([self.loss, float(self.tokens)], dtype=torch.float64)
        flat = dd.sum_(torch.cat([head, self.ce_sum, self.correct, self.count]).to(device)).cpu()
        (loss, tokens), (ce, correct, count) = flat[:2].tolist(), flat[2:].split(steps)
        return StepStats(loss, ce, correct, count, int(tokens))


@dataclass
class Window:
    """Training statistics accumulated since the last evaluation (what its metrics line reports)."""

    correct: torch.Tensor  # [steps] float64
    count: torch.Tensor  # [steps] float64
    steps: int = 0
    loss_sum: float = 0.0
    tokens: int = 0
    seconds: float = 0.0

    @classmethod
    def empty(cls, ttt_steps: int) -> Window:
        return cls(torch.zeros(ttt_steps, dtype=torch.float64), torch.zeros(ttt_steps, dtype=torch.float64))

    def add(self, s: StepStats, seconds: float) -> None:
        self.correct += s.correct
        self.count += s.count
        self.steps += 1
        self.loss_sum += s.loss
        self.tokens += s.tokens
        self.seconds += seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    def metrics(self) -> dict[str, Any]:
        return {"train_loss": round(self.loss_sum / max(self.steps, 1), 5), "train_loss_steps": self.steps,
                "train_acc": [round(float(x), 5) for x in self.correct / self.count.clamp_min(1)]}


def train_step(draft: Eagle3Draft, opt: torch.optim.Optimizer, source, refs: list[Item], lr: float,
               cfg: TrainConfig, dd: Dist, device: torch.device, norm, head, autocast) -> StepStats:
    """One optimizer step on a global batch; this rank takes refs[rank::world]. Returns the step's
    statistics summed over ranks."""
    steps = cfg.ttt_steps
    params = list(draft.parameters())
    for g in opt.param_groups:
        g["lr"] = lr
    opt.zero_grad(set_to_none=False)
    stats = StepStats.zeros(steps)
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
        stats = StepStats(float(o.loss.detach()), o.step_loss_sum.double().cpu(), o.step_correct.double().cpu(),
                          o.step_count.double().cpu(), b.tokens)
    else:  # more ranks than samples in this batch: zero gradients, but join every reduction
        dd.sum_(torch.zeros(steps, dtype=torch.long, device=device))
    if dd.world > 1:  # sum (not average): each rank's loss is already divided by the global counts
        grads = [cast(torch.Tensor, p.grad) for p in params]  # never None: the loop allocates them up front
        flat = dd.sum_(torch.cat([grad.reshape(-1) for grad in grads]))
        off = 0
        for p, grad in zip(params, grads, strict=True):
            grad.copy_(flat[off:off + p.numel()].view_as(p))
            off += p.numel()
        stats = stats.all_reduce(dd, device)
    torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    opt.step()
    return stats


# ---- held-out evaluation ------------------------------------------------------------------------

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
