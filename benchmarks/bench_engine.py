"""eyas plain decoding vs Hugging Face `generate` greedy, and the speculative round's draft/verify split.

    python benchmarks/bench_engine.py [--prompts 3] [--max-new-tokens 64] [--repeats 2] [--draft random|PATH]
                                      [--dtype fp32] [--device cpu] [--out bench_engine.json]

Same target, dtype, prompts (MT-bench first turns) and machine, interleaved in one run (HF, eyas, HF, eyas...)
so load drifts hit both. Prints tok/s of each, the ratio (goal: eyas plain >= 1.0x HF greedy) and whether the
outputs are token-identical; then chain and tree rounds with the given draft: tau, ms per round spent drafting
vs verifying. A random draft shows the cost split, not the speed-up (its acceptance is ~0).
Speed numbers depend on the machine's load: compare within one run, never across runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from eyas.bench.prompts import load_mtbench
from eyas.draft import resolve_draft
from eyas.engine.decode import Engine
from eyas.engine.params import SamplingParams, SpecParams
from eyas.engine.prompt import chat_input_ids
from eyas.option import DEFAULT_TARGET
from eyas.target.load import load_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default="random")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    t = load_target(a.target, dtype=a.dtype, device=a.device)
    prompts = [chat_input_ids(t.tokenizer, p.messages) for p in load_mtbench(a.prompts, 1, None)]
    plain = Engine(t, None, SpecParams(method="plain"))
    sp = SamplingParams(max_new_tokens=a.max_new_tokens)
    eos = sorted(plain.eos)

    def hf(ids: list[int]) -> list[int]:
        x = torch.tensor([ids], device=t.device)
        with torch.no_grad():
            g = t.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=a.max_new_tokens,
                                 do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
        return g[0, len(ids):].tolist()

    hf(prompts[0][:8]), plain.generate(prompts[0][:8], SamplingParams(max_new_tokens=4))  # warm-up
    times = {"hf": [], "eyas": []}
    toks = {"hf": 0, "eyas": 0}
    same = True
    for _ in range(a.repeats):
        for ids in prompts:
            t0 = time.perf_counter()
            ref = hf(ids)
            t1 = time.perf_counter()
            out = plain.generate(ids, sp).token_ids
            t2 = time.perf_counter()
            times["hf"].append(t1 - t0)
            times["eyas"].append(t2 - t1)
            toks["hf"] += len(ref)
            toks["eyas"] += len(out)
            same &= ref == out
    hf_tps = toks["hf"] / sum(times["hf"])
    ey_tps = toks["eyas"] / sum(times["eyas"])
    res = {"hf_greedy_tok_s": hf_tps, "eyas_plain_tok_s": ey_tps, "ratio": ey_tps / hf_tps, "identical": same,
           "per_prompt_ratio_median": statistics.median(h / e for h, e in zip(times["hf"], times["eyas"],
                                                                                strict=True)),
           "tokens": toks, "dtype": a.dtype, "threads": torch.get_num_threads()}
    print(f"HF generate greedy {hf_tps:.1f} tok/s | eyas plain {ey_tps:.1f} tok/s | ratio {ey_tps / hf_tps:.2f}x "
          f"(median per prompt {res['per_prompt_ratio_median']:.2f}x) | token-identical: {same}")

    ckpt = resolve_draft(a.draft, t)
    res["speculative"] = {}
    for spec in (SpecParams("chain", steps=4), SpecParams("tree", depth=4, topk=4, tokens=16),
                 SpecParams("tree", depth=3, topk=2, tokens=6)):
        eng = Engine(t, ckpt, spec)
        st = [eng.generate(ids, sp).stats for ids in prompts]
        rounds = sum(s.rounds for s in st)
        d_ms = sum(s.draft_s for s in st) / rounds * 1e3
        v_ms = sum(s.verify_s for s in st) / rounds * 1e3
        new = sum(s.new_tokens for s in st)
        tau = sum(s.new_tokens - 1 for s in st) / rounds
        tps = new / sum(s.total_s for s in st)
        name = f"{spec.method} d{spec.shape()[0]} k{spec.shape()[1]} t{spec.shape()[2]}"
        res["speculative"][name] = {"tau": tau, "draft_ms_per_round": d_ms, "verify_ms_per_round": v_ms,
                                    "draft_share": d_ms / (d_ms + v_ms), "tok_s": tps}
        print(f"{name:16s} tau {tau:.2f} | per round: draft {d_ms:.1f} ms, verify {v_ms:.1f} ms "
              f"(draft share {d_ms / (d_ms + v_ms):.0%}) | {tps:.1f} tok/s")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
