"""Speculative decoding is lossless: greedy token-identical to plain, sampling distributed as plain.

Tiny random Llama targets (vocab 128, a word-level tokenizer built here) with a random EAGLE-3 draft and
with a draft trained in the test by eyas.ttt on the target's own greedy continuations (so acceptance is
well above zero and the deep-acceptance / compaction / EOS-inside-a-run paths really run). The refusals
(inconsistent parameters, missing or foreign drafts) are in tests/test_engine_refusals.py.
"""

from __future__ import annotations

import pytest
import torch

from eyas.draft import DraftCheckpoint, DraftConfig, Eagle3Draft, random_draft
from eyas.engine.decode import Engine
from eyas.engine.params import EngineError, SamplingParams, SpecParams
from eyas.engine.prompt import chat_input_ids
from eyas.engine.sampling import warp
from eyas.target.capture import capture
from eyas.target.convert import tensor_fingerprint
from eyas.target.load import Target, identity_of
from eyas.train.ttt import ttt_forward
from tests.tiny import tiny_model

VOCAB = 128
SHARPEN = 30.0


def word_tokenizer(vocab: int = VOCAB):
    """A real (fast) HF tokenizer over words w0..w{vocab-1}; 'w2' is the EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="w0", eos_token="w2")


def make_target(family: str = "llama", seed: int = 0, eos: int = 2, layers: int = 6) -> Target:
    m = tiny_model(family, seed=seed, vocab=VOCAB, layers=layers)
    with torch.no_grad():  # default init gives near-uniform next-token distributions; make them peaked like an LM's
        m.get_output_embeddings().weight.mul_(SHARPEN)
    m.config.eos_token_id = eos
    m.generation_config.eos_token_id = eos
    return Target(model=m, tokenizer=word_tokenizer(), identity=identity_of(m, tensor_fingerprint(m), "tiny"),
                  source="tiny", path=None)


PROMPTS = [[5, 6, 7, 8], [1, 3], list(range(10, 40)), [99, 12, 99, 12, 99]]


def prompts_for_training(n: int, seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def train_draft(target: Target, steps: int = 80, ttt_steps: int = 3, fc_norm: bool = False) -> DraftCheckpoint:
    """Fit a draft with eyas.ttt on the target's own greedy continuations (few seconds); fc_norm: an EAGLE 3.1
    draft (one RMSNorm per aux state before fc)."""
    from dataclasses import replace

    ck = random_draft(target, draft_vocab=VOCAB, seed=2)  # full vocab: every target token is reachable
    if fc_norm:
        ck.model = Eagle3Draft(replace(ck.model.config, fc_norm=True))
    ck.model.set_vocab_map(torch.arange(VOCAB))
    plain = Engine(target, None, SpecParams(method="plain"))
    seqs = []
    for p in PROMPTS + prompts_for_training(28):
        r = plain.generate(p, SamplingParams(max_new_tokens=40))
        seqs.append(p + r.token_ids)
    S = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), S, dtype=torch.long)
    mask = torch.zeros(len(seqs), S, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = True
    cap = capture(target.model, ids, ck.layout)
    draft = ck.model
    draft.set_embeddings(target.embed_tokens().weight)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    draft.train()
    for _ in range(steps):
        out = ttt_forward(draft, cap.aux, cap.final_prenorm, ids, mask, target.final_norm(), target.lm_head(),
                          ttt_steps)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    draft.eval()
    return ck


@pytest.fixture(scope="module")
def tiny():
    return make_target()


@pytest.fixture(scope="module")
def trained(tiny):
    return train_draft(tiny)


CONFIGS = [
    SpecParams("chain", steps=1),
    SpecParams("chain", steps=4),
    SpecParams("tree", depth=3, topk=3, tokens=8),
    SpecParams("tree", depth=5, topk=2, tokens=12),
    SpecParams("tree", depth=2, topk=4, tokens=21),  # the whole pool: 1 + 4 + 16
    SpecParams("tree", depth=4, topk=1, tokens=5),
]


def greedy(engine: Engine, prompt, n: int = 40) -> list[int]:
    return engine.generate(prompt, SamplingParams(max_new_tokens=n)).token_ids


@pytest.mark.parametrize("which", ["random", "trained"])
def test_greedy_speculative_equals_plain(tiny, trained, which):
    draft = random_draft(tiny) if which == "random" else trained
    plain = Engine(tiny, None, SpecParams(method="plain"))
    refs = [greedy(plain, p) for p in PROMPTS]
    taus = []
    for spec in CONFIGS:
        eng = Engine(tiny, draft, spec)
        for p, ref in zip(PROMPTS, refs, strict=True):
            res = eng.generate(p, SamplingParams(max_new_tokens=40))
            assert res.token_ids == ref, f"{spec} prompt {p}"
            st = res.stats
            assert st.new_tokens == len(ref) and st.target_forwards == st.rounds + 1
            assert sum(st.accepted_per_depth) + st.rounds >= st.new_tokens - 1
            taus.append(st.tau)
    if which == "trained":
        assert sum(taus) / len(taus) > 1.8, taus  # the trained draft really gets accepted, at depth
    else:
        assert min(taus) >= 1.0


LOOKUP_CONFIGS = [SpecParams("tree", depth=3, topk=3, tokens=8, lookup=6),
                  SpecParams("chain", steps=2, lookup=8, lookup_ngram=4)]


def test_lookup_merged_tree_is_lossless_and_accepted(tiny, trained):
    """Lookup candidates merged into the draft's tree: greedy output stays identical to plain, and on repetitive
    prompts lookup-only nodes are proposed and accepted (greedy tiny targets loop, like SmolLM2 does)."""
    plain = Engine(tiny, None, SpecParams(method="plain"))
    prompts = PROMPTS + [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10] * 6]
    for draft in (random_draft(tiny), trained):
        for spec in LOOKUP_CONFIGS:
            eng = Engine(tiny, draft, spec)
            proposed = accepted = 0
            for p in prompts:
                ref = greedy(plain, p, 60)
                res = eng.generate(p, SamplingParams(max_new_tokens=60))
                assert res.token_ids == ref, f"{spec} prompt {p}"
                st = res.stats
                assert st.lookup_accepted <= st.lookup_proposed
                assert sum(st.accepted_per_depth) + st.rounds >= st.new_tokens - 1
                proposed += st.lookup_proposed
                accepted += st.lookup_accepted
            assert proposed > 0 and accepted > 0, (spec, proposed, accepted)


@pytest.mark.parametrize("n", [1, 4])
def test_lookup_method_verifies_the_chain_alone_and_stays_lossless(tiny, n):
    """Method lookup: no draft (none is loaded, no features are captured), the root plus the lookup chain
    verified each round; greedy output identical to plain, and the looping prompts get lookup tokens accepted."""
    plain = Engine(tiny, None, SpecParams(method="plain"))
    eng = Engine(tiny, None, SpecParams("lookup", lookup=n))
    assert eng.speculative and not eng.drafts
    proposed = accepted = 0
    for p in PROMPTS + [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10] * 6]:
        ref = greedy(plain, p, 60)
        res = eng.generate(p, SamplingParams(max_new_tokens=60))
        assert res.token_ids == ref, p
        st = res.stats
        assert st.draft_forwards == 0  # no draft model runs: only the lookup search (counted, not timed)
        assert len(st.accepted_per_depth) == n and st.lookup_accepted == sum(st.accepted_per_depth)
        # every round commits its accepted lookup tokens plus one (the last round's may be cut at the limit)
        assert st.new_tokens == len(ref) and st.rounds + st.lookup_accepted >= len(ref) - 1
        assert st.rounds <= len(ref) - 1 - (st.lookup_accepted > 0)
        proposed += st.lookup_proposed
        accepted += st.lookup_accepted
    assert proposed > 0 and accepted > 0, (proposed, accepted)


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_chunked_prefill_yields_between_chunks_and_stays_lossless(tiny, trained, chunk):
    """prefill_chunk (set by the server so other requests run between a long prompt's chunks): an empty round
    after each chunk but the last, one target forward per chunk, and the same tokens as the whole-prompt
    prefill, greedy and seeded sampling alike."""
    for spec, draft in ((SpecParams(method="plain"), None), (SpecParams("tree", depth=3, topk=2, tokens=6), trained),
                        (SpecParams("lookup", lookup=4), None)):
        whole, chunked = Engine(tiny, draft, spec), Engine(tiny, draft, spec)
        chunked.prefill_chunk = chunk
        for p in PROMPTS:
            for params in (SamplingParams(max_new_tokens=20), SamplingParams(temperature=0.8, seed=3,
                                                                               max_new_tokens=20)):
                ref = whole.generate(p, params)
                rounds = list(chunked.stream(p, params))
                n_chunks = -(-len(p) // chunk)
                assert rounds[:n_chunks - 1] == [[]] * (n_chunks - 1) and rounds[n_chunks - 1], (spec, p)
                res = chunked.last_result
                assert res.token_ids == ref.token_ids, (spec, p, params)
                assert res.stats.target_forwards == n_chunks + res.stats.rounds


def test_min_prob_shrinks_unsure_rounds_and_stays_lossless(tiny, trained):
    """--min-prob: candidates below the cumulative draft probability are not verified. Output stays identical to
    plain; a high threshold verifies fewer rows (rounds of the root alone count as rounds without proposals),
    and min_prob 0 is today's full tree."""
    plain = Engine(tiny, None, SpecParams(method="plain"))
    rows = {}
    for mp in (0.0, 0.3, 0.9):
        eng = Engine(tiny, trained, SpecParams("tree", depth=3, topk=3, tokens=8, min_prob=mp))
        proposed = 0
        for p in PROMPTS:
            res = eng.generate(p, SamplingParams(max_new_tokens=40))
            assert res.token_ids == greedy(plain, p), (mp, p)
            proposed += sum(res.stats.proposed_per_depth)
        rows[mp] = proposed
    assert rows[0.0] > rows[0.3] > rows[0.9], rows
    lk = Engine(tiny, trained, SpecParams("tree", depth=3, topk=3, tokens=8, lookup=6, min_prob=0.99))
    p = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    assert lk.generate(p, SamplingParams(max_new_tokens=60)).token_ids == greedy(plain, p, 60)
    with pytest.raises(EngineError, match="min_prob 1.0 must be in"):
        Engine(tiny, trained, SpecParams("tree", min_prob=1.0))


def test_lookup_needs_a_draft_method(tiny):
    with pytest.raises(EngineError, match="lookup candidates are merged into a draft's tree"):
        Engine(tiny, None, SpecParams(method="plain", lookup=4))
    with pytest.raises(EngineError, match="lookup -1 must be >= 0"):
        Engine(tiny, random_draft(tiny), SpecParams("tree", lookup=-1))
    with pytest.raises(EngineError, match="give it --lookup 1 or more"):
        Engine(tiny, None, SpecParams("lookup", lookup=0))
    with pytest.raises(EngineError, match="method lookup drafts nothing"):
        Engine(tiny, None, SpecParams("lookup", lookup=4, min_prob=0.3))


def test_max_new_tokens_boundaries(tiny, trained):
    plain = Engine(tiny, None, SpecParams(method="plain"))
    ref = greedy(plain, PROMPTS[2], 30)
    for spec in (SpecParams("chain", steps=5), SpecParams("tree", depth=4, topk=3, tokens=10)):
        eng = Engine(tiny, trained, spec)
        for n in (1, 2, 3, 5, 8, 13, 21):
            res = eng.generate(PROMPTS[2], SamplingParams(max_new_tokens=n))
            expect = ref[:n]
            assert res.token_ids == expect and len(res.token_ids) <= n
            assert res.finish_reason == ("stop" if 2 in expect else "length")


def test_eos_inside_an_accepted_run(trained):
    """EOS = a token the greedy output repeats: the draft proposes runs through it; everything after the first
    EOS is dropped, and the output equals plain decoding that stops at that EOS."""
    base = make_target()
    plain0 = greedy(Engine(base, None, SpecParams(method="plain")), PROMPTS[0], 40)
    # the most repeated token of the plain continuation, appearing after a few tokens
    counts = {t: plain0.count(t) for t in set(plain0[3:])}
    eos = max(counts, key=counts.get)
    assert counts[eos] >= 3
    t = make_target(eos=eos)
    ck = DraftCheckpoint(model=trained.model, layout=t.default_layout(), manifest={})
    ref = Engine(t, None, SpecParams(method="plain")).generate(PROMPTS[0], SamplingParams(max_new_tokens=40))
    assert ref.token_ids[-1] == eos and ref.finish_reason == "stop"
    dropped_somewhere = False
    for spec in (SpecParams("chain", steps=4), SpecParams("tree", depth=4, topk=2, tokens=8)):
        eng = Engine(t, ck, spec)
        chunks = list(eng.stream(PROMPTS[0], SamplingParams(max_new_tokens=40)))
        res = eng.last_result
        assert [x for c in chunks for x in c] == res.token_ids == ref.token_ids
        assert res.finish_reason == "stop" and res.token_ids.count(eos) == 1
        st = res.stats
        dropped_somewhere |= sum(st.accepted_per_depth) + st.rounds > st.new_tokens - 1
    assert dropped_somewhere, "no round accepted tokens past the EOS; the test did not exercise the case"


def test_stop_strings_trim_text_and_tokens(tiny, trained):
    plain = Engine(tiny, None, SpecParams(method="plain"))
    ref = plain.generate(PROMPTS[1], SamplingParams(max_new_tokens=30))
    words = ref.text.split()
    stop = " ".join(words[4:6])  # two words in the middle of the output
    cut = ref.text.index(stop)
    for eng in (plain, Engine(tiny, trained, SpecParams("chain", steps=4)),
                Engine(tiny, trained, SpecParams("tree", depth=3, topk=2, tokens=6))):
        res = eng.generate(PROMPTS[1], SamplingParams(max_new_tokens=30, stop=["nothing-like-this", stop]))
        assert res.finish_reason == "stop"
        assert res.text == ref.text[:cut]
        # the tokens end with the one that completed the stop string
        assert tiny.tokenizer.decode(res.token_ids).endswith(stop)
        assert res.token_ids == ref.token_ids[:len(res.token_ids)]


def test_stats_are_consistent(tiny, trained):
    eng = Engine(tiny, trained, SpecParams("tree", depth=3, topk=2, tokens=6))
    st = eng.generate(PROMPTS[0], SamplingParams(max_new_tokens=25)).stats
    assert st.prompt_tokens == len(PROMPTS[0]) and st.rounds >= 1
    assert len(st.accept_rates) == 3 and all(0.0 <= a <= 1.0 for a in st.accept_rates)
    assert st.proposed_per_depth[0] == st.rounds  # depth 1 is attempted every round
    for d in range(1, 3):  # depth d+1 can only be attempted after depth d was accepted
        assert st.proposed_per_depth[d] <= st.accepted_per_depth[d - 1]
    assert st.draft_forwards >= st.rounds  # every round drafts: step 0 at least
    assert st.total_s >= st.prefill_s + st.draft_s + st.verify_s * 0.99 > 0
    assert 0.0 <= st.draft_share <= 1.0 and st.tok_s > 0 and st.decode_tok_s > 0
    d = st.to_dict()
    assert d["tau"] == st.tau and d["accept_rates"] == st.accept_rates
    plain = Engine(tiny, None, SpecParams(method="plain")).generate(PROMPTS[0], SamplingParams(max_new_tokens=9))
    if plain.finish_reason == "length":
        assert plain.stats.tau == 1.0 and plain.stats.rounds == 8


# ---- sampling: distribution of the first tokens equals plain sampling --------------------------------------

def exact_first_two(target: Target, prompt: list[int], sp: SamplingParams) -> torch.Tensor:
    """Exact joint P(x1, x2) [V, V] of plain sampling under the warp (one batched forward)."""
    m = target.model
    with torch.no_grad():
        l1 = m(input_ids=torch.tensor([prompt]), use_cache=False).logits[0, -1]
        p1 = warp(l1, sp.temperature, sp.top_k, sp.top_p)
        ids = torch.cat([torch.tensor([prompt]).expand(VOCAB, -1), torch.arange(VOCAB)[:, None]], 1)
        l2 = m(input_ids=ids, use_cache=False).logits[:, -1]
        p2 = warp(l2, sp.temperature, sp.top_k, sp.top_p)
    return p1[:, None] * p2


def sample_first_two(eng: Engine, prompt: list[int], sp: SamplingParams, n: int):
    """Counts [VOCAB * VOCAB] of the first two tokens of n runs seeded 0..n-1, and each run's GenStats."""
    counts = torch.zeros(VOCAB * VOCAB, dtype=torch.float64)
    stats = []
    for seed in range(n):
        res = eng.generate(prompt, SamplingParams(**{**sp.__dict__, "seed": seed}))
        x1, x2 = res.token_ids[:2]
        counts[x1 * VOCAB + x2] += 1
        stats.append(res.stats)
    return counts, stats


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells with expectation < 5 are pooled into one cell."""
    n = counts.sum()
    exp = probs * n
    big = exp >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    ex = torch.cat([exp[big], exp[~big].sum()[None]])
    keep = ex > 0
    stat = (((obs - ex) ** 2)[keep] / ex[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat.double() / 2))


@pytest.mark.slow
@pytest.mark.parametrize("spec", [SpecParams("chain", steps=2), SpecParams("tree", depth=2, topk=3, tokens=7),
                                  SpecParams("tree", depth=2, topk=3, tokens=7, lookup=3),
                                  SpecParams("lookup", lookup=3)],
                         ids=["chain", "tree", "tree-lookup", "lookup"])
def test_sampling_matches_plain_distribution(tiny, trained, spec):
    """Joint distribution of the first two tokens of 1500 seeded speculative runs vs the exact plain-sampling
    distribution (computed from the target's logits): Pearson chi-square must not reject at p < 1e-6. Under
    losslessness the statistic is chi-square distributed, so a false failure has probability ~1e-6 (and the
    fixed seeds make the outcome deterministic on a given platform). Power, checked by hand with the same
    trained draft: accepting candidates with probability min(1, 1.5 p(x)) instead of p(x) gives p ~ 1e-17 at
    n = 1500, while the correct engine gave p = 0.31 (chain) and 0.18 (tree)."""
    # with lookup, a prompt where the last token t was followed by (almost) every token once: whatever x1 is,
    # (t, x1) occurred, so a lookup candidate for x2 is always proposed (and judged by rejection sampling)
    prompt = PROMPTS[0] if not spec.lookup else [x for v in range(3, VOCAB - 2) for x in (9, v)] + [9]
    if spec.method == "lookup":  # no draft: a prompt whose looping greedy text makes lookup's guesses likely
        prompt = [1, 3] + greedy(Engine(tiny, None, SpecParams(method="plain")), [1, 3], 24)
    sp = SamplingParams(temperature=1.0, top_k=12, top_p=0.95, max_new_tokens=2)
    exact = exact_first_two(tiny, prompt, sp).reshape(-1)
    n = 1500
    counts, stats = sample_first_two(Engine(tiny, trained, spec), prompt, sp, n)
    accepted = sum(st.accepted_per_depth[0] for st in stats)
    lookup = sum(st.lookup_proposed for st in stats)
    assert not spec.lookup or lookup > 0, "no lookup candidate was proposed; the test would not exercise them"
    accepted_by = "lookup" if spec.method == "lookup" else "the draft"
    assert accepted > n * 0.2, f"{accepted_by} is hardly ever accepted; the test would not exercise acceptance"
    assert chi2_pvalue(counts, exact.double()) > 1e-6


def test_sampling_is_reproducible_with_seed(tiny, trained):
    eng = Engine(tiny, trained, SpecParams("tree", depth=3, topk=2, tokens=6))
    sp = SamplingParams(temperature=0.9, top_p=0.9, max_new_tokens=20, seed=11)
    assert eng.generate(PROMPTS[2], sp).token_ids == eng.generate(PROMPTS[2], sp).token_ids


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral", "gemma3_text"])
def test_other_families_lossless_with_random_draft(family):
    t = make_target(family, seed=3, layers=4)
    ref = greedy(Engine(t, None, SpecParams(method="plain")), PROMPTS[2], 24)
    for spec in (SpecParams("chain", steps=3), SpecParams("tree", depth=3, topk=3, tokens=9)):
        assert greedy(Engine(t, random_draft(t), spec), PROMPTS[2], 24) == ref
    if family == "gemma3_text":  # 24 new tokens cross the tiny model's sliding window of 6: HF agrees
        ids = torch.tensor([PROMPTS[2]])
        hf = t.model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None)[0, ids.shape[1]:]
        assert ref == hf.tolist()[:len(ref)]


# ---- integration: the real bundled target -------------------------------------------------------------------

@pytest.mark.integration
def test_smollm2_mtbench_speculative_equals_plain(smollm2):
    from eyas.bench.prompts import load_mtbench

    torch.manual_seed(0)
    d = Eagle3Draft(DraftConfig.from_target_config(smollm2.model.config, draft_vocab_size=2048))
    d.set_vocab_map(torch.arange(2048))  # the most frequent ids come first in SmolLM2's BPE vocab
    ck = DraftCheckpoint(model=d, layout=smollm2.default_layout(), manifest={})
    plain = Engine(smollm2, None, SpecParams(method="plain"))
    engines = [Engine(smollm2, ck, SpecParams("chain", steps=3)),
               Engine(smollm2, ck, SpecParams("tree", depth=3, topk=2, tokens=6))]
    sp = SamplingParams(max_new_tokens=48)
    for p in load_mtbench(3, 1, None):
        ids = chat_input_ids(smollm2.tokenizer, p.messages)
        ref = plain.generate(ids, sp)
        assert len(ref.token_ids) > 0
        for eng in engines:
            assert eng.generate(ids, sp).token_ids == ref.token_ids, (p.id, eng.spec)



# ---- CLI ----------------------------------------------------------------------------------------------------

def test_generate_cli(tmp_path, tiny, monkeypatch):
    from typer.testing import CliRunner

    from eyas.cli import app

    folder = tmp_path / "tiny"
    tiny.model.save_pretrained(folder, safe_serialization=True)
    tiny.tokenizer.save_pretrained(folder)
    runner = CliRunner()
    base = ["generate", "--target", str(folder), "--prompt", "w5 w6 w7 w8", "--raw", "--max-new-tokens", "12"]
    plain = runner.invoke(app, base + ["--draft", "none"])
    assert plain.exit_code == 0, plain.output
    assert "[plain] " in plain.output and "tok/s" in plain.output
    # --weights auto on a HF folder runs fp32, and the user is told why native did not run
    assert "weights: target fp32 (--weights auto: " in plain.output and "is not a GGUF target" in plain.output
    ref = Engine(tiny, None, SpecParams(method="plain")).generate([5, 6, 7, 8], SamplingParams(max_new_tokens=12))
    assert ref.text in plain.output
    spec = runner.invoke(app, base + ["--draft", "random", "--method", "chain", "--steps", "2"])
    assert spec.exit_code == 0, spec.output
    assert ref.text in spec.output and "tau " in spec.output and "acceptance per depth: d1=" in spec.output
    assert "weights: target fp32, draft fp32 (" in spec.output
    lk = runner.invoke(app, base + ["--method", "lookup", "--lookup", "3"])  # --draft default: not loaded
    assert lk.exit_code == 0, lk.output
    assert "[lookup] " in lk.output and ref.text in lk.output and "tau " in lk.output
    assert "weights: target fp32 (" in lk.output  # no draft weights: none was loaded
    forced = runner.invoke(app, base + ["--draft", "none", "--weights", "fp32"])
    assert forced.exit_code == 0 and "weights: target fp32\n" in forced.output, forced.output  # asked for: no note
    cases = [(["--draft", "none", "--method", "tree"], "needs a draft"),
             (["--draft", "random", "--topk", "1", "--depth", "3", "--tokens", "8"], "--tokens 4"),
             (["--draft", "random", "--temperature", "-1"], "temperature")]
    # an install without the shipped draft (the package data left out): --draft default is one clear error
    monkeypatch.setattr("eyas.draft.bundled_draft_path", lambda name="default": tmp_path / "not-shipped" / name)
    cases.append((["--draft", "default"], "bundled draft"))
    for extra, match in cases:
        bad = runner.invoke(app, base + extra)
        assert bad.exit_code == 2 and match in bad.output, (extra, bad.output)


def test_q8_draft_runs_its_layer_in_one_c_call_with_the_torch_layers_arithmetic(tiny, trained):
    """--draft-weights q8 runs the draft layer through eyas_draft_layer: the same numbers as the q8 draft's torch
    modules (to float rounding), and decoding stays token-identical to plain."""
    eng = Engine(tiny, trained, SpecParams("tree", depth=3, topk=2, tokens=6, draft_weights="q8"))
    assert eng.draft_layer is not None
    d, c = eng.draft, eng.draft.config
    torch.manual_seed(0)
    R, slot = 3, 9
    dk = torch.randn(1, c.num_key_value_heads, 16, c.head_dim)
    dv = torch.randn_like(dk)
    dk2, dv2 = dk.clone(), dv.clone()
    hid = torch.randn(1, R, c.hidden_size) * 3
    ids, pos = torch.randint(3, VOCAB, (1, R)), torch.tensor([[9, 10, 10]])
    mask = torch.zeros(1, 1, R, slot + R, dtype=torch.bool)
    mask[..., :slot] = True
    mask[0, 0, 0, slot] = mask[0, 0, 1, slot] = mask[0, 0, 1, slot + 1] = mask[0, 0, 2, slot] = True
    mask[0, 0, 2, slot + 2] = True
    fast = eng.draft_layer(hid, d.embed(ids), pos, dk, dv, slot, mask)
    q, k, v = d.qkv(hid, ids, pos)
    dk2[:, :, slot:slot + R], dv2[:, :, slot:slot + R] = k, v
    ref = d.finish(d.attend(q, dk2[:, :, :slot + R], dv2[:, :, :slot + R], mask), hid)
    assert float((fast - ref).norm() / ref.norm()) < 1e-5
    assert torch.allclose(dk, dk2, atol=1e-5) and torch.allclose(dv, dv2, atol=1e-5)  # the same cache rows
    plain = Engine(tiny, None, SpecParams(method="plain"))
    for p in PROMPTS:
        assert greedy(eng, p) == greedy(plain, p)
