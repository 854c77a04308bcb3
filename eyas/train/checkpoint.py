"""Training state on disk: OUT/checkpoint (draft + optimizer + RNG + cursor, swapped in atomically) and what
--resume and --init-from read back (refusing a checkpoint made for other data, target or options)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..draft import MANIFEST as DRAFT_MANIFEST
from ..draft import WEIGHTS, Eagle3Draft, save_draft
from ..files import (
    atomic_write_json,
    atomic_write_text,
    check_file,
    file_record,
    swap_folder,
    write_fault,
)
from ..layout import Layout, check_layouts
from ..metadata import CHECKPOINT_MANIFEST, TRAINER_STATE, read_metadata
from ..vocab import DraftVocab
from .config import OPT_FILE, RNG_FILE, STATE_FILE, TrainConfig, TrainError


def warm_start(cfg: TrainConfig, layout: Layout, counts: torch.Tensor,
               fresh: DraftVocab | None = None) -> tuple[Eagle3Draft, DraftVocab]:
    """--init-from: the draft's fp32 weights and its draft vocabulary (so more data continues the same head);
    refused when its layout or shape does not fit these shards and options. fresh (--refresh-vocab): the
    vocabulary chosen from this data instead; lm_head rows of tokens in both are kept, rows of new tokens start
    at the mean of the old rows (an average logit), rows of dropped tokens go."""
    from ..draft import DraftError, load_draft

    assert cfg.init_from is not None  # called for --init-from only (prepare)
    try:
        ck = load_draft(cfg.init_from)
    except DraftError as e:
        raise TrainError(f"--init-from {cfg.init_from}: {e}") from e
    check_layouts(ck.layout, layout, f"the --init-from draft {cfg.init_from}", "the training data")
    d = ck.model
    if cfg.intermediate_size is not None and cfg.intermediate_size != d.config.intermediate_size:
        raise TrainError(f"--intermediate-size {cfg.intermediate_size} but the --init-from draft has "
                         f"{d.config.intermediate_size}; drop the flag or start from scratch")
    ids = d.target_token_ids().long().cpu()
    if fresh is not None:
        return _refresh_vocab(d, ids, fresh), fresh
    if cfg.draft_vocab != ids.numel():
        raise TrainError(f"--draft-vocab {cfg.draft_vocab} but the --init-from draft's vocabulary has {ids.numel()} "
                         f"tokens (a warm start keeps it); pass --draft-vocab {ids.numel()} or --refresh-vocab")
    old = ck.manifest.get("draft_vocab", {})
    vocab = DraftVocab(ids=ids, target_vocab_size=counts.numel(),
                       coverage=float(counts[ids].sum() / counts.sum().clamp_min(1)),
                       counted_tokens=int(counts.sum()), always=list(old.get("always_included", [])),
                       source_hash=old.get("source_dataset_hash", ""), requested_size=ids.numel())
    d.requires_grad_(True)
    return d.float().train(), vocab


def _refresh_vocab(d: Eagle3Draft, old_ids: torch.Tensor, fresh: DraftVocab) -> Eagle3Draft:
    from dataclasses import replace

    new = Eagle3Draft(replace(d.config, draft_vocab_size=fresh.size))
    state = {k: v for k, v in d.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
    missing, unexpected = new.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight", "d2t", "t2d"}:
        raise TrainError(f"--refresh-vocab: cannot carry the draft's weights over (missing {missing}, "
                         f"unexpected {unexpected})")
    W = d.lm_head.weight.detach().float()  # [Vd_old, H]
    row = {int(t): i for i, t in enumerate(old_ids.tolist())}
    Wn = W.mean(0, keepdim=True).repeat(fresh.size, 1)  # [Vd_new, H]
    keep = [(j, row[int(t)]) for j, t in enumerate(fresh.ids.tolist()) if int(t) in row]
    if keep:
        dst, src = (torch.tensor(x) for x in zip(*keep, strict=True))
        Wn[dst] = W[src]
    with torch.no_grad():
        new.lm_head.weight.copy_(Wn)
    new.set_vocab_map(fresh.ids)
    new.requires_grad_(True)
    return new.float().train()


def save_optimizer(opt: torch.optim.Optimizer, path: Path) -> dict[str, Any]:
    """Optimizer tensors -> safetensors; hyper-parameters -> returned JSON-able dict. Never pickle."""
    sd = opt.state_dict()
    tensors = {f"state.{i}.{k}": v.detach().cpu().contiguous() for i, st in sd["state"].items()
               for k, v in st.items() if torch.is_tensor(v)}
    save_file(tensors or {"empty": torch.zeros(0)}, str(path))
    return {"param_groups": sd["param_groups"]}


FIX_CHECKPOINT = "delete OUT/checkpoint to train from the start, or train into a new --out"


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's safetensors file; a truncated or corrupt one is one error naming it."""
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises several types (SafetensorError, OSError) on damaged files
        raise TrainError(f"{path} is not a readable safetensors file ({e}); {FIX_CHECKPOINT}") from e


