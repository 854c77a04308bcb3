"""eyas export/import: round trips through every format, each engine's conventions, launch commands and the CLI.
Misplaced or missing ids, corrupt and foreign inputs and layout inference on import are in tests/test_import.py.

A tiny random 8-layer Llama target and a random draft with a non-default layout and a non-trivial draft
vocabulary; exact (fp32) equality of weights, layout and draft logits after eyas -> format -> eyas.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from eyas.cli import app
from eyas.draft import DraftConfig, Eagle3Draft, load_draft, save_draft
from eyas.interop.export import ExportError, LaunchParams, export_draft
from eyas.interop.formats import FormatError
from eyas.interop.importer import import_draft
from eyas.layout import Layout
from eyas.target.capture import capture
from eyas.target.convert import tensor_fingerprint
from eyas.target.load import Target, identity_of
from tests.tiny import tiny_model

L = 8
LAYOUT = [1, 3, 6]  # not the default [2, 4, 5]; expressible by every engine


def make_target(layers: int = L, hidden: int = 32, vocab: int = 128) -> Target:
    m = tiny_model("llama", layers=layers, hidden=hidden, vocab=vocab)
    return Target(model=m, tokenizer=None, identity=identity_of(m, tensor_fingerprint(m), "tiny"), source="tiny",
                  path=None)




@pytest.fixture(scope="module")
def target() -> Target:
    return make_target()


def make_draft(path: Path, target: Target, aux: list[int], draft_vocab: int = 40, seed: int = 1) -> Path:
    cfg = DraftConfig.from_target_config(target.config, draft_vocab_size=draft_vocab, num_aux=len(aux),
                                         rope_theta=50000.0)
    torch.manual_seed(seed)
    d = Eagle3Draft(cfg)
    with torch.no_grad():
        for p in d.parameters():  # non-trivial everywhere, norms included
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    d.set_vocab_map(torch.randperm(target.identity.vocab_size, generator=torch.Generator().manual_seed(seed))
                    [:draft_vocab].sort().values)
    save_draft(path, d, Layout(aux_indices=aux, target=target.identity), extra={"target_source": "tiny"})
    return path


def export(src: Path, fmt: str, out: Path, tgt: Target, **kw):
    """export_draft with the target's embeddings, which the speculators format carries."""
    return export_draft(src, fmt, out, embeddings=tgt.embed_tokens().weight, **kw)


def draft_logits(draft: Eagle3Draft, target: Target, aux: list[int], seed: int = 0) -> torch.Tensor:
    """Step-0 draft logits on features captured from the target by the draft's layout."""
    ids = torch.randint(3, target.identity.vocab_size, (1, 12), generator=torch.Generator().manual_seed(seed))
    feats = capture(target.model, ids, aux).aux  # [1, 12, n_aux * H]
    draft.set_embeddings(target.embed_tokens().weight)
    with torch.no_grad():
        out, _ = draft(draft.fuse(feats[:, :-1]), ids[:, 1:], torch.arange(11)[None])
        return draft.logits(out)  # [1, 11, Vd]


def assert_same_draft(a, b, target: Target) -> None:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    assert a.layout.aux_indices == b.layout.aux_indices
    assert a.layout.target == b.layout.target
    assert a.model.config == b.model.config
    assert torch.equal(draft_logits(a.model, target, a.layout.aux_indices),
                       draft_logits(b.model, target, b.layout.aux_indices))


def _foreign(tmp_path: Path, target: Target, aux: list[int], edit) -> Path:
    """An SGLang export with the eyas manifest removed and its config edited: a foreign folder."""
    src = make_draft(tmp_path / "d", target, aux)
    res = export(src, "sglang", tmp_path / "foreign", target)
    (res.path / "eyas_manifest.json").unlink()
    cfg = json.loads((res.path / "config.json").read_text())
    edit(cfg)
    (res.path / "config.json").write_text(json.dumps(cfg))
    return res.path


def _edit_weights(path: Path, fn) -> None:
    """Rewrite an export's weights as another tool would: without eyas's digest record (which the edit would
    otherwise fail first), so the folder is checked as a foreign one is."""
    w = load_file(str(path / "model.safetensors"))
    fn(w)
    save_file(w, str(path / "model.safetensors"))
    man = json.loads((path / "eyas_manifest.json").read_text())
    man.pop("files", None)
    (path / "eyas_manifest.json").write_text(json.dumps(man))


