"""`eyas import`: take SGLang/SpecForge, vLLM, speculators and EAGLE reference drafts back as eyas drafts.

Import translates the checkpoint's ids into stream indices (what each format's ids mean:
eyas/conventions.py), checks every shape against the target, and writes an eyas draft whose manifest records
how the layout was decided. When the ids are missing or ambiguous it runs the layout inference the doctor runs
too (eyas.probe.infer_layout), and otherwise refuses, naming the readings and the flags that pick one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch
from safetensors.torch import load_file

from .. import __version__
from ..conventions import ID_CONVENTIONS, IMPORT_FORMATS, IdsFound, from_engine_ids, read_ids
from ..draft import MANIFEST, DraftCheckpoint, DraftConfig, Eagle3Draft, load_draft, save_draft
from ..files import check_file, note_unverified, portable_command
from ..id_readings import Readings, id_readings
from ..layout import Layout, LayoutError
from ..metadata import DRAFT_CONFIG, EXPORT_MANIFEST, read_metadata
from ..probe import infer_layout, layout_candidates
from .export import ExportError, check_out, sha256_of
from .formats import check_vocab_map, detect_format, draft_config_from, explain_unexpected, to_eyas_names


@dataclass
class Foreign:
    """What a foreign folder holds, read but not yet interpreted."""
    config: dict[str, Any]
    weights: dict[str, torch.Tensor]
    weight_files: list[str]
    eyas_export: dict[str, Any] | None  # the eyas-export manifest, when eyas wrote the folder


def read_folder(src: str | Path, allow_pickle: bool = False) -> Foreign:
    p = Path(src)
    if not p.is_dir():
        raise ExportError(f"{src} is not a folder; expected a draft checkpoint folder with config.json")
    cfg_path = p / "config.json"
    if not cfg_path.exists():
        raise ExportError(f"{p} has no config.json; an EAGLE-3 draft folder holds config.json plus weights")
    config = read_metadata(cfg_path, DRAFT_CONFIG, ExportError, "the checkpoint is corrupt")
    man = None
    if (p / MANIFEST).exists():
        man = read_metadata(p / MANIFEST, EXPORT_MANIFEST, ExportError, "delete it to import by config alone")
        if man["kind"] == "eyas-draft":
            raise ExportError(f"{p} is already an eyas draft (kind eyas-draft); use it directly, no import needed")
        if man["kind"] != "eyas-export":
            man = None
    # an eyas export records each tensor file's size and digest: a damaged one is named before it is read (a
    # foreign folder records none and is read as it is)
    if man is not None and not man.get("files"):
        note_unverified(f"the export {p}", p)
    for name, rec in ((man or {}).get("files") or {}).items():  # names: files inside p (the schema)
        check_file(p / name, rec, ExportError, "the export is damaged: copy it again, or rerun `eyas "
                   "export`")
    weights: dict[str, torch.Tensor] = {}
    files = sorted(p.glob("*.safetensors"))
    if files:
        for f in files:
            try:
                weights.update(load_file(str(f)))
            except Exception as e:  # safetensors raises several types on corrupt headers
                raise ExportError(f"{f} is not a readable safetensors file ({e}); the checkpoint is corrupt") from e
    else:
        # the model's weights, not a trainer's leftovers (training_args.bin, optimizer.pt, rng_state.pth, ...)
        pickles = sorted(p.glob("pytorch_model*.bin")) or sorted(
            f for f in [*p.glob("*.bin"), *p.glob("*.pt"), *p.glob("*.pth")]
            if not f.name.startswith(("training_args", "optimizer", "scheduler", "rng_state", "trainer_state")))
        if not pickles:
            raise ExportError(f"{p} holds no weights (*.safetensors, or pickled *.bin/*.pt)")
        if not allow_pickle:
            raise ExportError(f"{p} holds only pickled weights ({', '.join(f.name for f in pickles)}); eyas does not "
                              "unpickle by default. If you trust the file, pass --allow-pickle (loaded with "
                              "torch.load(weights_only=True)), or convert it to safetensors first")
        for f in pickles:
            try:
                obj = torch.load(f, map_location="cpu", weights_only=True)
            except Exception as e:
                raise ExportError(f"{f}: torch.load(weights_only=True) refused it ({e})") from e
            if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
                raise ExportError(f"{f} is not a state dict of tensors")
            weights.update(obj)
        files = pickles
    return Foreign(config=config, weights=weights, weight_files=[f.name for f in files], eyas_export=man)


def run_inference(target, model: Eagle3Draft, candidates: dict[str, list[int]] | None, recorded: list[int] | None,
                  samples: list | None = None) -> dict[str, Any] | None:
    """The layout inference `eyas doctor` runs too (eyas.probe.infer_layout: step-0 held-out loss and accuracy of
    the draft on features the target produces under each candidate layout). `candidates` None lets it search
    around `recorded` (shifts, the embedding, permutations). `samples`: token-id tensors to measure on; None = a
    few chat conversations through the target's tokenizer.
    Adds `confident`: whether the best candidate beats the runner-up clearly enough to decide on."""
    try:
        if candidates is None:  # import needs an aux layout: the doctor's final-state-only candidate is no answer
            L = target.identity.num_layers
            candidates = {lab: idx for idx, lab in layout_candidates(recorded, L, model.config.num_aux) if idx}
        ranking = infer_layout(target, model, samples, candidates=candidates, recorded=recorded)
    except Exception as e:  # the doctor measures through the target; any failure there must stop the import
        raise ExportError(f"layout inference failed ({type(e).__name__}: {e}); pass the layout explicitly "
                          "(--aux-ids with --ids-convention, or --aux-indices), or --no-infer") from e
    d = ranking.to_dict()
    table = [r for r in d["table"] if r["accuracy"] is not None]
    none = {"margin_points": None, "margin_loss": None, "se_loss": None}
    if not table:
        return {**d, "confident": False, **none}
    best = table[0]
    out = {**d, "chosen": best["label"], "aux_indices": best["indices"], "accuracy": best["accuracy"], **none}
    if len(table) == 1:
        return {**out, "confident": bool(best["indices"])}
    # the doctor's rule: the runner-up's held-out loss is worse beyond noise (eyas.probe.LayoutRanking.worse)
    worse, diff, se = ranking.worse(table[1]["indices"], best["indices"])
    a, b = best["accuracy"], table[1]["accuracy"]
    out.update(margin_points=round(100.0 * (a - b), 2))
    if math.isnan(diff):
        return {**out, "confident": False}
    out.update(margin_loss=round(diff, 4), se_loss=round(se, 4))
    return {**out, "confident": bool(best["indices"]) and worse}


@dataclass
class ImportResult:
    path: Path
    checkpoint: DraftCheckpoint
    info: dict[str, Any]
    warnings: list[str] = field(default_factory=list)


def _decide_layout(readings: Readings, foreign: Foreign, found: IdsFound, aux_indices: list[int] | None,
                   aux_ids: list[int] | None, ids_convention: str | None, L: int,
                   warnings: list[str]) -> tuple[list[int] | None, str | None]:
    """(stream indices, what decided them) by precedence: explicit flags > the eyas-export manifest > an
    unambiguous reading of the config ids; (None, None) when only inference or the user can decide."""
    decided_by, stream = None, None
    if aux_indices is not None or aux_ids is not None:
        try:
            if aux_indices is not None:
                stream = list(aux_indices)
            else:
                assert aux_ids is not None and ids_convention is not None  # the if above; check_import_options
                stream = from_engine_ids(aux_ids, ids_convention, L)
        except LayoutError as e:
            raise ExportError(str(e)) from e
        decided_by = ("--aux-indices" if aux_indices is not None
                      else f"--aux-ids {aux_ids} --ids-convention {ids_convention}")
        others = {n: s for n, s in readings.candidates.items() if s != stream}
        if others and readings.preferred is not None and readings.preferred in others:
            warnings.append(f"your override stream {stream} differs from the config's {readings.preferred} reading "
                            f"{readings.candidates[readings.preferred]}; using your override")
    elif foreign.eyas_export is not None:
        stream = list(foreign.eyas_export["layout"]["aux_indices"])
        decided_by = "eyas export manifest"
        pref = readings.candidates.get(readings.preferred) if readings.preferred else None
        if pref is not None and pref != stream:
            raise ExportError(f"the config's ids ({found.to_dict()}) read as {readings.preferred} give stream {pref}, "
                              f"but the eyas export manifest says stream {stream}: the folder was edited after "
                              "export. Re-export it, or delete eyas_manifest.json to import by the config alone")
    elif not readings.ambiguous and len(readings.candidates) == 1:
        (decided_by, stream), = readings.candidates.items()
    elif not readings.ambiguous and readings.preferred is not None:
        decided_by, stream = readings.preferred, readings.candidates[readings.preferred]

    return stream, decided_by


def check_import_options(fmt: str, aux_indices: list[int] | None, aux_ids: list[int] | None,
                         ids_convention: str | None) -> None:
    """Option errors, raised before any target is loaded."""
    if fmt not in IMPORT_FORMATS:
        raise ExportError(f"--format {fmt!r}: expected one of {', '.join(IMPORT_FORMATS)}")
    if aux_indices is not None and aux_ids is not None:
        raise ExportError("pass either --aux-indices (eyas stream indices) or --aux-ids with --ids-convention")
    if aux_ids is not None and ids_convention is None:
        raise ExportError("--aux-ids needs --ids-convention (one of " + ", ".join(ID_CONVENTIONS) + "): the same "
                          "numbers mean different layers in SGLang (output-of) and vLLM (input-of)")
    if ids_convention is not None and ids_convention not in ID_CONVENTIONS:
        raise ExportError(f"--ids-convention {ids_convention!r}: expected one of {', '.join(ID_CONVENTIONS)}")


def _num_aux(sd: dict[str, torch.Tensor], foreign: Foreign, src: str | Path, Ht: int) -> int:
    """How many aux states fc takes, from its input width and the target's hidden size."""
    if "fc.weight" not in sd:
        raise ExportError(f"{src}: no fc.weight among the weights ({sorted(foreign.weights)[:10]}...); "
                          "not an EAGLE-3 draft")
    fc_in = int(sd["fc.weight"].shape[1])
    declared = foreign.config.get("target_hidden_size")  # top level in every format
    if declared is not None and int(declared) != Ht:
        raise ExportError(f"the draft declares target_hidden_size {declared} but the target's hidden size is {Ht}: "
                          "it was trained for another target")
    if fc_in % Ht:
        raise ExportError(f"fc.weight takes {fc_in} inputs, not a multiple of the target's hidden size {Ht}: this "
                          "draft was trained for another target (fc input = n_aux x target hidden)")
    return fc_in // Ht


