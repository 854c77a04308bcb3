"""The doctor's stored-vs-fresh feature checks: the norm fingerprint recorded at capture against this target's
(norms), and which stream each stored feature slice really holds (data_layout)."""

from __future__ import annotations

import torch

from ..draft import DraftCheckpoint
from ..probe import EvalSample, FreshStreams
from .checklist import Check

# relative drift of a mean stream norm from what this target gives (position 0 modelled separately: SmolLM2's
# stream 15 averages 353 over 128-token samples, 223 over 384, 179 over 1024, all explained by ~25000 at
# position 0 and ~150 elsewhere; other content moves a mean by ~5%, measured on ShareGPT rows)
NORM_WARN, NORM_FAIL = 0.15, 0.40
NORM_LENGTHS = (16, 8192)  # plausible mean sample lengths when the recorded data's is unknown
SLICE_MATCH = 0.02  # stored slice == fresh stream when relative error < 2% (bf16 storage is ~0.4%)


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


def check_norms(recorded: dict[str, float], fresh: list[FreshStreams], samples: list[EvalSample], aux: list[int],
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


def check_data_layout(shard_layout, ckpt: DraftCheckpoint, sample: EvalSample, streams: dict[int, torch.Tensor],
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
    assert sample.stored_aux is not None and sample.stored_final is not None  # a sample read from the shards
    H = sample.stored_aux.shape[-1] // max(len(recorded), 1)
    found = []
    errs = []
    for j, k in enumerate(recorded):
        sl = sample.stored_aux[:, j * H:(j + 1) * H].to(streams[0].device).float()
        err = {kk: float((sl - v.float()).norm() / v.float().norm().clamp_min(1e-12)) for kk, v in streams.items()}
        kbest = min(err, key=err.__getitem__)
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
