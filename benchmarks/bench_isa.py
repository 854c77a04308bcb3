"""eyas plain greedy decoding (native weights) on each kernel instruction-set variant, interleaved in one run.

    python benchmarks/bench_isa.py [--isa portable,avx2,avx512vnni] [--prompts 4] [--max-new-tokens 64]
                                   [--repeats 3] [--threads 2] [--out isa.json]

Each repeat decodes every prompt (MT-bench first turns) once per variant (kernels.select_isa before each), so load
drift on a shared machine hits all of them. Reports decode tokens per second after the prefill (wall clock, the
engine's own timer), new tokens per second with the prefill by wall clock and by the process's CPU seconds (the
latter leaves out time spent waiting for a core; meaningful with --threads 1), the medians over repeats, and
whether every variant produced the same tokens as the first (the variants compute the same bits).
Compare within one run, never across runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from eyas.bench.prompts import load_mtbench
from eyas.engine.decode import Engine
from eyas.engine.params import SamplingParams, SpecParams
from eyas.engine.prompt import chat_input_ids
from eyas.native import kernels
from eyas.option import DEFAULT_TARGET
from eyas.target.load import load_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--isa", default=None, help="variants to compare (default: every one this CPU runs)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    isas = a.isa.split(",") if a.isa else kernels.supported_isas()
    t = load_target(a.target)
    eng = Engine(t, None, SpecParams(method="plain", weights="native"))
    prompts = [chat_input_ids(t.tokenizer, p.messages) for p in load_mtbench(a.prompts, 1, None)]
    sp = SamplingParams(max_new_tokens=a.max_new_tokens)
    decode: dict[str, list[float]] = {i: [] for i in isas}
    wall: dict[str, list[float]] = {i: [] for i in isas}
    cpu: dict[str, list[float]] = {i: [] for i in isas}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(a.repeats):
        for isa in isas:
            kernels.select_isa(isa)
            w0, c0 = time.perf_counter(), time.process_time()
            res = [eng.generate(ids, sp) for ids in prompts]
            w, c = time.perf_counter() - w0, time.process_time() - c0
            out = [r.token_ids for r in res]
            n = sum(len(o) for o in out)
            decode[isa].append(sum(r.stats.new_tokens - 1 for r in res)
                               / sum(r.stats.total_s - r.stats.prefill_s for r in res))
            wall[isa].append(n / w)
            cpu[isa].append(n / c)
            tokens.setdefault(isa, out)
    same = {i: tokens[i] == tokens[isas[0]] for i in isas}
    print(f"plain greedy, native weights, {a.prompts} prompts x {a.max_new_tokens} tokens, {a.threads} threads, "
          f"median of {a.repeats}")
    print("variant".ljust(12) + "decode tok/s".rjust(14) + "vs first".rjust(10) + "wall tok/s".rjust(12)
          + "cpu tok/s".rjust(12) + "  same tokens")
    base = statistics.median(decode[isas[0]])
    for i in isas:
        md, mw, mc = (statistics.median(x[i]) for x in (decode, wall, cpu))
        print(i.ljust(12) + f"{md:14.1f}{md / base:9.2f}x{mw:12.1f}{mc:12.1f}  {same[i]}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"threads": a.threads, "prompts": a.prompts, "max_new_tokens": a.max_new_tokens,
                       "repeats": a.repeats, "decode_tok_s": decode, "wall_tok_s": wall, "cpu_tok_s": cpu,
                       "same_tokens": same, "supported": kernels.supported_isas()}, f, indent=2)


if __name__ == "__main__":
    main()
