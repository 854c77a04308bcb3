"""eyas doctor flags: SGLang / vLLM serve-command lint against a draft folder (pure parsing, no model)."""

from __future__ import annotations

import json

import pytest

from eyas.doctor.flags import lint_serve_command
from eyas.doctor.launch_command import FlagsError, parse_serve_command
from eyas.engine_views import engine_views

L = 30  # a SmolLM2-sized target: the EAGLE-3 default is stream [2, 15, 27] = SGLang ids [1, 14, 26]


def draft_dir(tmp_path, config: dict | None = None, layout=(2, 15, 27), manifest: bool = True,
              arch: str | None = "LlamaForCausalLM"):
    d = tmp_path / "draft"
    d.mkdir(exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 576, "target_hidden_size": 576,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [k - 1 for k in layout], "use_aux_hidden_state": True},
           "eagle_aux_hidden_state_layer_ids": list(layout)}
    if config is not None:
        cfg = config
    (d / "config.json").write_text(json.dumps(cfg))
    if manifest:
        (d / "eyas_manifest.json").write_text(json.dumps({
            "kind": "eyas-draft", "layout": {"convention": "eyas-stream-v1", "aux_indices": list(layout),
                                             "target": {"num_layers": L, "hidden_size": 576, "model_type": "llama",
                                                        "vocab_size": cfg.get("vocab_size", 32),
                                                        "fingerprint": "sha256:0",
                                                        **({"architecture": arch} if arch else {})}}}))
    return d


def sglang(d, *extra):
    return ["python", "-m", "sglang.launch_server", "--model-path", "HuggingFaceTB/SmolLM2-135M-Instruct",
            "--speculative-draft-model-path", str(d), *extra]


def by_name(lint):
    return {c.name: c for c in lint.checks}


def test_clean_sglang_command_passes(tmp_path):
    d = draft_dir(tmp_path)
    lint = lint_serve_command(sglang(d, "--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3",
                                     "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "16"), d)
    assert lint.ok, [(c.name, c.status, c.summary) for c in lint.checks]
    assert by_name(lint)["aux_ids"].numbers["views"][0]["indices"] == [2, 15, 27]


def test_eagle_instead_of_eagle3_is_a_fail_and_corrected(tmp_path):
    d = draft_dir(tmp_path)
    lint = lint_serve_command(sglang(d, "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3",
                                     "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "16"), d)
    c = by_name(lint)["algorithm"]
    assert c.status == "fail" and "only EAGLE3 turns on aux hidden-state capture" in c.summary
    assert "--speculative-algorithm EAGLE3" in lint.corrected_text()
    assert "--speculative-algorithm EAGLE " not in lint.corrected_text() + " "


def test_topk1_draft_tokens_rewrite(tmp_path):
    # the story: --speculative-num-steps 1 with 16 draft tokens and topk 1 -> SGLang runs 2
    d = draft_dir(tmp_path)
    lint = lint_serve_command(sglang(d, "--speculative-algorithm=EAGLE3", "--speculative-num-steps", "1",
                                     "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens=16"), d)
    c = by_name(lint)["draft_shape"]
    assert c.status == "fail" and "silently rewrites num_draft_tokens to 2" in c.summary
    assert "--speculative-num-steps 15" in c.fix
    assert lint.corrected[-1] == "--speculative-num-draft-tokens=2"  # the = form is kept


def test_tree_too_small_for_draft_tokens(tmp_path):
    d = draft_dir(tmp_path)
    lint = lint_serve_command(sglang(d, "--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "2",
                                     "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "16"), d)
    c = by_name(lint)["draft_shape"]
    assert c.status == "fail" and "7 nodes" in c.summary  # 1 + 2 + (2-1)*2*2


def test_no_draft_shape_flags_warns_about_auto_choice(tmp_path):
    d = draft_dir(tmp_path)
    lint = lint_serve_command(sglang(d, "--speculative-algorithm", "EAGLE3"), d)
    assert by_name(lint)["draft_shape"].status == "warn" and "(5, 4, 8)" in by_name(lint)["draft_shape"].summary


def test_abbreviated_options_are_resolved_like_argparse(tmp_path):
    d = draft_dir(tmp_path)
    argv = ["python3", "-m", "sglang.launch_server", "--model", "M", "--speculative-algo", "EAGLE",
            "--speculative-draft", str(d), "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", "4"]
    cmd = parse_serve_command(argv)
    assert cmd.opts["algorithm"] == "EAGLE" and cmd.opts["draft_path"] == str(d)
    lint = lint_serve_command(argv, d)
    names = by_name(lint)
    assert names["option_spelling"].status == "warn" and "ambiguous" in names["option_spelling"].summary
    text = lint.corrected_text()
    assert "--speculative-algorithm EAGLE3" in text and f"--speculative-draft-model-path {d}" in text


def test_ids_in_vllm_convention_read_by_sglang_are_off_by_one(tmp_path):
    # eagle_config written with stream indices (vLLM's input-of) instead of SGLang's output-of ids
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "target_hidden_size": 576,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27]}}
    d = draft_dir(tmp_path, cfg)
    lint = lint_serve_command(sglang(d, "--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3",
                                     "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"), d)
    c = by_name(lint)["aux_ids"]
    assert c.status == "fail" and "off by one" in c.details[0] and "stream [3, 16, 28]" in c.details[0]
    assert "[1, 14, 26]" in c.fix and lint.config_edits


def test_missing_ids_fall_back_to_engine_defaults(tmp_path):
    # a draft trained on another layout whose config names no ids: both engines apply their default
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "target_hidden_size": 576}
    d = draft_dir(tmp_path, cfg, layout=(3, 16, 28))
    lint = lint_serve_command(sglang(d, "--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3",
                                     "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"), d)
    c = by_name(lint)["aux_ids"]
    assert c.status == "fail" and "SGLang default [1, 14, 26]" in c.summary
    v = engine_views(cfg, "vllm", L)
    assert [x.indices for x in v] == [[2, 15, 27]]


def test_vllm_views_of_an_sglang_only_config():
    cfg = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}}
    v = engine_views(cfg, "vllm", L)
    assert {tuple(x.indices) for x in v} == {(2, 15, 27), (1, 14, 26)}  # default vs eagle_config used as-is
    assert all(x.when for x in v)
    s = engine_views(cfg, "sglang", L)
    assert s[0].indices == [2, 15, 27] and not s[0].when


