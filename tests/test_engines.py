"""The versioned engine table (eyas/engines.py), the export's self-check against it, and EAGLE 3.1 (fc_norm) drafts
through train, export, import and the lint. Tiny random models; seconds."""

from __future__ import annotations

import json

import pytest
import torch

from eyas.doctor.flags import FlagsError, lint_serve_command
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
    assert lint.ok and "the version the export targets" in by_name(lint)["engine_version"].summary
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
