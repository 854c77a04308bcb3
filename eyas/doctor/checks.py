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
docs/CONTRACTS.md); the serving path captures with `eyas.model.TargetModel`, the forward the engine runs (HF
hooks for a family it does not cover; the report names which ran).
All stream indices a sample needs are captured in ONE target forward per sample.

Layout inference lives in eyas/doctor/inference.py (`eyas import` uses it too), the identity and config.json
checks in eyas/doctor/identity.py, the trace in eyas/doctor/trace.py, the serve-flag lint in eyas/doctor/flags.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..conventions import default_aux_indices, engine_views, to_engine_ids
from ..draft import DraftCheckpoint, Eagle3Draft
from ..errors import LayoutError
from .identity import _read_config, check_identity
from .inference import _rank, layout_candidates
from .ranking import LayoutRanking, LayoutScore
from .report import Check, jsonable, render_checks, render_fixes
from .samples import EvalSample, as_samples, conversation_samples, shard_samples
from .scoring import _score
from .streams import Serving, _Fresh, _fresh, _prepare, capture_path_streams

# ---- thresholds (why each value) ------------------------------------------------------------------
SKEW_POINTS = 2.0  # the bar: a training/serving accuracy gap above 2 points is skew
BASELINE_MARGIN_POINTS = 2.0  # "predicts nothing": accuracy within this of always guessing the top token
# relative drift of a mean stream norm from what this target gives (position 0 modelled separately: SmolLM2's
# stream 15 averages 353 over 128-token samples, 223 over 384, 179 over 1024, all explained by ~25000 at
# position 0 and ~150 elsewhere; other content moves a mean by ~5%, measured on ShareGPT rows)
NORM_WARN, NORM_FAIL = 0.15, 0.40
NORM_LENGTHS = (16, 8192)  # plausible mean sample lengths when the recorded data's is unknown
SLICE_MATCH = 0.02  # stored slice == fresh stream when relative error < 2% (bf16 storage is ~0.4%)
UNIFORM_ENTROPY = 0.97  # draft logits whose entropy is >= 97% of log(Vd) carry no prediction ...
UNIFORM_GAP = 0.05  # ... unless the target's own distribution is about as flat (a high-entropy target)
INIT_STD_TOL = 0.03  # weight std within 3% of an init distribution's std ...
INIT_KURT_TOL = 0.15  # ... and its kurtosis within 0.15 of the init's (uniform 1.8, normal 3.0)
IID_SPREAD = 1.5  # row/column norm spread within 1.5x of i.i.d. sampling noise = never trained


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

def _pct(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"


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
    lines = [f"serving path ({serving_path}, fresh features): " + ", ".join(_pct(a) for a in s_acc)]
    if train is not None:
        nums.update(training_acc=train["acc"], training_count=train["count"])
        lines.insert(0, "training path (stored shard features): " + ", ".join(_pct(a) for a in train["acc"]))
    if recorded_metric:
        nums["training_time_heldout_acc"] = recorded_metric
        lines.append("training-time held-out metric (draft manifest): " + ", ".join(_pct(a) for a in recorded_metric))
    if train is not None:
        gaps = [100 * (t - v) for t, v in zip(train["acc"], s_acc, strict=True) if not (math.isnan(t) or math.isnan(v))]
        j = max(range(len(gaps)), key=lambda i: abs(gaps[i])) if gaps else 0
        nums["gap_points"] = [round(g, 2) for g in gaps]
        if gaps and abs(gaps[j]) > SKEW_POINTS:
            return Check("accuracy", "fail",
                         f"training/serving skew: step-{j} held-out accuracy {_pct(train['acc'][j])} on the stored "
                         f"shard features (training path) vs {_pct(s_acc[j])} on features captured fresh through "
                         f"{serving_path} (serving path) — {gaps[j]:+.1f} points on the same tokens",
                         numbers=nums, details=lines,
                         fix="the stored features are not what the target produces now: same target file, dtype and "
                             "capture path for datagen and serving (see target_identity, norms, data_layout); "
                             "re-capture and retrain if the target changed")
        return Check("accuracy", "pass", f"no skew: step-0 held-out accuracy {_pct(train['acc'][0])} (stored) vs "
                     f"{_pct(s_acc[0])} (fresh, serving path) on the same tokens; steps: "
                     + ", ".join(_pct(a) for a in s_acc), numbers=nums, details=lines)
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
                         f"possible training/serving skew: step-0 held-out accuracy {_pct(m0)} at training vs "
                         f"{_pct(v0)} now through {serving_path} ({gap:+.1f} points, SE {se:.1f} over conversations); "
                         "other samples than the training run's held-out set, so the data distribution may differ",
                         numbers=nums, details=lines,
                         fix="pass --data SHARDS (the training data) for a paired test on the same tokens")
        return Check("accuracy", "pass", f"step-0 held-out accuracy {_pct(v0)} through {serving_path} vs "
                     f"{_pct(m0)} at training (training minus now {gap:+.1f} points, SE {se:.1f} over "
                     "conversations; only a drop would point to skew)", numbers=nums, details=lines)
    return Check("accuracy", "skip",
                 f"serving-path held-out accuracy per step: {', '.join(_pct(a) for a in s_acc)} (no training-path "
                 "features or training-time metric to compare with)", numbers=nums, details=lines,
                 fix="pass --data SHARDS to compare with the stored features")


