"""`eyas train`: the EAGLE-3 training loop over captured shards (or features captured on the fly).

One step = one global batch of whole samples (right-padded, at most --batch-tokens padded tokens) ->
ttt_forward -> AdamW (warmup + cosine, grad clip). Data-parallel under torchrun: every rank plans the same
global batches and takes samples [rank::world]; each rank's loss is divided by the *global* valid-row count
per TTT step, so summing gradients over ranks reproduces the one-process gradient.

OUT/ holds: checkpoint/ (draft + optimizer/RNG/cursor state, replaced atomically as one folder; what
--resume reads), draft/ (the draft alone, for serving/export), train_log.jsonl (one line per step),
metrics.jsonl (one line per eval), curves.png, run.json.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from ..draft import MANIFEST as DRAFT_MANIFEST
from ..draft import DraftConfig, Eagle3Draft, save_draft
from ..files import atomic_write
from ..layout import check_layouts
from ..target.load import end_token_ids
from ..target.template import require_template, resolve_template, template_from_record, use_template
from ..vocab import DraftVocab, count_tokens, select_draft_vocab, stale_vocab_warning
from .checkpoint import (
    check_resume,
    checkpoint_dir,
    load_optimizer,
    save_checkpoint,
    set_rng,
    truncate_jsonl,
    warm_start,
)
from .config import OPT_FILE, RNG_FILE, Dist, TrainConfig, TrainError, init_dist
from .sources import Item, OnlineSource, ShardSource, feature_norm, plan_epoch
from .ttt import STEP_DECAY, TTTOutput, step_counts, target_labels, ttt_forward

KILL_ENV = "EYAS_TRAIN_KILL_AT_STEP"  # tests: SIGKILL this process right after the given step


# ---- model, schedule -------------------------------------------------------------------

def init_draft(cfg: DraftConfig, vocab: DraftVocab, embed_weight: torch.Tensor, seed: int, fc_init: str,
               feat_norm: float | None = None) -> Eagle3Draft:
    """Build the draft deterministically from `seed`.

    fc_init 'scaled': the aux features are huge (SmolLM2 stream norms ~80-1100, one channel ~355) while the
    token embedding is ~3, so a default-initialised fc gives a residual h far larger than the attention/MLP
    outputs and the layer barely changes it. With fc ~ N(0, 1/|f|^2), |f| the RMS norm of the concatenated
    features measured on the data, each fc output element starts with RMS ~1, the scale the layer's own
    outputs have."""
    torch.manual_seed(seed)
    draft = Eagle3Draft(cfg)
    draft.set_vocab_map(vocab.ids)
    draft.set_embeddings(embed_weight)
    if fc_init == "scaled":
        if not feat_norm or not math.isfinite(feat_norm):
            raise TrainError(f"fc_init 'scaled' needs the features' measured norm, got {feat_norm}")
        with torch.no_grad():
            draft.fc.weight.normal_(0.0, 1.0 / feat_norm)
    elif fc_init != "default":
        raise TrainError(f"--fc-init {fc_init!r}: expected 'scaled' or 'default'")
    return draft


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    """Linear warmup then cosine to min_lr_ratio * lr; `step` counts from 0."""
    warm = max(1, round(cfg.warmup_ratio * total)) if cfg.warmup_ratio > 0 else 0
    if step < warm:
        return cfg.lr * (step + 1) / warm
    prog = (step - warm) / max(1, total - warm)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(prog, 1.0))))


# ---- eval + rendering -----------------------------------------------------------------------------

@torch.no_grad()
def evaluate(draft: Eagle3Draft, source, items: list[Item], target, cfg: TrainConfig, dd: Dist,
             device: torch.device) -> dict[str, Any]:
    """Held-out loss and accuracy per TTT step (fp32: the numbers acceptance follows)."""
    steps = cfg.ttt_steps
    sums = torch.zeros(3 * steps, dtype=torch.float64, device=device)  # loss_sum, correct, count
    mine = items[dd.rank::dd.world]
    was = draft.training
    draft.eval()
    for batch_items in plan_epoch(mine, [(-1, 0)], 0, 0, cfg.batch_tokens, cfg.max_len, 1 << 62):
        b = source.batch([mine[i] for i in batch_items], device, cfg.max_len)
        o = ttt_forward(draft, b.aux, b.final, b.input_ids, b.loss_mask, target.final_norm(), target.lm_head(),
                        steps)
        sums += torch.cat([o.step_loss_sum, o.step_correct.float(), o.step_count.float()]).double()
    draft.train(was)
    dd.sum_(sums)
    loss_sum, correct, count = sums.view(3, steps).cpu()
    return {"heldout_loss": [round(float(x), 5) for x in loss_sum / count.clamp_min(1)],
            "heldout_acc": [round(float(x), 5) for x in correct / count.clamp_min(1)],
            "heldout_rows": [int(x) for x in count]}


def metrics_table(m: dict[str, Any], title: str):
    from rich.table import Table

    tab = Table(title=title)
    tab.add_column("TTT step", justify="right")
    tab.add_column("held-out loss", justify="right")
    tab.add_column("held-out acc", justify="right")
    tab.add_column("train acc", justify="right")
    tr = m.get("train_acc") or []
    for j, (lo, ac) in enumerate(zip(m["heldout_loss"], m["heldout_acc"], strict=True)):
        tab.add_row(str(j), f"{lo:.4f}", f"{ac:.4f}", f"{tr[j]:.4f}" if j < len(tr) else "-")
    return tab


def write_curves(metrics_path: Path, log_path: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evals = [json.loads(ln) for ln in metrics_path.read_text().splitlines() if ln.strip()] \
        if metrics_path.exists() else []
    log = [json.loads(ln) for ln in log_path.read_text().splitlines() if ln.strip()] if log_path.exists() else []
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    if log:
        a1.plot([r["step"] for r in log], [r["loss"] for r in log], lw=0.6, alpha=0.6, label="train loss")
    if evals:
        a1.plot([e["step"] for e in evals], [sum(STEP_DECAY ** j * x for j, x in enumerate(e["heldout_loss"]))
                                             for e in evals], "o-", label="held-out loss")
        for j in range(len(evals[0]["heldout_acc"])):
            a2.plot([e["step"] for e in evals], [e["heldout_acc"][j] for e in evals], "o-", ms=3, label=f"step {j}")
    a1.set_xlabel("optimizer step")
    a1.set_title("loss (sum over TTT steps of 0.8^j x soft CE)")
    a1.legend()
    a2.set_xlabel("optimizer step")
    a2.set_title("held-out accuracy per TTT step")
    a2.set_ylim(0, 1)
    a2.legend(fontsize=7)
    fig.tight_layout()
    atomic_write(png, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)


# ---- the run --------------------------------------------------------------------------------------

@dataclass
class StepStats:
    """One optimizer step, over all ranks: the global loss, per TTT step the soft-CE sum, the rows whose
    top-1 was right and the valid rows, and the real (unpadded) tokens."""

    loss: float
    ce_sum: torch.Tensor  # [steps] float64
    correct: torch.Tensor  # [steps] float64
    count: torch.Tensor  # [steps] float64
    tokens: int

    @classmethod
    def zeros(cls, steps: int) -> StepStats:
        z = torch.zeros(steps, dtype=torch.float64)
        return cls(0.0, z, z.clone(), z.clone(), 0)

    @property
    def acc0(self) -> float:
        return float(self.correct[0] / max(float(self.count[0]), 1.0))

    def all_reduce(self, dd: Dist, device: torch.device) -> StepStats:
        """Sum over ranks, packed into one tensor so that it costs one reduction."""
        steps = self.ce_sum.numel()
        head = torch.tensor([self.loss, float(self.tokens)], dtype=torch.float64)
        flat = dd.sum_(torch.cat([head, self.ce_sum, self.correct, self.count]).to(device)).cpu()
        (loss, tokens), ce, correct, count = flat[:2].tolist(), *flat[2:].split(steps)
        return StepStats(loss, ce, correct, count, int(tokens))


@dataclass
class Window:
    """Training statistics accumulated since the last evaluation (what its metrics line reports)."""

    correct: torch.Tensor  # [steps] float64
    count: torch.Tensor  # [steps] float64
    steps: int = 0
    loss_sum: float = 0.0
    tokens: int = 0
    seconds: float = 0.0

    @classmethod
    def empty(cls, ttt_steps: int) -> Window:
        return cls(torch.zeros(ttt_steps, dtype=torch.float64), torch.zeros(ttt_steps, dtype=torch.float64))

    def add(self, s: StepStats, seconds: float) -> None:
        self.correct += s.correct
        self.count += s.count
        self.steps += 1
        self.loss_sum += s.loss
        self.tokens += s.tokens
        self.seconds += seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    def metrics(self) -> dict[str, Any]:
        return {"train_loss": round(self.loss_sum / max(self.steps, 1), 5),
                "train_acc": [round(float(x), 5) for x in self.correct / self.count.clamp_min(1)]}


def train_step(draft: Eagle3Draft, opt: torch.optim.Optimizer, source, refs: list[Item], lr: float,
               cfg: TrainConfig, dd: Dist, device: torch.device, norm, head, autocast) -> StepStats:
    """One optimizer step on a global batch; this rank takes refs[rank::world]. Returns the step's
    statistics summed over ranks."""
    steps = cfg.ttt_steps
    params = list(draft.parameters())
    for g in opt.param_groups:
        g["lr"] = lr
    opt.zero_grad(set_to_none=False)
    stats = StepStats.zeros(steps)
    mine = refs[dd.rank::dd.world]
    if mine:
        b = source.batch(mine, device, cfg.max_len)
        denom = dd.sum_(step_counts(b.loss_mask, steps).to(device))  # global valid rows per TTT step
        # draft-vocab head rows only: the loss is unchanged; the training-batch accuracy counts the target's
        # top token within the draft vocab (held-out evaluation uses the full-vocab argmax)
        labels = target_labels(b.final, norm, head, draft.target_token_ids(), full_argmax=False)
        with autocast:
            o: TTTOutput = ttt_forward(draft, b.aux, b.final, b.input_ids, b.loss_mask, norm, head, steps,
                                       denom=denom, labels=labels)
        o.loss.backward()
        stats = StepStats(float(o.loss.detach()), o.step_loss_sum.double().cpu(), o.step_correct.double().cpu(),
                          o.step_count.double().cpu(), b.tokens)
    else:  # more ranks than samples in this batch: zero gradients, but join every reduction
        dd.sum_(torch.zeros(steps, dtype=torch.long, device=device))
    if dd.world > 1:  # sum (not average): each rank's loss is already divided by the global counts
        flat = dd.sum_(torch.cat([p.grad.reshape(-1) for p in params]))
        off = 0
        for p in params:
            p.grad.copy_(flat[off:off + p.numel()].view_as(p))
            off += p.numel()
        stats = stats.all_reduce(dd, device)
    torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    opt.step()
    return stats


@dataclass
class TrainResult:
    out: Path
    step: int
    losses: list[float] = field(default_factory=list)  # per step, this process's view (global loss)
    final_metrics: dict[str, Any] | None = None
    tokens_per_s: float = 0.0
    vocab: DraftVocab | None = None
    draft: Eagle3Draft | None = None


def _load_target(cfg: TrainConfig, source_desc: dict[str, Any] | None):
    from ..target.load import load_target

    spec = cfg.target or (source_desc or {}).get("target_source")
    if not spec:
        raise TrainError("the shards' manifest names no target_source; pass --target (the model the shards "
                         "were captured from)")
    return load_target(spec, dtype=cfg.target_dtype if cfg.online else "fp32", device=cfg.device)


def train(cfg: TrainConfig, target=None) -> TrainResult:
    """Run (or resume) a training job. `target`: an already loaded eyas Target (tests); else loaded from
    --target or the shards manifest."""
    prev = torch.get_num_threads()
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    try:
        return _train(cfg, target)
    finally:
        torch.set_num_threads(prev)


def _no_samples(cfg: TrainConfig, source: ShardSource | OnlineSource) -> TrainError:
    """The no-training-samples error, naming why: the skip reasons datagen recorded in the shard manifests and
    this run's own (samples with no loss token within --max-len), or a held-out split that took every sample."""
    from ..data.datagen import skip_summary

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


