"""The ranking of candidate layouts: one LayoutScore per candidate, the LayoutRanking of them with its paired noise
test (is one layout's held-out loss worse than another's beyond noise?), and rank_layouts, which scores the
candidates on captured streams in two stages."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from ..draft import Eagle3Draft
from .samples import EvalSample
from .scoring import baseline_accuracy, score_layout
from .streams import FreshStreams

# a candidate must beat the recorded layout's held-out loss by LOSS_Z paired standard errors AND by this share of
# the loss to be called its true layout. Measured: on the shipped SmolLM2 draft (loss 4.68) a +1 shift costs
# 0.069 nats (z 12 over 2,900 positions), moving the top id 27->26 0.040 (z 10), 15->16 0.006 (z 5), 2->3 0.001
# (z 1); on the tiny test pair (loss 3.75, flat targets) single-id moves cost 0.003..0.005 nats at z > 25.
LOSS_Z = 4.0
LOSS_MARGIN_REL = 0.001


class LayoutScore(NamedTuple):
    """One candidate layout. indices [] = no aux capture: the target's final post-norm 1xH state is fed
    straight to the draft layer, skipping fc — what SGLang/vLLM do when they run EAGLE instead of EAGLE3
    (sglang/srt/models/llama_eagle3.py and vllm's llama_eagle3.py apply fc only when the feature is wider
    than hidden_size). accuracy: step-0 held-out accuracy in [0, 1], or NaN when the engine would crash.
    loss: mean step-0 cross-entropy against the target's distribution (the training loss, nats), NaN likewise."""

    indices: list[int]
    label: str
    accuracy: float
    loss: float = float("nan")


class LayoutRanking(list):
    """`infer_layout`'s result: LayoutScores, best first, plus the measurement context. Also answers the
    summary keys 'chosen' (best label), 'aux_indices' (best indices), 'accuracy' and 'table' with
    `ranking["key"]` / `ranking.get("key")`, for callers that want a dict."""

    def __init__(self, scores: Sequence[LayoutScore], tokens: int = 0, baseline: float = 0.0,
                 rows: Mapping[tuple[int, ...], torch.Tensor] | None = None,
                 first_rows: Mapping[tuple[int, ...], torch.Tensor] | None = None):
        super().__init__(scores)
        self.tokens = tokens  # valid step-0 positions each accuracy was measured on
        self.baseline = baseline  # accuracy of always proposing the most frequent target token
        self.rows = dict(rows or {})  # indices -> per-position step-0 loss [tokens], same positions for all
        self.first_rows = dict(first_rows or {})  # the same on the first-stage sample, for every candidate

    def paired(self, a: Sequence[int], b: Sequence[int]) -> tuple[float, float] | None:
        """(mean loss of a minus mean loss of b, its paired standard error) in nats, over all positions when
        both were scored on all, else over the first-stage sample; None when not both were scored."""
        for rows in (self.rows, self.first_rows):
            ra, rb = rows.get(tuple(a)), rows.get(tuple(b))
            if ra is not None and rb is not None and ra.numel() == rb.numel() and ra.numel() >= 2:
                d = (ra - rb).double()
                return float(d.mean()), float(d.std() / math.sqrt(d.numel()))
        return None

    def worse(self, a: Sequence[int], b: Sequence[int]) -> tuple[bool, float, float]:
        """Is layout a's held-out loss worse than b's beyond noise (LOSS_Z paired SEs and LOSS_MARGIN_REL)?
        Returns (worse, difference in nats, paired SE)."""
        p = self.paired(a, b)
        if p is None:
            return False, float("nan"), float("nan")
        d, se = p
        sb = self.find(list(b))
        ref = abs(sb.loss) if sb is not None and not math.isnan(sb.loss) else 0.0
        return d > max(LOSS_Z * se, LOSS_MARGIN_REL * ref), d, se

    @property
    def best(self) -> LayoutScore:
        return self[0]

    def simplest_among_ties(self, recorded: Sequence[int], bases: Sequence[Sequence[int]] = ()) -> LayoutRanking:
        """The ranking with one change: of the candidates whose loss is within noise of the lowest (not `worse`,
        all positions scored), the simplest explanation goes first: the recorded layout; else a whole layout
        (one of `bases`: engine-configured views, the default) or any of these with every index shifted by one
        (a convention off-by-one); else the lowest loss. Neighbouring layers can be near-interchangeable for a
        trained draft (the shipped SmolLM2 draft retrained on its own replies: streams 1 and 2 within 0.001
        nats, paired SE 0.002); noise must not pick a one-index variant that no real miswiring produces."""
        top = self[0] if self else None
        if top is None or math.isnan(top.loss):
            return self
        whole = [list(recorded), *(list(x) for x in bases)]
        simple = {tuple(x) for x in whole} | {tuple(k + d for k in x) for x in whole for d in (1, -1)}

        def tier(s: LayoutScore) -> int:
            return 0 if list(s.indices) == list(recorded) else 1 if tuple(s.indices) in simple else 2

        ties = [s for s in self if s.indices and tuple(s.indices) in self.rows and not math.isnan(s.loss)
                and not self.worse(s.indices, top.indices)[0]]
        pick = min(ties, key=tier, default=top)  # min keeps the first (lowest-loss) of a tier
        if pick is top or tier(pick) >= tier(top):
            return self
        return LayoutRanking([pick] + [s for s in self if s is not pick], self.tokens, self.baseline, self.rows,
                             self.first_rows)

    def find(self, indices: list[int]) -> LayoutScore | None:
        return next((s for s in self if list(s.indices) == list(indices)), None)

    def to_dict(self) -> dict[str, Any]:
        b = self[0] if self else None
        return {"chosen": b.label if b else None, "aux_indices": list(b.indices) if b else None,
                "accuracy": b.accuracy if b else None, "tokens": self.tokens, "baseline": self.baseline,
                "loss": b.loss if b and not math.isnan(b.loss) else None,
                "table": [{"indices": list(s.indices), "label": s.label,
                           "accuracy": None if math.isnan(s.accuracy) else round(s.accuracy, 4),
                           "loss": None if math.isnan(s.loss) else round(s.loss, 4)} for s in self]}

    def __getitem__(self, key):  # type: ignore[override]
        if isinstance(key, str):
            return self.to_dict()[key]
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        return self.to_dict().get(key, default)


