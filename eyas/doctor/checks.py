"""`eyas doctor`: find every wiring fault between target, data, draft and serving config, from measurements.

Checks (each a named `Check` with status pass/warn/fail/skip, the numbers behind it and a fix):
  target_identity  the draft's recorded target (layers, hidden, vocab, weights fingerprint) vs the target now
  hidden_size      fc input = n_aux x target hidden; the draft shares the target's embeddings
  vocab_map        d2t/t2d consistent and in range; the same draft vocabulary as at training (hash)
  config_hidden    config.json `target_hidden_size` present and right (engines fall back to hidden_size)
  config_ids       which stream indices SGLang and vLLM capture when they read config.json (eyas.conventions)
  data_layout      (--data) which stream each stored feature slice really holds, measured against the target
                   through datagen's capture path (the numerics the shards were stored in)
  accuracy         per-step held-out accuracy: stored shards (training path) vs features captured fresh
                   through the serving path (the engine's forward; HF hooks for a family it does not cover)
                   vs the training-time metric; skew > 2 points
  layout           layout inference: the recorded layout vs shifted/embedding/final-only/permuted candidates
  norms            per-index stream norms recorded at capture vs measured now
  head             lm_head / fc that look untrained (init statistics, near-uniform logits, accuracy ~ baseline)

Every accuracy is `eyas.train.ttt.ttt_forward` on the draft (the training-time-test alignment of
docs/CONTRACTS.md); the serving path captures with `eyas.engine.forward.TargetModel`, the forward the engine runs (HF
hooks for a family it does not cover; the report names which ran).
All stream indices a sample needs are captured in ONE target forward per sample.

Layout inference, the samples, the streams and the draft's scores live in eyas/probe (`eyas import` uses them
too), the identity and config.json checks in eyas/doctor/identity.py, the norms and data_layout checks in
eyas/doctor/features.py, the head check in eyas/doctor/head.py, the trace in eyas/doctor/trace.py, the serve-flag
lint in eyas/doctor/flags.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..conventions import default_aux_indices, to_engine_ids
from ..draft import DraftCheckpoint, check_draft_for_target, draft_misfit
from ..engine_views import engine_views
from ..errors import LayoutError
from ..probe import (
    EvalSample,
    LayoutRanking,
    LayoutScore,
    Serving,
    as_samples,
    capture_path_streams,
    capture_streams,
    conversation_samples,
    layout_candidates,
    prepare_draft,
    rank_layouts,
    score_draft,
    shard_samples,
)
from .checklist import Check, jsonable, pct, render_checks, render_fixes
from .features import check_data_layout, check_norms
from .head import BASELINE_MARGIN_POINTS, check_head
from .identity import check_identity, read_config

# ---- thresholds (why each value) ------------------------------------------------------------------
SKEW_POINTS = 2.0  # the bar: a training/serving accuracy gap above 2 points is skew


@dataclass
class DoctorReport:
    checks: list[Check]
    layout: LayoutRanking | None = None
    accuracy: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(c.status in ("pass", "skip") for c in self.checks)

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def check(self, name: str) -> Check:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(f"no check named {name!r}; have {[c.name for c in self.checks]}")

    def to_dict(self) -> dict[str, Any]:
        return jsonable({"ok": self.ok, "checks": [c.to_dict() for c in self.checks],
                         "layout_inference": self.layout.to_dict() if self.layout is not None else None,
                         "accuracy": self.accuracy, "meta": self.meta})


# ---- 2. accuracy: training path vs serving path ---------------------------------------------------

def _conversation_var(scored: dict[str, Any], step: int) -> float:
    """Variance of a pooled accuracy (sum correct / sum count) over conversations: positions within one
    conversation are correlated (some replies are far more predictable than others), so the binomial variance
    over positions understates the spread between sample sets; this is the cluster (ratio-estimator) variance
    over conversations, never below the binomial one."""
    c = [row[step] for row in scored["sample_correct"]]
    n = [row[step] for row in scored["sample_count"]]
    k, total = sum(1 for x in n if x), sum(n)
    if not total:
        return 0.0
    p = sum(c) / total
    binomial = p * (1 - p) / total
    if k < 2:
        return binomial
    cluster = k / (k - 1) * sum((ci - p * ni) ** 2 for ci, ni in zip(c, n, strict=True)) / total ** 2
    return max(cluster, binomial)


def _check_accuracy(serve: dict[str, Any], train: dict[str, Any] | None, recorded_metric: list[float] | None,
                    recorded_rows: list[int] | None, serving_path: str, paired: bool) -> Check:
    s_acc = serve["acc"]
    nums: dict[str, Any] = {"serving_acc": s_acc, "serving_count": serve["count"], "serving_path": serving_path}
    lines = [f"serving path ({serving_path}, fresh features): " + ", ".join(pct(a) for a in s_acc)]
    if train is not None:
        nums.update(training_acc=train["acc"], training_count=train["count"])
        lines.insert(0, "training path (stored shard features): " + ", ".join(pct(a) for a in train["acc"]))
    if recorded_metric:
        nums["training_time_heldout_acc"] = recorded_metric
        lines.append("training-time held-out metric (draft manifest): " + ", ".join(pct(a) for a in recorded_metric))
    if train is not None:
        gaps = [100 * (t - v) for t, v in zip(train["acc"], s_acc, strict=True) if not (math.isnan(t) or math.isnan(v))]
        j = max(range(len(gaps)), key=lambda i: abs(gaps[i])) if gaps else 0
        nums["gap_points"] = [round(g, 2) for g in gaps]
        if gaps and abs(gaps[j]) > SKEW_POINTS:
            return Check("accuracy", "fail",
                         f"training/serving skew: step-{j} held-out accuracy {pct(train['acc'][j])} on the stored "
                         f"shard features (training path) vs {pct(s_acc[j])} on features captured fresh through "
                         f"{serving_path} (serving path) — {gaps[j]:+.1f} points on the same tokens",
                         numbers=nums, details=lines,
                         fix="the stored features are not what the target produces now: same target file, dtype and "
                             "capture path for datagen and serving (see target_identity, norms, data_layout); "
                             "re-capture and retrain if the target changed")
        return Check("accuracy", "pass", f"no skew: step-0 held-out accuracy {pct(train['acc'][0])} (stored) vs "
                     f"{pct(s_acc[0])} (fresh, serving path) on the same tokens; steps: "
                     + ", ".join(pct(a) for a in s_acc), numbers=nums, details=lines)
    if recorded_metric:
        m0, v0 = recorded_metric[0], s_acc[0]
        rows = (recorded_rows or [0])[0]
        se = 100 * math.sqrt(_conversation_var(serve, 0) + (m0 * (1 - m0) / rows if rows else 0.0))
        gap = 100 * (m0 - v0)
        nums.update(gap_points=round(gap, 2), gap_se_points=round(se, 2))
        # one-sided: a miswiring only ever costs accuracy, and other samples than the training run's
        # held-out set may well be easier (the paired branch above is two-sided: same tokens there)
        if gap > SKEW_POINTS and gap > 2 * se:
            return Check("accuracy", "warn",
                         f"possible training/serving skew: step-0 held-out accuracy {pct(m0)} at training vs "
                         f"{pct(v0)} now through {serving_path} ({gap:+.1f} points, SE {se:.1f} over conversations); "
                         "other samples than the training run's held-out set, so the data distribution may differ",
                         numbers=nums, details=lines,
                         fix="pass --data SHARDS (the training data) for a paired test on the same tokens")
        return Check("accuracy", "pass", f"step-0 held-out accuracy {pct(v0)} through {serving_path} vs "
                     f"{pct(m0)} at training (training minus now {gap:+.1f} points, SE {se:.1f} over "
                     "conversations; only a drop would point to skew)", numbers=nums, details=lines)
    return Check("accuracy", "skip",
                 f"serving-path held-out accuracy per step: {', '.join(pct(a) for a in s_acc)} (no training-path "
                 "features or training-time metric to compare with)", numbers=nums, details=lines,
                 fix="pass --data SHARDS to compare with the stored features")


# ---- 3. the layout verdict ------------------------------------------------------------------------

def _check_layout(rank: LayoutRanking, recorded: list[int], L: int, configured: dict[str, list[int]]) -> Check:
    def show(x: LayoutScore | None) -> str:
        if x is None:
            return "n/a"
        if math.isnan(x.accuracy):
            return "engine crashes"
        return f"{pct(x.accuracy)} (loss {x.loss:.3f})" if not math.isnan(x.loss) else pct(x.accuracy)

    rec = rank.find(recorded)
    best = rank[0]
    top_acc = max((s.accuracy for s in rank if not math.isnan(s.accuracy)), default=float("nan"))
    table = [f"{s.label}: {show(s)}" for s in rank[:12]]
    nums = {"recorded": recorded, "recorded_acc": rec.accuracy if rec else None,
            "recorded_loss": rec.loss if rec else None, "best": best.indices, "best_label": best.label,
            "best_acc": best.accuracy, "best_loss": best.loss, "tokens": rank.tokens, "baseline": rank.baseline,
            "configured": {k: {"indices": v, "acc": (fv.accuracy if (fv := rank.find(v)) else None),
                               "loss": (fv.loss if fv else None)}
                           for k, v in configured.items()}}
    if math.isnan(top_acc) or 100 * (top_acc - rank.baseline) <= BASELINE_MARGIN_POINTS:
        return Check("layout", "skip", f"inconclusive: no candidate layout predicts better than always proposing the "
                     f"most frequent token (best {pct(top_acc)} vs {pct(rank.baseline)}); see the head check",
                     numbers=nums, details=table)
    conf = [f"{k} {v}: {show(rank.find(v))}" for k, v in configured.items()]

    others = [s for s in rank if s.indices and not math.isnan(s.loss) and s.indices != best.indices]
    if others and not any(rank.worse(s.indices, best.indices)[0] for s in others):
        worst = max(others, key=lambda s: s.loss)
        nums["spread_loss"] = round(worst.loss - best.loss, 4)
        return Check("layout", "warn", f"inconclusive: the draft barely uses its features — {len(others) + 1} "
                     f"candidate layouts score within noise of each other (loss {best.loss:.3f}..{worst.loss:.3f}, "
                     f"accuracy {pct(worst.accuracy)}..{pct(best.accuracy)}; recorded {recorded}: {show(rec)}), so "
                     "the layout cannot be verified; it predicts mostly from the token alone",
                     numbers=nums, details=table,
                     fix="train the draft longer / on more data (a trained EAGLE-3 draft loses tens of points on a "
                         "wrong layout), then re-run the doctor")
    if rec is None or list(best.indices) == list(recorded):
        nxt = next((s for s in rank if list(s.indices) != list(recorded)), None)
        return Check("layout", "pass", f"trained on {recorded}: {show(best)} is the best of {len(rank)} candidate "
                     f"layouts" + (f" (next: {nxt.label} {show(nxt)})" if nxt else "")
                     + ("; " + "; ".join(conf) if conf else ""), numbers=nums, details=table)
    worse, d, se = rank.worse(recorded, best.indices)
    nums.update(diff_points=round(100 * (best.accuracy - rec.accuracy), 2) if not math.isnan(rec.accuracy) else None,
                diff_loss=round(d, 4), se_loss=round(se, 4))
    if worse or math.isnan(rec.loss):
        what = "the final state alone" if not best.indices else f"stream {list(best.indices)}"
        try:
            ids = (f"; in engine ids: SGLang {to_engine_ids(best.indices, 'sglang', L)}, vLLM "
                   f"{to_engine_ids(best.indices, 'vllm', L)}") if best.indices else ""
        except LayoutError:
            ids = f"; vLLM ids {best.indices} (SGLang cannot express it)"
        note = ""
        if 0 in recorded and 0 not in best.indices:
            note = " (the recorded layout includes the embedding, stream 0, which the draft never trained on)"
        elif recorded and L in recorded and L not in best.indices:
            note = f" (the recorded layout includes the final state, stream {L})"
        return Check("layout", "fail",
                     f"the draft reads {what}, not its recorded layout{note}: trained on {list(best.indices)} "
                     f"({best.label}): {show(best)}; recorded {recorded}: {show(rec)} "
                     f"(+{d:.3f} nats, paired SE {se:.3f}, over {rank.tokens} positions)"
                     + ("; " + "; ".join(conf) if conf else ""),
                     numbers=nums, details=table,
                     fix=f"record and capture the layout the draft was trained on, stream {list(best.indices)}{ids} "
                         f"(`eyas import` with --aux-indices {','.join(map(str, best.indices))} rewrites a draft's "
                         "layout); never shift ids by hand")
    return Check("layout", "pass", f"recorded {recorded}: {show(rec)}, within noise of the best candidate "
                 f"{best.label} {show(best)} ({d:+.3f} nats, paired SE {se:.3f})", numbers=nums, details=table)


# ---- the whole run --------------------------------------------------------------------------------

def _blocking(checks: list[Check]) -> str | None:
    """Why measuring is impossible (the draft cannot run on this target), or None."""
    for c in checks:
        if c.name == "hidden_size" and c.status == "fail":
            return "the draft does not fit this target's hidden size (see hidden_size)"
        if c.name == "vocab_map" and c.status == "fail" and "-token vocabulary" in c.summary:
            return "the draft was built for another vocabulary (see vocab_map)"
        if c.name == "target_identity" and c.status == "fail" and "another model" in c.summary \
                and "num_layers" in c.summary:
            return "the draft was made for a target with another layer count (see target_identity)"
    return None


def run_doctor(target, ckpt: DraftCheckpoint, *, data: Sequence[str | Path] | None = None,
               samples: Sequence[Any] | None = None, source: str | None = None, num_samples: int = 6,
               max_len: int = 384, steps: int | None = None, heldout_pct: float | None = None,
               quick: bool = False, weights: str = "auto") -> DoctorReport:
    """All checks. data: shard folders (training path + paired serving path on the same held-out tokens;
    default: the training folders the draft manifest names, when they exist here); samples: token-id samples
    for the serving path (tests, tiny targets); else `num_samples` conversations of `source` (default: the
    training source, held-out rows only; else bundled ShareGPT). quick: identity and config checks only.
    weights: the engine forward's mode for the serving path (eyas.engine.weights.engine_model)."""
    # a draft recorded for another model (its architecture, layers, widths or vocabulary) is refused in one line, as
    # every command does; the same model with changed weights (the fingerprint alone), or a draft whose own shapes
    # are off, is what the checks below report on
    if any(p.startswith(("aux stream indices", "target.")) and not p.startswith("target.fingerprint ")
           for p in draft_misfit(ckpt, target)):
        check_draft_for_target(ckpt, target)
    checks = check_identity(target, ckpt, quick)
    man = ckpt.manifest or {}
    training = man.get("training") or {}
    meta: dict[str, Any] = {"target": target.identity.to_dict(), "draft": str(ckpt.path),
                            "recorded_layout": list(ckpt.layout.aux_indices)}
    if quick:
        meta["quick"] = True
        return DoctorReport(checks, meta=meta)
    why = _blocking(checks)
    if why:
        for n in ("data_layout", "accuracy", "layout", "norms", "head"):
            checks.append(Check(n, "skip", f"not measured: {why}"))
        return DoctorReport(checks, meta=meta)
    pct = float(heldout_pct if heldout_pct is not None else training.get("heldout_pct", 5.0))
    K = int(steps or training.get("ttt_steps") or 3)
    draft = prepare_draft(ckpt.model, target)
    L, recorded = target.num_layers, list(ckpt.layout.aux_indices)
    evs, shard_set = _eval_samples(target, man, data, samples, source, num_samples, max_len, pct, meta)
    configured = _configured_layouts(ckpt, L, recorded, target.identity.architecture)
    cands = layout_candidates(recorded, L, draft.config.num_aux, configured)
    serving = Serving(target, weights)
    meta["serving_path"] = serving.path
    need = {k for idx, _ in cands for k in idx} | set(recorded)
    fresh = capture_streams(serving, draft, target, evs, need)  # ONE per sample

    serve = score_draft(draft, target, [torch.cat([f.streams[k] for k in recorded], -1) for f in fresh],
                        [f.final for f in fresh], evs, K, [f.labels for f in fresh], want_logits=True)
    train = None
    if all(s.stored_aux is not None for s in evs):
        feats = [s.stored_aux for s in evs if s.stored_aux is not None]  # all of them (just checked)
        finals = [s.stored_final for s in evs if s.stored_final is not None]  # set with stored_aux (probe.samples)
        train = score_draft(draft, target, feats, finals, evs, K)
    metric = (man.get("metrics") or {}).get("heldout_acc")
    rows = (man.get("metrics") or {}).get("heldout_rows")
    checks.append(_check_accuracy(serve, train, metric[:K] if metric else None, rows, serving.path,
                                  paired=train is not None))
    rank = rank_layouts(draft, target, evs, fresh, cands, keep=[recorded, *configured.values()])
    dflt = default_aux_indices(L)
    bases = [*configured.values(), *([dflt] if len(dflt) == len(recorded) else [])]
    rank = rank.simplest_among_ties(recorded, bases)
    checks.append(_check_layout(rank, recorded, L, configured))
    checks.append(check_norms(ckpt.layout.norms, fresh, evs, recorded, L, _recorded_length(man, shard_set)))
    if shard_set is not None:
        captured = capture_path_streams(target, evs[0].input_ids)
        checks.append(check_data_layout(shard_set.layout, ckpt, evs[0], captured, L))
    checks.append(check_head(draft, serve, rank))
    acc = {"steps": K, "serving": serve, "training": train, "training_time_metric": metric,
           "serving_path": serving.short}
    return DoctorReport(_ordered(checks), layout=rank, accuracy=acc, meta=meta)


