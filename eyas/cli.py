"""The one `eyas` command; each subcommand maps to a module."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer

from .engine.params import LOOKUP_ALONE, default_help
from .errors import EyasError
from .files import write_fault

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="eyas: EAGLE-3 drafts with the hidden-state wiring checked end to end.")

TargetOpt = typer.Option("smollm2-135m", "--target", help="smollm2-135m, a HF model folder, or a .gguf file")
DtypeOpt = typer.Option("fp32", "--dtype", help="fp32 | bf16 | fp16")
DeviceOpt = typer.Option("cpu", "--device", help="cpu | cuda | cuda:N")
DraftWeightsOpt = typer.Option("auto", "--draft-weights", help="draft matrices: q8 (8-bit blocks, CPU) | fp32 | "
                               "auto (q8 with native target weights)")
WeightsOpt = typer.Option("auto", "--weights", help="target forward: native (a GGUF's own quantized weights, "
                          "8-bit activations, CPU) | native-bf16 (the same weights, bf16 activations) | "
                          "fp32 (the dequantized copy in --dtype) | auto (native where possible)")
ChatTemplateOpt = typer.Option(None, "--chat-template", help="render chats with this template: a Jinja FILE or a "
                               "built-in NAME (chatml | gemma | llama3); default: the tokenizer's own")
# generate, serve and bench: unset tree settings come from eyas.engine.params.TREE_DEFAULTS for the device
TreeDepthOpt = typer.Option(None, "--depth", help=f"tree: draft depth ({default_help('depth')})")
TreeTopkOpt = typer.Option(None, "--topk", help="tree: children per expanded node and frontier width "
                           f"({default_help('topk')})")
TreeTokensOpt = typer.Option(None, "--tokens", help="tree: tokens verified per round, root included "
                             f"({default_help('tokens')})")
TreeLookupOpt = typer.Option(None, "--lookup", help="lookup candidates merged into the tree per round (0 = off; "
                             f"{default_help('lookup')}; method lookup: the chain's length, default {LOOKUP_ALONE})")
MethodHelp = ("tree | chain (EAGLE-3) | lookup (no draft: verify what followed the context's last n-gram "
              "before; --lookup tokens) | plain (default tree; plain with --draft none)")
NgramOpt = typer.Option("auto", "--ngram", help="n-gram table (eyas ngram) proposing where context lookup finds "
                        "nothing, with method lookup or --lookup > 0: auto (the bundled one when counted for this "
                        "target) | default | none | PATH")
TreeMinProbOpt = typer.Option(None, "--min-prob", help="tree: verify only candidates whose cumulative draft "
                              f"probability reaches this ({default_help('min_prob')})")


@app.callback()
def _root() -> None:
    """eyas: EAGLE-3 drafts with the hidden-state wiring checked end to end."""


def fail(msg: str, code: int = 2) -> None:
    typer.secho(f"error: {msg}", fg="red", err=True)
    raise typer.Exit(code)


def warn(msg: str) -> None:
    typer.secho(f"warning: {msg}", fg="yellow", err=True)


@contextmanager
def user_errors() -> Iterator[None]:
    """An EyasError (bad input the user can fix) becomes one line and exit 2, and so does a disk fault (full,
    read-only, permission denied: eyas.files.write_fault names the file); anything else is a bug in eyas and keeps
    its traceback."""
    try:
        yield
    except EyasError as e:
        fail(str(e))
    except OSError as e:
        fault = write_fault(e)
        if fault is None:
            raise
        fail(str(fault))


@app.command()
def inspect(
    what: str = typer.Argument(None, help="a target (name, HF folder, .gguf), a shard folder or a draft "
                               "[default: smollm2-135m]"),
    target: str = typer.Option(None, "--target", help="the target, as every other command names it (the same as "
                               "WHAT)"),
    json_out: bool = typer.Option(False, "--json", help="emit JSON"),
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    chat_template: str = ChatTemplateOpt,
    raw: bool = typer.Option(False, "--raw", help="measure stream norms on plain-text prompts (no template; base "
                             "models)"),
) -> None:
    """Describe a target (layout in every engine's convention, stream norms), a shard folder or a draft."""
    from .inspect import inspect_path, inspect_target, render

    if what is not None and target is not None and what != target:
        fail(f"inspect got two things to describe: {what} and --target {target}; pass one of them")
    what = what or target or "smollm2-135m"
    with user_errors():
        info = inspect_path(Path(what)) if Path(what).is_dir() else None
        if info is None:
            info = inspect_target(what, dtype=dtype, device=device, chat_template=chat_template, raw=raw)
    if json_out:
        typer.echo(json.dumps(info, indent=2, default=str))
    else:
        render(info)


@app.command()
def bench(
    bench_set: str = typer.Option("mt-bench", "--bench", help="mt-bench | humaneval | a JSONL of prompts"),
    limit: int = typer.Option(10, "--limit", help="prompts (deterministic subset; 0 = all)"),
    turn: int = typer.Option(1, "--turn", help="MT-bench turn (2 = the target's greedy first answer in context)"),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens"),
    target: str = TargetOpt,
    draft: str = typer.Option("default", "--draft", help="eyas draft folder, 'default' (bundled) or 'random'"),
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    methods: str = typer.Option("hf-greedy,plain,chain,tree,hf-lookup", "--methods", help="comma-separated subset; "
                                "also vllm, vllm-eagle3 (vLLM's own environment, `make vllm`)"),
    steps: int = typer.Option(4, "--steps", help="chain: draft steps per round"),
    depth: int = TreeDepthOpt,
    topk: int = TreeTopkOpt,
    tokens: int = TreeTokensOpt,
    lookup_tokens: int = typer.Option(10, "--lookup-tokens", help="HF prompt_lookup_num_tokens"),
    lookup: int = TreeLookupOpt,
    ngram: str = NgramOpt,
    min_prob: float = TreeMinProbOpt,
    threads: int = typer.Option(0, "--threads", help="torch threads (0 = torch's default)"),
    out: str = typer.Option(None, "--out", help="results folder (default runs/bench-<time>/)"),
    resume: bool = typer.Option(False, "--resume", help="continue an interrupted run in --out"),
    sweep: bool = typer.Option(False, "--sweep", help="try the grid below and report the fastest setting"),
    sweep_limit: int = typer.Option(3, "--sweep-limit", help="prompts used by --sweep"),
    sweep_steps: str = typer.Option("1-6", "--sweep-steps"),
    sweep_depth: str = typer.Option("2-6", "--sweep-depth"),
    sweep_topk: str = typer.Option("1,2,4,8", "--sweep-topk"),
    sweep_tokens: str = typer.Option("4,8,16,32", "--sweep-tokens"),
    sweep_lookup: str = typer.Option("0", "--sweep-lookup", help="lookup candidates tried with each tree setting"),
    weights: str = WeightsOpt,
    draft_weights: str = DraftWeightsOpt,
    quiet: bool = typer.Option(False, "--quiet", help="no progress (per prompt and method, on stderr)"),
    chat_template: str = ChatTemplateOpt,
    raw: bool = typer.Option(False, "--raw", help="send each prompt's text as is, without a chat template (base "
                             "models; single-turn prompts only)"),
    vllm_python: str = typer.Option(None, "--vllm-python", help="methods vllm, vllm-eagle3: the python of a vLLM "
                                    "environment (default $EYAS_VLLM_PYTHON, then ./.venv-vllm from `make vllm`)"),
    vllm_k: int = typer.Option(None, "--vllm-k", help="vllm-eagle3: num_speculative_tokens (default --steps); "
                               "compared with eyas chain of the same steps on the fp32 weights"),
) -> None:
    """HF greedy, eyas plain/chain/tree and HF prompt lookup side by side: tok/s, speedup, tau, acceptance,
    draft overhead, lossless check; JSON + PNG in --out. --sweep searches steps/depth/topk/tokens."""
    from .bench.run import BenchConfig, SweepGrid, parse_int_list, parse_methods, run_bench
    from .bench.sweep import run_sweep
    from .engine.params import tree_defaults

    with user_errors():
        # the tree generate and serve use on this device, unless given; --lookup sets tree-lookup's merged
        # candidates and method lookup's chain alike
        tree = tree_defaults(device, "tree", depth=depth, topk=topk, tokens=tokens, lookup=lookup, min_prob=min_prob)
        alone = tree_defaults(device, "lookup", lookup=lookup)["lookup"]
        grid = SweepGrid(parse_int_list(sweep_steps, "--sweep-steps"), parse_int_list(sweep_depth, "--sweep-depth"),
                         parse_int_list(sweep_topk, "--sweep-topk"), parse_int_list(sweep_tokens, "--sweep-tokens"),
                         parse_int_list(sweep_lookup, "--sweep-lookup", minimum=0))
        cfg = BenchConfig(bench=bench_set, limit=limit or None, turn=turn, max_new_tokens=max_new_tokens,
                          target=target, draft=draft, dtype=dtype, device=device, weights=weights,
                          draft_weights=draft_weights, methods=parse_methods(methods),
                          steps=steps, lookup_tokens=lookup_tokens, lookup_alone=alone, ngram=ngram, **tree,
                          threads=threads or None, out=out, resume=resume, sweep=sweep, sweep_limit=sweep_limit,
                          grid=grid, chat_template=chat_template, raw=raw, vllm_python=vllm_python, vllm_k=vllm_k)
        (run_sweep if sweep else run_bench)(cfg, progress=not quiet)


@app.command()
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
    from .text import parse_int_list
    from .train.config import TrainConfig
    from .train.loop import train as run_train

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
                      intermediate_size=intermediate_size, fc_init=fc_init, init_from=init_from, resume=resume,
                      refresh_vocab=refresh_vocab, device=device,
                      target_dtype=dtype, quiet=quiet, threads=threads, chat_template=chat_template, raw=raw)
    with user_errors():
        run_train(cfg)


