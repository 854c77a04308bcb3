"""Probe stage: which stream layout a draft reads, inferred by scoring its predictions on captured features.

The draft is scored (step-0 held-out loss and accuracy through ttt_forward, the training objective) on the streams
the target produces now, under each candidate layout; the ranking's paired noise test says when one layout is
worse than another. `eyas doctor` and `eyas import` decide layouts with it.

  infer_layout           target + draft -> LayoutRanking, in one call (samples, streams and candidates built)
  layout_candidates      the candidate layouts around the recorded / configured / default ones
  rank_layouts           candidates scored on captured streams, in two stages -> LayoutRanking of LayoutScores
  score_draft, score_layout, prepare_draft, final_only_view, baseline_accuracy   the draft's scores
  EvalSample, as_samples, shard_samples, conversation_samples, SampleError        the samples scored on
  Serving, capture_streams, FreshStreams, capture_path_streams                    the target's streams
"""

from .candidates import FINAL_ONLY, layout_candidates
from .inference import infer_layout
from .ranking import LOSS_MARGIN_REL, LOSS_Z, LayoutRanking, LayoutScore, rank_layouts
from .samples import EvalSample, SampleError, as_samples, conversation_samples, shard_samples
from .scoring import baseline_accuracy, final_only_view, prepare_draft, score_draft, score_layout
from .streams import FreshStreams, Serving, capture_path_streams, capture_streams

__all__ = [
    "FINAL_ONLY", "LOSS_MARGIN_REL", "LOSS_Z", "EvalSample", "FreshStreams", "LayoutRanking", "LayoutScore",
    "SampleError", "Serving", "as_samples", "baseline_accuracy", "capture_path_streams", "capture_streams",
    "conversation_samples", "final_only_view", "infer_layout", "layout_candidates", "prepare_draft", "rank_layouts",
    "score_draft", "score_layout", "shard_samples",
]