# ---- 3. the layout verdict ------------------------------------------------------------------------

def _check_layout(rank: LayoutRanking, recorded: list[int], L: int, configured: dict[str, list[int]]) -> Check:
    def show(x: LayoutScore | None) -> str:
        if x is None:
            return "n/a"
        if math.isnan(x.accuracy):
            return "engine crashes"
        return f"{_pct(x.accuracy)} (loss {x.loss:.3f})" if not math.isnan(x.loss) else _pct(x.accuracy)

    rec = rank.find(recorded)
    best = rank[0]
    top_acc = max((s.accuracy for s in rank if not math.isnan(s.accuracy)), default=float("nan"))
    table = [f"{s.label}: {show(s)}" for s in rank[:12]]
    nums = {"recorded": recorded, "recorded_acc": rec.accuracy if rec else None,
            "recorded_loss": rec.loss if rec else None, "best": best.indices, "best_label": best.label,
            "best_acc": best.accuracy, "best_loss": best.loss, "tokens": rank.tokens, "baseline": rank.baseline,
            "configured": {k: {"indices": v, "acc": (rank.find(v).accuracy if rank.find(v) else None),
                               "loss": (rank.find(v).loss if rank.find(v) else None)}
                           for k, v in configured.items()}}
    if math.isnan(top_acc) or 100 * (top_acc - rank.baseline) <= BASELINE_MARGIN_POINTS:
        return Check("layout", "skip", f"inconclusive: no candidate layout predicts better than always proposing the "
                     f"most frequent token (best {_pct(top_acc)} vs {_pct(rank.baseline)}); see the head check",
                     numbers=nums, details=table)
    conf = [f"{k} {v}: {show(rank.find(v))}" for k, v in configured.items()]

    others = [s for s in rank if s.indices and not math.isnan(s.loss) and s.indices != best.indices]
    if others and not any(rank.worse(s.indices, best.indices)[0] for s in others):
        worst = max(others, key=lambda s: s.loss)
        nums["spread_loss"] = round(worst.loss - best.loss, 4)
        return Check("layout", "warn", f"inconclusive: the draft barely uses its features — {len(others) + 1} "
                     f"candidate layouts score within noise of each other (loss {best.loss:.3f}..{worst.loss:.3f}, "
                     f"accuracy {_pct(worst.accuracy)}..{_pct(best.accuracy)}; recorded {recorded}: {show(rec)}), so "
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


# ---- 4. norms -------------------------------------------------------------------------------------

def _norm_parts(streams: list[dict[int, torch.Tensor]], keys: list[int]) -> tuple[dict[int, float], dict[int, float]]:
    """(mean L2 norm at position 0, mean L2 norm over positions >= 1) per stream index."""
    p0 = {k: 0.0 for k in keys}
    rest = {k: 0.0 for k in keys}
    n_rest = 0
    for st in streams:
        for k in keys:
            nrm = st[k].float().norm(dim=-1)  # [S]
            p0[k] += float(nrm[0])
            rest[k] += float(nrm[1:].sum())
        n_rest += next(iter(st.values())).shape[0] - 1
    return ({k: v / max(len(streams), 1) for k, v in p0.items()}, {k: v / max(n_rest, 1) for k, v in rest.items()})


def _expected_norm(m0: float, m_rest: float, length: float) -> float:
    """Token-weighted mean norm over samples of `length` tokens (what datagen records): position 0 once."""
    return (m0 + (length - 1) * m_rest) / length


def _check_norms(recorded: dict[str, float], fresh: list[_Fresh], samples: list[EvalSample], aux: list[int],
                 L: int, recorded_len: float | None) -> Check:
    """Recorded mean norms vs this target's. Position 0 carries a massive activation (SmolLM2 stream 15: ~25000
    at position 0, ~150 elsewhere), so a mean depends on sample length; the comparison models it: the expected
    recorded mean is (m0 + (len-1) m_rest) / len, with len the recorded data's mean sample length when known,
    else any length in NORM_LENGTHS."""
    if not recorded:
        return Check("norms", "skip", "the draft's layout records no stream norms (made before datagen recorded "
                     "them)", fix="re-capture with this eyas to get a norm fingerprint")
    keys = [k for k in aux if str(k) in recorded] + ([L] if "final" in recorded else [])
    m0, mr = _norm_parts([f.streams for f in fresh], keys)
    rec = {k: recorded["final" if k == L else str(k)] for k in keys}
    name = {k: ("final" if k == L else str(k)) for k in keys}
    lens = [recorded_len] if recorded_len else list(NORM_LENGTHS)
    lo = {k: min(_expected_norm(m0[k], mr[k], n) for n in lens) for k in keys}
    hi = {k: max(_expected_norm(m0[k], mr[k], n) for n in lens) for k in keys}
    drift = {}
    for k in keys:  # relative distance of the recorded mean from what this target gives
        e = lo[k] if rec[k] < lo[k] else hi[k] if rec[k] > hi[k] else rec[k]
        drift[k] = (rec[k] - e) / e if e else float("inf")
    exp_txt = {k: f"{lo[k]:.1f}" if abs(hi[k] - lo[k]) < 0.05 else f"{lo[k]:.1f}..{hi[k]:.1f}" for k in keys}
    nums = {"recorded": {name[k]: rec[k] for k in keys},
            "expected_now": {name[k]: [round(lo[k], 4), round(hi[k], 4)] for k in keys},
            "position0_now": {name[k]: round(m0[k], 4) for k in keys},
            "rest_now": {name[k]: round(mr[k], 4) for k in keys},
            "recorded_sample_length": recorded_len, "relative_drift": {name[k]: round(drift[k], 4) for k in keys}}
    lines = [f"stream {name[k]}: recorded {rec[k]:.2f}, this target gives {exp_txt[k]} for "
             + (f"{recorded_len:.0f}-token samples" if recorded_len else
                f"samples of {NORM_LENGTHS[0]}..{NORM_LENGTHS[-1]} tokens")
             + f" (position 0: {m0[k]:.1f}, later: {mr[k]:.1f}; drift {100 * drift[k]:+.1f}%)" for k in keys]
    worst = max(keys, key=lambda k: abs(drift[k]))
    w = abs(drift[worst])
    msg = (f"stream {name[worst]} mean norm {rec[worst]:.2f} recorded at capture vs {exp_txt[worst]} from this "
           f"target ({100 * drift[worst]:+.1f}%)")
    if w >= NORM_FAIL:
        return Check("norms", "fail", "norm fingerprint drift: " + msg + ": another model, quantization or dtype "
                     "path than the draft was trained on", numbers=nums, details=lines,
                     fix="serve the target (file, dtype, device path) the data was captured with, or re-capture "
                         "and retrain")
    if w >= NORM_WARN:
        return Check("norms", "warn", "norm drift: " + msg + " (beyond content-to-content spread)", numbers=nums,
                     details=lines, fix="check the target file, dtype and quantization against the training run")
    return Check("norms", "pass", "norm fingerprint matches: " + "; ".join(
        f"{name[k]} {rec[k]:.1f} vs {exp_txt[k]}" for k in keys), numbers=nums, details=lines)


# ---- data layout: which stream each stored slice holds --------------------------------------------

def _check_data_layout(shard_layout, ckpt: DraftCheckpoint, sample: EvalSample, streams: dict[int, torch.Tensor],
                       L: int) -> Check:
    """Which stream each stored slice of `sample` holds: relative error against every fresh stream 0..L,
    captured the way datagen captured the shards (capture_path_streams)."""
    from ..layout import LayoutError, check_layouts

    lines = []
    problems = []
    try:
        check_layouts(ckpt.layout, shard_layout, "the draft", "the shards", ignore=("capture_final",))
    except LayoutError as e:
        problems.append(str(e).splitlines()[0])
        lines += str(e).splitlines()[1:]
    recorded = list(shard_layout.aux_indices)
    H = sample.stored_aux.shape[-1] // max(len(recorded), 1)
    found = []
    errs = []
    for j, k in enumerate(recorded):
        sl = sample.stored_aux[:, j * H:(j + 1) * H].to(streams[0].device).float()
        err = {kk: float((sl - v.float()).norm() / v.float().norm().clamp_min(1e-12)) for kk, v in streams.items()}
        kbest = min(err, key=err.get)
        found.append(kbest)
        errs.append(err[kbest])
        lines.append(f"slice {j} (manifest: stream {k}): closest stream {kbest} at {100 * err[kbest]:.2f}% error"
                     + (f", stream {k} at {100 * err[k]:.2f}%" if kbest != k else ""))
    fin = sample.stored_final.to(streams[L].device).float()
    ferr = float((fin - streams[L].float()).norm() / streams[L].float().norm().clamp_min(1e-12))
    lines.append(f"stored final vs stream {L}: {100 * ferr:.2f}% error")
    nums = {"manifest_indices": recorded, "measured_indices": found, "relative_error": [round(e, 5) for e in errs],
            "final_error": round(ferr, 5), "row_id": sample.row_id}
    if max(errs + [ferr]) > SLICE_MATCH:
        problems.append(f"the stored features match no stream of this target within {100 * SLICE_MATCH:.0f}% "
                        f"(best errors {', '.join(f'{100 * e:.1f}%' for e in errs)}; final {100 * ferr:.1f}%): "
                        "captured from another model, quantization or dtype path")
    elif found != recorded:
        problems.append(f"the shards hold streams {found}, but their manifest says {recorded}: captured with "
                        "another layout than recorded (an id-convention mix-up)")
    if problems:
        return Check("data_layout", "fail", "; ".join(problems), numbers=nums, details=lines,
                     fix="re-capture the data with `eyas datagen` on this target and layout, then retrain")
    return Check("data_layout", "pass", f"the stored slices are streams {found} of this target (max error "
                 f"{100 * max(errs + [ferr]):.2f}%), as recorded", numbers=nums, details=lines)


# ---- 5. head sanity -------------------------------------------------------------------------------

def _looks_init(w: torch.Tensor) -> str | None:
    w = w.detach().float()
    if w.numel() < 1000:
        return None
    fan_in = w.shape[1]
    flat = w.flatten()
    std = float(flat.std())
    if std == 0 or not torch.isfinite(flat).all():
        return "all zeros" if std == 0 else "non-finite"
    z = (flat - flat.mean()) / std
    kurt = float((z ** 4).mean())
    b = 1.0 / math.sqrt(fan_in)
    if (float(flat.abs().max()) <= b * 1.0001 and abs(std / (b / math.sqrt(3)) - 1) < INIT_STD_TOL
            and abs(kurt - 1.8) < INIT_KURT_TOL):
        return f"torch's default init U(+-1/sqrt({fan_in})) (std {std:.4g}, kurtosis {kurt:.2f}, max |w| <= bound)"
    if abs(std / 0.02 - 1) < INIT_STD_TOL and abs(kurt - 3.0) < INIT_KURT_TOL and abs(float(flat.mean())) < 0.1 * std:
        return f"N(0, 0.02) init (std {std:.4g}, kurtosis {kurt:.2f})"
    # any other i.i.d. init (e.g. a scaled normal): every row and column has the same squared norm up to
    # sampling noise, CV = sqrt((kurtosis - 1) / n) for n entries; training spreads them far wider
    if min(w.shape) >= 128 and (abs(kurt - 3.0) < INIT_KURT_TOL or abs(kurt - 1.8) < INIT_KURT_TOL):
        def cv(n2: torch.Tensor) -> float:
            return float(n2.std() / n2.mean())

        rows, cols = w.pow(2).sum(1), w.pow(2).sum(0)
        exp_r = math.sqrt(max(kurt - 1, 0.1) / w.shape[1])
        exp_c = math.sqrt(max(kurt - 1, 0.1) / w.shape[0])
        if cv(rows) < IID_SPREAD * exp_r and cv(cols) < IID_SPREAD * exp_c:
            return (f"an i.i.d. random init (kurtosis {kurt:.2f}; row/column norm spread {100 * cv(rows) / 2:.1f}%/"
                    f"{100 * cv(cols) / 2:.1f}%, as sampling noise alone gives)")
    return None


def _check_head(draft: Eagle3Draft, serve: dict[str, Any], rank: LayoutRanking | None) -> Check:
    sig = {name: _looks_init(getattr(draft, name).weight) for name in ("lm_head", "fc")}
    ent = serve.get("entropy_ratio", float("nan"))
    ent_t = serve.get("target_entropy_ratio", float("nan"))
    best = max((s.accuracy for s in rank if not math.isnan(s.accuracy)), default=float("nan")) if rank \
        else serve["acc"][0]
    base = rank.baseline if rank else float("nan")
    nums = {"init_signature": sig, "entropy_ratio": ent, "target_entropy_ratio": ent_t, "best_step0_acc": best,
            "baseline": base}
    evidence = [f"{n} weights match {s}" for n, s in sig.items() if s]
    # near-uniform: flat over the draft vocab AND clearly flatter than the target it should imitate
    near_uniform = not math.isnan(ent) and ent >= UNIFORM_ENTROPY and not ent_t >= ent - UNIFORM_GAP
    no_better = not math.isnan(base) and not math.isnan(best) and 100 * (best - base) <= BASELINE_MARGIN_POINTS
    if near_uniform:
        evidence.append(f"draft logits are near-uniform (entropy {100 * ent:.0f}% of log Vd; the target's "
                        f"{100 * ent_t:.0f}%)")
    if no_better:
        evidence.append(f"best step-0 accuracy {_pct(best)} vs {_pct(base)} for always proposing the most frequent "
                        "token")
    absent = [n for n, s in sig.items() if s in ("all zeros", "non-finite")]
    fix = "train the draft (or load the trained checkpoint); a head at its init gives accept length ~1.0"
    if absent:
        return Check("head", "fail", f"{' and '.join(absent)} absent ({', '.join(sig[n] for n in absent)})",
                     numbers=nums, details=evidence, fix=fix)
    if any(sig.values()) and (near_uniform or no_better):
        names = " and ".join(n for n, s in sig.items() if s)
        return Check("head", "fail", f"{names} look untrained: " + "; ".join(evidence), numbers=nums,
                     details=evidence, fix=fix)
    if near_uniform and no_better:
        return Check("head", "fail", "the draft predicts nothing: " + "; ".join(evidence), numbers=nums,
                     details=evidence, fix=fix)
    if any(sig.values()) or no_better:
        return Check("head", "warn", "suspicious head: " + "; ".join(evidence), numbers=nums, details=evidence,
                     fix="check the layout and vocab_map findings; retrain if the head never trained")
    return Check("head", "pass", f"trained head: step-0 accuracy {_pct(best)} vs {_pct(base)} baseline, logits "
                 f"entropy {100 * ent:.0f}% of log Vd (target {100 * ent_t:.0f}%), weights away from their init",
                 numbers=nums)


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
    weights: the engine forward's mode for the serving path (eyas.model.engine_model)."""
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
    draft = _prepare(ckpt.model, target)
    L, recorded = target.num_layers, list(ckpt.layout.aux_indices)
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

    # the layouts engines would configure from config.json, as extra bases for the candidates
    configured: dict[str, list[int]] = {}
    cfg = _read_config(ckpt)
    if cfg is not None:
        for eng in ("sglang", "vllm"):
            for v in engine_views(cfg, eng, L):
                if v.indices is not None and v.indices != recorded and len(v.indices) == len(recorded):
                    configured[f"{eng} config.json" + (f" ({v.when})" if v.when else "")] = v.indices
    cands = layout_candidates(recorded, L, draft.config.num_aux, configured)
    serving = Serving(target, weights)
    meta["serving_path"] = serving.path
    need = {k for idx, _ in cands for k in idx} | set(recorded)
    fresh = _fresh(serving, draft, target, evs, need)  # ONE per sample

    serve = _score(draft, target, [torch.cat([f.streams[k] for k in recorded], -1) for f in fresh],
                   [f.final for f in fresh], evs, K, [f.labels for f in fresh], want_logits=True)
    train = None
    if all(s.stored_aux is not None for s in evs):
        train = _score(draft, target, [s.stored_aux for s in evs], [s.stored_final for s in evs], evs, K)
    metric = (man.get("metrics") or {}).get("heldout_acc")
    rows = (man.get("metrics") or {}).get("heldout_rows")
    checks.append(_check_accuracy(serve, train, metric[:K] if metric else None, rows, serving.path,
                                  paired=train is not None))
    rank = _rank(draft, target, evs, fresh, cands, keep=[recorded, *configured.values()])
    dflt = default_aux_indices(L)
    bases = [*configured.values(), *([dflt] if len(dflt) == len(recorded) else [])]
    rank = rank.simplest_among_ties(recorded, bases)
    checks.append(_check_layout(rank, recorded, L, configured))
    checks.append(_check_norms(ckpt.layout.norms, fresh, evs, recorded, L, _recorded_length(man, shard_set)))
    if shard_set is not None:
        captured = capture_path_streams(target, evs[0].input_ids)
        checks.append(_check_data_layout(shard_set.layout, ckpt, evs[0], captured, L))
    checks.append(_check_head(draft, serve, rank))
    acc = {"steps": K, "serving": serve, "training": train, "training_time_metric": metric,
           "serving_path": serving.short}
    return DoctorReport(_ordered(checks), layout=rank, accuracy=acc, meta=meta)


def _training_data(man: dict[str, Any]) -> dict[str, Any]:
    """What the draft manifest says it trained on: shard folders that exist here, the conversation source
    (its row ids are the shards' row ids, so the held-out split can be rebuilt), whether replies were
    regenerated, and the regenerated folders' share of the training tokens (a mix of original and regenerated
    folders is weighed by kept tokens; manifests from before per-folder configs know only the first folder)."""
    d = man.get("data") if isinstance(man.get("data"), dict) else {}
    cfg = d.get("config") if isinstance(d.get("config"), dict) else {}
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
                         f"always proposing the most frequent token: {_pct(report.layout.baseline)})")
        lt.add_column("rank", justify="right")
        lt.add_column("stream indices")
        lt.add_column("candidate", overflow="fold")
        lt.add_column("accuracy", justify="right")
        lt.add_column("loss (nats)", justify="right")
        for i, s in enumerate(report.layout[:10]):
            lt.add_row(str(i + 1), str(list(s.indices)) if s.indices else "(final only)", s.label,
                       "engine crashes" if math.isnan(s.accuracy) else _pct(s.accuracy),
                       "" if math.isnan(s.loss) else f"{s.loss:.3f}")
        con.print(lt)
    if report.accuracy:
        a = report.accuracy
        at = Table(title="held-out accuracy per TTT step")
        at.add_column("path")
        for j in range(a["steps"]):
            at.add_column(f"step {j}", justify="right")
        if a.get("training"):
            at.add_row("training (stored shards)", *[_pct(x) for x in a["training"]["acc"]])
        at.add_row(f"serving (fresh, {a.get('serving_path', 'engine forward')})",
                   *[_pct(x) for x in a["serving"]["acc"]])
        if a.get("training_time_metric"):
            m = list(a["training_time_metric"])[:a["steps"]]
            m = m + [float("nan")] * (a["steps"] - len(m))
            at.add_row("training-time metric (manifest)", *[_pct(x) for x in m])
        con.print(at)
    render_fixes(report.checks, con)
    con.print("[green]all checks pass[/]" if report.ok else
              f"[red]{sum(c.status == 'fail' for c in report.checks)} failed[/], "
              f"[yellow]{sum(c.status == 'warn' for c in report.checks)} warned[/]")