@app.command()
def datagen(
    data: str = typer.Option("sharegpt", "--data", help="sharegpt (bundled), a ShareGPT JSON/JSONL or messages JSONL, "
                             "or self (the target writes the user turns too; needs --num or --end-row)"),
    out: str = typer.Option(..., "--out", help="shard folder (created; rerun the same command to resume)"),
    target: str = TargetOpt,
    num: int = typer.Option(None, "--num", help="first N usable conversations (default: all); more extends a run"),
    start_row: int = typer.Option(0, "--start-row", help="skip the source's rows before this one (new conversations "
                                  "for a second folder; fixed for the folder)"),
    end_row: int = typer.Option(None, "--end-row", help="never read the source's rows from this one on (another "
                                "folder starts there)"),
    max_len: int = typer.Option(2048, "--max-len", help="tokens per sample (longer ones are truncated)"),
    regenerate: bool = typer.Option(True, "--regenerate/--no-regenerate", help="target writes the replies"),
    temperature: float = typer.Option(0.0, "--temperature", help="regeneration: 0 = greedy"),
    top_p: float = typer.Option(1.0, "--top-p", help="regeneration: nucleus sampling when --temperature > 0"),
    seed: int = typer.Option(0, "--seed", help="regeneration sampling seed"),
    max_new_tokens: int = typer.Option(512, "--max-new-tokens", help="regeneration: tokens per reply"),
    max_turns: int = typer.Option(None, "--max-turns", help="keep at most N assistant replies per conversation"),
    repetition_limit: int = typer.Option(32, "--repetition-limit",
                                         help="stop a regenerated reply once it repeats an N-token loop (0 = off)"),
    dtype: str = typer.Option("bf16", "--dtype", help="stored feature dtype: bf16 | fp16 | fp32"),
    target_dtype: str = typer.Option("fp32", "--target-dtype", help="dtype the target runs in"),
    device: str = DeviceOpt,
    aux_indices: str = typer.Option(None, "--aux-indices", help="stream indices, e.g. 2,15,27 (default EAGLE-3)"),
    shard_samples: int = typer.Option(64, "--shard-samples", help="conversations per chunk/shard"),
    shard_tokens: int = typer.Option(65536, "--shard-tokens", help="max tokens per shard"),
    gen_batch: int = typer.Option(64, "--gen-batch", help="regeneration: prompts decoding at once"),
    regen_weights: str = typer.Option("auto", "--regen-weights", help="regeneration: the engine's weights, as "
                                      "--weights (auto: native for a GGUF on the CPU, the numerics eyas serves "
                                      "with) | fp32 (the HF weights in --target-dtype)"),
    capture_tokens: int = typer.Option(8192, "--capture-tokens", help="padded tokens per capture forward"),
    threads: int = typer.Option(0, "--threads", help="torch CPU threads (0 = default; 1 on a busy machine)"),
    quiet: bool = typer.Option(False, "--quiet", help="no progress bar"),
    chat_template: str = ChatTemplateOpt,
    raw: bool = typer.Option(False, "--raw", help="base models: rows as plain text without a template ({'text'} "
                             "documents, or a conversation's texts joined); loss on every token, or with "
                             "regeneration on the target's continuation"),
    engine: str = typer.Option("eyas", "--engine", help="who runs the target: eyas | vllm (vLLM writes the replies "
                               "and, through extract_hidden_states, the stream states; eyas loads no weights)"),
    vllm_python: str = typer.Option(None, "--vllm-python", help="--engine vllm: the python of a vLLM environment "
                                    "(default $EYAS_VLLM_PYTHON, then .venv-vllm from `make vllm`)"),
    vllm_tp: int = typer.Option(1, "--vllm-tp", help="--engine vllm: tensor_parallel_size"),
    vllm_pp: int = typer.Option(1, "--vllm-pp", help="--engine vllm: pipeline_parallel_size"),
    vllm_arg: list[str] = typer.Option(None, "--vllm-arg", help="--engine vllm: a vllm.LLM engine argument "
                                       "KEY=VALUE, VALUE as JSON (repeatable), e.g. gpu_memory_utilization=0.85"),
    vllm_generator: str = typer.Option("auto", "--vllm-generator", help="--engine vllm: the replies on the capture "
                                       "engine (shared: one copy of the weights) or a second plain one (separate: "
                                       "faster decoding); auto = separate on the CPU, shared on CUDA"),
) -> None:
    """Capture the target's hidden states on conversations (optionally regenerated by the target) into
    resumable safetensors shards with the layout recorded."""
    import sys

    from .data.datagen import DatagenConfig, run_datagen, summary
    from .text import parse_int_list

    with user_errors():
        aux = parse_int_list(aux_indices, "--aux-indices")
    cfg = DatagenConfig(out=out, target=target, data=data, num=num, start_row=start_row, end_row=end_row,
                        max_len=max_len, regenerate=regenerate,
                        temperature=temperature, top_p=top_p, seed=seed, max_new_tokens=max_new_tokens,
                        max_turns=max_turns, repetition_limit=repetition_limit, dtype=dtype, target_dtype=target_dtype,
                        device=device, aux_indices=aux, shard_samples=shard_samples, shard_tokens=shard_tokens,
                        gen_batch=gen_batch, regen_weights=regen_weights, capture_tokens=capture_tokens,
                        threads=threads, chat_template=chat_template, raw=raw, engine=engine,
                        vllm_python=vllm_python, vllm_tp=vllm_tp, vllm_pp=vllm_pp, vllm_args=list(vllm_arg or []),
                        vllm_generator=vllm_generator)
    with user_errors():
        m = run_datagen(cfg, command=" ".join(["eyas", *sys.argv[1:]]), log=typer.echo, progress=not quiet)
    for line in summary(m):
        typer.echo(line)


