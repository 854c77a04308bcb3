"""What lookup-only speculation (`--method lookup`) gains, by proposal length, from plain greedy outputs.

    python benchmarks/lookup_sim.py [--verify runs/verify.json] [--mt-bench 80] [--humaneval 40]
                                    [--max-new-tokens 256] [--outputs runs/lookup-sim-outputs.json]
                                    [--ngram TABLE [--ngram-tokens 1,2]]

Lookup only ever sees committed text, and greedy verification accepts exactly the proposal's prefix that
matches plain greedy decoding, so the rounds of `--method lookup` can be replayed exactly from plain outputs:
from each round's root, propose `lookup_chain(context, L)`, accept the matching prefix, commit it plus one.
The script decodes the prompts once with eyas plain (cached in --outputs), replays every L, and converts rounds
into time with the verify cost of 1 + len(proposal) rows from `benchmarks/bench_verify.py --out` (eyas native;
the rows it did not measure are interpolated). The speedup it prints is tokens / (sum of round costs in
one-step units): the round's fixed overhead (~0.2 ms of lookup search and KV compaction) is left out.
With --ngram, each length is replayed again with the n-gram table proposing `--ngram-tokens` where the context
has no match (what `--method lookup` does with `--ngram TABLE`); the table sees no bench prompt or reply.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from eyas.bench.prompts import load_prompts
from eyas.engine.decode import Engine
from eyas.engine.lookup import lookup_chain
from eyas.engine.ngram import NgramTable, load_ngram
from eyas.engine.params import SamplingParams, SpecParams
from eyas.engine.prompt import chat_input_ids
from eyas.option import DEFAULT_TARGET
from eyas.target.load import load_target

# native row costs measured with eyas 0.1.0 on a 2-core AMD EPYC Zen 3 (ms, 300-token context), used without --verify
DEFAULT_MS = {1: 8.37, 2: 9.54, 3: 11.15, 4: 13.06, 8: 22.20, 16: 39.26}


def row_costs(ms: dict[int, float], up_to: int) -> dict[int, float]:
    """Cost of a forward of r rows in one-step units, r = 1..up_to (linear between measured row counts)."""
    known = sorted(ms)
    out = {}
    for r in range(1, up_to + 1):
        lo = max(k for k in known if k <= r)
        hi = min((k for k in known if k >= r), default=lo)
        v = ms[lo] if hi == lo else ms[lo] + (ms[hi] - ms[lo]) * (r - lo) / (hi - lo)
        out[r] = v / ms[1]
    return out


def plain_outputs(path: Path, benches: list[tuple[str, int]], max_new: int) -> list[dict]:
    if path.is_file():
        data = json.loads(path.read_text())
        if data["max_new_tokens"] == max_new and data["benches"] == [list(b) for b in benches]:
            return data["rows"]
    t = load_target(DEFAULT_TARGET)
    eng = Engine(t, None, SpecParams(method="plain"))
    rows = []
    for bench, limit in benches:
        for p in load_prompts(bench, limit):
            ids = chat_input_ids(t.tokenizer, p.messages)
            out = eng.generate(ids, SamplingParams(max_new_tokens=max_new)).token_ids
            rows.append({"id": p.id, "bench": bench, "prompt": ids, "out": out})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"max_new_tokens": max_new, "benches": [list(b) for b in benches], "rows": rows}))
    return rows


def replay(rows: list[dict], length: int, cost: dict[int, float], tokens: int | None = None,
           table: NgramTable | None = None, table_tokens: int = 1) -> tuple[float, float]:
    """(tau, speedup over plain) of lookup with proposals of `length` (and the table's `table_tokens` where the
    context has no match), each output cut to `tokens`."""
    new = rounds = spent = 0.0
    for r in rows:
        prompt, out = r["prompt"], r["out"][:tokens]
        t = 0  # out[t] is the round's root (the previous round's bonus token)
        while t < len(out):
            chain = lookup_chain(prompt + out[:t + 1], length)
            if not chain and table is not None:
                chain = table.propose(prompt + out[:t + 1], table_tokens)
            acc = 0
            while acc < len(chain) and t + 1 + acc < len(out) and chain[acc] == out[t + 1 + acc]:
                acc += 1
            spent += cost[1 + len(chain)]
            rounds += 1
            new += min(acc + 1, len(out) - t)
            t += acc + 1
    return new / rounds, new / spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--verify", help="bench_verify.py --out JSON (its 'eyas native' row costs)")
    ap.add_argument("--mt-bench", type=int, default=80)
    ap.add_argument("--humaneval", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--lengths", default="1,2,3,4,5,6,8")
    ap.add_argument("--outputs", default="runs/lookup-sim-outputs.json")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ngram", help="an n-gram table folder (eyas ngram) to replay beside context lookup alone")
    ap.add_argument("--ngram-tokens", default="1", help="comma-separated table proposal lengths")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    ms = DEFAULT_MS
    if a.verify:
        ms = {int(k): v for k, v in json.loads(Path(a.verify).read_text())["ms"]["eyas native"].items()}
    lengths = [int(x) for x in a.lengths.split(",")]
    table_lengths = [int(x) for x in a.ngram_tokens.split(",")]
    table = load_ngram(a.ngram) if a.ngram else None
    cost = row_costs(ms, 1 + max(lengths + table_lengths))
    benches = [(b, n) for b, n in (("mt-bench", a.mt_bench), ("humaneval", a.humaneval)) if n]
    rows = plain_outputs(Path(a.outputs), benches, a.max_new_tokens)
    cuts = sorted({128, a.max_new_tokens})
    print("row costs (one-step units): " + ", ".join(f"{r}: {c:.2f}" for r, c in cost.items()))
    for bench, _ in benches:
        sel = [r for r in rows if r["bench"] == bench]
        for cut in cuts:
            res = [replay(sel, L, cost, cut) for L in lengths]
            print(f"{bench} x{len(sel)}, first {cut} tokens: "
                  + "  ".join(f"L{L} tau {t:.2f} {s:.2f}x" for L, (t, s) in zip(lengths, res, strict=True)))
            for n in table_lengths if table is not None else []:
                res = [replay(sel, L, cost, cut, table, n) for L in lengths]
                print(f"  + table ({n} token{'s' if n > 1 else ''}): "
                      + "  ".join(f"L{L} tau {t:.2f} {s:.2f}x" for L, (t, s) in zip(lengths, res, strict=True)))


if __name__ == "__main__":
    main()
