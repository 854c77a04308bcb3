"""Training throughput and draft cost, measured side by side in one run.

1. Training tokens/s (real, unpadded tokens per second of optimizer steps) on captured shards of the bundled
   target, fp32 vs bf16 autocast, same batches, same draft init.
2. The draft's forward cost per decoding step as a fraction of one target forward (both: one new token over a
   KV cache of --context tokens, fp32), with the --draft-vocab head and with the full target vocab.

    python benchmarks/bench_train.py --data SHARDS [--steps 6] [--out bench_train.json]

Prints ratios measured in one run; the goal is a draft step <= 10% of a target step with an 8k draft vocab.
Speed numbers depend on the machine's load: compare within one run, never across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from eyas.draft import DraftConfig, Eagle3Draft
from eyas.layout import check_layouts
from eyas.option import DEFAULT_TARGET
from eyas.target.load import end_token_ids, load_target
from eyas.train.config import TrainConfig
from eyas.train.sources import ShardSource, feature_norm, plan_epoch
from eyas.train.step import init_draft
from eyas.train.ttt import ttt_forward
from eyas.vocab import count_tokens, select_draft_vocab


def load_avg() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def train_throughput(source, target, vocab, batches, ttt_steps: int, bf16: bool, steps: int) -> dict:
    """Tokens/s over `steps` optimizer steps after one warm-up step (same batches for every mode)."""
    layout = source.layout
    dcfg = DraftConfig.from_target_config(target.config, draft_vocab_size=vocab.size, num_aux=layout.num_aux)
    emb = target.embed_tokens().weight.detach().float()
    draft = init_draft(dcfg, vocab, emb, 0, "scaled", feature_norm(source, source.train, 1024))
    opt = torch.optim.AdamW(draft.parameters(), lr=1e-4)
    norm, head = target.final_norm(), target.lm_head()
    times, tokens = [], []
    for i, b in enumerate(batches[:steps + 1]):
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            o = ttt_forward(draft, b.aux, b.final, b.input_ids, b.loss_mask, norm, head, ttt_steps)
        o.loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        if i:  # the first step warms up allocators and kernels
            times.append(time.perf_counter() - t0)
            tokens.append(b.tokens)
    return {"tokens_per_s": sum(tokens) / sum(times), "step_s_median": statistics.median(times),
            "steps": len(times), "tokens": sum(tokens)}


@torch.no_grad()
def decode_costs(target, layout, draft_vocab: int, context: int, reps: int) -> dict:
    """Median seconds of one target forward as the engine runs it (eyas.engine.forward.TargetModel: 1 new token over a
    KV cache of `context`, aux states captured) vs one draft step as the engine runs it (1 row over a draft
    cache of `context`: qkv + attend + finish + logits) with a `draft_vocab` head and with the full vocab."""
    from eyas.engine.forward import TargetModel

    V, H = target.identity.vocab_size, target.hidden_size
    tm = TargetModel(target.model)
    cache = tm.new_cache(1, context + 8)
    tm.forward(torch.randint(10, V, (1, context)), torch.arange(context)[None], cache, logits="none")
    cache.length = context
    nxt = torch.randint(10, V, (1, 1))
    pos = torch.tensor([[context]])

    def t_target():  # not committed: cache.length stays at `context`
        tm.forward(nxt, pos, cache, capture=layout.aux_indices, logits="last")

    out = {"context": context, "target_forward": "eyas.engine.forward.TargetModel (the engine's forward)"}
    timings = {"target": _median(t_target, reps)}
    emb = target.embed_tokens().weight.detach().float()
    for name, vd in (("draft", min(draft_vocab, V)), ("draft_full_vocab", V)):
        cfg = DraftConfig.from_target_config(target.config, draft_vocab_size=vd, num_aux=layout.num_aux)
        d = Eagle3Draft(cfg).eval()
        d.set_vocab_map(torch.arange(vd))
        d.set_embeddings(emb)
        dk = torch.randn(1, cfg.num_key_value_heads, context + 1, cfg.head_dim)
        dv = torch.randn(1, cfg.num_key_value_heads, context + 1, cfg.head_dim)
        h = torch.randn(1, 1, H)
        mask = torch.ones(1, 1, 1, context + 1, dtype=torch.bool)

        def t_draft(d=d, dk=dk, dv=dv, h=h, mask=mask):
            q, k, v = d.qkv(h, nxt, pos)
            dk[:, :, context:context + 1] = k
            dv[:, :, context:context + 1] = v
            d.logits(d.finish(d.attend(q, dk, dv, mask), h)).argmax(-1)

        timings[name] = _median(t_draft, reps)
    out.update({f"{k}_ms": round(v * 1e3, 3) for k, v in timings.items()})
    out["draft_fraction"] = round(timings["draft"] / timings["target"], 4)
    out["draft_full_vocab_fraction"] = round(timings["draft_full_vocab"] / timings["target"], 4)
    return out


def _median(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="/tmp/eyas-dg200", help="shard folder of the bundled target (eyas datagen)")
    ap.add_argument("--steps", type=int, default=2, help="timed optimizer steps per mode")
    ap.add_argument("--batch-tokens", type=int, default=1024)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--context", type=int, default=256, help="KV cache length for the decode-step costs")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="bench_train.json")
    ap.add_argument("--parts", default="train,decode", help="train and/or decode")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    ap.add_argument("--modes", default="fp32,bf16", help="training precision modes to time: fp32 and/or bf16")
    a = ap.parse_args()
    if not Path(a.data, "manifest.json").exists():
        raise SystemExit(f"{a.data} is not a shard folder; make one with e.g. `eyas datagen --data sharegpt --num 60 "
                         f"--max-len 512 --no-regenerate --out {a.data}`")
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    source = ShardSource([a.data], heldout_pct=0.0, buffer_mb=4096, max_len=a.max_len)
    target = load_target(source.set.manifests[0].get("target_source") or DEFAULT_TARGET)
    check_layouts(source.layout, target.default_layout(source.layout.aux_indices), "the shards", "the target")
    counts = count_tokens(source.token_pairs(source.train), target.identity.vocab_size)
    vocab = select_draft_vocab(counts, a.draft_vocab, end_token_ids(target.tokenizer, target.model), source.hash())
    cfg = TrainConfig(data=[a.data], out="", batch_tokens=a.batch_tokens, max_len=a.max_len)
    plan = plan_epoch(source.train, source.groups(), 0, 0, cfg.batch_tokens, cfg.max_len, 1 << 62)
    batches = [source.batch([source.train[i] for i in b], torch.device("cpu"), cfg.max_len)
               for b in plan[:a.steps + 1]]
    res = {"data": a.data, "threads": torch.get_num_threads(), "load_avg_start": load_avg(),
           "ttt_steps": a.ttt_steps, "draft_vocab": vocab.size, "coverage": vocab.coverage,
           "batch_tokens": a.batch_tokens}
    parts = set(a.parts.split(","))
    if "train" in parts:
        for mode in a.modes.split(","):
            res[mode] = train_throughput(source, target, vocab, batches, a.ttt_steps, mode == "bf16", a.steps)
            print(f"training tokens/s (TTT {a.ttt_steps}, draft vocab {vocab.size}, batch {a.batch_tokens} tokens, "
                  f"{mode}): {res[mode]['tokens_per_s']:.0f} (median step {res[mode]['step_s_median']:.2f} s)",
                  flush=True)
        if "fp32" in res and "bf16" in res:
            res["bf16_speedup"] = round(res["bf16"]["tokens_per_s"] / res["fp32"]["tokens_per_s"], 3)
            print(f"bf16 autocast / fp32: x{res['bf16_speedup']:.2f}", flush=True)
    if "decode" in parts:
        res["decode"] = d = decode_costs(target, source.layout, a.draft_vocab, a.context, a.reps)
        print(f"decode step over {d['context']} cached tokens: target {d['target_ms']:.2f} ms, draft "
              f"{d['draft_ms']:.2f} ms = {d['draft_fraction']:.1%} of a target step (goal <= 10%); full-vocab "
              f"draft {d['draft_full_vocab_ms']:.2f} ms = {d['draft_full_vocab_fraction']:.1%}")
    res["load_avg_end"] = load_avg()
    Path(a.out).write_text(json.dumps(res, indent=2))
    print(f"load average {res['load_avg_start']:.1f} -> {res['load_avg_end']:.1f} (other work skews absolute "
          f"numbers; ratios are measured in this one run) -> {a.out}")


if __name__ == "__main__":
    main()