def _eval_samples(target, man: dict[str, Any], data: Sequence[str | Path] | None, samples: Sequence[Any] | None,
                  source: str | None, num_samples: int, max_len: int, pct: float,
                  meta: dict[str, Any]) -> tuple[list[EvalSample], Any]:
    """The held-out samples to measure on, and their ShardSet when they come from shards (None otherwise): the
    given shard folders, else the draft's training shards when they are here, else the given token samples, else
    conversations of the source (the training source's held-out rows, regenerated in the share it trained on).
    meta records where they came from."""
    shard_set = None
    trained_on = _training_data(man)
    if not data and samples is None and source is None and trained_on["folders"]:
        data = trained_on["folders"]  # the training shards are here: measure paired on their held-out rows
        meta["data_from_manifest"] = True
    if data:
        evs, shard_set = shard_samples(data, num_samples, pct, max_len)
        meta["samples_from"] = f"held-out rows of {[str(d) for d in data]} ({pct}% split)"
    elif samples is not None:
        evs = as_samples(samples)
        meta["samples_from"] = "given token samples"
    else:
        src = source or trained_on["source"] or "sharegpt"
        same = trained_on["source"] is not None and src == trained_on["source"]
        n_regen = round(num_samples * trained_on["regen_share"]) if same else 0
        regen = (target, trained_on["regen_config"], n_regen) if n_regen else None
        evs = conversation_samples(target.tokenizer, src, num_samples, max_len, pct if same else None, regen=regen)
        meta["samples_from"] = f"{len(evs)} conversations of {src}" + (f" (held-out rows, {pct}%)" if same else "")
        if n_regen:  # like the training data: the target's own replies in the share it trained on
            meta["samples_from"] += f", replies of {min(n_regen, len(evs))} regenerated by the target as in training"
    meta["samples"] = len(evs)
    meta["tokens"] = int(sum(s.input_ids.numel() for s in evs))
    return evs, shard_set


