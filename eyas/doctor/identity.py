"""The doctor's checks that need no target forward: identity (target, hidden size, vocabulary map) and the
draft's config.json as SGLang and vLLM read it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..draft import DraftCheckpoint
from ..engine_views import config_fix, engine_views
from ..layout import layout_diff
from ..metadata import DRAFT_CONFIG, read_metadata
from ..probe import FINAL_ONLY
from .checklist import Check, DoctorError

# ---- 1. identity: no compute ----------------------------------------------------------------------

def check_identity(target, ckpt: DraftCheckpoint, quick: bool = False) -> list[Check]:
    """target_identity, hidden_size, vocab_map, config_hidden, config_ids. quick: no measured checks follow
    (`eyas doctor --quick`), so a fix may not point at them."""
    return [_check_target_identity(target, ckpt, quick), _check_hidden(target, ckpt), _check_vocab(target, ckpt),
            *_check_engine_config(target, ckpt)]


def _check_target_identity(target, ckpt: DraftCheckpoint, quick: bool = False) -> Check:
    lay, now = ckpt.layout, target.identity
    if lay.target is None:
        return Check("target_identity", "warn", "the draft records no target identity; cannot tell which target "
                     "it was trained for", fix="retrain or import it with this eyas (`eyas import`)")
    # the target fields only: the recorded aux ids may not even fit this target (checked below)
    diffs = [d for d in layout_diff(lay, target.default_layout()) if d[0].startswith("target.")]
    nums = {"recorded": lay.target.to_dict(), "now": now.to_dict()}
    bad = [k for k in lay.aux_indices if not 0 <= k <= now.num_layers]
    if bad:
        diffs.append(("aux_indices", lay.aux_indices, f"outside 0..{now.num_layers}"))
    if not diffs:
        return Check("target_identity", "pass", f"same target: {now.architecture}, {now.num_layers} layers, hidden "
                     f"{now.hidden_size}, vocab {now.vocab_size}, weights {now.fingerprint}", numbers=nums)
    details = [f"{n}: recorded {a!r}, now {b!r}" for n, a, b in diffs]
    if [d[0] for d in diffs] == ["target.fingerprint"]:
        return Check("target_identity", "fail",
                     f"the target's weights changed: re-quantized or another file (fingerprint {diffs[0][1]} at "
                     f"training, {diffs[0][2]} now; architecture, layers, hidden and vocab all match)",
                     numbers=nums, details=details,
                     fix="serve the exact target file the draft was trained on, or re-capture data on this target "
                         "and retrain; " + ("run `eyas doctor` without --quick: its accuracy and norms checks "
                                            "measure how much it matters" if quick else
                                            "the accuracy and norms checks below measure how much it matters"))
    return Check("target_identity", "fail", "the draft was made for another model: " + "; ".join(details),
                 numbers=nums, details=details, fix="use the draft's own target, or train a draft for this one")


def _check_hidden(target, ckpt: DraftCheckpoint) -> Check:
    c = ckpt.model.config
    Ht = target.hidden_size
    fc_in = int(ckpt.model.fc.weight.shape[1])
    emb_w = int(target.embed_tokens().weight.shape[1])
    nums = {"target_hidden": Ht, "draft_target_hidden_size": c.target_hidden_size, "num_aux": c.num_aux,
            "fc_in": fc_in, "draft_hidden": c.hidden_size, "target_embedding_width": emb_w}
    problems = []
    if fc_in != c.num_aux * Ht:
        problems.append(f"fc takes {fc_in} inputs but the target gives {c.num_aux} x {Ht} = {c.num_aux * Ht}")
    if c.target_hidden_size != Ht:
        problems.append(f"the draft was built for target hidden {c.target_hidden_size}, this target has {Ht}")
    if c.hidden_size != emb_w:
        problems.append(f"draft hidden {c.hidden_size} != target embedding width {emb_w}: eyas's draft shares the "
                        "target's token embeddings, so it cannot run on this target")
    if problems:
        return Check("hidden_size", "fail", "; ".join(problems), numbers=nums,
                     fix="use the draft's own target, or train a draft for this one")
    return Check("hidden_size", "pass", f"fc input {fc_in} = {c.num_aux} x target hidden {Ht}; draft hidden "
                 f"{c.hidden_size} = target embedding width", numbers=nums)


def _check_vocab(target, ckpt: DraftCheckpoint) -> Check:
    m, c = ckpt.model, ckpt.model.config
    V, Vd = target.identity.vocab_size, c.draft_vocab_size
    d2t, t2d = m.d2t.detach().cpu().long(), m.t2d.detach().cpu().bool()
    ids = torch.arange(Vd) + d2t  # target id of each draft id
    nums: dict[str, Any] = {"target_vocab": V, "draft_vocab": Vd, "draft_config_vocab": c.vocab_size,
                            "t2d_sum": int(t2d.sum()), "t2d_len": int(t2d.numel())}
    problems, fixes = [], []
    if c.vocab_size != V or t2d.numel() != V:
        problems.append(f"the draft was built for a {c.vocab_size}-token vocabulary (t2d over {t2d.numel()}), "
                        f"the target has {V}")
        fixes.append("use the draft's own target")
    out_of_range = ((ids < 0) | (ids >= V)).nonzero().flatten()
    nums["d2t_out_of_range"] = int(out_of_range.numel())
    if out_of_range.numel():
        i = int(out_of_range[0])
        problems.append(f"{out_of_range.numel()} draft ids map outside 0..{V - 1} (draft id {i} -> {int(ids[i])})")
    ok_ids = ids.clamp(0, max(V - 1, 0))
    dup = Vd - int(ok_ids.unique().numel())
    nums["d2t_duplicates"] = dup
    if dup:
        problems.append(f"{dup} draft ids map to a target id another draft id already has")
    if t2d.numel() == V and not out_of_range.numel():
        unmarked = int((~t2d[ids]).sum())
        extra = int(t2d.sum()) - (Vd - unmarked)
        nums.update(d2t_targets_not_in_t2d=unmarked, t2d_ids_not_in_d2t=extra)
        if int(t2d.sum()) != Vd:
            problems.append(f"t2d marks {int(t2d.sum())} target ids but the draft vocabulary has {Vd}")
        if unmarked:
            problems.append(f"{unmarked} of {Vd} draft ids map (d2t) to target ids that t2d does not mark, and t2d "
                            f"marks {extra} ids no draft id maps to: d2t and t2d come from different vocabulary "
                            "selections (a stale mapping)")
    if problems and not fixes:
        fixes.append("rebuild d2t and t2d from the vocabulary the draft was trained with (Eagle3Draft.set_vocab_map) "
                     "or retrain; SGLang/vLLM map proposals through d2t, so a stale d2t proposes wrong tokens")
    rec = (ckpt.manifest.get("draft_vocab") or {}).get("hash")
    if rec and not out_of_range.numel():
        from ..vocab import vocab_hash

        now_hash = vocab_hash(ids)
        nums.update(recorded_hash=rec, hash_now=now_hash)
        if now_hash != rec:
            problems.append(f"the draft vocabulary (d2t) hashes to {now_hash}, not the {rec} recorded at training: "
                            "the lm_head's rows are mapped to other tokens than it learned (a stale mapping)")
            fixes.append("restore d2t/t2d from the training run's checkpoint")
    if problems:
        return Check("vocab_map", "fail", "; ".join(problems), numbers=nums, fix="; ".join(dict.fromkeys(fixes)))
    return Check("vocab_map", "pass", f"{Vd} draft ids map to distinct target ids in range; t2d marks exactly "
                 "them" + ("; same vocabulary as at training (hash)" if rec else ""), numbers=nums)


def read_config(ckpt: DraftCheckpoint) -> dict[str, Any] | None:
    """The draft folder's config.json (what SGLang and vLLM read); None when the draft has no folder or no config."""
    if ckpt.path is None or not (Path(ckpt.path) / "config.json").is_file():
        return None
    path = Path(ckpt.path) / "config.json"
    return read_metadata(path, DRAFT_CONFIG, DoctorError, "write it again (`eyas export` writes the config engines "
                         "read) or remove it")


