"""The versioned engine table (eyas/engines.py), the export's self-check against it, and EAGLE 3.1 (fc_norm) drafts
through train, export, import and the lint. Tiny random models; seconds."""

from __future__ import annotations

import json

import pytest
import torch

from eyas.doctor.flags import lint_serve_command
from eyas.doctor.launch_command import FlagsError
from eyas.draft import load_draft
from eyas.engines import TABLE, engine_row, loader_misfit, parse_version
from eyas.interop.export import ExportError, export_draft
from tests.test_export import LAYOUT, make_draft, make_target


@pytest.fixture(scope="module")
def target():
    return make_target()


def by_name(lint):
    return {c.name: c for c in lint.checks}


def vllm(d, **extra):
    return ["vllm", "serve", "M", "--speculative-config",
            json.dumps({"method": "eagle3", "model": str(d), "num_speculative_tokens": 3, **extra})]


def sglang(d):
    return ["python", "-m", "sglang.launch_server", "--model-path", "M", "--speculative-algorithm", "EAGLE3",
            "--speculative-draft-model-path", str(d), "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", "4"]


# ---- the table --------------------------------------------------------------------------------------

def test_versions_parse_and_pick_the_nearest_verified_row():
    assert parse_version("0.32") == (0, 32) and parse_version("v0.32.1") == (0, 32, 1)
    assert parse_version("0.5.3rc2") == (0, 5, 3)
    with pytest.raises(ValueError, match="not a version"):
        parse_version("latest")
    assert engine_row("vllm", "0.32.0").row.versions == "0.32"
    c = engine_row("vllm", None)
    assert "assuming vllm 0.32" in c.why and "newest verified" in c.why
    c = engine_row("vllm", None, exported_for="0.32")
    assert "the version the export targets" in c.why
    assert "beyond the verified" in engine_row("vllm", "0.40").why
    assert "beyond the verified sglang 0.5" in engine_row("sglang", "0.5.14").why
    assert "older than the verified" in engine_row("vllm", "0.10").why
    assert {r.engine for r in TABLE} == {"sglang", "vllm"}


def test_loaders_differ_on_unknown_and_prefixed_names():
    names = ["fc.weight", "midlayer.self_attn.q_proj.weight", "model.norm.weight", "fc_norm.0.weight"]
    sg, vl = (engine_row(e, None).row for e in ("sglang", "vllm"))
    # SGLang accepts model.<name>; vLLM 0.32 prefixes model. itself, so a stored one doubles and is refused
    assert loader_misfit(names, {}, sg)[0] == ["fc_norm.0.weight"]
    assert loader_misfit(names, {}, vl)[0] == ["model.norm.weight", "fc_norm.0.weight"]
    assert loader_misfit(names, {"fc_norm": True}, vl)[0] == ["model.norm.weight"]
    missing = loader_misfit(names, {"fc_norm": True, "vocab_size": 9, "draft_vocab_size": 4}, vl)[1]
    assert "d2t" in missing and "fc_norm.1.weight" in missing and "lm_head.weight" in missing


def test_engine_flag_is_checked_against_the_command(tmp_path, target):
    out = export_draft(make_draft(tmp_path / "d", target, LAYOUT), "vllm", tmp_path / "x").path
    with pytest.raises(FlagsError, match="--engine sglang but the command starts vllm"):
        lint_serve_command(vllm(out), out, engine="sglang")
    with pytest.raises(FlagsError, match="expected one of"):
        lint_serve_command(vllm(out), out, engine="trt")
    with pytest.raises(FlagsError, match="not a version"):
        lint_serve_command(vllm(out), out, engine_version="newest")
    lint = lint_serve_command(vllm(out), out, engine="vllm")
    # with vLLM installed here (`make vllm`) its version decides, else the version the export targets
    said = by_name(lint)["engine_version"].summary
    assert lint.ok and ("the version installed here" in said or "the version the export targets" in said), said
    assert json.loads((out / "eyas_manifest.json").read_text())["engine_versions"]["vllm"] == "0.32"


# ---- the export checks its names against the engine it targets ----------------------------------------

