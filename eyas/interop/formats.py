"""Foreign EAGLE-3 draft formats: weight names and config keys. What each format's aux-layer ids mean, how each
engine reads them and every translation between them: eyas/conventions.py (the one place that knows).

Pure functions (no file IO): export.py and importer.py use them in both directions. Facts below were read in
the engines' own code (stored public copies, read for facts only; no code copied):

SGLang      Draft (python/sglang/srt/models/llama_eagle3.py): `fc` = Linear(3 * target_hidden_size
            (falls back to hidden_size)), so exactly 3 aux states; weights `fc.`, `midlayer.`, `norm.`,
            `lm_head.`, `d2t` (hot_token_id = d2t + arange), `t2d` ignored; any other name (`layers.0.*`)
            is skipped without a word by LlamaForCausalLMEagle3.load_weights; `tie_word_embeddings: true`
            would make lm_head the embedding table, so exports write false.
SpecForge   saves in SGLang's names (`draft_vocab_size`, `LlamaForCausalLMEagle3`).
vLLM        Draft (vllm/model_executor/models/llama_eagle3.py): renames `midlayer.` to `layers.0.` itself
            (LlamaModel.load_weights), so the SGLang names load in vLLM; fc input = target_hidden_size * 3,
            `d2t` -> draft_id_to_target_id, `t2d` skipped, `eagle_config.use_aux_hidden_state`,
            `norm_before_residual` flag; its lm_head is always its own ParallelLMHead (never tied).
speculators (0.9.0: speculators/models/eagle3/config.py `Eagle3SpeculatorConfig`, core.py
            `Eagle3DraftModel`): `speculators_model_type: "eagle3"`, `speculators_config` {algorithm,
            proposal_methods, default_proposal_method, verifier {name_or_path, architectures}},
            `transformer_layer_config` (a Llama config: vocab_size = target vocab, rope), `draft_vocab_size`,
            `target_hidden_size`, `norm_before_residual` (False = the residual is the un-normed hidden, eyas's
            draft), `fc_norm` (EAGLE 3.1: an RMSNorm per aux state, `fc_norm.{i}.weight`, eyas's --fc-norm),
            `norm_before_fc` (one RMSNorm over the concatenation, `input_norm.weight`) and `norm_output` (the
            post-norm state fed back): the last two eyas's draft does not have.
            fc = Linear(len(ids) * hidden_size); weights `layers.0.*`, `fc.`, `norm.`, `lm_head.`, `d2t`,
            `t2d` (only when the draft vocab is smaller), optional `embed_tokens.`, `fc_norm.{i}.` with fc_norm.
            SpecForge's EAGLE 3.1 (specforge/modeling/draft/llama3_eagle.py, configs/*-eagle3.1.json): top-level
            `fc_norm: true`, `fc_norm.{i}.weight`; its `norm_output: true` means the usual norm before lm_head
            (compute_logits), not vLLM's post-norm feedback. vLLM reads this config
            through vllm/transformers_utils/configs/speculators/algos.py `update_eagle3`, where an absent
            `norm_before_residual` means True — so exports always write it.
EAGLE ref.  (SafeAILab/EAGLE): weights named like SGLang's, often pickled (pytorch_model.bin).
"""

from __future__ import annotations

from typing import Any

import torch

from ..conventions import FormatError, read_ids, sglang_config_ids, speculators_config_ids, vllm_config_ids
from ..draft import DraftConfig
from ..errors import LayoutError
from ..layout import Layout

EXPORT_FORMATS = ("sglang", "vllm", "speculators")
SPECULATORS_SCHEMA_VERSION = "0.9.0"  # the speculators release whose config schema the export follows
TORCH_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


# ---- weight names --------------------------------------------------------------------------------

