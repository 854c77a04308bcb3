"""EAGLE-3 training-time test (TTT): the unrolled draft forward, its loss and per-step accuracy.

Alignment (docs/CONTRACTS.md, "Draft alignment"; the engine does the same at inference):
sample tokens x_0..x_{S-1}, features f_t = aux[t], target logits at t from final[t] (they predict x_{t+1}).
Step j, row t: hidden = fc(f_t) at j = 0, else the draft layer output of step j-1 at row t (no fc);
input token x_{t+1+j}; RoPE position t+j; label = the target distribution at t+1+j (predicts x_{t+2+j});
valid when t+2+j < S and loss_mask[t+2+j]. Attention at step j: the step-0 keys of rows 0..t (causal)
plus the step-1..j keys of row t itself, which is the flattened tree-path mask of a chain.

Rows that can never have an input token are dropped: step j runs rows 0..S-2-j (S_j = S-1-j rows), so
every row carries a real token and nothing beyond the sample is ever attended to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ..draft import Eagle3Draft
from ..errors import EyasError

STEP_DECAY = 0.8  # step j weighs 0.8**j (EAGLE-3)
TARGET_CHUNK_BYTES = 256 << 20  # fp32 full-vocab logits computed this many bytes at a time


class TTTError(EyasError):
    pass


@dataclass
class TTTOutput:
    loss: torch.Tensor  # scalar, differentiable: sum_j 0.8^j * (sum of valid CE at step j) / denom_j
    step_loss: torch.Tensor  # [steps] mean soft CE per step over its valid rows (detached; 0 where none)
    step_correct: torch.Tensor  # [steps] long: draft argmax (as target id) == target full-vocab argmax
    step_count: torch.Tensor  # [steps] long: valid rows per step
    # required (ttt_forward always sets them), keyword-only so that they may follow logits' default
    step_loss_sum: torch.Tensor = field(kw_only=True)  # [steps] summed CE per step (detached), for exact aggregation
    logits: list[torch.Tensor] = field(default_factory=list)  # per step [B, S_j, Vd] when return_logits
    row_correct: torch.Tensor = field(kw_only=True)  # [B, steps] long: step_correct per batch row (per conversation)
    row_count: torch.Tensor = field(kw_only=True)  # [B, steps] long: step_count per batch row


@torch.no_grad()
def target_labels(final: torch.Tensor, target_norm: nn.Module, target_lm_head: nn.Module,
                  draft_ids: torch.Tensor, full_argmax: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """final [B,S,Ht] pre-norm -> (probs over the draft vocab [B,S,Vd] fp32, renormalised;
    full-vocab argmax [B,S] long). fp32 and outside autocast: labels are what the draft is measured by.

    full_argmax=False computes only the draft vocabulary's rows of the head (SmolLM2: 8192 of 49152, ~18% of
    a CPU training step saved); the probs are identical, the argmax is then the target's top token WITHIN the
    draft vocab, which differs from the full argmax where the target's top token is outside it (the shipped
    vocabulary covers 89% of the 1.1M-token data's assistant tokens). Training steps use it; every held-out
    evaluation uses the full."""
    B, S, H = final.shape
    flat = final.reshape(B * S, H)
    W = getattr(target_lm_head, "weight", None)
    if not full_argmax and isinstance(target_lm_head, nn.Linear) and W is not None:
        with torch.autocast(final.device.type, enabled=False):
            Wd = W.index_select(0, draft_ids)  # [Vd, Ht]
            bd = target_lm_head.bias.index_select(0, draft_ids) if target_lm_head.bias is not None else None
            x = target_norm(flat.to(_param_dtype(target_norm, flat.dtype)))
            logits = torch.nn.functional.linear(x.to(Wd.dtype), Wd, bd).float()  # [B*S, Vd]
            probs = torch.softmax(logits, dim=-1)
            top = draft_ids[logits.argmax(-1)]
        return probs.view(B, S, -1), top.view(B, S)
    V = W.shape[0] if W is not None else None
    probs = torch.empty(B * S, draft_ids.numel(), dtype=torch.float32, device=final.device)
    top = torch.empty(B * S, dtype=torch.long, device=final.device)
    chunk = max(1, TARGET_CHUNK_BYTES // (4 * (V or 65536)))
    dev_type = final.device.type
    with torch.autocast(dev_type, enabled=False):
        for a in range(0, B * S, chunk):
            x = flat[a:a + chunk]
            x = target_norm(x.to(_param_dtype(target_norm, x.dtype)))
            logits = target_lm_head(x.to(_param_dtype(target_lm_head, x.dtype))).float()  # [n, V]
            top[a:a + chunk] = logits.argmax(-1)
            probs[a:a + chunk] = torch.softmax(logits.index_select(-1, draft_ids), dim=-1)
    return probs.view(B, S, -1), top.view(B, S)


def _param_dtype(m: nn.Module, default: torch.dtype) -> torch.dtype:
    p = next(m.parameters(), None)
    return p.dtype if p is not None else default


def step_valid(loss_mask: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """loss_mask [B,S] bool -> per step j a [B, S_j] bool: row t valid when t+2+j < S and loss_mask[t+2+j]."""
    S = loss_mask.shape[1]
    out = []
    for j in range(steps):
        n = max(S - 1 - j, 0)
        v = torch.zeros(loss_mask.shape[0], n, dtype=torch.bool, device=loss_mask.device)
        if n > 1:
            v[:, :n - 1] = loss_mask[:, 2 + j:]
        out.append(v)
    return out


def step_counts(loss_mask: torch.Tensor, steps: int) -> torch.Tensor:
    """[steps] long: valid rows per TTT step (what the loss of each step is averaged over)."""
    return torch.stack([v.sum() for v in step_valid(loss_mask, steps)]) if steps else torch.zeros(0, dtype=torch.long)


def ttt_attend(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor,
               diag_k: list[torch.Tensor], diag_v: list[torch.Tensor]) -> torch.Tensor:
    """Step-j attention without materialising the flattened S x (j+1)S mask.
    q [B,nh,n,hd]; k0/v0 [B,nkv,n,hd] step-0 keys (causal); diag_k/v: j tensors [B,nkv,n,hd], the keys of
    steps 1..j at the same row. Returns [B,nh,n,hd]."""
    B, nh, n, hd = q.shape
    nkv = k0.shape[1]
    rep = nh // nkv
    qg = q.reshape(B, nkv, rep, n, hd)  # head h uses kv head h // rep (as repeat_interleave)
    scale = 1.0 / math.sqrt(hd)
    s0 = torch.matmul(qg, k0.unsqueeze(2).transpose(-1, -2)) * scale  # [B,nkv,rep,n,n]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
    s0 = s0.masked_fill(causal, float("-inf"))
    if diag_k:
        sd = torch.stack([(qg * k.unsqueeze(2)).sum(-1) for k in diag_k], dim=-1) * scale  # [B,nkv,rep,n,j]
        p = torch.softmax(torch.cat([s0, sd], dim=-1).float(), dim=-1).to(q.dtype)  # [B,nkv,rep,n,n+j]
        out = torch.matmul(p[..., :n], v0.unsqueeze(2))
        for i, v in enumerate(diag_v):
            out = out + p[..., n + i, None] * v.unsqueeze(2)
    else:
        p = torch.softmax(s0.float(), dim=-1).to(q.dtype)
        out = torch.matmul(p, v0.unsqueeze(2))
    return out.reshape(B, nh, n, hd)


def ttt_forward(draft: Eagle3Draft, aux: torch.Tensor, final: torch.Tensor, input_ids: torch.Tensor,
                loss_mask: torch.Tensor, target_norm: nn.Module, target_lm_head: nn.Module, steps: int,
                *, denom: torch.Tensor | None = None, return_logits: bool = False,
                labels: tuple[torch.Tensor, torch.Tensor] | None = None) -> TTTOutput:
    """Unroll `steps` TTT steps over a right-padded batch.

    aux [B,S,nA*Ht], final [B,S,Ht] (pre-norm), input_ids [B,S], loss_mask [B,S] bool (padding False).
    denom [steps]: what each step's CE sum is divided by (default: this batch's valid rows; data-parallel
    training passes the global count so summed gradients equal the one-process gradient).
    labels: precomputed `target_labels(...)` (probs, argmax) to skip recomputing them.
    """
    if steps < 1:
        raise TTTError(f"steps must be >= 1, got {steps}")
    if aux.dim() != 3 or final.dim() != 3 or input_ids.dim() != 2 or loss_mask.shape != input_ids.shape:
        raise TTTError(f"expected aux [B,S,nA*H], final [B,S,H], input_ids/loss_mask [B,S]; got aux "
                       f"{tuple(aux.shape)}, final {tuple(final.shape)}, input_ids {tuple(input_ids.shape)}, "
                       f"loss_mask {tuple(loss_mask.shape)}")
    c = draft.config
    if aux.shape[-1] != c.num_aux * c.target_hidden_size:
        raise TTTError(f"aux width {aux.shape[-1]} != num_aux {c.num_aux} x target hidden {c.target_hidden_size}: "
                       "the features do not match this draft's fc")
    B, S = input_ids.shape
    device = aux.device
    draft_ids = draft.target_token_ids()  # [Vd] target ids
    probs, top = labels if labels is not None else target_labels(final, target_norm, target_lm_head, draft_ids)
    valid = step_valid(loss_mask.bool(), steps)
    if denom is None:
        denom = torch.stack([v.sum() for v in valid])
    denom = denom.to(device=device, dtype=torch.float32).clamp_min(1.0)

    dtype = draft.fc.weight.dtype
    hidden = draft.fuse(aux[:, :S - 1].to(dtype))  # [B, S-1, H]
    pos = torch.arange(S, device=device).unsqueeze(0).expand(B, S)
    k0 = v0 = None
    diag_k: list[torch.Tensor] = []
    diag_v: list[torch.Tensor] = []
    loss = aux.new_zeros((), dtype=torch.float32)
    zero = torch.zeros(steps, device=device)
    step_sum = zero.clone()
    row_correct = torch.zeros(B, steps, dtype=torch.long, device=device)
    row_count = torch.zeros_like(row_correct)
    logits_out: list[torch.Tensor] = []
    for j in range(steps):
        n = S - 1 - j  # rows 0..n-1 have an input token x_{t+1+j}
        if n < 1:
            break
        hidden = hidden[:, :n]  # [B, n, H]
        q, k, v = draft.qkv(hidden, input_ids[:, 1 + j:1 + j + n], pos[:, j:j + n])  # q [B,nh,n,hd]
        if j == 0:
            k0, v0 = k, v
        else:
            diag_k = [d[:, :, :n] for d in diag_k] + [k]
            diag_v = [d[:, :, :n] for d in diag_v] + [v]
        assert k0 is not None and v0 is not None  # set at j == 0
        attn = ttt_attend(q, k0[:, :, :n], v0[:, :, :n], diag_k, diag_v)
        out = draft.finish(attn, hidden)  # [B, n, H]
        logits = draft.logits(out).float()  # [B, n, Vd]
        if return_logits:
            logits_out.append(logits.detach())
        ok = valid[j]  # [B, n]
        tgt = probs[:, 1 + j:1 + j + n]  # [B, n, Vd]
        ce = -(tgt * torch.log_softmax(logits, dim=-1)).sum(-1)  # [B, n]
        ce_sum = (ce * ok).sum()
        loss = loss + (STEP_DECAY ** j) * ce_sum / denom[j]
        with torch.no_grad():
            pred = draft.draft_to_target(logits.argmax(-1))
            row_correct[:, j] = ((pred == top[:, 1 + j:1 + j + n]) & ok).sum(1)
            row_count[:, j] = ok.sum(1)
            step_sum[j] = ce_sum.detach()
        hidden = out  # fed back, no fc
    step_correct, step_count = row_correct.sum(0), row_count.sum(0)  # [steps]
    step_loss = step_sum / step_count.clamp_min(1)
    return TTTOutput(loss=loss, step_loss=step_loss, step_correct=step_correct, step_count=step_count,
                     step_loss_sum=step_sum, logits=logits_out, row_correct=row_correct, row_count=row_count)
