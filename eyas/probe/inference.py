"""Layout inference: which stream indices a draft was trained on, measured. The draft is scored (step-0 held-out
loss and accuracy through ttt_forward, the training objective) on features the target produces under each
candidate layout; every stream a sample needs is captured in one forward through eyas.engine.forward.TargetModel, the
forward the engine serves with. `eyas doctor` and `eyas import` both decide layouts with it. Here: the one call
from a target and a draft to a ranking; the candidates (candidates.py), the samples (samples.py), the target's
streams (streams.py), the draft's scores (scoring.py) and the ranking with its noise test (ranking.py) are their own
modules."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..draft import Eagle3Draft
from .candidates import layout_candidates
from .ranking import LayoutRanking, rank_layouts
from .samples import as_samples, conversation_samples
from .scoring import prepare_draft
from .streams import Serving, capture_streams


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
    draft = prepare_draft(draft_model, target)
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
    fresh = capture_streams(serving, draft, target, evs, need)
    keep = [list(recorded)] if recorded is not None else []
    return rank_layouts(draft, target, evs, fresh, cands, keep=keep)
