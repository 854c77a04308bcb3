"""The founding case against SGLang as it is: export, `doctor flags` and the id rules for a DeepSeek-V3 /
Kimi-K2.5-shaped target, a gpt-oss target and a llama target, with layouts whose first exported id is not 1.

SGLang 0.5.23 (eyas/aux_rules.py, read in its wheel): deepseek_v2.py adds 1 to the ids only when the first is 1,
gpt_oss.py takes them as they are when max(ids) == num_layers, llama.py adds 1 always; 0.5.6 adds 1 on all three.
Tiny random targets built here (seconds); no SGLang runs on these CPUs, so what it would capture is its rule, pinned
to its code by tests/test_engine_rules.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers as tf

from eyas.aux_rules import capture, release_rules
from eyas.doctor.flags import lint_serve_command
from eyas.interop.export import ExportError
from eyas.target.convert import tensor_fingerprint
from eyas.target.load import Target, identity_of
from tests.test_export import export, make_draft
from tests.tiny import tiny_model

SG = ("--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
      "--speculative-num-draft-tokens", "4")


def _target(model) -> Target:
    model.config.architectures = [type(model).__name__]
    return Target(model=model, tokenizer=None, identity=identity_of(model, tensor_fingerprint(model), "tiny"),
                  source="tiny", path=None)


@pytest.fixture(scope="module")
def deepseek() -> Target:
    cfg = tf.DeepseekV3Config(vocab_size=128, hidden_size=32, num_hidden_layers=8, num_attention_heads=2,
                              num_key_value_heads=2, intermediate_size=64, moe_intermediate_size=32,
                              n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                              first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                              qk_rope_head_dim=8, v_head_dim=8, max_position_embeddings=256)
    return _target(tf.DeepseekV3ForCausalLM(cfg).eval())


@pytest.fixture(scope="module")
def gpt_oss() -> Target:
    cfg = tf.GptOssConfig(vocab_size=128, hidden_size=32, num_hidden_layers=6, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=16, intermediate_size=32, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=16, max_position_embeddings=256,
                          layer_types=["sliding_attention", "full_attention"] * 3)
    return _target(tf.GptOssForCausalLM(cfg).eval())


@pytest.fixture(scope="module")
def llama() -> Target:
    return _target(tiny_model("llama", layers=8, hidden=32, vocab=128))


def _ids(folder: Path) -> list[int]:
    return json.loads((folder / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]


def _set_ids(folder: Path, ids: list[int] | None) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    if ids is None:
        cfg["eagle_config"].pop("eagle_aux_hidden_state_layer_ids")
    else:
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
    (folder / "config.json").write_text(json.dumps(cfg))


def _aux(folder: Path, version: str, model: str = "M"):
    argv = ["python", "-m", "sglang.launch_server", "--model-path", model, "--speculative-draft-model-path",
            str(folder), *SG]
    lint = lint_serve_command(argv, folder, engine_version=version)
    return next(c for c in lint.checks if c.name == "aux_ids"), lint


def test_deepseek_custom_layout_first_id_not_1(tmp_path, deepseek):
    layout = [3, 4, 6]  # as +1 ids: [2, 3, 5], whose first id is not 1
    res = export(make_draft(tmp_path / "d", deepseek, layout), "sglang", tmp_path / "sg", deepseek)
    # written so that 0.5.23's deepseek_v2 rule (as they are, the first id being 3) captures the trained streams
    assert _ids(res.path) == [3, 4, 6]
    assert capture(release_rules("sglang", "0.5.23"), "DeepseekV3ForCausalLM", _ids(res.path), 8).streams == layout
    # and the export names the release read that would not (0.5.6 adds 1 always) and what to pin
    assert any("SGLang 0.5.6 captures streams [4, 5, 7]" in w and "pin sglang>=0.5.21" in w for w in res.warnings)
    c, lint = _aux(res.path, "0.5.23")
    assert c.status == "pass" and lint.ok, [(x.name, x.status, x.summary) for x in lint.checks if x.status != "pass"]
    c, _ = _aux(res.path, "0.5.6")
    assert c.status == "fail" and "stream [4, 5, 7]" in c.details[0]
    # the off-by-one export: +1 ids (what eyas wrote before 0.5.23 was read) -> 0.5.23 taps one layer too low
    _set_ids(res.path, [2, 3, 5])
    c, _ = _aux(res.path, "0.5.23")
    assert c.status == "fail" and "stream [2, 3, 5], trained on [3, 4, 6]" in c.details[0]
    assert "+1 rule" in c.details[0] and "plus1_if_first_is_1" in c.details[0]
    assert '"eagle_aux_hidden_state_layer_ids": [3, 4, 6]' in c.fix
    assert _aux(res.path, "0.5.6")[0].status == "pass"  # which is what 0.5.6 reads right
    # an id the forward never meets (-1: taken as it is, the first id not being 1) is a fail, not a warn
    _set_ids(res.path, [-1, 4, 6])
    c, _ = _aux(res.path, "0.5.23")
    assert c.status == "fail" and "[-1]" in c.summary and "never captured" in c.summary


def test_kimi_wrapper_config_decides_by_its_language_model(tmp_path, deepseek):
    """Kimi-K2.5 is a VLM wrapper (KimiK25ForConditionalGeneration, remote code that transformers cannot build
    here) whose text model is DeepSeek-V3: SGLang's kimi_k25.py hands the ids to its language model. The launch's
    --model-path folder holds only the wrapper's config."""
    res = export(make_draft(tmp_path / "d", deepseek, [3, 4, 6]), "sglang", tmp_path / "sg", deepseek)
    kimi = tmp_path / "kimi"
    kimi.mkdir()
    (kimi / "config.json").write_text(json.dumps({
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "text_config": {**deepseek.model.config.to_dict(), "architectures": ["DeepseekV3ForCausalLM"]}}))
    c, lint = _aux(res.path, "0.5.23", str(kimi))
    assert c.status == "pass", c.summary
    note = next(x for x in lint.checks if x.name == "target")
    assert "KimiK25ForConditionalGeneration" in note.summary and "DeepseekV3ForCausalLM" in note.summary
    assert "kimi_k25.py" in json.dumps(c.numbers)
    _set_ids(res.path, [2, 3, 5])
    assert _aux(res.path, "0.5.23", str(kimi))[0].status == "fail"
    # 0.5.6 has no kimi_k25.py: SGLang of that release cannot serve this target, and the lint says so
    c, _ = _aux(res.path, "0.5.6", str(kimi))
    assert c.status == "warn" and "KimiK25ForConditionalGeneration" in c.summary


