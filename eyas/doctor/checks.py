"""`eyas doctor`: find every wiring fault between target, data, draft and serving config, from measurements.

Checks (each a named `Check` with status pass/warn/fail/skip, the numbers behind it and a fix):
  target_identity  the draft's recorded target (layers, hidden, vocab, weights fingerprint) vs the target now
  hidden_size      fc input = n_aux x target hidden; the draft shares the target's embeddings
  vocab_map        d2t/t2d consistent and in range; the same draft vocabulary as at training (hash)
  config_hidden    config.json `target_hidden_size` present and right (engines fall back to hidden_size)
  config_ids       which stream indices SGLang and vLLM capture when they read config.json (eyas.flags)
  data_layout      (--data) which stream each stored feature slice really holds, measured against the target
  accuracy         per-step held-out accuracy: stored shards (training path) vs features captured fresh
                   through the engine's forward (serving path) vs the training-time metric; skew > 2 points
  layout           layout inference: the recorded layout vs shifted/embedding/final-only/permuted candidates
  norms            per-index stream norms recorded at capture vs measured now
  head             lm_head / fc that look untrained (init statistics, near-uniform logits, accuracy ~ baseline)

Every accuracy is `eyas.ttt.ttt_forward` on the draft (the training-time-test alignment of
docs/CONTRACTS.md); the serving path captures with `eyas.model.TargetModel`, the forward the engine runs.
All stream indices a sample needs are captured in ONE target forward per sample.

Also here: `infer_layout` (the layout-inference API `eyas import` uses) and `trace` (one prompt through the
engine, observed stage by stage). The serve-flag lint lives in eyas/flags.py.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from ..draft import DraftCheckpoint, Eagle3Draft
from ..errors import EyasError
from ..layout import default_aux_indices, layout_diff
from ..train.ttt import step_valid, target_labels, ttt_forward
from .flags import Check, engine_views, jsonable, render_checks, render_fixes

__all__ = ["Check", "DoctorReport", "LayoutScore", "LayoutRanking", "EvalSample", "infer_layout",
           "layout_candidates", "run_doctor", "check_identity", "DoctorError", "trace", "TraceReport"]

# ---- thresholds (why each value) ------------------------------------------------------------------
SKEW_POINTS = 2.0  # the bar: a training/serving accuracy gap above 2 points is skew
# a candidate must beat the recorded layout's held-out loss by LOSS_Z paired standard errors AND by this share of
# the loss to be called its true layout. Measured: on the shipped SmolLM2 draft (loss 4.68) a +1 shift costs
# 0.069 nats (z 12 over 2,900 positions), moving the top id 27->26 0.040 (z 10), 15->16 0.006 (z 5), 2->3 0.001
# (z 1); on the tiny test pair (loss 3.75, flat targets) single-id moves cost 0.003..0.005 nats at z > 25.
LOSS_Z = 4.0
LOSS_MARGIN_REL = 0.001
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
FINAL_ONLY = "final state only"


class DoctorError(EyasError):
    """Bad input to the doctor (unreadable data, no samples); the message says what to pass."""


# ---- report ---------------------------------------------------------------------------------------

class LayoutScore(NamedTuple):
    """One candidate layout. indices [] = no aux capture: the target's final post-norm 1xH state is fed
    straight to the draft layer, skipping fc — what SGLang/vLLM do when they run EAGLE instead of EAGLE3
    (sglang/srt/models/llama_eagle3.py and vllm's llama_eagle3.py apply fc only when the feature is wider
    than hidden_size). accuracy: step-0 held-out accuracy in [0, 1], or NaN when the engine would crash.
    loss: mean step-0 cross-entropy against the target's distribution (the training loss, nats), NaN likewise."""

    indices: list[int]
    label: str
    accuracy: float
    loss: float = float("nan")


class LayoutRanking(list):
    """`infer_layout`'s result: LayoutScores, best first, plus the measurement context. Also answers the
    summary keys 'chosen' (best label), 'aux_indices' (best indices), 'accuracy' and 'table' with
    `ranking["key"]` / `ranking.get("key")`, for callers that want a dict."""

    def __init__(self, scores: Sequence[LayoutScore], tokens: int = 0, baseline: float = 0.0,
                 rows: Mapping[tuple[int, ...], torch.Tensor] | None = None,
                 first_rows: Mapping[tuple[int, ...], torch.Tensor] | None = None):
        super().__init__(scores)
        self.tokens = tokens  # valid step-0 positions each accuracy was measured on
        self.baseline = baseline  # accuracy of always proposing the most frequent target token
        self.rows = dict(rows or {})  # indices -> per-position step-0 loss [tokens], same positions for all
        self.first_rows = dict(first_rows or {})  # the same on the first-stage sample, for every candidate

    def paired(self, a: Sequence[int], b: Sequence[int]) -> tuple[float, float] | None:
        """(mean loss of a minus mean loss of b, its paired standard error) in nats, over all positions when
        both were scored on all, else over the first-stage sample; None when not both were scored."""
        for rows in (self.rows, self.first_rows):
            ra, rb = rows.get(tuple(a)), rows.get(tuple(b))
            if ra is not None and rb is not None and ra.numel() == rb.numel() and ra.numel() >= 2:
                d = (ra - rb).double()
                return float(d.mean()), float(d.std() / math.sqrt(d.numel()))
        return None

    def worse(self, a: Sequence[int], b: Sequence[int]) -> tuple[bool, float, float]:
        """Is layout a's held-out loss worse than b's beyond noise (LOSS_Z paired SEs and LOSS_MARGIN_REL)?
        Returns (worse, difference in nats, paired SE)."""
        p = self.paired(a, b)
        if p is None:
            return False, float("nan"), float("nan")
        d, se = p
        sb = self.find(list(b))
        ref = abs(sb.loss) if sb is not None and not math.isnan(sb.loss) else 0.0
        return d > max(LOSS_Z * se, LOSS_MARGIN_REL * ref), d, se

    @property
    def best(self) -> LayoutScore:
        return self[0]

    def find(self, indices: list[int]) -> LayoutScore | None:
        return next((s for s in self if list(s.indices) == list(indices)), None)

    def to_dict(self) -> dict[str, Any]:
        b = self[0] if self else None
        return {"chosen": b.label if b else None, "aux_indices": list(b.indices) if b else None,
                "accuracy": b.accuracy if b else None, "tokens": self.tokens, "baseline": self.baseline,
                "loss": b.loss if b and not math.isnan(b.loss) else None,
                "table": [{"indices": list(s.indices), "label": s.label,
                           "accuracy": None if math.isnan(s.accuracy) else round(s.accuracy, 4),
                           "loss": None if math.isnan(s.loss) else round(s.loss, 4)} for s in self]}

    def __getitem__(self, key):  # type: ignore[override]
        if isinstance(key, str):
            return self.to_dict()[key]
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        return self.to_dict().get(key, default)


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