# ---- round trips ---------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["sglang", "vllm", "speculators"])
@pytest.mark.parametrize("keep_manifest", [True, False])
def test_round_trip_identical(tmp_path, target, fmt, keep_manifest):
    src = make_draft(tmp_path / "d", target, LAYOUT)
    res = export(src, fmt, tmp_path / fmt, target)
    if not keep_manifest:  # a foreign reader sees only config.json + weights
        (res.path / "eyas_manifest.json").unlink()
    back = import_draft(res.path, target, tmp_path / "back", infer=False)
    assert back.info["aux_indices"] == LAYOUT
    assert back.info["ambiguous"] is False
    assert_same_draft(load_draft(src), back.checkpoint, target)


def test_export_writes_each_engines_convention(tmp_path, target):
    src = make_draft(tmp_path / "d", target, LAYOUT)
    sg = export(src, "sglang", tmp_path / "sg", target)
    vl = export(src, "vllm", tmp_path / "vl", target)
    sp = export(src, "speculators", tmp_path / "sp", target)
    # SGLang reads eagle_config only, output-of: stream k = id + 1
    assert sg.config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 5]
    # vLLM reads the top level first, input-of: id = stream index
    assert sg.config["eagle_aux_hidden_state_layer_ids"] == LAYOUT
    assert vl.config["eagle_aux_hidden_state_layer_ids"] == LAYOUT
    assert vl.config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 5]
    assert sp.config["eagle_aux_hidden_state_layer_ids"] == LAYOUT
    for r in (sg, vl):
        c = r.config
        assert c["architectures"] == ["LlamaForCausalLMEagle3"] and c["num_hidden_layers"] == 1
        assert (c["target_hidden_size"], c["vocab_size"], c["draft_vocab_size"]) == (32, 128, 40)
        assert c["rope_theta"] == 50000.0 and c["tie_word_embeddings"] is False
        assert c["eagle_config"]["use_aux_hidden_state"] is True
    assert vl.config["norm_before_residual"] is False and sp.config["norm_before_residual"] is False
    # vLLM reads eagle_aux_layer_semantics (newer builds): "vllm" = the top-level ids as-is, written explicitly
    assert sg.config["eagle_aux_layer_semantics"] == "vllm" and vl.config["eagle_aux_layer_semantics"] == "vllm"
    # weight names: SGLang and vLLM exports both keep midlayer. (SGLang skips layers.0.* silently; vLLM renames
    # midlayer. itself), speculators uses layers.0.
    w_sg, w_vl = load_file(str(sg.path / "model.safetensors")), load_file(str(vl.path / "model.safetensors"))
    assert "midlayer.self_attn.q_proj.weight" in w_sg and not any(k.startswith("layers.") for k in w_sg)
    assert "midlayer.self_attn.q_proj.weight" in w_vl and not any(k.startswith("layers.") for k in w_vl)
    assert any(k.startswith("layers.0.") for k in load_file(str(sp.path / "model.safetensors")))
    assert w_sg["d2t"].dtype == torch.int64 and w_sg["t2d"].dtype == torch.bool
    assert torch.equal(w_sg["d2t"], w_vl["d2t"])
    # speculators carries the target's embedding table (its loader would leave it uninitialised otherwise)
    w_sp = load_file(str(sp.path / "model.safetensors"))
    assert torch.equal(w_sp["embed_tokens.weight"], target.embed_tokens().weight)
    assert "embed_tokens.weight" not in w_sg and "embed_tokens.weight" not in w_vl
    back = import_draft(sp.path, target, tmp_path / "back", infer=False)
    assert back.info["dropped_target_owned"] == ["embed_tokens.weight"]
    assert any("max |diff| 0" in n for n in back.info["notes"])
    with pytest.raises(ExportError, match="needs the target's token embeddings"):
        export_draft(src, "speculators", tmp_path / "sp2")
    with pytest.raises(ExportError, match="wrong target"):
        export_draft(src, "speculators", tmp_path / "sp2", embeddings=torch.zeros(96, 32))
    man = json.loads((sg.path / "eyas_manifest.json").read_text())
    assert man["kind"] == "eyas-export" and man["format"] == "sglang"
    assert man["layout"]["aux_indices"] == LAYOUT
    assert man["source_manifest_sha256"].startswith("sha256:") and man["launch"]["command"] == sg.launch


