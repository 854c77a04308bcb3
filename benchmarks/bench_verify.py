"""Cost of one target forward of S new tokens after a context, as verification runs it, for S = 1..16.

    python benchmarks/bench_verify.py [--context 300] [--rows 1,2,4,8,16] [--repeats 21] [--threads 2]
                                      [--weights native,fp32] [--isa portable,avx2,avx512vnni] [--llama-cpp]
                                      [--clock wall|cpu] [--out verify.json]

Each eyas mode runs the engine's forward (eyas.model) with a tree mask, all-row logits and the draft's three
captured streams, i.e. exactly what a verification round costs; the median of --repeats timings is reported
with its ratio to S = 1 (one decode step). --llama-cpp adds llama.cpp on the same GGUF through its C API
(llama-cpp-python's ctypes bindings, `make llama-cpp`; eyas.bench.llama_c): one llama_decode of S tokens with
all-row logits after the same context, the previous batch dropped from the KV cache first. The modes are
interleaved per repeat so load drift hits all of them. Compare ratios within one run, never across runs.
--isa runs the native mode once per named kernel variant (kernels.select_isa before each forward), interleaved
the same way; without it the native mode runs the variant the library chose ($EYAS_ISA, else the CPU's best).
--clock cpu times with the process's CPU seconds instead of wall time: on a machine shared with other jobs it
leaves out the time spent waiting for a core (with --threads 1 it is the forward's own work; with more threads it
also counts their spinning at barriers, so use it with one thread).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from eyas.bench.llama_c import LlamaC
from eyas.engine.weights import engine_model
from eyas.native import kernels
from eyas.option import DEFAULT_TARGET
from eyas.target.load import load_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--weights", default="native,fp32")
    ap.add_argument("--isa", default=None, help="kernel variants to run native weights on, e.g. avx2,avx512vnni")
    ap.add_argument("--llama-cpp", action="store_true")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rows = [int(r) for r in a.rows.split(",")]
    t = load_target(a.target)
    g = torch.Generator().manual_seed(0)
    V = t.model.config.vocab_size
    ctx = torch.randint(0, V, (1, a.context), generator=g)
    new = torch.randint(0, V, (1, max(rows)), generator=g)
    runners = {}
    for w in a.weights.split(","):
        m = engine_model(t, w)
        cache = m.new_cache(1, a.context + max(rows))
        m.forward(ctx, torch.arange(a.context)[None], cache, logits="none")
        cache.length = a.context

        for isa in (a.isa.split(",") if a.isa and w == "native" else [None]):
            def run(S: int, m=m, cache=cache, isa=isa) -> None:
                if isa:
                    kernels.select_isa(isa)
                mask = torch.ones(S, S, dtype=torch.bool).tril()
                m.forward(new[:, :S], torch.arange(a.context, a.context + S)[None], cache, tree_mask=mask,
                          capture=[2, 15, 27], logits="all")
            runners[f"eyas {w}" + (f" {isa}" if isa else "")] = run
    if a.llama_cpp:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            print("skipping llama.cpp: llama-cpp-python is not installed (make llama-cpp)")
        else:
            if t.gguf is None:
                raise SystemExit(f"error: --llama-cpp needs a GGUF target; {a.target!r} is not one")
            llm = LlamaC(t.gguf, a.threads, n_ctx=a.context + max(rows) + 64)
            llm.prefill(ctx[0].tolist())

            def run_llama(S: int) -> None:
                llm.truncate(a.context)  # drop the previous batch from the KV cache
                llm.decode_rows(new[0, :S].tolist())
            runners["llama.cpp"] = run_llama
    times: dict[str, dict[int, list[float]]] = {k: {S: [] for S in rows} for k in runners}
    clock = time.process_time if a.clock == "cpu" else time.perf_counter
    for _ in range(a.repeats):
        for S in rows:
            for k, run in runners.items():
                t0 = clock()
                run(S)
                times[k][S].append(clock() - t0)
    med = {k: {S: statistics.median(v) * 1e3 for S, v in d.items()} for k, d in times.items()}
    print(f"verify forward after {a.context} tokens, {a.threads} threads, median of {a.repeats} ({a.clock} ms; "
          "ratio to S=1)")
    width = max(14, *(len(k) + 2 for k in med))
    print("mode".ljust(width) + "".join(f"S={S}".rjust(16) for S in rows))
    for k, d in med.items():
        print(k.ljust(width) + "".join(f"{d[S]:8.1f} ({d[S] / d[rows[0]]:.2f}x)".rjust(16) for S in rows))
    if 8 in rows and 1 in rows:
        for k, d in med.items():
            print(f"{k}: an 8-row verify costs {d[8] / d[1]:.2f}x a one-token step")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"context": a.context, "threads": a.threads, "repeats": a.repeats, "clock": a.clock, "ms": med,
                       "isa_default": kernels.isa(), "isa_supported": kernels.supported_isas()}, f, indent=2)


if __name__ == "__main__":
    main()