# ---- 1. identity: no compute ----------------------------------------------------------------------

def check_identity(target, ckpt: DraftCheckpoint) -> list[Check]:
    """target_identity, hidden_size, vocab_map, config_hidden, config_ids."""
    return [_check_target_identity(target, ckpt), _check_hidden(target, ckpt), _check_vocab(target, ckpt),
            *_check_engine_config(target, ckpt)]


def _check_target_identity(target, ckpt: DraftCheckpoint) -> Check:
    lay, now = ckpt.layout, target.identity
    if lay.target is None:
        return Check("target_identity", "warn", "the draft records no target identity; cannot tell which target "
                     "it was trained for", fix="retrain or import it with this eyas (`eyas import`)")
    diffs = [d for d in layout_diff(lay, target.default_layout(lay.aux_indices)) if d[0].startswith("target.")]
    nums = {"recorded": lay.target.to_dict(), "now": now.to_dict()}
    bad = [k for k in lay.aux_indices if not 0 <= k <= now.num_layers]
    if bad:
        diffs.append(("aux_indices", lay.aux_indices, f"outside 0..{now.num_layers}"))
    if not diffs:
        return Check("target_identity", "pass", f"same target: {now.architecture}, {now.num_layers} layers, hidden "
                     f"{now.hidden_size}, vocab {now.vocab_size}, weights {now.fingerprint}", numbers=nums)
    details = [f"{n}: recorded {a!r}, now {b!r}" for n, a, b in diffs]
    if [d[0] for d in diffs] == ["target.fingerprint"]:
        return Check("target_identity", "fail",
                     f"the target's weights changed: re-quantized or another file (fingerprint {diffs[0][1]} at "
                     f"training, {diffs[0][2]} now; architecture, layers, hidden and vocab all match)",
                     numbers=nums, details=details,
                     fix="serve the exact target file the draft was trained on, or re-capture data on this target "
                         "and retrain; the accuracy and norms checks below measure how much it matters")
    return Check("target_identity", "fail", "the draft was made for another model: " + "; ".join(details),
                 numbers=nums, details=details, fix="use the draft's own target, or train a draft for this one")


def _check_hidden(target, ckpt: DraftCheckpoint) -> Check:
    c = ckpt.model.config
    Ht = target.hidden_size
    fc_in = int(ckpt.model.fc.weight.shape[1])
    emb_w = int(target.embed_tokens().weight.shape[1])
    nums = {"target_hidden": Ht, "draft_target_hidden_size": c.target_hidden_size, "num_aux": c.num_aux,
            "fc_in": fc_in, "draft_hidden": c.hidden_size, "target_embedding_width": emb_w}
    problems = []
    if fc_in != c.num_aux * Ht:
        problems.append(f"fc takes {fc_in} inputs but the target gives {c.num_aux} x {Ht} = {c.num_aux * Ht}")
    if c.target_hidden_size != Ht:
        problems.append(f"the draft was built for target hidden {c.target_hidden_size}, this target has {Ht}")
    if c.hidden_size != emb_w:
        problems.append(f"draft hidden {c.hidden_size} != target embedding width {emb_w}: eyas's draft shares the "
                        "target's token embeddings, so it cannot run on this target")
    if problems:
        return Check("hidden_size", "fail", "; ".join(problems), numbers=nums,
                     fix="use the draft's own target, or train a draft for this one")
    return Check("hidden_size", "pass", f"fc input {fc_in} = {c.num_aux} x target hidden {Ht}; draft hidden "
                 f"{c.hidden_size} = target embedding width", numbers=nums)


def _check_vocab(target, ckpt: DraftCheckpoint) -> Check:
    m, c = ckpt.model, ckpt.model.config
    V, Vd = target.identity.vocab_size, c.draft_vocab_size
    d2t, t2d = m.d2t.detach().cpu().long(), m.t2d.detach().cpu().bool()
    ids = torch.arange(Vd) + d2t  # target id of each draft id
    nums: dict[str, Any] = {"target_vocab": V, "draft_vocab": Vd, "draft_config_vocab": c.vocab_size,
                            "t2d_sum": int(t2d.sum()), "t2d_len": int(t2d.numel())}
    problems, fixes = [], []
    if c.vocab_size != V or t2d.numel() != V:
        problems.append(f"the draft was built for a {c.vocab_size}-token vocabulary (t2d over {t2d.numel()}), "
                        f"the target has {V}")
        fixes.append("use the draft's own target")
    out_of_range = ((ids < 0) | (ids >= V)).nonzero().flatten()
    nums["d2t_out_of_range"] = int(out_of_range.numel())
    if out_of_range.numel():
        i = int(out_of_range[0])
        problems.append(f"{out_of_range.numel()} draft ids map outside 0..{V - 1} (draft id {i} -> {int(ids[i])})")
    ok_ids = ids.clamp(0, max(V - 1, 0))
    dup = Vd - int(ok_ids.unique().numel())
    nums["d2t_duplicates"] = dup
    if dup:
        problems.append(f"{dup} draft ids map to a target id another draft id already has")
    if t2d.numel() == V and not out_of_range.numel():
        unmarked = int((~t2d[ids]).sum())
        extra = int(t2d.sum()) - (Vd - unmarked)
        nums.update(d2t_targets_not_in_t2d=unmarked, t2d_ids_not_in_d2t=extra)
        if int(t2d.sum()) != Vd:
            problems.append(f"t2d marks {int(t2d.sum())} target ids but the draft vocabulary has {Vd}")
        if unmarked:
            problems.append(f"{unmarked} of {Vd} draft ids map (d2t) to target ids that t2d does not mark, and t2d "
                            f"marks {extra} ids no draft id maps to: d2t and t2d come from different vocabulary "
                            "selections (a stale mapping)")
    if problems and not fixes:
        fixes.append("rebuild d2t and t2d from the vocabulary the draft was trained with (Eagle3Draft.set_vocab_map) "
                     "or retrain; SGLang/vLLM map proposals through d2t, so a stale d2t proposes wrong tokens")
    rec = (ckpt.manifest.get("draft_vocab") or {}).get("hash")
    if rec and not out_of_range.numel():
        from ..vocab import vocab_hash

        now_hash = vocab_hash(ids)
        nums.update(recorded_hash=rec, hash_now=now_hash)
        if now_hash != rec:
            problems.append(f"the draft vocabulary (d2t) hashes to {now_hash}, not the {rec} recorded at training: "
                            "the lm_head's rows are mapped to other tokens than it learned (a stale mapping)")
            fixes.append("restore d2t/t2d from the training run's checkpoint")
    if problems:
        return Check("vocab_map", "fail", "; ".join(problems), numbers=nums, fix="; ".join(dict.fromkeys(fixes)))
    return Check("vocab_map", "pass", f"{Vd} draft ids map to distinct target ids in range; t2d marks exactly "
                 "them" + ("; same vocabulary as at training (hash)" if rec else ""), numbers=nums)


