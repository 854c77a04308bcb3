"""eyas doctor (eyas/doctor): the measured checks, and its subcommands flags, trace, serving and streams."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from ..engine.load import EngineOptions
from ..heartbeat import during
from .common import (
    ChatTemplateOpt,
    DeviceOpt,
    DtypeOpt,
    TargetOpt,
    WeightsOpt,
    config_from,
    config_options,
    fail,
    user_errors,
    warn,
)

doctor_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False,
                         help="Find every wiring fault between target, data, draft and serving flags.")


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
    steps: int = typer.Option(None, "--ttt-steps", help="TTT steps of the accuracy check (default: the training "
                              "run's; eyas train's --ttt-steps)"),
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
    from ..doctor.checks import render, run_doctor
    from ..draft import load_draft
    from ..target.open import TargetChoice
    from ..target.template import draft_template_warning

    if draft is None:
        fail("--draft is required: the eyas draft folder to check (or 'default'); see `eyas doctor --help`")
    with user_errors():
        # the serving-path samples render with the template; a target without one still opens: the checks that
        # render chats report it themselves
        tgt = TargetChoice(target, dtype, device, chat_template, template_required=False).open()
        ck = load_draft(draft, device=device)
        mismatch = draft_template_warning(ck.manifest, tgt.chat_template)
        if mismatch:
            warn(mismatch)
        with during(f"measuring the draft on {samples} samples (captures, layout ranking, accuracy; minutes on a "
                    "CPU)"):
            rep = run_doctor(tgt, ck, data=data or None, source=data_source, num_samples=samples,
                             max_len=max_len, steps=steps, heldout_pct=heldout_pct, quick=quick, weights=weights)
    if json_out:
        typer.echo(json.dumps(rep.to_dict(), indent=2, default=str))
    else:
        render(rep)
    raise typer.Exit(rep.exit_code)


@doctor_app.command("flags", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def doctor_flags(
    draft: Path = typer.Option(..., "--draft", help="the draft folder the server loads (its config.json)"),
    num_layers: int = typer.Option(None, "--num-layers", help="target layer count (only for non-eyas drafts)"),
    engine: str = typer.Option(None, "--engine", help="sglang | vllm: the engine the command starts (checked)"),
    engine_version: str = typer.Option(None, "--engine-version", help="the engine's version (default: the one the "
                                       "export targets, else the newest eyas knows)"),
    json_out: bool = typer.Option(False, "--json", help="emit JSON"),
    command: list[str] = typer.Argument(None, help="after --: an SGLang launch command, a vLLM serve command, "
                                        "or a --speculative-config JSON"),
) -> None:
    """Lint SGLang/vLLM serving flags and a draft folder against what that engine version does with them, and print
    the corrected command (eyas/engines.py: the versioned table)."""
    from ..doctor.checklist import jsonable
    from ..doctor.flags import lint_serve_command, render_lint

    with user_errors():
        lint = lint_serve_command(list(command or []), draft, num_layers, engine, engine_version)
    if json_out:
        typer.echo(json.dumps(jsonable(lint.to_dict()), indent=2))
    else:
        render_lint(lint)
    raise typer.Exit(0 if lint.ok else 1)


@doctor_app.command("seal")
def doctor_seal(
    folder: Path = typer.Argument(..., help="a shard folder, or an eyas draft, export, checkpoint or n-gram table"),
) -> None:
    """Record the size and digest of each tensor file the artifact holds without one (written before eyas recorded
    them), so every later read verifies it. It records the files as they are now: seal only a copy you trust. Files
    already recorded are verified: one whose bytes no longer give its digest is named, with both digests (exit 2)."""
    from ..doctor.seal import seal

    with user_errors():
        done = seal(folder)
    typer.echo(f"sealed {len(done)} file(s) in {folder}: {', '.join(done)}" if done else
               f"{folder}: every tensor file already has a digest record, and its bytes still give it; nothing to do")


@doctor_app.command("streams")
def doctor_streams(
    url: str = typer.Option(..., "--url", help="the SGLang server, started with --enable-return-aux-hidden-states "
                            "--speculative-algorithm EAGLE3 [--return-aux-hidden-state-layer-ids ...]"),
    target: str = TargetOpt,
    draft: str = typer.Option(None, "--draft", help="eyas draft folder (or 'default'): PASS when the served streams "
                              "are the ones it was trained on"),
    prompts: int = typer.Option(4, "--prompts", help="prompts to send (1..8)"),
    max_new_tokens: int = typer.Option(8, "--max-new-tokens", help="max_new_tokens per request"),
    api_key: str = typer.Option(None, "--api-key", help="sent as 'Authorization: Bearer KEY'"),
    timeout: float = typer.Option(120.0, "--timeout", help="seconds per HTTP request"),
    json_out: bool = typer.Option(False, "--json", help="emit JSON"),
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
) -> None:
    """Which streams a live SGLang server feeds the draft: its returned aux states matched against the target's own
    streams (eyas stream indices). Exit 0 when every slot is named (and, with --draft, they are the trained ones)."""
    from ..doctor.aux_probe import probe_streams, render_streams, server_facts
    from ..draft import load_draft
    from ..target.open import TargetChoice

    with user_errors():
        server_facts(url, timeout, api_key)  # an unreachable URL fails before anything loads
        trained = list(load_draft(draft, device="cpu").layout.aux_indices) if draft else None
        tgt = TargetChoice(target, dtype, device, template_required=False).open()
        rep = probe_streams(url, tgt, trained, num_prompts=prompts, max_new_tokens=max_new_tokens, timeout=timeout,
                            api_key=api_key, log=None if json_out else (lambda m: typer.echo(m, err=True)))
    if json_out:
        typer.echo(json.dumps(rep.to_dict(), indent=2))
    else:
        render_streams(rep, typer.echo)
    raise typer.Exit(0 if rep.ok else 1)


@doctor_app.command("trace")
@config_options(EngineOptions, skip=("ngram", "weights", "draft_weights"))
def doctor_trace(
    draft: str = typer.Option(..., "--draft", help="eyas draft folder (or 'default')"),
    prompt: str = typer.Option(..., "--prompt", help="a user message (the chat template is applied)"),
    method: str = typer.Option("tree", "--method", help="tree | chain (the engine's own defaults otherwise)"),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens"),
    rounds: int = typer.Option(4, "--rounds", help="speculative rounds to show"),
    json_out: bool = typer.Option(False, "--json", help="emit JSON"),
    **given: Any,
) -> None:
    """One prompt through the real serving path: shape and norm per stage, draft top tokens, accepted tokens."""
    from ..doctor.trace import render_trace, trace
    from ..engine.load import EngineUse, check_options, load_parts
    from ..engine.params import TreeSettings
    from ..engine.prompt import input_ids

    if method not in ("tree", "chain"):
        fail(f"--method {method}: the trace follows a draft's rounds; use --method tree or chain")
    opts = config_from(EngineOptions, given, draft=draft, method=method)
    use = EngineUse("eyas doctor trace", "`eyas doctor --target T --draft D` (without trace) measures the draft on "
                    "this target through HF hooks")
    spec = TreeSettings().spec(method, None)  # the engine's full tree, not the device's pruned default
    with user_errors():
        parts = load_parts(opts, use, check_options(opts, use, [spec]), [spec])
        if parts.template_warning:
            warn(parts.template_warning)
        ids = input_ids(parts.target.tokenizer, prompt, None, opts.raw)
        assert parts.draft is not None  # tree and chain load a draft
        rep = trace(parts.target, parts.draft, ids, spec, max_new_tokens=max_new_tokens, max_rounds=rounds)
    if json_out:
        typer.echo(json.dumps(rep.to_dict(), indent=2))
    else:
        render_trace(rep)


@doctor_app.command("serving", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def doctor_serving(
    url: str = typer.Option(..., "--url", help="the running vLLM or SGLang server, e.g. http://127.0.0.1:8000"),
    draft: str = typer.Option(..., "--draft", help="the eyas draft the server's export was made from (or 'default')"),
    target: str = TargetOpt,
    rows_dir: Path = typer.Option(None, "--rows", help="replay rows (`eyas replay capture`) of this target; default: "
                                  "captured by eyas's engine on --bench / --prompts once, then cached"),
    export: Path = typer.Option(None, "--export", help="the folder the server loads as its draft: its d2t and weights "
                                "are checked directly, its config by `doctor flags`"),
    k: int = typer.Option(None, "--k", help="vLLM: the server's num_speculative_tokens (default: read from its "
                          "/metrics)"),
    sglang_shape: str = typer.Option(None, "--sglang", help="SGLang: its STEPS,TOPK,NUM_DRAFT_TOKENS (default: "
                                     "from its /server_info, else the launch command after --)"),
    prompts: int = typer.Option(4, "--prompts", help="MT-bench questions to send (first turn, stratified)"),
    bench_set: str = typer.Option("mt-bench", "--bench", help="mt-bench | humaneval | a JSONL of prompts"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="max_tokens per request (and for the replay)"),
    api_key: str = typer.Option(None, "--api-key", help="sent as 'Authorization: Bearer KEY'"),
    timeout: float = typer.Option(120.0, "--timeout", help="seconds per HTTP request"),
    json_out: bool = typer.Option(False, "--json", help="emit JSON"),
    device: str = DeviceOpt,
    command: list[str] = typer.Argument(None, help="after --: the server's launch command (vllm serve ..., python "
                                        "-m sglang.launch_server ...), linted by `doctor flags` first"),
) -> None:
    """Live check of a vLLM or SGLang server (which one is asked first): its speculative acceptance per position
    (vLLM's /metrics counters, SGLang's per-request counts) vs the replay of the same draft on the same prompts and
    draft shape; a failure names the cause. Exit 0 on pass, 1 on fail."""
    import sys

    from ..doctor.checklist import jsonable
    from ..doctor.serving import check_server, render_serving
    from ..replay.rows import load_rows
    from ..target.open import TargetChoice

    with user_errors():
        answer = _probe_engine(url, api_key, timeout, k, sglang_shape)
        say = None if json_out else (lambda m: typer.echo(m, err=True))
        if say:
            say(f"{url}: {answer.line()}")
        if rows_dir is not None:
            rows = load_rows(rows_dir)
            rows.head(prompts)
            tgt = TargetChoice(target, "fp32", device, template_required=False).open(load_weights=False)
            m = min(max_new_tokens, rows.max_new_tokens)
        else:
            rows, tgt = _fresh_rows(target, draft, bench_set, prompts, max_new_tokens, device, say)
            m = max_new_tokens
        if answer.name == "sglang":
            from ..doctor.sglang_counts import check_sglang

            rep = check_sglang(url, tgt, draft, rows, answer, sglang_shape, max_new_tokens=m, api_key=api_key,
                               timeout=timeout, export=export, command=list(command or []) or None, log=say)
        else:
            rep = check_server(url, tgt, draft, rows, k=k, max_new_tokens=m, api_key=api_key, timeout=timeout,
                               export=export, command=list(command or []) or None, log=say)
    if json_out:
        typer.echo(json.dumps(jsonable(rep.to_dict()), indent=2))
    else:
        render_serving(rep, typer.echo)
    sys.stdout.flush()
    raise typer.Exit(0 if rep.ok else 1)


def _probe_engine(url: str, api_key: str | None, timeout: float, k: int | None, sglang_shape: str | None):
    """Which engine answers (a bad or unreachable URL fails before anything loads), and for vLLM its counters
    read once so a wrong --k is refused now; the options of the other engine are refused in one line."""
    from ..doctor.server import ServerClient

    probe = ServerClient(url, api_key, timeout)
    try:
        answer = probe.engine()
        if answer.name == "sglang":
            if k is not None:
                fail(f"--k is vLLM's num_speculative_tokens, but {url} is SGLang: give --sglang STEPS,TOPK,"
                     "NUM_DRAFT_TOKENS or nothing (read from its /server_info)")
            return answer
        found = probe.counters()
    finally:
        probe.close()
    if sglang_shape is not None:
        fail(f"--sglang is for an SGLang server, but {url} is vLLM ({answer.line()}); drop it")
    if k is not None and k != found.k:
        fail(f"--k {k}, but the server drafts {found.k} tokens per round (its per-position counters); drop --k "
             f"or pass --k {found.k}")
    return answer


def _fresh_rows(target: str, draft: str, bench_set: str, prompts: int, max_new_tokens: int, device: str, say):
    """Rows captured by eyas's engine (fp32) for the first --prompts of --bench, cached after the first check."""
    from ..bench.prompts import load_prompts
    from ..draft import load_draft
    from ..engine.prompt import chat_input_ids
    from ..replay.rows import cached_rows_eyas, plant_streams
    from ..target.family import check_engine_family
    from ..target.open import TargetChoice

    check_engine_family(target, "eyas doctor serving without --rows",
                        "capture rows where the target runs (`eyas replay capture --engine vllm --out DIR`) and "
                        "pass --rows DIR")
    items = load_prompts(bench_set, limit=prompts)
    tgt = TargetChoice(target, "fp32", device).open()  # the prompts render with its template
    aux = list(load_draft(draft, device="cpu").layout.aux_indices)
    ids = [chat_input_ids(tgt.tokenizer, r.messages) for r in items]
    rows = cached_rows_eyas(tgt, ids, max_new_tokens, plant_streams(aux, tgt.num_layers),
                            source={"target": target, "bench": bench_set, "prompts": prompts, "engine": "eyas"},
                            log=say)
    return rows, tgt
