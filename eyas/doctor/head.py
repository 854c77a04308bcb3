"""The doctor's head check: an lm_head or fc that looks untrained (init statistics), near-uniform draft logits, or
an accuracy no better than always proposing the most frequent token."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..draft import Eagle3Draft
from ..probe import LayoutRanking
from .checklist import Check, pct

BASELINE_MARGIN_POINTS = 2.0  # "predicts nothing": accuracy within this of always guessing the top token
UNIFORM_ENTROPY = 0.97  # draft logits whose entropy is >= 97% of log(Vd) carry no prediction ...
UNIFORM_GAP = 0.05  # ... unless the target's own distribution is about as flat (a high-entropy target)
INIT_STD_TOL = 0.03  # weight std within 3% of an init distribution's std ...
INIT_KURT_TOL = 0.15  # ... and its kurtosis within 0.15 of the init's (uniform 1.8, normal 3.0)
IID_SPREAD = 1.5  # row/column norm spread within 1.5x of i.i.d. sampling noise = never trained


def _looks_init(w: torch.Tensor) -> str | None:
    w = w.detach().float()
    if w.numel() < 1000:
        return None
    fan_in = w.shape[1]
    flat = w.flatten()
    std = float(flat.std())
    if std == 0 or not torch.isfinite(flat).all():
        return "all zeros" if std == 0 else "non-finite"
    z = (flat - flat.mean()) / std
    kurt = float((z ** 4).mean())
    b = 1.0 / math.sqrt(fan_in)
    if (float(flat.abs().max()) <= b * 1.0001 and abs(std / (b / math.sqrt(3)) - 1) < INIT_STD_TOL
            and abs(kurt - 1.8) < INIT_KURT_TOL):
        return f"torch's default init U(+-1/sqrt({fan_in})) (std {std:.4g}, kurtosis {kurt:.2f}, max |w| <= bound)"
    if abs(std / 0.02 - 1) < INIT_STD_TOL and abs(kurt - 3.0) < INIT_KURT_TOL and abs(float(flat.mean())) < 0.1 * std:
        return f"N(0, 0.02) init (std {std:.4g}, kurtosis {kurt:.2f})"
    # any other i.i.d. init (e.g. a scaled normal): every row and column has the same squared norm up to
    # sampling noise, CV = sqrt((kurtosis - 1) / n) for n entries; training spreads them far wider
    if min(w.shape) >= 128 and (abs(kurt - 3.0) < INIT_KURT_TOL or abs(kurt - 1.8) < INIT_KURT_TOL):
        def cv(n2: torch.Tensor) -> float:
            return float(n2.std() / n2.mean())

        rows, cols = w.pow(2).sum(1), w.pow(2).sum(0)
        exp_r = math.sqrt(max(kurt - 1, 0.1) / w.shape[1])
        exp_c = math.sqrt(max(kurt - 1, 0.1) / w.shape[0])
        if cv(rows) < IID_SPREAD * exp_r and cv(cols) < IID_SPREAD * exp_c:
            return (f"an i.i.d. random init (kurtosis {kurt:.2f}; row/column norm spread {100 * cv(rows) / 2:.1f}%/"
                    f"{100 * cv(cols) / 2:.1f}%, as sampling noise alone gives)")
    return None


def check_head(draft: Eagle3Draft, serve: dict[str, Any], rank: LayoutRanking | None) -> Check:
    """The head check from the draft's weights, its serving-path scores (score_draft with want_logits) and the layout
    ranking (its best accuracy and baseline; None or empty: the serving step-0 accuracy, no baseline)."""
    sig = {name: _looks_init(getattr(draft, name).weight) for name in ("lm_head", "fc")}
    ent = serve.get("entropy_ratio", float("nan"))
    ent_t = serve.get("target_entropy_ratio", float("nan"))
    best = max((s.accuracy for s in rank if not math.isnan(s.accuracy)), default=float("nan")) if rank \
        else serve["acc"][0]
    base = rank.baseline if rank else float("nan")
    nums = {"init_signature": sig, "entropy_ratio": ent, "target_entropy_ratio": ent_t, "best_step0_acc": best,
            "baseline": base}
    evidence = [f"{n} weights match {s}" for n, s in sig.items() if s]
    # near-uniform: flat over the draft vocab AND clearly flatter than the target it should imitate
    near_uniform = not math.isnan(ent) and ent >= UNIFORM_ENTROPY and not ent_t >= ent - UNIFORM_GAP
    no_better = not math.isnan(base) and not math.isnan(best) and 100 * (best - base) <= BASELINE_MARGIN_POINTS
    if near_uniform:
        evidence.append(f"draft logits are near-uniform (entropy {100 * ent:.0f}% of log Vd; the target's "
                        f"{100 * ent_t:.0f}%)")
    if no_better:
        evidence.append(f"best step-0 accuracy {pct(best)} vs {pct(base)} for always proposing the most frequent "
                        "token")
    absent = [n for n, s in sig.items() if s in ("all zeros", "non-finite")]
    fix = "train the draft (or load the trained checkpoint); a head at its init gives accept length ~1.0"
    if absent:
        return Check("head", "fail", f"{' and '.join(absent)} absent ({', '.join(str(sig[n]) for n in absent)})",
                     numbers=nums, details=evidence, fix=fix)
    if any(sig.values()) and (near_uniform or no_better):
        names = " and ".join(n for n, s in sig.items() if s)
        return Check("head", "fail", f"{names} look untrained: " + "; ".join(evidence), numbers=nums,
                     details=evidence, fix=fix)
    if near_uniform and no_better:
        return Check("head", "fail", "the draft predicts nothing: " + "; ".join(evidence), numbers=nums,
                     details=evidence, fix=fix)
    if any(sig.values()) or no_better:
        return Check("head", "warn", "suspicious head: " + "; ".join(evidence), numbers=nums, details=evidence,
                     fix="check the layout and vocab_map findings; retrain if the head never trained")
    return Check("head", "pass", f"trained head: step-0 accuracy {pct(best)} vs {pct(base)} baseline, logits "
                 f"entropy {100 * ent:.0f}% of log Vd (target {100 * ent_t:.0f}%), weights away from their init",
                 numbers=nums)