def _build_draft(cfg: DraftConfig, sd: dict[str, torch.Tensor], extra: dict[str, torch.Tensor], emb: torch.Tensor,
                 V: int, notes: list[str], warnings: list[str]) -> Eagle3Draft:
    """eyas's draft with the foreign weights, the checked vocabulary map and the target's embeddings."""
    if emb.shape[1] != cfg.hidden_size:
        raise ExportError(f"draft hidden_size {cfg.hidden_size} but the target's embeddings are {emb.shape[1]} wide; "
                          "the draft reuses the target's token embeddings, so they must match")
    ids = check_vocab_map(sd.pop("d2t", None), sd.get("t2d"), V, cfg.draft_vocab_size)
    sd.pop("t2d", None)
    model = Eagle3Draft(cfg)
    expected = {k for k in model.state_dict() if k not in ("d2t", "t2d")}
    missing, unexpected = sorted(expected - set(sd)), sorted(set(sd) - expected)
    if missing or unexpected:
        raise ExportError(f"weights do not fit eyas's EAGLE-3 draft: missing {missing[:8]}, unexpected "
                          f"{unexpected[:8]}. {explain_unexpected(unexpected)}".strip())
    with torch.no_grad():
        for k, p in model.state_dict().items():
            if k in sd:
                if tuple(sd[k].shape) != tuple(p.shape):
                    raise ExportError(f"{k}: shape {tuple(sd[k].shape)}, config implies {tuple(p.shape)}")
                p.copy_(sd[k].float())
    model.set_vocab_map(ids)
    model.set_embeddings(emb.detach().float().cpu())
    if "embed_tokens.weight" in extra:
        e = extra["embed_tokens.weight"]
        if tuple(e.shape) != tuple(emb.shape):
            warnings.append(f"the checkpoint's embed_tokens {tuple(e.shape)} differ in shape from the target's "
                            f"{tuple(emb.shape)}; eyas uses the target's")
        else:
            d = float((e.float() - emb.detach().float().cpu()).abs().max())
            notes.append(f"checkpoint embed_tokens vs target embeddings: max |diff| {d:.3g}")
            if d > 1e-2 * max(1.0, float(emb.detach().float().abs().max())):
                warnings.append(f"the checkpoint's embed_tokens differ from the target's (max |diff| {d:.3g}): it "
                                "was trained with another embedding table; eyas uses the target's")
    model.eval()
    return model