def _read_config(ckpt: DraftCheckpoint) -> dict[str, Any] | None:
    import json

    if ckpt.path is None or not (Path(ckpt.path) / "config.json").is_file():
        return None
    return json.loads((Path(ckpt.path) / "config.json").read_text())


def _check_engine_config(target, ckpt: DraftCheckpoint) -> list[Check]:
    cfg = _read_config(ckpt)
    if cfg is None:
        why = "the draft has no folder" if ckpt.path is None else f"{ckpt.path} has no config.json"
        return [Check("config_hidden", "skip", f"{why}: nothing for SGLang/vLLM to read"),
                Check("config_ids", "skip", f"{why}: nothing for SGLang/vLLM to read")]
    Ht, nA = target.hidden_size, ckpt.model.config.num_aux
    th, h = cfg.get("target_hidden_size"), cfg.get("hidden_size")
    nums = {"target_hidden_size": th, "hidden_size": h, "target_hidden": Ht}
    # sglang/srt/models/llama_eagle3.py and vllm's llama_eagle3.py: fc = Linear(3 * (target_hidden_size if
    # present else hidden_size), hidden_size) — a missing key silently means "the draft's own hidden size".
    if th is None:
        used = h if h is not None else "?"
        if h == Ht:
            hidden = Check("config_hidden", "warn", f"config.json has no target_hidden_size; SGLang/vLLM fall back "
                           f"to hidden_size {h}, which equals the target hidden {Ht} (harmless here, wrong the day "
                           "the sizes differ)", numbers=nums, fix=f'add "target_hidden_size": {Ht} to config.json')
        else:
            hidden = Check("config_hidden", "fail", f"config.json has no target_hidden_size and hidden_size {used} != "
                           f"target hidden {Ht}: SGLang/vLLM build fc for {nA} x {used} inputs while the target "
                           f"feeds {nA} x {Ht} (the server fails to load or computes garbage)", numbers=nums,
                           fix=f'add "target_hidden_size": {Ht} to config.json')
    elif th != Ht:
        hidden = Check("config_hidden", "fail", f"config.json target_hidden_size {th} != target hidden {Ht}",
                       numbers=nums, fix=f'set "target_hidden_size": {Ht} (or use the draft\'s own target)')
    else:
        hidden = Check("config_hidden", "pass", f"config.json target_hidden_size {th} = target hidden", numbers=nums)
    return [hidden, _check_config_ids(cfg, ckpt.layout.aux_indices, target.num_layers)]


def _check_config_ids(cfg: dict[str, Any], trained: list[int], L: int) -> Check:
    from .flags import config_fix

    lines, worst, fixes = [], "pass", []
    views_out: dict[str, Any] = {}
    for eng in ("sglang", "vllm"):
        views = engine_views(cfg, eng, L)
        views_out[eng] = [{"indices": v.indices, "source": v.source, "when": v.when} for v in views]
        bad = [v for v in views if v.indices != list(trained)]
        for v in views:
            got = FINAL_ONLY if v.indices is None else f"stream {v.indices}"
            mark = "ok" if v not in bad else "WRONG"
            lines.append(f"{eng}{' (' + v.when + ')' if v.when else ''}: {v.source} -> {got} [{mark}]")
        if bad:
            sev = "fail" if len(bad) == len(views) or any(v.indices is None for v in bad) else "warn"
            worst = "fail" if "fail" in (worst, sev) else sev
            fixes.append(config_fix(eng, list(trained), L))
    nums = {"trained": list(trained), "views": views_out}
    if worst == "pass":
        return Check("config_ids", "pass", f"SGLang and vLLM both capture the trained stream {list(trained)} from "
                     "config.json", numbers=nums, details=lines)
    wrong = [ln for ln in lines if ln.endswith("[WRONG]")]
    return Check("config_ids", worst, f"config.json makes an engine capture other layers than the trained stream "
                 f"{list(trained)}: " + wrong[0].removesuffix(" [WRONG]")
                 + (" (depends on the engine version)" if worst == "warn" else ""),
                 numbers=nums, details=lines, fix="; ".join(fixes))


# ---- samples and the serving-path capture ---------------------------------------------------------

@dataclass
class EvalSample:
    row_id: int
    input_ids: torch.Tensor  # [S] long
    loss_mask: torch.Tensor  # [S] bool (which positions are scored)
    stored_aux: torch.Tensor | None = None  # [S, nA*Ht] from shards: the training path's features
    stored_final: torch.Tensor | None = None  # [S, Ht]


def as_samples(samples: Sequence[Any]) -> list[EvalSample]:
    """Token-id tensors [S], (ids, loss_mask) pairs, shards Samples or EvalSamples -> EvalSamples."""
    out = []
    for i, s in enumerate(samples):
        if isinstance(s, EvalSample):
            out.append(s)
        elif hasattr(s, "input_ids") and hasattr(s, "aux"):  # eyas.shards.Sample
            out.append(EvalSample(int(s.row_id), s.input_ids.long(), s.loss_mask.bool(), s.aux, s.final))
        elif isinstance(s, (tuple, list)) and len(s) == 2:
            ids, mask = torch.as_tensor(s[0]).long().reshape(-1), torch.as_tensor(s[1]).bool().reshape(-1)
            out.append(EvalSample(i, ids, mask))
        else:
            ids = torch.as_tensor(s).long().reshape(-1)
            out.append(EvalSample(i, ids, torch.ones_like(ids, dtype=torch.bool)))
    for s in out:
        if s.input_ids.numel() < 3:
            raise DoctorError(f"sample {s.row_id} has {s.input_ids.numel()} tokens; the draft needs at least 3")
        if s.loss_mask.shape != s.input_ids.shape:
            raise DoctorError(f"sample {s.row_id}: loss_mask {tuple(s.loss_mask.shape)} != input_ids "
                              f"{tuple(s.input_ids.shape)}")
    return out


