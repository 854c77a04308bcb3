"""The replay predictor (eyas.replay): on rows of the target's own greedy replies, a draft replayed alone gives the
engine's counts exactly (chain, tree, lookup, min-prob, end tokens inside a run, replies cut by max tokens); rows
round-trip through disk and refuse what they cannot answer in one line; planted faults move the counts."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from eyas.cli import app
from eyas.engine.decode import Engine
from eyas.engine.params import TREE_DEFAULTS, SamplingParams, SpecParams
from eyas.replay.plants import FAULTS
from eyas.replay.rows import ReplayError, capture_rows_eyas, load_rows, plant_streams, save_rows
from eyas.replay.run import chain, replay, sglang, tree
from tests.test_engine import PROMPTS, make_target, prompts_for_training, train_draft

CPU = TREE_DEFAULTS["cpu"]
CPU_TREE = (CPU["depth"], CPU["topk"], CPU["tokens"])  # the default tree on the CPU


@pytest.fixture(scope="module")
def tiny():
    return make_target()


@pytest.fixture(scope="module")
def trained(tiny):
    return train_draft(tiny)


@pytest.fixture(scope="module")
def rows(tiny, trained):
    streams = plant_streams(trained.layout.aux_indices, tiny.num_layers)
    return capture_rows_eyas(tiny, PROMPTS + prompts_for_training(4, seed=11), 30, streams)


def engine_counts(target, ck, spec: SpecParams, prompts, m: int):
    import copy

    eng = Engine(target, copy.deepcopy(ck), copy.deepcopy(spec))
    per, prop, rounds, toks = None, None, 0, []
    for p in prompts:
        r = eng.generate(p, SamplingParams(max_new_tokens=m))
        st = r.stats
        per = st.accepted_per_depth if per is None else [a + b for a, b in zip(per, st.accepted_per_depth,
                                                                                strict=True)]
        prop = st.proposed_per_depth if prop is None else [a + b for a, b in zip(prop, st.proposed_per_depth,
                                                                                 strict=True)]
        rounds += st.rounds
        toks.append(r.token_ids)
    return per, prop, rounds, toks


SPECS = [chain(1), chain(2), chain(3), chain(5), tree(3, 3, 8), tree(4, 2, 10), tree(2, 4, 21),
         tree(*CPU_TREE, lookup=CPU["lookup"], min_prob=CPU["min_prob"]), tree(3, 2, 6, lookup=3), sglang(3, 1, 99)]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.method}-{s.steps}-{s.depth}-{s.topk}-{s.tokens}-"
                         f"{s.lookup}-{s.min_prob:g}")
@pytest.mark.parametrize("m", [30, 7])
def test_replay_equals_the_engine_exactly(tiny, trained, rows, spec, m):
    res = replay(rows, tiny, trained, spec, max_new_tokens=m)
    per, prop, rounds, toks = engine_counts(tiny, trained, spec, [rows.prompt(i) for i in range(len(rows))], m)
    assert toks == [rows.reply(i, m) for i in range(len(rows))]  # the rows are the engine's own greedy replies
    assert (res.per_pos, res.proposed, res.rounds) == (per, prop, rounds)
    assert sum(per) > 0  # a trained draft: acceptance really ran, past depth 1 too
    assert res.tau == pytest.approx(1 + sum(per) / rounds)


def test_rows_reply_ends_at_the_end_token_and_keep_the_continuation(tiny, rows):
    eos = set(rows.eos)
    assert rows.eos == [2]
    ended = [i for i in range(len(rows)) if rows.reply(i)[-1:] and rows.reply(i)[-1] in eos]
    for i in range(len(rows)):
        reply = rows.reply(i)
        assert not (set(reply[:-1]) & eos)
        assert len(rows.tokens[i]) == rows.prompt_lens[i] + 30 + 16  # max_new + lookahead, end tokens ignored
        assert rows.states[i].shape[0] == rows.prompt_lens[i] + len(reply) - 1
    # the recorded states are the target's own: the capture at the draft's streams agrees with HF hooks
    from eyas.target.capture import capture

    cap = capture(tiny.model, torch.tensor([rows.tokens[0]]), tiny.default_layout(rows.streams[1:4]))
    n = rows.states[0].shape[0]
    assert torch.allclose(cap.aux[0, :n].view(n, 3, -1), rows.states[0][:, 1:4], atol=1e-4)
    assert ended or True  # whether a tiny target's reply ends early depends on its weights


def test_rows_round_trip_and_refuse_what_they_cannot_answer(tiny, trained, rows, tmp_path):
    out = save_rows(rows, tmp_path / "rows")
    back = load_rows(out)
    assert back.tokens == rows.tokens and back.streams == rows.streams and back.eos == rows.eos
    assert all(torch.equal(a, b) for a, b in zip(back.states, rows.states, strict=True))
    assert replay(back, tiny, trained, chain(3)).counts() == replay(rows, tiny, trained, chain(3)).counts()
    with pytest.raises(ReplayError, match="captured for at most 30"):
        replay(rows, tiny, trained, chain(2), max_new_tokens=31)
    narrow = load_rows(out)
    narrow.streams = [s + 100 for s in narrow.streams]
    with pytest.raises(ReplayError, match="hold only"):
        replay(narrow, tiny, trained, chain(2))
    other = make_target(seed=5)
    with pytest.raises(ReplayError, match="another model"):
        replay(rows, other, trained, chain(2))
    short = load_rows(out)  # a recording cut right after the replies: the last round needs the lookahead
    short.tokens = [t[:p + len(short.reply(i))] for i, (t, p) in enumerate(zip(short.tokens, short.prompt_lens,
                                                                               strict=True))]
    with pytest.raises(ReplayError, match="--lookahead"):
        replay(short, tiny, trained, chain(4))
    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged)
    data = bytearray((damaged / "rows.safetensors").read_bytes())
    data[-5] ^= 0xFF
    (damaged / "rows.safetensors").write_bytes(bytes(data))
    with pytest.raises(ReplayError, match="damaged"):
        load_rows(damaged)
    (damaged / "manifest.json").write_text("{not json")
    with pytest.raises(ReplayError, match="not JSON|damaged"):
        load_rows(damaged)
    with pytest.raises(ReplayError, match="not a replay-rows folder"):
        load_rows(tmp_path)


def test_planted_faults_change_what_is_accepted(tiny, trained, rows):
    right = replay(rows, tiny, trained, chain(3))
    got = {f.name: replay(rows, tiny, trained, chain(3), plant=f.plant) for f in FAULTS}
    assert sum(right.per_pos) > 0
    for name in ("aux_ids_minus_1", "aux_ids_plus_1", "embedding_mixed_in", "untrained"):
        assert got[name].counts() != right.counts(), name
    assert sum(got["untrained"].per_pos) < sum(right.per_pos) / 2
    # d2t zeroed: draft id i proposes target token i; this test's draft vocab is the identity map, so nothing changes
    assert got["d2t_missing"].counts() == right.counts()


def test_replay_cli_on_a_saved_target_folder(tiny, tmp_path):
    """capture with eyas's engine from a HF folder, then replay with the target loaded without weights (its
    embedding read from the safetensors file alone)."""
    from eyas.draft import save_random_draft
    from eyas.target.load import input_embeddings, load_target

    folder = tmp_path / "target"
    tiny.model.save_pretrained(folder)
    tok = tiny.tokenizer
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok.save_pretrained(folder)
    loaded = load_target(str(folder))
    bare = load_target(str(folder), load_weights=False)
    assert torch.equal(input_embeddings(bare), loaded.embed_tokens().weight)
    draft = save_random_draft(loaded, tmp_path / "draft", draft_vocab=64)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"w{i} w{i + 3} w7"}) for i in range(5, 8)))
    r = CliRunner().invoke(app, ["replay", "capture", "--target", str(folder), "--bench", str(prompts), "--prompts",
                                 "3", "--max-new-tokens", "12", "--draft", str(draft), "--out", str(tmp_path / "rows")])
    assert r.exit_code == 0, r.output
    assert "3 rows" in r.output and "eyas-fp32" in r.output
    r = CliRunner().invoke(app, ["replay", "run", "--rows", str(tmp_path / "rows"), "--draft", str(draft), "--k", "2",
                                 "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["rounds"] > 0 and len(out["per_pos"]) == 2 and out["config"] == "chain k=2"
    r = CliRunner().invoke(app, ["replay", "run", "--rows", str(tmp_path / "rows"), "--draft", str(draft), "--k", "2",
                                 "--depth", "3"])
    assert r.exit_code == 2 and "one serving configuration" in r.output
    r = CliRunner().invoke(app, ["replay", "run", "--rows", str(tmp_path), "--draft", str(draft), "--k", "2"])
    assert r.exit_code == 2 and "not a replay-rows folder" in r.output


@pytest.mark.integration
@pytest.mark.slow
def test_replay_equals_the_engine_on_the_bundled_target(smollm2):
    """The shipped draft on the bundled target (fp32, 3 MT-bench questions x 48 tokens): the replay's counts equal
    eyas's engine's for chain k = 1..5 and the CPU default tree (lookup 4 and min-prob 0.35 included)."""
    from eyas.bench.prompts import load_prompts
    from eyas.draft import load_draft
    from eyas.engine.prompt import chat_input_ids
    from eyas.replay.rows import cached_rows_eyas

    ck = load_draft("default")
    ids = [chat_input_ids(smollm2.tokenizer, r.messages) for r in load_prompts("mt-bench", limit=3)]
    rows = cached_rows_eyas(smollm2, ids, 48, plant_streams(ck.layout.aux_indices, smollm2.num_layers))
    for spec in [chain(k) for k in range(1, 6)] + [tree(*CPU_TREE, lookup=CPU["lookup"], min_prob=CPU["min_prob"])]:
        res = replay(rows, smollm2, ck, spec)
        per, prop, rounds, toks = engine_counts(smollm2, ck, spec, ids, 48)
        assert toks == [rows.reply(i) for i in range(len(rows))]
        assert (res.per_pos, res.proposed, res.rounds) == (per, prop, rounds), spec
        assert sum(per) > 0
