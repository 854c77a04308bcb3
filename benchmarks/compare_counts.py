"""Whether two `eyas bench` runs counted the same: per eyas method and prompt, the token ids, rounds, target
forwards, accepted and proposed tokens per depth and what lookup and the n-gram table proposed and had accepted,
and per method the lossless marks. Speed is left out (it depends on the machine and its load); the counts depend
on the code alone, so a refactor that must not change a single token shows it here.

    python benchmarks/compare_counts.py OLD/results.json NEW/results.json [--methods plain,tree]

Prints one line per method (equal, or the first prompt and field that differ) and exits 1 when any differ.
The figure behind "the counts did not change" in the CHANGELOG: the main bench (make demo's methods, 8 MT-bench
questions x 128 tokens, --threads 1) run at the last release and at the new commit, then compared with this.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# the GenStats counters a decode's outcome fixes (no timings)
COUNTS = ("prompt_tokens", "new_tokens", "target_forwards", "rounds", "accepted_per_depth", "proposed_per_depth",
          "lookup_proposed", "lookup_accepted", "ngram_proposed", "ngram_accepted")
ENGINE = ("plain", "chain", "tree", "tree-lookup", "lookup", "lookup-context")


def counted(row: dict) -> dict:
    stats = row.get("stats") or {}
    return {"token_ids": row["token_ids"], "same_as_ref": row.get("same_as_ref"),
            **{k: stats.get(k) for k in COUNTS}}


def compare(old: dict, new: dict, methods: list[str]) -> list[str]:
    """One line per method; a line starting with 'DIFF' names the first difference."""
    def rows(res: dict) -> dict:
        return {(r["method"], r["prompt"]): counted(r) for r in res["rows"]}

    a, b = rows(old), rows(new)
    lines = []
    for m in methods:
        keys = sorted(k for k in a if k[0] == m)
        if not keys or {k for k in b if k[0] == m} != set(keys):
            lines.append(f"DIFF {m}: prompts {len(keys)} vs {sum(1 for k in b if k[0] == m)}")
            continue
        diff = next(((k[1], f) for k in keys for f in a[k] if a[k][f] != b[k][f]), None)
        sa, sb = old["summary"]["methods"][m], new["summary"]["methods"][m]
        summary = f"tau {sa['tau']:.4f}, identical {sa['identical']}/{sa['compared']}"
        if diff is None and (sa["tau"], sa["identical"]) == (sb["tau"], sb["identical"]):
            lines.append(f"equal {m}: {len(keys)} prompts, {sum(len(a[k]['token_ids']) for k in keys)} tokens, "
                         + summary)
        else:
            lines.append(f"DIFF {m}: prompt {diff[0]} field {diff[1]}" if diff else
                         f"DIFF {m}: {summary} vs tau {sb['tau']:.4f}, identical {sb['identical']}/{sb['compared']}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--methods", default=None, help="default: every eyas method both runs have")
    a = ap.parse_args()
    old, new = (json.loads(Path(p).read_text()) for p in (a.old, a.new))
    have = [m for m in ENGINE if m in old["summary"]["methods"] and m in new["summary"]["methods"]]
    methods = a.methods.split(",") if a.methods else have
    lines = compare(old, new, methods)
    print("\n".join(lines))
    return 1 if any(line.startswith("DIFF") for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
