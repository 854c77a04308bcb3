"""datagen's manifest: the folder's identity (refusing a rerun with other settings), its lock, the commit
records a resume rolls back to when a shard is damaged, and the end-of-run summary."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..files import damaged, remove_stale_temps
from ..layout import Layout, LayoutError, check_layouts
from ..target.convert import file_fingerprint
from ..target.load import Target
from ..target.template import describe_record, fix_for, same_template
from .conversations import SELF_SOURCE, resolve_source
from .datagen_config import LISTED_ROWS, SKIP_HINTS, DatagenConfig, DatagenError
from .regen import SELF_PROMPT
from .shards import FORMAT_VERSION, KIND, MANIFEST, ShardError, load_manifest, read_fields

SHARD_GLOB = "shard-*.safetensors"

# config keys that define the dataset's content: a rerun into the same folder must match them
_IDENTITY_KEYS = ("source", "source_fingerprint", "start_row", "max_len", "regenerate", "max_turns", "dtype",
                  "target_dtype", "engine")
_REGEN_KEYS = ("temperature", "top_p", "seed", "max_new_tokens", "repetition_limit", "regen_weights")
_LEGACY = {"regen_weights": "fp32", "start_row": 0, "engine": "eyas"}  # manifests from before the key: what they ran


def manifest_config(cfg: DatagenConfig, source: str, source_fp: str) -> dict[str, Any]:
    return {
        "source": source, "source_fingerprint": source_fp, "start_row": cfg.start_row, "max_len": cfg.max_len,
        "regenerate": cfg.regenerate,
        "temperature": cfg.temperature, "top_p": cfg.top_p, "seed": cfg.seed, "max_new_tokens": cfg.max_new_tokens,
        "max_turns": cfg.max_turns, "repetition_limit": cfg.repetition_limit, "dtype": cfg.dtype,
        "target_dtype": cfg.target_dtype, "num": cfg.num, "shard_samples": cfg.shard_samples,
        "shard_tokens": cfg.shard_tokens, "threads": torch.get_num_threads(),
        # vLLM writes the replies in its own numerics: a folder is never resumed with the other engine's
        "regen_weights": "vllm" if cfg.engine == "vllm" else cfg.regen_weights, "engine": cfg.engine,
    }


def source_identity(data: str) -> tuple[str, str]:
    if data == SELF_SOURCE:
        return SELF_SOURCE, f"self-prompt {SELF_PROMPT}"  # a change to how user turns are sampled is refused
    path = resolve_source(data)
    return ("sharegpt" if data == "sharegpt" else str(path.resolve())), file_fingerprint([path])

def lock_folder(out: Path):
    """An exclusive lock on the folder so two runs never interleave commits; released by the OS on a kill."""
    import fcntl

    f = open(out / ".datagen.lock", "a+")  # noqa: SIM115 (held for the whole run)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        f.close()
        raise DatagenError(f"another `eyas datagen` is writing into {out}; wait for it or use another --out") from e
    return f


def _refuse_mismatch(out: Path, m: dict[str, Any], layout: Layout, target_source: str,
                     conf: dict[str, Any], template: dict[str, Any]) -> None:
    problems: list[str] = []
    try:
        check_layouts(Layout.from_dict(m["layout"]), layout, f"{out} (existing)", "this run")
    except LayoutError as e:
        problems.append(str(e))
    old = m.get("config", {})
    keys = _IDENTITY_KEYS + (_REGEN_KEYS if conf["regenerate"] or old.get("regenerate") else ())
    diff = [k for k in keys if old.get(k, _LEGACY.get(k)) != conf[k]]
    if diff:
        problems.append("config differs: " + "; ".join(
            f"{k}: existing {old.get(k, _LEGACY.get(k))!r}, this run {conf[k]!r}" for k in diff))
    if not same_template(m.get("chat_template"), template):
        problems.append(f"chat template differs: existing {describe_record(m.get('chat_template'))}, this run "
                        f"{describe_record(template)} ({fix_for(m.get('chat_template'))} to resume)")
    if problems:
        # the target only when it is what changed: the same path twice reads as if it were the difference
        was = m.get("target_source")
        target = f" (target_source was {was!r}, now {target_source!r})" if was != target_source else ""
        raise DatagenError(
            f"refusing to add to {out}: it was made with different settings{target}.\n" + "\n".join(problems) +
            "\nfix: rerun with the original settings to resume, or write to a new --out folder")


def open_manifest(out: Path, cfg: DatagenConfig, target: Target, layout: Layout,
                   conf: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    if (out / MANIFEST).exists():
        try:
            m = load_manifest(out)
        except ShardError as e:
            raise DatagenError(f"{out} holds a {MANIFEST} that is not an eyas shard manifest ({e}); "
                               "use another --out folder") from e
        _refuse_mismatch(out, m, layout, cfg.target, conf, target.chat_template.record())
        m["config"]["num"] = cfg.num  # --num may grow (extends the run) or change; it does not alter content
        for k in ("shard_samples", "shard_tokens", "threads"):  # speed settings only: may change on resume
            m["config"][k] = conf[k]
        c = m.get("counts") or {}
        if c.get("conversations"):
            log(f"resuming {out}: {c.get('conversations', 0)} conversations in {len(m['shards'])} shards are "
                f"committed; going on after source row {m['watermark']}")
    else:
        layout.norms = {}
        m = {
            "kind": KIND, "format_version": FORMAT_VERSION, "layout": layout.to_dict(),
            "target_source": cfg.target, "target": target.identity.to_dict(), "config": conf,
            "chat_template": target.chat_template.record(),
            "shards": [], "watermark": cfg.start_row - 1, "complete": False,
            "counts": {}, "skipped": {}, "norm_sums": {}, "norm_tokens": 0, "commands": [], "versions": _versions(),
        }
    m.setdefault("skipped_rows", {})  # folders written before rows were listed have none
    m.setdefault("commits", [])  # folders written before commits were recorded have none
    if not m["commits"]:  # a new folder's empty start (or an older folder's state now): a point to roll back to
        m["commits"].append(commit_state(m))
    m = _redo_damaged(out, m, log)
    # a resume adds to these shards: their ids must fit this target (its digest cannot say)
    for entry in m["shards"]:  # not e: the exception name above
        read_fields(out / entry["file"], ("input_ids",), target.identity.vocab_size)
    listed = {s["file"] for s in m["shards"]}
    for f in sorted(out.glob(SHARD_GLOB)):
        if f.name not in listed:  # committed shard file, uncommitted manifest: the chunk is redone
            log(f"removing {f.name}: written before a kill, never committed to the manifest")
            f.unlink()
    remove_stale_temps(out, inside=True)
    return m


COMMITTED = ("watermark", "counts", "skipped", "norm_sums", "norm_tokens")


def commit_state(m: dict[str, Any]) -> dict[str, Any]:
    """The manifest's state after a committed chunk (shards listed, rows read, counts): what a resume rolls back
    to when a later shard file is found damaged. Kept in m["commits"], outside the shard entries the dataset
    hash reads."""
    return json.loads(json.dumps({"shards": len(m["shards"]), **{k: m[k] for k in COMMITTED},
                                  "norms": m["layout"].get("norms") or {}}))


def _redo_damaged(out: Path, m: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    """Check each listed shard against its entry (size; digest where recorded). From the first damaged one on,
    the folder is rolled back to the last commit before it, so this run redoes that chunk (and the ones after;
    their files are then orphans, removed). A folder written before commits were recorded cannot be rolled
    back: one error naming the file."""
    found = next(((i, e, why) for i, e in enumerate(m["shards"]) if (why := damaged(out / e["file"], e))), None)
    if found is None:
        return m
    i, entry, why = found
    earlier = [c for c in m.get("commits") or [] if c["shards"] <= i]
    if not earlier:
        raise DatagenError(f"{out / entry['file']}: {why}; this folder predates the commit records a resume needs "
                           f"to redo one chunk, so delete {out} and rerun datagen")
    c = earlier[-1]
    dropped = len(m["shards"]) - c["shards"]
    log(f"{out / entry['file']}: {why}; rolling back to row {c['watermark']} and redoing the {dropped} shard(s) "
        "from there")
    m["shards"] = m["shards"][:c["shards"]]
    m.update({k: c[k] for k in COMMITTED}, commits=earlier, complete=False)
    m["layout"]["norms"] = c["norms"]
    # rows past the restored watermark are read again, and listed again if skipped again
    m["skipped_rows"] = {k: [r for r in v if r <= c["watermark"]] for k, v in (m.get("skipped_rows") or {}).items()}
    return m


def list_skipped_rows(m: dict[str, Any], listed: dict[str, list[int]]) -> None:
    """Add a committed chunk's skipped row ids (LISTED_SKIPS reasons) to the manifest's "skipped_rows"."""
    rows = m.setdefault("skipped_rows", {})
    for reason, ids in listed.items():
        rows[reason] = (rows.get(reason, []) + ids)[:LISTED_ROWS]


def _versions() -> dict[str, str]:
    import transformers

    from .. import __version__ as eyas_version
    return {"eyas": eyas_version, "torch": torch.__version__, "transformers": transformers.__version__}


def counts_view(m: dict[str, Any]) -> dict[str, Any]:
    c = m["counts"]
    secs = c.get("seconds", 0.0)
    return {**c, "tokens_per_s": round(c.get("tokens", 0) / secs, 1) if secs else None,
            "bytes_per_token": round(c.get("bytes", 0) / c["tokens"], 1) if c.get("tokens") else None}


def summary(m: dict[str, Any]) -> list[str]:
    """End-of-run lines: samples, tokens, loss tokens, skipped by reason, bytes per token, size, tokens/s."""
    c = counts_view(m) if "tokens_per_s" not in m["counts"] else m["counts"]
    skipped = ", ".join(f"{k} {v}" for k, v in sorted(m["skipped"].items(), key=lambda kv: -kv[1])) or "none"
    size = c.get("bytes", 0)
    lines = [
        f"layout: stream indices {m['layout']['aux_indices']} (+ final pre-norm) of {m['target_source']} "
        f"[{m['layout']['target']['fingerprint']}]",
        f"samples {c.get('samples', 0)} from {c.get('conversations', 0)} conversations "
        f"({c.get('rows', 0)} source rows read, complete: {m['complete']})",
        f"tokens {c.get('tokens', 0)}, loss tokens {c.get('loss_tokens', 0)}, "
        f"truncated samples {c.get('truncated', 0)}",
        f"skipped: {skipped}",
        f"size on disk {size / 2**20:.1f} MiB in {len(m['shards'])} shards, "
        f"{c.get('bytes_per_token') or 0:.0f} bytes/token ({m['config']['dtype']})",
        f"throughput {c.get('tokens_per_s') or 0:.0f} tokens/s over {c.get('seconds', 0):.0f} s of processing",
    ]
    if m["config"]["regenerate"]:
        lines.append(
            f"regenerated {c.get('regenerated_replies', 0)} replies, {c.get('regenerated_tokens', 0)} tokens "
            f"({c.get('regenerated_tokens', 0) / max(c.get('regen_ms', 0) / 1000, 1e-9):.0f} tok/s); finished by "
            f"eos {c.get('finish_eos', 0)}, repetition {c.get('finish_repetition', 0)}, "
            f"length {c.get('finish_length', 0)}")
    for reason, rows in sorted((m.get("skipped_rows") or {}).items()):
        if rows:  # which rows, so the user can mend them: the count alone says only that some text was damaged
            n = int(m["skipped"].get(reason, len(rows)))
            shown = ", ".join(map(str, rows[:20])) + (", ..." if n > 20 else "")
            lines.append(f"skipped {n} row(s) as {reason} (row ids {shown}; {MANIFEST} lists up to {LISTED_ROWS} "
                         f"in skipped_rows): {SKIP_HINTS.get(reason, '')}")
    lines.append(f"norms (mean L2 per token): {m['layout']['norms']}")
    return lines