@app.command()
def serve(
    target: str = TargetOpt,
    draft: str = typer.Option("default", "--draft", help="eyas draft folder, 'default' (bundled), 'random' "
                              "(untrained: the plumbing, not the speed) or 'none' (plain decoding)"),
    method: str = typer.Option(None, "--method", help=MethodHelp),
    steps: int = typer.Option(None, "--steps", help="chain: draft steps per round"),
    depth: int = TreeDepthOpt,
    topk: int = TreeTopkOpt,
    tokens: int = TreeTokensOpt,
    lookup: int = TreeLookupOpt,
    ngram: str = NgramOpt,
    min_prob: float = TreeMinProbOpt,
    host: str = typer.Option("127.0.0.1", "--host", help="bind address (localhost by default)"),
    port: int = typer.Option(8000, "--port"),
    api_key: str = typer.Option(None, "--api-key", help="require 'Authorization: Bearer KEY' (or set EYAS_API_KEY)"),
    max_prompt_tokens: int = typer.Option(4096, "--max-prompt-tokens", help="longer prompts get a 400"),
    max_new_tokens: int = typer.Option(1024, "--max-new-tokens", help="cap (and default) for max_tokens"),
    model_name: str = typer.Option(None, "--model-name", help="the model id clients send (default: the target's name)"),
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    weights: str = WeightsOpt,
    draft_weights: str = DraftWeightsOpt,
    log_level: str = typer.Option("info", "--log-level", help="uvicorn log level"),
    chat_template: str = ChatTemplateOpt,
) -> None:
    """OpenAI-compatible HTTP server (chat/completions, streaming, /metrics) on the speculative engine."""
    from .engine.load import EngineOptions
    from .serve import app as srv

    key = srv.resolve_api_key(api_key)
    warning = srv.exposure_warning(host, key)
    if warning:
        typer.secho(f"warning: {warning}", fg="yellow", err=True)
    with user_errors():
        cfg = srv.ServeConfig(model_name=model_name or "pending", api_key=key, max_prompt_tokens=max_prompt_tokens,
                              max_new_tokens=max_new_tokens)
        cfg.check()  # bad flags fail before the model loads
        engine, tgt, used = srv.build_engine(EngineOptions(
            target=target, draft=draft, method=method, steps=steps, depth=depth, topk=topk, tokens=tokens,
            lookup=lookup, min_prob=min_prob, ngram=ngram, weights=weights, draft_weights=draft_weights, dtype=dtype,
            device=device, chat_template=chat_template))
        for w in srv.template_warnings(engine, tgt):
            warn(w)
        cfg.model_name = model_name or tgt.identity.name or target
        cfg.context_length = srv.context_length_of(tgt)
        app_ = srv.create_app(engine, tgt.tokenizer, cfg)
    desc = f"{used}, draft {draft}" if engine.drafts else f"{used}, no draft"
    if engine.ngram is not None:
        desc += f", n-gram table ({len(engine.ngram)} contexts)"
    typer.echo(srv.startup_line(cfg, host, port, desc), err=True)
    srv.run(app_, host, port, log_level=log_level)