def shard_samples(folders: Sequence[str | Path], num: int, heldout_pct: float,
                  max_tokens: int) -> tuple[list[EvalSample], Any]:
    """The first `num` held-out samples (by the training split) of shard folders, at most max_tokens each."""
    from ..data.shards import ShardSet

    ss = ShardSet(list(folders))
    out = []
    for s in ss.samples("heldout", heldout_pct):
        n = min(len(s), max_tokens)
        out.append(EvalSample(int(s.row_id), s.input_ids[:n].long(), s.loss_mask[:n].bool(), s.aux[:n], s.final[:n]))
        if len(out) >= num:
            break
    if not out:
        raise DoctorError(f"{list(folders)} hold no held-out samples at --heldout-pct {heldout_pct}: the doctor "
                          "measures on rows the draft never trained on; pass the training run's --heldout-pct")
    return out, ss


def conversation_samples(tokenizer, source: str, num: int, max_len: int, heldout_pct: float | None,
                         scan: int = 4000) -> list[EvalSample]:
    """`num` conversations of a source, tokenized with the chat template and the assistant loss mask; when the
    draft trained on this source, only rows of its held-out split (the same `is_heldout` rule as training)."""
    from ..data.conversations import DataError, iter_source, tokenize_conversation
    from ..data.shards import is_heldout

    if tokenizer is None:
        raise DoctorError("the target has no tokenizer: pass token-id samples (samples=...) instead of a source")
    out: list[EvalSample] = []
    seen = 0
    for item in iter_source(source):
        seen += 1
        if seen > scan and out:
            break
        if not hasattr(item, "messages"):
            continue
        if heldout_pct is not None and not is_heldout(int(item.row_id), heldout_pct):
            continue
        try:
            ids, mask = tokenize_conversation(tokenizer, item.messages, max_len)
        except DataError:
            continue
        if ids.numel() < 8 or int(mask[2:].sum()) == 0:
            continue
        out.append(EvalSample(int(item.row_id), ids, mask))
        if len(out) >= num:
            break
    if not out:
        raise DoctorError(f"no usable conversations in {source!r} (scanned {seen} rows"
                          + (f", held-out rows at {heldout_pct}%" if heldout_pct is not None else "") + ")")
    return out


class Serving:
    """The serving-path forward: eyas.model.TargetModel (what the engine runs) when the family has one,
    else the HF forward with hooks (the only path those families have)."""

    def __init__(self, target):
        self.target = target
        self.L = target.num_layers
        try:
            from ..model import TargetModel

            self.fwd = TargetModel(target.model)
            self.path = "eyas.model.TargetModel (the engine's forward)"
        except ValueError:
            self.fwd = None
            self.path = "HF forward + hooks (no engine forward for this family)"

    @torch.no_grad()
    def streams(self, input_ids: torch.Tensor, indices: Sequence[int]) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """input_ids [S] -> ({k: [S, H]} for each wanted stream index, final pre-norm [S, H]); one forward."""
        want = sorted(set(int(k) for k in indices) - {self.L})
        ids = input_ids.reshape(1, -1).to(self.target.device)
        H = self.target.hidden_size
        if self.fwd is not None:
            cap = self.fwd.capture(ids, want)
        else:
            from ..target import capture

            cap = capture(self.target.model, ids, want)
        parts = {k: cap.aux[0, :, i * H:(i + 1) * H] for i, k in enumerate(want)} if want else {}
        final = cap.final_prenorm[0]
        parts[self.L] = final
        return parts, final


@dataclass
class _Fresh:
    streams: dict[int, torch.Tensor]  # k -> [S, H]
    final: torch.Tensor  # [S, H] pre-norm
    labels: tuple[torch.Tensor, torch.Tensor]  # (probs [1,S,Vd], argmax [1,S]) from the fresh final


def _prepare(draft: Eagle3Draft, target) -> Eagle3Draft:
    if draft.embed_weight.numel() == 0:
        draft.set_embeddings(target.embed_tokens().weight)
    dev = target.device
    if draft.fc.weight.device != dev:
        draft.to(dev)
    draft.eval()
    return draft


def _fresh(serving: Serving, draft: Eagle3Draft, target, samples: list[EvalSample], indices: set[int],
           all_streams_first: bool = False) -> list[_Fresh]:
    """One serving-path forward per sample capturing `indices` (every stream 0..L for the first sample when
    asked: the data-layout check compares stored slices with all of them)."""
    out = []
    ids_map = draft.target_token_ids()
    for i, s in enumerate(samples):
        want = range(serving.L + 1) if (i == 0 and all_streams_first) else indices
        streams, final = serving.streams(s.input_ids, sorted(want))
        labels = target_labels(final[None].float(), target.final_norm(), target.lm_head(), ids_map)
        out.append(_Fresh(streams, final, labels))
    return out


# ---- accuracy through ttt_forward ---------------------------------------------------------------

def _final_only_view(draft: Eagle3Draft) -> Eagle3Draft | None:
    """The draft as an engine running EAGLE (not EAGLE3) uses it: the 1xH final state skips fc. None when the
    draft's hidden differs from the target's (the engine would then apply a 3xH fc to a 1xH input: a crash)."""
    c = draft.config
    if c.hidden_size != c.target_hidden_size:
        return None
    view = copy.copy(draft)  # shares every parameter; only fc and the config differ
    view._modules = dict(draft._modules)
    view._modules["fc"] = _SkipFc(draft.fc.weight)
    view.config = replace(c, num_aux=1)
    return view