def test_use_aux_hidden_state_false_means_final_state_only():
    cfg = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26], "use_aux_hidden_state": False}}
    for eng in ("sglang", "vllm"):
        (v,) = engine_views(cfg, eng, L)
        assert v.indices is None and "final 1xH" in v.source


def test_vllm_method_missing_is_guessed_from_the_path(tmp_path):
    d = draft_dir(tmp_path)
    spec = json.dumps({"model": str(d), "num_speculative_tokens": 3})
    lint = lint_serve_command(["vllm", "serve", "M", "--speculative-config", spec], d)
    c = by_name(lint)["method"]
    assert c.status == "fail" and '"draft_model"' in c.summary
    fixed = json.loads(lint.corrected[lint.corrected.index("--speculative-config") + 1])
    assert fixed["method"] == "eagle3" and fixed["model"] == str(d)
    assert by_name(lint)["aux_ids"].status == "pass"  # top-level ids present: vLLM reads them as-is


def test_vllm_eagle_dash_in_path_means_eagle1(tmp_path):
    d = draft_dir(tmp_path)
    lint = lint_serve_command(['{"model": "org/EAGLE-3-smollm", "num_speculative_tokens": 3}'], d)
    c = by_name(lint)["method"]
    assert c.status == "fail" and '-> "eagle"' in c.summary  # "eagle-" wins over "eagle3"
    assert json.loads(lint.corrected_text())["method"] == "eagle3"


