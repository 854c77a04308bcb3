"""GGUF targets compute the model they came from: a tiny random HF model per family the engine covers, written
the way llama.cpp's convert_hf_to_gguf.py writes it (tests/gguf_write.py), loaded by eyas, and compared with the
original's logits. Llama 3 RoPE scaling reaches the GGUF only as the rope_freqs divisors; eyas recovers it."""

from __future__ import annotations

import pytest
import torch

from eyas.target.family import TargetError
from eyas.target.gguf_config import llama3_divisors, recover_llama3, rope_summary
from tests.gguf_write import write_gguf
from tests.tiny import tiny_model

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3_text"]
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64, "rope_theta": 100.0}  # theta 100: 3 of 8 dims in the smooth band


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))


def _model(family: str, rope: dict | None = None) -> torch.nn.Module:
    """hidden 64 / 4 heads: head_dim 16, 8 RoPE frequencies, so a Llama 3 scaling has low, smooth and high dims."""
    m = tiny_model(family, hidden=64)
    cfg = m.config
    if family == "mistral":
        cfg.sliding_window = None  # llama.cpp writes Mistral as `llama`, whose graph has no window
    if family == "gemma3_text":
        # the GGUF carries no query_pre_attn_scalar: llama.cpp (llama_model::load_hparams) scales queries by
        # 1/sqrt(head_dim), so the model a GGUF means has query_pre_attn_scalar == head_dim (every released Gemma 3
        # but the 27B, which llama.cpp special-cases); transformers' default is 256
        cfg.query_pre_attn_scalar = cfg.head_dim
    if rope is not None:
        cfg.rope_parameters = dict(rope)
    if family == "gemma3_text" or rope is not None:  # rebuilt from the edited config, same weights
        fresh = type(m)(cfg).eval()
        fresh.load_state_dict(m.state_dict())
        m = fresh
    return m


def _logits_eyas(target, ids: torch.Tensor, weights: str = "fp32") -> torch.Tensor:
    from eyas.engine.weights import engine_model

    tm = engine_model(target, weights)
    cache = tm.new_cache(1, ids.shape[1])
    pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        return tm.forward(ids, pos, cache, logits="all").logits  # [1, S, V]