def _train(cfg: TrainConfig, target) -> TrainResult:
    dd, device = init_dist(cfg.device)
    if cfg.ttt_steps < 1:
        raise TrainError(f"--ttt-steps must be >= 1, got {cfg.ttt_steps}")
    if cfg.batch_tokens < cfg.max_len:
        raise TrainError(f"--batch-tokens {cfg.batch_tokens} < --max-len {cfg.max_len}: a full-length sample "
                         "would not fit one batch; raise --batch-tokens or lower --max-len")
    out = Path(cfg.out)
    t_setup = time.perf_counter()

    # data + target (each rank reads the same data and derives the same plan and vocab)
    if cfg.online:
        choice = resolve_template(cfg.chat_template, cfg.raw)
        if target is None:
            if cfg.target:
                require_template(cfg.target, choice)  # a base model without a template: before it loads
            target = _load_target(cfg, None)
        if len(cfg.data) != 1:
            raise TrainError(f"--online takes one conversation source in --data, got {cfg.data}")
        if cfg.data_tokens is not None:
            raise TrainError("--data-tokens caps captured shard folders; with --online use --num-samples")
        template_record = use_template(target, choice).record()
        source = OnlineSource(target, cfg.data[0], cfg.num_samples, cfg.max_len, cfg.heldout_pct, cfg.aux_indices,
                              raw=choice.raw)
    else:
        if cfg.chat_template is not None or cfg.raw:
            flag = "--raw" if cfg.raw else f"--chat-template {cfg.chat_template}"
            raise TrainError(f"{flag} applies to --online only: shards were rendered when they were captured and "
                             "record their template (`eyas datagen --chat-template NAME` or `--raw`)")
        source = ShardSource(cfg.data, cfg.heldout_pct, cfg.buffer_mb, cfg.max_len, cfg.data_tokens)
        if not source.train:  # before the target loads: nothing it could be used for
            raise _no_samples(cfg, source)
        template_record = source.set.chat_template  # one template across the folders (ShardSet checks)
        if target is None:
            target = _load_target(cfg, source.describe())
        rebuilt = template_from_record(template_record)
        if rebuilt is not None and rebuilt.source in ("builtin", "file"):
            # the shards' template on the tokenizer, so end_token_ids below finds its end-of-turn token (Gemma's
            # <end_of_turn>) and the draft vocabulary always holds it, as when training --online
            use_template(target, rebuilt)
        check_layouts(source.layout, target.default_layout(source.layout.aux_indices), "the shards",
                      f"the target {target.source!r}")
    layout = source.layout
    if not source.train:
        raise _no_samples(cfg, source)
    heldout = source.heldout[:cfg.eval_samples] if cfg.eval_samples > 0 else source.heldout
    if not heldout and cfg.heldout_pct > 0:
        raise TrainError(f"the {cfg.heldout_pct}% held-out split of {len(source.train)} samples is empty; raise "
                         "--heldout-pct or add data (or pass --heldout-pct 0 to train without evaluation)")
    data_hash = source.hash()

    # draft vocab from this run's data (never cached), or the warm-start draft's own
    V = target.identity.vocab_size
    counts = count_tokens(source.token_pairs(source.train), V)
    emb = target.embed_tokens().weight.detach().to(device=device, dtype=torch.float32)
    fnorm = feature_norm(source, source.train, cfg.max_len) if cfg.fc_init == "scaled" else None
    if cfg.refresh_vocab and not cfg.init_from:
        raise TrainError("--refresh-vocab re-chooses a warm-started draft's vocabulary: pass --init-from DRAFT too")
    ends = end_token_ids(target.tokenizer, target.model)  # always in the draft vocab
    fresh = select_draft_vocab(counts, min(cfg.draft_vocab, V), ends, data_hash)  # this data's own choice
    fresh.requested_size = cfg.draft_vocab
    if cfg.init_from:
        draft, vocab = warm_start(cfg, layout, counts, fresh if cfg.refresh_vocab else None)
        stale = None if cfg.refresh_vocab else stale_vocab_warning(vocab, fresh,
                                                                   count_tokens(source.token_pairs(heldout), V))
        if stale and dd.main:
            print(stale, file=sys.stderr)
        dcfg = draft.config
        draft = draft.to(device)
    else:
        vocab = fresh
        dcfg = DraftConfig.from_target_config(target.config, draft_vocab_size=vocab.size, num_aux=layout.num_aux,
                                              intermediate_size=cfg.intermediate_size)
        draft = init_draft(dcfg, vocab, emb, cfg.seed, cfg.fc_init, fnorm).to(device)
    draft.set_embeddings(emb)
    if dd.world > 1:  # identical start on every rank (same seed already; broadcast makes it certain)
        for p in draft.parameters():
            dist.broadcast(p.data, 0)
    decay = [p for n, p in draft.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in draft.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)

    groups = source.groups()
    buffer_bytes = cfg.buffer_mb << 20

    def plan(ep: int) -> list[list[int]]:
        return plan_epoch(source.train, groups, cfg.seed, ep, cfg.batch_tokens, cfg.max_len, buffer_bytes)

    steps_per_epoch = len(plan(0))
    total = cfg.max_steps if cfg.max_steps else max(1, math.ceil(cfg.epochs * steps_per_epoch))

    # resume
    step, epoch, bi, tokens_seen, train_time = 0, 0, 0, 0, 0.0
    resumed_metrics = None
    ck = checkpoint_dir(out)
    if ck is not None and not cfg.resume:
        raise TrainError(f"{out} already holds a training checkpoint ({ck}); pass --resume to continue it or "
                         "choose another --out")
    if cfg.resume and ck is not None:
        state = check_resume(ck, cfg, layout, vocab, data_hash)
        sd = load_file(str(ck / "model.safetensors"))
        draft.load_state_dict({k: v.to(device) for k, v in sd.items()})
        load_optimizer(opt, ck / OPT_FILE, state["optimizer"])
        set_rng(load_file(str(ck / RNG_FILE)))
        step, epoch, bi = state["step"], state["epoch"], state["batch_in_epoch"]
        tokens_seen, train_time = state["tokens_seen"], state["train_time_s"]
        resumed_metrics = json.loads((ck / DRAFT_MANIFEST).read_text()).get("metrics")
        if dd.main:
            truncate_jsonl(out / "train_log.jsonl", step)
            truncate_jsonl(out / "metrics.jsonl", step)
    else:
        if cfg.resume and dd.main and not cfg.quiet:
            print(f"--resume: no checkpoint in {out}; starting a new run")
        if dd.main:  # logs of a run killed before its first checkpoint belong to no checkpoint
            truncate_jsonl(out / "train_log.jsonl", 0)
            truncate_jsonl(out / "metrics.jsonl", 0)
    if dd.main:
        out.mkdir(parents=True, exist_ok=True)
        run = {"config": cfg.to_dict(), "command": sys.argv, "world_size": dd.world, "data": source.describe(),
               "draft_vocab": vocab.to_manifest(), "draft_config": dcfg.to_dict(), "total_steps": total,
               "steps_per_epoch": steps_per_epoch, "train_samples": len(source.train),
               "heldout_samples": len(heldout), "feature_norm": fnorm}
        (out / "run.json").write_text(json.dumps(run, indent=2, default=str))

    norm, head = target.final_norm(), target.lm_head()
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16)
    kill_at = int(os.environ.get(KILL_ENV, "0") or 0)
    steps = cfg.ttt_steps
    for p in draft.parameters():  # real zero grads from the start: a rank without samples still all-reduces
        p.grad = torch.zeros_like(p)
    losses: list[float] = []
    last_eval: dict[str, Any] | None = resumed_metrics
    win = Window.empty(steps)

    def manifest_extra(metrics: dict[str, Any] | None) -> dict[str, Any]:
        return {"target": {**target.identity.to_dict(), "source": target.source}, "chat_template": template_record,
                "draft_vocab": vocab.to_manifest(), "training": {**cfg.to_dict(), "feature_norm": fnorm},
                "data": {**source.describe(), "train_samples": len(source.train), "heldout_samples": len(heldout)},
                "metrics": metrics, "step": step, "total_steps": total, "tokens_seen": tokens_seen,
                "training_time_s": round(train_time, 2), "command": " ".join(sys.argv), "world_size": dd.world,
                "versions": {"torch": torch.__version__}}

    def save() -> None:
        if not dd.main:
            return
        extra = manifest_extra(last_eval)
        save_checkpoint(out, draft, layout, extra, opt,
                        {"step": step, "epoch": epoch, "batch_in_epoch": bi, "tokens_seen": tokens_seen,
                         "train_time_s": train_time, "config": cfg.to_dict(), "world_size": dd.world})
        save_draft(out / "draft", draft, layout, extra=extra)

    def run_eval() -> dict[str, Any] | None:
        nonlocal win
        if not heldout:
            return None
        m = evaluate(draft, source, heldout, target, cfg, dd, device)
        m = {"step": step, "epoch": epoch, "tokens_seen": tokens_seen, **win.metrics(),
             **m, "tokens_per_s": round(win.tokens_per_s, 1), "lr": lr_at(max(step - 1, 0), total, cfg),
             "elapsed_s": round(train_time, 2)}
        win = Window.empty(steps)
        if dd.main:
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(m) + "\n")
        return m

    progress = None
    if dd.main and not cfg.quiet:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        progress = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                            TextColumn("{task.fields[info]}"))
        progress.start()
        task = progress.add_task("train", total=total, completed=step, info="")
        progress.console.print(
            f"[bold]eyas train[/]: {len(source.train)} train / {len(heldout)} held-out samples, "
            f"{steps_per_epoch} steps/epoch, {total} steps, draft vocab {vocab.size} (coverage "
            f"{vocab.coverage:.3f}), TTT {steps}, world {dd.world}, setup {time.perf_counter() - t_setup:.1f}s"
            + (f", skipped {source.skipped}" if source.skipped else ""))
    if step == 0 and cfg.init_from:  # where the warm-started draft stands on this held-out set before training
        m0 = run_eval()
        if m0 is not None and progress is not None:
            progress.console.print(metrics_table(m0, f"step 0 (--init-from {cfg.init_from})"))
    draft.train()
    cur_plan = plan(epoch)
    try:
        while step < total:
            if bi >= len(cur_plan):
                epoch, bi = epoch + 1, 0
                cur_plan = plan(epoch)
                continue
            t0 = time.perf_counter()
            refs = [source.train[i] for i in cur_plan[bi]]
            bi += 1
            lr = lr_at(step, total, cfg)
            stats = train_step(draft, opt, source, refs, lr, cfg, dd, device, norm, head, autocast)
            step += 1
            dt = time.perf_counter() - t0
            train_time += dt
            tokens_seen += stats.tokens
            loss = stats.loss
            losses.append(loss)
            win.add(stats, dt)
            if dd.main:
                acc0 = stats.acc0
                with open(out / "train_log.jsonl", "a") as f:
                    f.write(json.dumps({"step": step, "loss": loss, "acc0": round(acc0, 5), "lr": lr,
                                        "tokens": stats.tokens}) + "\n")
                if progress is not None:
                    progress.update(task, completed=step,
                                    info=f"loss {loss:.3f}  acc0 {acc0:.3f}  {win.tokens_per_s:.0f} tok/s")
            if (cfg.eval_every and step % cfg.eval_every == 0) or step == total:
                m = run_eval()
                if m is not None:
                    last_eval = m
                    if progress is not None:
                        progress.console.print(metrics_table(m, f"step {step}/{total}  epoch {epoch}  "
                                                                f"train loss {m['train_loss']:.4f}  "
                                                                f"{m['tokens_per_s']:.0f} tok/s"))
            if (cfg.save_every and step % cfg.save_every == 0) or step == total:
                save()
            if kill_at and step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
    finally:
        if progress is not None:
            progress.stop()
    if dd.main:
        write_curves(out / "metrics.jsonl", out / "train_log.jsonl", out / "curves.png")
        if not cfg.quiet:
            from rich.console import Console

            con = Console()
            tps = tokens_seen / max(train_time, 1e-9)
            con.print(f"[bold green]done[/]: {step} steps, {tokens_seen} tokens in {train_time:.1f}s of training "
                      f"({tps:.0f} tok/s), draft -> {out / 'draft'}, curves -> {out / 'curves.png'}")
            if last_eval:
                con.print(metrics_table(last_eval, "final held-out metrics"))
    return TrainResult(out=out, step=step, losses=losses, final_metrics=last_eval,
                       tokens_per_s=tokens_seen / max(train_time, 1e-9), vocab=vocab, draft=draft)
