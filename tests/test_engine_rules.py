"""The aux-id rules in eyas/aux_rules.py held to the engines' own code: each row is re-derived from its release's
files (SGLang's wheels from the package registry, vLLM's installed CPU build) by running each architecture's
rule on a stand-in (eyas/engine_source.py), so a row cannot drift from its source. A planted wrong rule fails.
SGLang's wheel is downloaded into eyas's cache (~40 MB for 0.5.23); without the registry the test is skipped."""

from __future__ import annotations

import glob
import os
from pathlib import Path

import pytest

from eyas import aux_rules
from eyas.engine_source import (
    SourceError,
    class_fields,
    classify,
    config_keys,
    download_wheel,
    find_class,
    open_source,
    sglang_silent_default,
    sglang_tapped,
    sglang_topk1_rewrite,
    vllm_config_ids,
    vllm_tapped,
)

ROOT = Path(__file__).resolve().parents[1]


def _sglang(version: str):
    try:
        return open_source(download_wheel("sglang", version), "sglang")
    except SourceError as e:
        pytest.skip(f"sglang {version}'s wheel is not available here: {e}")


def _vllm():
    env = os.environ.get("EYAS_VLLM_SOURCE")
    sites = [env] if env else glob.glob(str(ROOT / ".venv-vllm/lib/python3*/site-packages"))
    if not sites or not Path(sites[0]).joinpath("vllm").is_dir():
        pytest.skip("no vLLM installed (`make vllm`)")
    return open_source(sites[0], "vllm")


def _derive(src, rules: aux_rules.AuxRules) -> dict[str, tuple[str, str]]:
    tap = sglang_tapped if src.engine == "sglang" else vllm_tapped
    out = {}
    for arch in rules.rules:
        t = tap(src, arch, [1, 5, 9], 12)
        kind = "none" if t.layers is None else classify(lambda ids, L, a=arch: tap(src, a, ids, L).layers)
        out[arch] = (kind, t.source if t.layers is not None else rules.rules[arch][1])
    return out


def _check_row(src, rules: aux_rules.AuxRules) -> None:
    derived = _derive(src, rules)
    assert {a: k for a, (k, _) in derived.items()} == {a: k for a, (k, _) in rules.rules.items()}
    for arch, (kind, source) in derived.items():
        if kind != "none":  # the row names the file and function the rule came from
            assert source == rules.rules[arch][1], arch
    tap = sglang_tapped if src.engine == "sglang" else vllm_tapped
    final = {a for a, (k, _) in rules.rules.items() if k != "none" and tap(src, a, [1, 2], 4).final}
    assert final == set(rules.final)
    draft = f"{'sglang/srt/models' if src.engine == 'sglang' else 'vllm/model_executor/models'}/llama_eagle3.py"
    assert config_keys(src, draft) & set(aux_rules.KEYS) == set(rules.draft_keys)
    # the fc width follows the id count exactly when the loader reads num_aux_hidden_states
    assert (rules.fc_width == "ids") == ("num_aux_hidden_states" in config_keys(src, draft))


@pytest.mark.parametrize("release", ["0.5.23", "0.5.6"])
def test_sglang_rows_equal_their_wheels(release):
    rules = aux_rules.release_rules("sglang", release)
    src = _sglang(release)
    _check_row(src, rules)
    mla = src.read("sglang/srt/models/kimi_k25_eagle3.py")
    assert (mla is not None) == (rules.mla_draft_keys is not None)
    if mla is not None:
        assert config_keys(src, "sglang/srt/models/kimi_k25_eagle3.py") & set(aux_rules.KEYS) == rules.mla_draft_keys
    fields = class_fields(src, "sglang/srt/entrypoints/openai/protocol.py", "SpecTokensDetails")
    assert (tuple(fields) if fields else None) == rules.spec_fields
    # the silent default: a config without ids -> [2, L//2, L-3] on the llama path, caught without a log line
    assert sglang_tapped(src, "LlamaForCausalLM", None, 30).layers == [2, 15, 27]
    silent = sglang_silent_default(src)
    assert silent is not None and silent[0] == rules.silent_default
    # topk 1: num_draft_tokens rewritten to steps + 1 with only a warning
    assert (sglang_topk1_rewrite(src) is not None) == rules.topk1_rewrite


def test_sglang_0523_live_table():
    """The rule, run from 0.5.23's own files, gives the streams measured live on SGLang 0.5.23 (CPU, bf16),
    matched against transformers' hidden states (the table in the SGLang issue of 2026-12)."""
    src = _sglang("0.5.23")
    live = [("LlamaForCausalLM", 30, [1, 14, 26], [2, 15, 27]), ("LlamaForCausalLM", 30, [2, 15, 27], [3, 16, 28]),
            ("DeepseekV3ForCausalLM", 4, [1, 2], [2, 3]), ("DeepseekV3ForCausalLM", 4, [2, 3], [2, 3]),
            ("DeepseekV3ForCausalLM", 4, [0, 2], [0, 2]), ("Qwen3MoeForCausalLM", 4, [0, 2], [1, 3])]
    for arch, L, ids, streams in live:
        assert sglang_tapped(src, arch, ids, L).layers == streams, (arch, ids)
        assert aux_rules.capture(aux_rules.release_rules("sglang", "0.5.23"), arch, ids, L).streams == streams


def test_wrappers_delegate_to_the_class_their_file_builds():
    src = _sglang("0.5.23")
    from eyas.engine_source import WRAPS

    for wrapper, inner in WRAPS.items():
        cls = find_class(src, wrapper)
        assert cls is not None, wrapper
        text = src.read(cls.file) or ""
        # the wrapper file names its text model's class or the module defining it
        inner_cls = find_class(src, inner)
        assert inner_cls is not None and (inner in text or Path(inner_cls.file).stem in text), wrapper


def test_vllm_row_equals_the_installed_engine():
    src = _vllm()
    rules = aux_rules.release_rules("vllm", src.version)
    _check_row(src, rules)
    # the config reader: top-level ids first, eagle_config's used as they are, none -> the model default
    assert vllm_config_ids(src, {"eagle_aux_hidden_state_layer_ids": [2, 15, 27],
                                 "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}}) == [2, 15, 27]
    assert vllm_config_ids(src, {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}}) == [1, 14, 26]
    assert vllm_config_ids(src, {}) is None


@pytest.mark.slow
def test_vllm_033_gpu_wheel_reads_as_the_row():
    """vLLM 0.33.0, the GPU release (a 336 MB wheel, read, never installed): the same rules as 0.32."""
    try:
        src = open_source(download_wheel("vllm", "0.33.0"), "vllm")
    except SourceError as e:
        pytest.skip(f"vllm 0.33.0's wheel is not available here: {e}")
    rules = aux_rules.release_rules("vllm", "0.33.0")
    _check_row(src, rules)
    assert vllm_config_ids(src, {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}}) == [1, 14, 26]


def test_a_planted_wrong_rule_fails_the_pin(monkeypatch):
    """deepseek_v2 given the llama rule (+1 always, what eyas believed before 0.5.23 was read): the pin fails."""
    rules = aux_rules.release_rules("sglang", "0.5.23")
    src = _sglang("0.5.23")
    planted = dict(rules.rules)
    planted["DeepseekV3ForCausalLM"] = ("plus1", planted["DeepseekV3ForCausalLM"][1])
    wrong = aux_rules.AuxRules(**{**rules.__dict__, "rules": planted})
    with pytest.raises(AssertionError):
        _check_row(src, wrong)
