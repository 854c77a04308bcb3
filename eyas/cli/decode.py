"""The commands that decode with the speculative engine: generate, serve (eyas/serve) and bench (eyas/bench);
they share the tree options."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import typer

from ..bench.config import BenchConfig
from ..engine.load import EngineOptions
from ..engine.params import TreeSettings
from ..serve.config import ServeConfig
from .common import (
    config_from,
    config_options,
    fail,
    user_errors,
    warn,
)

if TYPE_CHECKING:
    from ..engine.decode import Engine
    from ..engine.stats import GenResult


@config_options(EngineOptions, TreeSettings)
def generate(
    prompt: str = typer.Option(None, "--prompt", help="user message (sent through the chat template)"),
    messages: str = typer.Option(None, "--messages", help='chat JSON: [{"role": "user", "content": "..."}, ...] '
                                 "or a path to such a file"),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy"),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k", help="0 = off"),
    seed: int = typer.Option(None, "--seed", help="sampling seed (reproducible output)"),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens"),
    stop: list[str] = typer.Option(None, "--stop", help="stop string (repeatable); trimmed from the output"),
    **given: Any,
) -> None:
    """Generate for a prompt or chat messages; streams text and prints tok/s, tau and acceptance per depth."""
    import sys

    from ..engine.load import EngineUse, load_engine
    from ..engine.params import SamplingParams
    from ..engine.prompt import input_ids, read_messages
    from ..text import TextStream

    opts = config_from(EngineOptions, given, tree=config_from(TreeSettings, given))
    raw = opts.raw
    if (prompt is None) == (messages is None):
        fail("pass exactly one of --prompt TEXT or --messages JSON")
    if raw and messages is not None:
        fail("--raw sends --prompt as plain text; --messages is a chat, which needs a template: drop --raw (and "
             "pass --chat-template NAME if the target has none)")
    use = EngineUse("eyas generate", "HF's own greedy decoding of this target runs in `eyas bench --target "
                    f"{opts.target} --methods hf-greedy --bench PROMPTS.jsonl`")
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
    assert res is not None  # the stream ran to its end
    sys.stdout.write(res.text[shown.sent:] + "\n")
    for line in summary_lines(engine, res):
        typer.secho(line, fg="cyan", err=True)


@config_options(EngineOptions, ServeConfig, TreeSettings, skip=("raw",))
def serve(
    host: str = typer.Option("127.0.0.1", "--host", help="bind address (localhost by default)"),
    port: int = typer.Option(8000, "--port"),
    api_key: str = typer.Option(None, "--api-key", help="require 'Authorization: Bearer KEY' (or set EYAS_API_KEY)"),
    model_name: str = typer.Option(None, "--model-name", help="the model id clients send (default: the target's name)"),
    log_level: str = typer.Option("info", "--log-level", help="uvicorn log level"),
    **given: Any,
) -> None:
    """OpenAI-compatible HTTP server (chat/completions, streaming, /metrics) on the speculative engine."""
    from ..serve import app as srv
    from ..serve import launch

    with launch.exit_logged():  # every exit says why: a signal, an error and where, a native crash
        key = launch.resolve_api_key(api_key)
        warning = launch.exposure_warning(host, key)
        if warning:
            typer.secho(f"warning: {warning}", fg="yellow", err=True)
        with user_errors():
            cfg = config_from(ServeConfig, given, model_name=model_name or "pending", api_key=key)
            cfg.check()  # bad flags fail before the model loads
            opts = config_from(EngineOptions, given, tree=config_from(TreeSettings, given)).resolved()
            engine, tgt = launch.build_engine(opts)
            for w in launch.template_warnings(engine, tgt):
                warn(w)
            cfg.model_name = model_name or tgt.identity.name or opts.target
            cfg.context_length = launch.context_length_of(tgt)
            app_ = srv.create_app(engine, tgt.tokenizer, cfg)
        desc = f"{opts.method}, draft {opts.draft}" if engine.drafts else f"{opts.method}, no draft"
        if engine.ngram is not None:
            desc += f", n-gram table ({len(engine.ngram)} contexts)"
        typer.echo(launch.startup_line(cfg, host, port, desc), err=True)
        launch.run(app_, host, port, log_level=log_level)


@config_options(BenchConfig, TreeSettings)
def bench(
    limit: int = typer.Option(10, "--limit", help="prompts (deterministic subset; 0 = all)"),
    methods: str = typer.Option("hf-greedy,plain,chain,tree,hf-lookup", "--methods", help="comma-separated subset; "
                                "also llama-cpp, llama-cpp-c (llama.cpp via llama-cpp-python, `make llama-cpp`) and "
                                "vllm, vllm-eagle3 (vLLM's own environment, `make vllm`)"),
    threads: int = typer.Option(0, "--threads", help="torch threads (0 = torch's default)"),
    sweep_steps: str = typer.Option("1-6", "--sweep-steps"),
    sweep_depth: str = typer.Option("2-6", "--sweep-depth"),
    sweep_topk: str = typer.Option("1,2,4,8", "--sweep-topk"),
    sweep_tokens: str = typer.Option("4,8,16,32", "--sweep-tokens"),
    sweep_lookup: str = typer.Option("0", "--sweep-lookup", help="lookup candidates tried with each tree setting"),
    quiet: bool = typer.Option(False, "--quiet", help="no progress (per prompt and method, on stderr)"),
    **given: Any,
) -> None:
    """HF greedy and eyas plain, chain, tree and lookup side by side (with the peers asked for): tok/s, speedup, tau,
    acceptance, draft overhead, lossless check; JSON + PNG in --out. --sweep searches steps/depth/topk/tokens."""
    from ..bench.config import SweepGrid, parse_int_list, parse_methods
    from ..bench.run import run_bench
    from ..bench.sweep import run_sweep

    with user_errors():
        grid = SweepGrid(parse_int_list(sweep_steps, "--sweep-steps"), parse_int_list(sweep_depth, "--sweep-depth"),
                         parse_int_list(sweep_topk, "--sweep-topk"), parse_int_list(sweep_tokens, "--sweep-tokens"),
                         parse_int_list(sweep_lookup, "--sweep-lookup", minimum=0))
        cfg = config_from(BenchConfig, given, limit=limit or None, methods=parse_methods(methods),
                          tree=config_from(TreeSettings, given), threads=threads or None, grid=grid)
        (run_sweep if cfg.sweep else run_bench)(cfg, progress=not quiet)


def summary_lines(engine: Engine, res: GenResult) -> list[str]:
    """generate's report after the text: speed, the weights that ran, and for speculative methods tau,
    acceptance per depth, the draft/verify split and what lookup contributed."""
    st, spec = res.stats, engine.spec
    lines = [f"[{spec.method}] {st.new_tokens} tokens ({res.finish_reason}) in {st.total_s:.2f}s: {st.tok_s:.1f} "
             f"tok/s ({st.decode_tok_s:.1f} after the {st.prefill_s * 1e3:.0f} ms prefill of {st.prompt_tokens} "
             "tokens)",
             f"weights: target {engine.weights}" + (f", draft {engine.draft_weights}" if engine.draft_weights else "")
             + (f" (--weights auto: {engine.weights_note})" if engine.weights_note else "")]
    if spec.method == "plain":
        return lines
    # depths some round drafted (a depth-2 tree never attempts depth 3 of the lookup-sized arrays)
    rates = " ".join(f"d{i + 1}={a:.2f}" for i, (a, p) in enumerate(zip(st.accept_rates, st.proposed_per_depth,
                                                                          strict=True)) if p)
    per = max(st.rounds, 1)
    lines.append(f"tau {st.tau:.2f} tokens/forward over {st.rounds} rounds; acceptance per depth: {rates}")
    lines.append(f"per round: draft {st.draft_s / per * 1e3:.1f} ms, verify {st.verify_s / per * 1e3:.1f} ms "
                 f"(draft share {st.draft_share:.0%})")
    if spec.lookup:
        table = f"n-gram table {engine.ngram.path} ({len(engine.ngram)} contexts)" if engine.ngram else \
            "no n-gram table"
        lines.append(f"lookup: {st.lookup_accepted} of {st.lookup_proposed} proposed accepted; {table}"
                     + (f": {st.ngram_accepted} of {st.ngram_proposed} accepted" if engine.ngram else ""))
    return lines
