"""The draft's scores: its per-step accuracy and step-0 loss through ttt_forward (the training objective) on given
features, in right-padded length batches (score_draft), and on one candidate layout's captured streams
(score_layout); the draft readied for it (prepare_draft), its final-state-only view (EAGLE instead of EAGLE3) and
the most-frequent-token baseline."""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..draft import Eagle3Draft
from ..train.ttt import step_valid, ttt_forward
from .samples import EvalSample
from .streams import FreshStreams


def prepare_draft(draft: Eagle3Draft, target) -> Eagle3Draft:
    """The draft ready to score on the target: the target's embeddings when it carries none, on its device, in eval
    mode (in place; returned for chaining)."""
    if draft.embed_weight.numel() == 0:
        draft.set_embeddings(target.embed_tokens().weight)
    dev = target.device
    if draft.fc.weight.device != dev:
        draft.to(dev)
    draft.eval()
    return draft


def final_only_view(draft: Eagle3Draft) -> Eagle3Draft | None:
    """The draft as an engine running EAGLE (not EAGLE3) uses it: the 1xH final state skips fc. None when the
    draft's hidden differs from the target's (the engine would then apply a 3xH fc to a 1xH input: a crash)."""
    c = draft.config
    if c.hidden_size != c.target_hidden_size:
        return None
    view = copy.copy(draft)  # shares every parameter; only fc and the config differ
    view._modules = dict(draft._modules)
    view._modules["fc"] = _SkipFc(draft.fc.weight)
    if draft.fc_norm is not None:  # SGLang skips fc, and so the norms before it, when the width is hidden_size
        view._modules["fc_norm"] = None
    view.config = replace(c, num_aux=1)
    return view