@pytest.mark.parametrize("method", [None, "draft_model"])
def test_vllm_head_served_without_its_method_is_a_generic_draft_model(tmp_path, method):
    """An eyas export folder (no "eagle3" in its path) served without "method": "eagle3": vLLM loads it as a
    generic draft model, which never gets the target's hidden states, and fails on the first request."""
    d = draft_dir(tmp_path)  # nothing in the path for vLLM's guess (tmp_path is named after the test)
    spec = {"model": str(d), "num_speculative_tokens": 3}
    if method:
        spec["method"] = method
    lint = lint_serve_command(["vllm", "serve", "M", "--speculative-config", json.dumps(spec)], d)
    c = by_name(lint)["method"]
    assert c.status == "fail" and not lint.ok
    assert "generic draft model" in c.summary and "first request" in c.summary and c.fix == '"method": "eagle3"'
    fixed = json.loads(lint.corrected[lint.corrected.index("--speculative-config") + 1])
    assert fixed["method"] == "eagle3"
    # the same folder under a path with "eagle3" in it: vLLM's guess is right, but only by the folder's name
    d3 = tmp_path / "smollm-eagle3"
    d.rename(d3)
    lint = lint_serve_command([json.dumps({**spec, "model": str(d3)})], d3)
    assert by_name(lint)["method"].status == "warn"


def test_vllm_explicit_eagle3_and_dotted_options(tmp_path):
    d = draft_dir(tmp_path)
    argv = ["vllm", "serve", "M", "--speculative-config.method", "eagle3", f"--speculative-config.model={d}",
            "--speculative-config.num_speculative_tokens", "3"]
    lint = lint_serve_command(argv, d)
    assert lint.ok, [(c.name, c.status, c.summary) for c in lint.checks]


def test_vllm_sglang_only_ids_warn(tmp_path):
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "target_hidden_size": 576,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}}
    d = draft_dir(tmp_path, cfg)
    lint = lint_serve_command([json.dumps({"method": "eagle3", "model": str(d), "num_speculative_tokens": 3})], d)
    c = by_name(lint)["aux_ids"]
    assert c.status == "warn" and "off by one" in " ".join(c.details)
    assert '"eagle_aux_hidden_state_layer_ids": [2, 15, 27]' in c.fix


def test_foreign_draft_without_manifest_needs_the_layer_count(tmp_path):
    cfg = {"architectures": ["LlamaForCausalLMEagle3"],
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}}
    d = draft_dir(tmp_path, cfg, manifest=False)
    lint = lint_serve_command(sglang(d, "--speculative-algorithm", "EAGLE3"), d)
    assert by_name(lint)["aux_ids"].status == "warn" and "--num-layers" in by_name(lint)["aux_ids"].fix
    lint = lint_serve_command(sglang(d, "--speculative-algorithm", "EAGLE3"), d, num_layers=L)
    c = by_name(lint)["aux_ids"]
    assert c.status == "warn" and "does not record" in c.summary and "stream [2, 15, 27]" in c.summary


def test_bad_inputs_are_loud(tmp_path):
    d = draft_dir(tmp_path)
    with pytest.raises(FlagsError, match="no serve command"):
        lint_serve_command([], d)
    with pytest.raises(FlagsError, match="not valid JSON"):
        lint_serve_command(["{method: eagle3"], d)
    with pytest.raises(FlagsError, match="cannot tell which engine"):
        lint_serve_command(["llama-server", "-m", "x.gguf"], d)
    with pytest.raises(FlagsError, match="no config.json"):
        lint_serve_command(["vllm", "serve", "M"], tmp_path / "nope")
    with pytest.raises(FlagsError, match="expected an integer"):
        lint_serve_command(sglang(d, "--speculative-num-steps", "three"), d)


def test_command_as_one_string(tmp_path):
    d = draft_dir(tmp_path)
    line = f"python -m sglang.launch_server --model-path M --speculative-algorithm EAGLE3 " \
           f"--speculative-draft-model-path {d} --speculative-num-steps 3 --speculative-eagle-topk 1 " \
           "--speculative-num-draft-tokens 4"
    assert lint_serve_command([line], d).ok


# ---- the launcher is read from the command's structure, not from substrings -----------------------