def _inference(target, model: Eagle3Draft, readings: Readings, found: IdsFound, n_aux: int,
               samples: list | None) -> dict[str, Any] | None:
    """The doctor's layout inference over the readings with the draft's number of aux states; with no ids at all,
    its search around the reference default. None when there is nothing to rank."""
    ids_missing = found.top is None and found.eagle_config is None
    cands = {n: s for n, s in readings.candidates.items() if len(s) == n_aux}
    if not (cands or ids_missing):
        return None
    return run_inference(target, model, None if ids_missing else cands, recorded=next(iter(cands.values()), None),
                         samples=samples)


def _as_captured(stream: list[int], decided_by: str, n_aux: int, notes: list[str]) -> list[int]:
    """The stream as the engine fed fc: each layer once, in ascending order (unless the user or the doctor chose
    the order, which then names fc's blocks as they are)."""
    if len(set(stream)) != len(stream):
        raise ExportError(f"the layout {stream} repeats a stream index: engines capture each layer once per forward, "
                          f"so they would feed fc fewer than the {n_aux} states it takes; the config's ids are wrong")
    if stream != sorted(stream) and not decided_by.startswith(("--aux-indices", "doctor inference")):
        notes.append(f"ids listed as stream {stream}: engines concatenate captured states in ascending layer order, "
                     f"so fc's input blocks are read as stream {sorted(stream)}")
        return sorted(stream)
    return stream


