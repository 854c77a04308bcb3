"""eyas's engine forward on the MoE and MLA families (Qwen3-MoE, gpt-oss, DeepSeek-V3) against Hugging Face, and
lossless speculation over them.

Tiny random models from tests/moe.py (vocab cut to the word tokenizer's 128), with the router weights, the q/k
projections, gpt-oss's sinks and DeepSeek's correction bias scaled up so routing and attention are far from
uniform: each control drops one family rule and must then miss HF by far more than the tolerance."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eyas.draft import random_draft
from eyas.engine.forward import KVCache, TargetModel
from eyas.engine.load import EngineParts, make_engine
from eyas.engine.params import SamplingParams, TreeSettings
from eyas.engine.rowwise import ROW_OPS
from eyas.engine.weights import engine_model
from eyas.target.convert import check_gguf_architecture, convert_gguf, tensor_fingerprint
from eyas.target.family import ModelError, TargetError
from eyas.target.load import Target, identity_of
from tests.moe import moe_config
from tests.test_engine import PROMPTS, VOCAB, word_tokenizer
from tests.tiny import gguf_bytes, tiny_model

FAMILIES = ("qwen3_moe", "gpt_oss", "deepseek_v3")
ATOL = 1e-4
SHARP = 6.0  # router and q/k scale: peaked routing and attention
HEAD = 30.0  # peaked next-token distributions, like an LM's
SCALED = ("mlp.gate.weight", "router.weight", "q_proj", "k_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")


def build(family: str, seed: int = 0, **config):
    cfg, cls = moe_config(family)
    cfg.vocab_size = VOCAB
    for k, v in config.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    m = cls(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if any(s in name for s in SCALED):
                p.mul_(SHARP)
            if name.endswith("sinks"):
                p.normal_(0.0, 2.0)
        for layer in m.model.layers:
            bias = getattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias", None)
            if bias is not None:  # large enough to change which experts win
                bias.normal_(0.0, 0.5)
        m.get_output_embeddings().weight.mul_(HEAD)
        m.get_output_embeddings().weight[2] = 0.0  # EOS's logit stays 0, below the best: replies run their length
    m.config.eos_token_id = 2
    m.generation_config.eos_token_id = 2
    return m


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return build(request.param)


def run_against_hf(m, tm: TargetModel) -> list[float]:
    """Max |logit diff| vs HF: a 2-row prefill of 20 tokens, a 3-token causal chunk, then 3 single-token steps
    through the cache (each compared with HF's full forward over the whole sequence)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 20), generator=g)
    cache = tm.new_cache(2, 32)
    out = tm.forward(ids, torch.arange(20).expand(2, 20), cache, logits="all")
    cache.length = 20
    diffs = [(out.logits - m(ids).logits).abs().max().item()]
    for n in (3, 1, 1, 1):
        new = torch.randint(3, VOCAB, (2, n), generator=g)
        pos = torch.arange(cache.length, cache.length + n).expand(2, n)
        out = tm.forward(new, pos, cache, logits="all")
        cache.length += n
        ids = torch.cat([ids, new], dim=1)
        diffs.append((out.logits - m(ids).logits[:, -n:]).abs().max().item())
    return diffs


def test_logits_match_hf_prefill_and_decode(model):
    tm = TargetModel(model)
    diffs = run_against_hf(model, tm)
    assert max(diffs) < ATOL, diffs
    if model.config.model_type == "deepseek_v3":  # the cache holds MLA's latent and rope key, not per-head k/v
        cache = tm.new_cache(1, 8)
        assert cache.k.shape[2:] == (1, 8, model.config.kv_lora_rank)
        assert cache.v.shape[2:] == (1, 8, model.config.qk_rope_head_dim)


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}


def test_deepseek_yarn_mscale_plain_q_and_rotate_half_match_hf():
    """The other DeepSeek shapes: no q_lora_rank (one q_proj), RoPE not interleaved, YaRN with mscale (the softmax
    scale grows by mscale^2)."""
    m = build("deepseek_v3", q_lora_rank=None, rope_interleave=False, rope_parameters=YARN)
    tm = TargetModel(m)
    assert tm.layers[0].mla.scale > 1.2 * (16 + 64) ** -0.5
    diffs = run_against_hf(m, tm)
    assert max(diffs) < ATOL, diffs


