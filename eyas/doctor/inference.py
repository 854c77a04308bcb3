"""Layout inference: which stream indices a draft was trained on, measured. The draft is scored (step-0 held-out
loss and accuracy through ttt_forward, the training objective) on features the target produces under each
candidate layout; every stream a sample needs is captured in one forward through eyas.model.TargetModel, the
forward the engine serves with. `eyas doctor` and `eyas import` both decide layouts with it."""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from ..draft import Eagle3Draft
from ..layout import default_aux_indices
from ..train.ttt import step_valid, target_labels, ttt_forward
from .report import DoctorError

# a candidate must beat the recorded layout's held-out loss by LOSS_Z paired standard errors AND by this share of
# the loss to be called its true layout. Measured: on the shipped SmolLM2 draft (loss 4.68) a +1 shift costs
# 0.069 nats (z 12 over 2,900 positions), moving the top id 27->26 0.040 (z 10), 15->16 0.006 (z 5), 2->3 0.001
# (z 1); on the tiny test pair (loss 3.75, flat targets) single-id moves cost 0.003..0.005 nats at z > 25.
LOSS_Z = 4.0
LOSS_MARGIN_REL = 0.001
FINAL_ONLY = "final state only"


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

    def simplest_among_ties(self, recorded: Sequence[int], bases: Sequence[Sequence[int]] = ()) -> LayoutRanking:
        """The ranking with one change: of the candidates whose loss is within noise of the lowest (not `worse`,
        all positions scored), the simplest explanation goes first: the recorded layout; else a whole layout
        (one of `bases`: engine-configured views, the default) or any of these with every index shifted by one
        (a convention off-by-one); else the lowest loss. Neighbouring layers can be near-interchangeable for a
        trained draft (the shipped SmolLM2 draft retrained on its own replies: streams 1 and 2 within 0.001
        nats, paired SE 0.002); noise must not pick a one-index variant that no real miswiring produces."""
        top = self[0] if self else None
        if top is None or math.isnan(top.loss):
            return self
        whole = [list(recorded), *(list(x) for x in bases)]
        simple = {tuple(x) for x in whole} | {tuple(k + d for k in x) for x in whole for d in (1, -1)}

        def tier(s: LayoutScore) -> int:
            return 0 if list(s.indices) == list(recorded) else 1 if tuple(s.indices) in simple else 2

        ties = [s for s in self if s.indices and tuple(s.indices) in self.rows and not math.isnan(s.loss)
                and not self.worse(s.indices, top.indices)[0]]
        pick = min(ties, key=tier, default=top)  # min keeps the first (lowest-loss) of a tier
        if pick is top or tier(pick) >= tier(top):
            return self
        return LayoutRanking([pick] + [s for s in self if s is not pick], self.tokens, self.baseline, self.rows,
                             self.first_rows)

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
        elif hasattr(s, "input_ids") and hasattr(s, "aux"):  # eyas.data.shards.Sample
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
                         scan: int = 4000, regen: tuple[Any, dict[str, Any] | None, int] | None = None
                         ) -> list[EvalSample]:
    """`num` conversations of a source, tokenized with the chat template and the assistant loss mask; when the
    draft trained on this source, only rows of its held-out split (the same `is_heldout` rule as training).
    regen (target, datagen config dict, n): the replies of n of them (spread evenly) regenerated by the target
    through eyas.data.regen with that config's generation settings, for a draft trained on its own replies."""
    from ..data.conversations import SELF_SOURCE, tokenize_conversation

    if tokenizer is None:
        raise DoctorError("the target has no tokenizer: pass token-id samples (samples=...) instead of a source")
    if source == SELF_SOURCE:  # rows the target writes: nothing to read, and every reply is its own
        if regen is None:
            raise DoctorError("source 'self' (user turns the target writes) is scored only for a draft trained on "
                              "it; pass --data-source sharegpt or a conversation file")
        convs = _self_prompted(regen[0], regen[1], num, max_len, heldout_pct)
        if not convs:
            raise DoctorError(f"no usable self-prompted rows: each of the target's {2 * num} own user turns was "
                              "empty, looping, repeated or unfinished; --data-source self needs a chat-tuned target")
    else:
        convs = _read(tokenizer, source, num, max_len, heldout_pct, scan)
        if regen is not None and regen[2] > 0:
            convs = _regenerated(convs, *regen, max_len)
    out = []
    for item in convs:
        ids, mask = tokenize_conversation(tokenizer, item.messages, max_len)
        if ids.numel() >= 8 and int(mask[2:].sum()) > 0:
            out.append(EvalSample(int(item.row_id), ids, mask))
    return out


