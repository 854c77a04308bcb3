"""/metrics lists a depth once something was proposed there: GenStats are sized for the deepest path a round
could take, and a depth-2 tree's empty depths 3 and 4 read as measured zeros."""

from __future__ import annotations

from types import SimpleNamespace

from eyas.serve.metrics import Metrics


def stats(accepted: list[int], proposed: list[int]) -> SimpleNamespace:
    return SimpleNamespace(new_tokens=9, target_forwards=5, rounds=4, prefill_s=0.1, draft_s=0.2, verify_s=0.3,
                           accepted_per_depth=accepted, proposed_per_depth=proposed, lookup_proposed=0,
                           lookup_accepted=0, ngram_proposed=0, ngram_accepted=0)


def test_depths_nothing_was_proposed_at_are_not_listed():
    m = Metrics()
    m.record_generation(stats([3, 1, 0, 0], [4, 3, 0, 0]))
    text = m.render()
    assert 'eyas_spec_proposed_tokens_total{depth="2"} 3' in text
    assert 'depth="3"' not in text and 'depth="4"' not in text
    m.record_generation(stats([0, 0, 1, 0], [1, 1, 2, 0]))  # a lookup chain reached depth 3 later
    text = m.render()
    assert 'eyas_spec_proposed_tokens_total{depth="3"} 2' in text and 'depth="4"' not in text
    m.record_generation(stats([0, 0, 0, 0], [1, 0, 0, 0]))  # once listed, a depth stays (a counter never vanishes)
    assert 'eyas_spec_proposed_tokens_total{depth="3"} 2' in m.render()
