"""eyas/engine/sequence.py on hand-made tokens: committing stops at an end token (kept) or at max_new_tokens
(nothing past it), a stop string cuts the tokens and the text where it begins and ends the generation, the
plain choice is the argmax or a seeded draw, and the result carries what was committed."""

from __future__ import annotations

import torch

from eyas.engine.params import SamplingParams
from eyas.engine.sequence import Sequence
from eyas.engine.stats import GenStats


class Letters:
    """A tokenizer stand-in: token t decodes to chr(ord('a') + t); 25 is special (skipped, as eos tokens are)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + t) for t in ids if not (skip_special_tokens and t == 25))


def seq(max_new: int = 8, stop: list[str] | None = None, seed: int | None = None, temperature: float = 0.0
        ) -> Sequence:
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new, stop=list(stop or []), seed=seed)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return Sequence(prompt=[0, 1], params=params, gen=gen, cache=None, draft_cache=None, stats=GenStats())


def test_commit_stops_at_an_end_token_and_keeps_it():
    s = seq()
    assert s.commit([2, 25, 3], eos={25}, tokenizer=Letters()) == [2, 25]
    assert s.out == [2, 25] and s.finish == "stop" and s.stats.new_tokens == 2


def test_commit_never_goes_past_max_new_tokens():
    s = seq(max_new=3)
    assert s.commit([2, 3], eos=set(), tokenizer=Letters()) == [2, 3] and s.finish is None and s.room == 1
    assert s.commit([4, 5, 6], eos=set(), tokenizer=Letters()) == [4]
    assert s.out == [2, 3, 4] and s.finish == "length" and s.room == 0
    assert s.context == [0, 1, 2, 3, 4]


def test_a_stop_string_cuts_tokens_and_text_where_it_begins():
    s = seq(stop=["cd"])  # tokens 2 3 decode to "cd"
    assert s.commit([7, 2], eos=set(), tokenizer=Letters()) == [7, 2] and s.finish is None
    # the stop string completes with the next round's first token: the tokens that make it up to there stay
    # committed as the shortest prefix holding it, and the text ends before it
    emitted = s.commit([3, 4], eos=set(), tokenizer=Letters())
    assert s.finish == "stop" and s.out == [7, 2, 3] and emitted == [3]
    res = s.result(Letters())
    assert res.text == "h" and res.token_ids == [7, 2, 3] and res.finish_reason == "stop"


def test_a_stop_string_inside_one_round_keeps_nothing_after_it():
    s = seq(stop=["e"])
    assert s.commit([2, 4, 5, 6], eos=set(), tokenizer=Letters()) == [2, 4]
    assert s.out == [2, 4] and s.result(Letters()).text == "c"


def test_pick_is_the_argmax_greedy_and_a_seeded_draw_when_sampling():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9])
    assert seq().pick(logits) == 1
    draws = [seq(seed=s, temperature=1.0).pick(logits) for s in (1, 1, 2, 3, 4, 5, 6, 7)]
    assert draws[0] == draws[1]  # the same seed, the same token
    assert set(draws) <= {0, 1, 2, 3} and len(set(draws)) > 1
    p = seq(seed=0, temperature=0.5).target_probs(logits)
    assert abs(float(p.sum()) - 1.0) < 1e-6 and int(p.argmax()) == 1


def test_an_unfinished_result_reads_as_length():
    s = seq()
    s.commit([2, 3], eos=set(), tokenizer=Letters())
    res = s.result(Letters())
    assert res.finish_reason == "length" and res.text == "cd"
