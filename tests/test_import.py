"""eyas import's refusals and decisions: ids in the wrong place, disagreeing or missing (flagged, read as
input_of, or settled by layout inference on a trained draft), an export edited afterwards, a pickle without
consent, a draft for another target, inconsistent vocab maps, unsupported architectures, corrupt and missing
files, an out folder never clobbered. The tiny target and draft helpers are tests/test_export.py's.
"""

from __future__ import annotations

import json

import pytest
import torch

from eyas.draft import DraftConfig, Eagle3Draft, load_draft, save_draft
from eyas.interop.export import ExportError, export_draft
from eyas.interop.formats import FormatError
from eyas.interop.importer import import_draft, read_folder
from eyas.layout import Layout
from eyas.target.capture import capture
from eyas.target.convert import tensor_fingerprint
from eyas.target.load import Target, identity_of
from tests.test_export import LAYOUT, L, _edit_weights, _foreign, assert_same_draft, export, make_draft, make_target
from tests.tiny import tiny_config


@pytest.fixture(scope="module")
def target() -> Target:
    return make_target()


# ---- ids in the wrong place or missing -----------------------------------------------------------

def test_eagle_config_only_is_ambiguous(tmp_path, target):
    def only_eagle_config(c):  # SpecForge style: eagle_config ids only
        del c["eagle_aux_hidden_state_layer_ids"]
    p = _foreign(tmp_path, target, LAYOUT, only_eagle_config)
    with pytest.raises(ExportError) as e:
        import_draft(p, target, tmp_path / "x", infer=False)
    msg = str(e.value)
    assert "stream [1, 3, 6]" in msg and "stream [0, 2, 5]" in msg and "--ids-convention" in msg
    r = import_draft(p, target, tmp_path / "a", fmt="specforge", infer=False)
    assert r.info["aux_indices"] == LAYOUT and r.info["ambiguous"] is False
    r = import_draft(p, target, tmp_path / "b", aux_ids=[0, 2, 5], ids_convention="sglang", infer=False)
    assert r.checkpoint.layout.aux_indices == LAYOUT
    assert r.info["decided_by"].startswith("--aux-ids")


def test_sglang_ids_at_vllm_top_level_are_flagged(tmp_path, target):
    sg_default = [1, 3, 4]  # SGLang's default output-of ids for L = 8, i.e. stream [2, 4, 5]

    def misplaced(c):
        c["eagle_aux_hidden_state_layer_ids"] = sg_default
        del c["eagle_config"]
    p = _foreign(tmp_path, target, [2, 4, 5], misplaced)
    with pytest.raises(ExportError, match="SGLang's default output-of ids"):
        import_draft(p, target, tmp_path / "x", infer=False)
    # the user insists on vLLM's reading: imported as written, the suspicion recorded
    r = import_draft(p, target, tmp_path / "v", fmt="vllm", infer=False)
    assert r.info["aux_indices"] == sg_default
    assert any("SGLang ids placed at vLLM's top level" in n for n in r.info["notes"])
    man = json.loads((tmp_path / "v" / "eyas_manifest.json").read_text())
    assert man["import"]["readings"]["sglang ids misplaced at the top level (id + 1)"] == [2, 4, 5]


def test_ids_impossible_for_sglang_are_read_as_input_of(tmp_path, target):
    def vllm_ids_in_eagle_config(c):  # id 7 = output of layer 7 = stream 8: SGLang cannot capture that
        del c["eagle_aux_hidden_state_layer_ids"]
        c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 4, 7]
    p = _foreign(tmp_path, target, [2, 4, 7], vllm_ids_in_eagle_config)
    r = import_draft(p, target, tmp_path / "x", infer=False)
    assert r.info["aux_indices"] == [2, 4, 7]
    assert any("impossible in SGLang" in n for n in r.info["notes"])


def test_disagreeing_engine_ids_are_ambiguous(tmp_path, target):
    def same_list_twice(c):  # both engines would capture different layers
        c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = c["eagle_aux_hidden_state_layer_ids"]
    p = _foreign(tmp_path, target, LAYOUT, same_list_twice)
    with pytest.raises(ExportError, match="disagree"):
        import_draft(p, target, tmp_path / "x", infer=False)