class _SkipFc(nn.Module):
    """fc skipped (the feature is already hidden-wide); keeps a `weight` so callers can read its dtype."""

    def __init__(self, like: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", torch.empty(0, dtype=like.dtype, device=like.device), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


BATCH_TOKENS = 8192  # padded tokens per ttt_forward batch


def _batches(lengths: list[int], budget: int = BATCH_TOKENS) -> list[list[int]]:
    """Sample indices grouped by similar length so that (longest x count) stays within budget."""
    from ..data.capture import length_batches

    return length_batches(lengths, 1 << 30, budget)


def _pad(xs: list[torch.Tensor], S: int) -> torch.Tensor:
    """Right-pad [S_i, ...] tensors with zeros to [B, S, ...] (padding rows are masked out by loss_mask)."""
    out = xs[0].new_zeros((len(xs), S, *xs[0].shape[1:]))
    for b, x in enumerate(xs):
        out[b, :x.shape[0]] = x
    return out


def _entropy(p: torch.Tensor) -> torch.Tensor:
    return -(p * torch.log(p.clamp_min(1e-30))).sum(-1)


@torch.no_grad()
def score_draft(draft: Eagle3Draft, target, feats: list[torch.Tensor], finals: list[torch.Tensor],
                samples: list[EvalSample], steps: int, labels: list[Any] | None = None,
                want_logits: bool = False, want_rows: bool = False) -> dict[str, Any]:
    """Per-step correct/count of ttt_forward over samples (right-padded batches), also per sample
    ("sample_correct"/"sample_count" [samples][steps], for a standard error over conversations); with
    want_logits also the step-0 entropy of the draft's and the target's distributions over the draft
    vocab, as a share of log Vd; with want_rows (needs labels) the step-0 cross-entropy of every scored
    position, in a fixed order ("rows" [tokens] fp32; "loss" their mean)."""
    rows: list[torch.Tensor] = []
    per_correct = torch.zeros(len(samples), steps, dtype=torch.long)
    per_count = torch.zeros_like(per_correct)
    ent_d = ent_t = 0.0
    ent_n = 0
    dev = draft.fc.weight.device
    dtype = next(draft.parameters()).dtype
    for group in _batches([s.input_ids.numel() for s in samples]):
        S = max(samples[i].input_ids.numel() for i in group)
        aux = _pad([feats[i].to(dev, dtype) for i in group], S)
        fin = _pad([finals[i].to(dev).float() for i in group], S)
        ids = _pad([samples[i].input_ids.to(dev) for i in group], S)
        mask = _pad([samples[i].loss_mask.to(dev) for i in group], S)
        lab = None
        if labels is not None:
            lab = (_pad([labels[i][0][0] for i in group], S), _pad([labels[i][1][0] for i in group], S))
        o = ttt_forward(draft, aux, fin, ids, mask, target.final_norm(), target.lm_head(), steps,
                        labels=lab, return_logits=want_logits or want_rows)
        per_correct[group] = o.row_correct.cpu()
        per_count[group] = o.row_count.cpu()
        if want_rows and o.logits and lab is not None:
            valid = step_valid(mask, 1)[0]  # [B, S-1]
            ce = -(lab[0][:, 1:] * torch.log_softmax(o.logits[0].float(), -1)).sum(-1)  # [B, S-1]
            rows.append(ce[valid].cpu())
        if want_logits and o.logits and lab is not None:
            valid = step_valid(mask, 1)[0]  # [B, S-1]: row t scored against the target at t+1
            if valid.any():
                ent_d += float(_entropy(torch.softmax(o.logits[0][valid].float(), -1)).sum())
                ent_t += float(_entropy(lab[0][:, 1:][valid]).sum())
                ent_n += int(valid.sum())
    correct, count = per_correct.sum(0), per_count.sum(0)  # [steps]
    acc = [(int(c) / int(n)) if n else float("nan") for c, n in zip(correct, count, strict=True)]
    out: dict[str, Any] = {"correct": correct.tolist(), "count": count.tolist(), "acc": acc,
                           "sample_correct": per_correct.tolist(), "sample_count": per_count.tolist()}
    if want_rows:
        out["rows"] = torch.cat(rows) if rows else torch.zeros(0)
        out["loss"] = float(out["rows"].mean()) if out["rows"].numel() else float("nan")
    if want_logits:
        logv = math.log(max(draft.config.draft_vocab_size, 2))
        out["entropy_ratio"] = ent_d / ent_n / logv if ent_n else float("nan")
        out["target_entropy_ratio"] = ent_t / ent_n / logv if ent_n else float("nan")
    return out


@torch.no_grad()
def score_layout(draft: Eagle3Draft, target, samples: list[EvalSample], fresh: list[FreshStreams],
                 indices: list[int], subset: list[int]) -> dict[str, Any] | None:
    """score_draft at step 0, with the per-position losses ("rows", "loss"), of the draft fed one candidate layout
    on the samples in `subset`: the streams `indices` concatenated, or for [] the post-norm final state through
    the draft's final-only view; None when an engine would crash on that (final_only_view)."""
    if not indices:
        model = final_only_view(draft)
        if model is None:
            return None
        # the post-norm final state, as an engine running EAGLE passes it (what the target's head sees)
        feats = [target.final_norm()(fresh[i].final.float()) for i in subset]
    else:
        feats = [torch.cat([fresh[i].streams[k] for k in indices], dim=-1) for i in subset]
        model = draft
    return score_draft(model, target, feats, [fresh[i].final for i in subset], [samples[i] for i in subset], 1,
                       [fresh[i].labels for i in subset], want_rows=True)


def baseline_accuracy(samples: list[EvalSample], labels: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Step-0 accuracy of always proposing the most frequent target token (over the scored positions)."""
    tops = []
    for s, (_, top) in zip(samples, labels, strict=True):
        valid = step_valid(s.loss_mask.to(top.device)[None], 1)[0][0]  # rows t: label at t+1
        tops.append(top[0, 1:][valid].cpu())
    allt = torch.cat(tops) if tops else torch.zeros(0, dtype=torch.long)
    if allt.numel() == 0:
        return 0.0
    return float(torch.bincount(allt).max()) / allt.numel()