def _configured_layouts(ckpt: DraftCheckpoint, L: int, recorded: list[int],
                        architecture: str | None) -> dict[str, list[int]]:
    """The layouts engines would configure from the draft's config.json (other than the recorded one), as extra
    bases for the candidates."""
    configured: dict[str, list[int]] = {}
    cfg = read_config(ckpt)
    if cfg is not None:
        for eng in ("sglang", "vllm"):
            for v in engine_views(cfg, eng, L, architecture=architecture):
                if v.indices is not None and v.indices != recorded and len(v.indices) == len(recorded):
                    configured[f"{eng} config.json" + (f" ({v.when})" if v.when else "")] = v.indices
    return configured


def _training_data(man: dict[str, Any]) -> dict[str, Any]:
    """What the draft manifest says it trained on: shard folders that exist here, the conversation source
    (its row ids are the shards' row ids, so the held-out split can be rebuilt), whether replies were
    regenerated, and the regenerated folders' share of the training tokens (a mix of original and regenerated
    folders is weighed by kept tokens; manifests from before per-folder configs know only the first folder)."""
    d = man["data"] if isinstance(man.get("data"), dict) else {}
    cfg = d["config"] if isinstance(d.get("config"), dict) else {}
    configs = [c if isinstance(c, dict) else {} for c in d.get("configs") or [cfg]]
    regen = [bool(c.get("regenerate")) for c in configs]
    toks = d.get("kept_tokens") or d.get("folder_tokens")
    if isinstance(toks, list) and len(toks) == len(regen) and sum(toks) > 0:
        share = sum(t for t, r in zip(toks, regen, strict=True) if r) / sum(toks)
    else:
        share = float(any(regen))
    folders = [f for f in d.get("folders") or [] if (Path(f) / "manifest.json").is_file()]
    src = d.get("source") if isinstance(d.get("source"), str) else cfg.get("source")
    return {"folders": folders if folders and len(folders) == len(d.get("folders") or []) else [],
            "source": src if isinstance(src, str) else None, "regenerated": any(regen), "regen_share": share,
            "regen_config": next((c for c, r in zip(configs, regen, strict=True) if r), None)}