@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_export_refuses_a_tensor_its_engine_would_not_load(tmp_path, target, fmt):
    ckpt = load_draft(make_draft(tmp_path / "d", target, LAYOUT))
    ckpt.model.register_buffer("fc_bias_extra", torch.zeros(3))  # planted: no engine has such a parameter
    with pytest.raises(ExportError, match=r"export self-check: .* 1 tensors it has no parameter for \(e\.g\. "
                                          r"fc_bias_extra\).*nothing was written") as e:
        export_draft(ckpt, fmt, tmp_path / "x")
    assert "\n" not in str(e.value) and not (tmp_path / "x").exists()


def test_export_refuses_a_missing_tensor(tmp_path, target, monkeypatch):
    import eyas.interop.export as export

    real = export.to_format_names
    monkeypatch.setattr(export, "to_format_names", lambda sd, fmt: {k: v for k, v in real(sd, fmt).items()
                                                                     if k != "midlayer.hidden_norm.weight"})
    with pytest.raises(ExportError, match=r"no tensor for 1 of its parameters \(e\.g\. midlayer\.hidden_norm"):
        export_draft(make_draft(tmp_path / "d", target, LAYOUT), "vllm", tmp_path / "x")


# ---- EAGLE 3.1: fc_norm ---------------------------------------------------------------------------------