def test_per_row_slots_write_where_they_say(model):
    """datagen's regeneration: one token per row, written at slots[b] under an attn_mask, equals the plain step."""
    tm = TargetModel(model)
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))
    caches = [tm.new_cache(2, 12), tm.new_cache(2, 12)]
    for c in caches:
        tm.forward(ids[:, :9], torch.arange(9).expand(2, 9), c)
        c.length = 9
    pos = torch.full((2, 1), 9)
    plain = tm.forward(ids[:, 9:], pos, caches[0]).logits
    mask = torch.ones(2, 1, 1, 10, dtype=torch.bool)
    slotted = tm.forward(ids[:, 9:], pos, caches[1], attn_mask=mask, slots=torch.tensor([9, 9])).logits
    torch.testing.assert_close(slotted, plain, atol=1e-5, rtol=0)
    torch.testing.assert_close(caches[1].k[:, :, :, :10], caches[0].k[:, :, :, :10], atol=0, rtol=0)


def broken(m) -> TargetModel:
    """The engine forward with one family rule removed."""
    cfg = m.config
    if cfg.model_type == "qwen3_moe":  # no renormalisation over the top-k
        cfg.norm_topk_prob = False
        try:
            return TargetModel(m)
        finally:
            cfg.norm_topk_prob = True
    tm = TargetModel(m)
    if cfg.model_type == "gpt_oss":  # no attention sinks
        for L in tm.layers:
            L.sinks = None
        return tm
    gates = [layer.mlp.gate for layer in m.model.layers if hasattr(layer.mlp, "gate")]
    saved = [g.e_score_correction_bias for g in gates]
    for g in gates:  # the expert choice ignores the correction bias
        g.e_score_correction_bias = torch.zeros_like(g.e_score_correction_bias)
    try:
        return TargetModel(m)
    finally:
        for g, b in zip(gates, saved, strict=True):
            g.e_score_correction_bias = b


def test_control_a_missing_rule_misses_hf(model):
    diffs = run_against_hf(model, broken(model))
    assert max(diffs) > 100 * ATOL, diffs


def _prefilled(tm: TargetModel, ids: torch.Tensor) -> KVCache:
    cache = tm.new_cache(ids.shape[0], 32)
    tm.forward(ids, torch.arange(ids.shape[1]).expand(ids.shape), cache, logits="none")
    cache.length = ids.shape[1]
    return cache


def test_verify_rows_are_the_bits_of_each_row_alone(model):
    """Lossless decoding must not depend on the batch: a near-tie decided by the last bit would flip a greedy token.
    With the row-invariant kernels a verified row's logits equal, by torch.equal, the same row run alone: sibling
    tree rows (the verify forward's tree mask) and a chain against plain one-token steps, and two sequences batched
    against each alone. torch's kernels missed by up to ~1e-5 here (the dense fp32 path by ~1e-7)."""
    tm = TargetModel(model)
    assert tm.ops.row_invariant and tm.row_note is None
    g = torch.Generator().manual_seed(5)
    P, S = 10, 6
    prefix, rows = torch.randint(3, VOCAB, (2, P), generator=g), torch.randint(3, VOCAB, (2, S), generator=g)
    cache = _prefilled(tm, prefix[:1])
    tree = tm.forward(rows[:1], torch.full((1, S), P), cache, tree_mask=torch.eye(S, dtype=torch.bool),
                      capture=[1, 3], logits="all")
    for i in range(S):  # each sibling alone after the same prefix
        one = tm.forward(rows[:1, i:i + 1], torch.full((1, 1), P), cache, capture=[1, 3], logits="all")
        assert torch.equal(one.logits[0, 0], tree.logits[0, i]) and torch.equal(one.aux[0, 0], tree.aux[0, i]), i
    chain = tm.forward(rows[:1], torch.arange(P, P + S)[None], cache, logits="all").logits[0]
    for i in range(S):  # plain decoding: one token per forward, the cache growing by one
        one = tm.forward(rows[:1, i:i + 1], torch.tensor([[P + i]]), cache, logits="all").logits[0, 0]
        cache.length += 1
        assert torch.equal(one, chain[i]), i
    both_cache = _prefilled(tm, prefix)
    both = tm.forward(rows, torch.arange(P, P + S).expand(2, S), both_cache, logits="all").logits
    for b in range(2):
        alone = tm.forward(rows[b:b + 1], torch.arange(P, P + S)[None], _prefilled(tm, prefix[b:b + 1]),
                           logits="all").logits
        assert torch.equal(alone[0], both[b]), b
        assert torch.equal(_prefilled(tm, prefix[b:b + 1]).k[:, 0, :, :P], both_cache.k[:, b, :, :P])


