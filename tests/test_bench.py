from __future__ import annotations

import json
import shutil

import pytest

from eyas.bench.config import BenchConfig, BenchError, parse_int_list, parse_methods
from eyas.bench.methods import Output, hf_runner
from eyas.bench.prompts import BenchPrompt
from eyas.bench.rows import first_diff, make_row, mark_lossless, summarize
from eyas.draft import save_random_draft
from eyas.engine.params import TreeSettings
from eyas.target.load import end_token_ids, load_target
from tests.tiny import tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_tokenizer, smollm2_tokenizer_dir):
    """A tiny random Llama with the SmolLM2 tokenizer (vocab 49152), saved as a HF folder, plus a
    random eyas draft saved next to it."""
    root = tmp_path_factory.mktemp("tiny-bench")
    model = tiny_model("llama", seed=0, vocab=len(smollm2_tokenizer), hidden=32, layers=4)
    model.config.eos_token_id = 2
    model.config.bos_token_id = 1
    model.config.pad_token_id = 2
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 2
    model.save_pretrained(root / "target", safe_serialization=True)
    for f in smollm2_tokenizer_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "special_tokens_map.json"):
            shutil.copy(f, root / "target" / f.name)
    target = load_target(str(root / "target"), dtype="fp32")
    save_random_draft(target, root / "draft", draft_vocab=512, seed=1)
    return root


@pytest.fixture(scope="module")
def tiny_target(tiny_dir):
    return load_target(str(tiny_dir / "target"), dtype="fp32")


def test_parsers():
    assert parse_int_list("2-4,8,3", "--x") == [2, 3, 4, 8]
    with pytest.raises(BenchError, match="comma-separated"):
        parse_int_list("a", "--sweep-depth")
    with pytest.raises(BenchError, match=">= 1, found \\[0, 1\\]"):
        parse_int_list("0,1", "--sweep-topk")
    assert parse_int_list("0,8", "--sweep-lookup", minimum=0) == [0, 8]
    assert parse_methods("tree,plain,plain") == ["plain", "tree"]
    with pytest.raises(BenchError, match="choose from"):
        parse_methods("plain,medusa")


def test_first_diff():
    assert first_diff([1, 2, 3], [1, 2, 3]) is None
    assert first_diff([1, 2, 3], [1, 5, 3]) == 1
    assert first_diff([1, 2], [1, 2, 3]) == 2


def test_end_tokens_of_smollm2_template(smollm2_tokenizer):
    assert end_token_ids(smollm2_tokenizer) == [2]  # <|im_end|> is both eos and the template's end token


def test_hf_runner_counts_forwards(tiny_target):
    ids = tiny_target.tokenizer("a b c d a b c d a b c", add_special_tokens=False)["input_ids"]
    greedy = hf_runner(tiny_target, [2])(ids, 12)
    lookup = hf_runner(tiny_target, [2], lookup_tokens=4)(ids, 12)
    gen = len(greedy.token_ids) + (greedy.finish == "stop")
    assert greedy.target_forwards == gen  # one forward per token, prefill included
    assert 1 <= lookup.target_forwards <= len(lookup.token_ids) + 1
    p = BenchPrompt("p", "c", [])
    rows = [make_row(p, "hf-greedy", greedy), make_row(p, "hf-lookup", lookup)]
    assert rows[0]["tau"] == 1.0
    mark_lossless(rows, "hf-greedy")
    assert rows[0]["same_as_ref"] is None and isinstance(rows[1]["same_as_ref"], bool)
    # the model's own generation defaults must not leak into "greedy"
    gc = tiny_target.model.generation_config
    gc.repetition_penalty, gc.no_repeat_ngram_size = 5.0, 1
    try:
        assert hf_runner(tiny_target, [2])(ids, 12).token_ids == greedy.token_ids
    finally:
        gc.repetition_penalty, gc.no_repeat_ngram_size = 1.0, 0
    assert tiny_target.model.generation_config is gc