def _read(tokenizer, source: str, num: int, max_len: int, heldout_pct: float | None, scan: int) -> list:
    """The first `num` usable conversations of a source (held-out rows only when heldout_pct is given), scanning at
    most `scan` rows once one is found."""
    from ..data.conversations import DataError, iter_source, tokenize_conversation
    from ..data.shards import is_heldout

    convs = []
    seen = 0
    for item in iter_source(source):
        seen += 1
        if seen > scan and convs:
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
        convs.append(item)
        if len(convs) >= num:
            break
    if not convs:
        raise DoctorError(f"no usable conversations in {source!r} (scanned {seen} rows"
                          + (f", held-out rows at {heldout_pct}%" if heldout_pct is not None else "") + ")")
    return convs


def _gen_config(config: dict[str, Any] | None, max_len: int):
    """The training data's generation settings (a datagen config dict) as a DatagenConfig that writes nothing."""
    from ..data.datagen import DatagenConfig

    keep = ("temperature", "top_p", "seed", "max_new_tokens", "repetition_limit", "regen_weights")  # regenerate's
    given = {k: v for k, v in (config or {}).items() if k in keep and v is not None}
    return DatagenConfig(out="", max_len=max_len, **given)


def _one_batch(lengths: list[int]) -> list[list[int]]:
    """The doctor regenerates a handful of rows: all of them in one HF generate batch (regenerate's `batches`)."""
    return [list(range(len(lengths)))] if lengths else []


def _self_prompted(target, config: dict[str, Any] | None, num: int, max_len: int, heldout_pct: float | None) -> list:
    """`num` rows like `datagen --data self` writes, from the held-out row ids: the target's own user turns and
    its replies, with the training data's settings."""
    from collections import Counter

    from ..data.conversations import self_rows
    from ..data.regen import regenerate, sample_user_turns
    from ..data.shards import is_heldout

    cfg = _gen_config(config, max_len)
    rows = itertools.islice((c for c in self_rows() if heldout_pct is None or is_heldout(c.row_id, heldout_pct)),
                            2 * num)  # some user turns are skipped (still open, looping)
    convs = sample_user_turns(target, list(rows), cfg, Counter(), Counter())[:num]
    return regenerate(target, convs, cfg, Counter(), _one_batch)


def _regenerated(convs: list, target, config: dict[str, Any] | None, n: int, max_len: int) -> list:
    """convs with the replies of n of them (spread evenly) replaced by the target's own, generated with the
    training data's settings (eyas.data.regen.regenerate: greedy or sampled, the same loop stop), replies
    capped by the samples' max_len: the doctor scores only that many tokens."""
    from collections import Counter

    from ..data.regen import regenerate

    cfg = _gen_config(config, max_len)  # generation settings only: nothing is written
    pick = sorted({round(i * len(convs) / min(n, len(convs))) for i in range(min(n, len(convs)))})
    new = regenerate(target, [convs[i] for i in pick], cfg, Counter(), _one_batch)
    out = list(convs)
    for i, c in zip(pick, new, strict=True):
        out[i] = c
    return out


