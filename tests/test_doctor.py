"""eyas doctor on tiny target+draft pairs: a draft that really learned its layout, then one injected fault per
test; the doctor must name each one (and pass the clean pair).

The tiny target is a random Llama (8 layers, hidden 32, vocab 64) with init std 0.1 and its residual writes
(o_proj, down_proj) scaled x3, so consecutive stream indices differ the way a real model's do (adjacent cosine
~0.5-0.9, norms growing with depth). Its own sampled text (temperature 0.7) is the data; the draft trains on
stream [2, 4, 5] (the default for L = 8) with the training-time test for a few hundred steps.
The pair is built by tests/doctor_pair.py; the layout faults are in tests/test_doctor_layout.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas.data.shards import MANIFEST, is_heldout, write_shard
from eyas.doctor.checks import run_doctor
from eyas.draft import DraftConfig, Eagle3Draft, bundled_draft_path, load_draft, save_draft
from eyas.layout import Layout
from eyas.target.convert import tensor_fingerprint
from eyas.target.load import Target, identity_of
from tests.doctor_pair import (
    DRAFT_VOCAB,
    LAYOUT,
    H,
    S,
    V,
    edit_json,
    relabel_dir,
    statuses,
    tiny_target,
)
from tests.tiny import tiny_config

# ---- the clean pair -------------------------------------------------------------------------------

def test_clean_pair_passes_every_check(pair):
    assert pair.heldout_acc[0] > 0.4, f"the fixture draft did not learn (held-out step-0 {pair.heldout_acc})"
    rep = run_doctor(pair.target, load_draft(pair.draft_dir), samples=pair.samples())
    assert rep.ok, [(c.name, c.status, c.summary) for c in rep.checks]
    assert rep.exit_code == 0
    assert rep.layout.best.indices == LAYOUT
    # the accuracy measured through the engine's forward is the training-time one (same held-out rows)
    assert abs(rep.accuracy["serving"]["acc"][0] - pair.heldout_acc[0]) < 1e-6
    assert "TargetModel" in rep.meta["serving_path"]


def test_clean_pair_with_shards_is_paired_and_passes(pair):
    rep = run_doctor(pair.target, load_draft(pair.draft_dir), data=[pair.shards], num_samples=200)
    st = statuses(rep)
    assert rep.ok, [(c.name, c.status, c.summary) for c in rep.checks]
    assert st["data_layout"] == "pass" and rep.check("data_layout").numbers["measured_indices"] == LAYOUT
    acc = rep.check("accuracy").numbers
    assert abs(acc["gap_points"][0]) <= 2.0  # bf16-stored vs fresh fp32 features: no skew


# ---- config and vocab faults -------------------------------------------------------------------------

def test_missing_target_hidden_size_with_differing_sizes(pair, tmp_path):
    # a foreign-style draft (own hidden size 48) on the 32-wide target; config.json lacks target_hidden_size
    dc = DraftConfig.from_target_config(pair.target.model.config, draft_vocab_size=DRAFT_VOCAB, hidden_size=48,
                                        head_dim=12)
    d = Eagle3Draft(dc)
    d.set_vocab_map(torch.arange(DRAFT_VOCAB))
    p = save_draft(tmp_path / "wide", d, Layout(aux_indices=LAYOUT, target=pair.target.identity))
    edit_json(p / "config.json", lambda c: c.pop("target_hidden_size"))
    rep = run_doctor(pair.target, load_draft(p), samples=pair.samples())
    c = rep.check("config_hidden")
    assert c.status == "fail" and "no target_hidden_size" in c.summary and "3 x 48" in c.summary, c.summary
    assert '"target_hidden_size": 32' in c.fix
    assert rep.check("hidden_size").status == "fail"  # eyas itself cannot run it either (embedding width)
    assert rep.check("layout").status == "skip"  # nothing is measured on a draft that cannot run


def test_missing_target_hidden_size_same_sizes_only_warns(pair, tmp_path):
    d = pair.copy(tmp_path / "nohidden")
    edit_json(d / "config.json", lambda c: c.pop("target_hidden_size"))
    rep = run_doctor(pair.target, load_draft(d), quick=True)
    assert rep.check("config_hidden").status == "warn"


def _set_weights(d: Path, **tensors) -> None:
    """Plant a consistent-but-wrong draft: the weights change and the manifest records them, as a draft written
    that way would (a digest mismatch alone is the damaged-file error, tested elsewhere)."""
    from eyas.files import file_record

    sd = load_file(str(d / "model.safetensors"))
    sd.update(tensors)
    save_file(sd, str(d / "model.safetensors"))
    edit_json(d / "eyas_manifest.json",
              lambda m: m.setdefault("files", {}).update({"model.safetensors": file_record(d / "model.safetensors")}))


def test_stale_vocab_mapping_t2d(pair, tmp_path):
    d = pair.copy(tmp_path / "stale")
    other = torch.arange(V - DRAFT_VOCAB, V)  # t2d from another vocabulary selection
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[other] = True
    _set_weights(d, t2d=t2d)
    rep = run_doctor(pair.target, load_draft(d), quick=True)
    c = rep.check("vocab_map")
    assert c.status == "fail" and "stale" in c.summary, c.summary


def test_stale_vocab_mapping_d2t_consistent_but_not_the_trained_one(pair, tmp_path):
    d = pair.copy(tmp_path / "stale2")
    m = load_draft(d).model
    m.set_vocab_map(torch.arange(V - DRAFT_VOCAB, V))  # consistent d2t/t2d, but another vocabulary
    _set_weights(d, d2t=m.d2t, t2d=m.t2d)
    rep = run_doctor(pair.target, load_draft(d), samples=pair.samples())
    c = rep.check("vocab_map")
    assert c.status == "fail" and "recorded at training" in c.summary, c.summary
    assert rep.check("layout").status != "fail"  # not blamed on the layout


def test_random_lm_head(pair, tmp_path):
    d = pair.copy(tmp_path / "randhead")
    torch.manual_seed(5)
    _set_weights(d, **{"lm_head.weight": torch.nn.Linear(H, DRAFT_VOCAB, bias=False).weight.detach()})
    rep = run_doctor(pair.target, load_draft(d), samples=pair.samples())
    c = rep.check("head")
    assert c.status == "fail" and "lm_head" in c.summary and "init" in c.summary, c.summary
    assert rep.check("layout").status in ("skip", "pass")  # the layout is not blamed
    assert rep.check("vocab_map").status == "pass"


def test_changed_target_weights(pair, tmp_path):
    # the same architecture re-quantized: every weight rounded to a 4-bit grid per tensor
    t = tiny_target()
    with torch.no_grad():
        for p in t.model.parameters():
            if p.dim() == 2:
                step = p.abs().max() / 7
                p.copy_(torch.round(p / step) * step)
    t.identity = identity_of(t.model, tensor_fingerprint(t.model), "tiny-q4")
    rep = run_doctor(t, load_draft(pair.draft_dir), data=[pair.shards], num_samples=200)
    c = rep.check("target_identity")
    assert c.status == "fail" and "weights changed" in c.summary and "re-quantized" in c.summary, c.summary
    d = rep.check("data_layout")
    assert d.status == "fail" and "match no stream" in d.summary, d.summary  # measured, not only the fingerprint
    assert rep.check("layout").status == "pass"  # nothing else is blamed
    assert "gap_points" in rep.check("accuracy").numbers


def test_training_serving_skew(pair, tmp_path):
    # a capture bug: the stored features sit 4 positions late (a header the capture template added and the
    # stored ids lack); serving feeds the aligned features, so the same draft scores differently on each path
    from eyas.data.shards import ShardSet

    out = tmp_path / "skewed"
    out.mkdir()
    samples = list(ShardSet(pair.shards).samples("all"))
    for s in samples:
        s.aux = torch.cat([s.aux[:4], s.aux[:-4]])
    entry = write_shard(out / "shard-00000.safetensors", samples)
    man = json.loads((pair.shards / MANIFEST).read_text())
    man["shards"] = [entry]
    (out / MANIFEST).write_text(json.dumps(man))
    rep = run_doctor(pair.target, load_draft(pair.draft_dir), data=[out], num_samples=200)
    c = rep.check("accuracy")
    assert c.status == "fail" and "training/serving skew" in c.summary, c.summary
    tr, sv = c.numbers["training_acc"][0], c.numbers["serving_acc"][0]
    assert f"{100 * tr:.1f}%" in c.summary and f"{100 * sv:.1f}%" in c.summary  # both numbers
    assert sv - tr > 0.03


# ---- flags -------------------------------------------------------------------------------------------

def test_eagle_instead_of_eagle3_flags(pair):
    from eyas.doctor.flags import lint_serve_command

    cmd = ["python", "-m", "sglang.launch_server", "--model-path", "M", "--speculative-algorithm", "EAGLE",
           "--speculative-draft-model-path", str(pair.draft_dir), "--speculative-num-steps", "3",
           "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "16"]
    r = lint_serve_command(cmd, pair.draft_dir)
    algo = next(c for c in r.checks if c.name == "algorithm")
    assert algo.status == "fail" and "final 1xH" in algo.summary
    assert "--speculative-algorithm EAGLE3" in r.corrected_text()
    assert {c.name: c.status for c in r.checks}["aux_ids"] == "pass"


def test_cli_doctor_flags_exit_codes(pair):
    from typer.testing import CliRunner

    from eyas.cli import app

    good = ["python", "-m", "sglang.launch_server", "--model-path", "M", "--speculative-algorithm", "EAGLE3",
            "--speculative-draft-model-path", str(pair.draft_dir), "--speculative-num-steps", "3",
            "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
    r = CliRunner().invoke(app, ["doctor", "flags", "--draft", str(pair.draft_dir), "--", *good])
    assert r.exit_code == 0, r.output
    bad = [a if a != "4" else "16" for a in good]
    r = CliRunner().invoke(app, ["doctor", "flags", "--draft", str(pair.draft_dir), "--json", "--", *bad])
    assert r.exit_code == 1, r.output
    out = json.loads(r.output[r.output.index("{"):])
    assert out["corrected"].endswith("--speculative-num-draft-tokens 4")
    r = CliRunner().invoke(app, ["doctor", "flags", "--draft", str(pair.draft_dir / "nope"), "--", *good])
    assert r.exit_code == 2 and "no config.json" in r.output


# ---- norms and trace -----------------------------------------------------------------------------------

def test_norm_fingerprint_drift(pair, tmp_path):
    # norms recorded on another model (x1.8): the doctor compares them with what this target gives
    d = pair.copy(tmp_path / "norms")
    edit_json(d / "eyas_manifest.json",
              lambda m: m["layout"].update(norms={k: 1.8 * v for k, v in m["layout"]["norms"].items()}))
    rep = run_doctor(pair.target, load_draft(d), samples=pair.samples()[:20])
    c = rep.check("norms")
    assert c.status == "fail" and "norm fingerprint drift" in c.summary, c.summary
    assert rep.check("layout").status == "pass"


def tiny_tokenizer():
    """A real word-level tokenizer over the tiny vocabulary (t0..t63), so the engine can decode."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk)