def load_optimizer(opt: torch.optim.Optimizer, path: Path, meta: dict[str, Any]) -> None:
    t = read_tensors(path)
    state: dict[int, dict[str, torch.Tensor]] = {}
    try:
        for k, v in t.items():
            if k == "empty":
                continue
            _, i, name = k.split(".", 2)
            state.setdefault(int(i), {})[name] = v
        groups = meta["param_groups"]
        for g in groups:
            if "betas" in g:
                g["betas"] = tuple(g["betas"])
        opt.load_state_dict({"state": state, "param_groups": groups})
    except (ValueError, KeyError, TypeError) as e:  # foreign keys, or groups that do not fit this draft
        raise TrainError(f"{path} does not hold this run's optimizer state ({type(e).__name__}: {e}); "
                         f"{FIX_CHECKPOINT}") from e


def rng_tensors() -> dict[str, torch.Tensor]:
    out = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"cuda.{i}"] = s
    return out


def set_rng(t: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(t["torch"])
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            if f"cuda.{i}" in t:
                torch.cuda.set_rng_state(t[f"cuda.{i}"], i)


def checkpoint_dir(out: Path) -> Path | None:
    """The committed checkpoint; recovers from a kill between the two renames of a save."""
    ck, new, old = out / "checkpoint", out / "checkpoint.new", out / "checkpoint.old"
    if (ck / STATE_FILE).exists():
        return ck
    if (new / STATE_FILE).exists():
        return new
    if (old / STATE_FILE).exists():
        return old
    return None


def save_checkpoint(out: Path, draft: Eagle3Draft, layout: Layout, extra: dict[str, Any],
                    opt: torch.optim.Optimizer, state: dict[str, Any]) -> Path:
    """Draft + optimizer + RNG + cursor in one folder, swapped in atomically (trainer_state.json last)."""
    new, ck = out / "checkpoint.new", out / "checkpoint"
    try:
        save_draft(new, draft, layout, extra=extra)
        state = dict(state, optimizer=save_optimizer(opt, new / OPT_FILE))
        save_file(rng_tensors(), str(new / RNG_FILE))
        state["files"] = {name: file_record(new / name) for name in (OPT_FILE, RNG_FILE)}  # checked by check_resume
        atomic_write_json(new / STATE_FILE, state)
    except Exception as e:
        # without its trainer_state.json no resume trusts checkpoint.new; remove it rather than leave it to look
        # like one (the previous checkpoint, if any, is untouched)
        if not (new / STATE_FILE).exists():
            shutil.rmtree(new, ignore_errors=True)
        fault = write_fault(e, new, atomic=not new.exists())
        if fault is None:
            raise
        raise fault from e
    return swap_folder(new, ck)


# the cursor's counts: whole numbers, never negative (a -5 step would replay the log from step -4)
def count_lines(path: Path) -> int:
    """Non-empty lines of a log (0 when it does not exist): what a new run in the same folder would drop."""
    return sum(1 for ln in path.read_text().splitlines() if ln.strip()) if path.exists() else 0


def truncate_jsonl(path: Path, step: int) -> None:
    """Drop lines logged after `step` (they belong to the killed tail of the run)."""
    if not path.exists():
        return
    keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
    atomic_write_text(path, "".join(ln + "\n" for ln in keep))


def check_resume(ck: Path, cfg: TrainConfig, layout: Layout, vocab: DraftVocab,
                 data_hash: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(trainer state, checkpoint manifest), after refusing a checkpoint made for other data/target/vocab or with
    another trajectory (each field named). A damaged checkpoint (a metadata file that does not parse or fit its
    schema, a tensor file that is not what was written) is one error line."""
    man = read_metadata(ck / DRAFT_MANIFEST, CHECKPOINT_MANIFEST, TrainError, FIX_CHECKPOINT)
    state = read_metadata(ck / STATE_FILE, TRAINER_STATE, TrainError, FIX_CHECKPOINT)
    files = state.get("files") or {}  # checkpoints written before eyas recorded digests have none
    for name in (OPT_FILE, RNG_FILE):
        check_file(ck / name, files.get(name), TrainError, FIX_CHECKPOINT)
    check_file(ck / WEIGHTS, (man.get("files") or {}).get(WEIGHTS), TrainError, FIX_CHECKPOINT)
    check_layouts(Layout.from_dict(man["layout"]), layout, f"the checkpoint {ck}", "the training data")
    problems = []
    dv = man["draft_vocab"]
    if dv.get("hash") != vocab.hash:
        problems.append(f"draft vocab: the checkpoint has {dv.get('hash')} (size {dv.get('size')}, counted on "
                        f"data {dv.get('source_dataset_hash')}), the data gives {vocab.hash} (size {vocab.size}, "
                        f"data {vocab.source_hash})")
    if man["data"].get("hash") != data_hash:
        problems.append(f"data hash: the checkpoint was trained on {man['data'].get('hash')}, "
                        f"--data is {data_hash}")
    old = state["config"]
    for name in TrainConfig.TRAJECTORY:
        a, b = old.get(name), getattr(cfg, name)
        if a != b and not (isinstance(a, list) and b is not None and list(b) == a):
            problems.append(f"--{name.replace('_', '-')}: the checkpoint used {a!r}, this run {b!r}")
    if problems:
        raise TrainError(f"refusing to resume from {ck}:\n  - " + "\n  - ".join(problems) +
                         "\n  fix: resume with the original data and options, or train into a new --out")
    return state, man
