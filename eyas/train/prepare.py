"""What a training run is built from, derived the same way on every rank: the options' own checks, the data and
the target (`open_data`), the draft and its vocabulary (`build_draft`) and the optimizer."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..draft import DraftConfig, Eagle3Draft
from ..layout import Layout, check_layouts
from ..target.load import end_token_ids, load_target
from ..target.open import TargetChoice
from ..target.template import template_from_record
from ..vocab import DraftVocab, count_tokens, select_draft_vocab, stale_vocab_warning
from .checkpoint import warm_start
from .config import Dist, TrainConfig, TrainError
from .sources import Item, OnlineSource, ShardSource, feature_norm
from .step import init_draft


def check_options(cfg: TrainConfig) -> None:
    if cfg.ttt_steps < 1:
        raise TrainError(f"--ttt-steps must be >= 1, got {cfg.ttt_steps}")
    if cfg.max_time is not None and cfg.max_time <= 0:
        raise TrainError(f"--max-time must be a positive number of seconds, got {cfg.max_time}")
    if cfg.batch_tokens < cfg.max_len:
        raise TrainError(f"--batch-tokens {cfg.batch_tokens} < --max-len {cfg.max_len}: a full-length sample "
                         "would not fit one batch; raise --batch-tokens or lower --max-len")


# ---- data + target ---------------------------------------------------------------------------------

@dataclass
class Data:
    """The run's data: its source (shards, or features captured on the fly), the target the features come from,
    the chat template record the rows were rendered with, the held-out samples each evaluation reads (at most
    --eval-samples), and the data's hash (what a checkpoint is checked against)."""

    source: ShardSource | OnlineSource
    target: Any  # an eyas Target
    template: dict[str, Any] | None
    heldout: list[Item]
    hash: str

    @property
    def layout(self) -> Layout:
        return self.source.layout


def open_data(cfg: TrainConfig, target=None) -> Data:
    """The data source and the target (loaded unless given); refused when no training sample is left or the
    held-out split came out empty."""
    source, target, template = _online(cfg, target) if cfg.online else _shards(cfg, target)
    if not source.train:
        raise _no_samples(cfg, source)
    heldout = source.heldout[:cfg.eval_samples] if cfg.eval_samples > 0 else source.heldout
    if not heldout and cfg.heldout_pct > 0:
        raise TrainError(f"the {cfg.heldout_pct}% held-out split is empty: it holds out whole source rows and "
                         f"keeps one for training, and these {len(source.train)} samples come from one row; add data "
                         "(or pass --heldout-pct 0 to train without evaluation)")
    return Data(source, target, template, heldout, source.hash())


def _online(cfg: TrainConfig, target) -> tuple[OnlineSource, Any, dict[str, Any]]:
    spec = target.source if target is not None else _target_spec(cfg, None)
    opening = TargetChoice(spec, cfg.target_dtype, cfg.device, cfg.chat_template, cfg.raw)
    choice = opening.template(check_files=target is None)
    if len(cfg.data) != 1:
        raise TrainError(f"--online takes one conversation source in --data, got {cfg.data}")
    if cfg.data_tokens is not None:
        raise TrainError("--data-tokens caps captured shard folders; with --online use --num-samples")
    target = opening.open(target, choice)
    template = target.chat_template.record()
    source = OnlineSource(target, cfg.data[0], cfg.num_samples, cfg.max_len, cfg.heldout_pct, cfg.aux_indices,
                          raw=choice.raw)
    return source, target, template


def _shards(cfg: TrainConfig, target) -> tuple[ShardSource, Any, dict[str, Any] | None]:
    if cfg.chat_template is not None or cfg.raw:
        flag = "--raw" if cfg.raw else f"--chat-template {cfg.chat_template}"
        raise TrainError(f"{flag} applies to --online only: shards were rendered when they were captured and "
                         "record their template (`eyas datagen --chat-template NAME` or `--raw`)")
    source = ShardSource(cfg.data, cfg.heldout_pct, cfg.buffer_mb, cfg.max_len, cfg.data_tokens)
    if not source.train:  # before the target loads: nothing it could be used for
        raise _no_samples(cfg, source)
    template = source.set.chat_template  # one template across the folders (ShardSet checks)
    rebuilt = template_from_record(template)
    if rebuilt is not None and rebuilt.source in ("builtin", "file"):
        # the shards' template on the tokenizer, so end_token_ids finds its end-of-turn token (Gemma's
        # <end_of_turn>) and the draft vocabulary always holds it, as when training --online
        target = TargetChoice(_target_spec(cfg, source.describe()), device=cfg.device).open(target, rebuilt)
    elif target is None:
        target = load_target(_target_spec(cfg, source.describe()), device=cfg.device)
    check_layouts(source.layout, target.default_layout(source.layout.aux_indices), "the shards",
                  f"the target {target.source!r}")
    return source, target, template


