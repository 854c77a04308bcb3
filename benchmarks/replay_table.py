"""τ from training, replayed and served, side by side: for each draft, its held-out accuracy per position (from its
manifest), the training frameworks' simulated acceptance length from it, the replay's τ, eyas's engine τ and a
live vLLM server's τ, for a chain of k on MT-bench and on 16 other prompts.

    python benchmarks/replay_table.py --drafts default --train-data runs/table-data --checkpoints 4 \\
        --out runs/replay-table [--engine N] [--vllm]

--train-data trains a fresh draft on those shards and keeps a copy of it at each of --checkpoints evenly spaced
saves (each evaluated first, so its manifest holds its held-out accuracy). --engine N runs eyas's engine (fp32)
beside the replay on the first N drafts; --vllm serves each draft's vLLM export (make vllm) and reads its
spec-decode counters.
Prints a markdown table and writes table.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SETS = {"mt-bench": ("mt-bench", 8), "other 16": (str(ROOT / "benchmarks/configs/mt-bench-q9-24.jsonl"), 16)}


def train_checkpoints(data: str, out: Path, n: int, steps: int) -> list[Path]:
    from eyas.train.config import TrainConfig
    from eyas.train.loop import train

    every = max(1, steps // n)
    kept: list[Path] = []

    def keep(step: int) -> None:
        if step % every == 0:
            dst = out / f"ck-{step}"
            shutil.rmtree(dst, ignore_errors=True)
            shutil.copytree(out / "train" / "draft", dst)
            kept.append(dst)

    cfg = TrainConfig(data=[data], out=str(out / "train"), max_steps=every * n, eval_every=every, save_every=every,
                      ttt_steps=3, lr=1e-3, batch_tokens=2048, quiet=True)
    train(cfg, on_step=keep)
    return kept


def served_tau(py: Path, target, draft: str, rows_by_set: dict, k: int, m: int, work: Path) -> dict[str, float]:
    from eyas.doctor.serving import send_rows
    from eyas.interop.export import export_draft
    from tests.test_doctor_serving import _start, _stop, wait_up

    export = export_draft(draft, "vllm", work / f"export-{Path(draft).name}").path
    p, url = _start(py, target.path, {"method": "eagle3", "model": str(export), "num_speculative_tokens": k},
                    work / f"vllm-{Path(draft).name}.log")
    try:
        wait_up(p, url, work / f"vllm-{Path(draft).name}.log")
        out = {}
        for name, rows in rows_by_set.items():
            sent = send_rows(url, rows, m, k, None, 600.0, lambda _m: None)
            d = sent.after.minus(sent.before)
            same = sum(g == rows.reply(i, m) for i, g in enumerate(sent.got))
            out[name] = {"tau": d.tau(), "per_pos": [int(v) for v in d.per_pos], "drafts": int(d.drafts),
                         "same_tokens": same}
        return out
    finally:
        _stop(p)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafts", default="default", help="comma-separated eyas drafts")
    ap.add_argument("--train-data", help="shards: train a fresh draft and add its checkpoints")
    ap.add_argument("--checkpoints", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200, help="training steps in all, with --train-data")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--engine", type=int, default=0, help="also run eyas's engine (fp32) on the first N drafts")
    ap.add_argument("--vllm", action="store_true", help="also serve each draft in vLLM (make vllm)")
    ap.add_argument("--out", default="runs/replay-table")
    a = ap.parse_args()

    import torch

    from eyas.bench.environment import cpu_name
    from eyas.bench.prompts import load_prompts
    from eyas.draft import load_draft
    from eyas.engine.decode import Engine
    from eyas.engine.params import SamplingParams
    from eyas.engine.prompt import chat_input_ids
    from eyas.option import DEFAULT_TARGET
    from eyas.replay.heldout import simulated_length
    from eyas.replay.rows import cached_rows_eyas, plant_streams
    from eyas.replay.run import chain, replay
    from eyas.target.load import load_target

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    drafts = [d for d in a.drafts.split(",") if d]
    if a.train_data:
        drafts += [str(p) for p in train_checkpoints(a.train_data, out, a.checkpoints, a.steps)]
    target = load_target(DEFAULT_TARGET, dtype="fp32")
    aux = list(load_draft(drafts[0]).layout.aux_indices)
    rows_by_set = {}
    for name, (bench, n) in SETS.items():
        ids = [chat_input_ids(target.tokenizer, r.messages) for r in load_prompts(bench, limit=n)]
        rows_by_set[name] = cached_rows_eyas(target, ids, a.max_new_tokens, plant_streams(aux, target.num_layers))
    py = None
    if a.vllm:
        from eyas.vllm.env import vllm_python

        py = vllm_python(needed_for="replay_table --vllm")
    table = []
    for j, d in enumerate(drafts):
        ck = load_draft(d)
        acc = (ck.manifest.get("metrics") or {}).get("heldout_acc") or []
        row = {"draft": d, "step": ck.manifest.get("step"), "heldout_acc": acc,
               "simulated_tau": simulated_length(acc, a.k) if acc else None, "sets": {}}
        for name, rows in rows_by_set.items():
            t0 = time.perf_counter()
            res = replay(rows, target, ck, chain(a.k))
            cell = {"replay_tau": res.tau, "replay_per_pos": res.per_pos, "drafts": res.rounds,
                    "replay_s": round(time.perf_counter() - t0, 1)}
            if j < a.engine:
                eng = Engine(target, load_draft(d), chain(a.k))
                eng.eos = set(rows.eos)
                acc_e, rounds = 0, 0
                for i in range(len(rows)):
                    r = eng.generate(rows.prompt(i), SamplingParams(max_new_tokens=a.max_new_tokens))
                    acc_e += sum(r.stats.accepted_per_depth[:a.k])
                    rounds += r.stats.rounds
                cell["engine_tau"] = 1 + acc_e / rounds if rounds else 0.0
            row["sets"][name] = cell
        if py is not None:
            for name, s in served_tau(py, target, d, rows_by_set, a.k, a.max_new_tokens, out).items():
                row["sets"][name]["vllm"] = s
        table.append(row)
        print(json.dumps(row), flush=True)
    (out / "table.json").write_text(json.dumps({"cpu": cpu_name(), "torch": torch.__version__, "k": a.k,
                                                "max_new_tokens": a.max_new_tokens, "rows": table}, indent=2))
    print(f"\nchain k={a.k}, {a.max_new_tokens} new tokens; {cpu_name()}")
    print("| draft | step | held-out acc (pos 1-3) | simulated τ | set | replay τ | engine τ | vLLM τ |")
    print("|---|---|---|---|---|---|---|---|")
    for row in table:
        for name, c in row["sets"].items():
            sim = f"{row['simulated_tau']:.2f}" if row["simulated_tau"] else "-"
            eng = f"{c['engine_tau']:.3f}" if "engine_tau" in c else "-"
            vl = f"{c['vllm']['tau']:.3f}" if "vllm" in c else "-"
            accs = " / ".join(f"{x:.2f}" for x in row["heldout_acc"][:3]) or "-"
            print(f"| {Path(row['draft']).name} | {row['step']} | {accs} | {sim} | {name} | {c['replay_tau']:.3f} | "
                  f"{eng} | {vl} |")


if __name__ == "__main__":
    main()
