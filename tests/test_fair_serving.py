"""Fair serving: a short request starts between long prompts' prefill chunks and decoding rounds, and long
prompts over the limit are refused at once with a 503 and Retry-After (the worker on a stub engine that logs
what ran; the bundled target's tokenizer, no model).
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

# ---- fair serving: a short request starts between long prompts' prefill chunks and decoding rounds ------------

class ChunkedStub:
    """An engine whose prefill takes one empty round per 2 prompt tokens, then max_new_tokens rounds of one
    token; it logs what ran, in order, by prompt (prompt i of `longs` has 40 + i tokens). A long prompt's first
    round waits for `gate`, and its second token for `resume`, so the test can queue requests at a known point."""

    def __init__(self, token: int):
        self.last_result, self.log, self.token = None, [], token
        self.gate, self.resume = threading.Event(), threading.Event()

    def stream(self, input_ids, params):
        who = len(input_ids)
        if who > 10:
            assert self.gate.wait(30)
        for _ in range(who // 2 - 1):
            self.log.append(("chunk", who))
            yield []
        for i in range(params.max_new_tokens):
            if who > 10 and i == 1:
                assert self.resume.wait(30)
            self.log.append(("token", who))
            yield [self.token]


def run_behind(tokenizer, longs: int, long_new: int = 3, while_decoding: bool = False,
               max_long: int = 8) -> tuple[list[tuple[str, int]], list[Any]]:
    """`longs` prompts of 40+ tokens, then a 2-token one, submitted while the first long prompt is in its first
    prefill chunk (or, while_decoding, once it has its first token) -> (the engine's log, the refusals)."""
    from eyas.engine.params import SamplingParams
    from eyas.serve.metrics import Metrics
    from eyas.serve.openai_schema import APIError
    from eyas.serve.worker import Job, Worker

    engine = ChunkedStub(token=tokenizer("hello", add_special_tokens=False)["input_ids"][0])
    worker = Worker(engine, tokenizer, Metrics(), max_long=max_long, long_prompt=16)
    refused: list[APIError] = []

    async def go() -> None:
        loop = asyncio.get_running_loop()

        def job(n_prompt: int, n_new: int) -> Job:
            return Job(input_ids=[7] * n_prompt, params=SamplingParams(max_new_tokens=n_new), stop=[], loop=loop,
                       arrived=time.perf_counter(), endpoint="test")

        jobs = [job(40 + i, long_new) for i in range(longs)] + [job(2, 2)]
        worker.submit(jobs[0])
        if while_decoding:
            engine.gate.set()
            while (await jobs[0].events.get()).kind != "delta":
                pass
        for j in jobs[1:]:
            try:
                worker.submit(j)
            except APIError as e:
                refused.append(e)
                jobs.remove(j)
        engine.gate.set()
        engine.resume.set()
        for j in jobs:
            while (ev := await j.events.get()).kind not in ("done", "error"):
                pass
            assert ev.kind == "done", ev

    worker.start()
    try:
        asyncio.run(asyncio.wait_for(go(), 120))  # a deadline, not a timing: a lost event fails instead of hanging
    finally:
        worker.stop()
    return engine.log, refused


def long_rounds_before(log: list[tuple[str, int]], index: int) -> int:
    return sum(1 for e in log[:index] if e[1] > 2)


def long_rounds_before_first_token(log: list[tuple[str, int]]) -> int:
    return long_rounds_before(log, log.index(("token", 2)))


@pytest.mark.parametrize("longs", [1, 4, 8])
def test_short_request_runs_between_long_prompts_chunks(smollm2_tokenizer, longs):
    """Behind 1, 4 or 8 long prompts (19-23 chunks each) a 2-token request's first token comes after the chunk in
    progress and its second after one more; before, it waited FIFO behind 4 started prompts' whole prefills and
    generations (and 8 queued ones' too). Every long prompt still ran all its chunks and tokens, in its order."""
    log, refused = run_behind(smollm2_tokenizer, longs)
    assert not refused
    assert long_rounds_before_first_token(log) <= 1, log
    short = [i for i, e in enumerate(log) if e[1] == 2]
    assert long_rounds_before(log, short[-1]) <= 2, log
    assert short[-1] < min(log.index(("token", 40 + i)) for i in range(longs)), log  # done before any long token
    for i in range(longs):
        n = 40 + i
        assert [e for e in log if e[1] == n] == [("chunk", n)] * (n // 2 - 1) + [("token", n)] * 3


def test_short_request_starts_while_a_long_one_decodes(smollm2_tokenizer):
    """Before, a decoding job kept newcomers queued until its generation ended; now a short request starts at the
    next round boundary and the two decode in turn."""
    log, _ = run_behind(smollm2_tokenizer, 1, long_new=6, while_decoding=True)
    first = log.index(("token", 2))
    assert log[first - 2:first] == [("token", 40)] * 2, log  # right after the round that was in progress
    assert first < max(i for i, e in enumerate(log) if e[1] == 40), log  # the long one was not finished


def test_long_prompts_beyond_the_limit_get_a_503_with_retry_after(smollm2_tokenizer):
    """--max-long-prompts 3: the 4th and 5th long prompts are refused at once with a 503 and Retry-After; the short
    request is never refused, and the 3 held ones run to their end."""
    log, refused = run_behind(smollm2_tokenizer, 5, max_long=3)
    assert [(e.status, e.code) for e in refused] == [(503, "server_busy")] * 2
    assert all(e.retry_after is not None and 1 <= e.retry_after <= 60 for e in refused)
    assert "--max-long-prompts 3" in refused[0].message and "retry" in refused[0].message
    assert {e[1] for e in log} == {40, 41, 42, 2} and long_rounds_before_first_token(log) <= 1