def test_trace_walks_the_serving_path(pair):
    from eyas.doctor.trace import trace
    from eyas.engine.params import SpecParams

    t = pair.target
    t.tokenizer = tiny_tokenizer()
    try:
        prompt = pair.samples()[0][:12].tolist()
        rep = trace(t, load_draft(pair.draft_dir), prompt, SpecParams(method="tree", depth=3, topk=2, tokens=6),
                    max_new_tokens=12, max_rounds=3)
    finally:
        t.tokenizer = None
    stages = [(e.round, e.stage) for e in rep.events]
    assert stages[:5] == [(0, "target"), (0, "capture 2"), (0, "capture 4"), (0, "capture 5"), (0, "concatenation")]
    r1 = [e for e in rep.events if e.round == 1]
    names = [e.stage for e in r1]
    assert names[0] == "fc" and names[1] == "draft layer" and names[2] == "draft logits"
    assert "target" in names and names[-1] == "accepted"
    fc = r1[0]
    assert fc.shape == [1, 12, H] and "[1, 12, 96]" in fc.note  # cat of 3 streams -> hidden
    cap = next(e for e in rep.events if e.stage == "capture 5")
    assert cap.shape == [1, 12, H] and cap.norm > 0
    logit = next(e for e in r1 if e.stage == "draft logits")
    assert logit.shape[-1] == DRAFT_VOCAB and "top of the last row: 't" in logit.note
    assert len(rep.accepted) == 4 and all(len(a) >= 1 for a in rep.accepted)
    # the trace observes only: the engine's greedy output is the target's own greedy continuation
    from eyas.engine.decode import Engine
    from eyas.engine.params import SamplingParams

    t.tokenizer = tiny_tokenizer()
    try:
        plain = Engine(t, None, SpecParams(method="plain")).generate(prompt, SamplingParams(max_new_tokens=12))
    finally:
        t.tokenizer = None
    got = [x for a in rep.accepted for x in a]
    assert got == plain.token_ids[:len(got)]