@torch.no_grad()
def rank_layouts(draft: Eagle3Draft, target, samples: list[EvalSample], fresh: list[FreshStreams],
                 cands: list[tuple[list[int], str]], stage1_tokens: int = 512,
                 keep: Sequence[Sequence[int]] = ()) -> LayoutRanking:
    """Step-0 held-out loss and accuracy of each candidate, ranked by loss (lowest first).

    Why loss and not accuracy: the draft was trained to minimise exactly this cross-entropy on its true
    layout, and it moves on every position, while top-1 accuracy moves only where the argmax flips. On the
    shipped SmolLM2 draft (32% step-0 accuracy) a +1 shift costs 0.07 nats at paired z ~ 12 over 2,900
    positions but only 1 point of accuracy (z ~ 2.5): accuracy alone cannot tell neighbouring layers apart.
    Two stages to stay fast on real targets: every candidate on the first ~stage1_tokens tokens, then the
    best 6 (plus `keep`) on all samples; the per-position losses of those are kept for paired tests."""
    def score(idx: list[int], label: str, r: dict[str, Any] | None) -> LayoutScore:
        if r is None:
            return LayoutScore(idx, label, float("nan"), float("nan"))
        return LayoutScore(idx, label, r["acc"][0], r["loss"])

    def key(s: LayoutScore) -> tuple[float, float]:
        return (math.inf if math.isnan(s.loss) else s.loss, -1.0 if math.isnan(s.accuracy) else -s.accuracy)

    everything = list(range(len(samples)))
    sub, tok = [], 0
    for i, s in enumerate(samples):
        sub.append(i)
        tok += s.input_ids.numel()
        if tok >= stage1_tokens:
            break
    scores: list[LayoutScore] = []
    rest: list[LayoutScore] = []  # ranked on the first stage only (fewer tokens), listed after
    rows: dict[tuple[int, ...], torch.Tensor] = {}
    n_tok = 0

    def full(idx: list[int], label: str) -> None:
        nonlocal n_tok
        r = score_layout(draft, target, samples, fresh, idx, everything)
        if r is not None:
            rows[tuple(idx)] = r["rows"]
            n_tok = max(n_tok, r["count"][0])
        scores.append(score(idx, label, r))

    first_rows: dict[tuple[int, ...], torch.Tensor] = {}
    if len(sub) < len(everything) and len(cands) > 8:
        first = []
        for idx, lab in cands:
            r = score_layout(draft, target, samples, fresh, idx, sub)
            if r is not None:
                first_rows[tuple(idx)] = r["rows"]
            first.append(score(idx, lab, r))
        first.sort(key=key)
        finalists = {tuple(x.indices) for x in first[:6]} | {tuple(k) for k in keep}
        for c in first:
            if tuple(c.indices) in finalists:
                full(c.indices, c.label)
            else:
                rest.append(c._replace(label=c.label + " (first-stage sample)"))
    else:
        for idx, lab in cands:
            full(idx, lab)
    scores.sort(key=key)
    baseline = baseline_accuracy(samples, [f.labels for f in fresh])
    return LayoutRanking(scores + rest, tokens=n_tok, baseline=baseline, rows=rows, first_rows=first_rows)