@app.command()
def export(
    draft: str = typer.Option(..., "--draft", help="eyas draft folder (or 'default', the bundled draft)"),
    fmt: str = typer.Option(..., "--format", help="sglang | vllm | speculators"),
    out: Path = typer.Option(..., "--out", help="folder to write (replaced atomically)"),
    dtype: str = typer.Option("fp32", "--dtype", help="weights dtype: fp32 | bf16 | fp16"),
    target: str = typer.Option(None, "--target", help="the draft's target (name, HF folder, .gguf; default: the "
                               "one the draft records); speculators exports load it for its token embeddings"),
    serve_model: str = typer.Option(None, "--serve-model", help="model path/id for the printed launch command "
                                    "(default: the target; a bundled GGUF becomes its converted HF folder)"),
    steps: int = typer.Option(3, "--steps", help="draft steps (SGLang num-steps, vLLM num_speculative_tokens)"),
    topk: int = typer.Option(1, "--topk", help="SGLang --speculative-eagle-topk"),
    draft_tokens: int = typer.Option(None, "--draft-tokens", help="SGLang num-draft-tokens (default 1 + steps*topk)"),
    verifier: str = typer.Option(None, "--verifier", help="speculators: verifier.name_or_path written in the config "
                                 "(default: the target's public model id, e.g. HuggingFaceTB/SmolLM2-135M-Instruct "
                                 "for the bundled target; the weights fingerprint stays in the eyas manifest)"),
    json_out: bool = typer.Option(False, "--json", help="print the result as JSON"),
) -> None:
    """Export a draft for SGLang/SpecForge, vLLM or speculators (ids in the engine's convention) + launch command."""
    import sys

    from .draft import load_draft
    from .interop.export import LaunchParams, export_draft, target_embeddings

    with user_errors():
        ckpt = load_draft(draft)
        emb = target_embeddings(ckpt, target) if fmt == "speculators" else None
        if verifier is not None and fmt != "speculators":
            fail(f"--verifier applies to --format speculators only (its config names the verifier); got --format {fmt}")
        res = export_draft(ckpt, fmt, out, dtype=dtype, target=serve_model or target, embeddings=emb,
                           launch=LaunchParams(steps, topk, draft_tokens), command="eyas " + " ".join(sys.argv[1:]),
                           verifier=verifier)
    if json_out:
        typer.echo(json.dumps({"path": str(res.path), "format": res.format, "config": res.config,
                               "launch": res.launch}, indent=2))
        return
    ids = res.manifest["ids_in_config"]
    typer.echo(f"wrote {res.format} draft to {res.path} (stream indices {res.manifest['layout']['aux_indices']}; "
               f"config ids: " + ", ".join(f"{k} = {v}" for k, v in ids.items() if v is not None) + ")")
    ver = (res.manifest.get("verifier") or {}).get("name_or_path")
    if ver is not None:
        typer.echo(f"verifier.name_or_path: {ver}")
        if Path(ver).is_absolute():
            typer.secho(f"warning: the verifier is named by a path on this machine ({ver}); pass --verifier "
                        "ORG/MODEL for a folder that works elsewhere", fg="yellow", err=True)
    typer.echo("launch:")
    typer.echo(f"  {res.launch}")


