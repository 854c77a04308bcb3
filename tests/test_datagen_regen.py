"""datagen's regeneration: the target's own greedy text (through the engine or HF generate, batched or alone,
seeded when sampling, on native weights in a refilled pool), the repetition stop, the progress bar during
the first chunk, and the self source (the target writes its own prompts).
"""

from collections import Counter

import pytest
import torch
from typer.testing import CliRunner

from eyas.cli import app
from eyas.data.conversations import load_conversations, masked_spans, render, tokenize_conversation
from eyas.data.datagen import DatagenConfig, DatagenError, run_datagen
from eyas.data.regen import (
    _loop_criteria,
    engine_generate,
    generate_replies,
    hf_generate,
    regen_engine,
    stop_token_ids,
    user_turn_opening,
)
from eyas.data.shards import ShardSet
from eyas.target.load import load_target
from tests.test_datagen import _cfg

runner = CliRunner()


def test_regeneration_is_the_targets_own_greedy_text(tmp_path, tiny_dir, tiny_target, conv_file):
    cfg = _cfg(tmp_path / "out", tiny_dir, conv_file, num=3, regenerate=True, max_len=256, max_turns=2,
               repetition_limit=0, max_new_tokens=5, gen_batch=2)
    m = run_datagen(cfg, command="test", progress=False, log=lambda s: None)
    tok, model = tiny_target.tokenizer, tiny_target.model
    convs = load_conversations(str(conv_file), num=3)[0]
    samples = {s.row_id: s for s in ShardSet(tmp_path / "out").samples()}
    n_replies = sum(min(2, sum(x["role"] == "assistant" for x in c.messages)) for c in convs)
    assert m["counts"]["regenerated_replies"] == n_replies and m["config"]["max_turns"] == 2
    for c in convs:
        msgs = [dict(x) for x in c.messages]
        asst = [i for i, x in enumerate(msgs) if x["role"] == "assistant"][:2]
        msgs = msgs[:asst[-1] + 1]
        for i in asst:  # one conversation alone, unbatched: greedy reply given its own earlier replies
            p = tok(render(tok, msgs[:i], add_generation_prompt=True), add_special_tokens=False)["input_ids"]
            out = model.generate(torch.tensor([p]), max_new_tokens=5, do_sample=False, pad_token_id=2)[0, len(p):]
            gen = out.tolist()
            gen = gen[:gen.index(2)] if 2 in gen else gen
            msgs[i] = {"role": "assistant", "content": tok.decode(gen)}
        ids, mask = tokenize_conversation(tok, msgs, max_len=256)
        s = samples[c.row_id]
        assert torch.equal(s.input_ids, ids) and torch.equal(s.loss_mask, mask)
        # the user turns are the original ones
        text = tok.decode(s.input_ids.tolist())
        assert all(x["content"] in text for x in msgs if x["role"] == "user")
        assert len(masked_spans(tok, s.input_ids, s.loss_mask)) == len(asst)


def test_the_bar_moves_with_each_reply_before_the_first_chunk_is_captured(tmp_path, tiny_dir, conv_file,
                                                                         monkeypatch):
    """datagen's bar counts a regenerated conversation 90% done as its replies finish: its position rises during
    the first chunk's generation (so rate and ETA show from the first reply), never goes back, and ends at the
    conversations processed."""
    import tqdm

    import eyas.data.regen as regen

    seen: list[tuple[int, int]] = []
    real = regen.regenerate

    def spy(*a, on_replies=None, **k):
        def note(done: int, total: int) -> None:
            seen.append((done, total))
            on_replies(done, total)
        return real(*a, on_replies=note, **k)

    positions: list[float] = []
    real_update = tqdm.tqdm.update

    def update(self, n=1):
        out = real_update(self, n)
        positions.append(self.n)
        return out

    monkeypatch.setattr("eyas.data.chunks.regenerate", spy)
    monkeypatch.setattr(tqdm.tqdm, "update", update)
    cfg = _cfg(tmp_path / "out", tiny_dir, conv_file, num=4, regenerate=True, max_len=256, max_turns=1,
               repetition_limit=0, max_new_tokens=5, gen_batch=1, shard_samples=8)
    m = run_datagen(cfg, command="test", progress=True, log=lambda s: None)
    assert m["counts"]["conversations"] == 4
    assert seen[-1][0] == seen[-1][1] == m["counts"]["regenerated_replies"]
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)  # replies only ever finish
    during = [x for x in positions if 0 < x < 4 * 0.9 + 1e-9]
    assert len(set(during)) >= 3, positions  # moved reply by reply before any capture
    assert positions == sorted(positions) and positions[-1] == pytest.approx(4)