def _check_engine_config(target, ckpt: DraftCheckpoint) -> list[Check]:
    cfg = read_config(ckpt)
    if cfg is None:
        why = "the draft has no folder" if ckpt.path is None else f"{ckpt.path} has no config.json"
        return [Check("config_hidden", "skip", f"{why}: nothing for SGLang/vLLM to read"),
                Check("config_ids", "skip", f"{why}: nothing for SGLang/vLLM to read")]
    Ht, nA = target.hidden_size, ckpt.model.config.num_aux
    th, h = cfg.get("target_hidden_size"), cfg.get("hidden_size")
    nums = {"target_hidden_size": th, "hidden_size": h, "target_hidden": Ht}
    # sglang/srt/models/llama_eagle3.py and vllm's llama_eagle3.py: fc = Linear(3 * (target_hidden_size if
    # present else hidden_size), hidden_size) — a missing key silently means "the draft's own hidden size".
    if th is None:
        used = h if h is not None else "?"
        if h == Ht:
            hidden = Check("config_hidden", "warn", f"config.json has no target_hidden_size; SGLang/vLLM fall back "
                           f"to hidden_size {h}, which equals the target hidden {Ht} (harmless here, wrong the day "
                           "the sizes differ)", numbers=nums, fix=f'add "target_hidden_size": {Ht} to config.json')
        else:
            hidden = Check("config_hidden", "fail", f"config.json has no target_hidden_size and hidden_size {used} != "
                           f"target hidden {Ht}: SGLang/vLLM build fc for {nA} x {used} inputs while the target "
                           f"feeds {nA} x {Ht} (the server fails to load or computes garbage)", numbers=nums,
                           fix=f'add "target_hidden_size": {Ht} to config.json')
    elif th != Ht:
        hidden = Check("config_hidden", "fail", f"config.json target_hidden_size {th} != target hidden {Ht}",
                       numbers=nums, fix=f'set "target_hidden_size": {Ht} (or use the draft\'s own target)')
    else:
        hidden = Check("config_hidden", "pass", f"config.json target_hidden_size {th} = target hidden", numbers=nums)
    return [hidden, _check_config_ids(cfg, ckpt.layout.aux_indices, target.num_layers, target.identity.architecture)]


