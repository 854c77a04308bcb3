"""The draft shipped in the package (eyas/assets/drafts/default): what it records, that the bundled target uses
it by default, and that any other target is refused."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from eyas.draft import DraftError, bundled_draft_path, check_draft_for_target, load_draft
from eyas.layout import LayoutError
from eyas.target.convert import tensor_fingerprint
from eyas.target.load import Target, identity_of
from tests.tiny import tiny_model

SHIPPED = bundled_draft_path()


def test_shipped_draft_is_fp16_small_and_documented():
    size = sum(p.stat().st_size for p in SHIPPED.iterdir())
    assert size <= 40 << 20, size
    with safe_open(SHIPPED / "model.safetensors", "pt") as f:
        floats = {f.get_slice(k).get_dtype() for k in f.keys()} - {"I64", "BOOL"}
    assert floats == {"F16"}
    man = json.loads((SHIPPED / "eyas_manifest.json").read_text())
    assert man["layout"]["aux_indices"] == [2, 15, 27]
    assert man["layout"]["target"]["name"] == "smollm2-135m"
    assert man["layout"]["target"]["fingerprint"].startswith("sha256:")
    assert len(man["metrics"]["heldout_acc"]) == man["training"]["ttt_steps"]
    assert man["training_time_s"] > 0 and man["command"] and man["data"]["hash"].startswith("sha256:")
    assert man["shipped"]["dtype"] == "float16"
    cfg = json.loads((SHIPPED / "config.json").read_text())
    assert cfg["target_hidden_size"] == 576 and cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]


def test_shipped_draft_refuses_another_target():
    m = tiny_model("llama", layers=30)  # another llama: every differing identity field is named
    other = Target(model=m, tokenizer=None, identity=identity_of(m, tensor_fingerprint(m), "other"), source="other",
                   path=None)
    with pytest.raises((LayoutError, DraftError), match="fingerprint"):
        check_draft_for_target(load_draft("default"), other)


@pytest.mark.integration
def test_default_draft_is_used_with_the_bundled_target_and_is_lossless(smollm2):
    from eyas.draft import resolve_draft
    from eyas.engine.decode import Engine, chat_input_ids
    from eyas.engine.params import SamplingParams, SpecParams

    ck = resolve_draft("default", smollm2)
    assert ck is not None and ck.path == SHIPPED
    ids = chat_input_ids(smollm2.tokenizer, [{"role": "user", "content": "List three uses of a paperclip."}])
    sp = SamplingParams(max_new_tokens=48)
    plain = Engine(smollm2, None, SpecParams(method="plain")).generate(ids, sp)
    for lookup in (0, 8):
        spec = SpecParams("tree", depth=3, topk=4, tokens=8, lookup=lookup)
        res = Engine(smollm2, ck, spec).generate(ids, sp)
        assert res.token_ids == plain.token_ids, spec
        assert res.stats.tau > 1.2, res.stats.tau  # a trained head: accepted beyond the bonus token


def test_shipped_ngram_table_is_small_and_counted_over_the_targets_own_replies():
    from eyas.engine.ngram import bundled_ngram_path, load_ngram

    p = bundled_ngram_path()
    assert sum(f.stat().st_size for f in p.iterdir()) <= 8 << 20
    t = load_ngram("default")
    m = t.manifest
    assert m["target"]["name"] == "smollm2-135m" and m["target"]["fingerprint"].startswith("sha256:")
    assert m["sources"] and all(s["regenerated"] for s in m["sources"])
    assert m["reply_tokens"] > 100_000 and len(t) == sum(m["entries"].values()) > 10_000


@pytest.mark.integration
def test_bundled_table_is_picked_for_the_bundled_target_only_and_is_lossless(smollm2):
    from eyas.engine.decode import Engine, chat_input_ids
    from eyas.engine.ngram import bundled_ngram_path, resolve_ngram
    from eyas.engine.params import SamplingParams, SpecParams

    table = resolve_ngram("auto", smollm2)
    assert table is not None and table.path == bundled_ngram_path()
    m = tiny_model("llama", layers=30)
    other = Target(model=m, tokenizer=None, identity=identity_of(m, tensor_fingerprint(m), "other"), source="other",
                   path=None)
    assert resolve_ngram("auto", other) is None  # auto: only the target it was counted for
    ids = chat_input_ids(smollm2.tokenizer, [{"role": "user", "content": "Explain what a hash table is."}])
    sp = SamplingParams(max_new_tokens=64)
    plain = Engine(smollm2, None, SpecParams(method="plain")).generate(ids, sp)
    res = Engine(smollm2, None, SpecParams("lookup", lookup=3), table).generate(ids, sp)
    assert res.token_ids == plain.token_ids
    assert res.stats.ngram_proposed > 0 and res.stats.ngram_accepted > 0, res.stats
