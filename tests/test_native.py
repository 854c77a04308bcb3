"""Native (quantized GGUF) weights and eyas's row-invariant CPU kernels.

The kernels' promise is exact: a row's output has the same bits whatever else is in the call (row count,
tree mask, key positions). These tests compare with torch.equal, never with a tolerance."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from eyas.engine.sinks import sink_attention
from eyas.native import kernels
from eyas.native.quant import NativeError, _llama_unpermute, _match, _pack, _quantized


def _tree_mask(S: int, rng: random.Random) -> torch.Tensor:
    parent = [-1] + [rng.randint(0, i - 1) for i in range(1, S)]
    m = torch.zeros(S, S, dtype=torch.bool)
    for i in range(S):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parent[j]
    return m


def test_attention_matches_sdpa_and_each_tree_row_equals_the_plain_step():
    rng = random.Random(0)
    torch.manual_seed(0)
    nh, kvh, hd = 6, 2, 16
    for _ in range(12):
        P, S = rng.randint(0, 90), rng.randint(1, 9)
        q = torch.randn(1, S, nh, hd) * 2
        K, V = torch.randn(1, kvh, P + S + 3, hd), torch.randn(1, kvh, P + S + 3, hd)
        tm = _tree_mask(S, rng)
        mask = torch.cat([torch.ones(S, P, dtype=torch.bool), tm], 1)[None, None]
        out = kernels.attention(q, K, V, P, mask, 0.25)
        ref = F.scaled_dot_product_attention(q.transpose(1, 2), K[:, :, :P + S], V[:, :, :P + S], attn_mask=mask,
                                             scale=0.25, enable_gqa=True).transpose(1, 2)
        assert (out - ref).abs().max() < 1e-4
        for i in range(S):
            # the plain step: the row's ancestors sit contiguously after the prefix, no mask
            anc = [P + j for j in range(S) if tm[i, j]]
            K1, V1 = K.clone(), V.clone()
            K1[:, :, P:P + len(anc)], V1[:, :, P:P + len(anc)] = K[:, :, anc], V[:, :, anc]
            one = kernels.attention(q[:, i:i + 1], K1, V1, P + len(anc) - 1, None, 0.25)
            assert torch.equal(one[:, 0], out[:, i])


def test_causal_attention_equals_the_explicit_causal_mask():
    torch.manual_seed(1)
    q, K, V = torch.randn(2, 7, 4, 8), torch.randn(2, 2, 20, 8), torch.randn(2, 2, 20, 8)
    causal = torch.ones(7, 12, dtype=torch.bool).tril(5)[None, None]
    assert torch.equal(kernels.attention(q, K, V, 5, None, 0.3), kernels.attention(q, K, V, 5, causal, 0.3))


@pytest.mark.parametrize("kind", ["q8", "q8q8", "f32"])
def test_head_kernels_are_row_invariant_and_exact_enough(kind):
    torch.manual_seed(2)
    N, K = 301, 96  # N not a multiple of 8: the last 8-output tile is padded
    x = torch.randn(9, K)
    tol = 1e-4
    if kind in ("q8", "q8q8"):
        qw, d = torch.randint(-128, 128, (N, K), dtype=torch.int8), torch.rand(N, K // 32) * 0.02
        tiles = kernels.pack_q8(qw, d)
        run = (lambda a: kernels.q8_matmul(a, qw, d)) if kind == "q8" else (  # noqa: E731
            lambda a: kernels.q8q8_matmul(a, tiles, N))
        W = (qw.float().view(N, K // 32, 32) * d[:, :, None]).view(N, K)
        tol = 1e-4 if kind == "q8" else 0.02 * float((x @ W.t()).abs().max())  # 8-bit activations
    else:
        W = torch.randn(N, K)
        run = lambda a: kernels.f32_matmul(a, W)  # noqa: E731
    full = run(x)
    assert (full - x @ W.t()).abs().max() < tol
    for r in range(9):
        assert torch.equal(run(x[r:r + 1])[0], full[r])
        assert torch.equal(run(x[: r + 1])[r], full[r])


def test_input_major_matmul_is_row_invariant_and_exact_enough():
    """f32_matmul_kn (x @ w for w [K, N]: gpt-oss's experts, MLA's absorbed keys) over N not a multiple of its
    64-column blocks."""
    torch.manual_seed(3)
    x, w = torch.randn(9, 96), torch.randn(96, 150)
    full = kernels.f32_matmul_kn(x, w)
    assert (full - x @ w).abs().max() < 1e-4
    for r in range(9):
        assert torch.equal(kernels.f32_matmul_kn(x[r:r + 1], w)[0], full[r])
        assert torch.equal(kernels.f32_matmul_kn(x[: r + 1], w)[r], full[r])


@pytest.mark.parametrize("shape", ["mla", "sinks", "odd"])
def test_attention_kv_matches_torch_and_each_tree_row_equals_the_plain_step(shape):
    """attention_kv: keys and values of their own sizes (MLA's 576-wide keys over 512-wide latents, one shared
    head), per-head sinks (gpt-oss), a key size off the 16-wide path; each tree row equals its plain step."""
    rng = random.Random(4)
    g = torch.Generator().manual_seed(4)
    nh, kvh, kd, vd = {"mla": (4, 1, 576, 512), "sinks": (6, 2, 64, 64), "odd": (2, 1, 40, 24)}[shape]
    sinks = torch.randn(nh, generator=g) * 2 if shape == "sinks" else None
    for _ in range(4):
        P, S = rng.randint(0, 40), rng.randint(1, 7)
        q = torch.randn(1, S, nh, kd, generator=g)
        K, V = torch.randn(1, kvh, P + S + 2, kd, generator=g), torch.randn(1, kvh, P + S + 3, vd, generator=g)
        tm = _tree_mask(S, rng)
        mask = torch.cat([torch.ones(S, P, dtype=torch.bool), tm], 1)[None, None]
        out = kernels.attention_kv(q, K, V, P, mask, 0.1, sinks)
        qh, Kh, Vh = q.transpose(1, 2), K[:, :, :P + S], V[:, :, :P + S]
        if sinks is None:
            ref = F.scaled_dot_product_attention(qh, Kh, Vh, attn_mask=mask, scale=0.1, enable_gqa=True)
        else:
            ref = sink_attention(qh, Kh, Vh, mask, 0.1, sinks)
        assert (out - ref.transpose(1, 2)).abs().max() < 1e-5
        for i in range(S):
            anc = [P + j for j in range(S) if tm[i, j]]
            K1, V1 = K.clone(), V.clone()
            K1[:, :, P:P + len(anc)], V1[:, :, P:P + len(anc)] = K[:, :, anc], V[:, :, anc]
            one = kernels.attention_kv(q[:, i:i + 1], K1, V1, P + len(anc) - 1, None, 0.1, sinks)
            assert torch.equal(one[:, 0], out[:, i])


def _q4_1_tensor(w: torch.Tensor):
    """Quantize w [N, K] to GGUF Q4_1 bytes (a stand-in for a GGUFReader tensor)."""
    N, K = w.shape
    blk = w.view(N, K // 32, 32)
    mn, mx = blk.min(-1).values, blk.max(-1).values
    d = ((mx - mn) / 15).clamp_min(1e-6).half()
    m = mn.half()
    q = ((blk - m.float()[..., None]) / d.float()[..., None]).round().clamp(0, 15).to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)  # byte t: element t low, t+16 high
    raw = np.concatenate([d.numpy().view(np.uint8).reshape(N, K // 32, 2), m.numpy().view(np.uint8).reshape(
        N, K // 32, 2), packed.numpy()], axis=-1).reshape(N, -1)
    deq = (d.float()[..., None] * q.float() + m.float()[..., None]).view(N, K)
    return SimpleNamespace(type_name="Q4_1", data=raw), deq


@pytest.mark.parametrize("act", ["q8", "bf16"])
def test_q4_1_blocks_round_trip_find_the_llama_row_order_and_run_the_4bit_kernels(act):
    torch.manual_seed(3)
    heads, N, K = 4, 32, 96  # K = 3 blocks: the kernel's odd-block tail runs too
    t, deq = _q4_1_tensor(torch.randn(N, K))
    kind, q, d, m = _quantized(t, "blk.0.attn_q.weight")
    assert kind == "Q4_1" and q.shape == (N, K)
    assert _match("x", q, d, m, deq, []) is None  # identity
    order = _llama_unpermute(N, heads)
    hf = deq[order]  # what transformers' loader produces for a llama attn_q
    got = _match("x", q, d, m, hf, [heads])
    assert torch.equal(got, order)
    with pytest.raises(NativeError, match="does not equal"):
        _match("x", q, d, m, hf + 1e-3, [heads])
    lin = _pack(act, kind, q[got], d[got], m[got], None)
    assert lin.kind == {"q8": "q4", "bf16": "int4"}[act]
    x = torch.randn(11, K)  # 11 rows = 4 + 4 + 2 + 1: every row-group path of the q4 kernel
    y = lin(x)
    ref = x @ hf.t()
    assert (y - ref).abs().max() < 0.05 * ref.abs().max()  # 8-bit or bf16 activations
    for r in range(11):  # a row's bits never depend on the rows beside it
        assert torch.equal(lin(x[r:r + 1])[0], y[r])
    for M in (2, 3, 5, 7):
        assert torch.equal(lin(x[:M]), y[:M])


def test_unsupported_quant_type_is_refused_with_the_fix(tmp_path):
    t = SimpleNamespace(type_name="Q6_K", data=np.zeros((2, 210), np.uint8))
    with pytest.raises(NativeError, match="blk.0.ffn_down.weight is Q6_K; native weights cover"):
        _quantized(t, "blk.0.ffn_down.weight")
    # inspect says what --weights auto will run for such a file, from its tensor headers alone, as generate then does
    from eyas.native.auto import describe
    from eyas.native.quant import native_misfit
    from tests.gguf_write import write_gguf
    from tests.tiny import tiny_model

    gguf = write_gguf(tiny_model("llama", layers=2, hidden=32, vocab=64), tmp_path / "f16.gguf", qtype="F16")
    why = native_misfit(gguf, 2)
    assert why is not None and "blk.0." in why and "is F16; native weights cover" in why
    assert describe(True, True, why)["weights_auto"] == "fp32" and describe(True, True, why)["why"] == why
    q8 = write_gguf(tiny_model("llama", layers=2, hidden=32, vocab=64), tmp_path / "q8.gguf", qtype="Q8_0")
    assert native_misfit(q8, 2) is None


@pytest.mark.integration
def test_bundled_gguf_native_mode_is_lossless_and_agrees_with_fp32():
    from eyas.draft import resolve_draft
    from eyas.engine.decode import Engine
    from eyas.engine.params import SamplingParams, SpecParams
    from eyas.engine.prompt import chat_input_ids
    from eyas.target.load import load_target

    target = load_target("smollm2-135m")
    ckpt = resolve_draft("default", target)
    plain = Engine(target, None, SpecParams(method="plain", weights="native"))
    assert plain.weights == "native"
    fp32 = Engine(target, None, SpecParams(method="plain", weights="fp32"))
    spec = [Engine(target, ckpt, SpecParams(method="tree", depth=3, topk=4, tokens=8, lookup=8, weights="native")),
            Engine(target, ckpt, SpecParams(method="chain", steps=3, weights="native"))]
    agree = total = 0
    for q in ("List five fruits and say one thing about each.", "Write a Python function that reverses a list."):
        ids = chat_input_ids(target.tokenizer, [{"role": "user", "content": q}])
        ref = plain.generate(ids, SamplingParams(max_new_tokens=48)).token_ids
        for e in spec:
            assert e.generate(ids, SamplingParams(max_new_tokens=48)).token_ids == ref
        other = fp32.generate(ids, SamplingParams(max_new_tokens=48)).token_ids
        n = next((i for i, (a, b) in enumerate(zip(ref, other, strict=False)) if a != b), min(len(ref), len(other)))
        agree, total = agree + n, total + len(ref)
    # native is another numerics mode (bf16 activations): greedy text may drift late, not from the start
    assert agree >= total // 4


def test_truncated_or_foreign_gguf_is_one_clear_error(tmp_path):
    import struct

    from eyas.native.gguf_file import GGUFError, read_gguf_tensors

    foreign = tmp_path / "x.gguf"
    foreign.write_bytes(b"PK\x03\x04" + bytes(40))
    with pytest.raises(GGUFError, match="not a GGUF file"):
        read_gguf_tensors(foreign)
    name = b"blk.0.attn_q.weight"
    head = b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + struct.pack("<Q", len(name)) + name
    head += struct.pack("<I", 2) + struct.pack("<QQ", 64, 8) + struct.pack("<IQ", 3, 0)  # Q4_1 64x8, no data
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(head)
    with pytest.raises(GGUFError, match="truncated"):
        read_gguf_tensors(cut)
    cut.write_bytes(head[:30])
    with pytest.raises(GGUFError, match="ends early"):
        read_gguf_tensors(cut)


def test_ggml_type_table_matches_gguf_py_and_catches_k_quant_truncation(tmp_path):
    """eyas's own copy of ggml's block sizes (read without importing gguf-py) must agree with gguf-py's, since it
    decides where every tensor ends: a K-quant file cut short (the Gemma 3 GGUFs are Q4_K/Q5_0/Q6_K) is caught."""
    from gguf.constants import GGML_QUANT_SIZES

    from eyas.native.gguf_file import _GGML_TYPES, GGUFError, read_gguf_tensors
    from tests.tiny import gguf_bytes

    theirs = {int(t): (t.name, *GGML_QUANT_SIZES[t]) for t in GGML_QUANT_SIZES}
    assert {k: theirs[k] for k in _GGML_TYPES} == _GGML_TYPES
    whole = gguf_bytes("gemma3", [("blk.0.ffn_down.weight", (512, 3), 12, 3 * 2 * 144),  # Q4_K
                                  ("blk.0.attn_v.weight", (64, 2), 6, 2 * 2 * 22)])  # Q5_0
    f = tmp_path / "k.gguf"
    f.write_bytes(whole)
    t = read_gguf_tensors(f)
    assert t["blk.0.ffn_down.weight"].type_name == "Q4_K" and t["blk.0.ffn_down.weight"].data.shape == (3, 288)
    assert t["blk.0.attn_v.weight"].type_name == "Q5_0" and t["blk.0.attn_v.weight"].data.shape == (2, 44)
    f.write_bytes(whole[:-40])  # the last tensor (Q5_0) loses its end
    with pytest.raises(GGUFError, match="blk.0.attn_v.weight runs past the end"):
        read_gguf_tensors(f)