def _recorded_length(man: dict[str, Any], shard_set) -> float | None:
    """Mean sample length of the data the norms were recorded on: the shard manifests' counts (--data, or
    the training data folders the draft manifest names, when they exist here)."""
    from ..data.shards import ShardError, load_manifest

    mans = list(shard_set.manifests) if shard_set is not None else []
    if not mans:
        folders = (man.get("data") or {}).get("folders") if isinstance(man.get("data"), dict) else None
        for f in folders or []:
            try:
                mans.append(load_manifest(f))
            except (ShardError, OSError, ValueError):
                return None
    tok = sum(int((m.get("counts") or {}).get("tokens", 0)) for m in mans)
    n = sum(int((m.get("counts") or {}).get("samples", 0)) for m in mans)
    return tok / n if tok and n else None


ORDER = ("target_identity", "hidden_size", "vocab_map", "config_hidden", "config_ids", "data_layout", "accuracy",
         "layout", "norms", "head")


def _ordered(checks: list[Check]) -> list[Check]:
    return sorted(checks, key=lambda c: ORDER.index(c.name) if c.name in ORDER else len(ORDER))


# ---- rendering ------------------------------------------------------------------------------------

def render(report: DoctorReport, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    con = console or Console()
    render_checks(report.checks, "eyas doctor", con)
    if report.layout is not None:
        lt = Table(title=f"layout inference (ranked by step-0 held-out loss over {report.layout.tokens} positions; "
                         f"always proposing the most frequent token: {pct(report.layout.baseline)})")
        lt.add_column("rank", justify="right")
        lt.add_column("stream indices")
        lt.add_column("candidate", overflow="fold")
        lt.add_column("accuracy", justify="right")
        lt.add_column("loss (nats)", justify="right")
        for i, s in enumerate(report.layout[:10]):
            lt.add_row(str(i + 1), str(list(s.indices)) if s.indices else "(final only)", s.label,
                       "engine crashes" if math.isnan(s.accuracy) else pct(s.accuracy),
                       "" if math.isnan(s.loss) else f"{s.loss:.3f}")
        con.print(lt)
    if report.accuracy:
        a = report.accuracy
        at = Table(title="held-out accuracy per TTT step")
        at.add_column("path")
        for j in range(a["steps"]):
            at.add_column(f"step {j}", justify="right")
        if a.get("training"):
            at.add_row("training (stored shards)", *[pct(x) for x in a["training"]["acc"]])
        at.add_row(f"serving (fresh, {a.get('serving_path', 'engine forward')})",
                   *[pct(x) for x in a["serving"]["acc"]])
        if a.get("training_time_metric"):
            m = list(a["training_time_metric"])[:a["steps"]]
            m = m + [float("nan")] * (a["steps"] - len(m))
            at.add_row("training-time metric (manifest)", *[pct(x) for x in m])
        con.print(at)
    render_fixes(report.checks, con)
    con.print("[green]all checks pass[/]" if report.ok else
              f"[red]{sum(c.status == 'fail' for c in report.checks)} failed[/], "
              f"[yellow]{sum(c.status == 'warn' for c in report.checks)} warned[/]")