@app.command("import")
def import_(
    src: Path = typer.Argument(..., help="SGLang/SpecForge, vLLM, speculators or EAGLE reference draft folder"),
    target: str = TargetOpt,
    out: Path = typer.Option(..., "--out", help="eyas draft folder to write"),
    fmt: str = typer.Option("auto", "--format", help="auto | sglang | specforge | vllm | speculators | eagle"),
    aux_indices: str = typer.Option(None, "--aux-indices", help="override: eyas stream indices, e.g. 2,15,27"),
    aux_ids: str = typer.Option(None, "--aux-ids", help="override: ids in --ids-convention, e.g. 1,14,26"),
    ids_convention: str = typer.Option(None, "--ids-convention", help="eyas | eagle | sglang | specforge | vllm | "
                                       "speculators (what --aux-ids mean)"),
    allow_pickle: bool = typer.Option(False, "--allow-pickle", help="read pickled .bin/.pt weights "
                                      "(torch.load weights_only=True); only for files you trust"),
    infer: bool = typer.Option(True, "--infer/--no-infer", help="run layout inference when ids are missing or "
                               "ambiguous"),
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    json_out: bool = typer.Option(False, "--json", help="print the import record as JSON"),
) -> None:
    """Import a foreign EAGLE-3 draft: ids translated into stream indices, shapes checked against the target."""
    import sys

    from .interop.importer import check_import_options, import_draft
    from .target.load import load_target
    from .text import parse_int_list

    with user_errors():
        idx = parse_int_list(aux_indices, "--aux-indices")
        ids = parse_int_list(aux_ids, "--aux-ids")
        check_import_options(fmt, idx, ids, ids_convention)  # before the target loads
        tgt = load_target(target, dtype=dtype, device=device)
        res = import_draft(src, tgt, out, fmt=fmt, allow_pickle=allow_pickle, aux_indices=idx, aux_ids=ids,
                           ids_convention=ids_convention, infer=infer, command="eyas " + " ".join(sys.argv[1:]))
    if json_out:
        typer.echo(json.dumps(res.info, indent=2, default=str))
        return
    i = res.info
    typer.echo(f"imported {i['format']} draft ({i['format_detected_by']}) -> {res.path}")
    typer.echo(f"  ids found: {i['ids_found']}")
    typer.echo(f"  stream indices {i['aux_indices']} decided by {i['decided_by']}")
    for n in i["notes"]:
        typer.echo(f"  note: {n}")
    for w in res.warnings:
        typer.secho(f"  warning: {w}", fg="yellow", err=True)


# ---- eyas doctor (eyas/doctor/) --------------------------------------------------------------------
doctor_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False,
                         help="Find every wiring fault between target, data, draft and serving flags.")
app.add_typer(doctor_app, name="doctor")