def test_export_edited_afterwards_is_caught(tmp_path, target):
    src = make_draft(tmp_path / "d", target, LAYOUT)
    res = export(src, "sglang", tmp_path / "sg", target)
    cfg = json.loads((res.path / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 3, 6]
    del cfg["eagle_aux_hidden_state_layer_ids"]
    (res.path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match="edited after export"):
        import_draft(res.path, target, tmp_path / "x", infer=False)


def test_no_ids_needs_a_decision(tmp_path, target):
    def no_ids(c):
        del c["eagle_aux_hidden_state_layer_ids"]
        del c["eagle_config"]
    p = _foreign(tmp_path, target, [2, 4, 5], no_ids)
    with pytest.raises(ExportError, match="--aux-indices"):
        import_draft(p, target, tmp_path / "x", infer=False)
    r = import_draft(p, target, tmp_path / "e", fmt="eagle", infer=False)  # reference code: inputs of 2, L//2, L-3
    assert r.info["aux_indices"] == [2, 4, 5]
    r = import_draft(p, target, tmp_path / "i", aux_indices=[2, 4, 5], infer=False)
    assert r.info["decided_by"] == "--aux-indices"


def test_eagle_reference_pickle_needs_consent(tmp_path, target):
    src = make_draft(tmp_path / "d", target, [2, 4, 5])
    ck = load_draft(src)
    ref = tmp_path / "ref"
    ref.mkdir()
    cfg = ck.model.config.hf_config(None)  # reference configs carry no ids
    (ref / "config.json").write_text(json.dumps(cfg))
    torch.save(ck.model.state_dict(), ref / "pytorch_model.bin")
    torch.save({"lr": 1e-4}, ref / "training_args.bin")  # a trainer's leftover: never read as weights
    with pytest.raises(ExportError, match="--allow-pickle"):
        import_draft(ref, target, tmp_path / "x", fmt="eagle", infer=False)
    r = import_draft(ref, target, tmp_path / "ok", fmt="eagle", allow_pickle=True, infer=False)
    assert_same_draft(ck, r.checkpoint, target)


# ---- shapes, vocab maps, corrupt and foreign inputs ----------------------------------------------

def test_draft_for_another_target_is_refused(tmp_path, target):
    p = export_draft(make_draft(tmp_path / "d", target, LAYOUT), "vllm", tmp_path / "vl").path
    with pytest.raises(ExportError, match="another target"):
        import_draft(p, make_target(hidden=48), tmp_path / "x", infer=False)
    with pytest.raises(ExportError, match="vocabulary has 96"):
        import_draft(p, make_target(vocab=96), tmp_path / "y", infer=False)
    with pytest.raises(ValueError, match="out of range for a 4-layer target"):
        import_draft(p, make_target(layers=4), tmp_path / "z", infer=False)


def test_inconsistent_vocab_map_is_refused(tmp_path, target):
    p = export_draft(make_draft(tmp_path / "d", target, LAYOUT), "vllm", tmp_path / "vl").path

    def flip_t2d(w):
        t2d = w["t2d"].clone()
        unmarked = int((~t2d).nonzero()[0])
        t2d[int(w["d2t"][0])] = False  # draft id 0's target id, unmarked ...
        t2d[unmarked] = True  # ... and another marked instead: same count, wrong set
        w["t2d"] = t2d
    _edit_weights(p, flip_t2d)
    with pytest.raises(FormatError, match="d2t and t2d disagree"):
        import_draft(p, target, tmp_path / "x", infer=False)

    def bad_d2t(w):
        w["d2t"] = w["d2t"] + 1000
        del w["t2d"]
    _edit_weights(p, bad_d2t)
    with pytest.raises(FormatError, match="outside the target vocabulary"):
        import_draft(p, target, tmp_path / "y", infer=False)


def test_unsupported_architectures_are_refused(tmp_path, target):
    p = export_draft(make_draft(tmp_path / "d", target, LAYOUT), "vllm", tmp_path / "vl").path

    def two_layers(w):
        w["layers.1.self_attn.q_proj.weight"] = w["midlayer.self_attn.q_proj.weight"].clone()
    _edit_weights(p, two_layers)
    with pytest.raises(ExportError, match="more than one decoder layer"):
        import_draft(p, target, tmp_path / "x", infer=False)

    sp = export(tmp_path / "d", "speculators", tmp_path / "sp", target).path
    cfg = json.loads((sp / "config.json").read_text())
    cfg["norm_before_residual"] = True
    (sp / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FormatError, match="norm_before_residual"):
        import_draft(sp, target, tmp_path / "y", infer=False)
    cfg["norm_before_residual"] = False
    cfg["speculators_model_type"] = "eagle"
    (sp / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FormatError, match="only 'eagle3'"):
        import_draft(sp, target, tmp_path / "z", infer=False)


def test_corrupt_and_missing_files(tmp_path, target):
    d = make_draft(tmp_path / "d", target, LAYOUT)
    with pytest.raises(ExportError, match="already an eyas draft"):
        read_folder(d)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ExportError, match="no config.json"):
        read_folder(empty)
    (empty / "config.json").write_text("{not json")
    with pytest.raises(ExportError, match="not valid JSON"):
        read_folder(empty)
    (empty / "config.json").write_text("{}")
    with pytest.raises(ExportError, match="holds no weights"):
        read_folder(empty)
    (empty / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ExportError, match="not a readable safetensors"):
        read_folder(empty)
    with pytest.raises(ExportError, match="not a folder"):
        read_folder(tmp_path / "nowhere")


