"""Bench rows and their summaries: one row per (prompt, method), the lossless marks against the reference, and
tok/s (end to end, and after the prefill where a method times it), tau, acceptance per depth and speedups per
method and per category."""

from __future__ import annotations

from typing import Any

from .methods import Output
from .prompts import BenchPrompt
from .vllm_peer import accept_rates as vllm_accept_rates


def first_diff(a: list[int], b: list[int]) -> int | None:
    """First position where two token lists differ (the shorter length if one is a prefix); None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def make_row(p: BenchPrompt, method: str, o: Output) -> dict[str, Any]:
    row: dict[str, Any] = {
        "prompt": p.id, "category": p.category, "method": method, "new_tokens": len(o.token_ids),
        "seconds": round(o.seconds, 6), "tok_s": len(o.token_ids) / o.seconds if o.seconds > 0 else 0.0,
        "target_forwards": o.target_forwards, "finish": o.finish, "token_ids": o.token_ids,
    }
    if o.prefill_s is not None:
        row["prefill_s"] = round(o.prefill_s, 6)
    if o.stats is not None:
        row["stats"] = o.stats
        row["tau"] = o.stats["tau"]
    else:  # GenStats.tau's definition: tokens after the prefill's (an end token included) per later forward
        generated = len(o.token_ids) + (1 if o.finish == "stop" else 0)
        row["tau"] = (generated - 1) / (o.target_forwards - 1) if o.target_forwards > 1 else None
    return row


def mark_lossless(rows: list[dict[str, Any]], reference: str | None) -> None:
    """Set same_as_ref / first_diff on every row of one prompt (rows of all methods)."""
    ref = next((r for r in rows if r["method"] == reference), None)
    for r in rows:
        if ref is None or r["method"] == reference:
            r["same_as_ref"], r["first_diff"] = None, None
        else:
            d = first_diff(ref["token_ids"], r["token_ids"])
            r["same_as_ref"], r["first_diff"] = d is None, d


def decode_tok_s(rows: list[dict[str, Any]]) -> float | None:
    """Tokens after the prefill's one per second after the prefill, over rows that time their prefill (eyas: its
    stats; the llama.cpp peers: prefill_s); None when some row does not (HF, vLLM)."""
    pre = [r.get("prefill_s", (r.get("stats") or {}).get("prefill_s")) for r in rows]
    if not rows or any(p is None for p in pre):
        return None
    tokens = sum(r["new_tokens"] + (r["finish"] == "stop") - 1 for r in rows)
    secs = sum(r["seconds"] - p for r, p in zip(rows, pre, strict=True))
    return tokens / secs if secs > 0 else None


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    tokens = sum(r["new_tokens"] for r in rows)
    secs = sum(r["seconds"] for r in rows)
    s: dict[str, Any] = {"prompts": len(rows), "new_tokens": tokens, "seconds": round(secs, 4),
                         "tok_s": tokens / secs if secs > 0 else 0.0, "decode_tok_s": decode_tok_s(rows)}
    stats = [r["stats"] for r in rows if "stats" in r]
    if stats:  # eyas: tau over all rounds, acceptance per depth pooled over prompts
        rounds = sum(st["rounds"] for st in stats)
        s["tau"] = sum(st["new_tokens"] - 1 for st in stats) / rounds if rounds else None
        depth = max(len(st["proposed_per_depth"]) for st in stats)
        acc = [sum(st["accepted_per_depth"][d] for st in stats if d < len(st["accepted_per_depth"]))
               for d in range(depth)]
        prop = [sum(st["proposed_per_depth"][d] for st in stats if d < len(st["proposed_per_depth"]))
                for d in range(depth)]
        s["accept_per_depth"] = [a / p if p else None for a, p in zip(acc, prop, strict=True)]
        draft_s = sum(st["draft_s"] for st in stats)
        round_s = sum(st["total_s"] - st["prefill_s"] for st in stats)
        s["draft_s"] = round(draft_s, 4)
        # tokens accepted from lookup-only tree nodes: tau minus this share is what EAGLE-3 alone accepted
        s["lookup_accepted"] = sum(st.get("lookup_accepted", 0) for st in stats)
        s["lookup_share"] = s["lookup_accepted"] / max(sum(st["new_tokens"] for st in stats), 1)
        s["ngram_accepted"] = sum(st.get("ngram_accepted", 0) for st in stats)
        s["ngram_proposed"] = sum(st.get("ngram_proposed", 0) for st in stats)
        s["ngram_share"] = s["ngram_accepted"] / max(sum(st["new_tokens"] for st in stats), 1)
        s["draft_overhead"] = draft_s / round_s if round_s > 0 and depth else None
    else:
        fwd = sum(r["target_forwards"] - 1 for r in rows)
        gen = sum(r["new_tokens"] + (r["finish"] == "stop") - 1 for r in rows)
        s["tau"] = gen / fwd if fwd else None
        s["accept_per_depth"] = vllm_accept_rates(rows)  # vllm-eagle3: from vLLM's own counters; else None
        s["draft_overhead"] = None
    compared = [r for r in rows if r.get("same_as_ref") is not None]
    s["identical"] = sum(bool(r["same_as_ref"]) for r in compared)
    s["compared"] = len(compared)
    s["mismatches"] = [{"prompt": r["prompt"], "first_diff": r["first_diff"]} for r in compared
                       if not r["same_as_ref"]]
    return s


def summarize(rows: list[dict[str, Any]], methods: list[str]) -> dict[str, Any]:
    """{"methods": {m: summary}, "categories": {cat: {m: summary}}} with speedups vs HF greedy and plain."""

    def block(sub: list[dict[str, Any]]) -> dict[str, Any]:
        out = {m: _summary([r for r in sub if r["method"] == m]) for m in methods}
        for base, key in (("hf-greedy", "speedup_vs_hf"), ("plain", "speedup_vs_plain")):
            b = out.get(base, {}).get("tok_s")
            for s in out.values():
                s[key] = s["tok_s"] / b if b else None
        return out

    cats = sorted({r["category"] for r in rows})
    return {"methods": block(rows), "categories": {c: block([r for r in rows if r["category"] == c]) for c in cats},
            "noise": repeat_spread(rows)}


def repeat_spread(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """plain against itself: its first and repeated runs over the same prompts (bench --repeat-plain). `spread` is
    how far apart the two totals are (|ratio - 1|): a speedup inside 1 ± spread is not a measured difference.
    `same` counts prompts whose repeat gave the same tokens (plain is deterministic; anything else is a bug)."""
    reps = [r for r in rows if r["method"] == "plain" and "repeat_seconds" in r]
    first, again = sum(r["seconds"] for r in reps), sum(r["repeat_seconds"] for r in reps)
    if not reps or first <= 0 or again <= 0:
        return None
    return {"prompts": len(reps), "ratio": again / first, "spread": abs(again / first - 1),
            "same": sum(bool(r["repeat_same"]) for r in reps)}


def within_noise(speedup: float | None, noise: dict[str, Any] | None) -> bool:
    """A speedup (vs plain) no further from 1x than plain is from itself."""
    if speedup is None or speedup <= 0 or not noise:
        return False
    return max(speedup, 1 / speedup) <= 1 + noise["spread"]

