"""eyas replay (eyas/replay): capture a target's greedy replies and stream states once, then predict any draft's
serving acceptance on them with the draft alone."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from ..option import DEFAULT_TARGET
from .common import DeviceOpt, TargetOpt, fail, user_errors

replay_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True,
                         help="Serving acceptance replayed from captured features: capture rows, then replay a draft.")


@replay_app.command("capture")
def capture(
    out: Path = typer.Option(..., "--out", help="rows folder (written atomically)"),
    target: str = TargetOpt,
    bench_set: str = typer.Option("mt-bench", "--bench", help="mt-bench | humaneval | a JSONL of prompts"),
    prompts: int = typer.Option(8, "--prompts", help="prompts (first turns), as `eyas bench --limit` picks them"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", help="reply tokens per prompt: what the check will "
                                       "ask the server for (a replay may ask for fewer)"),
    draft: str = typer.Option(None, "--draft", help="capture the streams this draft reads, their neighbours and the "
                              "embedding (default: the target's EAGLE-3 default layout's)"),
    aux_indices: str = typer.Option(None, "--aux-indices", help="stream indices to plan for instead of --draft's"),
    engine: str = typer.Option("eyas", "--engine", help="who runs the target: eyas (fp32, its engine forward) | vllm "
                               "(a vLLM python: --vllm-python, $EYAS_VLLM_PYTHON or .venv-vllm)"),
    vllm_python: str = typer.Option(None, "--vllm-python", help="--engine vllm: the python of a vLLM environment"),
    vllm_dtype: str = typer.Option("float32", "--vllm-dtype", help="--engine vllm: float32 | bfloat16 | float16 (the "
                                   "server's dtype, for equal counts)"),
    device: str = DeviceOpt,
) -> None:
    """Capture replay rows: the target's greedy reply to each prompt (past its end token by a lookahead) and the
    stream states a draft and its planted faults read."""
    from ..bench.prompts import load_prompts
    from ..engine.prompt import chat_input_ids
    from ..replay.rows import capture_rows_eyas, capture_rows_vllm, plant_streams, rows_summary, save_rows
    from ..target.open import TargetChoice
    from ..text import parse_int_list

    if engine not in ("eyas", "vllm"):
        fail(f"--engine {engine!r}: expected eyas or vllm")
    if max_new_tokens < 1 or prompts < 1:
        fail(f"--max-new-tokens {max_new_tokens} and --prompts {prompts}: expected 1 or more")
    with user_errors():
        aux = parse_int_list(aux_indices, "--aux-indices")
        py = None
        if engine == "vllm":
            from ..vllm.env import vllm_python as find_vllm

            py = find_vllm(vllm_python, "replay capture --engine vllm")
        rows_in = load_prompts(bench_set, limit=prompts)
        tgt = TargetChoice(target, "fp32", device).open(load_weights=py is None)  # prompts render with its template
        if aux is None and draft is not None:
            from ..draft import load_draft

            aux = list(load_draft(draft, device="cpu").layout.aux_indices)
        streams = plant_streams(aux or tgt.default_layout().aux_indices, tgt.num_layers)
        ids = [chat_input_ids(tgt.tokenizer, r.messages) for r in rows_in]
        source = {"target": target, "bench": bench_set, "prompts": prompts, "engine": engine}
        say = lambda m: typer.echo(m, err=True)  # noqa: E731
        if py is None:
            rows = capture_rows_eyas(tgt, ids, max_new_tokens, streams, source=source, log=say)
        else:
            rows = capture_rows_vllm(py, tgt, ids, max_new_tokens, streams, out.parent / f".{out.name}.vllm",
                                     dtype=vllm_dtype, source=source, log=say)
        save_rows(rows, out)
    s = rows_summary(rows)
    typer.echo(f"{out}: {s['rows']} rows, {s['prompt_tokens']} prompt + {s['reply_tokens']} reply tokens, streams "
               f"{s['streams']}, {s['numerics']}")


@replay_app.command("run")
def run(
    rows_dir: Path = typer.Option(..., "--rows", help="rows folder from `eyas replay capture`"),
    draft: str = typer.Option(..., "--draft", help="eyas draft folder (or 'default')"),
    target: str = typer.Option(None, "--target", help="the rows' target (default: the one they were captured from); "
                               "only its tokenizer, config and embeddings are read"),
    k: int = typer.Option(None, "--k", help="a vLLM chain: num_speculative_tokens"),
    depth: int = typer.Option(None, "--depth", help="an eyas tree: depth"),
    topk: int = typer.Option(None, "--topk", help="an eyas tree: topk"),
    tokens: int = typer.Option(None, "--tokens", help="an eyas tree: tokens, root included"),
    lookup: int = typer.Option(0, "--lookup", help="an eyas tree: lookup candidates merged per round"),
    min_prob: float = typer.Option(0.0, "--min-prob", help="an eyas tree: min cumulative draft probability"),
    sglang: str = typer.Option(None, "--sglang", help="SGLang's flags as STEPS,TOPK,NUM_DRAFT_TOKENS (e.g. 3,4,8): "
                               "the accept length a correctly wired SGLang should log"),
    max_new_tokens: int = typer.Option(None, "--max-new-tokens", help="reply tokens (default: the rows')"),
    export: Path = typer.Option(None, "--export", help="with --k (vLLM) or --sglang: the folder the server loads; "
                                "its config.json is read as that engine reads it on the rows' target, and the "
                                "streams it would tap are replayed beside the trained ones"),
    engine_version: str = typer.Option(None, "--engine-version", help="with --export: the engine release whose "
                                       "id rule applies (default: the newest eyas read)"),
    json_out: bool = typer.Option(False, "--json", help="emit JSON"),
) -> None:
    """Replay a draft's greedy speculative decoding on rows: per-position accepted counts, drafts and τ, counted
    as vLLM's spec-decode metrics count them."""
    from ..draft import load_draft
    from ..replay import run as rr
    from ..replay.rows import load_rows
    from ..replay.served import served_streams
    from ..target.load import load_target

    with user_errors():
        spec = _serving_spec(k, sglang, depth, topk, tokens, lookup, min_prob)
        if export is None and engine_version is not None:
            fail("--engine-version applies to --export (the release whose id rule reads its config.json); add "
                 "--export DIR or drop --engine-version")
        if export is not None and k is None and sglang is None:
            fail("--export reads the folder as a server reads it: give --k N (vLLM) or --sglang S,K,N (SGLang)")
        rows = load_rows(rows_dir)
        tgt = load_target(target or rows.source.get("target") or DEFAULT_TARGET, dtype="fp32", load_weights=False)
        ck = load_draft(draft, device="cpu")
        res = rr.replay(rows, tgt, ck, spec, max_new_tokens)
        served, res_served = None, None
        if export is not None:
            trained = list(ck.layout.aux_indices)
            served = served_streams(export, "sglang" if sglang is not None else "vllm", tgt.num_layers,
                                    tgt.identity.architecture, engine_version, trained)
            if served.streams != trained:
                res_served = rr.replay(rows, tgt, ck, spec, max_new_tokens,
                                       plant=lambda c, L: setattr(c.layout, "aux_indices", list(served.streams)))
    if json_out:
        extra = {} if served is None else {"served": {"streams": served.streams, "reading": served.line,
                                                      **(res_served or res).to_dict()}}
        typer.echo(json.dumps({"rows": str(rows_dir), "draft": draft, "config": spec.describe(),
                               **res.to_dict(), **extra}, indent=2))
        return
    _render_run(spec, rows, res, sglang, served, res_served)