def test_summary_pools_stats_and_speedups():
    p1, p2 = BenchPrompt("a", "x", []), BenchPrompt("b", "y", [])
    st = dict(prompt_tokens=5, new_tokens=5, target_forwards=3, rounds=2, prefill_s=0.5, draft_s=0.25, verify_s=0.5,
              total_s=1.5, accepted_per_depth=[2, 1], proposed_per_depth=[2, 2], tau=2.0)
    rows = []
    for p in (p1, p2):
        prow = [make_row(p, "hf-greedy", Output([1, 2, 3, 4, 5, 6], 2.0, 6, "length")),
                make_row(p, "plain", Output([1, 2, 3, 4, 5, 6], 1.0, 6, "length",
                                            {**st, "accepted_per_depth": [], "proposed_per_depth": [], "new_tokens": 6,
                                             "rounds": 5, "target_forwards": 6, "tau": 1.0, "draft_s": 0.0})),
                make_row(p, "tree", Output([1, 2, 3, 9, 5, 6] if p is p2 else [1, 2, 3, 4, 5, 6], 0.5, 3, "length",
                                           st))]
        mark_lossless(prow, "plain")
        rows += prow
    s = summarize(rows, ["hf-greedy", "plain", "tree"])
    m = s["methods"]
    assert m["hf-greedy"]["tok_s"] == 3.0 and m["plain"]["speedup_vs_hf"] == 2.0
    assert m["tree"]["speedup_vs_plain"] == 2.0 and m["tree"]["tau"] == 2.0
    assert m["tree"]["accept_per_depth"] == [1.0, 0.5]
    assert m["tree"]["draft_overhead"] == pytest.approx(0.25)  # 0.25 s drafting of 1.0 s of rounds
    assert (m["tree"]["identical"], m["tree"]["compared"]) == (1, 2)
    assert m["tree"]["mismatches"] == [{"prompt": "b", "first_diff": 3}]
    assert m["hf-greedy"]["tau"] == 1.0 and m["hf-greedy"]["draft_overhead"] is None
    assert set(s["categories"]) == {"x", "y"}


def test_bench_refuses_to_overwrite_without_resume(tmp_path, tiny_target):
    from eyas.bench.outdir import prepare_out

    cfg = BenchConfig(bench="humaneval", out=str(tmp_path / "o"))
    prepare_out(cfg, tmp_path / "o", tiny_target)
    (tmp_path / "o" / "rows.jsonl").write_text(json.dumps({"prompt": "x", "method": "plain"}) + "\n")
    with pytest.raises(BenchError, match="--resume"):
        prepare_out(cfg, tmp_path / "o", tiny_target)
    cfg.resume, cfg.max_new_tokens = True, 7
    with pytest.raises(BenchError, match="max_new_tokens"):
        prepare_out(cfg, tmp_path / "o", tiny_target)


def test_missing_bundled_draft_is_a_clear_error(tiny_target, tmp_path, monkeypatch):
    """An install without the shipped draft (the package data left out): --draft default names the ways on."""
    import eyas.draft
    from eyas.draft import DraftError, resolve_draft

    monkeypatch.setattr(eyas.draft, "bundled_draft_path", lambda name="default": tmp_path / "not-shipped" / name)
    with pytest.raises(DraftError, match="is not shipped in this install.*--draft random"):
        resolve_draft("default", tiny_target)


