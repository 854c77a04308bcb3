"""eyas train: train an EAGLE-3 draft (eyas/train)."""

from __future__ import annotations

import typer

from .common import DeviceOpt, fail, user_errors


def train(
    data: list[str] = typer.Option(..., "--data", help="shard folder(s); with --online a conversation source"),
    out: str = typer.Option(..., "--out", help="output folder: OUT/draft, OUT/checkpoint, metrics, curves"),
    target: str = typer.Option(None, "--target", help="default: the shards' target_source (online: smollm2-135m)"),
    online: bool = typer.Option(False, "--online", help="capture features on the fly from conversations"),
    num_samples: int = typer.Option(None, "--num-samples", help="online: conversations to read"),
    data_tokens: str = typer.Option(None, "--data-tokens", help="per --data folder, at most N training tokens "
                                    "(a fixed random subset; 0 = all), e.g. 120000,65000: mixes data at a ratio"),
    aux_indices: str = typer.Option(None, "--aux-indices", help="online: stream indices, e.g. 2,15,27"),
    draft_vocab: int = typer.Option(8192, "--draft-vocab", help="draft vocabulary size (clamped to the target's)"),
    ttt_steps: int = typer.Option(7, "--ttt-steps"),
    epochs: float = typer.Option(1.0, "--epochs"),
    max_steps: int = typer.Option(None, "--max-steps", help="overrides --epochs"),
    lr: float = typer.Option(1e-4, "--lr"),
    warmup_ratio: float = typer.Option(0.05, "--warmup-ratio"),
    weight_decay: float = typer.Option(0.0, "--weight-decay"),
    grad_clip: float = typer.Option(0.5, "--grad-clip"),
    batch_tokens: int = typer.Option(4096, "--batch-tokens", help="padded tokens per global batch"),
    max_len: int = typer.Option(2048, "--max-len", help="samples are cut to this many tokens"),
    bf16: bool = typer.Option(False, "--bf16", help="bf16 autocast for the draft (CPU and CUDA)"),
    seed: int = typer.Option(0, "--seed"),
    eval_every: int = typer.Option(200, "--eval-every"),
    save_every: int = typer.Option(500, "--save-every"),
    heldout_pct: float = typer.Option(5.0, "--heldout-pct"),
    eval_samples: int = typer.Option(256, "--eval-samples", help="held-out samples per eval (0 = all)"),
    replay_k: int = typer.Option(3, "--replay-k", help="each eval replays a served chain of k (vLLM's "
                                 "num_speculative_tokens) on held-out replies and logs its τ (0 = off)"),
    replay_samples: int = typer.Option(16, "--replay-samples", help="held-out samples the replay uses"),
    intermediate_size: int = typer.Option(None, "--intermediate-size", help="draft MLP width (default: target's)"),
    fc_init: str = typer.Option("scaled", "--fc-init", help="scaled (by the layout's stream norms) | default"),
    init_from: str = typer.Option(None, "--init-from", help="warm start from an eyas draft (keeps its vocabulary): "
                                  "continue a shipped draft on more data"),
    refresh_vocab: bool = typer.Option(False, "--refresh-vocab", help="with --init-from: re-choose the draft "
                                       "vocabulary from this data (rows of kept tokens carried over)"),
    resume: bool = typer.Option(False, "--resume", help="continue from OUT/checkpoint"),
    device: str = DeviceOpt,
    dtype: str = typer.Option("fp32", "--dtype", help="online: target dtype for capture"),
    quiet: bool = typer.Option(False, "--quiet"),
    threads: int = typer.Option(0, "--threads", help="CPU threads (0 = torch default; 1 is faster on a busy CPU)"),
    chat_template: str = typer.Option(None, "--chat-template", help="--online: Jinja FILE or built-in NAME (chatml "
                                      "| gemma | llama3); shards record the template they were rendered with"),
    raw: bool = typer.Option(False, "--raw", help="--online: rows as plain text, no chat template (base models; "
                             "every token but a BOS is a loss token, like `datagen --raw --no-regenerate`)"),
) -> None:
    """Train an EAGLE-3 draft with training-time test on captured shards (or --online)."""
    from ..text import parse_int_list
    from ..train.config import TrainConfig
    from ..train.loop import train as run_train

    if online and target is None:
        target = "smollm2-135m"
    with user_errors():
        aux = parse_int_list(aux_indices, "--aux-indices")
        caps = parse_int_list(data_tokens, "--data-tokens")
    if aux is not None and not online:
        fail("--aux-indices applies to --online only: shards carry their own layout")
    cfg = TrainConfig(data=data, out=out, target=target, online=online, num_samples=num_samples, data_tokens=caps,
                      aux_indices=aux,
                      draft_vocab=draft_vocab, ttt_steps=ttt_steps, epochs=epochs, max_steps=max_steps, lr=lr,
                      warmup_ratio=warmup_ratio, weight_decay=weight_decay, grad_clip=grad_clip,
                      batch_tokens=batch_tokens, max_len=max_len, bf16=bf16, seed=seed, eval_every=eval_every,
                      save_every=save_every, heldout_pct=heldout_pct, eval_samples=eval_samples,
                      replay_k=replay_k, replay_samples=replay_samples,
                      intermediate_size=intermediate_size, fc_init=fc_init, init_from=init_from, resume=resume,
                      refresh_vocab=refresh_vocab, device=device,
                      target_dtype=dtype, quiet=quiet, threads=threads, chat_template=chat_template, raw=raw)
    with user_errors():
        run_train(cfg)

