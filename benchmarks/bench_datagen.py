"""Datagen throughput on the bundled target, side by side in one run.

1. Capture: the datagen capture path (`capture_samples`: hooks, right padding, real-token slicing, norm
   statistics, bf16 cast to CPU) vs a bare Hugging Face forward of the same padded batches computing logits
   for the last position only. Batches alternate A/B, B/A so machine noise hits both sides alike, and the
   fastest of --repeats timings per batch counts.
   Goal: ratio (capture tok/s / bare tok/s) >= 0.8.
2. End to end: `run_datagen --no-regenerate` on the same rows (tokenization + capture + shard writes + manifest).
3. Regeneration tokens/s (batched greedy generate, a few samples) in bf16 and fp32.

    .venv/bin/python benchmarks/bench_datagen.py [--num 32] [--max-len 512] [--threads 1] [--out DIR]

Writes results.json and datagen.png into --out. Speeds are machine-dependent: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from eyas.data.conversations import load_conversations, render, tokenize_conversation
from eyas.data.datagen import (
    DatagenConfig,
    capture_samples,
    generate_replies,
    length_batches,
    run_datagen,
    stop_token_ids,
)
from eyas.target import load_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num", type=int, default=32, help="ShareGPT conversations (the first N usable rows)")
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2, help="timings per batch and side (the fastest counts)")
    ap.add_argument("--capture-tokens", type=int, default=8192, help="padded tokens per forward (as datagen)")
    ap.add_argument("--regen-samples", type=int, default=4)
    ap.add_argument("--regen-new-tokens", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = default; 1 on a busy machine)")
    ap.add_argument("--out", default="/tmp/eyas-bench-datagen")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    target = load_target("smollm2-135m", dtype="fp32", device=args.device)
    layout = target.default_layout()
    convs, _ = load_conversations("sharegpt", num=args.num)
    tok = target.tokenizer
    items = []
    for c in convs:
        ids, mask = tokenize_conversation(tok, c.messages, args.max_len)
        items.append((c.row_id, ids, mask))
    lens = [len(it[1]) for it in items]
    batches = length_batches(lens, 1 << 30, args.capture_tokens)
    n_tokens = sum(lens)
    print(f"{len(items)} ShareGPT samples, {n_tokens} tokens (max_len {args.max_len}), {len(batches)} batches, "
          f"torch threads {torch.get_num_threads()}, device {target.device}")

    # warm up both paths on the smallest batch (allocator, kernels)
    small = [items[i] for i in batches[0]]
    capture_samples(target, small, layout, torch.bfloat16, args.capture_tokens)

    @torch.no_grad()
    def bare(batch_items):
        S = max(len(it[1]) for it in batch_items)
        ids = torch.zeros((len(batch_items), S), dtype=torch.long)
        am = torch.zeros((len(batch_items), S), dtype=torch.long)
        for b, it in enumerate(batch_items):
            ids[b, :len(it[1])] = it[1]
            am[b, :len(it[1])] = 1
        return target.model(input_ids=ids.to(target.device), attention_mask=am.to(target.device),
                            use_cache=False, logits_to_keep=1).logits

    bare(small)
    # per batch, the fastest of --repeats timings of each side: a busy machine only ever adds time
    best: dict[tuple[str, int], float] = {}
    for r in range(args.repeats):
        for k, b in enumerate(batches):
            bi = [items[i] for i in b]
            order = ("cap", "hf") if (k + r) % 2 == 0 else ("hf", "cap")
            for which in order:
                s = time.perf_counter()
                if which == "cap":
                    capture_samples(target, bi, layout, torch.bfloat16, args.capture_tokens)
                else:
                    bare(bi)
                dt = time.perf_counter() - s
                best[(which, k)] = min(best.get((which, k), dt), dt)
    t_cap = sum(v for (w, _), v in best.items() if w == "cap")
    t_hf = sum(v for (w, _), v in best.items() if w == "hf")
    cap_tps, hf_tps = n_tokens / t_cap, n_tokens / t_hf
    print(f"capture path      {cap_tps:8.1f} tok/s  ({t_cap:.1f} s)")
    print(f"bare HF forward   {hf_tps:8.1f} tok/s  ({t_hf:.1f} s, logits for the last position only)")
    print(f"ratio capture/bare = {cap_tps / hf_tps:.3f}   (goal >= 0.8)")

    # end to end: eyas datagen --no-regenerate on the same rows
    dg_out = out / "shards"
    shutil.rmtree(dg_out, ignore_errors=True)
    cfg = DatagenConfig(out=str(dg_out), data="sharegpt", num=args.num, max_len=args.max_len, regenerate=False,
                        capture_tokens=args.capture_tokens, threads=args.threads)
    m = run_datagen(cfg, command="bench_datagen", progress=False, log=lambda s: None, target=target)
    e2e_tps = m["counts"]["tokens_per_s"]
    print(f"datagen end to end {e2e_tps:8.1f} tok/s  (tokenize + capture + shards; ratio to bare "
          f"{e2e_tps / hf_tps:.3f}); {m['counts']['bytes_per_token']:.0f} bytes/token bf16")

    # regeneration speed, bf16 and fp32, same prompts (first user turn of the first rows)
    regen = {}
    for dt in ("bf16", "fp32"):
        t = target if dt == "fp32" else load_target("smollm2-135m", dtype=dt, device=args.device)
        # the first user turns (of the first rows whose prompt fits in max_len // 2 tokens; never cut a prompt,
        # that would drop the assistant header)
        prompts = [p for p in (t.tokenizer(render(t.tokenizer, c.messages[:1], add_generation_prompt=True),
                                           add_special_tokens=False)["input_ids"] for c in convs)
                   if len(p) <= args.max_len // 2][:args.regen_samples]
        gcfg = DatagenConfig(out="", max_new_tokens=args.regen_new_tokens, repetition_limit=0, max_len=4096)
        generate_replies(t, [prompts[0]], DatagenConfig(out="", max_new_tokens=4, max_len=4096), 0,
                         stop_token_ids(t))  # warm-up
        s = time.perf_counter()
        replies = generate_replies(t, prompts, gcfg, 0, stop_token_ids(t))
        dt_s = time.perf_counter() - s
        new = sum(len(r) for r, _ in replies)
        regen[dt] = {"new_tokens": new, "seconds": round(dt_s, 2), "tok_s": round(new / dt_s, 1),
                     "batch": len(prompts), "finish": [w for _, w in replies]}
        print(f"regeneration {dt}: {new} new tokens in {dt_s:.1f} s = {new / dt_s:.1f} tok/s "
              f"(batch {len(prompts)}, max_new_tokens {args.regen_new_tokens})")

    res = {
        "samples": len(items), "tokens": n_tokens, "max_len": args.max_len, "batches": len(batches),
        "threads": torch.get_num_threads(), "device": str(target.device), "repeats": args.repeats,
        "capture_tok_s": round(cap_tps, 1), "bare_hf_tok_s": round(hf_tps, 1), "ratio": round(cap_tps / hf_tps, 3),
        "datagen_end_to_end_tok_s": e2e_tps, "datagen_ratio_to_bare": round(e2e_tps / hf_tps, 3),
        "bytes_per_token": m["counts"]["bytes_per_token"], "regeneration": regen,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    (out / "results.json").write_text(json.dumps(res, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = ["bare HF fwd", "capture path", "datagen e2e", "regen bf16", "regen fp32"]
        vals = [hf_tps, cap_tps, e2e_tps, regen["bf16"]["tok_s"], regen["fp32"]["tok_s"]]
        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.bar(names, vals, color=["#888", "#2a7", "#27a", "#a72", "#a52"])
        ax.set_ylabel("tokens/s")
        ax.set_title(f"eyas datagen, SmolLM2-135M, {len(items)} ShareGPT samples (ratio {cap_tps / hf_tps:.2f})")
        fig.tight_layout()
        fig.savefig(out / "datagen.png", dpi=100)
    except ImportError:
        pass
    print(f"wrote {out / 'results.json'} ({res['wall_s']} s)")


if __name__ == "__main__":
    main()