def test_pointwise_functions_give_a_row_its_bits_whatever_the_rows_beside_it():
    """torch runs an elementwise sigmoid or SiLU in vectors and a call's last few elements through a scalar formula
    whose last bit can differ: DeepSeek's router sigmoid over 8 experts took that tail for a row alone. The padded
    form (rowwise.ROW_OPS.pointwise) keeps every element on the vector path."""
    g = torch.Generator().manual_seed(0)
    for fn, width in ((torch.sigmoid, 8), (F.silu, 24), (F.silu, 64)):
        x = torch.randn(1500, width, generator=g) * 3
        full = ROW_OPS.pointwise(fn, x)
        if width % 64 == 0:  # torch's own call has no tail here: the same bits as torch's
            assert torch.equal(full, fn(x))
        assert all(torch.equal(ROW_OPS.pointwise(fn, x[i:i + 1]), full[i:i + 1]) for i in range(0, 1500, 7))
        assert (full - fn(x)).abs().max() < 1e-6
    x = torch.randn(1500, 8, generator=g) * 3
    assert any(not torch.equal(x[i:i + 1].sigmoid(), x.sigmoid()[i:i + 1]) for i in range(1500))  # the control


def test_torch_kernels_run_where_the_row_invariant_ones_do_not():
    """A MoE target off fp32 or off the CPU runs torch's kernels and says what that costs; dense targets keep
    torch's (faster) kernels, native weights their own row-invariant ones."""
    tm = TargetModel(build("qwen3_moe").to(torch.bfloat16))
    assert not tm.ops.row_invariant and "row-invariant kernels run fp32 on the CPU" in tm.row_note
    dense = TargetModel(tiny_model("llama"))
    assert not dense.ops.row_invariant and dense.row_note is None


def test_auto_weights_fall_back_to_fp32_with_a_reason(model):
    t = target_of(model)
    tm = engine_model(t, "auto")
    assert tm.native is None and tm.fallback


def target_of(m) -> Target:
    return Target(model=m, tokenizer=word_tokenizer(), identity=identity_of(m, tensor_fingerprint(m), "tiny"),
                  source="tiny", path=None)


def test_speculation_is_lossless(model):
    t = target_of(model)
    parts = EngineParts(t, random_draft(t, draft_vocab=VOCAB, seed=2), None)
    plain = make_engine(parts, TreeSettings().spec("plain", None))
    specs = {"chain": TreeSettings(steps=3, lookup=0, min_prob=0.0).spec("chain", None),
             "tree": TreeSettings(depth=3, topk=3, tokens=9, lookup=0, min_prob=0.0).spec("tree", None),
             "tree-lookup": TreeSettings(depth=2, topk=2, tokens=6, lookup=4, min_prob=0.0).spec("tree", None),
             "lookup": TreeSettings(lookup=4).spec("lookup", None)}
    params = SamplingParams(max_new_tokens=24)
    for prompt in (PROMPTS[2], [5, 6, 7, 8] * 3):
        ref = plain.generate(prompt, params).token_ids
        assert len(ref) > 4
        for name, spec in specs.items():
            got = make_engine(parts, spec).generate(prompt, params).token_ids
            assert got == ref, f"{name} on {prompt}"


def test_gguf_architectures_transformers_cannot_read_are_refused_in_one_line(tmp_path):
    """deepseek2 (DeepSeek-V3, Kimi-K2) is not in transformers' GGUF loader, and it loads gpt-oss without its
    experts and sinks: both refused before any conversion, in one line naming what is missing. qwen3moe goes on to
    transformers' reader (converted below)."""
    f = tmp_path / "qwen3moe.gguf"
    f.write_bytes(gguf_bytes("qwen3moe"))
    check_gguf_architecture(f)
    f = tmp_path / "oss.gguf"
    f.write_bytes(gguf_bytes("gpt-oss"))
    with pytest.raises(TargetError, match=r"'gpt-oss': transformers .* does not read it whole \(.*experts and "
                                          r"attention sinks") as e:
        convert_gguf(f, tmp_path / "out")
    assert "\n" not in str(e.value)
    f = tmp_path / "k2.gguf"
    f.write_bytes(gguf_bytes("deepseek2"))
    with pytest.raises(TargetError, match=r"'deepseek2' \(DeepSeek-V2/V3 and Kimi-K2, MLA attention\) is missing "
                                          r"from transformers .*'s GGUF loader") as e:
        convert_gguf(f, tmp_path / "out")
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


