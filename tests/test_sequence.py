"""eyas.engine.sequence with a word tokenizer stub: a Sequence's context and room; pick (greedy argmax, or a
draw from the warped target distribution); commit (appends, stops at an EOS or max_new_tokens and drops what
follows, cuts a stop string's tokens, searches each token count for stop strings only once, keeps
stats.new_tokens); result (the cut text, the finish reason); and DraftCache.empty's shape."""

from __future__ import annotations

import pytest
import torch

from eyas.engine.forward import KVCache
from eyas.engine.params import SamplingParams
from eyas.engine.sequence import DraftCache, Sequence
from eyas.engine.stats import GenStats

EOS = {2}
WORDS = {0: "a", 1: "b", 2: "<eos>", 3: "c", 4: "d", 5: "STOP", 6: "e"}


class Words:
    """decode joins words with spaces, dropping the EOS as a special token; it records each call's token count."""

    def __init__(self):
        self.decoded: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        self.decoded.append(len(ids))
        return " ".join(WORDS[i] for i in ids if not (skip_special_tokens and i in EOS))


def make_seq(max_new: int = 10, stop: list[str] | None = None, temperature: float = 0.0,
             prompt: list[int] | None = None) -> Sequence:
    gen = torch.Generator().manual_seed(0) if temperature > 0 else None
    cache = KVCache(torch.zeros(1, 1, 1, 8, 1), torch.zeros(1, 1, 1, 8, 1))
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new, stop=stop or [])
    return Sequence(prompt or [6, 6], params, gen, cache, None, GenStats())


def test_context_is_prompt_then_output_and_room_counts_down():
    seq = make_seq(max_new=5, prompt=[4, 4])
    assert seq.context == [4, 4] and seq.room == 5
    seq.commit([0, 1], EOS, Words())
    assert seq.context == [4, 4, 0, 1] and seq.room == 3
    assert seq.prompt == [4, 4]  # the context is a new list; the prompt is not extended


def test_pick_is_the_argmax_when_greedy():
    logits = torch.tensor([0.1, 3.0, 0.2, 3.0])
    assert make_seq().pick(logits) == 1  # a tie goes to the first maximum


def test_pick_samples_from_the_warped_target_distribution():
    seq = make_seq(temperature=1.0)
    seq.params.top_k = 2
    logits = torch.tensor([2.0, 1.9, 5.0, -1.0, 4.9])
    draws = {seq.pick(logits) for _ in range(200)}
    assert draws == {2, 4}  # top_k 2 leaves only the two best, and both come up
    p = seq.target_probs(logits)
    assert float(p.sum()) == pytest.approx(1.0) and float(p[0]) == 0.0


def test_commit_appends_and_returns_what_may_be_emitted():
    seq = make_seq()
    assert seq.commit([0, 1], EOS, Words()) == [0, 1]
    assert seq.commit([3], EOS, Words()) == [3]
    assert seq.out == [0, 1, 3] and seq.finish is None and seq.stats.new_tokens == 3


def test_commit_stops_at_eos_keeps_it_and_drops_what_follows():
    seq = make_seq()
    assert seq.commit([0, 2, 3, 4], EOS, Words()) == [0, 2]
    assert seq.out == [0, 2] and seq.finish == "stop" and seq.stats.new_tokens == 2


def test_commit_stops_at_max_new_tokens():
    seq = make_seq(max_new=3)
    seq.commit([0], EOS, Words())
    assert seq.commit([1, 3, 4, 6], EOS, Words()) == [1, 3]
    assert seq.out == [0, 1, 3] and seq.finish == "length" and seq.room == 0


def test_eos_on_the_last_allowed_token_is_a_stop():
    seq = make_seq(max_new=2)
    seq.commit([0, 2], EOS, Words())
    assert seq.finish == "stop"


def test_stop_string_cuts_the_tokens_after_the_one_completing_it_and_the_text_before_it():
    seq = make_seq(stop=["STOP"])
    new = seq.commit([0, 5, 1, 3], EOS, Words())
    assert new == [0, 5] and seq.out == [0, 5]
    assert seq.finish == "stop" and seq.stop_text == "a "
    assert seq.stats.new_tokens == 2


def test_stop_string_spanning_two_commits_is_found():
    seq = make_seq(stop=["b c"])
    assert seq.commit([0, 1], EOS, Words()) == [0, 1] and seq.finish is None
    assert seq.commit([3, 4], EOS, Words()) == [3]
    assert seq.out == [0, 1, 3] and seq.stop_text == "a " and seq.finish == "stop"


def test_stop_search_reads_each_token_count_once():
    words = Words()
    seq = make_seq(stop=["zzz"])
    seq.commit([0, 1], EOS, words)
    assert words.decoded == [1, 2] and seq.text_checked == 2
    words.decoded.clear()
    seq.commit([3, 4, 6], EOS, words)
    assert words.decoded == [3, 4, 5] and seq.text_checked == 5  # counts 1 and 2 were searched already


def test_no_stop_strings_decodes_nothing():
    words = Words()
    make_seq().commit([0, 1, 3], EOS, words)
    assert words.decoded == []


def test_result_holds_tokens_text_and_finish_reason():
    words = Words()
    seq = make_seq()
    seq.commit([0, 1, 2], EOS, words)
    r = seq.result(words)
    assert r.token_ids == [0, 1, 2] and r.text == "a b" and r.finish_reason == "stop"
    assert r.stats is seq.stats
    r.token_ids.append(9)
    assert seq.out == [0, 1, 2]  # the result's ids are a copy


def test_result_text_is_the_stop_cut_text():
    seq = make_seq(stop=["STOP"])
    seq.commit([0, 1, 5, 3], EOS, Words())
    assert seq.result(Words()).text == "a b "


def test_result_of_an_unfinished_sequence_reads_as_length():
    seq = make_seq()
    seq.commit([0], EOS, Words())
    assert seq.result(Words()).finish_reason == "length"


def test_draft_cache_empty_is_zero_length_with_the_given_shape():
    dc = DraftCache.empty(2, 4, 9, torch.float32, torch.device("cpu"))
    assert dc.length == 0
    assert dc.keys.shape == dc.values.shape == (1, 2, 9, 4)
    assert dc.keys.dtype == torch.float32 and dc.keys.data_ptr() != dc.values.data_ptr()


def test_a_new_sequence_has_no_round_inputs_yet():
    seq = make_seq()
    assert seq.root == -1 and seq.features is None and seq.rows_tokens == []
    assert seq.out == [] and seq.finish is None and seq.stop_text is None
