"""`eyas train`: the EAGLE-3 training loop over captured shards (or features captured on the fly).

One step = one global batch of whole samples (right-padded, at most --batch-tokens padded tokens) ->
ttt_forward -> AdamW (warmup + cosine, grad clip); data-parallel under torchrun (step.py: how the ranks' gradients
add up to the one-process gradient).

OUT/ holds: checkpoint/ (draft + optimizer/RNG/cursor state, replaced atomically as one folder; what
--resume reads), draft/ (the draft alone, for serving/export), train_log.jsonl (one line per step),
metrics.jsonl (one line per eval), curves.png, run.json.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from ..draft import Eagle3Draft, save_draft
from ..files import portable_command, remove_stale_temps
from ..heartbeat import during
from ..interrupt import Interrupted, stop_on_signals
from ..replay.heldout import heldout_replay, simulated_length
from ..vocab import DraftVocab
from .checkpoint import (
    check_resume,
    checkpoint_dir,
    count_lines,
    load_optimizer,
    read_tensors,
    save_checkpoint,
    set_rng,
    truncate_jsonl,
)
from .config import OPT_FILE, RNG_FILE, TrainConfig, TrainError, init_dist
from .prepare import build_draft, check_options, make_optimizer, open_data
from .progress import Report, print_done, write_curves
from .sources import Item, plan_epoch
from .step import StepStats, Window, lr_at, schedule_step, train_step
from .step import evaluate as heldout_metrics

OnStep = Callable[[int], None]


@dataclass
class TrainResult:
    out: Path
    step: int
    losses: list[float] = field(default_factory=list)  # per step, this process's view (global loss)
    final_metrics: dict[str, Any] | None = None
    tokens_per_s: float = 0.0
    vocab: DraftVocab | None = None
    draft: Eagle3Draft | None = None


def train(cfg: TrainConfig, target=None, on_step: OnStep | None = None) -> TrainResult:
    """Run (or resume) a training job. `target`: an already loaded eyas Target (tests); else loaded from
    --target or the shards manifest. `on_step(step)`: called after each optimizer step once its log line,
    evaluation and checkpoint are written (the resume test kills the process there)."""
    prev = torch.get_num_threads()
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    try:
        return Trainer(cfg, target, on_step).run()
    finally:
        torch.set_num_threads(prev)


@dataclass
class Cursor:
    """Where the run stands: what trainer_state.json records besides the config, and what --resume restores."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    tokens_seen: int = 0
    train_time_s: float = 0.0


