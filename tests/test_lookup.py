"""Lookup candidates (eyas.engine.lookup): what follows the latest earlier match of the context's suffix."""

from __future__ import annotations

from eyas.engine.lookup import lookup_chain


def test_latest_longest_match_wins():
    # suffix (7, 8) occurs twice earlier; the later occurrence (followed by 4) wins over the first (followed by 1)
    assert lookup_chain([7, 8, 1, 7, 8, 4, 5, 7, 8], 2) == [4, 5]
    # a 3-token match beats a later 2-token one
    assert lookup_chain([1, 2, 3, 9, 0, 2, 3, 5, 1, 2, 3], 1, max_ngram=3) == [9]


def test_loop_shorter_than_the_proposal_is_continued():
    assert lookup_chain([1, 2, 3, 1, 2, 3], 7) == [1, 2, 3, 1, 2, 3, 1]


def test_no_match_and_degenerate_inputs():
    assert lookup_chain([1, 2, 3, 4], 5) == []
    assert lookup_chain([1, 2], 5) == []
    assert lookup_chain([5, 5, 5], 0) == []
    # single-token matches are not used (min_ngram 2): too noisy to pay for their verification rows
    assert lookup_chain([4, 1, 9, 1], 3) == []


def test_window_limits_the_search():
    ctx = [1, 2, 42] + [0] * 50 + [1, 2]
    assert lookup_chain(ctx, 1) == [42]
    assert lookup_chain(ctx, 1, window=20) == []