def test_tiny_end_to_end_all_methods(tiny_dir, tiny_target, tmp_path):
    from eyas.bench.config import METHODS
    from eyas.bench.run import run_bench
    from eyas.draft import load_draft

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Name three colours.", "category": "a"}) + "\n"
                       + json.dumps({"prompt": "Count to five: one two", "category": "b"}) + "\n")
    cfg = BenchConfig(bench=str(prompts), limit=2, max_new_tokens=8, target=str(tiny_dir / "target"),
                      draft=str(tiny_dir / "draft"),
                      tree=TreeSettings(steps=3, depth=3, topk=2, tokens=6, lookup=3, min_prob=0.0), lookup_tokens=3,
                      out=str(tmp_path / "out"))
    res = run_bench(cfg, target=tiny_target, draft=load_draft(tiny_dir / "draft"), progress=False, show=False)
    out = tmp_path / "out"
    saved = json.loads((out / "results.json").read_text())
    assert (out / "bench.png").stat().st_size > 1000
    assert saved["draft"]["untrained"] is True and "UNTRAINED" in saved["draft"]["status"]
    assert saved["environment"]["torch"] and saved["target"]["num_layers"] == 4
    m = saved["summary"]["methods"]
    assert list(m) == list(METHODS)
    assert len(saved["rows"]) == 2 * len(METHODS)
    assert set(saved["summary"]["categories"]) == {"a", "b"}
    for name in ("chain", "tree"):  # fp32 greedy speculative decoding is lossless
        assert (m[name]["identical"], m[name]["compared"]) == (2, 2), m[name]["mismatches"]
        assert len(m[name]["accept_per_depth"]) == 3
        assert 0.0 <= m[name]["draft_overhead"] < 1.0
    for name in ("tree-lookup", "lookup"):  # lookup alone loads no draft and is checked lossless too
        assert (m[name]["identical"], m[name]["compared"]) == (2, 2), m[name]["mismatches"]
    # lookup runs no draft model: counted per row (draft time on a busy machine proves nothing)
    forwards = {name: sum(r["stats"]["draft_forwards"] for r in saved["rows"] if r["method"] == name)
                for name in ("lookup", "tree")}
    assert forwards["lookup"] == 0 < forwards["tree"], forwards
    for name in ("hf-greedy", "hf-lookup"):  # computed, whatever HF's numerics give
        assert m[name]["compared"] == 2 and 0 <= m[name]["identical"] <= 2
    assert m["plain"]["tau"] == 1.0 and m["hf-greedy"]["tau"] == 1.0
    sp = saved["specs"]  # the knobs each eyas method ran with, the given ones kept
    tree, chain = sp["tree"], sp["chain"]
    assert (tree["depth"], tree["lookup"], sp["tree-lookup"]["lookup"], chain["steps"]) == (3, 0, 3, 3)
    assert (sp["lookup"]["lookup"], sp["lookup"]["min_prob"], sp["plain"]["lookup"]) == (3, 0.0, 0)
    assert all(s["tok_s"] > 0 and s["new_tokens"] > 0 for s in m.values())
    assert m["hf-greedy"]["speedup_vs_hf"] == 1.0
    assert res["summary"] == saved["summary"]
    # plain ran twice per prompt (--repeat-plain, the default): the same tokens, a measured spread
    noise = saved["summary"]["noise"]
    assert (noise["prompts"], noise["same"]) == (2, 2) and noise["spread"] == abs(noise["ratio"] - 1)
    assert all(r["repeat_seconds"] > 0 for r in saved["rows"] if r["method"] == "plain")
    assert not any("repeat_seconds" in r for r in saved["rows"] if r["method"] != "plain")
    # which weights each eyas method ran: auto on a HF folder is fp32, and the record says why
    eyas_methods = [x for x in METHODS if x not in ("hf-greedy", "hf-lookup", "llama-cpp")]
    assert set(saved["weights"]) == set(eyas_methods)
    assert all(w["target"] == "fp32" and "not a GGUF target" in w["note"] for w in saved["weights"].values())
    assert saved["weights"]["plain"]["draft"] is None and saved["weights"]["tree"]["draft"] == "fp32"
    assert saved["weights"]["lookup"]["draft"] is None

    # --resume with everything done reruns nothing and gives the same rows
    cfg.resume = True
    again = run_bench(cfg, target=tiny_target, draft=load_draft(tiny_dir / "draft"), progress=False, show=False)
    assert [r["token_ids"] for r in again["rows"]] == [r["token_ids"] for r in saved["rows"]]
    assert [r["seconds"] for r in again["rows"]] == [r["seconds"] for r in saved["rows"]]