def test_repetition_stop_matches_loop_end():
    from eyas.data.conversations import loop_end

    g = torch.Generator().manual_seed(0)
    for n in (1, 3, 5):
        seqs = torch.randint(0, 3, (40, 30), generator=g)  # 3 symbols: loops are common
        crit = _loop_criteria(n, prompt_len=0)
        first = [None] * 40
        for T in range(1, 31):
            hit = crit(seqs[:, :T], None)
            for b in range(40):
                if hit[b] and first[b] is None:
                    first[b] = T
        assert first == [loop_end(r, n) for r in seqs.tolist()]


@pytest.mark.parametrize("path", ["engine", "hf"])
def test_repetition_limit_cuts_a_looping_reply(tiny_dir, path):
    t = load_target(str(tiny_dir))
    with torch.no_grad():
        t.model.lm_head.weight.zero_()
        t.model.lm_head.weight[7] = 1.0  # logits: token 7 gets sum(h), every other token 0: a period-1 loop
        t.model.model.norm.weight.fill_(1.0)
    eng = regen_engine(t) if path == "engine" else None
    assert (eng is not None) == (path == "engine")
    cfg = DatagenConfig(out="unused", max_new_tokens=40, repetition_limit=4, max_len=512)
    p = t.tokenizer("hello", add_special_tokens=False)["input_ids"]
    (reply, why), = generate_replies(t, [p], cfg, seed=0, stop_ids=stop_token_ids(t), engine=eng)
    assert why == "repetition" and len(reply) <= 10 and loop_end_len(reply) == len(reply)
    cfg.repetition_limit = 0
    (reply, why), = generate_replies(t, [p], cfg, seed=0, stop_ids=stop_token_ids(t), engine=eng)
    assert why == "length" and len(reply) == 40


def test_engine_batch_matches_each_prompt_alone_and_hf(tiny_dir):
    """Per-row slots, positions and key masks: a prompt's greedy reply in a pool (rows finishing at different
    steps, refilled with the next prompt or compacted out) is the reply it gets alone, and HF generate's."""
    t = load_target(str(tiny_dir))
    eng = regen_engine(t)
    tok = t.tokenizer
    texts = ["hi", "Tell me a long story about a dragon and a castle", "What is 2+2?", "ok", "Name three colors",
             "The quick brown fox jumps over the lazy dog, twice, and then sleeps for a while."]
    prompts = [tok(render(tok, [{"role": "user", "content": x}], add_generation_prompt=True),
                   add_special_tokens=False)["input_ids"] for x in texts]
    caps = [3, 17, 9, 12, 5, 14]  # different lengths: rows leave the batch at different steps
    stop = stop_token_ids(t)
    full = engine_generate(eng, prompts, caps, stop, repetition_limit=0)
    pooled = engine_generate(eng, prompts, caps, stop, repetition_limit=0, width=2)  # rows refilled as they end
    for p, c, got, got2 in zip(prompts, caps, full, pooled, strict=True):
        alone = engine_generate(eng, [p], [c], stop, repetition_limit=0)[0]
        hf = hf_generate(t, [p], c, stop, repetition_limit=0)[0]
        assert got == got2 == alone == hf, (got, got2, alone, hf)
        assert got[1] in ("eos", "length") and (got[1] == "eos" or len(got[0]) == c)