def test_fc_norm_is_one_rmsnorm_per_aux_state_before_fc():
    """speculators models/eagle3/core.py, SpecForge llama3_eagle.py project_hidden_states and vLLM 0.32
    combine_hidden_states: cat(RMSNorm_i(chunk_i)) -> fc, eps = rms_norm_eps, each norm target_hidden_size wide."""
    from eyas.draft import DraftConfig, Eagle3Draft

    cfg = DraftConfig(hidden_size=16, target_hidden_size=12, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                      intermediate_size=32, vocab_size=50, draft_vocab_size=50, rms_norm_eps=1e-5, fc_norm=True)
    torch.manual_seed(0)
    d = Eagle3Draft(cfg)
    with torch.no_grad():
        for n in d.fc_norm:
            n.weight.uniform_(0.5, 1.5)
    assert [k for k in d.state_dict() if k.startswith("fc_norm.")] == [f"fc_norm.{i}.weight" for i in range(3)]
    x = torch.randn(2, 5, 36) * 40
    chunks = [x[..., 12 * i:12 * (i + 1)] for i in range(3)]
    ref = torch.cat([n.weight * c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-5)
                     for n, c in zip(d.fc_norm, chunks, strict=True)], -1) @ d.fc.weight.T
    assert torch.allclose(d.fuse(x), ref, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(d.fuse(x), d.fc(x))  # the norm changes what fc sees
    assert d.config.hf_config(None)["fc_norm"] is True
    assert "fc_norm" not in DraftConfig(**{**cfg.to_dict(), "fc_norm": False}).hf_config(None)


@pytest.fixture(scope="module")
def tiny31():
    from tests.test_engine import make_target as engine_target
    from tests.test_engine import train_draft

    tgt = engine_target()
    return tgt, train_draft(tgt, steps=60, fc_norm=True)


def test_fc_norm_draft_trains_and_decodes_losslessly_in_torch_and_q8(tiny31):
    from eyas.engine.decode import Engine
    from eyas.engine.params import SamplingParams, SpecParams
    from tests.test_engine import PROMPTS, greedy

    tgt, ck = tiny31
    assert all(not torch.equal(n.weight, torch.ones_like(n.weight)) for n in ck.model.fc_norm)  # trained
    plain = Engine(tgt, None, SpecParams(method="plain"))
    for weights in ("fp32", "q8"):
        eng = Engine(tgt, ck, SpecParams("tree", depth=3, topk=2, tokens=6, draft_weights=weights))
        assert eng.draft.fc_norm is not None
        assert (eng.draft_layer is not None) == (weights == "q8")  # the native layer runs after fc_norm and fc
        for p in PROMPTS:
            assert greedy(eng, p) == greedy(plain, p)
        st = eng.generate(PROMPTS[2], SamplingParams(max_new_tokens=40)).stats
        assert st.tau > 1.5, st  # the draft learned through its norms


@pytest.mark.parametrize("fmt", ["sglang", "vllm", "speculators"])
def test_fc_norm_round_trip_is_bit_identical(tmp_path, tiny31, fmt):
    from eyas.draft import save_draft
    from eyas.interop.importer import import_draft
    from tests.test_export import assert_same_draft, export

    tgt, ck = tiny31
    src = save_draft(tmp_path / "d", ck.model, ck.layout, extra={"target_source": "tiny"})
    res = export(src, fmt, tmp_path / fmt, tgt)
    assert res.config["fc_norm"] is True
    names = json.loads((res.path / "eyas_manifest.json").read_text())
    assert names["draft_config"]["fc_norm"] is True
    (res.path / "eyas_manifest.json").unlink()  # import by config and weights alone, as a foreign folder
    back = import_draft(res.path, tgt, tmp_path / "back", fmt=fmt, infer=False)
    assert back.checkpoint.model.config.fc_norm
    assert_same_draft(load_draft(src), back.checkpoint, tgt)


def test_train_offers_fc_norm_and_records_it_as_part_of_the_trajectory():
    from typer.testing import CliRunner

    from eyas.cli import app
    from eyas.train.config import TrainConfig

    assert "--fc-norm" in CliRunner().invoke(app, ["train", "--help"], terminal_width=200).output
    assert "fc_norm" in TrainConfig.TRAJECTORY and TrainConfig(data=["x"], out="o").fc_norm is False


# ---- each trap: planted, caught in one line with its fix; the clean case passes ------------------------------

@pytest.fixture(scope="module")
def exports31(tmp_path_factory, tiny31):
    from eyas.draft import save_draft

    tgt, ck = tiny31
    root = tmp_path_factory.mktemp("exports31")
    src = save_draft(root / "d", ck.model, ck.layout, extra={"target_source": "tiny"})
    return {fmt: export_draft(src, fmt, root / fmt).path for fmt in ("sglang", "vllm")}


def planted(tmp_path, export, config=None, weights=None):
    """A copy of an export with its config.json edited and/or tensors changed (the manifest's file record dropped,
    so the lint reads the planted weights instead of refusing a damaged folder)."""
    import shutil

    from safetensors.torch import load_file, save_file

    d = tmp_path / "planted"
    shutil.copytree(export, d)
    if config is not None:
        cfg = json.loads((d / "config.json").read_text())
        config(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    if weights is not None:
        sd = load_file(d / "model.safetensors")
        weights(sd)
        save_file(sd, d / "model.safetensors")
        man = json.loads((d / "eyas_manifest.json").read_text())
        man.pop("files", None)
        (d / "eyas_manifest.json").write_text(json.dumps(man))
    return d


def test_eagle31_draft_in_an_sglang_that_ignores_fc_norm_is_caught(exports31):
    sg, vl = exports31["sglang"], exports31["vllm"]
    lint = lint_serve_command(sglang(sg), sg, engine_version="0.5.6")
    c = by_name(lint)["fusion_norm"]
    assert c.status == "fail" and "never reads" in c.summary and "τ near 1" in c.summary and "vLLM >= 0.32" in c.fix
    assert not lint.ok
    # SGLang 0.5.23 reads fc_norm (llama_eagle3.py LlamaModel): the same export passes
    lint = lint_serve_command(sglang(sg), sg, engine_version="0.5.23")
    assert lint.ok, [(c.name, c.status, c.summary) for c in lint.checks if c.status not in ("pass", "skip")]
    assert by_name(lint)["fusion_norm"].summary == "fc_norm read by sglang 0.5.23"
    lint = lint_serve_command(vllm(vl), vl)  # vLLM 0.32 reads fc_norm: the clean case
    assert lint.ok, [(c.name, c.status, c.summary) for c in lint.checks if c.status != "pass"]
    assert by_name(lint)["fusion_norm"].summary == "fc_norm read by vllm 0.32"


def test_fusion_norm_weights_without_their_key_and_the_key_without_weights(tmp_path, exports31, target):
    d = planted(tmp_path, exports31["vllm"], config=lambda c: c.pop("fc_norm"))
    lint = lint_serve_command(vllm(d), d)
    assert by_name(lint)["fusion_norm"].fix == 'set "fc_norm": true in the draft\'s config.json'
    w = by_name(lint)["weights"]
    assert w.status == "fail" and "refuses them at load" in w.summary and "fc_norm.0.weight" in w.summary
    plain = export_draft(make_draft(tmp_path / "p", target, LAYOUT), "vllm", tmp_path / "plain").path
    d2 = planted(tmp_path / "b", plain, config=lambda c: c.update(fc_norm=True))
    lint = lint_serve_command(vllm(d2), d2)
    assert "adds a norm the draft was not trained with" in by_name(lint)["fusion_norm"].summary
    assert "fc_norm.0.weight" in by_name(lint)["weights"].summary  # and leaves it at its initial value


def test_a_norm_vllm_drops_without_a_word(tmp_path, exports31):
    # llama_eagle3.py load_weights maps input_norm. to None unless norm_before_fc: the tensor vanishes
    d = planted(tmp_path, exports31["vllm"], weights=lambda sd: sd.update({"input_norm.weight": torch.ones(96)}))
    w = by_name(lint_serve_command(vllm(d), d))["weights"]
    assert w.status == "fail" and "drops them without a word" in w.summary and "input_norm.weight" in w.summary


def test_norm_output_in_an_eyas_config_is_caught(tmp_path, exports31):
    d = planted(tmp_path, exports31["vllm"], config=lambda c: c.update(norm_output=True))
    c = by_name(lint_serve_command(vllm(d), d))["fusion_norm"]
    assert c.status == "fail" and "post-norm" in c.summary and c.fix == 'set "norm_output": false'


def test_missing_d2t_with_a_smaller_draft_vocabulary_is_caught(tmp_path, target):
    out = export_draft(make_draft(tmp_path / "d", target, LAYOUT), "vllm", tmp_path / "x").path
    d = planted(tmp_path, out, weights=lambda sd: sd.pop("d2t"))
    for argv in (vllm(d), sglang(d)):
        w = by_name(lint_serve_command(argv, d))["weights"]
        assert w.status == "fail" and "(e.g. d2t)" in w.summary and "initial values" in w.summary


def test_vllm_drafts_greedily_at_temperature_unless_told(tmp_path, target):
    out = export_draft(make_draft(tmp_path / "d", target, LAYOUT), "vllm", tmp_path / "x").path
    assert by_name(lint_serve_command(vllm(out), out))["draft_sampling"].status == "pass"
    argv = [*vllm(out), "--override-generation-config", '{"temperature": 0.7}']
    lint = lint_serve_command(argv, out)
    c = by_name(lint)["draft_sampling"]
    assert c.status == "warn" and "argmax" in c.summary and c.fix == '"draft_sample_method": "probabilistic"'
    fixed = json.loads(lint.corrected[lint.corrected.index("--speculative-config") + 1])
    assert fixed["draft_sample_method"] == "probabilistic"
    assert lint_serve_command([*argv[:-2], "--override-generation-config", '{"temperature": 0.7}'][:4] + [
        json.dumps({"method": "eagle3", "model": str(out), "num_speculative_tokens": 3,
                    "draft_sample_method": "probabilistic"}), *argv[5:]], out).ok


def test_vllm_032_has_no_draft_tree(tmp_path, target):
    out = export_draft(make_draft(tmp_path / "d", target, LAYOUT), "vllm", tmp_path / "x").path
    lint = lint_serve_command(vllm(out, speculative_token_tree="[(0,), (1,), (0, 0)]"), out)
    c = by_name(lint)["speculative_config"]
    assert c.status == "fail" and "chains only" in c.summary and "speculative_token_tree" in c.fix
    assert "speculative_token_tree" not in json.loads(lint.corrected[lint.corrected.index("--speculative-config")
                                                                     + 1])


# ---- vLLM 0.32 serves an EAGLE 3.1 export, and refuses its tensors without the key -----------------------------

@pytest.mark.vllm
@pytest.mark.integration
@pytest.mark.slow
def test_vllm_032_serves_an_eagle31_export(tmp_path, smollm2_tokenizer_dir, vllm_py):
    """A tiny Llama target (the bundled tokenizer) and a random fc_norm draft exported by eyas: vLLM 0.32 starts,
    drafts and answers; the same export without "fc_norm": true is refused at load in vLLM's own words (its loader
    has no fc_norm module then), which shows it is the key that makes vLLM build the norms."""
    import shutil
    from dataclasses import replace

    import httpx
    import transformers as tf

    from eyas.draft import Eagle3Draft, random_draft, save_draft
    from eyas.target.load import load_target
    from tests.test_doctor_serving import _start, _stop, wait_up

    folder = tmp_path / "target"
    cfg = tf.LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)  # head_dim 64: vLLM CPU's
    torch.manual_seed(0)
    m = tf.LlamaForCausalLM(cfg).eval()
    m.config.architectures = ["LlamaForCausalLM"]
    m.save_pretrained(folder)
    for f in smollm2_tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")) or f.suffix == ".jinja":
            shutil.copy(f, folder / f.name)
    ck = random_draft(load_target(str(folder)), draft_vocab=1024, seed=1)
    d = Eagle3Draft(replace(ck.model.config, fc_norm=True))
    d.load_state_dict(ck.model.state_dict(), strict=False)
    with torch.no_grad():
        for n in d.fc_norm:
            n.weight.uniform_(0.5, 1.5)
    src = save_draft(tmp_path / "draft", d, ck.layout, extra={"target_source": str(folder)})
    out = export_draft(src, "vllm", tmp_path / "export", target=str(folder)).path
    spec = {"method": "eagle3", "model": str(out), "num_speculative_tokens": 3}
    assert lint_serve_command(vllm(out), out).ok
    log = tmp_path / "serve.log"
    p, url = _start(vllm_py, folder, spec, log)
    try:
        wait_up(p, url, log)
        r = httpx.post(url + "/v1/completions", json={"model": str(folder), "prompt": "Hello there", "max_tokens": 24,
                                                      "temperature": 0}, timeout=300)
        assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
        metrics = httpx.get(url + "/metrics", timeout=30).text
        drafts = [x for x in metrics.splitlines() if x.startswith("vllm:spec_decode_num_drafts_total")]
        assert drafts and float(drafts[0].split()[-1]) > 0, metrics[-2000:]
    finally:
        _stop(p)
    # the same folder without the key: vLLM has no fc_norm module and refuses the tensors at start
    cfgj = json.loads((out / "config.json").read_text())
    cfgj.pop("fc_norm")
    (out / "config.json").write_text(json.dumps(cfgj))
    assert not lint_serve_command(vllm(out), out).ok
    p, url = _start(vllm_py, folder, spec, log)
    try:
        p.wait(timeout=900)
    finally:
        _stop(p)
    text = log.read_text()
    said = [line for line in text.splitlines() if "There is no module or parameter named" in line]
    assert said and "fc_norm" in said[-1], "\n".join(x for x in text.splitlines() if "Error" in x)[-3000:]
    print(f"\nvLLM's own words: {said[-1].strip()[:200]}")


def test_d2t_of_absolute_ids_instead_of_offsets_is_caught(tmp_path, target):
    # both engines compute target = draft id + d2t (SGLang hot_token_id, vLLM 0.32 compute_logits)
    out = export_draft(make_draft(tmp_path / "d", target, LAYOUT), "vllm", tmp_path / "x").path
    assert by_name(lint_serve_command(vllm(out), out))["vocab_map"].status == "pass"
    d = planted(tmp_path, out, weights=lambda sd: sd.update(d2t=sd["d2t"] + torch.arange(sd["d2t"].numel())))
    for argv in (vllm(d), sglang(d)):
        c = by_name(lint_serve_command(argv, d))["vocab_map"]
        assert c.status == "fail" and "absolute target ids" in c.summary and "offsets" in c.fix


def test_a_specforge_eagle31_config_imports(tmp_path, tiny31, exports31):
    """SpecForge's configs/qwen3-30B-A3B-eagle3.1.json: "fc_norm": true and "norm_output": true, where its
    norm_output means the usual norm before lm_head (llama3_eagle.py compute_logits), which eyas's draft has."""
    from eyas.interop.importer import import_draft

    tgt, ck = tiny31
    d = planted(tmp_path, exports31["sglang"], config=lambda c: c.update(norm_output=True))
    (d / "eyas_manifest.json").unlink()
    back = import_draft(d, tgt, tmp_path / "back", fmt="specforge", infer=False)
    assert back.checkpoint.model.config.fc_norm
    assert any("SpecForge's" in n for n in back.info["notes"])
    for a, b in zip(ck.model.fc_norm, back.checkpoint.model.fc_norm, strict=True):
        assert torch.equal(a.weight, b.weight)


def test_norm_before_residual_sglang_never_reads(tmp_path, target):
    out = export_draft(make_draft(tmp_path / "d", target, LAYOUT), "sglang", tmp_path / "x").path
    assert by_name(lint_serve_command(sglang(out), out))["residual"].status == "pass"
    d = planted(tmp_path, out, config=lambda c: c.update(norm_before_residual=True))
    c = by_name(lint_serve_command(sglang(d), d))["residual"]
    assert c.status == "fail" and "never reads" in c.summary
    assert by_name(lint_serve_command(vllm(d), d))["residual"].status == "pass"  # vLLM 0.32 reads it
