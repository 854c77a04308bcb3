"""Time to first token of a short request sent just after a long prompt, on the server's engine worker, with
whole-prompt prefill (--prefill-chunk 0, how the server ran before) and with chunked prefill (the default).

Each trial submits a LONG-token prompt (one new token), waits DELAY seconds, then submits a 2-token request,
and records the short request's time to first token (TTFT). Printed per setting: p50 and p95 TTFT, the time
of one prefill chunk (the long prefill's time / its chunks), and TTFT p50 / chunk time: the goal is ~2 or less.

    .venv/bin/python benchmarks/ttft_behind_long_prompt.py --long 4000 --trials 5
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from eyas.engine.decode import Engine
from eyas.engine.params import SamplingParams, SpecParams
from eyas.serve.metrics import Metrics
from eyas.serve.worker import Job, Worker
from eyas.target.load import load_target


async def trial(worker: Worker, long_ids: list[int], short_ids: list[int], delay: float) -> tuple[float, float]:
    """-> (short request's TTFT, long request's prefill time to its first token)."""
    loop = asyncio.get_running_loop()

    def job(ids: list[int], n: int) -> Job:
        return Job(input_ids=ids, params=SamplingParams(max_new_tokens=n), stop=[], loop=loop,
                   arrived=time.perf_counter(), endpoint="bench")

    long = job(long_ids, 1)
    worker.submit(long)
    await asyncio.sleep(delay)
    short = job(short_ids, 2)
    worker.submit(short)
    for j in (short, long):
        while (ev := await j.events.get()).kind not in ("done", "error", "cancelled"):
            pass
        if ev.kind != "done":
            raise SystemExit(f"the request ended with {ev.kind}: {ev.error and ev.error.message}")
    assert short.first_token_at is not None and long.first_token_at is not None
    return short.first_token_at - short.arrived, long.first_token_at - long.arrived


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--long", type=int, default=4000, help="tokens in the long prompt")
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk of the 'after' setting")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--delay", type=float, default=0.5, help="seconds between the long and the short request")
    args = ap.parse_args()

    target = load_target(args.target)
    engine = Engine(target, None, SpecParams(method="plain"))
    tok = target.tokenizer
    text_ids = tok("The quick brown fox jumps over the lazy dog. ", add_special_tokens=False)["input_ids"]
    long_ids = (text_ids * (args.long // len(text_ids) + 1))[:args.long]
    short_ids = text_ids[:2]
    worker = Worker(engine, tok, Metrics())
    worker.start()
    rows = {}
    try:
        for name, chunk in (("before (whole-prompt prefill)", 0), (f"after (chunks of {args.chunk})", args.chunk)):
            engine.prefill_chunk = chunk
            ttft, prefill = [], []
            for _ in range(args.trials):
                a, b = await trial(worker, long_ids, short_ids, args.delay)
                ttft.append(a)
                prefill.append(b)
            n_chunks = -(-args.long // chunk) if chunk else 1
            chunk_s = statistics.median(prefill) / n_chunks
            rows[name] = (pct(ttft, 0.5), pct(ttft, 0.95), chunk_s)
    finally:
        worker.stop()
    print(f"short request ({len(short_ids)} tokens) behind a {args.long}-token prompt, {args.trials} trials, "
          f"{args.delay} s apart:")
    for name, (p50, p95, chunk_s) in rows.items():
        print(f"  {name:32s} TTFT p50 {p50:7.3f} s  p95 {p95:7.3f} s  chunk {chunk_s:6.3f} s  "
              f"p50/chunk {p50 / chunk_s:6.2f}")
    before, after = rows.values()
    print(f"TTFT p50 before/after: {before[0] / after[0]:.1f}x")


if __name__ == "__main__":
    asyncio.run(main())
