"""The n-gram table: counting, proposing, its files (loud on bad ones), and lossless decoding with it.

The engine tests count a tiny random Llama target's own greedy replies into a table (as `eyas ngram` does with
`eyas datagen --regenerate` shards) and decode other prompts with method lookup and the table.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from eyas.data.ngrams import NgramConfig, build_ngram
from eyas.data.shards import KIND, MANIFEST, Sample, write_shard
from eyas.engine.decode import Engine
from eyas.engine.ngram import (
    TABLE,
    NgramError,
    NgramTable,
    check_ngram_for_target,
    count_ngrams,
    load_ngram,
    resolve_ngram,
)
from eyas.engine.params import SamplingParams, SpecParams
from eyas.files import atomic_write_json
from tests.test_engine import (
    PROMPTS,
    chi2_pvalue,
    exact_first_two,
    greedy,
    make_target,
    prompts_for_training,
    sample_first_two,
)


def test_count_keeps_the_top_next_token_of_reply_positions_only():
    # prompt 7 8 (mask 0), reply 1 2 1 2 1 3: the table learns only what follows inside the reply
    ids = [7, 8, 1, 2, 1, 2, 1, 3]
    mask = [False, False, True, True, True, True, True, True]
    t = count_ngrams([(ids, mask)], order=2, min_count=1)
    assert t[1][(8,)] == (1, 1, 1)  # a context may reach into the prompt; the predicted token is a reply token
    assert (7,) not in t[1]  # 8 is a prompt token: never counted as a prediction
    assert t[1][(1,)] == (2, 2, 3)  # 1 -> 2 twice, 1 -> 3 once
    assert t[2][(2, 1)] == (2, 1, 2)  # tie 2 vs 3: the smaller id
    pruned = count_ngrams([(ids, mask)], order=2, min_count=2)
    assert pruned[1] == {(1,): (2, 2, 3), (2,): (1, 2, 2)} and pruned[2] == {(1, 2): (1, 2, 2)}


def test_propose_backs_off_to_shorter_contexts_and_stops_where_nothing_is_known():
    table = NgramTable(order=3, next={(1, 2, 3): 4, (3,): 9, (4,): 5, (5,): 6, (2, 4): 7}, manifest={})
    assert table.propose([0, 1, 2, 3], 1) == [4]  # the 3-token context wins
    assert table.propose([0, 1, 2, 3], 4) == [4, 5, 6]  # (2, 3, 4) and (3, 4) unknown: (4,); then (6,) is not
    assert table.propose([8, 8, 3], 2) == [9]  # backs off to (3,), then (8, 3, 9)/(3, 9)/(9,) are unknown
    assert table.propose([42], 3) == []
    assert table.propose([1, 2, 3], 0) == []


def reply_shards(target, folder, prompts, n_new=40, regenerate=True):
    """An eyas shard folder whose loss-masked tokens are the target's own greedy replies."""
    folder.mkdir(parents=True)
    plain = Engine(target, None, SpecParams(method="plain"))
    samples = []
    for i, p in enumerate(prompts):
        out = greedy(plain, p, n_new)
        ids = torch.tensor(p + out)
        mask = torch.arange(len(ids)) >= len(p)
        samples.append(Sample(row_id=i, input_ids=ids, loss_mask=mask, aux=torch.zeros(len(ids), 3),
                              final=torch.zeros(len(ids), 1)))
    entry = write_shard(folder / "shard-00000.safetensors", samples, dtype=torch.float32)
    atomic_write_json(folder / MANIFEST, {"kind": KIND, "format_version": 1,
                                          "layout": target.default_layout().to_dict(),
                                          "config": {"source": "tiny-greedy", "regenerate": regenerate},
                                          "shards": [entry]})
    return folder


@pytest.fixture(scope="module")
def tiny():
    return make_target()