def sglang_captures(cfg: dict, L: int) -> list[int]:
    """Stream indices SGLang's target captures for a draft config (facts, not SGLang code):
    python/sglang/srt/model_executor/model_runner.py reads eagle_config["eagle_aux_hidden_state_layer_ids"]
    (None on any error); python/sglang/srt/models/llama.py set_eagle3_layers_to_capture: None ->
    [2, L//2, L-3], else [x + 1 for x in ids], captured entering layer i (= stream i), in layer order."""
    try:
        ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    except (KeyError, TypeError):
        ids = None
    want = [2, L // 2, L - 3] if ids is None else [x + 1 for x in ids]
    return [i for i in range(L) if i in want]


def vllm_captures(cfg: dict, L: int) -> list[int]:
    """vllm/v1/worker/gpu_model_runner.py _get_eagle3_aux_layers_from_config: top-level ids, else
    eagle_config's as-is, else the model default (2, L//2, L-3); interfaces.py EagleModelMixin captures the
    state entering layer idx (idx = L after the last layer), in layer order."""
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids") or [2, L // 2, L - 3]
    return [i for i in range(L + 1) if i in ids]


# parameter names of each engine's draft module after its load_weights renames (stacked q/k/v and gate/up)
SGLANG_PARAMS = {  # python/sglang/srt/models/llama_eagle3.py LlamaForCausalLMEagle3.load_weights: "model." prefix
    "model.fc.weight", "model.midlayer.self_attn.qkv_proj.weight", "model.midlayer.self_attn.o_proj.weight",
    "model.midlayer.mlp.gate_up_proj.weight", "model.midlayer.mlp.down_proj.weight", "model.norm.weight",
    "model.midlayer.input_layernorm.weight", "model.midlayer.hidden_norm.weight", "lm_head.weight",
    "model.midlayer.post_attention_layernorm.weight"}
VLLM_PARAMS = {  # vllm/model_executor/models/llama_eagle3.py: midlayer. -> layers.0., "model." unless lm_head
    "model.fc.weight", "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.mlp.down_proj.weight", "model.norm.weight",
    "model.layers.0.input_layernorm.weight", "model.layers.0.hidden_norm.weight", "lm_head.weight",
    "model.layers.0.post_attention_layernorm.weight"}
STACKED = ((".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj"),
           (".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj"))


def engine_param_names(keys, engine: str) -> set[str]:
    out = set()
    for k in keys:
        if k in ("d2t", "t2d"):  # d2t -> hot_token_id / draft_id_to_target_id, t2d skipped by both
            continue
        if engine == "vllm":
            k = k.replace("midlayer.", "layers.0.")
        for a, b in STACKED:
            k = k.replace(a, b)
        out.add(k if k.startswith("lm_head") else "model." + k)
    return out


@pytest.mark.parametrize("aux", [LAYOUT, [2, 4, 5], [0, 3, 8]])
def test_engines_read_the_exported_layout(tmp_path, target, aux):
    src = make_draft(tmp_path / "d", target, aux)
    vl = export(src, "vllm", tmp_path / "vl", target)
    assert vllm_captures(vl.config, L) == aux
    w = load_file(str(vl.path / "model.safetensors"))
    assert engine_param_names(w, "vllm") == VLLM_PARAMS
    # both engines build fc as Linear(3 * target_hidden_size, hidden_size) and lm_head with draft_vocab_size rows
    c = vl.config
    assert tuple(w["fc.weight"].shape) == (c["hidden_size"], 3 * c["target_hidden_size"])
    assert tuple(w["lm_head.weight"].shape) == (c["draft_vocab_size"], c["hidden_size"])
    if 0 in aux or L in aux:  # SGLang cannot capture these: refused, and SGLang reading the vLLM export
        with pytest.raises(ExportError):  # would fall back to its default (recorded in the manifest)
            export(src, "sglang", tmp_path / "sg", target)
        assert vl.manifest["engine_ids"]["sglang"].startswith("not expressible")
        return
    sg = export(src, "sglang", tmp_path / "sg", target)
    assert sglang_captures(sg.config, L) == aux
    assert vllm_captures(sg.config, L) == aux  # vLLM pointed at the SGLang export reads the top level: right
    assert sglang_captures(vl.config, L) == aux  # and SGLang pointed at the vLLM export reads eagle_config
    assert engine_param_names(load_file(str(sg.path / "model.safetensors")), "sglang") == SGLANG_PARAMS
    # the trap the export avoids: SGLang ids alone, read by vLLM's eagle_config fallback, are off by one
    trap = {"eagle_config": sg.config["eagle_config"]}
    assert vllm_captures(trap, L) == [k - 1 for k in aux]


def test_bf16_export_round_trip(tmp_path, target):
    src = make_draft(tmp_path / "d", target, LAYOUT)
    res = export(src, "vllm", tmp_path / "vl", target, dtype="bf16")
    w = load_file(str(res.path / "model.safetensors"))
    assert w["fc.weight"].dtype == torch.bfloat16 and w["d2t"].dtype == torch.int64
    assert res.config["torch_dtype"] == "bfloat16"
    back = import_draft(res.path, target, tmp_path / "back", infer=False).checkpoint
    orig = load_draft(src)
    for k, v in orig.model.state_dict().items():
        want = v.to(torch.bfloat16).float() if v.is_floating_point() else v
        assert torch.equal(back.model.state_dict()[k], want), k


def test_sglang_refuses_the_embedding_vllm_expresses_it(tmp_path, target):
    src = make_draft(tmp_path / "d", target, [0, 3, 8])  # embedding + final pre-norm state
    with pytest.raises(ExportError, match=r"embedding \(stream 0\)"):
        export(src, "sglang", tmp_path / "sg", target)
    assert not (tmp_path / "sg").exists()
    vl = export(src, "vllm", tmp_path / "vl", target)
    assert vl.config["eagle_aux_hidden_state_layer_ids"] == [0, 3, 8]
    assert "eagle_aux_hidden_state_layer_ids" not in vl.config["eagle_config"]  # SGLang cannot say it
    back = import_draft(vl.path, target, tmp_path / "back", infer=False)
    assert_same_draft(load_draft(src), back.checkpoint, target)
    sp = export(src, "speculators", tmp_path / "sp", target)
    assert sp.config["eagle_aux_hidden_state_layer_ids"] == [0, 3, 8]


def test_unsorted_layout_exports_in_engine_order(tmp_path, target):
    """Engines concatenate captured states in ascending layer order; an eyas layout listed otherwise is
    exported with fc's input blocks permuted, and imports back as the same function."""
    src = make_draft(tmp_path / "d", target, [6, 1, 3])
    orig = load_draft(src)
    for fmt in ("sglang", "vllm", "speculators"):
        res = export(src, fmt, tmp_path / fmt, target)
        assert res.manifest["layout"]["aux_indices"] == [1, 3, 6]
        assert res.manifest["source_layout_order"] == [6, 1, 3]
        back = import_draft(res.path, target, tmp_path / f"{fmt}-in", infer=False).checkpoint
        assert back.layout.aux_indices == [1, 3, 6]
        W, Wb = orig.model.fc.weight, back.model.fc.weight  # [H, 3 * 32]
        assert torch.equal(Wb, torch.cat([W[:, 32:64], W[:, 64:96], W[:, :32]], dim=1))
        a = draft_logits(orig.model, target, [6, 1, 3])
        b = draft_logits(back.model, target, [1, 3, 6])
        assert torch.allclose(a, b, atol=1e-5) and torch.equal(a.argmax(-1), b.argmax(-1))
    dup = make_draft(tmp_path / "dup", target, [2, 2, 1])  # a repeated stream (default_aux_indices(4) gave this once)
    with pytest.raises(ExportError, match="repeats a stream index"):
        export(dup, "vllm", tmp_path / "dup-vl", target)


def test_three_aux_engines_refuse_other_counts(tmp_path, target):
    src = make_draft(tmp_path / "d", target, [2, 6])
    for fmt in ("sglang", "vllm"):
        with pytest.raises(ExportError, match="exactly 3"):
            export(src, fmt, tmp_path / fmt, target)
    sp = export(src, "speculators", tmp_path / "sp", target)
    back = import_draft(sp.path, target, tmp_path / "back", infer=False)
    assert_same_draft(load_draft(src), back.checkpoint, target)


# ---- launch commands and the CLI -----------------------------------------------------------------

def test_launch_params_are_consistent():
    assert LaunchParams(3, 1).resolved().draft_tokens == 4
    assert LaunchParams(3, 4).resolved().draft_tokens == 13
    with pytest.raises(ExportError, match="silently force 2"):
        LaunchParams(1, 1, 16).resolved()  # the trap from DESIGN.md: steps 1 overriding 16 draft tokens
    with pytest.raises(ExportError, match="outside 2..37"):
        LaunchParams(3, 4, 64).resolved()
    with pytest.raises(ExportError, match=">= 1"):
        LaunchParams(0, 1).resolved()


def test_printed_launch_commands(tmp_path, target):
    src = make_draft(tmp_path / "d", target, LAYOUT)
    sg = export(src, "sglang", tmp_path / "sg", target, target="/models/tiny", launch=LaunchParams(5, 4, 24))
    assert sg.launch == ("python -m sglang.launch_server --model-path /models/tiny --speculative-algorithm EAGLE3 "
                         f"--speculative-draft-model-path {tmp_path / 'sg'} --speculative-num-steps 5 "
                         "--speculative-eagle-topk 4 --speculative-num-draft-tokens 24")
    vl = export(src, "vllm", tmp_path / "vl", target, target="/models/tiny", launch=LaunchParams(5))
    prefix = "vllm serve /models/tiny --speculative-config '"
    assert vl.launch.startswith(prefix) and vl.launch.endswith("'")
    assert json.loads(vl.launch[len(prefix):-1]) == {"method": "eagle3", "model": str(tmp_path / "vl"),
                                                     "num_speculative_tokens": 5}


@pytest.mark.parametrize("aux", [LAYOUT, [0, 3, 8]])
def test_printed_commands_pass_the_flag_lint(tmp_path, target, aux):
    """`eyas doctor flags` (eyas.doctor.flags) accepts every launch command export prints."""
    import shlex

    from eyas.doctor import flags

    src = make_draft(tmp_path / "d", target, aux)
    cases = [("vllm", LaunchParams(3)), ("speculators", LaunchParams(4)), ("sglang", LaunchParams(3)),
             ("sglang", LaunchParams(5, 4, 24))]
    for i, (fmt, lp) in enumerate(cases):
        if fmt == "sglang" and 0 in aux:
            continue  # refused at export (tested above)
        res = export(src, fmt, tmp_path / f"{fmt}{i}", target, target="/models/tiny", launch=lp)
        lint = flags.lint_serve_command(shlex.split(res.launch), res.path)
        assert lint.ok, (res.launch, [c.to_dict() for c in lint.checks if c.status not in ("pass", "skip")])
        assert any(c.name == "aux_ids" and c.status == "pass" for c in lint.checks)


def test_vllm_export_serves_in_sglang_too(tmp_path, target):
    """One folder layout for both engines: the vLLM export keeps SGLang's midlayer.* names (vLLM renames them
    itself), so an SGLang launch on it passes the lint; a layers.0.* folder (what vLLM exports used to be) fails."""
    import shlex

    from eyas.doctor.flags import lint_serve_command
    from eyas.interop.export import sglang_command

    src = make_draft(tmp_path / "d", target, LAYOUT)
    res = export(src, "vllm", tmp_path / "vl", target, target="/models/tiny")
    cmd = shlex.split(sglang_command("/models/tiny", str(res.path), LaunchParams(3)))
    lint = lint_serve_command(cmd, res.path)
    assert lint.ok, [c.to_dict() for c in lint.checks if c.status not in ("pass", "skip")]

    def old_names(w):  # an older eyas's vLLM export (written before exports recorded digests)
        for k in [k for k in w if k.startswith("midlayer.")]:
            w[k.replace("midlayer.", "layers.0.")] = w.pop(k)
    _edit_weights(res.path, old_names)
    # SGLang 0.5.6 drops layers.0.* without a word; 0.5.23's load_weights renames midlayer to layers.0 and places both
    lint = lint_serve_command(cmd, res.path, engine_version="0.5.6")
    assert not lint.ok and next(c for c in lint.checks if c.name == "weights").status == "fail"
    assert next(c for c in lint_serve_command(cmd, res.path, engine_version="0.5.23").checks
                if c.name == "weights").status == "pass"


def test_cli_export_and_errors(tmp_path, target):
    src = make_draft(tmp_path / "d", target, LAYOUT)
    r = CliRunner().invoke(app, ["export", "--draft", str(src), "--format", "sglang", "--out", str(tmp_path / "o"),
                                 "--steps", "4"])
    assert r.exit_code == 0, r.output
    assert "--speculative-algorithm EAGLE3" in r.output and "--speculative-num-draft-tokens 5" in r.output
    assert "eagle_config.eagle_aux_hidden_state_layer_ids = [0, 2, 5]" in r.output
    r = CliRunner().invoke(app, ["export", "--draft", str(src), "--format", "tensorrt", "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and "expected one of sglang, vllm, speculators" in r.output
    r = CliRunner().invoke(app, ["export", "--draft", str(src), "--format", "sglang", "--out", str(tmp_path / "x"),
                                 "--steps", "1", "--draft-tokens", "16"])
    assert r.exit_code == 2 and "silently force 2" in r.output
    # import option errors come before any target is loaded (the bogus --target proves it)
    r = CliRunner().invoke(app, ["import", str(tmp_path / "o"), "--target", "/nowhere", "--out", str(tmp_path / "i"),
                                 "--aux-ids", "0,2,5"])
    assert r.exit_code == 2 and "--aux-ids needs --ids-convention" in r.output
    r = CliRunner().invoke(app, ["import", str(tmp_path / "o"), "--target", "/nowhere", "--out", str(tmp_path / "i"),
                                 "--aux-ids", "0,2,x", "--ids-convention", "sglang"])
    assert r.exit_code == 2 and "comma-separated integers" in r.output


# ---- the real bundled target, through the CLI ----------------------------------------------------

@pytest.mark.integration
def test_cli_round_trip_on_smollm2(tmp_path, smollm2):
    """SmolLM2-135M (L = 30): every format through `eyas export` and back through `eyas import`."""
    aux = [3, 16, 28]  # not the default [2, 15, 27]
    cfg = DraftConfig.from_target_config(smollm2.config, draft_vocab_size=512)
    torch.manual_seed(0)
    d = Eagle3Draft(cfg)
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(torch.randn_like(p) * 0.05 + (1.0 if p.dim() == 1 else 0.0))
    d.set_vocab_map(torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(0))[:512].sort().values)
    src = save_draft(tmp_path / "d", d, smollm2.default_layout(aux))  # no target_source: the bundled name is used
    orig = load_draft(src)
    want = {"sglang": ("eagle_config", [2, 15, 27]), "vllm": ("top", aux), "speculators": ("top", aux)}
    for fmt, (where, ids) in want.items():
        out = tmp_path / fmt
        r = CliRunner().invoke(app, ["export", "--draft", str(src), "--format", fmt, "--out", str(out)])
        assert r.exit_code == 0, r.output
        c = json.loads((out / "config.json").read_text())
        got = c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] if where == "eagle_config" \
            else c["eagle_aux_hidden_state_layer_ids"]
        assert got == ids
        assert str(smollm2.path) in r.output  # engines are pointed at the converted HF folder, not the GGUF name
        back_dir = tmp_path / f"{fmt}-in"
        r = CliRunner().invoke(app, ["import", str(out), "--target", "smollm2-135m", "--out", str(back_dir),
                                     "--no-infer"])
        assert r.exit_code == 0, r.output
        back = load_draft(back_dir)
        assert_same_draft(orig, back, smollm2)


# ---- speculators: a portable verifier name; the tie note only for the draft's own config -----------------

def test_speculators_tie_flag_of_the_copied_verifier_config_is_not_reported(tmp_path, target):
    """speculators' transformer_layer_config is the verifier's config copied over (SmolLM2's says
    tie_word_embeddings: true); the draft never ties its lm_head there, so the import says nothing about it."""
    src = make_draft(tmp_path / "d", target, LAYOUT)
    sp = export(src, "speculators", tmp_path / "sp", target).path
    cfg = json.loads((sp / "config.json").read_text())
    cfg["transformer_layer_config"]["tie_word_embeddings"] = True
    (sp / "config.json").write_text(json.dumps(cfg))
    res = import_draft(sp, target, tmp_path / "back", infer=False)
    assert not any("tie_word_embeddings" in n for n in res.info["notes"]), res.info["notes"]
    # the draft's own config tying (an SGLang folder): SGLang would serve lm_head = embeddings, so it is said
    sg = export(src, "sglang", tmp_path / "sg", target).path
    cfg = json.loads((sg / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (sg / "config.json").write_text(json.dumps(cfg))
    res = import_draft(sg, target, tmp_path / "back2", infer=False)
    assert any("tie_word_embeddings is true" in n for n in res.info["notes"])


@pytest.mark.integration
def test_speculators_verifier_is_portable(tmp_path, smollm2):
    """The bundled target's speculators export names HuggingFaceTB/SmolLM2-135M-Instruct, not this machine's
    converted cache folder; the exact weights stay identified by the fingerprint in the eyas manifest."""
    out = tmp_path / "sp"
    r = CliRunner().invoke(app, ["export", "--draft", "default", "--format", "speculators", "--out", str(out)])
    assert r.exit_code == 0, r.output
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert str(smollm2.path) not in (out / "config.json").read_text()
    man = json.loads((out / "eyas_manifest.json").read_text())
    assert man["verifier"]["fingerprint"] == smollm2.identity.fingerprint
    assert man["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    r = CliRunner().invoke(app, ["export", "--draft", "default", "--format", "speculators", "--out", str(out),
                                 "--verifier", "my-org/smollm2-q4"])
    assert r.exit_code == 0, r.output
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "my-org/smollm2-q4"
    r = CliRunner().invoke(app, ["export", "--draft", "default", "--format", "vllm", "--out", str(tmp_path / "v"),
                                 "--verifier", "my-org/x"])
    assert r.exit_code == 2 and "--verifier applies to --format speculators only" in r.output


def test_import_reads_eagle_aux_layer_semantics():
    """A vLLM config whose top-level ids are marked "sglang" (vLLM adds 1) means output-of ids."""
    from eyas.conventions import read_ids
    from eyas.id_readings import id_readings

    found = read_ids({"eagle_aux_hidden_state_layer_ids": [1, 14, 26], "eagle_aux_layer_semantics": "sglang"})
    r = id_readings(found, "vllm", 30, explicit_format=False)
    assert r.candidates[r.preferred] == [2, 15, 27] and not r.ambiguous
    r = id_readings(read_ids({"eagle_aux_hidden_state_layer_ids": [2, 15, 27]}), "vllm", 30, explicit_format=True)
    assert r.candidates[r.preferred] == [2, 15, 27]
    with pytest.raises(FormatError, match="knows only 'vllm'"):
        read_ids({"eagle_aux_hidden_state_layer_ids": [1, 14, 26], "eagle_aux_layer_semantics": "output-of"})


@pytest.mark.integration
def test_export_refuses_a_target_the_draft_was_not_trained_for(tmp_path, target):
    """--target names a model the draft does not fit: one line naming both targets and what to do, and no export
    (nor a launch command for that model) is written. The bundled target is read without its weights."""
    src = make_draft(tmp_path / "d", target, LAYOUT)
    out = tmp_path / "o"
    r = CliRunner().invoke(app, ["export", "--draft", str(src), "--format", "vllm", "--out", str(out),
                                 "--target", "smollm2-135m"])
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1, r.output
    line = lines[0]
    assert f"the draft {src} was trained for tiny (llama, {L} layers" in line and "not for" in line, line
    assert "30 layers" in line and "train a draft" in line and "give export --target" in line, line
    assert "--method" not in line, line  # generate's advice; export has no such flag
    assert not out.exists()