def test_gpt_oss_final_state_as_is(tmp_path, gpt_oss):
    layout = [2, 3, 6]  # stream 6 = L: the last layer's output, which gpt_oss.py captures when max(ids) == L
    res = export(make_draft(tmp_path / "d", gpt_oss, layout), "sglang", tmp_path / "sg", gpt_oss)
    rules = release_rules("sglang", "0.5.23")
    assert capture(rules, "GptOssForCausalLM", _ids(res.path), 6).streams == layout
    assert _aux(res.path, "0.5.23")[0].status == "pass"
    # both spellings reach stream 6 in 0.5.23: +1 ids [1, 2, 5] (the last lands on L) and as-is ids ending in L
    _set_ids(res.path, [2, 3, 6])
    assert _aux(res.path, "0.5.23")[0].status == "pass"
    c, _ = _aux(res.path, "0.5.6")  # +1 always: layer 7 is never met
    assert c.status == "fail" and "never captured" in c.summary
    res2 = export(make_draft(tmp_path / "d2", gpt_oss, [2, 3, 5]), "sglang", tmp_path / "sg2", gpt_oss)
    assert _ids(res2.path) == [1, 2, 4]  # max(ids) < L: +1, as the llama family
    assert _aux(res2.path, "0.5.23")[0].status == "pass" and _aux(res2.path, "0.5.6")[0].status == "pass"


def test_llama_plus_one_and_the_silent_default(tmp_path, llama):
    res = export(make_draft(tmp_path / "d", llama, [1, 3, 6]), "sglang", tmp_path / "sg", llama)
    assert _ids(res.path) == [0, 2, 5] and not res.warnings
    assert _aux(res.path, "0.5.23")[0].status == "pass"
    _set_ids(res.path, [1, 3, 6])  # ids written as stream indices (vLLM's convention)
    c, _ = _aux(res.path, "0.5.23")
    assert c.status == "fail" and "off by one" in c.details[0] and '[0, 2, 5]' in c.fix
    _set_ids(res.path, None)  # no eagle_config ids: SGLang's silent default
    c, _ = _aux(res.path, "0.5.23")
    assert c.status == "fail" and "no eagle_config ids" in c.details[0] and "with no log line" in c.details[0]
    assert "stream [2, 4, 5]" in c.details[0]
    # the embedding cannot be written for SGLang on a llama target: export refuses in one line
    with pytest.raises(ExportError, match=r"embedding \(stream 0\)"):
        export(make_draft(tmp_path / "e", llama, [0, 3, 6]), "sglang", tmp_path / "sge", llama)