@pytest.mark.parametrize("qtype", ["F32", "F16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_logits_match_the_original(tmp_path, family, qtype):
    from eyas.target.load import load_target

    m = _model(family)
    if qtype == "F16":  # the original, rounded the way the file stores it: the comparison stays exact
        with torch.no_grad():
            for p in m.parameters():
                if p.dim() == 2:
                    p.copy_(p.half().float())
    t = load_target(str(write_gguf(m, tmp_path / f"{family}.gguf", qtype)))
    ids = torch.randint(3, 120, (1, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = m(ids).logits
    assert (t.model(ids).logits - ref).abs().max() < 1e-4
    assert (_logits_eyas(t, ids) - ref).abs().max() < 1e-4
    assert t.model.config.model_type == ("llama" if family == "mistral" else family)


def test_llama3_rope_scaling_survives_the_gguf(tmp_path):
    from eyas.target.load import load_target

    m = _model("llama", LLAMA3)
    div = llama3_divisors(100.0, 16, 8.0, 1.0, 4.0, 64)
    assert 1 < int(((div > 1) & (div < 8)).sum())  # dims in the smooth band: the scaling is visible
    t = load_target(str(write_gguf(m, tmp_path / "l3.gguf", "F32", rope_freqs=div)))
    rp = t.model.config.rope_parameters
    assert rp["rope_type"] == "llama3" and rp["factor"] == 8.0
    assert torch.allclose(llama3_divisors(100.0, 16, rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"],
                                          rp["original_max_position_embeddings"]), div, rtol=1e-6)
    ids = torch.randint(3, 120, (1, 160), generator=torch.Generator().manual_seed(2))  # 2.5x the original context
    with torch.no_grad():
        ref = m(ids).logits
        # the same weights with the default RoPE eyas used to run
        unscaled = _model("llama", {"rope_type": "default", "rope_theta": 100.0})(ids).logits
    assert (unscaled - ref).abs().max() > 1e-3  # the scaling changes the output, so the match below means something
    assert (t.model(ids).logits - ref).abs().max() < 1e-4
    assert (_logits_eyas(t, ids) - ref).abs().max() < 1e-4
    assert rope_summary(t.model.config) == "llama3 factor 8 low 1 high 4 orig 64, theta 100"
    from typer.testing import CliRunner

    from eyas.cli import app

    res = CliRunner().invoke(app, ["inspect", str(tmp_path / "l3.gguf"), "--raw", "--json"])
    assert res.exit_code == 0, res.output
    assert '"rope": "llama3 factor 8 low 1 high 4 orig 64, theta 100"' in res.output


@pytest.mark.parametrize("params", [(8.0, 1.0, 4.0, 8192), (32.0, 1.0, 4.0, 8192), (8.0, 1.0, 4.0, 24),
                                    (4.0, 1.0, 3.0, 40), (16.0, 2.0, 5.0, 100)])
def test_recover_llama3_reproduces_the_divisors(params):
    for theta, dim in ((500000.0, 128), (10000.0, 16), (10000.0, 64)):
        div = llama3_divisors(theta, dim, *params)
        found = recover_llama3(div, theta, dim)
        assert found is not None, (params, theta, dim)
        again = llama3_divisors(theta, dim, found["factor"], found["low_freq_factor"], found["high_freq_factor"],
                                found["original_max_position_embeddings"])
        assert torch.allclose(again, div, rtol=1e-5, atol=1e-6)
    assert recover_llama3(llama3_divisors(500000.0, 128, 8.0, 1.0, 4.0, 8192), 500000.0, 128) == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}


def test_rope_freqs_no_llama3_scaling_reproduces_is_refused(tmp_path):
    from eyas.target.load import load_target

    m = _model("llama")
    div = llama3_divisors(100.0, 16, 8.0, 1.0, 4.0, 64)
    div[3] = 2.5  # a smooth-band value off the llama3 curve
    path = write_gguf(m, tmp_path / "odd.gguf", "F32", rope_freqs=div)
    with pytest.raises(TargetError, match="matches no Llama 3 rope scaling") as e:
        load_target(str(path))
    assert "\n" not in str(e.value)
    assert not (tmp_path / "cache" / "targets").exists() or not any((tmp_path / "cache" / "targets").iterdir())


def test_linear_rope_scaling_and_default_summary(tmp_path):
    from eyas.target.load import load_target

    m = _model("qwen2", {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})
    t = load_target(str(write_gguf(m, tmp_path / "lin.gguf", "F32")))
    ids = torch.randint(3, 120, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (_logits_eyas(t, ids) - m(ids).logits).abs().max() < 1e-4
    assert rope_summary(t.model.config) == "linear factor 4, theta 10000"
    assert rope_summary(_model("llama").config) == "default, theta 10000"


@pytest.mark.slow  # ~20 s: the native kernels build in the test's own cache folder
def test_native_greedy_agrees_with_fp32_on_a_q8_gguf(tmp_path):
    """Native mode reads the file's Q8_0 blocks; with the llama3-scaled RoPE its greedy tokens follow fp32's."""
    from eyas.engine.decode import Engine
    from eyas.engine.params import SamplingParams, SpecParams
    from eyas.target.load import load_target

    m = _model("llama", LLAMA3)
    div = llama3_divisors(100.0, 16, 8.0, 1.0, 4.0, 64)
    t = load_target(str(write_gguf(m, tmp_path / "q8.gguf", "Q8_0", rope_freqs=div)))
    ids = torch.randint(3, 120, (60,), generator=torch.Generator().manual_seed(4)).tolist()
    runs = {w: Engine(t, None, SpecParams(method="plain", weights=w)).generate(ids, SamplingParams(
        max_new_tokens=24)).token_ids for w in ("native", "fp32")}
    assert len(runs["fp32"]) == 24
    same = next((i for i, (a, b) in enumerate(zip(runs["native"], runs["fp32"], strict=False)) if a != b), 24)
    assert same >= 12, runs  # bf16/q8 activations may drift late, not early


@pytest.mark.parametrize("extra, why", [
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}, "rope.scaling.type 'yarn'"),
    ({"qwen2.rope.dimension_count": 4}, "rotary dims 4"),
    ({"qwen2.final_logit_softcapping": 30.0}, "final_logit_softcapping = 30"),
])
def test_gguf_keys_eyas_cannot_honour_are_refused(tmp_path, extra, why):
    from eyas.target.load import load_target

    family = "llama" if "llama.rope.scaling.type" in extra else "qwen2"
    path = write_gguf(_model(family), tmp_path / "x.gguf", "F32", extra=extra)
    with pytest.raises(TargetError, match=why) as e:
        load_target(str(path))
    assert "\n" not in str(e.value)


# every command that opens a target, on a GGUF transformers cannot read: (argv after the target, what runs it)
UNREADABLE = {
    "generate": ["generate", "--prompt", "hi", "--target"],
    "inspect": ["inspect"],
    "bench hf-greedy": ["bench", "--methods", "hf-greedy", "--bench", "mt-bench", "--limit", "1", "--target"],
    "bench eyas methods": ["bench", "--bench", "mt-bench", "--limit", "1", "--target"],
    "datagen": ["datagen", "--out", "OUT", "--num", "1", "--target"],
}


@pytest.mark.parametrize("command", list(UNREADABLE))
def test_a_gguf_transformers_cannot_read_gets_the_same_line_from_every_command(tmp_path, command):
    """llama.cpp names DeepSeek-V2/V3 'deepseek2'. generate once judged that name as a family ('unsupported') and
    sent the user to `eyas bench --methods hf-greedy`, which then refused the file; every command now says the
    one line of eyas.target.family.check_gguf_architecture, before anything else (a missing chat template
    included: this file has none)."""
    from typer.testing import CliRunner

    from eyas.cli import app
    from tests.tiny import gguf_bytes

    f = tmp_path / "k2.gguf"
    f.write_bytes(gguf_bytes("deepseek2"))
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in UNREADABLE[command]] + [str(f)]
    r = CliRunner().invoke(app, argv)
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert r.exit_code == 2 and len(errors) == 1 and "Traceback" not in r.output, r.output
    assert errors[0].startswith("error: k2.gguf: general.architecture 'deepseek2' (DeepSeek-V2/V3 and Kimi-K2, MLA "
                                "attention) is missing from transformers "), errors[0]
    assert errors[0].endswith("pass the Hugging Face model folder instead"), errors[0]
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()  # nothing written, nothing converted