def _serving_spec(k, sglang, depth, topk, tokens, lookup, min_prob):
    """The one serving configuration given: a vLLM chain, an SGLang shape or an eyas tree."""
    from ..replay import run as rr
    from ..text import parse_int_list

    given = [x is not None for x in (k, sglang)] + [depth is not None or topk is not None or tokens is not None]
    if sum(given) != 1:
        fail("give one serving configuration: --k N (vLLM chain), --depth/--topk/--tokens (eyas tree) or --sglang "
             "STEPS,TOPK,NUM_DRAFT_TOKENS")
    if k is not None:
        spec = rr.chain(k)
    elif sglang is not None:
        v = parse_int_list(sglang, "--sglang") or []
        if len(v) != 3:
            fail(f"--sglang {sglang!r}: expected STEPS,TOPK,NUM_DRAFT_TOKENS, e.g. 3,4,8")
        spec = rr.sglang(*v)
    else:
        if None in (depth, topk, tokens):
            fail("an eyas tree needs --depth, --topk and --tokens")
        spec = rr.tree(depth, topk, tokens, lookup, min_prob)
    spec.check()
    return spec


def _render_run(spec, rows, res, sglang, served, res_served) -> None:
    typer.echo(f"{spec.describe()} on {len(res.rows)} rows x {res.max_new_tokens} tokens ({rows.numerics})")
    typer.echo(f"  drafts {res.rounds}, accepted per position {res.per_pos}, rate "
               f"[{', '.join(f'{r:.2f}' for r in res.rates)}]")
    typer.echo(f"  tau {res.tau:.3f} (1 + accepted per draft: vLLM's mean acceptance length, SGLang's accept length)"
               f"; committed tokens per round {res.tau_committed:.3f}")
    if sglang is not None:
        s = [int(x) for x in sglang.split(",")]
        typer.echo(f"  a correctly wired SGLang with --speculative-num-steps {s[0]} --speculative-eagle-topk {s[1]} "
                   f"--speculative-num-draft-tokens {s[2]} should log an accept length near {res.tau:.2f} on these "
                   "prompts at temperature 0")
    if served is not None:
        typer.echo(f"  served: {served.line}")
        if res_served is not None:
            typer.echo(f"  as served: accepted per position {res_served.per_pos}, tau {res_served.tau:.3f} (against "
                       f"{res.tau:.3f} wired as trained): fix the export's ids (`eyas export`) before serving it")