class _SkipFc(nn.Module):
    """fc skipped (the feature is already hidden-wide); keeps a `weight` so callers can read its dtype."""

    def __init__(self, like: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", torch.empty(0, dtype=like.dtype, device=like.device), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


BATCH_TOKENS = 8192  # padded tokens per ttt_forward batch


def _batches(lengths: list[int], budget: int = BATCH_TOKENS) -> list[list[int]]:
    """Sample indices grouped by similar length so that (longest x count) stays within budget."""
    from ..data.datagen import length_batches

    return length_batches(lengths, 1 << 30, budget)


def _pad(xs: list[torch.Tensor], S: int) -> torch.Tensor:
    """Right-pad [S_i, ...] tensors with zeros to [B, S, ...] (padding rows are masked out by loss_mask)."""
    out = xs[0].new_zeros((len(xs), S, *xs[0].shape[1:]))
    for b, x in enumerate(xs):
        out[b, :x.shape[0]] = x
    return out


def _entropy(p: torch.Tensor) -> torch.Tensor:
    return -(p * torch.log(p.clamp_min(1e-30))).sum(-1)


@torch.no_grad()
def _score(draft: Eagle3Draft, target, feats: list[torch.Tensor], finals: list[torch.Tensor],
           samples: list[EvalSample], steps: int, labels: list[Any] | None = None,
           want_logits: bool = False, want_rows: bool = False) -> dict[str, Any]:
    """Per-step correct/count of ttt_forward over samples (right-padded batches); with want_logits also the
    step-0 entropy of the draft's and the target's distributions over the draft vocab, as a share of log Vd;
    with want_rows (needs labels) the step-0 cross-entropy of every scored position, in a fixed order
    ("rows" [tokens] fp32; "loss" their mean)."""
    rows: list[torch.Tensor] = []
    correct = torch.zeros(steps, dtype=torch.long)
    count = torch.zeros(steps, dtype=torch.long)
    ent_d = ent_t = 0.0
    ent_n = 0
    dev = draft.fc.weight.device
    dtype = next(draft.parameters()).dtype
    for group in _batches([s.input_ids.numel() for s in samples]):
        S = max(samples[i].input_ids.numel() for i in group)
        aux = _pad([feats[i].to(dev, dtype) for i in group], S)
        fin = _pad([finals[i].to(dev).float() for i in group], S)
        ids = _pad([samples[i].input_ids.to(dev) for i in group], S)
        mask = _pad([samples[i].loss_mask.to(dev) for i in group], S)
        lab = None
        if labels is not None:
            lab = (_pad([labels[i][0][0] for i in group], S), _pad([labels[i][1][0] for i in group], S))
        o = ttt_forward(draft, aux, fin, ids, mask, target.final_norm(), target.lm_head(), steps,
                        labels=lab, return_logits=want_logits or want_rows)
        correct += o.step_correct.cpu()
        count += o.step_count.cpu()
        if want_rows and o.logits and lab is not None:
            valid = step_valid(mask, 1)[0]  # [B, S-1]
            ce = -(lab[0][:, 1:] * torch.log_softmax(o.logits[0].float(), -1)).sum(-1)  # [B, S-1]
            rows.append(ce[valid].cpu())
        if want_logits and o.logits and lab is not None:
            valid = step_valid(mask, 1)[0]  # [B, S-1]: row t scored against the target at t+1
            if valid.any():
                ent_d += float(_entropy(torch.softmax(o.logits[0][valid].float(), -1)).sum())
                ent_t += float(_entropy(lab[0][:, 1:][valid]).sum())
                ent_n += int(valid.sum())
    acc = [(int(c) / int(n)) if n else float("nan") for c, n in zip(correct, count, strict=True)]
    out = {"correct": correct.tolist(), "count": count.tolist(), "acc": acc}
    if want_rows:
        out["rows"] = torch.cat(rows) if rows else torch.zeros(0)
        out["loss"] = float(out["rows"].mean()) if out["rows"].numel() else float("nan")
    if want_logits:
        logv = math.log(max(draft.config.draft_vocab_size, 2))
        out["entropy_ratio"] = ent_d / ent_n / logv if ent_n else float("nan")
        out["target_entropy_ratio"] = ent_t / ent_n / logv if ent_n else float("nan")
    return out


def _baseline(samples: list[EvalSample], labels: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Step-0 accuracy of always proposing the most frequent target token (over the scored positions)."""
    tops = []
    for s, (_, top) in zip(samples, labels, strict=True):
        valid = step_valid(s.loss_mask.to(top.device)[None], 1)[0][0]  # rows t: label at t+1
        tops.append(top[0, 1:][valid].cpu())
    allt = torch.cat(tops) if tops else torch.zeros(0, dtype=torch.long)
    if allt.numel() == 0:
        return 0.0
    return float(torch.bincount(allt).max()) / allt.numel()


# ---- 3. layout inference --------------------------------------------------------------------------

def layout_candidates(recorded: Sequence[int] | None, num_layers: int, num_aux: int,
                      configured: Mapping[str, Sequence[int] | None] | None = None) -> list[tuple[list[int], str]]:
    """Candidate layouts around each base (the recorded layout, every engine-configured one, the default):
    the base; every id shifted +1 / -1 together and one at a time; the embedding (0) in place of each id;
    permutations; plus the final state alone (indices []). Labels say how each relates to its base; a
    candidate reached from two bases carries both labels."""
    L = num_layers
    bases: list[tuple[str, list[int]]] = []
    if recorded is not None:
        bases.append(("recorded", list(recorded)))
    for name, ids in (configured or {}).items():
        if ids is not None:
            bases.append((name, list(ids)))
    dflt = default_aux_indices(L)
    if len(dflt) == num_aux:
        bases.append(("default", dflt))
    labels: dict[tuple[int, ...], list[str]] = {}

    def add(ids: list[int], label: str, allow_dup: bool = False) -> None:
        if len(ids) != num_aux or not all(0 <= k <= L for k in ids):
            return
        if not allow_dup and len(set(ids)) != len(ids):
            return
        labels.setdefault(tuple(ids), [])
        if label not in labels[tuple(ids)]:
            labels[tuple(ids)].append(label)

    for name, b in bases:
        add(b, f"{name} {b}", allow_dup=True)
    for name, b in bases:
        add([k + 1 for k in b], f"{name} shifted +1")
        add([k - 1 for k in b], f"{name} shifted -1")
        for i, k in enumerate(b):
            for d in (1, -1):
                add(b[:i] + [k + d] + b[i + 1:], f"{name} with {k}->{k + d}")
            if k != 0:
                add(b[:i] + [0] + b[i + 1:], f"{name} with the embedding (0) in place of {k}")
        perms = itertools.permutations(range(len(b))) if len(b) <= 4 else \
            [tuple(reversed(range(len(b))))] + [tuple(j + 1 if j == i else j - 1 if j == i + 1 else j
                                                      for j in range(len(b))) for i in range(len(b) - 1)]
        for p in perms:
            if list(p) != list(range(len(b))):
                add([b[j] for j in p], f"{name} permuted {list(p)}")
    out = [(list(k), " = ".join(v[:2])) for k, v in labels.items()]
    out.append(([], f"{FINAL_ONLY} (1xH post-norm, no fc: EAGLE instead of EAGLE3)"))
    return out


@torch.no_grad()
def _rank(draft: Eagle3Draft, target, samples: list[EvalSample], fresh: list[_Fresh],
          cands: list[tuple[list[int], str]], stage1_tokens: int = 512,
          keep: Sequence[Sequence[int]] = ()) -> LayoutRanking:
    """Step-0 held-out loss and accuracy of each candidate, ranked by loss (lowest first).

    Why loss and not accuracy: the draft was trained to minimise exactly this cross-entropy on its true
    layout, and it moves on every position, while top-1 accuracy moves only where the argmax flips. On the
    shipped SmolLM2 draft (32% step-0 accuracy) a +1 shift costs 0.07 nats at paired z ~ 12 over 2,900
    positions but only 1 point of accuracy (z ~ 2.5): accuracy alone cannot tell neighbouring layers apart.
    Two stages to stay fast on real targets: every candidate on the first ~stage1_tokens tokens, then the
    best 6 (plus `keep`) on all samples; the per-position losses of those are kept for paired tests."""
    labels = [f.labels for f in fresh]
    final_view = _final_only_view(draft)

    def run(idx: list[int], subset: list[int]) -> dict[str, Any] | None:
        if not idx:
            if final_view is None:
                return None
            # the post-norm final state, as an engine running EAGLE passes it (what the target's head sees)
            feats = [target.final_norm()(fresh[i].final.float()) for i in subset]
            model = final_view
        else:
            feats = [torch.cat([fresh[i].streams[k] for k in idx], dim=-1) for i in subset]
            model = draft
        return _score(model, target, feats, [fresh[i].final for i in subset], [samples[i] for i in subset], 1,
                      [labels[i] for i in subset], want_rows=True)

    def score(idx: list[int], label: str, r: dict[str, Any] | None) -> LayoutScore:
        if r is None:
            return LayoutScore(idx, label, float("nan"), float("nan"))
        return LayoutScore(idx, label, r["acc"][0], r["loss"])

    def key(s: LayoutScore) -> tuple[float, float]:
        return (math.inf if math.isnan(s.loss) else s.loss, -1.0 if math.isnan(s.accuracy) else -s.accuracy)

    everything = list(range(len(samples)))
    sub, tok = [], 0
    for i, s in enumerate(samples):
        sub.append(i)
        tok += s.input_ids.numel()
        if tok >= stage1_tokens:
            break
    scores: list[LayoutScore] = []
    rest: list[LayoutScore] = []  # ranked on the first stage only (fewer tokens), listed after
    rows: dict[tuple[int, ...], torch.Tensor] = {}
    n_tok = 0

    def full(idx: list[int], label: str) -> None:
        nonlocal n_tok
        r = run(idx, everything)
        if r is not None:
            rows[tuple(idx)] = r["rows"]
            n_tok = max(n_tok, r["count"][0])
        scores.append(score(idx, label, r))

    first_rows: dict[tuple[int, ...], torch.Tensor] = {}
    if len(sub) < len(everything) and len(cands) > 8:
        first = []
        for idx, lab in cands:
            r = run(idx, sub)
            if r is not None:
                first_rows[tuple(idx)] = r["rows"]
            first.append(score(idx, lab, r))
        first.sort(key=key)
        finalists = {tuple(x.indices) for x in first[:6]} | {tuple(k) for k in keep}
        for c in first:
            if tuple(c.indices) in finalists:
                full(c.indices, c.label)
            else:
                rest.append(c._replace(label=c.label + " (first-stage sample)"))
    else:
        for idx, lab in cands:
            full(idx, lab)
    scores.sort(key=key)
    return LayoutRanking(scores + rest, tokens=n_tok, baseline=_baseline(samples, labels), rows=rows,
                         first_rows=first_rows)


def infer_layout(target, draft_model: Eagle3Draft, samples: Sequence[Any] | Mapping[str, Sequence[int]] | None = None,
                 candidates: Mapping[str, Sequence[int]] | Sequence[Sequence[int]] | None = None, *,
                 recorded: Sequence[int] | None = None, num_samples: int = 6, max_len: int = 384,
                 source: str = "sharegpt") -> LayoutRanking:
    """Which target layers does this draft read? Rank candidate layouts by the draft's step-0 accuracy.

    target: an eyas Target; draft_model: an Eagle3Draft (its embeddings are set from the target if missing).
    samples: token-id tensors [S] or (input_ids, loss_mask) pairs; None -> `num_samples` conversations of
      `source` through the target's chat template. (A mapping here is taken as `candidates`.)
    candidates: {label: stream indices} or a list of stream-index lists to rank exactly those; None -> the
      generated set of `layout_candidates` around `recorded` (or the default layout): shifts by +-1,
      the embedding in place of each id, permutations and the final state alone.
    Returns a LayoutRanking: LayoutScore(indices, label, accuracy) best first; `.tokens` positions scored,
    `.baseline` the accuracy of always proposing the most frequent token. All stream indices are captured
    in one target forward per sample through the engine's forward.
    """
    if isinstance(samples, Mapping):
        samples, candidates = None, samples
    draft = _prepare(draft_model, target)
    L, nA = target.num_layers, draft.config.num_aux
    if samples is None:
        evs = conversation_samples(target.tokenizer, source, num_samples, max_len, None)
    else:
        evs = as_samples(samples)
    if candidates is None:
        cands = layout_candidates(recorded, L, nA)
    elif isinstance(candidates, Mapping):
        cands = [(list(v), k if str(list(v)) in k else f"{k} {list(v)}") for k, v in candidates.items()]
    else:
        cands = [(list(v), f"{list(v)}") for v in candidates]
    need = {k for idx, _ in cands for k in idx}
    serving = Serving(target)
    fresh = _fresh(serving, draft, target, evs, need)
    keep = [list(recorded)] if recorded is not None else []
    return _rank(draft, target, evs, fresh, cands, keep=keep)


# ---- 2. accuracy: training path vs serving path ---------------------------------------------------

def _pct(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"


def _check_accuracy(serve: dict[str, Any], train: dict[str, Any] | None, recorded_metric: list[float] | None,
                    recorded_rows: list[int] | None, serving_path: str, paired: bool,
                    caveat: str | None = None) -> Check:
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
                         f"the engine's forward (serving path) — {gaps[j]:+.1f} points on the same tokens",
                         numbers=nums, details=lines,
                         fix="the stored features are not what the target produces now: same target file, dtype and "
                             "capture path for datagen and serving (see target_identity, norms, data_layout); "
                             "re-capture and retrain if the target changed")
        return Check("accuracy", "pass", f"no skew: step-0 held-out accuracy {_pct(train['acc'][0])} (stored) vs "
                     f"{_pct(s_acc[0])} (fresh, serving path) on the same tokens; steps: "
                     + ", ".join(_pct(a) for a in s_acc), numbers=nums, details=lines)
    if recorded_metric:
        m0, v0, n0 = recorded_metric[0], s_acc[0], serve["count"][0]
        rows = (recorded_rows or [0])[0]
        se = 100 * math.sqrt(v0 * (1 - v0) / max(n0, 1) + (m0 * (1 - m0) / rows if rows else 0.0))
        gap = 100 * (m0 - v0)
        nums.update(gap_points=round(gap, 2), gap_se_points=round(se, 2))
        if abs(gap) > SKEW_POINTS and abs(gap) > 2 * se:
            return Check("accuracy", "warn",
                         f"possible training/serving skew: step-0 held-out accuracy {_pct(m0)} at training vs "
                         f"{_pct(v0)} now through the engine's forward ({gap:+.1f} points, SE {se:.1f}); other "
                         "samples than the training run's held-out set, so the data distribution may differ"
                         + (f" ({caveat})" if caveat else ""),
                         numbers=nums, details=lines,
                         fix="pass --data SHARDS (the training data) for a paired test on the same tokens")
        return Check("accuracy", "pass", f"step-0 held-out accuracy {_pct(v0)} through the engine's forward vs "
                     f"{_pct(m0)} at training ({gap:+.1f} points, SE {se:.1f})", numbers=nums, details=lines)
    return Check("accuracy", "skip",
                 f"serving-path held-out accuracy per step: {', '.join(_pct(a) for a in s_acc)} (no training-path "
                 "features or training-time metric to compare with)", numbers=nums, details=lines,
                 fix="pass --data SHARDS to compare with the stored features")


# ---- 3. the layout verdict ------------------------------------------------------------------------

def _check_layout(rank: LayoutRanking, recorded: list[int], L: int, configured: dict[str, list[int]]) -> Check:
    from ..layout import LayoutError, to_engine_ids

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
    """Which stream each stored slice of `sample` holds: relative error against every fresh stream 0..L."""
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
               quick: bool = False) -> DoctorReport:
    """All checks. data: shard folders (training path + paired serving path on the same held-out tokens;
    default: the training folders the draft manifest names, when they exist here); samples: token-id samples
    for the serving path (tests, tiny targets); else `num_samples` conversations of `source` (default: the
    training source, held-out rows only; else bundled ShareGPT). quick: identity and config checks only."""
    checks = check_identity(target, ckpt)
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
        evs = conversation_samples(target.tokenizer, src, num_samples, max_len, pct if same else None)
        meta["samples_from"] = f"{len(evs)} conversations of {src}" + (f" (held-out rows, {pct}%)" if same else "")
        if same and trained_on["regenerated"]:
            meta["caveat"] = ("the draft trained on replies regenerated by the target; these samples carry the "
                              "source's original replies, which a draft predicts less well")
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
    serving = Serving(target)
    meta["serving_path"] = serving.path
    need = {k for idx, _ in cands for k in idx} | set(recorded)
    fresh = _fresh(serving, draft, target, evs, need, all_streams_first=shard_set is not None)  # ONE per sample

    serve = _score(draft, target, [torch.cat([f.streams[k] for k in recorded], -1) for f in fresh],
                   [f.final for f in fresh], evs, K, [f.labels for f in fresh], want_logits=True)
    train = None
    if all(s.stored_aux is not None for s in evs):
        train = _score(draft, target, [s.stored_aux for s in evs], [s.stored_final for s in evs], evs, K)
    metric = (man.get("metrics") or {}).get("heldout_acc")
    rows = (man.get("metrics") or {}).get("heldout_rows")
    checks.append(_check_accuracy(serve, train, metric[:K] if metric else None, rows, serving.path,
                                  paired=train is not None, caveat=meta.get("caveat")))
    rank = _rank(draft, target, evs, fresh, cands, keep=[recorded, *configured.values()])
    checks.append(_check_layout(rank, recorded, L, configured))
    checks.append(_check_norms(ckpt.layout.norms, fresh, evs, recorded, L, _recorded_length(man, shard_set)))
    if shard_set is not None:
        checks.append(_check_data_layout(shard_set.layout, ckpt, evs[0], fresh[0].streams, L))
    checks.append(_check_head(draft, serve, rank))
    acc = {"steps": K, "serving": serve, "training": train, "training_time_metric": metric}
    return DoctorReport(_ordered(checks), layout=rank, accuracy=acc, meta=meta)


def _training_data(man: dict[str, Any]) -> dict[str, Any]:
    """What the draft manifest says it trained on: shard folders that exist here, the conversation source
    (its row ids are the shards' row ids, so the held-out split can be rebuilt), whether replies were
    regenerated."""
    d = man.get("data") if isinstance(man.get("data"), dict) else {}
    cfg = d.get("config") if isinstance(d.get("config"), dict) else {}
    folders = [f for f in d.get("folders") or [] if (Path(f) / "manifest.json").is_file()]
    src = d.get("source") if isinstance(d.get("source"), str) else cfg.get("source")
    return {"folders": folders if folders and len(folders) == len(d.get("folders") or []) else [],
            "source": src if isinstance(src, str) else None, "regenerated": bool(cfg.get("regenerate"))}


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
        at.add_row("serving (fresh, engine forward)", *[_pct(x) for x in a["serving"]["acc"]])
        if a.get("training_time_metric"):
            m = list(a["training_time_metric"])[:a["steps"]]
            m = m + [float("nan")] * (a["steps"] - len(m))
            at.add_row("training-time metric (manifest)", *[_pct(x) for x in m])
        con.print(at)
    render_fixes(report.checks, con)
    con.print("[green]all checks pass[/]" if report.ok else
              f"[red]{sum(c.status == 'fail' for c in report.checks)} failed[/], "
              f"[yellow]{sum(c.status == 'warn' for c in report.checks)} warned[/]")


# ---- 7. trace: one prompt through the real serving path ---------------------------------------------
#
# The engine runs with its normal settings (tree or chain, KV caches, compaction); the trace only observes:
# the engine's target forward and the draft's finish/logits are wrapped on the instances and fc gets a
# forward hook, all removed afterwards. Nothing is disabled and no engine code changes.

@dataclass
class TraceEvent:
    round: int  # 0 = prefill, then one per speculative round
    stage: str  # target | capture k | concatenation | fc | draft layer | draft logits | accepted
    shape: list[int] | None = None
    norm: float | None = None  # mean L2 norm per row (last dim)
    note: str = ""


@dataclass
class TraceReport:
    prompt_tokens: int
    aux_indices: list[int]
    engine_ids: dict[str, Any]
    method: str
    events: list[TraceEvent]
    accepted: list[list[int]]  # per round, the tokens it committed (bonus included)
    text: str

    @property
    def tau(self) -> float:
        """Mean tokens committed per round after prefill (bonus included)."""
        r = self.accepted[1:]
        return sum(len(a) for a in r) / len(r) if r else 0.0

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return jsonable({"prompt_tokens": self.prompt_tokens, "aux_indices": self.aux_indices,
                         "engine_ids": self.engine_ids, "method": self.method, "tau": self.tau, "text": self.text,
                         "accepted": self.accepted, "events": [asdict(e) for e in self.events]})


def _row_norm(x: torch.Tensor) -> float:
    return float(x.detach().float().norm(dim=-1).mean())


def _decode(tok, ids: list[int]) -> str:
    if tok is None:
        return str(ids)
    return repr(tok.decode(ids))


@torch.no_grad()
def trace(target, ckpt: DraftCheckpoint, prompt_ids: list[int], spec=None, max_new_tokens: int = 32,
          max_rounds: int = 4, top: int = 5) -> TraceReport:
    """Run one prompt through eyas.engine.Engine and record, per round, the shape and mean norm of every
    captured stream index, their concatenation, fc, the draft layer, the draft logits (top tokens) and
    the tokens accepted."""
    from ..engine import Engine, SamplingParams, SpecParams
    from ..layout import engine_ids_table

    eng = Engine(target, ckpt, spec or SpecParams())
    d, tm, tok = eng.draft, eng.model, target.tokenizer
    idx = list(ckpt.layout.aux_indices)
    H = target.hidden_size
    events: list[TraceEvent] = []
    rnd = [0]
    depth = [0]

    def ev(stage: str, x: torch.Tensor | None = None, note: str = "") -> None:
        events.append(TraceEvent(rnd[0], stage, list(x.shape) if x is not None else None,
                                 _row_norm(x) if x is not None else None, note))

    orig_forward = tm.forward

    def forward(ids, pos, cache, *a, **kw):
        start = cache.length
        out = orig_forward(ids, pos, cache, *a, **kw)
        what = "prefill" if start == 0 else ("verify tree" if kw.get("tree_mask") is not None else "verify")
        ev("target", None, f"{what}: {ids.shape[1]} tokens at positions {start}..{start + ids.shape[1] - 1}")
        cap = kw.get("capture")
        if cap and out.aux is not None:
            for j, k in enumerate(cap):
                ev(f"capture {k}", out.aux[..., j * H:(j + 1) * H],
                   "embedding" if k == 0 else f"output of layer {k - 1} (input of layer {k})")
            ev("concatenation", out.aux, f"cat{list(cap)}: the draft's fc input")
        return out

    def fc_hook(mod, args, out):
        depth[0] = 0
        ev("fc", out, f"fc {list(args[0].shape)} -> {list(out.shape)}; input norm {_row_norm(args[0]):.2f}")

    orig_finish, orig_logits = d.finish, d.logits

    def finish(attn_out, hidden):
        out = orig_finish(attn_out, hidden)
        ev("draft layer", out, "step 0 over the rows accepted last round" if depth[0] == 0 else
           f"the {out.shape[1]} frontier node(s) at depth {depth[0]}")
        return out

    def logits(out):
        lg = orig_logits(out)
        last = torch.softmax(lg[0, -1].float(), -1)
        p, i = last.topk(min(top, last.numel()))
        ids = d.draft_to_target(i).tolist()
        shown = ", ".join(f"{_decode(tok, [t])} {100 * float(q):.0f}%" for t, q in zip(ids, p, strict=True))
        ev("draft logits", lg, f"proposals for depth {depth[0] + 1}, top of the last row: {shown}")
        depth[0] += 1
        return lg

    handle = d.fc.register_forward_hook(fc_hook)
    tm.forward, d.finish, d.logits = forward, finish, logits
    accepted: list[list[int]] = []
    try:
        for new in eng.stream(list(prompt_ids), SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)):
            events.append(TraceEvent(rnd[0], "accepted", [len(new)], None, f"{len(new)} token(s): {_decode(tok, new)}"))
            accepted.append(list(new))
            rnd[0] += 1
            if rnd[0] > max_rounds:
                break
    finally:
        handle.remove()
        del tm.forward, d.finish, d.logits  # back to the class methods
    out_ids = [t for a in accepted for t in a]
    try:
        ids_table = engine_ids_table(idx, target.num_layers)
    except ValueError:
        ids_table = {}
    return TraceReport(len(prompt_ids), idx, ids_table, eng.spec.method, events, accepted,
                       tok.decode(out_ids) if tok is not None else str(out_ids))


def render_trace(rep: TraceReport, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    con = console or Console()
    con.print(f"stream indices {rep.aux_indices}; engine ids: "
              + "; ".join(f"{k} {v}" for k, v in rep.engine_ids.items() if k in ("sglang", "vllm")))
    t = Table(title=f"eyas doctor trace ({rep.method}, {rep.prompt_tokens} prompt tokens, engine defaults)")
    t.add_column("round", justify="right")
    t.add_column("stage")
    t.add_column("shape")
    t.add_column("mean |x|", justify="right")
    t.add_column("note", overflow="fold")
    for e in rep.events:
        t.add_row(str(e.round), e.stage, str(e.shape) if e.shape else "", f"{e.norm:.2f}" if e.norm is not None else "",
                  e.note)
    con.print(t)
    con.print(f"tokens per round after prefill (bonus included): {rep.tau:.2f}; text: {rep.text!r}")