def test_engine_sampling_is_seeded(tiny_dir):
    t = load_target(str(tiny_dir))
    eng = regen_engine(t)
    p = [t.tokenizer("hello there", add_special_tokens=False)["input_ids"]] * 3
    stop = stop_token_ids(t)
    a = engine_generate(eng, p, [20] * 3, stop, 0, temperature=1.0, top_p=0.9, seed=5)
    b = engine_generate(eng, p, [20] * 3, stop, 0, temperature=1.0, top_p=0.9, seed=5)
    c = engine_generate(eng, p, [20] * 3, stop, 0, temperature=1.0, top_p=0.9, seed=6)
    assert a == b and a != c
    assert len({tuple(r) for r, _ in a}) > 1  # the rows of one batch draw different tokens


def loop_end_len(reply):
    from eyas.data.conversations import loop_end

    return loop_end(reply, 4)


@pytest.mark.integration
def test_smollm2_regenerates_its_own_greedy_reply(tmp_path, smollm2):
    cfg = DatagenConfig(out=str(tmp_path / "o"), data="sharegpt", num=2, max_len=256, max_turns=1,
                        max_new_tokens=12, repetition_limit=0, dtype="fp32")
    m = run_datagen(cfg, command="t", progress=False, log=lambda s: None, target=smollm2)
    tok = smollm2.tokenizer
    convs = load_conversations("sharegpt", num=2)[0]
    samples = list(ShardSet(tmp_path / "o").samples())
    assert m["counts"]["regenerated_replies"] == 2
    for c, s in zip(convs, samples, strict=True):
        p = tok(render(tok, c.messages[:1], add_generation_prompt=True), add_special_tokens=False)["input_ids"]
        out = smollm2.model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p):].tolist()
        out = out[:out.index(2)] if 2 in out else out
        spans = masked_spans(tok, s.input_ids, s.loss_mask)
        assert [x.text for x in spans] == [tok.decode(out) + "<|im_end|>"]
    assert Counter(m["counts"])["finish_length"] + Counter(m["counts"])["finish_eos"] == 2


def test_self_source_needs_a_bound_regeneration_and_a_chat_tuned_target(tmp_path, tiny_dir):
    def cfg(**kw):
        return DatagenConfig(**{**dict(out=str(tmp_path / "o"), target=str(tiny_dir), data="self", num=3,
                                       max_len=512, dtype="fp32", shard_samples=4, max_new_tokens=4), **kw})

    for kw, msg in [(dict(num=None), "endless source: pass --num N"),
                    (dict(regenerate=False), "needs --regenerate and no --raw"),
                    (dict(raw=True), "needs --regenerate and no --raw")]:
        with pytest.raises(DatagenError, match=msg):
            cfg(**kw).validate()
    res = runner.invoke(app, ["datagen", "--target", str(tiny_dir), "--data", "self", "--out", str(tmp_path / "c")])
    assert res.exit_code == 2 and "--data self is an endless source" in res.output, res.output
    cfg(end_row=5, num=None).validate()  # a row bound is enough
    # a random model never ends a user turn of its own: every row is skipped, loudly, with the reason and the fix
    with pytest.raises(DatagenError, match="self_prompt_unfinished 3; self_prompt_unfinished: .*chat-tuned target"):
        run_datagen(cfg(), command="t", progress=False, log=lambda s: None)


def test_user_turn_opening_is_the_templates_text_before_the_users(smollm2_tokenizer, tmp_path):
    tok = smollm2_tokenizer
    opening = user_turn_opening(tok)
    assert tok.decode(opening) == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                                   "Hugging Face<|im_end|>\n<|im_start|>user\n")
    full = tok.apply_chat_template([{"role": "user", "content": "Hello there"}], tokenize=True)
    full = full["input_ids"] if hasattr(full, "keys") else full
    assert list(full[:len(opening)]) == opening  # what serving renders starts with it
    from transformers import AutoTokenizer

    tok.save_pretrained(tmp_path)
    odd = AutoTokenizer.from_pretrained(tmp_path)
    odd.chat_template = "{% for m in messages %}{{ m['content'] | lower }}{% endfor %}"
    with pytest.raises(ValueError, match="does not render the user's text verbatim"):
        user_turn_opening(odd)