@pytest.fixture(scope="module")
def table_dir(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("ngram")
    shards = reply_shards(tiny, root / "shards", prompts_for_training(40, seed=11))
    return build_ngram(NgramConfig(data=[str(shards)], out=str(root / "table"), order=3, min_count=1),
                       log=lambda m: None)


def test_build_and_load_round_trip(table_dir, tiny):
    t = load_ngram(table_dir)
    m = json.loads((table_dir / "eyas_manifest.json").read_text())
    assert m["kind"] == "eyas-ngram" and m["target"]["fingerprint"] == tiny.identity.fingerprint
    shards = json.loads((table_dir.parent / "shards" / MANIFEST).read_text())["shards"]
    assert m["reply_tokens"] == sum(e["loss_tokens"] for e in shards) > 1000  # every reply token, no prompt token
    assert len(t) == sum(m["entries"].values()) > 0
    assert t.order == 3 and all(1 <= len(c) <= 3 for c in t.next)
    check_ngram_for_target(t, tiny)


def test_table_proposes_where_the_context_has_no_match_and_stays_lossless(tiny, table_dir):
    table = load_ngram(table_dir)
    plain = Engine(tiny, None, SpecParams(method="plain"))
    with_table = Engine(tiny, None, SpecParams("lookup", lookup=3), table)
    without = Engine(tiny, None, SpecParams("lookup", lookup=3))
    proposed = accepted = rounds_with = rounds_without = 0
    for p in PROMPTS + prompts_for_training(6, seed=99):  # none of these prompts was counted
        ref = greedy(plain, p, 50)
        res = with_table.generate(p, SamplingParams(max_new_tokens=50))
        assert res.token_ids == ref, p
        st = res.stats
        assert st.ngram_accepted <= st.ngram_proposed
        assert sum(st.accepted_per_depth) == st.lookup_accepted + st.ngram_accepted
        proposed += st.ngram_proposed
        accepted += st.ngram_accepted
        rounds_with += st.rounds
        base = without.generate(p, SamplingParams(max_new_tokens=50))
        assert base.token_ids == ref and base.stats.ngram_proposed == 0
        rounds_without += base.stats.rounds
    assert proposed > 0 and accepted > 0, (proposed, accepted)
    assert rounds_with < rounds_without  # the table's accepted tokens save target forwards


def test_table_chains_longer_than_the_context_chain(tiny, table_dir):
    """ngram_tokens > lookup: the per-depth counters and the cache margin follow the longer of the two chains."""
    plain = Engine(tiny, None, SpecParams(method="plain"))
    eng = Engine(tiny, None, SpecParams("lookup", lookup=1, ngram_tokens=4), load_ngram(table_dir))
    assert eng.lookup_depth == 4
    for p in PROMPTS:
        res = eng.generate(p, SamplingParams(max_new_tokens=30))
        assert res.token_ids == greedy(plain, p, 30)
        assert len(res.stats.accepted_per_depth) == 4


@pytest.mark.slow
def test_sampling_with_the_table_matches_plain_distribution(tiny, table_dir):
    """Table tokens are point-mass proposals judged by rejection sampling: the joint distribution of the first
    two sampled tokens equals plain sampling's (chi-square, as in test_engine)."""
    table = load_ngram(table_dir)
    prompt = PROMPTS[0]  # no repeated n-gram: context lookup finds nothing, so the table proposes
    sp = SamplingParams(temperature=1.0, top_k=12, top_p=0.95, max_new_tokens=2)
    exact = exact_first_two(tiny, prompt, sp).reshape(-1)
    n = 1500
    counts, stats = sample_first_two(Engine(tiny, None, SpecParams("lookup", lookup=3), table), prompt, sp, n)
    accepted = sum(st.ngram_accepted for st in stats)
    proposed = sum(st.ngram_proposed for st in stats)
    assert proposed >= n and accepted > n * 0.1, (proposed, accepted)
    assert chi2_pvalue(counts, exact.double()) > 1e-6


def test_a_table_for_another_target_is_refused(tiny, table_dir):
    other = make_target(seed=1)
    with pytest.raises(NgramError, match="counted over the replies of tiny .* but the target is tiny .* --ngram none"):
        Engine(other, None, SpecParams("lookup", lookup=3), load_ngram(table_dir))
    with pytest.raises(NgramError, match="counted over the replies"):
        resolve_ngram(str(table_dir), other)
    assert resolve_ngram("none", tiny) is None


def test_the_table_is_only_consulted_with_lookup(tiny, table_dir):
    eng = Engine(tiny, None, SpecParams(method="plain"), load_ngram(table_dir))
    assert eng.ngram is None


@pytest.mark.parametrize("damage, match", [
    ("no-folder", "is not a folder"),
    ("no-manifest", "has no eyas_manifest.json"),
    ("bad-json", "is not valid JSON"),
    ("wrong-kind", "kind 'eyas-draft', expected 'eyas-ngram'"),
    ("future-version", "format_version 99"),
    ("corrupt-table", "is not a readable safetensors file"),  # a table without a digest record (older eyas)
    ("cut-table", r"ngram.safetensors: it is \d+ bytes, \d+ were written"),
    ("flipped-table", "ngram.safetensors: its xxh3_128 digest differs"),
    ("wrong-order", r"expected ctx4 \[E, 4\]"),
])
def test_bad_tables_are_one_clear_error(table_dir, tmp_path, damage, match):
    import shutil

    d = tmp_path / "t"
    if damage != "no-folder":
        shutil.copytree(table_dir, d)
    man = d / "eyas_manifest.json"
    if damage == "no-manifest":
        man.unlink()
    elif damage == "bad-json":
        man.write_text("{not json")
    elif damage in ("wrong-kind", "future-version", "wrong-order"):
        m = json.loads(man.read_text())
        m.update({"wrong-kind": {"kind": "eyas-draft"}, "future-version": {"format_version": 99},
                  "wrong-order": {"config": {**m["config"], "order": 4}}}[damage])
        man.write_text(json.dumps(m))
    elif damage == "corrupt-table":
        m = json.loads(man.read_text())
        del m["files"]
        man.write_text(json.dumps(m))
        (d / TABLE).write_bytes(b"garbage")
    elif damage == "cut-table":
        (d / TABLE).write_bytes((d / TABLE).read_bytes()[:-9])
    elif damage == "flipped-table":
        b = bytearray((d / TABLE).read_bytes())
        b[-3] ^= 0x10
        (d / TABLE).write_bytes(bytes(b))
    with pytest.raises(NgramError, match=match):
        load_ngram(d)


def test_build_refuses_bad_input_and_warns_on_original_replies(tiny, tmp_path):
    with pytest.raises(NgramError, match="no --data"):
        build_ngram(NgramConfig(data=[], out=str(tmp_path / "x")))
    with pytest.raises(NgramError, match="--order 0"):
        build_ngram(NgramConfig(data=["d"], out=str(tmp_path / "x"), order=0))
    shards = reply_shards(tiny, tmp_path / "orig", [[5, 6, 7]], n_new=6, regenerate=False)
    logs: list[str] = []
    with pytest.raises(NgramError, match="no context reached --min-count 50"):
        build_ngram(NgramConfig(data=[str(shards)], out=str(tmp_path / "x"), min_count=50), log=logs.append)
    assert any("original replies, not the target's own" in m for m in logs)
    assert not (tmp_path / "x").exists()


def test_cli_builds_and_generate_uses_the_table(tiny, table_dir, tmp_path):
    from typer.testing import CliRunner

    from eyas.cli import app

    r = CliRunner().invoke(app, ["ngram", "--data", str(tmp_path / "missing"), "--out", str(tmp_path / "t")])
    assert r.exit_code == 2 and "Traceback" not in r.output and "not an eyas shard folder" in r.output
    r = CliRunner().invoke(app, ["generate", "--prompt", "hi", "--method", "lookup", "--ngram", "nowhere"])
    assert r.exit_code == 2 and "--ngram 'nowhere': expected auto | default | none | PATH" in r.output


def test_ctrl_c_while_counting_writes_nothing_and_says_so(tiny, table_dir, tmp_path, monkeypatch):
    """SIGINT during the count: exit 130, one line saying nothing was written (the existing table untouched) and
    the command to rerun."""
    import os
    import signal

    from typer.testing import CliRunner

    import eyas.data.ngrams as ngrams
    from eyas.cli import app

    real = ngrams.count_ngrams

    def interrupted(rows, order, min_count):
        os.kill(os.getpid(), signal.SIGINT)  # delivered here, in the main thread, as Ctrl-C would be
        return real(rows, order, min_count)

    monkeypatch.setattr(ngrams, "count_ngrams", interrupted)
    out = tmp_path / "table"
    shutil.copytree(table_dir, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    shards = json.loads((table_dir / "eyas_manifest.json").read_text())["sources"][0]["folder"]
    r = CliRunner().invoke(app, ["ngram", "--data", shards, "--out", str(out)])
    assert r.exit_code == 130, r.output
    said = " ".join(r.output.split())
    assert "eyas ngram: stopped by SIGINT; nothing was written" in said and "Rerun to count again" in said, said
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
