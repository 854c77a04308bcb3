"""eyas export and eyas import: drafts to and from SGLang/SpecForge, vLLM and speculators (eyas/interop)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from .common import DeviceOpt, DtypeOpt, TargetOpt, fail, user_errors


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

    from ..draft import load_draft
    from ..interop.export import (
        LaunchParams,
        check_export_target,
        export_draft,
        served_name,
        target_embeddings,
        vllm_cpu_command,
    )
    from ..vllm.env import vllm_python_path

    with user_errors():
        ckpt = load_draft(draft)
        if fmt != "speculators":  # speculators loads the target for its embeddings, and checks it there
            check_export_target(ckpt, target)
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
    for w in res.warnings:
        typer.echo(f"warning: {w}")
    typer.echo("launch:")
    typer.echo(f"  {res.launch}")
    py = vllm_python_path()
    cpu = vllm_cpu_command(res.launch, str(py) if py is not None else "python", served_name(res.manifest))
    if cpu is not None:
        typer.echo("or, with vLLM's CPU build on this machine (" + (f"{py}" if py is not None else
                   "`make vllm` builds it; its python") + ", sized to the memory free now):")
        typer.echo(f"  {cpu}")


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

    from ..interop.importer import check_import_options, import_draft
    from ..target.open import TargetChoice
    from ..text import parse_int_list

    with user_errors():
        idx = parse_int_list(aux_indices, "--aux-indices")
        ids = parse_int_list(aux_ids, "--aux-ids")
        check_import_options(fmt, idx, ids, ids_convention)  # before the target loads
        # layout inference renders chats with its template; a target without one is told by the inference
        tgt = TargetChoice(target, dtype, device, template_required=False).open()
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

