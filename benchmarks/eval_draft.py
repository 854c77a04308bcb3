"""Held-out accuracy of eyas drafts on shard folders' held-out rows, side by side.

Each --data folder's held-out rows (the split training uses: --heldout-pct of the source rows, by row id, the
same rows in every folder) are scored with the training loop's own evaluation (TTT steps 0..N-1, fp32). With
a folder of regenerated replies this is the accuracy on the target's own replies, the figure acceptance
follows when serving.

    .venv/bin/python benchmarks/eval_draft.py --draft default --draft runs/recipe/train-x/draft \\
        --data runs/recipe/data-regen [--data runs/mix/data-regen] [--ttt-steps 3] [--threads 2]

Prints one row per (draft, folder) and writes --out (JSON) when given.
"""

from __future__ import annotations

import argparse
import json

import torch

from eyas.draft import load_draft
from eyas.target import load_target
from eyas.train.config import Dist, TrainConfig
from eyas.train.loop import evaluate
from eyas.train.sources import ShardSource


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draft", action="append", required=True, help="eyas draft folder or 'default' (repeatable)")
    ap.add_argument("--data", action="append", required=True, help="shard folder (repeatable)")
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--heldout-pct", type=float, default=5.0)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    target = load_target("smollm2-135m", dtype="fp32")
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
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
