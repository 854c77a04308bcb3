"""The llama.cpp peers of `eyas bench`: decode tok/s after the prefill (every install), and the `llama-cpp-c` method
(llama.cpp's C API through llama-cpp-python's ctypes bindings) on the bundled GGUF, which runs only where
`make llama-cpp` installed llama-cpp-python (CI does not)."""

from __future__ import annotations

import json

import pytest
import torch

from eyas.bench.config import BenchConfig, BenchError, parse_methods
from eyas.bench.methods import Output
from eyas.bench.prompts import BenchPrompt
from eyas.bench.rows import decode_tok_s, make_row


def test_decode_tok_s_counts_tokens_after_the_prefill():
    p = BenchPrompt("a", "x", [])
    rows = [make_row(p, "llama-cpp-c", Output([1, 2, 3, 4], 1.0, 5, "stop", prefill_s=0.2)),  # 4 later tokens
            make_row(p, "llama-cpp-c", Output([5, 6], 0.5, 2, "length", prefill_s=0.1))]  # 1 later token
    assert rows[0]["prefill_s"] == 0.2
    assert decode_tok_s(rows) == pytest.approx(5 / 1.2)
    eyas = make_row(p, "plain", Output([1, 2, 3], 1.0, 3, "length", {"prefill_s": 0.5, "tau": 1.0}))
    assert "prefill_s" not in eyas and decode_tok_s([eyas]) == pytest.approx(2 / 0.5)
    hf = make_row(p, "hf-greedy", Output([1, 2, 3], 1.0, 3, "length"))
    assert decode_tok_s([hf]) is None and decode_tok_s([*rows, hf]) is None


def test_llama_cpp_c_is_a_named_peer():
    from eyas.bench.config import PEER_METHODS

    assert parse_methods("llama-cpp-c,plain,llama-cpp") == ["plain", "llama-cpp", "llama-cpp-c"]
    assert "llama-cpp-c" in PEER_METHODS


@pytest.fixture(scope="module")
def llama_c(smollm2):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (make llama-cpp)")
    from eyas.bench.llama_c import LlamaC

    return LlamaC(smollm2.gguf, torch.get_num_threads(), n_ctx=512)


def test_c_api_greedy_repeats_and_its_batch_path_agrees(llama_c, smollm2):
    """Two runs of one prompt give the same tokens (the cache is emptied between them); the all-row batch path
    (bench_verify) at explicit positions picks the same first token as the prompt's own decode."""
    import numpy as np

    from eyas.engine.prompt import chat_input_ids

    lc = llama_c.lc
    ids = list(chat_input_ids(smollm2.tokenizer, [{"role": "user", "content": "Name three colours."}]))
    a = llama_c.greedy(ids, 12, set())
    b = llama_c.greedy(ids, 12, set())
    assert a.token_ids == b.token_ids and 1 <= len(a.token_ids) <= 12
    assert a.decodes == 1 + len(a.token_ids) - 1  # one prompt call, then one per later token
    llama_c.clear()
    llama_c.prefill(ids[:-1])
    llama_c.decode_rows(ids[-1:])
    n_vocab = lc.llama_vocab_n_tokens(llama_c.vocab)
    logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(llama_c.ctx, 0), shape=(n_vocab,))
    assert int(logits.argmax()) == a.token_ids[0]
    with pytest.raises(BenchError, match="do not fit"):
        llama_c.greedy(ids, 512, set())
    with pytest.raises(BenchError, match="holds 1..512 rows, got 513"):
        llama_c.decode_rows([0] * 513)


def test_llama_cpp_c_bench_rows_on_the_bundled_gguf(llama_c, smollm2, tmp_path):
    from eyas.bench.run import run_bench

    cfg = BenchConfig(bench="mt-bench", limit=2, max_new_tokens=16, methods=["plain", "llama-cpp-c"],
                      out=str(tmp_path / "out"))
    res = run_bench(cfg, target=smollm2, progress=False, show=False)
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    rows = [r for r in saved["rows"] if r["method"] == "llama-cpp-c"]
    prompt_tokens = {r["prompt"]: r["stats"]["prompt_tokens"] for r in saved["rows"] if r["method"] == "plain"}
    assert len(rows) == 2 and all(0 < n < 512 for n in prompt_tokens.values())
    for r in rows:
        stopped = r["finish"] == "stop"
        assert 1 <= r["new_tokens"] <= 16 and (stopped or r["new_tokens"] == 16)
        # prompts under n_batch (512) tokens: one prefill call, then one llama_decode per later token
        assert r["target_forwards"] == 1 + r["new_tokens"] + stopped - 1
        assert 0 < r["prefill_s"] < r["seconds"]
        assert smollm2.tokenizer.decode(r["token_ids"], skip_special_tokens=True).strip()
        assert r["same_as_ref"] in (True, False)  # compared with eyas plain, as information
    s = res["summary"]["methods"]["llama-cpp-c"]
    assert s["compared"] == 2 and 0 <= s["identical"] <= 2 and s["new_tokens"] == sum(r["new_tokens"] for r in rows)
    assert s["decode_tok_s"] is not None and s["decode_tok_s"] > 0
