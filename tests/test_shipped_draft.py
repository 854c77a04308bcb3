"""The draft shipped in the package (eyas/assets/drafts/default): what it records, that the bundled target uses
it by default, and that any other target is refused. Marked `asset`: whatever draft and n-gram table are shipped,
these must hold, so the bounds come from the assets' own manifests rather than from one ship's numbers."""

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

pytestmark = pytest.mark.asset


def test_shipped_draft_is_fp16_small_and_documented():
    size = sum(p.stat().st_size for p in SHIPPED.iterdir())
    assert size <= 40 << 20, size
    with safe_open(SHIPPED / "model.safetensors", "pt") as f:
        floats = {f.get_slice(k).get_dtype() for k in f.keys()} - {"I64", "BOOL"}
    assert floats == {"F16"}
    man = json.loads((SHIPPED / "eyas_manifest.json").read_text())
    aux = man["layout"]["aux_indices"]
    assert len(aux) == man["draft_config"]["num_aux"] and all(0 <= i <= man["layout"]["target"]["num_layers"]
                                                              for i in aux)
    assert man["layout"]["target"]["name"] == "smollm2-135m"
    assert man["layout"]["target"]["fingerprint"].startswith("sha256:")
    assert len(man["metrics"]["heldout_acc"]) == man["training"]["ttt_steps"]
    assert man["training_time_s"] > 0 and man["command"] and man["data"]["hash"].startswith("sha256:")
    assert man["shipped"]["dtype"] == "float16"
    cfg = json.loads((SHIPPED / "config.json").read_text())
    # the serving config hands engines the same layers, in their output-of ids (eyas stream index - 1)
    assert cfg["target_hidden_size"] == man["layout"]["target"]["hidden_size"] == 576
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in aux]


def test_shipped_draft_refuses_another_target():
    m = tiny_model("llama", layers=30)  # another llama: every differing identity field is named
    other = Target(model=m, tokenizer=None, identity=identity_of(m, tensor_fingerprint(m), "other"), source="other",
                   path=None)
    with pytest.raises((LayoutError, DraftError), match="fingerprint"):
        check_draft_for_target(load_draft("default"), other)


@pytest.mark.integration
def test_default_draft_is_used_with_the_bundled_target_and_is_lossless(smollm2):
    from eyas.draft import resolve_draft
    from eyas.engine.decode import Engine
    from eyas.engine.params import SamplingParams, SpecParams
    from eyas.engine.prompt import chat_input_ids

    ck = resolve_draft("default", smollm2)
    assert ck is not None and ck.path == SHIPPED
    ids = chat_input_ids(smollm2.tokenizer, [{"role": "user", "content": "List three uses of a paperclip."}])
    sp = SamplingParams(max_new_tokens=48)
    plain = Engine(smollm2, None, SpecParams(method="plain")).generate(ids, sp)
    for lookup in (0, 8):
        spec = SpecParams("tree", depth=3, topk=4, tokens=8, lookup=lookup)
        res = Engine(smollm2, ck, spec).generate(ids, sp)
        assert res.token_ids == plain.token_ids, spec
        # a trained head: accepted beyond the bonus token. Each round's first draft token alone is accepted as
        # often as the head's held-out step-0 accuracy (its manifest records it); half of that is the floor for
        # one short reply, whatever draft is shipped
        acc0 = ck.manifest["metrics"]["heldout_acc"][0]
        assert res.stats.tau > 1 + acc0 / 2, (res.stats.tau, acc0)


def test_shipped_ngram_table_is_small_and_counted_over_the_targets_own_replies():
    from safetensors.torch import load_file

    from eyas.engine.ngram import TABLE, bundled_ngram_path, load_ngram

    p = bundled_ngram_path()
    assert sum(f.stat().st_size for f in p.iterdir()) <= 8 << 20
    t = load_ngram("default")
    m = t.manifest
    assert m["target"]["name"] == "smollm2-135m" and m["target"]["fingerprint"].startswith("sha256:")
    assert m["sources"] and all(s["regenerated"] for s in m["sources"])
    # what a table counted the way its manifest says must hold: every order 1..order present, every kept context
    # seen at least min_count times, and no more positions counted than the sources' reply tokens
    order, min_count = m["config"]["order"], m["config"]["min_count"]
    assert 0 < m["reply_tokens"] <= sum(s["tokens"] for s in m["sources"])
    assert set(m["entries"]) == {str(k) for k in range(1, order + 1)} and all(m["entries"].values())
    assert len(t) == sum(m["entries"].values())
    w = load_file(str(p / TABLE))
    for k in range(1, order + 1):
        count, total = w[f"count{k}"], w[f"total{k}"]
        assert len(count) == m["entries"][str(k)] and bool((count >= min_count).all()), k
        assert bool((count <= total).all()) and int(total.sum()) <= m["reply_tokens"], k


@pytest.mark.integration
def test_bundled_table_is_picked_for_the_bundled_target_only_and_is_lossless(smollm2):
    from eyas.engine.decode import Engine
    from eyas.engine.ngram import bundled_ngram_path, resolve_ngram
    from eyas.engine.params import SamplingParams, SpecParams
    from eyas.engine.prompt import chat_input_ids

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