@doctor_app.callback(invoke_without_command=True)
def doctor(
    ctx: typer.Context,
    target: str = TargetOpt,
    draft: str = typer.Option(None, "--draft", help="eyas draft folder (or 'default')"),
    data: list[Path] = typer.Option(None, "--data", help="shard folder(s): stored features (training path), "
                                    "compared with fresh captures of the same held-out tokens"),
    data_source: str = typer.Option(None, "--data-source", help="conversations for the serving path without "
                                    "--data: sharegpt | ShareGPT/OpenAI JSON(L) path (default: the training source)"),
    samples: int = typer.Option(6, "--samples", help="samples to measure on"),
    max_len: int = typer.Option(384, "--max-len", help="tokens per sample at most"),
    steps: int = typer.Option(None, "--steps", help="TTT steps of the accuracy check (default: the training run's)"),
    heldout_pct: float = typer.Option(None, "--heldout-pct", help="held-out split (default: the training run's)"),
    quick: bool = typer.Option(False, "--quick", help="identity and config checks only (no target forward)"),
    json_out: bool = typer.Option(False, "--json", help="emit JSON"),
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    weights: str = WeightsOpt,
    chat_template: str = ChatTemplateOpt,
) -> None:
    """Check the target, data, draft and config.json from measurements; exit 0 only when every check passes.
    Subcommands: `flags` (lint a serve command), `trace` (one prompt through the serving path)."""
    if ctx.invoked_subcommand is not None:
        return
    from .doctor.checks import render, run_doctor
    from .draft import load_draft
    from .target.load import load_target

    if draft is None:
        fail("--draft is required: the eyas draft folder to check (or 'default'); see `eyas doctor --help`")
    with user_errors():
        from .target.template import TemplateError, draft_template_warning, resolve_template, use_template

        choice = resolve_template(chat_template)  # a bad flag fails before the target loads
        tgt = load_target(target, dtype=dtype, device=device)
        ck = load_draft(draft, device=device)
        try:  # the serving-path samples render with it
            use_template(tgt, choice)
        except TemplateError:
            pass  # no template at all: the checks that render chats report it themselves
        mismatch = draft_template_warning(ck.manifest, tgt.chat_template)
        if mismatch:
            warn(mismatch)
        rep = run_doctor(tgt, ck, data=data or None, source=data_source, num_samples=samples, max_len=max_len,
                         steps=steps, heldout_pct=heldout_pct, quick=quick, weights=weights)
    if json_out:
        typer.echo(json.dumps(rep.to_dict(), indent=2, default=str))
    else:
        render(rep)
    raise typer.Exit(rep.exit_code)


