"""The silent traps of a draft folder in one engine version (eyas/engines.py says what each version does): sizes
in config.json that disagree with the tensors, tensor names the loader drops or refuses, EAGLE 3.1 fusion norms
an engine never reads, the aux states an engine concatenates against the ones fc was trained on, greedy drafting
at temperature and draft trees an engine cannot run. Each is one Check with the fix. Pure parsing: no model."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch

from ..conventions import default_aux_indices
from ..engine_views import config_fix, engine_views, off_by_one_note
from ..engines import NORM_KEYS, EngineRow, canonical, draft_sizes, flag, loader_misfit, num_aux
from .checklist import Check
from .draft_dir import DraftInfo

# ---- sizes ------------------------------------------------------------------------------------------

def size_check(info: DraftInfo, row: EngineRow) -> Check:
    """Every size key against the tensors' shapes: both engines build each parameter from config.json and then
    refuse (or mis-place) a tensor of another shape, so a wrong draft_vocab_size, hidden_size, ... never serves."""
    if not info.weight_shapes:
        return Check("sizes", "skip", "no *.safetensors in the draft folder: sizes not checked")
    c = draft_sizes(info.config)
    w = {canonical(k): v for k, v in info.weight_shapes.items()}
    H = c.get("hidden_size")
    nh, hd = c.get("num_attention_heads"), c.get("head_dim")
    hd = hd or (H // nh if H and nh else None)
    vd = c.get("draft_vocab_size") or c.get("vocab_size")  # both engines fall back to vocab_size
    ht = c.get("target_hidden_size") or H
    engine = row.engine
    n = num_aux(info.config, row)
    # (config key, its value, tensor, axis, expected size, the value the tensor implies)
    rules: list[tuple[str, Any, str, int, Any, Any]] = [
        ("draft_vocab_size", vd, "lm_head.weight", 0, vd, None),
        ("draft_vocab_size", vd, "d2t", 0, vd, None),
        ("hidden_size", H, "lm_head.weight", 1, H, None),
        ("hidden_size", H, "fc.weight", 0, H, None),
        ("target_hidden_size", ht, "fc.weight", 1, n * ht if ht else None, "/n"),
        ("num_attention_heads", nh, "midlayer.self_attn.q_proj.weight", 0, nh * hd if nh and hd else None, "/hd"),
        ("hidden_size", H, "midlayer.self_attn.q_proj.weight", 1, 2 * H if H else None, "/2"),
        ("num_key_value_heads", c.get("num_key_value_heads") or nh, "midlayer.self_attn.k_proj.weight", 0,
         (c.get("num_key_value_heads") or nh or 0) * (hd or 0) or None, "/hd"),
        ("intermediate_size", c.get("intermediate_size"), "midlayer.mlp.gate_proj.weight", 0,
         c.get("intermediate_size"), None),
        ("target_hidden_size", ht, "input_norm.weight", 0, n * ht if ht else None, "/n"),
    ]
    rules += [("target_hidden_size", ht, k, 0, ht, None) for k in w if k.startswith("fc_norm.")]
    if info.target_vocab:
        rules.append(("vocab_size", c.get("vocab_size"), "t2d", 0, info.target_vocab, None))
    bad: list[str] = []
    edits: dict[str, int] = {}
    for key, value, tensor, axis, want, inv in rules:
        shape = w.get(tensor)
        if shape is None or want is None or len(shape) <= axis or shape[axis] == want:
            continue
        got = shape[axis]
        implied = {"/n": got // n, "/hd": got // hd if hd else got, "/2": got // 2}.get(inv or "", got)
        bad.append(f"config.json {key} {value} but {tensor} has {got} (expected {want})")
        edits.setdefault(key, implied)
    if info.target_vocab and c.get("vocab_size") not in (None, info.target_vocab):
        bad.append(f"config.json vocab_size {c.get('vocab_size')} but the target has {info.target_vocab} tokens")
        edits.setdefault("vocab_size", info.target_vocab)
    if not bad:
        return Check("sizes", "pass", "every size in config.json fits the tensors' shapes")
    fix = ", ".join(f'"{k}": {v}' for k, v in edits.items())
    return Check("sizes", "fail", f"{bad[0]}: {engine} builds its parameters from config.json and refuses the "
                 "tensor (the server does not start)" + (f" (+{len(bad) - 1} more)" if len(bad) > 1 else ""),
                 numbers={"mismatches": bad}, details=bad, fix=f"set {fix} in the draft's config.json")


# ---- weight names -------------------------------------------------------------------------------------

def weights_check(info: DraftInfo, row: EngineRow) -> Check:
    """Every tensor maps to a parameter the loader fills, and every parameter has its tensor."""
    if row.engine == "sglang" and info.config.get("speculators_model_type"):
        return Check("weights", "fail", f"a speculators-format draft (speculators_model_type "
                     f"{info.config['speculators_model_type']!r}): {row.label()} has no loader for it",
                     fix="export the draft with `eyas export --format sglang` (or serve this folder with vLLM)")
    if info.weight_names is None:
        return Check("weights", "skip", "no *.safetensors in the draft folder: weight names not checked")
    unread, missing = loader_misfit(info.weight_names, info.config, row)
    have = {canonical(n) for n in info.weight_names if n not in unread}
    nums = {"unread": unread, "missing": missing, "engine": row.label()}
    if unread:
        how = ("drops them without a word, so the draft runs without them" if row.unknown_weights == "skip"
               or all(n.endswith(".bias") or n.startswith("input_norm.") for n in unread)
               else "refuses them at load: the server does not start")
        fix = _rename_fix(unread, row)
        return Check("weights", "fail", f"{len(unread)} tensors {row.label()} has no parameter for (e.g. "
                     f"{unread[0]}): it {how}", numbers=nums, details=unread[:12], fix=fix)
    if missing:
        return Check("weights", "fail", f"{row.label()} would find no tensor for {len(missing)} parameters (e.g. "
                     f"{missing[0]}) and leave them at their initial values without an error",
                     numbers=nums, details=missing[:12], fix="re-export the draft (eyas export) so every tensor "
                     "is written, or fix config.json if it turns on a part the draft does not have")
    return Check("weights", "pass", f"{len(have)} tensors, each read by {row.label()}, none missing", numbers=nums)


def _rename_fix(unread: list[str], row: EngineRow) -> str:
    if row.engine == "sglang" and any(canonical(n).startswith("midlayer.") for n in unread
                                      if n.startswith(("layers.0.", "model.layers.0."))):
        return ("re-export with `eyas export --format sglang` (or --format vllm: both write midlayer.*, which vLLM "
                "renames itself), or rename layers.0. -> midlayer. in the safetensors")
    if any(n.startswith(tuple(NORM_KEYS.values())) for n in unread):
        return 'add the norm\'s key to config.json ("fc_norm": true for fc_norm.*, "norm_before_fc": true for ' \
               'input_norm.*), or serve with an engine that reads it'
    return f"remove or rename them to the names {row.label()} loads ({', '.join(row.weight_prefixes)})"


# ---- the vocabulary map ------------------------------------------------------------------------------------

def vocab_map_check(info: DraftInfo) -> Check:
    """d2t holds offsets: both engines add the draft id (SGLang llama_eagle3.py hot_token_id = d2t + arange, vLLM
    0.32 compute_logits targets = arange + draft_id_to_target_id). A d2t of absolute target ids maps draft id i to
    i + id: every drafted token is wrong, silently (or past the vocabulary). Reads the one small tensor."""
    name = next((n for n in info.weight_names or [] if canonical(n) == "d2t"), None)
    if name is None:
        return Check("vocab_map", "skip", "no d2t tensor: nothing to check")
    from safetensors import safe_open

    d2t = torch.zeros(0, dtype=torch.long)
    for f in sorted(info.path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            if name in fh.keys():  # safe_open has no __contains__
                d2t = fh.get_tensor(name).long()
                break
    if d2t.numel() == 0:
        return Check("vocab_map", "skip", "d2t is empty: nothing to check")
    ids = d2t + torch.arange(d2t.numel())
    vocab = draft_sizes(info.config).get("vocab_size") or info.target_vocab
    absolute = bool((d2t[1:] > d2t[:-1]).all()) and int(d2t[0]) >= 0 and d2t.numel() > 1 and \
        (vocab is not None and int(ids.max()) >= vocab)
    if absolute:
        return Check("vocab_map", "fail", f"d2t holds absolute target ids (strictly increasing, {int(d2t[0])}.."
                     f"{int(d2t[-1])}), but the engines add the draft id to it: draft id i would become i + d2t[i], "
                     f"past the vocabulary of {vocab}", fix="store offsets: d2t[i] = target_id[i] - i")
    if vocab is not None and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        return Check("vocab_map", "fail", f"d2t maps draft ids to target ids {int(ids.min())}..{int(ids.max())}, "
                     f"outside the vocabulary 0..{vocab - 1}", fix="re-export the draft (eyas export)")
    if ids.unique().numel() != ids.numel():
        return Check("vocab_map", "fail", f"d2t maps {ids.numel()} draft ids onto {ids.unique().numel()} target ids",
                     fix="re-export the draft (eyas export)")
    return Check("vocab_map", "pass", f"d2t: {d2t.numel()} offsets onto distinct target ids")


# ---- EAGLE 3.1 fusion norms ----------------------------------------------------------------------------

def norm_check(info: DraftInfo, row: EngineRow) -> Check:
    """A fusion norm (fc_norm per aux state, or norm_before_fc over the concatenation) the draft was trained with
    and the engine never reads: it serves the draft without it, and acceptance collapses with no error."""
    names = [canonical(n) for n in info.weight_names or []]
    on = [k for k in NORM_KEYS if flag(info.config, k)]
    ignored = [k for k in on if k in row.ignores]
    if ignored:
        return Check("fusion_norm", "fail", f"the draft turns on {', '.join(ignored)} (EAGLE 3.1), which "
                     f"{row.label()} never reads: it serves the draft without its fusion norm, acceptance "
                     "collapses (τ near 1) with no error", numbers={"keys": on},
                     fix="serve this draft with SGLang >= 0.5.21 or vLLM >= 0.32 (both read fc_norm and "
                         "norm_before_fc); or train a plain EAGLE-3 draft (without --fc-norm)")
    if row.engine == "sglang" and flag(info.config, "norm_output") and "norm_output" in row.ignores:
        return Check("fusion_norm", "fail", f"norm_output: true (the post-norm state fed back), which "
                     f"{row.label()} never reads: it feeds back the pre-norm state", fix="serve with vLLM >= 0.32")
    if row.engine == "vllm" and flag(info.config, "norm_output") and info.layout is not None:
        return Check("fusion_norm", "fail", "norm_output: true in an eyas draft's config: vLLM 0.32 then feeds back "
                     "the post-norm state, eyas trains on the pre-norm one", fix='set "norm_output": false')
    stray = [k for k, p in NORM_KEYS.items() if k not in on and any(n.startswith(p) for n in names)]
    if stray:
        return Check("fusion_norm", "fail", f"{NORM_KEYS[stray[0]]}* weights but no \"{stray[0]}\": true in "
                     f"config.json: {row.label()} drops or refuses them and runs without the norm",
                     fix=f'set "{stray[0]}": true in the draft\'s config.json')
    absent = [k for k in on if not any(n.startswith(NORM_KEYS[k]) for n in names)] if info.weight_names else []
    if absent:
        return Check("fusion_norm", "fail", f'"{absent[0]}": true but no {NORM_KEYS[absent[0]]}* weights: '
                     f"{row.label()} adds a norm the draft was not trained with", fix=f'remove "{absent[0]}"')
    what = f"{', '.join(on)} read by {row.label()}" if on else "no fusion norm (plain EAGLE-3)"
    return Check("fusion_norm", "pass", what)


def residual_check(info: DraftInfo, row: EngineRow) -> Check:
    """norm_before_residual (the residual is the normed hidden): vLLM 0.32 reads it, and reads a speculators config
    without it as true (transformers_utils/configs/speculators/algos.py update_eagle3); SGLang never reads it and
    always keeps the raw hidden as residual (llama_eagle3.py)."""
    cfg = info.config
    on = bool(cfg.get("norm_before_residual"))
    if on and "norm_before_residual" in row.ignores:
        return Check("residual", "fail", f"norm_before_residual: true, which {row.label()} never reads: it keeps "
                     "the raw hidden as the residual, not the normed one the draft was trained with",
                     fix="serve this draft with vLLM >= 0.32")
    if row.engine == "vllm" and cfg.get("speculators_model_type") and "norm_before_residual" not in cfg:
        return Check("residual", "warn", "a speculators config without norm_before_residual: vLLM 0.32 reads it as "
                     "true (the residual is the normed hidden)", fix='write "norm_before_residual" explicitly '
                     "(false for a draft trained with the raw hidden as residual, as eyas's)")
    return Check("residual", "pass", f"residual: the {'normed' if on else 'raw'} hidden, as {row.label()} reads it")


# ---- aux states: what the engine concatenates vs what fc was trained on ----------------------------------

def ids_check(info: DraftInfo, engine: str, semantics: str | None = None,
              reads_semantics: bool | None = None, release: Any = None) -> tuple[Check, str | None]:
    """The aux states `engine` concatenates (config.json read as it reads it; both engines capture each layer once,
    in layer order, whatever order the ids are listed in) against the ones the draft's fc was trained on, in the
    order fc takes them (the eyas manifest's layout)."""
    L = info.num_layers
    if L is None:
        return Check("aux_ids", "warn", f"cannot tell which layers {engine} captures: the target's layer count "
                     "is unknown (no eyas manifest in the draft folder)",
                     fix="pass --num-layers L (the target's num_hidden_layers)"), None
    views = engine_views(info.config, engine, L, semantics, reads_semantics, info.target_arch, release)
    if any(v.unknown for v in views):
        return Check("aux_ids", "warn", f"cannot tell which streams {engine} captures: " + views[0].source,
                     numbers={"views": [asdict(v) for v in views], "trained": info.layout, "num_layers": L},
                     fix="give the launch's --model-path as a local folder (its config.json names the target's "
                         "architecture), or export the draft with eyas, whose manifest records it"), None
    concat = [None if v.indices is None else sorted(set(v.indices)) for v in views]
    nums: dict[str, Any] = {"views": [asdict(v) for v in views], "concatenated": concat, "trained": info.layout,
                            "num_layers": L}
    lines = [f"{v.when or 'all versions'}: {v.source} -> "
             f"{'final state only' if c is None else f'concatenates stream {c}'}"
             for v, c in zip(views, concat, strict=True)]
    if info.layout is None:
        return Check("aux_ids", "warn", f"{engine} will capture " + "; ".join(lines) + ", but the draft folder "
                     "does not record which layout it was trained on", numbers=nums, details=lines,
                     fix="run `eyas doctor --target T --draft D` (layout inference) to measure the true layout"), None
    trained = list(info.layout)
    bad = [(v, c) for v, c in zip(views, concat, strict=True) if c != trained]
    if not bad:
        listed = "" if views[0].indices == trained else f" (the config lists them as {views[0].indices}: order " \
                                                         "does not matter, engines concatenate in layer order)"
        return Check("aux_ids", "pass", f"{engine} concatenates stream {trained} = what fc was trained on"
                     f"{listed}", numbers=nums, details=lines), None
    if all(c is not None and c == sorted(trained) for _, c in bad):
        return Check("aux_ids", "fail", f"{engine} concatenates stream {sorted(trained)} (layer order), but the "
                     f"draft's fc was trained on the concatenation {trained}: every block of fc reads the wrong "
                     "layer", numbers=nums, details=lines, fix="export it with `eyas export`, which permutes fc's "
                     "input blocks into layer order (exact)"), None
    fix = config_fix(engine, sorted(trained), L, info.target_arch if engine == "sglang" else None)
    why = []
    for v, c in bad:
        if c is None:
            why.append(f"{v.when or engine}: {v.source}")
            continue
        kind = off_by_one_note(engine, c, sorted(trained))
        rule = next((r for r in ("plus1_if_first_is_1", "as_is_if_max_is_L") if r in v.source), None)
        if kind and rule and [k + 1 for k in c] == sorted(trained):
            # the founding fault, 2026 form: +1 ids on a target whose rule takes them as they are
            kind = (f" — off by one: ids written for the llama family's +1 rule, but this target's rule ({rule}) "
                    "takes them as they are")
        if not kind and c == default_aux_indices(L):
            kind = " — the engine default, not what the draft was trained on"
        if len(c) != len(trained):
            kind += f" — {len(c)} distinct layers for fc's {len(trained)} blocks"
        why.append(f"{v.when or engine}: {v.source} -> stream {c}, trained on {trained}{kind}")
    status = "fail" if len(bad) == len(views) or any(c is None for _, c in bad) else "warn"
    if status == "warn":
        why.append("which one applies depends on the engine version: pin the ids explicitly, or pass "
                   "--engine-version")
    return Check("aux_ids", status, f"{engine} will not capture the trained layout {trained}: " + why[0],
                 numbers=nums, fix=fix, details=why), fix


# ---- vLLM's --speculative-config: drafting at temperature, trees, keys it refuses -------------------------

VLLM_032_SPEC_KEYS = frozenset((
    "enforce_eager num_speculative_tokens model method draft_tensor_parallel_size tensor_parallel_size quantization "
    "moe_backend attention_backend kv_cache_dtype max_model_len revision code_revision index_share_for_mtp_iteration "
    "disable_padded_drafter_batch disable_eagle_block_drop use_local_argmax_reduction use_heterogeneous_vocab "
    "prompt_lookup_max prompt_lookup_min parallel_drafting num_speculative_tokens_per_batch_size "
    "suffix_decoding_max_tree_depth suffix_decoding_max_cached_requests suffix_decoding_max_spec_factor "
    "suffix_decoding_min_token_prob draft_load_config rejection_sample_method synthetic_acceptance_rates "
    "synthetic_acceptance_length enable_adaptive_verification draft_sample_method dspark_draft_topk").split())


def vllm_spec_checks(spec: dict[str, Any], row: EngineRow, temperature: float | None) -> list[Check]:
    """vllm/config/utils.py `config`: SpeculativeConfig is a pydantic dataclass with extra="forbid", so a key 0.32
    does not know (a tree, eagle_aux_layer_semantics) stops the server; drafts are argmax unless
    draft_sample_method is "probabilistic" (vllm/config/speculative.py, v1/spec_decode/llm_base_proposer.py)."""
    out = []
    unknown = sorted(k for k in spec if k not in VLLM_032_SPEC_KEYS) if row.versions == "0.32" else []
    if unknown:
        tree = " (vLLM 0.32 drafts chains only)" if "speculative_token_tree" in unknown else ""
        out.append(Check("speculative_config", "fail", f"--speculative-config keys {unknown} are unknown to "
                         f"{row.label()}, which refuses them at start{tree}", numbers={"unknown": unknown},
                         fix=f"drop {', '.join(unknown)} from --speculative-config"))
    method = spec.get("draft_sample_method", "greedy")
    if row.greedy_draft and method != "probabilistic":
        if temperature:
            out.append(Check("draft_sampling", "warn", f"temperature {temperature} but {row.label()} drafts the "
                             "argmax (draft_sample_method greedy): lossless, yet fewer drafts are accepted than "
                             "with sampled drafts", fix='"draft_sample_method": "probabilistic"'))
        else:
            out.append(Check("draft_sampling", "pass", f"{row.label()} drafts the argmax (greedy); at temperature "
                             '> 0 set "draft_sample_method": "probabilistic"'))
    return out
