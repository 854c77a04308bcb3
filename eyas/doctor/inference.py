"""Layout inference: which stream indices a draft was trained on, measured. The draft is scored (step-0 held-out
loss and accuracy through ttt_forward, the training objective) on features the target produces under each
candidate layout; every stream a sample needs is captured in one forward through eyas.engine.forward.TargetModel, the
forward the engine serves with. `eyas doctor` and `eyas import` both decide layouts with it. Here: the candidates
and their two-stage ranking; the samples (samples.py), the target's streams (streams.py), the draft's scores
(scoring.py) and the ranking's noise test (ranking.py) are their own modules."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..draft import Eagle3Draft
from ..layout import default_aux_indices
from .ranking import FINAL_ONLY, LayoutRanking, LayoutScore
from .samples import EvalSample, as_samples, conversation_samples
from .scoring import _baseline, _final_only_view, _score
from .streams import Serving, _Fresh, _fresh, _prepare


def layout_candidates(recorded: Sequence[int] | None, num_layers: int, num_aux: int,
                      configured: Mapping[str, Sequence[int] | None] | None = None) -> list[tuple[list[int], str]]:
    """Candidate layouts around each base (the recorded layout, every engine-configured one, the default):
    the base; every id shifted +1 / -1 together and one at a time; the embedding (0) in place of each id;
    permutations; plus the final state alone (indices []). Labels say how each relates to its base; a
    candidate reached from two bases carries both labels."""
    L = num_layers
    bases: list[tuple[str, list[int]]] = []
    if recorded is not None:
        bases.append(("recorded", list(recorded)))
    for name, ids in (configured or {}).items():
        if ids is not None:
            bases.append((name, list(ids)))
    dflt = default_aux_indices(L)
    if len(dflt) == num_aux:
        bases.append(("default", dflt))
    labels: dict[tuple[int, ...], list[str]] = {}

    def add(ids: list[int], label: str, allow_dup: bool = False) -> None:
        if len(ids) != num_aux or not all(0 <= k <= L for k in ids):
            return
        if not allow_dup and len(set(ids)) != len(ids):
            return
        labels.setdefault(tuple(ids), [])
        if label not in labels[tuple(ids)]:
            labels[tuple(ids)].append(label)

    for name, b in bases:
        add(b, f"{name} {b}", allow_dup=True)
    for name, b in bases:
        add([k + 1 for k in b], f"{name} shifted +1")
        add([k - 1 for k in b], f"{name} shifted -1")
        for i, k in enumerate(b):
            for d in (1, -1):
                add(b[:i] + [k + d] + b[i + 1:], f"{name} with {k}->{k + d}")
            if k != 0:
                add(b[:i] + [0] + b[i + 1:], f"{name} with the embedding (0) in place of {k}")
        perms = itertools.permutations(range(len(b))) if len(b) <= 4 else \
            [tuple(reversed(range(len(b))))] + [tuple(j + 1 if j == i else j - 1 if j == i + 1 else j
                                                      for j in range(len(b))) for i in range(len(b) - 1)]
        for p in perms:
            if list(p) != list(range(len(b))):
                add([b[j] for j in p], f"{name} permuted {list(p)}")
    out = [(list(k), " = ".join(v[:2])) for k, v in labels.items()]
    out.append(([], f"{FINAL_ONLY} (1xH post-norm, no fc: EAGLE instead of EAGLE3)"))
    return out


@torch.no_grad()
def _rank(draft: Eagle3Draft, target, samples: list[EvalSample], fresh: list[_Fresh],
          cands: list[tuple[list[int], str]], stage1_tokens: int = 512,
          keep: Sequence[Sequence[int]] = ()) -> LayoutRanking:
    """Step-0 held-out loss and accuracy of each candidate, ranked by loss (lowest first).

    Why loss and not accuracy: the draft was trained to minimise exactly this cross-entropy on its true
    layout, and it moves on every position, while top-1 accuracy moves only where the argmax flips. On the
    shipped SmolLM2 draft (32% step-0 accuracy) a +1 shift costs 0.07 nats at paired z ~ 12 over 2,900
    positions but only 1 point of accuracy (z ~ 2.5): accuracy alone cannot tell neighbouring layers apart.
    Two stages to stay fast on real targets: every candidate on the first ~stage1_tokens tokens, then the
    best 6 (plus `keep`) on all samples; the per-position losses of those are kept for paired tests."""
    labels = [f.labels for f in fresh]
    final_view = _final_only_view(draft)

    def run(idx: list[int], subset: list[int]) -> dict[str, Any] | None:
        if not idx:
            if final_view is None:
                return None
            # the post-norm final state, as an engine running EAGLE passes it (what the target's head sees)
            feats = [target.final_norm()(fresh[i].final.float()) for i in subset]
            model = final_view
        else:
            feats = [torch.cat([fresh[i].streams[k] for k in idx], dim=-1) for i in subset]
            model = draft
        return _score(model, target, feats, [fresh[i].final for i in subset], [samples[i] for i in subset], 1,
                      [labels[i] for i in subset], want_rows=True)

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
        r = run(idx, everything)
        if r is not None:
            rows[tuple(idx)] = r["rows"]
            n_tok = max(n_tok, r["count"][0])
        scores.append(score(idx, label, r))

    first_rows: dict[tuple[int, ...], torch.Tensor] = {}
    if len(sub) < len(everything) and len(cands) > 8:
        first = []
        for idx, lab in cands:
            r = run(idx, sub)
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
    return LayoutRanking(scores + rest, tokens=n_tok, baseline=_baseline(samples, labels), rows=rows,
                         first_rows=first_rows)


def infer_layout(target, draft_model: Eagle3Draft, samples: Sequence[Any] | Mapping[str, Sequence[int]] | None = None,
                 candidates: Mapping[str, Sequence[int]] | Sequence[Sequence[int]] | None = None, *,
                 recorded: Sequence[int] | None = None, num_samples: int = 6, max_len: int = 384,
                 source: str = "sharegpt") -> LayoutRanking:
    """Which target layers does this draft read? Rank candidate layouts by the draft's step-0 accuracy.

    target: an eyas Target; draft_model: an Eagle3Draft (its embeddings are set from the target if missing).
    samples: token-id tensors [S] or (input_ids, loss_mask) pairs; None -> `num_samples` conversations of
      `source` through the target's chat template. (A mapping here is taken as `candidates`.)
    candidates: {label: stream indices} or a list of stream-index lists to rank exactly those; None -> the
      generated set of `layout_candidates` around `recorded` (or the default layout): shifts by +-1,
      the embedding in place of each id, permutations and the final state alone.
    Returns a LayoutRanking: LayoutScore(indices, label, accuracy) best first; `.tokens` positions scored,
    `.baseline` the accuracy of always proposing the most frequent token. All stream indices are captured
    in one target forward per sample through the engine's forward.
    """
    if isinstance(samples, Mapping):
        samples, candidates = None, samples
    draft = _prepare(draft_model, target)
    L, nA = target.num_layers, draft.config.num_aux
    if samples is None:
        evs = conversation_samples(target.tokenizer, source, num_samples, max_len, None)
    else:
        evs = as_samples(samples)
    if candidates is None:
        cands = layout_candidates(recorded, L, nA)
    elif isinstance(candidates, Mapping):
        cands = [(list(v), k if str(list(v)) in k else f"{k} {list(v)}") for k, v in candidates.items()]
    else:
        cands = [(list(v), f"{list(v)}") for v in candidates]
    need = {k for idx, _ in cands for k in idx}
    serving = Serving(target)
    fresh = _fresh(serving, draft, target, evs, need)
    keep = [list(recorded)] if recorded is not None else []
    return _rank(draft, target, evs, fresh, cands, keep=keep)