def _target_spec(cfg: TrainConfig, source_desc: dict[str, Any] | None) -> str:
    """--target, else the target the shards were captured from."""
    spec = cfg.target or (source_desc or {}).get("target_source")
    if not spec:
        raise TrainError("the shards' manifest names no target_source; pass --target (the model the shards "
                         "were captured from)")
    return spec


def _no_samples(cfg: TrainConfig, source: ShardSource | OnlineSource) -> TrainError:
    """The no-training-samples error, naming why: the skip reasons datagen recorded in the shard manifests and
    this run's own (samples with no loss token within --max-len), or a held-out split that took every sample."""
    from ..data.datagen_config import skip_summary

    skipped = dict(source.skipped)
    if isinstance(source, ShardSource):
        for m in source.set.manifests:
            for k, v in (m.get("skipped") or {}).items():
                skipped[k] = skipped.get(k, 0) + int(v)
    where = f"no training samples in {', '.join(cfg.data)}"
    if isinstance(source, ShardSource) and cfg.data_tokens and any(cfg.data_tokens):
        capped = source.set.num_samples - sum(source.skipped.values()) - len(source.heldout)
        if capped > 0:  # training samples existed: the caps dropped every one
            return TrainError(f"{where}: --data-tokens {','.join(map(str, cfg.data_tokens))} keeps none of its "
                              f"{capped} training samples (a cap smaller than a sample drops it); raise the caps "
                              "(0 = all)")
    if source.heldout:
        return TrainError(f"{where}: all {len(source.heldout)} usable samples fall in the {cfg.heldout_pct}% "
                          "held-out split (split by source row id); add data or lower --heldout-pct")
    return TrainError(f"{where}: every source row was skipped ({skip_summary(skipped)})")


# ---- draft + optimizer -----------------------------------------------------------------------------

def build_draft(cfg: TrainConfig, data: Data, dd: Dist,
                device: torch.device) -> tuple[Eagle3Draft, DraftVocab, float | None]:
    """The draft on `device`, its vocabulary and the features' measured norm (fc_init 'scaled', else None).
    The vocabulary is chosen from this run's data (never cached), or is the warm-start draft's own."""
    source, target = data.source, data.target
    V = target.identity.vocab_size
    counts = count_tokens(source.token_pairs(source.train), V)
    emb = target.embed_tokens().weight.detach().to(device=device, dtype=torch.float32)
    fnorm = feature_norm(source, source.train, cfg.max_len) if cfg.fc_init == "scaled" else None
    if fnorm is not None and cfg.fc_norm:  # fc sees each aux state normalised to RMS 1: |f| = sqrt(n_aux * Ht)
        fnorm = math.sqrt(data.layout.num_aux * target.hidden_size)
    if cfg.refresh_vocab and not cfg.init_from:
        raise TrainError("--refresh-vocab re-chooses a warm-started draft's vocabulary: pass --init-from DRAFT too")
    ends = end_token_ids(target.tokenizer, target.model)  # always in the draft vocab
    fresh = select_draft_vocab(counts, min(cfg.draft_vocab, V), ends, data.hash)  # this data's own choice
    fresh.requested_size = cfg.draft_vocab
    if cfg.init_from:
        draft, vocab = warm_start(cfg, data.layout, counts, fresh if cfg.refresh_vocab else None)
        if draft.config.fc_norm != cfg.fc_norm:
            kind, flag = ("an EAGLE 3.1 (fc_norm)", "--fc-norm") if draft.config.fc_norm else ("a plain EAGLE-3",
                                                                                               "no --fc-norm")
            raise TrainError(f"--init-from {cfg.init_from} is {kind} draft; pass {flag} to continue it, or start "
                             "from scratch")
        stale = None if cfg.refresh_vocab else stale_vocab_warning(vocab, fresh,
                                                                   count_tokens(source.token_pairs(data.heldout), V))
        if stale and dd.main:
            print(stale, file=sys.stderr)
        draft = draft.to(device)
    else:
        vocab = fresh
        dcfg = DraftConfig.from_target_config(target.config, draft_vocab_size=vocab.size,
                                              num_aux=data.layout.num_aux, intermediate_size=cfg.intermediate_size,
                                              fc_norm=cfg.fc_norm)
        draft = init_draft(dcfg, vocab, emb, cfg.seed, cfg.fc_init, fnorm).to(device)
    draft.set_embeddings(emb)
    if dd.world > 1:  # identical start on every rank (same seed already; broadcast makes it certain)
        for p in draft.parameters():
            dist.broadcast(p.data, 0)
    return draft, vocab, fnorm


def make_optimizer(draft: Eagle3Draft, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not on norms or biases)."""
    decay = [p for n, p in draft.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in draft.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
