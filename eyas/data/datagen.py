"""`eyas datagen`: conversations -> (optional) target-regenerated replies -> hidden-state shards, resumable.

Rows are processed in source order, a chunk of --shard-samples conversations at a time. Each chunk is
regenerated (batched across conversations, turn by turn), tokenized with the assistant loss mask, captured
(batched by similar length, right padding + attention mask, real tokens sliced out) and written as shard
file(s); then the manifest is committed with a watermark = the last source row the chunk covered. Every row
up to the watermark is either in a committed shard or counted as skipped, so a rerun of the same command
continues after the watermark; a shard file the manifest does not list (a kill between the shard rename and
the manifest rename) is removed first. No sample is lost or duplicated.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..files import atomic_write_json, portable_command
from ..interrupt import Interrupted, StoppedNow, stop_on_signals
from ..layout import Layout, LayoutError
from ..target.device import parse_dtype
from ..target.load import Target
from ..target.open import TargetChoice
from ..text import duration
from ..vllm.env import vllm_python, vllm_version
from ..vllm.session import VllmSession, aux_ids
from .capture import NormAccumulator, capture_samples
from .chunks import chunk_items, iter_chunks, write_chunk_shards
from .conversations import SELF_SOURCE, DataError
from .datagen_config import DatagenConfig, DatagenError, skip_summary, vllm_engine_args
from .datagen_vllm import LazySession, capture_samples_vllm, start_vllm
from .manifest import (
    commit_state,
    counts_view,
    list_skipped_rows,
    lock_folder,
    manifest_config,
    open_manifest,
    source_identity,
)
from .regen import regen_engine, regen_numerics, user_turn_opening
from .shards import MANIFEST

__all__ = ["DatagenConfig", "DatagenError", "run_datagen"]  # the entry names every stage imports from here


REGEN_SHARE = 0.9  # of a regenerated conversation's progress: its replies; the rest is its capture
# tqdm's own layout, the count shown whole (the bar moves by fractions of a conversation)
BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"

def run_datagen(cfg: DatagenConfig, command: str | None = None, log: Callable[[str], None] = print,
                progress: bool = True, target: Target | None = None) -> dict[str, Any]:
    """Run (or resume) a datagen job into cfg.out; returns the final manifest (with derived rates)."""
    cfg.validate()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out)
    # everything a bad flag or file can fail on comes before --out is created: a failed first run leaves nothing
    source, source_fp = source_identity(cfg.data)
    opening = TargetChoice(cfg.target, cfg.target_dtype, cfg.device, cfg.chat_template, cfg.raw)
    choice = opening.template(check_files=target is None)
    py = vllm_python(cfg.vllm_python, "datagen --engine vllm") if cfg.engine == "vllm" else None
    # vLLM runs the target, so eyas needs its tokenizer, config and identity only (no weights: it may not fit)
    target = opening.open(target, choice, load_weights=py is None)
    if cfg.data == SELF_SOURCE:
        try:
            user_turn_opening(target.tokenizer)
        except (ValueError, DataError) as e:
            raise DatagenError(f"--data self: {e}") from e
    try:
        layout = target.default_layout(cfg.aux_indices)
    except LayoutError as e:
        raise DatagenError(f"--aux-indices {cfg.aux_indices}: {e}") from e
    conf = manifest_config(cfg, source, source_fp)
    if cfg.regenerate:  # what wrote the replies: hf-generate, eyas-fp32, eyas-native (--regen-weights) or vllm
        conf["regen_engine"] = "vllm" if py else regen_numerics(regen_engine(target, cfg.regen_weights))
    out.mkdir(parents=True, exist_ok=True)
    lock = lock_folder(out)
    try:
        m = open_manifest(out, cfg, target, layout, conf, log)
        m["config"]["regen_engine"] = conf.get("regen_engine")
        m["commands"].append(command or portable_command())
        atomic_write_json(out / MANIFEST, m)
        if py is not None:  # started at the first chunk with work: a finished folder costs no vLLM start
            def start() -> VllmSession:
                session = start_vllm(py, cfg, target, layout, out, log)
                m["config"]["vllm"] = {"version": vllm_version(py), "python": str(py),
                                       "device": session.info["device"], "generator": session.info["generator"],
                                       "aux_ids": aux_ids(layout.aux_indices, target.num_layers),
                                       "engine_args": vllm_engine_args(cfg)}  # speed settings: may change
                return session
            cfg.vllm_session = LazySession(start)
        try:
            with stop_on_signals("eyas datagen", at_once=True):
                _run_chunks(cfg, target, layout, m, out, log, progress)
        except StoppedNow as stop:
            c = m["counts"]  # the manifest as last committed
            raise Interrupted(f"eyas datagen: stopped by {stop.signal_name}; {c.get('conversations', 0)} "
                              f"conversations in {len(m['shards'])} shards are committed in {out} (the chunk in "
                              f"progress is redone). Resume with: {command or portable_command()}") from None
        finally:
            if cfg.vllm_session is not None:
                cfg.vllm_session.close()
                cfg.vllm_session = None
        if not m["counts"].get("samples"):  # the whole run so far, so a resumed run with samples passes
            rows = m["counts"].get("rows", 0)
            raise DatagenError(f"no samples: all {rows} source rows read from {cfg.data} were skipped "
                               f"({skip_summary(m['skipped'])}); {out} holds nothing to train on" if rows else
                               f"no samples: no rows of {cfg.data} were read (--num {cfg.num}); pass --num N >= 1")
        return {**m, "counts": counts_view(m)}
    finally:
        lock.close()


def count_chunk(counts: Counter[str], stats: Counter[str], rows: int, convs: int, samples: list[Any],
                entries: list[dict[str, Any]], seconds: float) -> None:
    """Add a committed chunk to the folder's counts (the manifest's `counts`)."""
    counts.update(stats)
    counts["rows"] += rows
    counts["conversations"] += convs
    counts["samples"] += len(samples)
    counts["tokens"] += sum(len(s) for s in samples)
    counts["loss_tokens"] += sum(int(s.loss_mask.sum()) for s in samples)
    counts["bytes"] += sum(e["bytes"] for e in entries)
    counts["seconds"] = round(counts["seconds"] + seconds, 3)  # type: ignore[assignment]  # a float among the ints


def rest_estimate(done: int, num: int, seconds: float, run_convs: int) -> str:
    """How long the remaining conversations of a --num run take at this run's rate so far."""
    rate = seconds / max(run_convs, 1)
    return (f"datagen: {done} of {num} conversations committed; at {rate:.1f} s each the remaining {num - done} "
            f"take about {duration(rate * (num - done))} (Ctrl-C keeps what is committed; rerun the same command to "
            "resume)")