def test_tiny_sweep_reports_refused_and_fastest(tiny_dir, tiny_target, tmp_path):
    from eyas.bench.config import SweepGrid
    from eyas.bench.sweep import run_sweep
    from eyas.draft import load_draft

    cfg = BenchConfig(bench="humaneval", max_new_tokens=6, target=str(tiny_dir / "target"), sweep=True,
                      sweep_limit=1, out=str(tmp_path / "sw"),
                      grid=SweepGrid(steps=[1, 2], depth=[2], topk=[1, 2], tokens=[3, 4, 99]))
    res = run_sweep(cfg, target=tiny_target, draft=load_draft(tiny_dir / "draft"), progress=False, show=False)
    labels = {r["label"] for r in res["settings"]}
    # topk 1 needs tokens = depth + 1 = 3; 99 exceeds what depth 2 x topk 2 can propose: refused, not adjusted
    assert labels == {"plain", "chain steps=1", "chain steps=2", "tree depth=2 topk=1 tokens=3",
                      "tree depth=2 topk=2 tokens=3", "tree depth=2 topk=2 tokens=4"}
    refused = {r["label"] for r in res["refused"]}
    assert refused == {"tree depth=2 topk=1 tokens=4", "tree depth=2 topk=1 tokens=99",
                       "tree depth=2 topk=2 tokens=99"}
    assert all("tokens" in r["error"] for r in res["refused"])
    assert all(r["identical"] == r["compared"] == 1 for r in res["settings"] if r["method"] != "plain")
    assert res["best"]["method"] != "plain" and res["best"]["command"].startswith("eyas bench")
    assert f"--method {res['best']['method']}" in res["best"]["generate_command"] and res["best"]["lossless"]
    assert (tmp_path / "sw" / "sweep.png").exists() and (tmp_path / "sw" / "sweep.json").exists()


def test_sweep_tries_lookup_with_each_tree(tiny_dir, tiny_target, tmp_path):
    from eyas.bench.config import SweepGrid
    from eyas.bench.sweep import run_sweep
    from eyas.draft import load_draft

    cfg = BenchConfig(bench="humaneval", max_new_tokens=6, target=str(tiny_dir / "target"), sweep=True,
                      sweep_limit=1, out=str(tmp_path / "swl"),
                      grid=SweepGrid(steps=[], depth=[2], topk=[2], tokens=[4], lookup=[0, 3]))
    res = run_sweep(cfg, target=tiny_target, draft=load_draft(tiny_dir / "draft"), progress=False, show=False)
    assert {r["label"] for r in res["settings"]} == {"plain", "tree depth=2 topk=2 tokens=4",
                                                     "tree depth=2 topk=2 tokens=4 lookup=3"}
    assert all(r["identical"] == r["compared"] == 1 for r in res["settings"] if r["method"] != "plain")
    if res["best"].get("lookup"):
        assert "--methods tree-lookup" in res["best"]["command"] and "--lookup 3" in res["best"]["command"]


