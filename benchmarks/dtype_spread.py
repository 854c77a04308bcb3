"""The spread of the right export's acceptance across dtypes: vLLM serving the bundled target and the shipped
draft's export in --dtype DTYPE, against the replay on rows captured by eyas's engine in fp32 (what `eyas doctor
serving` compares). The largest per-position rate difference over the prompt sets is what its tolerance for other
numerics (eyas.doctor.serving.RATE_TOL) must cover.

    python benchmarks/dtype_spread.py --dtype bfloat16 [--k 3] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SETS = {"mt-bench": ("mt-bench", 8), "other 16": (str(ROOT / "benchmarks/configs/mt-bench-q9-24.jsonl"), 16)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    a = ap.parse_args()

    from eyas.bench.environment import cpu_name
    from eyas.bench.prompts import load_prompts
    from eyas.doctor.serving import send_rows
    from eyas.engine.prompt import chat_input_ids
    from eyas.interop.export import export_draft
    from eyas.option import DEFAULT_TARGET
    from eyas.replay.rows import cached_rows_eyas, plant_streams
    from eyas.replay.run import chain, replay
    from eyas.target.load import load_target
    from eyas.vllm.env import vllm_python
    from tests.test_doctor_serving import _start, _stop, wait_up

    target = load_target(DEFAULT_TARGET, dtype="fp32")
    rows = {}
    for name, (bench, n) in SETS.items():
        ids = [chat_input_ids(target.tokenizer, r.messages) for r in load_prompts(bench, limit=n)]
        rows[name] = cached_rows_eyas(target, ids, a.max_new_tokens, plant_streams([2, 15, 27], target.num_layers))
    work = Path(tempfile.mkdtemp(prefix="eyas-dtype-"))
    export = export_draft("default", "vllm", work / "export").path
    py = vllm_python(needed_for="dtype_spread")
    p, url = _start(py, target.path, {"method": "eagle3", "model": str(export), "num_speculative_tokens": a.k},
                    work / "vllm.log", dtype=a.dtype)
    out = {"cpu": cpu_name(), "dtype": a.dtype, "k": a.k, "max_new_tokens": a.max_new_tokens, "sets": {}}
    try:
        wait_up(p, url, work / "vllm.log")
        for name, r in rows.items():
            sent = send_rows(url, r, a.max_new_tokens, a.k, None, 600.0, lambda _m: None)
            d = sent.after.minus(sent.before)
            rep = replay(r, target, "default", chain(a.k), a.max_new_tokens)
            diff = [abs(s - m) for s, m in zip(d.rates(), rep.rates, strict=True)]
            out["sets"][name] = {"server": [int(v) for v in d.per_pos], "server_drafts": int(d.drafts),
                                 "replay": rep.per_pos, "replay_drafts": rep.rounds,
                                 "same_tokens": sum(g == r.reply(i) for i, g in enumerate(sent.got)),
                                 "prompts": len(r), "max_rate_diff": max(diff)}
            print(name, json.dumps(out["sets"][name]), flush=True)
    finally:
        _stop(p)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