def _refuse_undecided(why: str, found: IdsFound, readings: Readings, inference: dict[str, Any] | None,
                      infer: bool) -> NoReturn:
    """No layout could be decided: name every reading, what inference found, and the flags that pick one."""
    lines = [f"cannot tell which target layers this draft reads ({why}; ids found: {found.to_dict()})."]
    lines += [f"  - {n}: stream {s}" for n, s in readings.candidates.items()]
    lines += [f"  note: {n}" for n in readings.notes]
    if inference is not None:
        lines.append(f"Layout inference did not separate them (held-out loss margin {inference['margin_loss']} "
                     f"nats, paired standard error {inference['se_loss']} on {inference.get('tokens')} tokens):")
        lines += [f"  accuracy {r['accuracy']}  loss {r['loss']}  {r['label']}" for r in inference["table"][:6]]
    else:
        lines.append("Layout inference (eyas.probe.infer_layout) " + (
            "had no reading with the draft's number of aux states to rank" if infer
            else "is disabled (--no-infer)") + ".")
    lines.append("Pick the layout explicitly: --format sglang|vllm|eagle if you know where the draft was trained, "
                 "or --aux-ids 1,14,26 --ids-convention sglang, or --aux-indices (eyas stream indices).")
    raise ExportError("\n".join(lines))