def _check_config_ids(cfg: dict[str, Any], trained: list[int], L: int, architecture: str | None) -> Check:
    """architecture: the target's model class, whose rule decides what SGLang's ids mean (eyas/aux_rules.py)."""
    lines, worst, fixes = [], "pass", []
    views_out: dict[str, Any] = {}
    for eng in ("sglang", "vllm"):
        views = engine_views(cfg, eng, L, architecture=architecture)
        views_out[eng] = [{"indices": v.indices, "source": v.source, "when": v.when} for v in views]
        bad = [v for v in views if v.indices != list(trained)]
        for v in views:
            got = FINAL_ONLY if v.indices is None else f"stream {v.indices}"
            mark = "ok" if v not in bad else "WRONG"
            lines.append(f"{eng}{' (' + v.when + ')' if v.when else ''}: {v.source} -> {got} [{mark}]")
        if bad:
            sev = "fail" if len(bad) == len(views) or any(v.indices is None for v in bad) else "warn"
            worst = "fail" if "fail" in (worst, sev) else sev
            fixes.append(config_fix(eng, list(trained), L, architecture))
    nums = {"trained": list(trained), "views": views_out}
    if worst == "pass":
        return Check("config_ids", "pass", f"SGLang and vLLM both capture the trained stream {list(trained)} from "
                     "config.json", numbers=nums, details=lines)
    wrong = [ln for ln in lines if ln.endswith("[WRONG]")]
    return Check("config_ids", worst, f"config.json makes an engine capture other layers than the trained stream "
                 f"{list(trained)}: " + wrong[0].removesuffix(" [WRONG]")
                 + (" (depends on the engine version)" if worst == "warn" else ""),
                 numbers=nums, details=lines, fix="; ".join(fixes))
