import pytest

from eyas.conventions import default_aux_indices, engine_ids_table, from_engine_ids, to_engine_ids
from eyas.layout import Layout, LayoutError, TargetIdentity, check_layouts


def ident(**kw):
    d = dict(architecture="LlamaForCausalLM", model_type="llama", num_layers=30, hidden_size=576,
             vocab_size=49152, fingerprint="sha256:abc")
    d.update(kw)
    return TargetIdentity(**d)


def test_default_indices_smollm2():
    assert default_aux_indices(30) == [2, 15, 27]
    assert default_aux_indices(61) == [2, 30, 58]


def test_json_round_trip():
    lay = Layout.default_for(ident())
    lay.norms = {"2": 81.9, "15": 820.4, "27": 1123.3, "final": 809.1}
    back = Layout.from_json(lay.to_json())
    assert back == lay
    assert back.aux_indices == [2, 15, 27] and back.target.fingerprint == "sha256:abc"


def test_check_names_every_differing_field():
    a = Layout.default_for(ident())
    b = Layout(aux_indices=[3, 16, 28], capture_final=False,
               target=ident(fingerprint="sha256:def", hidden_size=512))
    with pytest.raises(LayoutError) as e:
        check_layouts(a, b, "the draft", "the target")
    msg = str(e.value)
    for field in ("aux_indices", "capture_final", "target.fingerprint", "target.hidden_size"):
        assert field in msg
    assert "[2, 15, 27]" in msg and "[3, 16, 28]" in msg
    assert "sha256:abc" in msg and "sha256:def" in msg
    assert msg.count("fix:") == 4
    assert "4 field(s) differ" in msg


def test_check_passes_equal_and_ignores_name_and_norms():
    a = Layout.default_for(ident(name="x"))
    b = Layout.default_for(ident(name="y"))
    b.norms = {"2": 1.0}
    check_layouts(a, b)


def test_unknown_convention_refused():
    with pytest.raises(LayoutError, match="convention"):
        Layout.from_dict({"aux_indices": [1, 14, 26], "convention": "sglang"})
    with pytest.raises(LayoutError, match="no 'convention'"):
        Layout.from_dict({"aux_indices": [1, 14, 26]})


def test_out_of_range_index_refused():
    with pytest.raises(LayoutError, match="outside 0..30"):
        Layout(aux_indices=[2, 15, 31], target=ident())


@pytest.mark.parametrize("engine,expected", [
    ("sglang", [1, 14, 26]), ("specforge", [1, 14, 26]), ("vllm", [2, 15, 27]),
    ("speculators", [2, 15, 27]), ("eagle", [2, 15, 27]), ("eyas", [2, 15, 27]),
])
def test_translators_round_trip(engine, expected):
    assert to_engine_ids([2, 15, 27], engine, 30) == expected
    assert from_engine_ids(expected, engine, 30) == [2, 15, 27]


def test_sglang_refuses_embedding_and_final():
    with pytest.raises(LayoutError, match="cannot express the embedding"):
        to_engine_ids([0, 15, 27], "sglang", 30)
    with pytest.raises(LayoutError, match=r"\[30\]"):
        to_engine_ids([2, 15, 30], "sglang", 30)
    # vLLM expresses both
    assert to_engine_ids([0, 15, 30], "vllm", 30) == [0, 15, 30]


def test_from_engine_refuses_out_of_range():
    with pytest.raises(LayoutError, match="out of range"):
        from_engine_ids([1, 14, 29], "sglang", 30)  # output of layer 29 = stream 30: not capturable in SGLang
    with pytest.raises(LayoutError, match="out of range"):
        from_engine_ids([2, 15, 31], "vllm", 30)
    with pytest.raises(LayoutError, match="unknown engine"):
        to_engine_ids([2], "tensorrt", 30)


def test_engine_table_marks_unexpressible():
    t = engine_ids_table([0, 15, 27], 30)
    assert t["vllm"] == [0, 15, 27]
    assert isinstance(t["sglang"], str) and "not expressible" in t["sglang"]