def import_draft(src: str | Path, target, out: str | Path, fmt: str = "auto", allow_pickle: bool = False,
                 aux_indices: list[int] | None = None, aux_ids: list[int] | None = None,
                 ids_convention: str | None = None, infer: bool = True, infer_samples: list | None = None,
                 command: str | None = None) -> ImportResult:
    """A foreign draft folder -> an eyas draft at `out` for `target` (a loaded eyas Target).
    Precedence for the layout: --aux-indices / --aux-ids (explicit) > the eyas-export manifest > the format's
    reading of the config ids when unambiguous > the doctor's inference; anything else is an error."""
    check_import_options(fmt, aux_indices, aux_ids, ids_convention)
    ident = target.identity
    L, Ht, V = ident.num_layers, ident.hidden_size, ident.vocab_size
    check_out(Path(out), "eyas-draft", Path(src))
    foreign = read_folder(src, allow_pickle)
    warnings: list[str] = []
    notes: list[str] = []

    explicit_format = fmt != "auto"
    if fmt == "auto":
        if foreign.eyas_export is not None:
            fmt, why = foreign.eyas_export.get("format", "auto"), "eyas export manifest"
        else:
            fmt, why = detect_format(foreign.config)
    else:
        why = "--format"
    found = read_ids(foreign.config)

    sd, extra = to_eyas_names(foreign.weights)
    n_aux = _num_aux(sd, foreign, src, Ht)

    # -- the layout: explicit > eyas manifest > unambiguous config ids > inference
    readings = id_readings(found, "sglang" if fmt == "specforge" else fmt, L, explicit_format)
    notes += readings.notes
    stream, decided_by = _decide_layout(readings, foreign, found, aux_indices, aux_ids, ids_convention, L, warnings)
    if n_aux != (len(stream) if stream is not None else n_aux):
        assert stream is not None  # the condition
        raise ExportError(f"fc.weight takes {n_aux} x {Ht} inputs but the layout has {len(stream)} indices {stream}")
    cfg = draft_config_from(foreign.config, sd, n_aux, notes)
    if cfg.target_hidden_size != Ht:
        raise ExportError(f"config target_hidden_size {cfg.target_hidden_size} but the target's hidden size is {Ht}")
    if cfg.vocab_size != V:
        raise ExportError(f"config vocab_size {cfg.vocab_size} but the target's vocabulary has {V} tokens: the draft "
                          "was made for another model or tokenizer")
    model = _build_draft(cfg, sd, extra, target.embed_tokens().weight, V, notes, warnings)

    inference = None
    if infer and (readings.ambiguous or stream is None or len(readings.candidates) > 1):
        inference = _inference(target, model, readings, found, n_aux, infer_samples)
    if inference is not None:
        best: Any  # the chosen stream indices when inference is confident
        chosen, best = inference.get("chosen"), inference.get("aux_indices")
        if stream is None and inference["confident"]:
            stream, decided_by = list(best), f"doctor inference: {chosen}"
        elif stream is not None and inference["confident"] and list(best) != stream:
            warnings.append(f"layout inference prefers {chosen} (accuracy {inference['accuracy']:.3f}) over the "
                            f"stream {stream} from {decided_by}; check the table in the manifest")
    if stream is None:
        _refuse_undecided(why, found, readings, inference, infer)
    if readings.ambiguous and inference is None and decided_by and not decided_by.startswith("--"):
        warnings.append(f"the ids were ambiguous; using {decided_by} because you passed --format {fmt}")
    assert decided_by is not None  # set with stream
    stream = _as_captured(stream, decided_by, n_aux, notes)
    layout = Layout(aux_indices=stream, target=ident)
    info = {"source": str(src), "format": fmt, "format_detected_by": why, "weight_files": foreign.weight_files,
            "source_config_sha256": sha256_of(Path(src) / "config.json"), "ids_found": found.to_dict(),
            "readings": readings.candidates, "ambiguous": readings.ambiguous, "decided_by": decided_by,
            "aux_indices": stream, "inference": inference, "notes": notes, "warnings": warnings,
            "dropped_target_owned": sorted(extra)}
    extra_manifest = {"import": info, "target_source": target.source,
                      "commands": [command or portable_command()], "eyas_version": __version__}
    out = Path(out)
    save_draft(out, model, layout, extra=extra_manifest)
    ckpt = load_draft(out)
    return ImportResult(path=out, checkpoint=ckpt, info=info, warnings=warnings)