# ---- the real bundled target (integration) ----------------------------------------------------------------

@pytest.fixture(scope="module")
def real_random(smollm2, tmp_path_factory):
    """An untrained draft for the real target, saved like any eyas draft."""
    torch.manual_seed(0)
    d = Eagle3Draft(DraftConfig.from_target_config(smollm2.config, draft_vocab_size=4096))
    d.set_vocab_map(torch.arange(4096))
    return save_draft(tmp_path_factory.mktemp("real") / "random", d, smollm2.default_layout())


@pytest.mark.integration
def test_real_target_fast_checks_with_a_random_draft(smollm2, real_random, tmp_path):
    from typer.testing import CliRunner

    from eyas.cli import app

    rep = run_doctor(smollm2, load_draft(real_random), quick=True)
    assert rep.ok and [c.name for c in rep.checks] == ["target_identity", "hidden_size", "vocab_map", "config_hidden",
                                                        "config_ids"], [(c.name, c.status) for c in rep.checks]
    r = CliRunner().invoke(app, ["doctor", "--draft", str(real_random), "--quick", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output[r.output.index("{"):])["ok"] is True
    # SGLang ids written in vLLM's convention: the off-by-one, named per engine
    d = shutil.copytree(real_random, tmp_path / "offbyone")
    edit_json(d / "config.json", lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[2, 15, 27]))
    c = run_doctor(smollm2, load_draft(d), quick=True).check("config_ids")
    assert c.status == "fail" and "stream [3, 16, 28]" in c.summary and "[1, 14, 26]" in c.fix, c.summary
    # the same draft recorded for another file of the same model: only the fingerprint differs
    e = shutil.copytree(real_random, tmp_path / "otherfile")
    edit_json(e / "eyas_manifest.json", lambda m: m["layout"]["target"].update(fingerprint="sha256:0123"))
    c = run_doctor(smollm2, load_draft(e), quick=True).check("target_identity")
    assert c.status == "fail" and "weights changed: re-quantized or another file" in c.summary
    # the story's flags, linted against this draft
    story = ["python", "-m", "sglang.launch_server", "--model-path", "HuggingFaceTB/SmolLM2-135M-Instruct",
             "--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", str(real_random),
             "--speculative-num-steps", "1", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "16"]
    r = CliRunner().invoke(app, ["doctor", "flags", "--draft", str(real_random), "--json", "--", *story])
    assert r.exit_code == 1, r.output
    out = json.loads(r.output[r.output.index("{"):])
    st = {c["name"]: c["status"] for c in out["checks"]}
    assert st["algorithm"] == "fail" and st["draft_shape"] == "fail" and st["aux_ids"] == "pass"
    assert "--speculative-algorithm EAGLE3" in out["corrected"]
    assert "--speculative-num-draft-tokens 2" in out["corrected"]