@doctor_app.command("flags", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def doctor_flags(
    draft: Path = typer.Option(..., "--draft", help="the draft folder the server loads (its config.json)"),
    num_layers: int = typer.Option(None, "--num-layers", help="target layer count (only for non-eyas drafts)"),
    json_out: bool = typer.Option(False, "--json", help="emit JSON"),
    command: list[str] = typer.Argument(None, help="after --: an SGLang launch command, a vLLM serve command, "
                                        "or a --speculative-config JSON"),
) -> None:
    """Lint SGLang/vLLM serving flags against an EAGLE-3 draft and print the corrected command."""
    from .doctor.flags import lint_serve_command, render_lint
    from .doctor.report import jsonable

    with user_errors():
        lint = lint_serve_command(list(command or []), draft, num_layers)
    if json_out:
        typer.echo(json.dumps(jsonable(lint.to_dict()), indent=2))
    else:
        render_lint(lint)
    raise typer.Exit(0 if lint.ok else 1)


@doctor_app.command("trace")
def doctor_trace(
    target: str = TargetOpt,
    draft: str = typer.Option(..., "--draft", help="eyas draft folder (or 'default')"),
    prompt: str = typer.Option(..., "--prompt", help="a user message (the chat template is applied)"),
    method: str = typer.Option("tree", "--method", help="tree | chain (the engine's own defaults otherwise)"),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens"),
    rounds: int = typer.Option(4, "--rounds", help="speculative rounds to show"),
    json_out: bool = typer.Option(False, "--json", help="emit JSON"),
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    chat_template: str = ChatTemplateOpt,
    raw: bool = typer.Option(False, "--raw", help="send --prompt as plain text, without a chat template"),
) -> None:
    """One prompt through the real serving path: shape and norm per stage, draft top tokens, accepted tokens."""
    from .doctor.trace import render_trace, trace
    from .engine.load import EngineOptions, EngineUse, check_options, load_parts
    from .engine.params import SpecParams
    from .engine.report import input_ids

    if method not in ("tree", "chain"):
        fail(f"--method {method}: the trace follows a draft's rounds; use --method tree or chain")
    opts = EngineOptions(target=target, draft=draft, method=method, dtype=dtype, device=device,
                         chat_template=chat_template, raw=raw)
    use = EngineUse("eyas doctor trace", "`eyas doctor --target T --draft D` (without trace) measures the draft on "
                    "this target through HF hooks")
    spec = SpecParams(method=method)  # the engine's own tree, not the device's default
    with user_errors():
        parts = load_parts(opts, use, check_options(opts, use, [spec]), [spec])
        if parts.template_warning:
            warn(parts.template_warning)
        ids = input_ids(parts.target.tokenizer, prompt, None, raw)
        rep = trace(parts.target, parts.draft, ids, spec, max_new_tokens=max_new_tokens, max_rounds=rounds)
    if json_out:
        typer.echo(json.dumps(rep.to_dict(), indent=2))
    else:
        render_trace(rep)


@doctor_app.command("serving")
def doctor_serving(
    url: str = typer.Option(..., "--url", help="the running vLLM server, e.g. http://127.0.0.1:8000"),
    draft: str = typer.Option(..., "--draft", help="the eyas draft the server's export was made from (or 'default')"),
    target: str = TargetOpt,
    k: int = typer.Option(None, "--k", help="the server's num_speculative_tokens (default: read from its /metrics)"),
    prompts: int = typer.Option(4, "--prompts", help="MT-bench questions to send (first turn, stratified)"),
    bench_set: str = typer.Option("mt-bench", "--bench", help="mt-bench | humaneval | a JSONL of prompts"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="max_tokens per request (and for eyas)"),
    api_key: str = typer.Option(None, "--api-key", help="sent as 'Authorization: Bearer KEY'"),
    timeout: float = typer.Option(120.0, "--timeout", help="seconds per HTTP request"),
    weights: str = typer.Option("fp32", "--weights", help="eyas's target forward for the prediction: fp32 (the HF "
                                "weights, what vLLM runs) | native | auto"),
    json_out: bool = typer.Option(False, "--json", help="emit JSON"),
    device: str = DeviceOpt,
) -> None:
    """Live check of a vLLM server: its spec-decode acceptance per position vs eyas's prediction for the same draft,
    prompts and chain length; a failure names the likely cause. Exit 0 on pass, 1 on fail."""
    import sys

    from .bench.prompts import load_prompts
    from .doctor.report import jsonable
    from .doctor.serving import ServerClient, check_server, render_serving
    from .engine.decode import chat_input_ids
    from .target.load import load_target

    with user_errors():
        probe = ServerClient(url, api_key, timeout)  # a bad or unreachable URL fails before the target loads
        try:
            found = probe.counters()
        finally:
            probe.close()
        if k is not None and k != found.k:
            fail(f"--k {k}, but the server drafts {found.k} tokens per round (its per-position counters); drop --k "
                 f"or pass --k {found.k}")
        rows = load_prompts(bench_set, limit=prompts)
        tgt = load_target(target, dtype="fp32", device=device)
        ids = [chat_input_ids(tgt.tokenizer, r.messages) for r in rows]
        rep = check_server(url, tgt, draft, ids, k=k, max_new_tokens=max_new_tokens, api_key=api_key,
                           timeout=timeout, weights=weights,
                           log=None if json_out else (lambda m: typer.echo(m, err=True)))
    if json_out:
        typer.echo(json.dumps(jsonable(rep.to_dict()), indent=2))
    else:
        render_serving(rep, typer.echo)
    sys.stdout.flush()
    raise typer.Exit(0 if rep.ok else 1)


@app.command()
def generate(
    target: str = TargetOpt,
    draft: str = typer.Option("default", "--draft", help="eyas draft folder, 'default' (bundled), 'random' "
                              "(untrained: the plumbing, not the speed) or 'none' (plain decoding)"),
    prompt: str = typer.Option(None, "--prompt", help="user message (sent through the chat template)"),
    messages: str = typer.Option(None, "--messages", help='chat JSON: [{"role": "user", "content": "..."}, ...] '
                                 "or a path to such a file"),
    raw: bool = typer.Option(False, "--raw", help="send --prompt as plain text, without a chat template (base "
                             "models; the tokenizer's own BOS rule applies)"),
    chat_template: str = ChatTemplateOpt,
    method: str = typer.Option(None, "--method", help=MethodHelp),
    steps: int = typer.Option(4, "--steps", help="chain: draft steps per round (verifies steps+1 tokens)"),
    depth: int = TreeDepthOpt,
    topk: int = TreeTopkOpt,
    tokens: int = TreeTokensOpt,
    lookup: int = TreeLookupOpt,
    ngram: str = NgramOpt,
    min_prob: float = TreeMinProbOpt,
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy"),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k", help="0 = off"),
    seed: int = typer.Option(None, "--seed", help="sampling seed (reproducible output)"),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens"),
    stop: list[str] = typer.Option(None, "--stop", help="stop string (repeatable); trimmed from the output"),
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    weights: str = WeightsOpt,
    draft_weights: str = DraftWeightsOpt,
) -> None:
    """Generate for a prompt or chat messages; streams text and prints tok/s, tau and acceptance per depth."""
    import sys

    from .engine.load import EngineOptions, EngineUse, load_engine
    from .engine.params import SamplingParams
    from .engine.report import input_ids, read_messages, summary_lines
    from .text import TextStream

    if (prompt is None) == (messages is None):
        fail("pass exactly one of --prompt TEXT or --messages JSON")
    if raw and messages is not None:
        fail("--raw sends --prompt as plain text; --messages is a chat, which needs a template: drop --raw (and "
             "pass --chat-template NAME if the target has none)")
    opts = EngineOptions(target=target, draft=draft, method=method, steps=steps, depth=depth, topk=topk, tokens=tokens,
                         lookup=lookup, min_prob=min_prob, ngram=ngram, weights=weights, draft_weights=draft_weights,
                         dtype=dtype, device=device, chat_template=chat_template, raw=raw)
    use = EngineUse("eyas generate", f"HF's own greedy decoding of this target runs in `eyas bench --target {target} "
                    "--methods hf-greedy --bench PROMPTS.jsonl`")
    with user_errors():
        msgs = read_messages(messages) if messages is not None else None
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                                stop=list(stop or []), seed=seed)
        params.validate()
        engine, parts = load_engine(opts, use)
        if parts.template_warning:
            warn(parts.template_warning)
        tok = engine.target.tokenizer
        ids = input_ids(tok, prompt, msgs, raw)
        shown = TextStream(tok, params.stop, params.max_new_tokens)  # what is safe to print so far
        for new in engine.stream(ids, params):
            delta = shown.push(new)
            if delta:
                sys.stdout.write(delta)
                sys.stdout.flush()
    res = engine.last_result
    sys.stdout.write(res.text[shown.sent:] + "\n")
    for line in summary_lines(engine, res):
        typer.secho(line, fg="cyan", err=True)


