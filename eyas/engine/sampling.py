"""Logit warping and the recursive rejection step that keeps speculative sampling lossless.

Plain sampling and speculative verification call the same `warp` on the target's logits, so both
sample from exactly the same distribution p (temperature -> top-k -> top-p, Hugging Face's order).
"""

from __future__ import annotations

import torch


def warp(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] (fp32). temperature must be > 0 here."""
    x = logits.float() / temperature
    V = x.shape[-1]
    if 0 < top_k < V:
        kth = x.topk(top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    p = torch.softmax(x, dim=-1)
    if top_p < 1.0:
        sp, idx = p.sort(dim=-1, descending=True)
        # keep the smallest head whose mass reaches top_p (the first token is always kept)
        drop = (sp.cumsum(-1) - sp) >= top_p
        drop[..., 0] = False  # a top_p that rounds to 0 in fp32 would otherwise drop every token
        sp = sp.masked_fill(drop, 0.0)
        p = torch.zeros_like(p).scatter_(-1, idx, sp)
        p = p / p.sum(-1, keepdim=True)
    return p


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from probs [V]."""
    return int(torch.multinomial(probs, 1, generator=generator))


def rejection_step(p: torch.Tensor, token: int, q: torch.Tensor | None, generator: torch.Generator | None
                   ) -> tuple[bool, torch.Tensor]:
    """Try one candidate `token` against the target distribution p [V].

    q is the distribution the candidate was drawn from ([V] over target ids), or None when it was
    chosen deterministically (EAGLE-2 top-k tree: q is a point mass on the token). Accept with
    probability min(1, p(x)/q(x)); on rejection return the residual norm(max(p - q, 0)) for the next
    sibling (or for the final draw). With a point mass the residual is p with x removed. Either way
    P(output = y) = p(y) exactly (standard speculative-sampling argument, applied recursively)."""
    px = float(p[token])
    qx = 1.0 if q is None else float(q[token])
    u = float(torch.rand((), generator=generator, device=p.device))
    if qx > 0 and u * qx < px:  # u < p/q without dividing by a tiny q
        return True, p
    if q is None:
        r = p.clone()
        r[token] = 0.0
    else:
        r = (p - q).clamp_min(0.0)
    s = r.sum()
    if float(s) <= 0.0:
        # only when p == q exactly, where rejection has probability 0; keep p as a safe fallback
        return False, p
    return False, r / s