@pytest.mark.integration
def test_real_target_random_head_is_named(smollm2, real_random):
    rep = run_doctor(smollm2, load_draft(real_random), num_samples=2, max_len=192)
    c = rep.check("head")
    assert c.status == "fail" and "lm_head and fc look untrained" in c.summary, c.summary
    assert rep.check("layout").status == "skip"  # no layout predicts anything: not blamed on the layout
    assert rep.meta["samples_from"].endswith("conversations of sharegpt")


@pytest.mark.integration
def test_self_source_samples_are_the_targets_own_prompts_on_held_out_rows(smollm2):
    from eyas.data.regen import user_turn_opening
    from eyas.probe import SampleError, conversation_samples

    tok = smollm2.tokenizer
    evs = conversation_samples(tok, "self", 2, 96, 5.0, regen=(smollm2, {"seed": 0, "max_new_tokens": 16}, 2))
    assert len(evs) == 2 and all(is_heldout(s.row_id, 5.0) for s in evs)
    opening = tok.decode(user_turn_opening(tok))
    for s in evs:
        text = tok.decode(s.input_ids.tolist())
        assert text.startswith(opening) and "<|im_start|>assistant\n" in text and int(s.loss_mask.sum()) > 0
    with pytest.raises(SampleError, match="source 'self'.*scored only for a draft trained on it"):
        conversation_samples(tok, "self", 2, 96, None)