def write_qwen3moe_gguf(m, path):
    """`m` as llama.cpp's convert_hf_to_gguf.py writes a Qwen3-MoE (F32): its tensor names, the fused gate/up
    experts split into ffn_gate_exps and ffn_up_exps, the experts' width in expert_feed_forward_length."""
    import gguf

    cfg, sd = m.config, m.state_dict()
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")  # single characters, no merges: enough for transformers' GGUF tokenizer
    w.add_tokenizer_pre("default")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [chr(0x21 + i) for i in range(cfg.vocab_size - 3)])
    w.add_token_types([3, 3, 3] + [1] * (cfg.vocab_size - 3))
    w.add_token_scores([0.0] * cfg.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def add(name, t):
        w.add_tensor(name, t.detach().float().numpy())
    add("token_embd.weight", sd["model.embed_tokens.weight"])
    add("output_norm.weight", sd["model.norm.weight"])
    add("output.weight", sd["lm_head.weight"])
    width = cfg.moe_intermediate_size
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for hf, g in (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm"),
                      ("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
                      ("self_attn.o_proj", "attn_output"), ("self_attn.q_norm", "attn_q_norm"),
                      ("self_attn.k_norm", "attn_k_norm"), ("mlp.gate", "ffn_gate_inp")):
            add(f"blk.{i}.{g}.weight", sd[p + hf + ".weight"])
        gate_up = sd[p + "mlp.experts.gate_up_proj"]  # [E, 2I, H], gate rows first
        add(f"blk.{i}.ffn_gate_exps.weight", gate_up[:, :width])
        add(f"blk.{i}.ffn_up_exps.weight", gate_up[:, width:])
        add(f"blk.{i}.ffn_down_exps.weight", sd[p + "mlp.experts.down_proj"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_qwen3moe_gguf_converts_and_runs_as_the_original(tmp_path):
    """transformers reads qwen3moe GGUFs but leaves moe_intermediate_size at its default: eyas's overrides set it
    from expert_feed_forward_length, and the converted target's engine logits are the original's."""
    from transformers import AutoModelForCausalLM

    m = build("qwen3_moe")
    write_qwen3moe_gguf(m, tmp_path / "t.gguf")
    convert_gguf(tmp_path / "t.gguf", tmp_path / "hf")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tm = TargetModel(back)
    ids = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(4))
    ours = tm.forward(ids, torch.arange(20)[None], tm.new_cache(1, 20), logits="all").logits
    torch.testing.assert_close(ours, m(ids).logits, atol=ATOL, rtol=0)
    # from its GGUF, --weights auto runs fp32 and says why; native refuses in one line
    t = Target(model=back, tokenizer=word_tokenizer(), identity=identity_of(back, tensor_fingerprint(back), "tiny"),
               source=str(tmp_path / "t.gguf"), path=tmp_path / "hf", gguf=tmp_path / "t.gguf")
    auto = engine_model(t, "auto")
    assert auto.native is None and "dense layers" in auto.fallback
    with pytest.raises(ModelError, match="--weights native: the native kernels cover dense layers"):
        engine_model(t, "native")


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_bf16_targets_round_as_hf_does(family):
    """In bf16 the op order shows (gpt-oss: the sink softmax's max shift; Qwen3-MoE: routing weights cast before
    use): the engine's logits equal HF's bit for bit. DeepSeek's absorbed MLA reassociates, so it is fp32-exact only."""
    m = build(family).to(torch.bfloat16)
    tm = TargetModel(m)
    ids = torch.randint(3, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    ours = tm.forward(ids, torch.arange(20).expand(2, 20), tm.new_cache(2, 20), logits="all").logits
    assert torch.equal(ours, m(ids).logits)


def test_capture_is_one_convention_in_hf_hooks_and_the_engine(model):
    """Stream index k means the same layer boundary in HF capture (hooks) and in eyas's engine forward: every
    stream 0..L, the final pre- and post-norm states, equal within the logits' tolerance (a shifted index would
    differ by a whole layer's update)."""
    from eyas.target.capture import capture

    L = model.config.num_hidden_layers
    ids = torch.tensor([[5, 9, 17, 3, 40, 22, 8, 11, 60, 7]])
    streams = list(range(L + 1))
    hf = capture(model, ids, streams)
    eyas = TargetModel(model).capture(ids, streams)
    H = model.config.hidden_size
    for i, k in enumerate(streams):
        a, b = hf.aux[..., i * H:(i + 1) * H], eyas.aux[..., i * H:(i + 1) * H]
        assert (a - b).abs().max() < ATOL * max(1.0, float(a.abs().max())), (k, float((a - b).abs().max()))
    assert torch.allclose(hf.final_prenorm, eyas.final_prenorm, atol=ATOL * 10)
    assert torch.allclose(hf.final_postnorm, eyas.final_postnorm, atol=ATOL * 10)
    # and the check can fail: neighbouring streams differ by far more than the tolerance
    assert (hf.aux[..., H:2 * H] - eyas.aux[..., 2 * H:3 * H]).abs().max() > 0.01
