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


def train_fc_norm_draft(target, steps: int = 60):
    """A draft with fc_norm fitted by eyas's TTT on the target's own greedy continuations (tests/test_engine.py's
    recipe, a few seconds)."""
    from dataclasses import replace

    from eyas.draft import Eagle3Draft, random_draft
    from eyas.engine.decode import Engine
    from eyas.engine.params import SamplingParams, SpecParams
    from eyas.target.capture import capture
    from eyas.train.ttt import ttt_forward
    from tests.test_engine import PROMPTS, VOCAB, prompts_for_training

    ck = random_draft(target, draft_vocab=VOCAB, seed=2)
    ck.model = Eagle3Draft(replace(ck.model.config, fc_norm=True))
    ck.model.set_vocab_map(torch.arange(VOCAB))
    plain = Engine(target, None, SpecParams(method="plain"))
    seqs = [p + plain.generate(p, SamplingParams(max_new_tokens=40)).token_ids
            for p in PROMPTS + prompts_for_training(28)]
    S = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), S, dtype=torch.long)
    mask = torch.zeros(len(seqs), S, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = torch.tensor(s), True
    cap = capture(target.model, ids, ck.layout)
    d = ck.model
    d.set_embeddings(target.embed_tokens().weight)
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    d.train()
    for _ in range(steps):
        out = ttt_forward(d, cap.aux, cap.final_prenorm, ids, mask, target.final_norm(), target.lm_head(), 3)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    d.eval()
    return ck


@pytest.fixture(scope="module")
def tiny31():
    from tests.test_engine import make_target as engine_target

    tgt = engine_target()
    return tgt, train_fc_norm_draft(tgt)


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