class Serving:
    """The serving-path forward: eyas.model.TargetModel (what the engine runs) when the family has one,
    else the HF forward with hooks (the only path those families have)."""

    def __init__(self, target, weights: str = "auto"):
        from ..engine.weights import engine_model
        from ..target.family import engine_covers

        self.target = target
        self.L = target.num_layers
        # only the family decides the fallback: any other refusal (a --weights mode that cannot apply) is the
        # user's to see, not a silent switch to another forward
        if engine_covers(target.identity.model_type):
            self.fwd = engine_model(target, weights)
            mode = "native GGUF weights" if self.fwd.native is not None else "fp32 weights"
            self.path = f"eyas.model.TargetModel (the engine's forward, {mode})"
            self.short = "engine forward"
        else:
            self.fwd = None
            self.path = f"HF forward + hooks (no engine forward for the {target.identity.model_type} family)"
            self.short = "HF forward + hooks"

    @torch.no_grad()
    def streams(self, input_ids: torch.Tensor, indices: Sequence[int]) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """input_ids [S] -> ({k: [S, H]} for each wanted stream index, final pre-norm [S, H]); one forward."""
        want = sorted(set(int(k) for k in indices) - {self.L})
        ids = input_ids.reshape(1, -1).to(self.target.device)
        H = self.target.hidden_size
        if self.fwd is not None:
            cap = self.fwd.capture(ids, want)
        else:
            from ..target.capture import capture

            cap = capture(self.target.model, ids, want)
        parts = {k: cap.aux[0, :, i * H:(i + 1) * H] for i, k in enumerate(want)} if want else {}
        final = cap.final_prenorm[0]
        parts[self.L] = final
        return parts, final


@torch.no_grad()
def capture_path_streams(target, input_ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """input_ids [S] -> {k: [S, H]} for every stream 0..L through datagen's capture path (eyas.target.capture:
    the HF forward with hooks, in the target's dtype). The data-layout check compares stored slices in the
    numerics they were captured in: a serving path on other numerics (native 4-bit weights with 8-bit
    activations drift ~1-3% by the last layers) must not read as a wiring fault."""
    from ..target.capture import capture

    L, H = target.num_layers, target.hidden_size
    want = list(range(L))
    cap = capture(target.model, input_ids.reshape(1, -1).to(target.device), want)
    out = {k: cap.aux[0, :, i * H:(i + 1) * H] for i, k in enumerate(want)}
    out[L] = cap.final_prenorm[0]
    return out


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


def _fresh(serving: Serving, draft: Eagle3Draft, target, samples: list[EvalSample],
           indices: set[int]) -> list[_Fresh]:
    """One serving-path forward per sample capturing `indices`."""
    out = []
    ids_map = draft.target_token_ids()
    for s in samples:
        streams, final = serving.streams(s.input_ids, sorted(indices))
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
    """Per-step correct/count of ttt_forward over samples (right-padded batches), also per sample
    ("sample_correct"/"sample_count" [samples][steps], for a standard error over conversations); with
    want_logits also the step-0 entropy of the draft's and the target's distributions over the draft
    vocab, as a share of log Vd; with want_rows (needs labels) the step-0 cross-entropy of every scored
    position, in a fixed order ("rows" [tokens] fp32; "loss" their mean)."""
    rows: list[torch.Tensor] = []
    per_correct = torch.zeros(len(samples), steps, dtype=torch.long)
    per_count = torch.zeros_like(per_correct)
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
        per_correct[group] = o.row_correct.cpu()
        per_count[group] = o.row_count.cpu()
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
    correct, count = per_correct.sum(0), per_count.sum(0)  # [steps]
    acc = [(int(c) / int(n)) if n else float("nan") for c, n in zip(correct, count, strict=True)]
    out = {"correct": correct.tolist(), "count": count.tolist(), "acc": acc,
           "sample_correct": per_correct.tolist(), "sample_count": per_count.tolist()}
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
