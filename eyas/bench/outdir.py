"""The bench's results folder: a new one, or an earlier run's continued with --resume (every finished
prompt-method run is kept, and only under the same settings)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ..files import atomic_write_json
from ..target.load import Target
from .config import BenchConfig, BenchError

# the fields that must agree for `--resume` to continue an earlier run's rows
RESUME_KEYS = ("bench", "limit", "turn", "max_new_tokens", "target", "draft", "dtype", "device", "weights",
               "draft_weights", "methods",
               "tree", "lookup_tokens", "ngram",
               "chat_template", "raw", "vllm_k")
SWEEP_RESUME_KEYS = ("bench", "limit", "turn", "max_new_tokens", "target", "draft", "dtype", "device", "weights",
                     "sweep_limit", "grid", "chat_template", "raw")


def default_out(prefix: str = "bench") -> Path:
    return Path("runs") / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}"


def _load_rows(path: Path, methods: list[str]) -> list[dict[str, Any]]:
    """Every finished prompt-method run of the methods asked (the unit a bench writes); a torn last line (a kill
    mid-write) is dropped, and so is a run written twice."""
    rows, seen = [], set()
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            break
        key = (r.get("prompt"), r.get("method"))
        if r.get("method") in methods and key not in seen:
            seen.add(key)
            rows.append(r)
    return rows


def prepare_out(cfg: BenchConfig, out: Path, target: Target, keys: tuple[str, ...] = RESUME_KEYS,
                 methods: list[str] | None = None) -> list[dict[str, Any]]:
    """Create `out`, or continue it with --resume; returns the prompt-method runs already done."""
    rows_path, cfg_path = out / "rows.jsonl", out / "config.json"
    if out.exists() and not out.is_dir():
        raise BenchError(f"--out {out} is a file; expected a results folder (new, or an earlier run's to --resume)")
    me = {**{k: cfg.to_dict()[k] for k in keys}, "target_fingerprint": target.identity.fingerprint}
    if rows_path.exists() and rows_path.stat().st_size > 0:
        if not cfg.resume:
            raise BenchError(f"{out} already holds rows of a bench run; pass --resume to continue it, or another --out")
        try:
            old = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        except json.JSONDecodeError as e:
            raise BenchError(f"--resume {out}: {cfg_path} is not valid JSON ({e}), so the earlier run's settings "
                             "are unknown; start over in another --out") from e
        diff = [f"{k}: {old.get(k)!r} there, {v!r} now" for k, v in me.items() if old.get(k) != v]
        if diff:
            raise BenchError(f"--resume {out}: the run there used other settings ({'; '.join(diff)}); "
                             "rerun with the same settings or choose another --out")
        rows = _load_rows(rows_path, methods or cfg.methods)
        rows_path.write_text("".join(json.dumps(r) + "\n" for r in rows))  # drop a torn line
        return rows
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(cfg_path, me)
    rows_path.write_text("")
    return []