def _run_chunks(cfg: DatagenConfig, target: Target, layout: Layout, m: dict[str, Any], out: Path,
                log: Callable[[str], None], progress: bool) -> None:
    from tqdm import tqdm

    counts: Counter[str] = Counter(m["counts"])
    skipped: Counter[str] = Counter(m["skipped"])
    norms = NormAccumulator(dict(m["norm_sums"]), int(m["norm_tokens"]))
    store_dtype = parse_dtype(cfg.dtype)
    done_convs = counts["conversations"]
    remaining = None if cfg.num is None else cfg.num - done_convs
    if remaining is not None and remaining <= 0:
        log(f"{out} already holds {done_convs} conversations (>= --num {cfg.num}); nothing to do")
        m["complete"] = True
        atomic_write_json(out / MANIFEST, m)
        return
    # the bar moves with each reply (a regenerated chunk's conversations count REGEN_SHARE done as their replies
    # finish, the rest as they are captured), so its rate and ETA show from the first reply, not the first chunk
    bar = tqdm(total=cfg.num, initial=done_convs, unit="conv", disable=not progress, dynamic_ncols=True,
               desc="datagen", file=sys.stderr, bar_format=BAR_FORMAT if cfg.num is not None else None)
    m["complete"] = False
    run_t0, run_tokens, base_tokens = time.perf_counter(), 0, counts["tokens"]
    run_convs, estimated = 0, False

    def postfix(phase: str) -> None:  # what is committed, and the tokens captured so far with this run's rate
        dt = time.perf_counter() - run_t0
        bar.set_postfix_str(f"{phase} | committed {counts['conversations']} | captured {base_tokens + run_tokens} "
                            f"tok, {run_tokens / max(dt, 1e-9):.0f} tok/s", refresh=True)

    # the bar is closed (its line ended) on every exit, so an error message starts on a line of its own
    try:
        chunks_done = len(m["commits"]) - 1  # the first commit record is the empty folder's
        for convs, skips, last_row, exhausted, listed in iter_chunks(cfg, int(m["watermark"]), remaining,
                                                                     chunks_done):
            t0 = time.perf_counter()
            stats: Counter[str] = Counter()
            loader_rows = sum(skips.values()) + len(convs)  # source rows this chunk covers
            start, share = counts["conversations"], REGEN_SHARE if cfg.regenerate and not cfg.raw else 0.0

            def on_replies(done: int, total: int, start=start, n=len(convs), share=share) -> None:
                bar.update(start + n * share * done / max(total, 1) - bar.n)

            items = chunk_items(target, convs, cfg, stats, skips, postfix, on_replies)
            bar.update(start + len(convs) * share - bar.n)
            postfix("capture")

            def on_batch(n_samples: int, n_tokens: int, share=share) -> None:
                nonlocal run_tokens
                run_tokens += n_tokens
                bar.update(n_samples * (1 - share))
                postfix("capture")

            if cfg.vllm_session is not None:
                samples = capture_samples_vllm(cfg.vllm_session, items, layout, target.num_layers,
                                               target.hidden_size, store_dtype, cfg.capture_tokens, out / ".vllm",
                                               norms, on_batch)
            else:
                samples = capture_samples(target, items, layout, store_dtype, cfg.capture_tokens, norms, on_batch)
            bar.update(start + len(convs) - bar.n)  # conversations skipped after loading still count as processed
            entries = write_chunk_shards(out, len(m["shards"]), samples, cfg.shard_tokens, store_dtype)
            # commit: every row up to last_row is now in a shard or counted as skipped
            m["shards"].extend(entries)
            count_chunk(counts, stats, loader_rows, len(convs), samples, entries, time.perf_counter() - t0)
            skipped.update(skips)
            list_skipped_rows(m, listed)
            layout.norms = norms.means()
            m.update(watermark=last_row, counts=dict(counts), skipped=dict(skipped), norm_sums=norms.sums,
                     norm_tokens=norms.tokens, layout=layout.to_dict(),
                     complete=exhausted or (cfg.num is not None and counts["conversations"] >= cfg.num))
            m["commits"].append(commit_state(m))
            atomic_write_json(out / MANIFEST, m)
            run_convs += len(convs)
            if not estimated and not m["complete"] and cfg.num is not None:
                estimated = True  # once, from this run's first committed chunk
                line = rest_estimate(counts["conversations"], cfg.num, time.perf_counter() - run_t0, run_convs)
                bar.write(line, file=sys.stderr) if progress else log(line)  # above the bar, which keeps its line
    finally:
        bar.close()
    if not m["complete"]:  # the source ended exactly at a chunk boundary
        m["complete"] = True
        atomic_write_json(out / MANIFEST, m)