def test_engine_is_the_program_not_a_substring(tmp_path):
    # a vLLM launch whose draft path happens to contain "sglang": it was linted as SGLang (two false fails)
    (tmp_path / "exp_sglang").mkdir()
    d = draft_dir(tmp_path / "exp_sglang")
    spec = json.dumps({"method": "eagle3", "model": str(d), "num_speculative_tokens": 3})
    lint = lint_serve_command(["vllm", "serve", "/models/sglang-ready-llama", "--speculative-config", spec], d)
    assert lint.engine == "vllm" and lint.ok, [(c.name, c.status, c.summary) for c in lint.checks]
    line = f"CUDA_VISIBLE_DEVICES=0 python3 -m vllm.entrypoints.openai.api_server --model M " \
           f"--speculative-config '{spec}'"
    assert parse_serve_command([line]).engine == "vllm"
    assert parse_serve_command(["python", "-m", "sglang.launch_server", "--model-path", "/x/vllm"]).engine == "sglang"
    assert parse_serve_command(["sglang", "serve", "--model-path", "M"]).engine == "sglang"
    assert parse_serve_command(["nice", "-n", "5", "vllm", "serve", "M"]).engine == "vllm"
    # options only: the speculative flags tell
    assert parse_serve_command(["--model-path", "M", "--speculative-algorithm", "EAGLE3"]).engine == "sglang"
    assert parse_serve_command(["--model", "/x/sglang", "--speculative-config", spec]).engine == "vllm"
    with pytest.raises(FlagsError, match="does not start SGLang or vLLM"):
        parse_serve_command(["python", "serve_sglang.py", "--port", "1"])
    with pytest.raises(FlagsError, match="cannot tell which engine"):
        parse_serve_command(["--model", "/x/sglang", "--port", "1"])


# ---- can SGLang load the folder at all --------------------------------------------------------------

# a tiny draft: hidden 8, 2 heads of 4, 1 kv head, MLP 16, target vocab 32, draft vocab 16, target hidden 8
TINY = {"hidden_size": 8, "target_hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
        "intermediate_size": 16, "vocab_size": 32, "draft_vocab_size": 16}


def tiny_shapes(layer: str = "midlayer.", n_aux: int = 3) -> dict[str, tuple[int, ...]]:
    H, V, Vd = 8, 32, 16
    return {"fc.weight": (H, n_aux * H), "norm.weight": (H,), "lm_head.weight": (Vd, H), "d2t": (Vd,), "t2d": (V,),
            f"{layer}input_layernorm.weight": (H,), f"{layer}hidden_norm.weight": (H,),
            f"{layer}post_attention_layernorm.weight": (H,), f"{layer}self_attn.q_proj.weight": (8, 2 * H),
            f"{layer}self_attn.k_proj.weight": (4, 2 * H), f"{layer}self_attn.v_proj.weight": (4, 2 * H),
            f"{layer}self_attn.o_proj.weight": (H, 8), f"{layer}mlp.gate_proj.weight": (16, H),
            f"{layer}mlp.up_proj.weight": (16, H), f"{layer}mlp.down_proj.weight": (H, 16)}


def _weights(d, shapes: dict[str, tuple[int, ...]]):
    import torch
    from safetensors.torch import save_file

    save_file({n: torch.zeros(s, dtype=torch.long if n == "d2t" else torch.bool if n == "t2d" else torch.float32)
               for n, s in shapes.items()}, str(d / "model.safetensors"))


def tiny_draft(tmp_path, shapes=None, **config):
    """A draft folder whose config.json and safetensors agree (each test then plants one fault)."""
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], **TINY,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26], "use_aux_hidden_state": True},
           "eagle_aux_hidden_state_layer_ids": [2, 15, 27], **config}
    d = draft_dir(tmp_path, {k: v for k, v in cfg.items() if v is not None})
    _weights(d, tiny_shapes() if shapes is None else shapes)
    return d


SGLANG_OK = ("--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
             "--speculative-num-draft-tokens", "4")


def vllm_spec(d, **extra):
    return ["vllm", "serve", "M", "--speculative-config",
            json.dumps({"method": "eagle3", "model": str(d), "num_speculative_tokens": 3, **extra})]


