from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    """Every test runs with one torch thread. The tiny models gain nothing from intra-op threads, and on a shared
    2-core machine OpenMP's spinning threads made small ops 30-1000x slower (measured on an AMD EPYC Zen 3); results are
    identical either way, only the wall time changes. Benchmarks, not tests, measure speed."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def smollm2():
    """The real bundled target, loaded once per test run (fp32)."""
    from eyas.target.load import load_target

    return load_target("smollm2-135m", dtype="fp32")


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(tmp_path_factory):
    """A folder with the bundled target's tokenizer files (tokenizer.json, tokenizer_config.json,
    chat_template.jinja), without loading its weights: the converted cache folder load_target reads its tokenizer
    from, when this GGUF's conversion is there; else the GGUF's own tokenizer saved the way the conversion saves
    it (transformers' GGUF tokenizer reader, ~10 s, still no weights)."""
    from transformers import AutoTokenizer

    from eyas.files import cache_dir
    from eyas.target.convert import file_fingerprint
    from eyas.target.family import bundled_gguf
    from eyas.target.load import _cache_entry_ok

    gguf = bundled_gguf("smollm2-135m")
    fp = file_fingerprint([gguf])
    folder = cache_dir() / "targets" / f"{gguf.stem}-{fp.split(':')[1][:12]}"  # load_target's cache entry
    if _cache_entry_ok(folder, fp) and (folder / "tokenizer.json").is_file():
        return folder
    folder = tmp_path_factory.mktemp("smollm2-tokenizer")
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_tokenizer_dir):
    """The bundled target's tokenizer (what `smollm2.tokenizer` is), read the way load_target reads it, without
    the model: for tests that only tokenize or render its chat template. Tests that change it deepcopy it first."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)


@pytest.fixture(scope="session")
def vllm_py():
    """vLLM's python for the tests that run the real engine (a skip, with the reason, where there is none; found
    here rather than at collection, because finding it imports vLLM once)."""
    from eyas.vllm.env import VllmError, vllm_python

    try:
        return vllm_python(needed_for="the vLLM tests")
    except VllmError as e:
        pytest.skip(f"no vLLM python: {e}")


@pytest.fixture(scope="module")
def served_target(smollm2_tokenizer, tmp_path_factory):
    """A tiny random Llama with the SmolLM2 tokenizer, saved and reloaded as a target, plus a random draft (the
    server tests' target)."""
    from eyas.draft import DraftConfig, Eagle3Draft, save_draft
    from tests.serving import chat_target

    root = tmp_path_factory.mktemp("serve")
    target = chat_target(smollm2_tokenizer, root / "target", layers=8, context=2048)
    dcfg = DraftConfig.from_target_config(target.config, draft_vocab_size=1024)
    torch.manual_seed(1)
    draft = Eagle3Draft(dcfg)
    draft.set_vocab_map(torch.arange(1024))
    save_draft(root / "draft", draft, target.default_layout())
    return target, root / "draft"


@pytest.fixture(scope="module")
def served(served_target):
    """A uvicorn server over served_target (tests/serving.py's Served), one per test module that asks for it."""
    from tests.serving import Served

    s = Served(*served_target)
    yield s
    s.close()


@pytest.fixture(scope="session")
def pair(tmp_path_factory):
    """The doctor tests' clean tiny pair (tests/doctor_pair.py's Pair), trained once per run."""
    from tests.doctor_pair import Pair

    return Pair(tmp_path_factory.mktemp("doctor-pair"))


@pytest.fixture(scope="session")
def tiny_dir(smollm2_tokenizer, tmp_path_factory):
    """The datagen tests' tiny random Llama with the SmolLM2 tokenizer, saved as a HF folder."""
    from tests.test_datagen import _save_tiny

    return _save_tiny(tmp_path_factory.mktemp("tiny-target"), smollm2_tokenizer, seed=0)


@pytest.fixture(scope="session")
def tiny_target(tiny_dir):
    from eyas.target.load import load_target

    return load_target(str(tiny_dir))


@pytest.fixture(scope="session")
def conv_file(tmp_path_factory):
    """60 real ShareGPT conversations (short opening question, so short --max-len keeps a reply) as JSONL with
    two bad rows mixed in (row ids 5 and 11)."""
    import json

    from eyas.data.conversations import load_conversations

    convs = [c for c in load_conversations("sharegpt", num=400)[0] if len(c.messages[0]["content"]) < 200][:60]
    assert len(convs) == 60
    lines = [json.dumps({"conversations": [{"from": m["role"], "value": m["content"]} for m in c.messages]})
             for c in convs]
    lines.insert(5, json.dumps({"conversations": [{"from": "human", "value": "unanswered"}]}))
    lines.insert(11, "{broken")
    p = tmp_path_factory.mktemp("data") / "convs.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p
