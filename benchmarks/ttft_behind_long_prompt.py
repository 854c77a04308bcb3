"""Time to first token of a short request sent just after N long prompts, on the server's engine worker.

Each trial submits N LONG-token prompts at once (each asking for LONG_NEW tokens), waits DELAY seconds, then
submits a 2-token request (2 new tokens) and records its time to first token (TTFT) and to its last token; then it
cancels the long prompts (they would only slow the next trial) and waits for the worker to be idle. First, one long
prompt alone gives the time of one prefill chunk (its prefill time / its chunks). Printed per N: TTFT p50 and p95,
the short request's whole time, and TTFT p50 / chunk time: the worker's goal is ~1-2 (the chunk in progress, then
the short request's own round), whatever N is up to --max-long-prompts.

    .venv/bin/python benchmarks/ttft_behind_long_prompt.py --long 1500 --behind 1,4,8 --trials 3

--chunk 0 prefills whole prompts (no interleaving inside a prompt). The script uses only the worker's public
constructor, so the same file measures an older eyas checkout (PYTHONPATH=that checkout).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from eyas.engine.decode import Engine
from eyas.engine.params import SamplingParams, SpecParams
from eyas.option import DEFAULT_TARGET
from eyas.serve.metrics import Metrics
from eyas.serve.worker import Job, Worker
from eyas.target.load import load_target


def make_job(ids: list[int], n: int) -> Job:
    return Job(input_ids=ids, params=SamplingParams(max_new_tokens=n), stop=[], loop=asyncio.get_running_loop(),
               arrived=time.perf_counter(), endpoint="bench")


async def finish(job: Job) -> str:
    while (ev := await job.events.get()).kind not in ("done", "error", "cancelled"):
        pass
    return ev.kind


async def trial(worker: Worker, longs: list[list[int]], long_new: int, short_ids: list[int],
                delay: float) -> tuple[float, float]:
    """-> (the short request's TTFT, its time to its last token)."""
    jobs = [make_job(ids, long_new) for ids in longs]
    for j in jobs:
        worker.submit(j)
    await asyncio.sleep(delay)
    short = make_job(short_ids, 2)
    worker.submit(short)
    if (kind := await finish(short)) != "done":
        raise SystemExit(f"the short request ended with {kind}")
    ended = time.perf_counter()
    for j in jobs:
        j.cancelled.set()
    for j in jobs:
        await finish(j)
    assert short.first_token_at is not None
    return short.first_token_at - short.arrived, ended - short.arrived


async def chunk_seconds(worker: Worker, ids: list[int], chunk: int) -> float:
    """One long prompt alone: the time to its first token / its prefill chunks."""
    job = make_job(ids, 1)
    worker.submit(job)
    await finish(job)
    assert job.first_token_at is not None
    return (job.first_token_at - job.arrived) / (-(-len(ids) // chunk) if chunk else 1)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--long", type=int, default=1500, help="tokens in each long prompt")
    ap.add_argument("--long-new", type=int, default=32, help="tokens each long prompt asks for")
    ap.add_argument("--behind", default="1,4,8", help="numbers of long prompts ahead of the short request")
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk (0: whole prompts)")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--delay", type=float, default=0.5, help="seconds between the long prompts and the short one")
    args = ap.parse_args()

    target = load_target(args.target)
    engine = Engine(target, None, SpecParams(method="plain"))
    engine.prefill_chunk = args.chunk
    tok = target.tokenizer
    text_ids = tok("The quick brown fox jumps over the lazy dog. ", add_special_tokens=False)["input_ids"]
    # each long prompt different (a different first token), as separate clients' prompts are
    base = (text_ids * (args.long // len(text_ids) + 1))[:args.long - 1]
    short_ids = text_ids[:2]
    worker = Worker(engine, tok, Metrics())
    worker.start()
    rows = {}
    t0 = time.perf_counter()
    try:
        chunk_s = await chunk_seconds(worker, [text_ids[0]] + base, args.chunk)
        for n in (int(x) for x in args.behind.split(",")):
            longs = [[text_ids[i % len(text_ids)]] + base for i in range(n)]
            ttft, total = [], []
            for _ in range(args.trials):
                a, b = await trial(worker, longs, args.long_new, short_ids, args.delay)
                ttft.append(a)
                total.append(b)
            rows[n] = (pct(ttft, 0.5), pct(ttft, 0.95), statistics.median(total))
    finally:
        worker.stop()
    print(f"short request ({len(short_ids)} tokens, 2 new) sent {args.delay} s after N prompts of {args.long} tokens "
          f"({args.long_new} new each), chunks of {args.chunk or 'whole prompts'}, {args.trials} trials; one chunk "
          f"{chunk_s:.3f} s; run took {time.perf_counter() - t0:.0f} s:")
    for n, (p50, p95, whole) in rows.items():
        print(f"  N={n}: TTFT p50 {p50:7.3f} s  p95 {p95:7.3f} s  whole answer {whole:7.3f} s  "
              f"p50/chunk {p50 / chunk_s:6.2f}")


if __name__ == "__main__":
    asyncio.run(main())