@app.command()
def ngram(
    data: list[str] = typer.Option(None, "--data", help="eyas shard folder of the target's regenerated replies "
                                   "(`eyas datagen --regenerate`; repeatable)"),
    out: str = typer.Option("runs/ngram", "--out", help="table folder (replaced atomically)"),
    order: int = typer.Option(3, "--order", help="longest context, in tokens"),
    min_count: int = typer.Option(2, "--min-count", help="keep a context only when its most frequent next token "
                                  "was seen this often"),
) -> None:
    """Count the target's own replies into the n-gram table that lookup proposes from where the context has no
    match (`--ngram PATH` on generate, serve and bench)."""
    from .data.ngrams import NgramConfig, build_ngram

    with user_errors():
        build_ngram(NgramConfig(data=list(data or []), out=out, order=order, min_count=min_count),
                    log=lambda m: typer.echo(m, err=True))


@app.command()
def recipe(
    name: str = typer.Argument("smollm2-135m", help="the recipe (target) to run"),
    work: str = typer.Option("runs/recipe", "--work", help="work folder (resume by rerunning the same command)"),
    stages: str = typer.Option("data,ngram,train,eval,ship", "--stages", help="subset of data,ngram,train,eval,ship"),
    device: str = DeviceOpt,
    orig_num: int = typer.Option(4000, "--orig-num", help="ShareGPT rows with original replies"),
    regen_num: int = typer.Option(0, "--regen-num", help="ShareGPT rows, target-regenerated"),
    regen_start: int = typer.Option(0, "--regen-start", help="regenerate from this source row on, into "
                                    "WORK/data-regen-from-ROW (new conversations for another round)"),
    self_num: int = typer.Option(0, "--self-num", help="rows whose user turn the target writes too (datagen --data "
                                 "self), into WORK/data-self"),
    self_start: int = typer.Option(0, "--self-start", help="self-prompted rows from this row on, into "
                                   "WORK/data-self-from-ROW"),
    epochs: float = typer.Option(5.0, "--epochs"),
    ttt_steps: int = typer.Option(3, "--ttt-steps"),
    draft_vocab: int = typer.Option(8192, "--draft-vocab"),
    lr: float = typer.Option(1e-3, "--lr"),
    batch_tokens: int = typer.Option(2048, "--batch-tokens", help="padded tokens per optimizer step"),
    bf16: bool = typer.Option(None, "--bf16/--no-bf16", help="bf16 autocast in training (default: on CUDA only)"),
    threads: int = typer.Option(0, "--threads", help="torch CPU threads (0 = torch's default)"),
    ship_to: str = typer.Option(None, "--ship-to", help="default: eyas/assets/drafts/default"),
    init_from: str = typer.Option(None, "--init-from", help="warm-start training from this eyas draft ('default' = "
                                  "the shipped one; keeps its draft vocabulary)"),
    refresh_vocab: bool = typer.Option(False, "--refresh-vocab", help="with --init-from: re-choose the draft "
                                       "vocabulary from the current data"),
    ngram_min_count: int = typer.Option(2, "--ngram-min-count", help="ngram stage: keep a context whose most "
                                        "frequent next token was seen this often"),
) -> None:
    """Run the whole pipeline (datagen -> ngram -> train -> bench -> ship) for a bundled target; resumable at every
    stage."""
    from .recipe import RecipeConfig, run_recipe

    with user_errors():
        run_recipe(RecipeConfig(name=name, work=work, stages=tuple(s for s in stages.split(",") if s), device=device,
                                orig_num=orig_num, regen_num=regen_num, regen_start=regen_start, self_num=self_num,
                                self_start=self_start, epochs=epochs,
                                ttt_steps=ttt_steps,
                                draft_vocab=draft_vocab, lr=lr, batch_tokens=batch_tokens, bf16=bf16, threads=threads,
                                ship_to=ship_to, init_from=init_from, refresh_vocab=refresh_vocab,
                                ngram_min_count=ngram_min_count))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