def test_sglang_launch_on_layers0_weights_fails(tmp_path):
    # SGLang's LlamaForCausalLMEagle3.load_weights drops names it has no parameter for: layers.0.* would leave
    # the draft layer random while the server starts fine
    d = tiny_draft(tmp_path, tiny_shapes("layers.0."))
    lint = lint_serve_command(sglang(d, *SGLANG_OK), d, engine_version="0.5.6")
    c = by_name(lint)["weights"]
    assert c.status == "fail" and "layers.0" in c.summary and "without a word" in c.summary and not lint.ok
    assert "midlayer" in c.fix
    # the same folder in vLLM is fine (it loads layers.0.* and renames midlayer.* itself), and in SGLang 0.5.23,
    # whose load_weights renames midlayer to layers.0 and places both
    assert lint_serve_command(vllm_spec(d), d).ok
    assert by_name(lint_serve_command(sglang(d, *SGLANG_OK), d, engine_version="0.5.23"))["weights"].status == "pass"
    _weights(d, tiny_shapes())
    lint = lint_serve_command(sglang(d, *SGLANG_OK), d)
    assert by_name(lint)["weights"].status == "pass" and lint.ok, [(c.name, c.summary) for c in lint.checks]


def test_sglang_launch_on_speculators_folder_fails(tmp_path):
    cfg = {"speculators_model_type": "eagle3", "eagle_aux_hidden_state_layer_ids": [2, 15, 27],
           "transformer_layer_config": {"hidden_size": 576}}
    d = draft_dir(tmp_path, cfg)
    lint = lint_serve_command(sglang(d, *SGLANG_OK), d)
    assert by_name(lint)["weights"].status == "fail" and "speculators" in by_name(lint)["weights"].summary


def test_truncated_weights_file_is_a_clear_error(tmp_path):
    d = draft_dir(tmp_path)
    (d / "model.safetensors").write_bytes(b"\x10\x00")
    with pytest.raises(FlagsError, match="not a readable safetensors file"):
        lint_serve_command(sglang(d, *SGLANG_OK), d)
    (d / "model.safetensors").unlink()
    (d / "eyas_manifest.json").write_text("{oops")
    with pytest.raises(FlagsError, match="is not valid JSON"):
        lint_serve_command(sglang(d, *SGLANG_OK), d)


# ---- where each engine reads ids: SGLang eagle_config only, vLLM top level (+ eagle_aux_layer_semantics) ----

def test_sglang_never_reads_top_level_ids():
    # model_runner.py ModelRunner.__init__ reads eagle_config["eagle_aux_hidden_state_layer_ids"] only
    (v,) = engine_views({"eagle_aux_hidden_state_layer_ids": [3, 16, 28]}, "sglang", L)
    assert v.indices == [2, 15, 27] and "never reads" in v.source and not v.when


def test_vllm_aux_layer_semantics_in_config(tmp_path):
    # ids written in SGLang's output-of convention at the top level, marked so: newer vLLM adds 1
    cfg = {"eagle_aux_hidden_state_layer_ids": [1, 14, 26], "eagle_aux_layer_semantics": "sglang"}
    views = engine_views(cfg, "vllm", L)
    assert [x.indices for x in views] == [[2, 15, 27], [1, 14, 26]] and all(x.when for x in views)
    (v,) = engine_views({**cfg, "eagle_aux_layer_semantics": "vllm"}, "vllm", L)
    assert v.indices == [1, 14, 26]
    (bad,) = engine_views({**cfg, "eagle_aux_layer_semantics": "SGLang"}, "vllm", L)
    assert bad.indices is None and "knows only" in bad.source
    # versions that read the key (newer than any row of eyas/engines.py) add 1; vLLM 0.32 never reads it
    assert [x.indices for x in engine_views(cfg, "vllm", L, reads_semantics=True)] == [[2, 15, 27]]
    assert [x.indices for x in engine_views(cfg, "vllm", L, reads_semantics=False)] == [[1, 14, 26]]
    d = draft_dir(tmp_path, {"architectures": ["LlamaForCausalLMEagle3"], **cfg})
    lint = lint_serve_command([json.dumps({"method": "eagle3", "model": str(d), "num_speculative_tokens": 3})], d)
    c = by_name(lint)["aux_ids"]
    assert "vllm 0.32" in by_name(lint)["engine_version"].summary
    assert c.status == "fail" and "stream [1, 14, 26]" in c.summary
    assert '"eagle_aux_hidden_state_layer_ids": [2, 15, 27]' in c.fix