@pytest.mark.integration
@pytest.mark.asset
def test_shipped_draft_passes_on_the_real_target(smollm2):
    rep = run_doctor(smollm2, load_draft("default"))
    assert rep.ok, [(c.name, c.status, c.summary) for c in rep.checks]
    assert rep.check("head").status == "pass" and rep.check("layout").status == "pass"


@pytest.mark.integration
@pytest.mark.asset
def test_shifted_copy_of_the_shipped_draft_fails_with_the_true_layout_first(smollm2, tmp_path):
    true = load_draft("default").layout.aux_indices
    d = relabel_dir(bundled_draft_path(), tmp_path / "shifted", [k + 1 for k in true])
    rep = run_doctor(smollm2, load_draft(d))
    c = rep.check("layout")
    # ranked by held-out loss: on the first trained draft the shift cost +0.076 nats at paired z ~ 9 over 1,125
    # positions while top-1 accuracy moved by less than its noise (31.5% true vs 30.8% shifted)
    assert c.status == "fail" and rep.layout.best.indices == true, (c.summary, rep.layout[:3])
    assert c.numbers["diff_loss"] > 4 * c.numbers["se_loss"], c.numbers
    assert f"--aux-indices {','.join(map(str, true))}" in c.fix


def test_untrained_weight_signatures():
    from eyas.doctor.head import _looks_init

    torch.manual_seed(0)
    assert "torch's default init" in _looks_init(torch.nn.Linear(576, 4096, bias=False).weight)
    assert "N(0, 0.02)" in _looks_init(torch.randn(512, 576) * 0.02)
    assert "i.i.d. random" in _looks_init(torch.randn(576, 1728) * 1e-3)  # e.g. train.py's scaled fc init
    trained = torch.randn(576, 1728) * 1e-3 * torch.linspace(0.5, 2.0, 576)[:, None]  # rows of unequal norm
    assert _looks_init(trained) is None
    assert _looks_init(torch.zeros(64, 64)) == "all zeros"


def test_identity_fix_points_only_at_checks_that_ran(pair, tmp_path):
    """--quick runs no accuracy or norms check, so its fix for a changed weights file must not say 'below'."""
    d = pair.copy(tmp_path / "otherfile")
    edit_json(d / "eyas_manifest.json", lambda m: m["layout"]["target"].update(fingerprint="sha256:0123"))
    quick = run_doctor(pair.target, load_draft(d), quick=True)
    full = run_doctor(pair.target, load_draft(d), samples=pair.samples()[:2])
    q, f = quick.check("target_identity"), full.check("target_identity")
    assert q.status == f.status == "fail"
    assert "without --quick" in q.fix and "below" not in q.fix and "accuracy" not in {c.name for c in quick.checks}
    assert "checks below" in f.fix and full.check("accuracy") is not None


def test_uncovered_family_is_measured_through_hf_hooks_and_says_so(tmp_path):
    """A family without an engine forward (phi3) still gets the measured checks, through HF hooks; the report and
    the accuracy table name that path instead of calling it the engine forward."""
    from rich.console import Console

    from eyas.doctor.checks import render

    cfg, cls = tiny_config("phi3", vocab=V, hidden=H, layers=4)
    torch.manual_seed(0)
    m = cls(cfg).eval().requires_grad_(False)
    m.config.architectures = [cls.__name__]
    t = Target(model=m, tokenizer=None, identity=identity_of(m, tensor_fingerprint(m), "phi3"), source="phi3",
               path=None)
    d = Eagle3Draft(DraftConfig.from_target_config(m.config, draft_vocab_size=DRAFT_VOCAB))
    d.set_embeddings(t.embed_tokens().weight)
    d.set_vocab_map(torch.arange(DRAFT_VOCAB))
    folder = save_draft(tmp_path / "draft", d, Layout(aux_indices=[1, 2, 3], target=t.identity))
    rep = run_doctor(t, load_draft(folder), samples=[torch.randint(0, V, (S,)) for _ in range(2)], steps=1)
    assert rep.accuracy["serving_path"] == "HF forward + hooks" and "phi3" in rep.meta["serving_path"]
    assert rep.check("accuracy").numbers["serving_path"] == rep.meta["serving_path"]
    con = Console(record=True, width=200)
    render(rep, con)
    text = con.export_text()
    assert "serving (fresh, HF forward + hooks)" in text and "engine forward)" not in text, text