def test_mtbench_turn2_uses_target_answer(tiny_dir, tiny_target, tmp_path):
    from eyas.bench.run import run_bench

    cfg = BenchConfig(bench="mt-bench", limit=1, turn=2, max_new_tokens=4, methods=["hf-greedy", "plain"],
                      target=str(tiny_dir / "target"), out=str(tmp_path / "t2"))
    res = run_bench(cfg, target=tiny_target, progress=False, show=False)
    msgs = res["prompts"][0]["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "user"] and msgs[1]["content"]
    assert res["summary"]["methods"]["hf-greedy"]["compared"] == 1
    assert res["draft"] is None  # no speculative method: no draft needed


def test_cli_errors_are_clean(tmp_path):
    from typer.testing import CliRunner

    from eyas.cli import app

    r = CliRunner().invoke(app, ["bench", "--methods", "plain,medusa"])
    assert r.exit_code == 2 and "choose from" in r.output and "Traceback" not in r.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n{oops\n')
    r = CliRunner().invoke(app, ["bench", "--bench", str(bad), "--target", "/nonexistent-target"])
    assert r.exit_code == 2 and "line 2 is not valid JSON" in r.output  # prompts are checked before any load
    r = CliRunner().invoke(app, ["bench", "--bench", "humaneval", "--methods", "plain", "--target",
                                 str(tmp_path / "nope")])
    assert r.exit_code == 2 and "not a bundled name" in r.output


def test_progress_names_prompt_and_method(tmp_path, capsys):
    """A long bench must not be silent: every finished method run is reported with prompt i/N and the method
    (on stderr, one line each when stderr is not a terminal; a live bar on a terminal), and --quiet silences it."""
    from eyas.bench.run import interleave

    prompts = [BenchPrompt(f"p{i}", "c", [{"role": "user", "content": "x"}]) for i in range(3)]
    runners = {m: (lambda ids, n: Output([1, 2], 0.5, 3, "length")) for m in ("plain", "tree")}
    earlier = [{"prompt": "p0", "method": m, "token_ids": [1, 2]} for m in runners]
    rows = interleave(prompts, [[1]] * 3, runners, "plain", 4, tmp_path / "rows.jsonl", earlier, True, "bench")
    err = capsys.readouterr().err
    assert len(rows) == 4
    assert "bench: prompt 2/3 (p1) plain: 2 tokens" in err and "bench: prompt 3/3 (p2) tree" in err
    assert "p0" not in err  # done by an earlier run (--resume)
    interleave(prompts, [[1]] * 3, runners, "plain", 4, tmp_path / "rows2.jsonl", [], False, "bench")
    assert capsys.readouterr().err == ""


def test_report_hides_what_was_never_measured_and_names_the_weights_and_the_noise():
    from eyas.bench.render import drafted_depths, load_note, summary_row, weights_ran

    assert drafted_depths([0.38, 1.0, None, None]) == [0.38, 1.0] and drafted_depths(None) == []
    s = {"tok_s": 10.0, "decode_tok_s": None, "speedup_vs_hf": None, "speedup_vs_plain": 1.2, "tau": 1.5,
         "accept_per_depth": [0.5, None, None], "draft_overhead": 0.1, "identical": 2, "compared": 2}
    row = summary_row("tree", s, "plain")
    assert row[6] == "0.50" and row[3] == "n/a" and row[8] == "2/2"
    env = {"dtype": "float32", "device": "cpu", "loadavg_1m": 3.0, "cpu_count": 2}
    assert weights_ran({"weights": {"plain": {"target": "native"}}}, env) == "native quantized weights"
    assert weights_ran({"weights": {"plain": {"target": "fp32"}}}, env) == "float32"
    assert "busy (load 3.0 on 2 CPUs)" in load_note(env) and load_note({**env, "loadavg_1m": 0.5}) is None


def test_a_speedup_inside_plains_spread_against_itself_is_flagged():
    """plain run twice per prompt measures the run's noise; a method whose speedup lies inside it gets a warning,
    one outside it does not, and a repeat that gave other tokens is reported."""
    from io import StringIO

    from rich.console import Console

    from eyas.bench.render import noise_lines
    from eyas.bench.rows import repeat_spread, within_noise

    p = BenchPrompt("a", "x", [])
    plain = make_row(p, "plain", Output([1, 2, 3, 4], 1.0, 4, "length"))
    plain.update(repeat_seconds=1.25, repeat_same=True)  # the machine slowed by 25% between the two runs
    noise = repeat_spread([plain, make_row(p, "tree", Output([1, 2, 3, 4], 0.5, 2, "length"))])
    assert noise == {"prompts": 1, "ratio": 1.25, "spread": 0.25, "same": 1}
    assert within_noise(1.2, noise) and within_noise(0.81, noise) and not within_noise(1.3, noise)
    assert not within_noise(0.7, noise) and not within_noise(1.0, None)
    assert repeat_spread([make_row(p, "plain", Output([1], 1.0, 1, "length"))]) is None  # --no-repeat-plain

    con = Console(file=StringIO(), width=200)
    summ = {"plain": {"speedup_vs_plain": 1.0}, "lookup": {"speedup_vs_plain": 0.85},
            "tree": {"speedup_vs_plain": 1.6}}
    noise_lines(summ, {**noise, "same": 0}, con)
    out = con.file.getvalue()
    assert "plain against itself: 1.250x over 1 prompts" in out and "±25.0%" in out
    assert "other tokens on 1 prompt(s)" in out
    assert "lookup's 0.85x vs plain lies within" in out and "tree's" not in out