class Trainer:
    """One training run. The constructor builds it the same way on every rank (data, target, draft, optimizer,
    then `resume` from OUT/checkpoint); `run` trains to the last step: per global batch `step`, a log line, and
    when due `evaluate` and `save`."""

    def __init__(self, cfg: TrainConfig, target=None, on_step: OnStep | None = None) -> None:
        self.cfg, self.on_step, self.out = cfg, on_step, Path(cfg.out)
        self.dd, self.device = init_dist(cfg.device)
        check_options(cfg)
        self.t_start = time.perf_counter()
        with during("reading the training data (shard digests, the draft vocab's token counts)"):
            self.data = open_data(cfg, target)
            self.draft, self.vocab, self.fnorm = build_draft(cfg, self.data, self.dd, self.device)
        self.opt = make_optimizer(self.draft, cfg)
        self.groups = self.data.source.groups()
        self.steps_per_epoch = len(self.plan(0))
        self.total = cfg.max_steps if cfg.max_steps else max(1, math.ceil(cfg.epochs * self.steps_per_epoch))
        self.at = Cursor()
        self.last_eval: dict[str, Any] | None = None  # the metrics the next checkpoint's manifest records
        self.resume()
        self.out_of_time()  # a resumed run whose --max-time is spent trains no further
        self.lr = lr_at(0, self.total, cfg)  # the rate of the last step taken (what an evaluation logs)
        self.write_run()
        self.norm, self.head = self.data.target.final_norm(), self.data.target.lm_head()
        self.autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=cfg.bf16)
        for p in self.draft.parameters():  # real zero grads from the start: a rank without samples still all-reduces
            p.grad = torch.zeros_like(p)
        self.losses: list[float] = []
        self.win = Window.empty(cfg.ttt_steps)

    def plan(self, epoch: int) -> list[list[int]]:
        c = self.cfg
        return plan_epoch(self.data.source.train, self.groups, c.seed, epoch, c.batch_tokens, c.max_len,
                          c.buffer_mb << 20)

    def resume(self) -> None:
        """With --resume and OUT/checkpoint: the draft, optimizer, RNG and cursor it holds (refused when it was made
        for other data or options), and the log lines past it dropped. A new run drops the log lines of a run
        killed before its first checkpoint; an existing checkpoint without --resume is refused."""
        cfg, out, main = self.cfg, self.out, self.dd.main
        if main:
            remove_stale_temps(out, inside=True)  # a checkpoint, draft or log a killed run was writing
        ck = checkpoint_dir(out)
        if ck is not None and not cfg.resume:
            raise TrainError(f"{out} already holds a training checkpoint ({ck}); pass --resume to continue it or "
                             "choose another --out")
        if ck is None:
            logged = count_lines(out / "train_log.jsonl")
            if main and (cfg.resume or logged):
                print(f"{'--resume: ' if cfg.resume else ''}no checkpoint in {out}; starting a new run"
                      + (f" (the {logged} logged steps of a run stopped before its first checkpoint are dropped)"
                         if logged else ""), file=sys.stderr)
        else:
            state, manifest = check_resume(ck, cfg, self.data.layout, self.vocab, self.data.hash)
            sd = read_tensors(ck / "model.safetensors")
            self.draft.load_state_dict({k: v.to(self.device) for k, v in sd.items()})
            load_optimizer(self.opt, ck / OPT_FILE, state["optimizer"])
            set_rng(read_tensors(ck / RNG_FILE))
            self.at = Cursor(**{f.name: state[f.name] for f in fields(Cursor)})
            self.check_cursor(ck, manifest["step"])
            self.last_eval = manifest.get("metrics")
            if main:
                print(f"--resume: continuing {ck} at step {self.at.step}/{self.total} (epoch {self.at.epoch}, batch "
                      f"{self.at.batch_in_epoch}, {self.at.tokens_seen} tokens seen)", file=sys.stderr)
        if main:
            truncate_jsonl(out / "train_log.jsonl", self.at.step)
            truncate_jsonl(out / "metrics.jsonl", self.at.step)

    def check_cursor(self, ck: Path, manifest_step: Any) -> None:
        """The checkpoint's cursor against this run: a step past the run's last, a batch past its epoch's or
        more epochs than steps would resume into a run that trains nothing (or skips data) and says it finished;
        a cursor the checkpoint's own manifest disagrees with was edited or mixed from two checkpoints."""
        at, problems = self.at, []
        if at.step > self.total:
            problems.append(f"step {at.step} is past this run's {self.total} steps (raise --max-steps or --epochs "
                            "to train further)")
        if at.batch_in_epoch > len(self.plan(at.epoch)):
            problems.append(f"batch_in_epoch {at.batch_in_epoch} is past epoch {at.epoch}'s "
                            f"{len(self.plan(at.epoch))} batches")
        if at.epoch > at.step:
            problems.append(f"epoch {at.epoch} with only {at.step} steps taken")
        if manifest_step != at.step:
            problems.append(f"its manifest says step {manifest_step!r}, its trainer_state.json step {at.step}")
        if problems:
            raise TrainError(f"{ck / 'trainer_state.json'} does not fit this run: {'; '.join(problems)}. Resume "
                             "with the options it was made with, or start a new run in another --out")

    def write_run(self) -> None:
        if not self.dd.main:
            return
        d, cfg = self.data, self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        run = {"config": cfg.to_dict(), "command": sys.argv, "world_size": self.dd.world, "data": d.source.describe(),
               "draft_vocab": self.vocab.to_manifest(), "draft_config": self.draft.config.to_dict(),
               "total_steps": self.total, "steps_per_epoch": self.steps_per_epoch,
               "train_samples": len(d.source.train), "heldout_samples": len(d.heldout), "feature_norm": self.fnorm}
        (self.out / "run.json").write_text(json.dumps(run, indent=2, default=str))

    # ---- the loop -------------------------------------------------------------------------------------

    def run(self) -> TrainResult:
        cfg = self.cfg
        report = Report(self.dd.main and not cfg.quiet, self.total, self.at.step)
        say = (lambda m: print(m, file=sys.stderr, flush=True)) if self.dd.main else None
        try:
            with stop_on_signals("eyas train", say) as stop:
                report.print(self.header())
                if self.at.step == 0 and cfg.init_from:  # where the warm-started draft stands before training
                    report.table(self.evaluate(), f"step 0 (--init-from {cfg.init_from})")
                self.draft.train()
                for refs in self.batches():
                    self.lr = lr = lr_at(schedule_step(self.at.step, self.total, self.at.train_time_s,
                                                       cfg.max_time), self.total, cfg)
                    stats = self.step(refs, lr)
                    self.out_of_time()
                    self.log(stats, lr, report)
                    if self.due(cfg.eval_every) and (m := self.evaluate()) is not None:
                        self.last_eval = m
                        if self.at.step < self.total:  # the last step's metrics print once, as the final table
                            report.table(m, f"step {self.at.step}/{self.total}  epoch {self.at.epoch}  train "
                                            f"loss {m['train_loss']:.4f} (mean of the last "
                                            f"{m.get('train_loss_steps', 1)} steps)  {m['tokens_per_s']:.0f} tok/s")
                    saved = self.due(cfg.save_every)
                    if saved:
                        self.save()
                    if self.on_step is not None:
                        self.on_step(self.at.step)
                    if stop.requested:
                        self.stopped(saved, stop.signal_name)
        finally:
            report.stop()
        return self.finish()

    def stopped(self, saved: bool, signal_name: str) -> None:
        """A signal asked the run to stop: the step just finished is checkpointed (unless it was) and the run ends
        with one line saying where it stands and the command that resumes it."""
        if not saved:
            self.save()
        resume = portable_command() + ("" if self.cfg.resume else " --resume")
        raise Interrupted(f"eyas train: stopped by {signal_name} at step {self.at.step}/{self.total}; checkpoint "
                          f"saved in {self.out / 'checkpoint'} (the draft so far in {self.out / 'draft'}). Resume "
                          f"with: {resume}")

    def batches(self) -> Iterator[list[Item]]:
        """The global batches left to train on, epoch after epoch, moving the cursor past each one handed out."""
        at, train = self.at, self.data.source.train
        plan = self.plan(at.epoch)
        while at.step < self.total:
            if at.batch_in_epoch >= len(plan):
                at.epoch, at.batch_in_epoch = at.epoch + 1, 0
                plan = self.plan(at.epoch)
                continue
            at.batch_in_epoch += 1
            yield [train[i] for i in plan[at.batch_in_epoch - 1]]

    def out_of_time(self) -> None:
        """With --max-time spent, the step just taken becomes the run's last: evaluated, saved, and the loop ends."""
        if self.cfg.max_time and self.at.train_time_s >= self.cfg.max_time and self.at.step < self.total:
            self.total = self.at.step

    def due(self, every: int) -> bool:
        return bool(every and self.at.step % every == 0) or self.at.step == self.total

    def step(self, refs: list[Item], lr: float) -> StepStats:
        """One optimizer step on a global batch (this rank takes its share); the cursor and the statistics since
        the last evaluation move on."""
        t0 = time.perf_counter()
        stats = train_step(self.draft, self.opt, self.data.source, refs, lr, self.cfg, self.dd, self.device,
                           self.norm, self.head, self.autocast)
        dt = time.perf_counter() - t0
        if self.cfg.max_time and self.dd.world > 1:  # every rank must anneal by, and stop at, the same time
            dt = float(self.dd.sum_(torch.tensor([dt], device=self.device))) / self.dd.world
        self.at.step += 1
        self.at.train_time_s += dt
        self.at.tokens_seen += stats.tokens
        self.losses.append(stats.loss)
        self.win.add(stats, dt)
        return stats

    def log(self, stats: StepStats, lr: float, report: Report) -> None:
        if not self.dd.main:
            return
        acc0 = stats.acc0
        with open(self.out / "train_log.jsonl", "a") as f:
            f.write(json.dumps({"step": self.at.step, "loss": stats.loss, "acc0": round(acc0, 5), "lr": lr,
                                "tokens": stats.tokens}) + "\n")
        report.advance(self.at.step, f"step loss {stats.loss:.3f}  acc0 {acc0:.3f}  {self.win.tokens_per_s:.0f} tok/s")

    def evaluate(self) -> dict[str, Any] | None:
        """Held-out metrics now, with the training statistics since the last evaluation, appended to
        metrics.jsonl; None when the run has no held-out split."""
        d, at = self.data, self.at
        if not d.heldout:
            return None
        m = heldout_metrics(self.draft, d.source, d.heldout, d.target, self.cfg, self.dd, self.device)
        if self.cfg.replay_k and self.dd.main:
            # beside accuracy, the τ a served chain would reach, and the frameworks' offline estimate of it
            m["simulated_tau"] = round(simulated_length(m["heldout_acc"], self.cfg.replay_k), 4)
            m.update(heldout_replay(self.draft, d.layout, d.source, d.heldout, d.target, self.cfg.replay_k,
                                    self.cfg.replay_samples))
        m = {"step": at.step, "epoch": at.epoch, "tokens_seen": at.tokens_seen, **self.win.metrics(), **m,
             "tokens_per_s": round(self.win.tokens_per_s, 1), "lr": self.lr,
             "elapsed_s": round(at.train_time_s, 2)}
        self.win = Window.empty(self.cfg.ttt_steps)
        if self.dd.main:
            with open(self.out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(m) + "\n")
        return m

    def save(self) -> None:
        """OUT/checkpoint (what --resume reads) and OUT/draft (what serving reads); the main rank writes."""
        if not self.dd.main:
            return
        extra = self.manifest()
        state = {**asdict(self.at), "config": self.cfg.to_dict(), "world_size": self.dd.world}
        save_checkpoint(self.out, self.draft, self.data.layout, extra, self.opt, state)
        save_draft(self.out / "draft", self.draft, self.data.layout, extra=extra)

    def manifest(self) -> dict[str, Any]:
        """What the draft's manifest records about this run, beyond the weights and the layout."""
        d, at, cfg = self.data, self.at, self.cfg
        return {"target": {**d.target.identity.to_dict(), "source": d.target.source}, "chat_template": d.template,
                "draft_vocab": self.vocab.to_manifest(), "training": {**cfg.to_dict(), "feature_norm": self.fnorm},
                "data": {**d.source.describe(), "train_samples": len(d.source.train),
                         "heldout_samples": len(d.heldout)},
                "metrics": self.last_eval, "step": at.step, "total_steps": self.total, "tokens_seen": at.tokens_seen,
                "training_time_s": round(at.train_time_s, 2), "command": portable_command(),
                "world_size": self.dd.world, "versions": {"eyas": __version__, "torch": torch.__version__}}

    def header(self) -> str:
        d, v = self.data, self.vocab
        return (f"[bold]eyas train[/]: {len(d.source.train)} train / {len(d.heldout)} held-out samples, "
                f"{self.steps_per_epoch} steps/epoch, {self.total} steps, draft vocab {v.size} (coverage "
                f"{v.coverage:.3f}), TTT {self.cfg.ttt_steps}, world {self.dd.world}, setup "
                f"{time.perf_counter() - self.t_start:.1f}s" + (f", skipped {d.source.skipped}" if d.source.skipped
                                                                else ""))

    def finish(self) -> TrainResult:
        at = self.at
        if self.dd.main:
            write_curves(self.out / "metrics.jsonl", self.out / "train_log.jsonl", self.out / "curves.png")
            if not self.cfg.quiet:
                print_done(at.step, at.tokens_seen, at.train_time_s, self.out, self.last_eval)
        return TrainResult(out=self.out, step=at.step, losses=self.losses, final_metrics=self.last_eval,
                           tokens_per_s=at.tokens_seen / max(at.train_time_s, 1e-9), vocab=self.vocab,
                           draft=self.draft)