def test_out_folder_is_never_clobbered(tmp_path, target):
    src = make_draft(tmp_path / "d", target, LAYOUT)
    with pytest.raises(ExportError, match="overlaps the source"):
        export(src, "vllm", src, target)
    with pytest.raises(ExportError, match="overlaps the source"):
        export(src, "vllm", src / "sub", target)
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(ExportError, match="not an earlier eyas-export"):
        export(src, "vllm", precious, target)
    vl = export(src, "vllm", tmp_path / "vl", target)
    export(src, "vllm", vl.path, target)  # re-exporting over an earlier export is fine
    with pytest.raises(ExportError, match="not an earlier eyas-draft"):
        import_draft(vl.path, target, precious, infer=False)
    assert (precious / "notes.txt").read_text() == "keep me" and load_draft(src).layout.aux_indices == LAYOUT


# ---- layout inference when the ids are ambiguous (eyas.doctor) -----------------------------------

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A draft trained (TTT, a few hundred steps) on the tiny target's own text with layout [1, 3, 6], so its
    accuracy depends on which layers feed it: what layout inference measures."""
    from eyas.train.ttt import ttt_forward

    mcfg, cls = tiny_config("llama", layers=L)
    mcfg.initializer_range = 0.1  # a peaked target: its text is predictable, so a draft can learn it
    mcfg._attn_implementation = "eager"
    torch.manual_seed(3)
    m = cls(mcfg).eval()
    m.config.architectures = [cls.__name__]
    with torch.no_grad():  # larger residual writes: neighbouring stream indices differ more
        for layer in m.model.layers:
            layer.self_attn.o_proj.weight.mul_(3.0)
            layer.mlp.down_proj.weight.mul_(3.0)
    tgt = Target(model=m, tokenizer=None, identity=identity_of(m, tensor_fingerprint(m), "tiny"), source="tiny",
                 path=None)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (96, 1), generator=g)
    with torch.no_grad():  # the target's own text, sampled at temperature 0.7
        for _ in range(23):
            p = torch.softmax(m(input_ids=ids).logits[:, -1] / 0.7, -1)
            ids = torch.cat([ids, torch.multinomial(p, 1, generator=g)], 1)
    cap = capture(m, ids, LAYOUT)
    cfg = DraftConfig.from_target_config(m.config, draft_vocab_size=64)
    d = Eagle3Draft(cfg)
    d.set_embeddings(m.get_input_embeddings().weight)
    d.set_vocab_map(torch.bincount(ids.flatten(), minlength=128).argsort(descending=True)[:64].sort().values)
    opt = torch.optim.AdamW(d.parameters(), lr=5e-3)
    mask = torch.ones_like(ids, dtype=torch.bool)
    for _ in range(200):
        b = torch.randint(0, 64, (16,), generator=g)  # rows 64.. are held out for the inference
        o = ttt_forward(d, cap.aux[b], cap.final_prenorm[b], ids[b], mask[b], tgt.final_norm(), tgt.lm_head(), 1)
        opt.zero_grad()
        o.loss.backward()
        opt.step()
    d.eval()
    path = save_draft(tmp_path_factory.mktemp("trained") / "d", d, Layout(aux_indices=LAYOUT, target=tgt.identity))
    return tgt, path, [ids[r] for r in range(64, 96)]


def test_ambiguous_ids_are_settled_by_layout_inference(tmp_path, trained):
    tgt, src, heldout = trained

    def only_eagle_config(c):
        del c["eagle_aux_hidden_state_layer_ids"]
    res = export(src, "sglang", tmp_path / "sg", tgt)
    (res.path / "eyas_manifest.json").unlink()
    cfg = json.loads((res.path / "config.json").read_text())
    only_eagle_config(cfg)
    (res.path / "config.json").write_text(json.dumps(cfg))
    r = import_draft(res.path, tgt, tmp_path / "in", infer_samples=heldout)
    inf = r.info["inference"]
    assert r.info["aux_indices"] == LAYOUT and r.info["decided_by"].startswith("doctor inference: sglang")
    assert inf["confident"] and inf["margin_points"] >= 3.0
    accs = {tuple(row["indices"]): row["accuracy"] for row in inf["table"]}
    assert accs[tuple(LAYOUT)] > accs[(0, 2, 5)]  # the vLLM as-is reading: every index one lower
    man = json.loads((tmp_path / "in" / "eyas_manifest.json").read_text())
    assert man["import"]["inference"]["aux_indices"] == LAYOUT  # what chose it travels with the draft
    # an explicit --format that contradicts a clear measurement is imported as asked, with a warning
    r = import_draft(res.path, tgt, tmp_path / "v", fmt="vllm", infer_samples=heldout)
    assert r.info["aux_indices"] == [0, 2, 5]
    assert any("layout inference prefers" in w for w in r.warnings)