def test_unknown_architecture_is_named_not_guessed(tmp_path, deepseek):
    res = export(make_draft(tmp_path / "d", deepseek, [3, 4, 6]), "sglang", tmp_path / "sg", deepseek)
    man = json.loads((res.path / "eyas_manifest.json").read_text())
    man["layout"]["target"]["architecture"] = "FalconH1ForCausalLM"
    (res.path / "eyas_manifest.json").write_text(json.dumps(man))
    c, _ = _aux(res.path, "0.5.23")
    assert c.status == "warn" and "FalconH1ForCausalLM" in c.summary and "rule for it was not read" in c.summary


def _planted_sglang(root: Path, version: str = "0.5.24") -> Path:
    """A stand-in SGLang release whose deepseek_v2.py adds 1 to every id again (a rule eyas's table does not
    have): written here, as a site-packages folder, for eyas to read as it reads an installed engine."""
    models = root / "sglang" / "srt" / "models"
    models.mkdir(parents=True)
    (models / "deepseek_v2.py").write_text(
        "class DeepseekV2ForCausalLM:\n"
        "    def set_eagle3_layers_to_capture(self, layer_ids=None):\n"
        "        if layer_ids is None:\n"
        "            self.model.layers_to_capture = [2, 4, 5]\n"
        "        else:\n"
        "            self.model.layers_to_capture = [v + 1 for v in layer_ids]\n\n\n"
        "class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):\n    pass\n")
    meta = root / f"sglang-{version}.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text(f"Name: sglang\nVersion: {version}\n")
    return root


def test_installed_engine_decides_over_the_table(tmp_path, deepseek, monkeypatch):
    res = export(make_draft(tmp_path / "d", deepseek, [3, 4, 6]), "sglang", tmp_path / "sg", deepseek)
    monkeypatch.delenv("EYAS_SGLANG_SOURCE", raising=False)
    argv = ["python", "-m", "sglang.launch_server", "--model-path", "M", "--speculative-draft-model-path",
            str(res.path), *SG]
    lint = lint_serve_command(argv, res.path)
    src = next(c for c in lint.checks if c.name == "engine_source")
    if src.summary.startswith("no sglang installed"):  # the table, and which wheel it was read from
        assert "sglang 0.5.23 rules (read from the sglang-0.5.23 wheel" in src.summary
    monkeypatch.setenv("EYAS_SGLANG_SOURCE", str(_planted_sglang(tmp_path / "site")))
    lint = lint_serve_command(argv, res.path)
    src = next(c for c in lint.checks if c.name == "engine_source")
    assert src.status == "warn" and "sglang 0.5.24 (installed" in src.summary
    assert "unlike the table's sglang 0.5.23 (plus1_if_first_is_1): plus1" in src.summary
    assert "using what the installed engine does" in src.summary
    c = next(c for c in lint.checks if c.name == "aux_ids")
    assert c.status == "fail" and "stream [4, 5, 7]" in c.details[0]  # the installed rule, not the table's
    assert "the version installed here" in next(c for c in lint.checks if c.name == "engine_version").summary
    # export where that SGLang is installed writes the ids it maps right, and says why
    res2 = export(make_draft(tmp_path / "d2", deepseek, [3, 4, 6]), "sglang", tmp_path / "sg2", deepseek)
    assert _ids(res2.path) == [2, 3, 5]
    assert any("sglang 0.5.24 installed here maps ids for DeepseekV3ForCausalLM" in w for w in res2.warnings)


def test_installed_real_release_agrees_with_the_table(tmp_path, deepseek, monkeypatch):
    from eyas.engine_source import SourceError, download_wheel

    try:
        wheel = download_wheel("sglang", "0.5.23")
    except SourceError as e:
        pytest.skip(f"sglang 0.5.23's wheel is not available here: {e}")
    monkeypatch.setenv("EYAS_SGLANG_SOURCE", str(wheel))
    res = export(make_draft(tmp_path / "d", deepseek, [3, 4, 6]), "sglang", tmp_path / "sg", deepseek)
    assert _ids(res.path) == [3, 4, 6]
    c, lint = _aux(res.path, "0.5.23")
    src = next(x for x in lint.checks if x.name == "engine_source")
    assert src.status == "pass" and "as the table's sglang 0.5.23 does (plus1_if_first_is_1" in src.summary
    assert c.status == "pass"