def to_format_names(sd: dict[str, torch.Tensor], fmt: str) -> dict[str, torch.Tensor]:
    """eyas names (already SGLang's) -> the format's names. SGLang and vLLM exports keep `midlayer.*`: SGLang
    loads only those (python/sglang/srt/models/llama_eagle3.py LlamaForCausalLMEagle3.load_weights skips, without
    a word, every name it has no parameter for, so `layers.0.*` would leave the draft layer at its random init),
    and vLLM renames `midlayer.` to `layers.0.` itself (vllm/model_executor/models/llama_eagle3.py
    LlamaModel.load_weights). One layout then serves both engines. speculators' own loader wants `layers.0.*`."""
    if fmt in ("sglang", "vllm"):
        return dict(sd)
    if fmt == "speculators":
        return {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v for k, v in sd.items()}
    raise FormatError(f"unknown export format {fmt!r}; expected one of {EXPORT_FORMATS}")


# keys foreign checkpoints may carry that eyas's draft does not store (the target owns them)
_TARGET_OWNED = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")


def to_eyas_names(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Any supported format's names -> (eyas names, target-owned extras such as embed_tokens)."""
    out: dict[str, torch.Tensor] = {}
    extra: dict[str, torch.Tensor] = {}
    for key, v in sd.items():
        k = key[len("model."):] if key.startswith("model.") else key
        if k.startswith("layers.0."):
            k = "midlayer." + k[len("layers.0."):]
        elif k.startswith("midlayers.0."):
            k = "midlayer." + k[len("midlayers.0."):]
        if k in _TARGET_OWNED:
            extra[k] = v
            continue
        if k in out:
            raise FormatError(f"weights {key!r} and another key both map to {k!r}; the checkpoint mixes "
                              "naming schemes (e.g. midlayer.* and layers.0.*) — keep one")
        out[k] = v
    return out, extra


def explain_unexpected(keys: list[str]) -> str:
    """Why a foreign key has no place in eyas's one-layer draft."""
    why = []
    if any(k.startswith("layers.") and not k.startswith("layers.0.") for k in keys):
        why.append("the checkpoint has more than one decoder layer; eyas drafts have exactly one")
    if any("qkv_proj" in k or "gate_up_proj" in k for k in keys):
        why.append("fused qkv/gate_up weights: save the checkpoint with separate q/k/v and gate/up projections")
    if any(k.endswith(".bias") for k in keys):
        why.append("bias weights: eyas's draft (like SGLang's LlamaForCausalLMEagle3 default) has no biases")
    if any(k.startswith("input_norm.") for k in keys):
        why.append("one norm over the concatenated aux states (norm_before_fc) is not part of eyas's draft, which "
                   "has the per-state fc_norm of EAGLE 3.1")
    if any(k.startswith("fc_norm.") for k in keys):
        why.append('fc_norm.* weights without "fc_norm": true in the config: add the key if the draft was trained '
                   "with them (EAGLE 3.1)")
    return ("; ".join(why) + ".") if why else ""


# ---- configs -------------------------------------------------------------------------------------

def _rope(cfg: DraftConfig) -> dict[str, Any]:
    return {"rope_theta": cfg.rope_theta, "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}}


def _arch(layout: Layout) -> str | None:
    """The target's model class: SGLang's id rule depends on it (eyas/aux_rules.py)."""
    return layout.target.architecture if layout.target is not None else None


def sglang_config(cfg: DraftConfig, layout: Layout, dtype: str) -> dict[str, Any]:
    """SGLang/SpecForge config: ids output-of in eagle_config (what SGLang reads). The same layout is also
    written top-level in vLLM's input-of convention: vLLM reads the top level first, so a user who points
    vLLM at this folder cannot fall into its eagle_config-as-is fallback (an off-by-one)."""
    L = _layers(layout)
    out = cfg.hf_config(None)
    out.update(_rope(cfg))
    out.update(sglang_config_ids(layout.aux_indices, L, _arch(layout)))
    out.update(vllm_config_ids(layout.aux_indices, L))  # with the explicit semantics: newer vLLM must not add 1
    out["torch_dtype"] = out["dtype"] = TORCH_DTYPE_NAMES[dtype]
    return out


def vllm_config(cfg: DraftConfig, layout: Layout, dtype: str) -> dict[str, Any]:
    """vLLM config: ids input-of at the top level (read first by vLLM). SGLang's output-of ids go into
    eagle_config too when SGLang can express the layout, so SGLang never falls back to its defaults."""
    L = _layers(layout)
    out = cfg.hf_config(None)
    out.update(_rope(cfg))
    out.update(vllm_config_ids(layout.aux_indices, L))
    out["norm_before_residual"] = False  # vLLM's draft layer reads this flag; eyas's residual is the raw h
    try:
        out.update(sglang_config_ids(layout.aux_indices, L, _arch(layout)))
    except LayoutError:  # e.g. stream 0: SGLang cannot capture it; the manifest records why
        out["eagle_config"] = {"use_aux_hidden_state": True}
    out["torch_dtype"] = out["dtype"] = TORCH_DTYPE_NAMES[dtype]
    return out


def speculators_config(cfg: DraftConfig, layout: Layout, dtype: str, verifier: str | None,
                       verifier_architecture: str, speculative_tokens: int) -> dict[str, Any]:
    """speculators 0.9.0 Eagle3SpeculatorConfig as saved by its save_pretrained (keys checked against the
    schema snapshot in tests/data); ids input-of at the top level."""
    L = _layers(layout)
    layer = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": cfg.vocab_size,  # the target's vocabulary (speculators' verifier vocab)
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "dtype": TORCH_DTYPE_NAMES[dtype],
        **{k: v for k, v in _rope(cfg).items() if k != "rope_scaling"},
    }
    return {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_SCHEMA_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": [verifier_architecture]},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        **speculators_config_ids(layout.aux_indices, L),
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": cfg.fc_norm,
        "norm_output": False,
        "embed_requires_grad": False,
        "dtype": TORCH_DTYPE_NAMES[dtype],
    }


def _layers(layout: Layout) -> int:
    if layout.target is None:
        raise FormatError("the draft's layout has no target identity, so its ids cannot be translated; "
                          "re-save it with this version of eyas")
    return layout.target.num_layers


# ---- reading a foreign config --------------------------------------------------------------------

def detect_format(config: dict[str, Any]) -> tuple[str, str]:
    """(format, why) from config keys alone. speculators has a marker key; the others are told apart by
    where their ids live, which is why eagle_config-only and id-less configs stay ambiguous."""
    if "speculators_model_type" in config:
        kind = config["speculators_model_type"]
        if kind != "eagle3":
            raise FormatError(f"speculators_model_type is {kind!r}; eyas imports only 'eagle3' speculators")
        return "speculators", "config has speculators_model_type: eagle3"
    ids = read_ids(config)
    if ids.top is not None:
        return "vllm", "config has top-level eagle_aux_hidden_state_layer_ids (vLLM reads these first, input-of)"
    if ids.eagle_config is not None:
        return "sglang", "config has only eagle_config.eagle_aux_hidden_state_layer_ids (SGLang/SpecForge style)"
    return "eagle", "config has no aux layer ids anywhere (EAGLE reference style)"


# ---- draft config from a foreign config + its weights --------------------------------------------

def _rope_theta(c: dict[str, Any], notes: list[str]) -> float:
    rp = c["rope_parameters"] if isinstance(c.get("rope_parameters"), dict) else {}
    scaling = c.get("rope_scaling")
    for what, kind in (("rope_scaling", (scaling or {}).get("rope_type") or (scaling or {}).get("type")),
                       ("rope_parameters", rp.get("rope_type"))):
        if kind not in (None, "default"):
            raise FormatError(f"{what} type {kind!r}: eyas's draft uses plain RoPE; a scaled RoPE would shift "
                              "every position. Re-train, or strip the scaling only if the draft was trained "
                              "without it")
    theta = c.get("rope_theta") or rp.get("rope_theta")
    if theta is None:
        notes.append("no rope_theta in the config: using 10000, the EAGLE reference draft's default")
        return 10000.0
    return float(theta)


def _check_norm_flags(config: dict[str, Any], notes: list[str]) -> None:
    """Refuse the norms eyas's draft does not have (norm_before_fc anywhere, speculators' norm_output: the post-norm
    state fed back); fc_norm (EAGLE 3.1) is eyas's own."""
    ec = config["eagle_config"] if isinstance(config.get("eagle_config"), dict) else {}
    if config.get("norm_before_fc") or ec.get("norm_before_fc"):
        raise FormatError("norm_before_fc: true (one RMSNorm over the concatenated aux states): eyas's draft has the "
                          "per-state fc_norm of EAGLE 3.1 instead, so its outputs would differ")
    if config.get("norm_output"):
        if "speculators_model_type" in config:
            raise FormatError("speculators flag norm_output: true feeds the post-norm state back, which eyas's draft "
                              "does not do; this draft cannot be imported without changing its outputs")
        notes.append("norm_output: true read as SpecForge's (the norm before lm_head, as eyas's draft); vLLM 0.32 "
                     "reads it as 'feed the post-norm state back', which eyas's exports never write")


def draft_config_from(config: dict[str, Any], sd: dict[str, torch.Tensor], n_aux: int,
                      notes: list[str]) -> DraftConfig:
    """A DraftConfig from a foreign config, every size cross-checked against the weights' shapes."""
    c = dict(config)
    if "speculators_model_type" in config:
        if config["speculators_model_type"] != "eagle3":
            raise FormatError(f"speculators_model_type is {config['speculators_model_type']!r}; eyas imports only "
                              "'eagle3' speculators")
        c = dict(config.get("transformer_layer_config") or {})
        if not c:
            raise FormatError("speculators config has no transformer_layer_config; it cannot be a valid export")
        c["draft_vocab_size"] = config.get("draft_vocab_size")
        c["target_hidden_size"] = config.get("target_hidden_size")
        nbr = config.get("norm_before_residual", False)  # speculators' own default
    else:
        nbr = config.get("norm_before_residual", False)
    _check_norm_flags(config, notes)
    if nbr:
        raise FormatError("norm_before_residual: true (the residual is the normed hidden): eyas's draft keeps the "
                          "raw hidden as residual, like SGLang's llama path, so its outputs would differ")
    if int(c.get("num_hidden_layers", 1)) != 1:
        raise FormatError(f"num_hidden_layers is {c.get('num_hidden_layers')}; eyas drafts have exactly one layer")
    act = c.get("hidden_act", "silu")
    if act != "silu":
        raise FormatError(f"hidden_act {act!r}: eyas's draft MLP is SwiGLU with silu")
    if c.get("attention_bias") or c.get("mlp_bias"):
        raise FormatError("attention_bias/mlp_bias true: eyas's draft has no biases")
    if "hidden_size" not in c:
        raise FormatError(f"config has no hidden_size (keys: {sorted(c)[:30]})")
    H = int(c["hidden_size"])
    need = ["fc.weight", "lm_head.weight", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
            "midlayer.mlp.gate_proj.weight"]
    missing = [k for k in need if k not in sd]
    if missing:
        raise FormatError(f"weights lack {missing}; found {sorted(sd)[:12]}... — not an EAGLE-3 draft checkpoint")
    nh = int(c.get("num_attention_heads") or 0)
    if nh <= 0:
        raise FormatError("config has no num_attention_heads")
    hd = int(c.get("head_dim") or H // nh)
    nkv = int(c.get("num_key_value_heads") or nh)
    fc_out, fc_in = sd["fc.weight"].shape
    Ht = int(c.get("target_hidden_size") or fc_in // max(n_aux, 1))
    q, k = "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight"
    checks = [
        ("fc.weight", tuple(sd["fc.weight"].shape), (H, n_aux * Ht), f"[hidden {H}, {n_aux} aux x target {Ht}]"),
        ("q_proj", tuple(sd[q].shape), (nh * hd, 2 * H), f"[{nh} heads x {hd}, 2 x {H}]"),
        ("k_proj", tuple(sd[k].shape), (nkv * hd, 2 * H), f"[{nkv} kv heads x {hd}, 2 x {H}]"),
    ]
    bad = [f"{name} is {found}, config implies {want} {what}" for name, found, want, what in checks if found != want]
    if bad:
        raise FormatError("weights do not match the config: " + "; ".join(bad))
    vd = int(sd["lm_head.weight"].shape[0])
    cfg_vd = c.get("draft_vocab_size")
    if cfg_vd is not None and int(cfg_vd) != vd:
        raise FormatError(f"draft_vocab_size {cfg_vd} in the config but lm_head.weight has {vd} rows")
    if "vocab_size" not in c:
        raise FormatError("config has no vocab_size (the target vocabulary)")
    # only the draft's own config can tie: SGLang's LlamaForCausalLMEagle3 then makes lm_head the embedding table.
    # A speculators transformer_layer_config is the verifier's config copied over (SmolLM2's says true); neither
    # speculators' Eagle3 draft nor vLLM's Eagle3LlamaForCausalLM (its own ParallelLMHead, always loaded from
    # lm_head.weight) ties, and SGLang does not load that format, so the flag says nothing about this draft.
    if "speculators_model_type" not in config and config.get("tie_word_embeddings"):
        notes.append("tie_word_embeddings is true: SGLang would serve this draft with lm_head = the embedding table "
                     "(llama_eagle3.py), ignoring the trained lm_head.weight that eyas imports")
    if fc_out != H:
        raise FormatError(f"fc.weight outputs {fc_out}, hidden_size is {H}")
    return DraftConfig(
        hidden_size=H, target_hidden_size=Ht, num_attention_heads=nh, num_key_value_heads=nkv, head_dim=hd,
        intermediate_size=int(sd["midlayer.mlp.gate_proj.weight"].shape[0]), vocab_size=int(c["vocab_size"]),
        draft_vocab_size=vd, num_aux=n_aux, rms_norm_eps=float(c.get("rms_norm_eps") or 1e-6),
        rope_theta=_rope_theta(c, notes), max_position_embeddings=int(c.get("max_position_embeddings") or 8192),
        hidden_act="silu", fc_norm=bool(config.get("fc_norm")))  # top level in every format


def check_vocab_map(d2t: torch.Tensor | None, t2d: torch.Tensor | None, vocab: int,
                    draft_vocab: int) -> torch.Tensor:
    """Validate d2t/t2d and return the [Vd] target ids of the draft vocabulary."""
    if d2t is None:
        if draft_vocab != vocab:
            raise FormatError(f"no d2t in the weights but the draft vocabulary ({draft_vocab}) is smaller than the "
                              f"target's ({vocab}): the draft->target token map is missing")
        return torch.arange(vocab)
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise FormatError(f"d2t has dtype {d2t.dtype}; expected integer offsets (target_id = draft_id + d2t)")
    if tuple(d2t.shape) != (draft_vocab,):
        raise FormatError(f"d2t has shape {tuple(d2t.shape)}, expected ({draft_vocab},) = lm_head rows")
    ids = torch.arange(draft_vocab) + d2t.long()
    if ids.min() < 0 or ids.max() >= vocab:
        raise FormatError(f"d2t maps draft ids to target ids {int(ids.min())}..{int(ids.max())}, outside the "
                          f"target vocabulary 0..{vocab - 1}: wrong target or corrupt d2t")
    if ids.unique().numel() != ids.numel():
        raise FormatError(f"d2t maps {ids.numel()} draft ids onto only {ids.unique().numel()} distinct target ids")
    if t2d is not None:
        if tuple(t2d.shape) != (vocab,):
            raise FormatError(f"t2d has shape {tuple(t2d.shape)}, expected ({vocab},) = the target vocabulary")
        mask = t2d.bool()
        if int(mask.sum()) != draft_vocab or not bool(mask[ids].all()):
            raise FormatError(f"t2d marks {int(mask.sum())} target ids, d2t maps {draft_vocab}; "
                              f"{int((~mask[ids]).sum())} of d2t's targets are not marked: d2t and t2d disagree")
    return ids
