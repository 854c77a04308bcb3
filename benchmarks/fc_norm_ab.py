"""EAGLE 3.1 (fc_norm) against EAGLE-3: two drafts trained by `eyas train` on the same shards with the same seed,
steps and options, one with --fc-norm; then τ (tokens per target forward after prefill) of each, greedy, at the CPU
default tree and at the reference tree (depth 6, topk 10, 60 tokens), on MT-bench and on long prompts (eyas's own
docs, >= 2k tokens each, to summarise).

    .venv/bin/python benchmarks/fc_norm_ab.py --data runs/table-data --steps 80 --limit 8 --long 2 \\
        --max-new-tokens 64 --train-args "--ttt-steps 3 --batch-tokens 2048 --lr 1e-3" --out runs/fcnorm-ab

Both drafts decode losslessly, so their outputs must be token-identical: the script checks it. Writes
OUT/results.json and prints one row per (draft, tree, prompt set) with the CPU's name.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from eyas.bench.environment import cpu_name
from eyas.bench.prompts import load_prompts
from eyas.draft import load_draft
from eyas.engine.decode import Engine
from eyas.engine.params import TREE_DEFAULTS, SamplingParams, SpecParams
from eyas.engine.prompt import chat_input_ids
from eyas.option import DEFAULT_TARGET
from eyas.target.load import load_target

TREES = {"cpu-default": SpecParams("tree", **{k: v for k, v in TREE_DEFAULTS["cpu"].items() if k != "steps"}),
         "reference-6/10/60": SpecParams("tree", depth=6, topk=10, tokens=60, lookup=0, min_prob=0.0),
         # the CPU default's shape without its context lookup: the drafts alone
         "cpu-default-no-lookup": SpecParams("tree", **{k: v for k, v in TREE_DEFAULTS["cpu"].items()
                                                        if k not in ("steps", "lookup")}, lookup=0)}
DRAFTS = {"eagle3": [], "eagle3.1": ["--fc-norm"]}


def train(a: argparse.Namespace, name: str, extra: list[str]) -> Path:
    out = Path(a.out) / name
    if (out / "draft" / "model.safetensors").is_file():
        return out / "draft"
    cmd = [sys.executable, "-m", "eyas", "train", *sum((["--data", d] for d in a.data), []), "--out", str(out),
           "--max-steps", str(a.steps), "--seed", "0", "--threads", str(a.threads), "--eval-every", str(a.steps),
           "--save-every", str(a.steps), "--quiet", *a.train_args.split(), *extra]
    print("$", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    print(f"  trained in {time.perf_counter() - t0:.0f} s", flush=True)
    return out / "draft"


def long_prompts(tok, n: int, min_tokens: int = 2048) -> list[list[int]]:
    """Summarise-this prompts over eyas's docs, each at least `min_tokens` after the chat template."""
    text = "\n\n".join(p.read_text() for p in sorted(Path(__file__).parent.parent.glob("docs/*.md")))
    words, out, start = text.split(" "), [], 0
    while len(out) < n and start < len(words):
        end = start + 1200
        while end <= len(words):
            msg = [{"role": "user", "content": "Summarise this text:\n\n" + " ".join(words[start:end])}]
            ids = chat_input_ids(tok, msg)
            if len(ids) >= min_tokens:
                out.append(ids)
                break
            end += 200
        start = end
    return out


def heldout(draft: Path) -> dict:
    lines = (draft.parent / "metrics.jsonl").read_text().splitlines()
    evals = [json.loads(x) for x in lines if "heldout_acc" in x]
    return {k: evals[-1].get(k) for k in ("step", "heldout_acc", "replay_tau")} if evals else {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", action="append", required=True, help="shard folder (repeatable)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--train-args", default="", help="more `eyas train` options, the same for both drafts")
    ap.add_argument("--limit", type=int, default=8, help="MT-bench prompts")
    ap.add_argument("--long", type=int, default=2, help="long prompts (>= 2k tokens)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="runs/fcnorm-ab")
    ap.add_argument("--trees", default="cpu-default,reference-6/10/60", help=f"comma list of {', '.join(TREES)}")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    drafts = {name: train(a, name, extra) for name, extra in DRAFTS.items()}
    target = load_target(DEFAULT_TARGET)
    sets = {"mt-bench": [chat_input_ids(target.tokenizer, p.messages) for p in load_prompts("mt-bench", a.limit)],
            "long": long_prompts(target.tokenizer, a.long)}
    rows, outputs = [], {}
    for name, path in drafts.items():
        ck = load_draft(path)
        for tree in a.trees.split(","):
            spec = TREES[tree]
            eng = Engine(target, ck, spec)
            for set_name, prompts in sets.items():
                new = rounds = 0
                t0 = time.perf_counter()
                for i, ids in enumerate(prompts):
                    r = eng.generate(ids, SamplingParams(max_new_tokens=a.max_new_tokens))
                    new, rounds = new + r.stats.new_tokens - 1, rounds + r.stats.rounds
                    same = outputs.setdefault((tree, set_name, i), r.token_ids) == r.token_ids
                    if not same:
                        print(f"WARNING: {name} {tree} {set_name}[{i}] differs from the other draft's output")
                row = {"draft": name, "tree": tree, "set": set_name, "prompts": len(prompts),
                       "prompt_tokens": [len(p) for p in prompts], "tau": new / rounds if rounds else 0.0,
                       "seconds": round(time.perf_counter() - t0, 1)}
                rows.append(row)
                print(f"{name:9s} {tree:18s} {set_name:9s} τ {row['tau']:.3f}  ({len(prompts)} prompts, "
                      f"{row['seconds']} s)", flush=True)
    result = {"cpu": cpu_name(), "command": " ".join(sys.argv), "steps": a.steps, "data": a.data,
              "max_new_tokens": a.max_new_tokens, "heldout": {n: heldout(p) for n, p in drafts.items()},
              "rows": rows}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    name = "results.json" if a.trees == ap.get_default("trees") else f"results-{a.trees.replace('/', '-')}.json"
    (Path(a.out) / name).write_text(json.dumps(result, indent=2))
    print(f"CPU: {result['cpu']}; held-out: {result['heldout']}")


if __name__ == "__main__":
    main()