def test_vllm_aux_layer_semantics_in_speculative_config_is_refused_by_032(tmp_path):
    # vllm/config/utils.py: SpeculativeConfig forbids extra keys, and 0.32 has no eagle_aux_layer_semantics
    d = draft_dir(tmp_path)  # top-level ids [2, 15, 27] in vLLM's convention
    spec = {"method": "eagle3", "model": str(d), "num_speculative_tokens": 3}
    lint = lint_serve_command([json.dumps({**spec, "eagle_aux_layer_semantics": "vllm"})], d)
    c = by_name(lint)["speculative_config"]
    assert c.status == "fail" and "eagle_aux_layer_semantics" in c.summary and "refuses" in c.summary
    assert "eagle_aux_layer_semantics" not in json.loads(lint.corrected_text())
    assert by_name(lint)["aux_ids"].status == "pass"  # the key is ignored: ids as-is


# ---- sizes against the tensors, and aux order judged by what is concatenated -----------------------

@pytest.mark.parametrize("vd", [8, 24])  # fewer or more than lm_head's 16 rows (vLLM refused 4096 and 49152 vs 8192)
def test_draft_vocab_size_that_disagrees_with_the_weights_fails(tmp_path, vd):
    d = tiny_draft(tmp_path, draft_vocab_size=vd)
    for argv in (vllm_spec(d), sglang(d, *SGLANG_OK)):
        lint = lint_serve_command(argv, d)
        c = by_name(lint)["sizes"]
        assert c.status == "fail" and not lint.ok
        assert f"draft_vocab_size {vd} but lm_head.weight has 16" in c.summary
        assert c.fix == 'set "draft_vocab_size": 16 in the draft\'s config.json' and c.fix in lint.config_edits


def test_hidden_and_head_sizes_are_checked_against_the_shapes(tmp_path):
    d = tiny_draft(tmp_path, hidden_size=16, intermediate_size=32)
    c = by_name(lint_serve_command(vllm_spec(d), d))["sizes"]
    assert c.status == "fail" and '"hidden_size": 8' in c.fix and '"intermediate_size": 16' in c.fix
    d = tiny_draft(tmp_path, num_key_value_heads=2, target_hidden_size=4)
    c = by_name(lint_serve_command(vllm_spec(d), d))["sizes"]
    assert '"num_key_value_heads": 1' in c.fix and '"target_hidden_size": 8' in c.fix
    d = tiny_draft(tmp_path)
    assert by_name(lint_serve_command(vllm_spec(d), d))["sizes"].status == "pass"


def test_ids_listed_in_reverse_order_serve_fine(tmp_path):
    # vLLM 0.32 interfaces.py: aux layers = tuple(sorted(set(ids))), concatenated in layer order (SGLang likewise)
    d = tiny_draft(tmp_path, eagle_aux_hidden_state_layer_ids=[27, 15, 2],
                   eagle_config={"eagle_aux_hidden_state_layer_ids": [26, 14, 1], "use_aux_hidden_state": True})
    for argv in (vllm_spec(d), sglang(d, *SGLANG_OK)):
        lint = lint_serve_command(argv, d)
        c = by_name(lint)["aux_ids"]
        assert c.status == "pass" and "order does not matter" in c.summary, c.summary
        assert lint.ok


def test_draft_trained_on_another_concatenation_order_fails(tmp_path):
    # an eyas draft whose fc takes stream 27 first: the engines feed stream 2 first whatever the config says
    d = tiny_draft(tmp_path, eagle_aux_hidden_state_layer_ids=[27, 15, 2])
    man = json.loads((d / "eyas_manifest.json").read_text())
    man["layout"]["aux_indices"] = [27, 15, 2]
    (d / "eyas_manifest.json").write_text(json.dumps(man))
    for argv in (vllm_spec(d), sglang(d, *SGLANG_OK)):
        c = by_name(lint_serve_command(argv, d))["aux_ids"]
        assert c.status == "fail" and "trained on the concatenation [27, 15, 2]" in c.summary
        assert "eyas export" in c.fix and "permutes" in c.fix


def test_ids_naming_one_layer_twice_feed_fc_fewer_states(tmp_path):
    d = tiny_draft(tmp_path, eagle_aux_hidden_state_layer_ids=[2, 2, 27])
    c = by_name(lint_serve_command(vllm_spec(d), d))["aux_ids"]
    assert c.status == "fail" and "2 distinct layers for fc's 3 blocks" in c.details[0]