@pytest.mark.integration
def test_smollm2_writes_its_own_prompts_and_greedy_replies_and_resumes_them(tmp_path, smollm2):
    def run(out, num):
        cfg = DatagenConfig(out=str(out), data="self", num=num, max_len=512, max_new_tokens=8, repetition_limit=0,
                            dtype="fp32", shard_samples=2)
        return run_datagen(cfg, command="t", progress=False, log=lambda s: None, target=smollm2)

    m = run(tmp_path / "a", 4)
    assert m["config"]["source"] == "self" and m["config"]["source_fingerprint"].startswith("self-prompt t=1.0")
    assert m["counts"]["rows"] == 4 and m["counts"]["samples"] + sum(m["skipped"].values()) == 4
    assert m["counts"]["samples"] >= 2 and m["counts"]["self_prompts"] == m["counts"]["samples"]
    tok = smollm2.tokenizer
    opening = tok.decode(user_turn_opening(tok))
    samples = list(ShardSet(tmp_path / "a").samples())
    for s in samples:
        text = tok.decode(s.input_ids.tolist())
        assert text.startswith(opening) and text.count("<|im_start|>user\n") == 1
        user = text[len(opening):text.index("<|im_end|>", len(opening))]
        assert user.strip()  # the target wrote a user turn
        p = tok(render(tok, [{"role": "user", "content": user}], add_generation_prompt=True),
                add_special_tokens=False)["input_ids"]
        out = smollm2.model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):].tolist()
        out = out[:out.index(2)] if 2 in out else out
        assert [x.text for x in masked_spans(tok, s.input_ids, s.loss_mask)] == [tok.decode(out) + "<|im_end|>"]
    run(tmp_path / "b", 2)  # the same rows in two runs: seeded per chunk, so resuming writes the same samples
    run(tmp_path / "b", 4)
    again = list(ShardSet(tmp_path / "b").samples())
    assert [s.row_id for s in again] == [s.row_id for s in samples]
    assert all(torch.equal(x.input_ids, y.input_ids) for x, y in zip(again, samples, strict=True))


def test_native_engine_pool_matches_each_prompt_alone(tiny_dir):
    """Regeneration on native weights (the whole decoder stack in one C call, per-row cache slots written by the
    kernel): a prompt's reply in a refilled pool is the reply it gets alone, and plain decoding's."""
    from eyas.engine.forward import TargetModel
    from eyas.native import kernels
    from tests.tiny import tiny_native

    t = load_target(str(tiny_dir))
    eng = TargetModel(t.model, tiny_native(t.model))
    assert isinstance(eng.stack, kernels.Q4Stack)
    tok = t.tokenizer
    texts = ["hi", "Tell me a long story about a dragon and a castle", "What is 2+2?", "ok", "Name three colors"]
    prompts = [tok(render(tok, [{"role": "user", "content": x}], add_generation_prompt=True),
                   add_special_tokens=False)["input_ids"] for x in texts]
    caps = [3, 17, 9, 12, 5]
    stop = stop_token_ids(t)
    full = engine_generate(eng, prompts, caps, stop, repetition_limit=0)
    pooled = engine_generate(eng, prompts, caps, stop, repetition_limit=0, width=2)
    for p, c, got, got2 in zip(prompts, caps, full, pooled, strict=True):
        alone = engine_generate(eng, [p], [c], stop, repetition_limit=0)[0]
        assert got == got2 == alone, (got, got2, alone)
        cache = eng.new_cache(1, len(p) + c + 1)  # plain decoding: one row, causal, the KV cache grows by one
        ids, out = list(p), []
        for _ in range(len(got[0]) + (got[1] == "eos")):
            logits = eng.forward(torch.tensor([ids[-1:] if out else ids]), torch.arange(len(ids) - (1 if out else
                                 len(ids)), len(ids))[None], cache).logits[0, -1]
            cache.length = len(ids)
            out.append(int(logits.argmax()))
            ids.append(out[-1])
        assert out[:len(got[0])] == got[0]
