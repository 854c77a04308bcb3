"""vLLM greedy generation on given prompt token ids, optionally with an EAGLE-3 draft; run by vLLM's own python.

    python generate_worker.py request.json out_dir

This file imports vLLM and never eyas (eyas's environment has no vLLM, vLLM's has no eyas): eyas writes the
request and reads out_dir/result.json (eyas/vllm/env.py run_worker). Request keys:
  model            the target's HF folder
  draft, k         an `eyas export --format vllm` folder and num_speculative_tokens (draft null: plain decoding)
  method           vLLM's speculative method name (default "eagle3": "eagle" would not capture the aux states)
  prompts          prompt token id lists (sent as TokensPrompt, so no tokenizer or template can differ)
  max_new_tokens, stop_token_ids, dtype (float32|bfloat16|float16), max_model_len, seed,
  warmup_tokens    one untimed generation of prompts[0] first (lazy init, allocations)
  enforce_eager    true: no torch.compile / graph capture (minutes of compiling on a small CPU)
The prompts run one at a time (batch 1, like eyas's engine), each timed by wall clock around its generate call
(prefill included). vLLM's spec-decode counters (Prometheus, read through LLM.get_metrics(), which needs
disable_log_stats=False) are read before and after each prompt, so every prompt gets its own differences.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

SPEC_COUNTERS = {  # vllm/v1/spec_decode/metrics.py names -> result keys
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_counters(llm, k: int) -> dict:
    """The spec-decode counters summed over engines (one here): drafts, draft_tokens, accepted, and
    accepted_per_pos[i] = drafts whose token at draft position i was accepted (so its prefix was too)."""
    from vllm.v1.metrics.reader import Counter, Vector

    out: dict[str, Any] = {key: 0 for key in SPEC_COUNTERS.values()}  # counts, and accepted_per_pos's list
    per_pos = [0] * k
    for m in llm.get_metrics():
        if isinstance(m, Counter) and m.name in SPEC_COUNTERS:
            out[SPEC_COUNTERS[m.name]] += int(m.value)
        elif isinstance(m, Vector) and m.name == PER_POS:
            for i, v in enumerate(m.values[:k]):
                per_pos[i] += int(v)
    out["accepted_per_pos"] = per_pos
    return out


def diff(after: dict, before: dict) -> dict:
    return {key: ([a - b for a, b in zip(v, before[key], strict=True)] if isinstance(v, list) else v - before[key])
            for key, v in after.items()}


def main(request_path: str, out_dir: str) -> None:
    req = json.loads(Path(request_path).read_text())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    k = int(req.get("k") or 0) if req.get("draft") else 0
    spec = ({"method": req.get("method", "eagle3"), "model": req["draft"], "num_speculative_tokens": k}
            if k else None)
    t0 = time.perf_counter()
    llm = LLM(model=req["model"], tokenizer=req["model"], dtype=req.get("dtype", "float32"),
              max_model_len=int(req.get("max_model_len", 2048)), seed=int(req.get("seed", 0)),
              enforce_eager=bool(req.get("enforce_eager", True)),
              disable_log_stats=False,  # without stats there are no spec-decode counters to read
              enable_prefix_caching=False,  # every prompt pays its prefill, as in eyas's engine
              generation_config="vllm",  # no generation_config.json defaults (penalties) on top of pure argmax
              max_num_seqs=1, speculative_config=spec)
    load_s = time.perf_counter() - t0

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, stop_token_ids=list(req.get("stop_token_ids") or []),
                              detokenize=False, seed=int(req.get("seed", 0)))

    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in req["prompts"]]
    if prompts and int(req.get("warmup_tokens", 0)) > 0:
        llm.generate(prompts[:1], params(int(req["warmup_tokens"])), use_tqdm=False)
    start = spec_counters(llm, k) if k else None
    outputs = []
    for i, p in enumerate(prompts):
        before = spec_counters(llm, k) if k else None
        t = time.perf_counter()
        res = llm.generate([p], params(int(req["max_new_tokens"])), use_tqdm=False)[0]
        dt = time.perf_counter() - t
        o = res.outputs[0]
        ids = [int(x) for x in o.token_ids]
        outputs.append({"token_ids": ids, "seconds": dt, "finish_reason": o.finish_reason,
                        "spec": diff(spec_counters(llm, k), before) if before is not None else None})  # k > 0
        print(f"vllm worker: prompt {i + 1}/{len(prompts)}: {len(ids)} tokens in {dt:.2f}s "
              f"({len(ids) / dt if dt > 0 else 0:.1f} tok/s)", file=sys.stderr, flush=True)
    result = {
        "vllm_version": vllm.__version__, "torch_version": torch.__version__, "load_seconds": load_s,
        "speculative_config": spec, "dtype": req.get("dtype", "float32"),
        "outputs": outputs,
        # the timed prompts, warm-up excluded (start is None exactly when k == 0)
        "spec_total": diff(spec_counters(llm, k), start) if start is not None else None,
    }
    tmp = out / "result.json.tmp"
    tmp.write_text(json.dumps(result))
    tmp.replace(out / "result.json")


if __name__ == "__main__":  # the guard matters: vLLM's engine core starts in a spawned process
    if len(sys.argv) != 3:
        sys.exit("usage: python generate_worker.py request.json out_dir")
    main(sys.argv[1], sys.argv[2])
