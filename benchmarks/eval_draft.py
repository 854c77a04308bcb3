"""Held-out accuracy of eyas drafts on shard folders' held-out rows and on a bench's own replies, side by side.

Each --data folder's held-out rows (the split training uses: --heldout-pct of the source rows, by row id, the
same rows in every folder) are scored with the training loop's own evaluation (TTT steps 0..N-1, fp32). With
a folder of regenerated replies this is the accuracy on the target's own replies, the figure acceptance
follows when serving.

--bench mt-bench: the target's greedy replies to the bench prompts (eyas plain decoding, the default weights:
exactly the tokens `eyas bench` verifies), each draft scored on them through the doctor's serving path (the
engine's forward captures the features, ttt_forward predicts): step-0 here is the draft's top-1 acceptance
in a chain-1 bench run on the same prompts, without timing anything.

    .venv/bin/python benchmarks/eval_draft.py --draft default --draft runs/recipe/train-x/draft \\
        --data runs/recipe/data-regen [--data runs/mix/data-regen] [--bench mt-bench --limit 8] [--threads 2]

Prints one row per (draft, folder or bench) and writes --out (JSON) when given.
"""

from __future__ import annotations

import argparse
import json

import torch

from eyas.draft import load_draft
from eyas.option import DEFAULT_TARGET
from eyas.target.load import load_target
from eyas.train.config import Dist, TrainConfig
from eyas.train.sources import ShardSource
from eyas.train.step import evaluate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draft", action="append", required=True, help="eyas draft folder or 'default' (repeatable)")
    ap.add_argument("--data", action="append", default=[], help="shard folder (repeatable)")
    ap.add_argument("--bench", default=None, help="score on the target's own replies to this bench's prompts")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--heldout-pct", type=float, default=5.0)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--by-category", action="store_true", help="--bench: also one row per prompt category")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    target = load_target(DEFAULT_TARGET, dtype="fp32")
    rows = []
    for folder in a.data:
        src = ShardSource([folder], a.heldout_pct, 2048, a.max_len)
        cfg = TrainConfig(data=[folder], out="", ttt_steps=a.ttt_steps, batch_tokens=2048, max_len=a.max_len,
                          heldout_pct=a.heldout_pct)
        for spec in a.draft:
            d = load_draft(spec)  # 'default': the bundled draft
            d.model.set_embeddings(target.embed_tokens().weight)
            m = evaluate(d.model, src, src.heldout, target, cfg, Dist(), torch.device("cpu"))
            rows.append({"draft": spec, "data": folder, **m})
            acc = " / ".join(f"{x:.3f}" for x in m["heldout_acc"])
            print(f"{spec:50s} {folder:36s} held-out acc {acc}  ({m['heldout_rows'][0]} positions)", flush=True)
    if a.bench:
        rows += bench_rows(target, a)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=2)


def bench_rows(target, a) -> list[dict]:
    from eyas.bench.load import prompt_ids
    from eyas.bench.prompts import load_prompts
    from eyas.engine.decode import Engine
    from eyas.engine.params import SamplingParams, SpecParams
    from eyas.probe import Serving, as_samples, capture_streams, prepare_draft, score_draft

    prompts = load_prompts(a.bench, a.limit)
    eng = Engine(target, None, SpecParams(method="plain"))
    samples = []
    for ids in prompt_ids(target, prompts):
        reply = eng.generate(ids, SamplingParams(max_new_tokens=a.max_new_tokens)).token_ids
        full = torch.tensor(ids + reply)
        mask = torch.zeros_like(full, dtype=torch.bool)
        mask[len(ids):] = True  # the reply tokens, as tokenize_conversation marks an assistant turn
        samples.append((full, mask))
    evs, serving, rows = as_samples(samples), Serving(target), []
    for spec in a.draft:
        d = load_draft(spec)
        draft = prepare_draft(d.model, target)
        idx = list(d.layout.aux_indices)
        fresh = capture_streams(serving, draft, target, evs, set(idx))
        r = score_draft(draft, target, [torch.cat([f.streams[k] for k in idx], -1) for f in fresh],
                        [f.final for f in fresh], evs, a.ttt_steps, [f.labels for f in fresh])
        name = f"{a.bench} x{len(evs)} own replies"
        rows.append({"draft": spec, "data": name, "heldout_acc": r["acc"], "heldout_rows": r["count"],
                     "serving_path": serving.path})
        acc = " / ".join(f"{x:.3f}" for x in r["acc"])
        print(f"{spec:50s} {name:36s} acc {acc}  ({r['count'][0]} positions)", flush=True)
        if a.by_category:
            rows += category_rows(spec, prompts, r)
    return rows


def category_rows(spec: str, prompts, r: dict) -> list[dict]:
    """Per-category step accuracy from score_draft's per-sample counts (samples are in prompt order)."""
    correct, count = torch.as_tensor(r["sample_correct"]), torch.as_tensor(r["sample_count"])  # [samples, steps]
    rows = []
    for cat in sorted({p.category for p in prompts}):
        sel = torch.tensor([p.category == cat for p in prompts])
        c, n = correct[sel].sum(0), count[sel].sum(0)  # [steps]
        acc = (c / n.clamp_min(1)).tolist()
        rows.append({"draft": spec, "data": f"category {cat}", "heldout_acc": acc, "heldout_rows": n.tolist()})
        print(f"{spec:50s} {'  ' + cat:36s} acc {' / '.join(f'{x:.3f}' for x in acc)}  ({int(n[0])} positions)",
              flush=True)
    return rows


if __name__ == "__main__":
    main()
