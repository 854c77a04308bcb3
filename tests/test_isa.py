"""The kernels' instruction-set variants (isa.c): every variant this CPU runs computes the bits of the portable one.

One library holds a plain-C variant, an AVX2+FMA one and an AVX-512 VNNI one; it picks the best the CPU has and
kernels.select_isa (or $EYAS_ISA) forces another. Each kernel with variants runs here on every variant the CPU
has and is compared with the portable run by torch.equal: a model served on any of them decodes the same tokens.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from eyas.native import kernels
from eyas.native.build import compiler

ALL = ("portable", "avx2", "avx512vnni")


@pytest.fixture
def restore_isa():
    was, threads = kernels.isa(), torch.get_num_threads()
    yield
    kernels.select_isa(was)
    torch.set_num_threads(threads)


def _on(isa: str, fn, *args):
    """fn(*args) run on `isa`, then on the portable variant -> (theirs, portable's)."""
    if isa not in kernels.supported_isas():
        pytest.skip(f"this CPU does not run the {isa} variant")
    kernels.select_isa(isa)
    got = fn(*args)
    kernels.select_isa("portable")
    return got, fn(*args)


def _equal(a, b) -> None:
    for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,), strict=True):
        assert torch.equal(x, y)


def _tree_mask(S: int, P: int, g: torch.Generator) -> torch.Tensor:
    m = torch.zeros(S, P + S, dtype=torch.bool)
    m[:, :P] = torch.rand(S, P, generator=g) > 0.2
    for i in range(S):
        j = i
        while j >= 0:
            m[i, P + j] = True
            j = int(torch.randint(0, j, (1,), generator=g)) if j else -1
    return m[None, None]


def test_the_best_variant_is_chosen_and_names_are_known():
    have = kernels.supported_isas()
    assert have[0] == "portable" and set(have) <= set(ALL)
    assert kernels.isa() == have[-1] or os.environ.get("EYAS_ISA")


def test_an_unknown_or_missing_variant_is_refused_and_the_current_one_stays(restore_isa):
    was = kernels.isa()
    with pytest.raises(kernels.KernelError, match="no such instruction-set variant.*portable, avx2, avx512vnni"):
        kernels.select_isa("neon")
    assert kernels.isa() == was
    missing = [n for n in ALL if n not in kernels.supported_isas()]
    if missing:
        with pytest.raises(kernels.KernelError, match="this CPU lacks"):
            kernels.select_isa(missing[-1])
        assert kernels.isa() == was


def test_eyas_isa_environment_variable_forces_a_variant_or_fails_loud():
    code = "from eyas.native import kernels; print(kernels.isa())"
    env = {**os.environ, "EYAS_ISA": "portable"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "portable", r.stderr
    env["EYAS_ISA"] = "sse9"
    code = "from eyas.native import kernels\ntry:\n kernels.lib()\nexcept kernels.KernelError as e:\n print(e)"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "EYAS_ISA=sse9: no such instruction-set variant" in r.stdout, r.stderr


@pytest.mark.parametrize("isa", ALL[1:])
@pytest.mark.parametrize("threads", [1, 2])
def test_4bit_matmul_is_bit_identical_on_every_variant(isa, threads, restore_isa):
    g = torch.Generator().manual_seed(11)
    torch.set_num_threads(threads)
    for N, K in ((40, 96), (203, 64), (16, 576)):  # N % 8 != 0: a padded last group
        q = torch.randint(0, 16, (N, K), generator=g)
        d = torch.rand(N, K // 32, generator=g) * 0.01
        m = -torch.rand(N, K // 32, generator=g) * 0.08
        m[::3] = -8 * d[::3]  # Q4_0 blocks: m = -8d
        tiles = kernels.pack_q4(q, d, m)
        x = (torch.randn(17, K, generator=g) * 3).to(torch.bfloat16)
        x[2, :32] = 0  # an all-zero block: dx = 0
        for M in (1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 17):  # every row grouping of the AVX2 (4) and VNNI (8) paths
            _equal(*_on(isa, kernels.q4_matmul_bf16, x[:M], tiles, N))


@pytest.mark.parametrize("isa", ALL[1:])
def test_8bit_matmuls_are_bit_identical_on_every_variant(isa, restore_isa):
    g = torch.Generator().manual_seed(12)
    N, K = 301, 96
    qw = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g)
    qw[0, :32] = -128  # the one weight whose magnitude needs the unsigned byte
    d = torch.rand(N, K // 32, generator=g) * 0.02
    tiles = kernels.pack_q8(qw, d)
    w = torch.randn(N, K, generator=g)
    x = torch.randn(13, K, generator=g) * 4
    for M in (1, 3, 4, 5, 8, 9, 13):
        _equal(*_on(isa, kernels.q8q8_matmul, x[:M], tiles, N))
        _equal(*_on(isa, kernels.q8_matmul, x[:M], qw, d))
        _equal(*_on(isa, kernels.f32_matmul, x[:M], w))
        _equal(*_on(isa, kernels.f32_matmul_kn, x[:M], w.t().contiguous()))


@pytest.mark.parametrize("isa", ALL[1:])
@pytest.mark.parametrize("hd", [64, 128, 40])  # 40: the plain-C head size path
def test_attention_is_bit_identical_on_every_variant(isa, hd, restore_isa):
    g = torch.Generator().manual_seed(13)
    B, S, nh, kvh, P = 2, 6, 6, 2, 37  # 43 keys: a tail after the 8-wide exp
    q = torch.randn(B, S, nh, hd, generator=g) * 2
    kc, vc = torch.randn(B, kvh, P + S + 5, hd, generator=g), torch.randn(B, kvh, P + S + 5, hd, generator=g)
    mask = _tree_mask(S, P, g)
    _equal(*_on(isa, lambda: kernels.attention(q, kc, vc, P, mask, 0.125)))
    _equal(*_on(isa, lambda: kernels.attention(q, kc, vc, P, None, 0.125)))
    _equal(*_on(isa, lambda: kernels.attention(q, kc, vc, 0, None, 0.125)))  # 1-6 keys: no 8-key group
    sinks = torch.randn(nh, generator=g)
    _equal(*_on(isa, lambda: kernels.attention_kv(q, kc, vc, P, mask, 0.125, sinks)))
    wide = torch.randn(B, S, nh, 576, generator=g)  # MLA: 576-wide keys over 512-wide values
    kw, vw = torch.randn(B, kvh, P + S, 576, generator=g), torch.randn(B, kvh, P + S + 5, 512, generator=g)
    _equal(*_on(isa, lambda: kernels.attention_kv(wide, kw, vw, P, mask, 0.05)))
    qkv = torch.randn(B, S, (nh + 2 * kvh) * hd, generator=g).to(torch.bfloat16)
    ang = torch.rand(B, S, hd, generator=g) * 6

    def rope():
        k2, v2 = kc.clone(), vc.clone()
        out = kernels.rope_attend(qkv, ang.cos(), ang.sin(), k2, v2, P, mask, 0.125, nh, kvh, hd)
        return out, k2, v2
    _equal(*_on(isa, rope))


@pytest.mark.parametrize("isa", ALL[1:])
def test_norm_and_swiglu_are_bit_identical_on_every_variant(isa, restore_isa):
    g = torch.Generator().manual_seed(14)
    x = torch.randn(19, 576, generator=g) * 30
    x[0, 5] = 900.0  # a massive activation, as the target's residual stream has
    y = torch.randn(19, 576, generator=g).to(torch.bfloat16)
    w = torch.rand(576, generator=g)
    _equal(*_on(isa, lambda: (lambda x2: (kernels.add_rms_bf16(x2, y, w, 1e-5), x2))(x.clone())))
    _equal(*_on(isa, lambda: kernels.add_rms_bf16(x.clone(), None, w, 1e-5)))
    gu = (torch.randn(5, 2 * 1536, generator=g) * 6).to(torch.bfloat16)
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -90.0])  # exp's clamps
    _equal(*_on(isa, lambda: kernels.silu_mul_bf16(gu)))
    _equal(*_on(isa, lambda: kernels.silu_mul_bf16(gu[:, :2 * 300].contiguous())))  # a 300-wide row: a tail


def test_a_build_without_x86_variants_runs_the_portable_path_alone(tmp_path, restore_isa):
    """What a non-x86 machine compiles (EYAS_PORTABLE_ONLY drops every x86 variant and cpuid): it builds with the
    same flags, knows only the portable level and computes its bits."""
    import ctypes

    so = tmp_path / "portable_only.so"
    cmd = [compiler(), *kernels.FLAGS, "-DEYAS_PORTABLE_ONLY", *map(str, kernels.SOURCES), "-o", str(so),
           "-lm"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    lib = ctypes.CDLL(str(so))
    lib.eyas_isa_name.restype = ctypes.c_char_p
    lib.eyas_isa_supported.argtypes = lib.eyas_isa_select.argtypes = [ctypes.c_char_p]
    assert lib.eyas_isa_name() == b"portable"
    assert [lib.eyas_isa_supported(n.encode()) for n in ALL] == [1, 0, 0]
    assert lib.eyas_isa_select(b"avx2") == 2 and lib.eyas_isa_select(b"neon") == 1
    g = torch.Generator().manual_seed(15)
    N, K, M = 40, 96, 9
    tiles = kernels.pack_q4(torch.randint(0, 16, (N, K), generator=g), torch.rand(N, K // 32, generator=g) * 0.01,
                            -torch.rand(N, K // 32, generator=g) * 0.08)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    mine = torch.empty(M, N, dtype=torch.bfloat16)
    lib.eyas_q4_matmul_bf16(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(tiles.data_ptr()),
                            ctypes.c_void_p(mine.data_ptr()), M, N, K, 1)
    kernels.select_isa(kernels.supported_isas()[-1])
    assert torch.equal(mine, kernels.q4_matmul_bf16(x, tiles, N))


@pytest.mark.integration
def test_bundled_target_decodes_the_same_tokens_on_every_variant(restore_isa):
    from eyas.engine.decode import Engine
    from eyas.engine.params import SamplingParams, SpecParams
    from eyas.engine.prompt import chat_input_ids
    from eyas.target.load import load_target

    target = load_target("smollm2-135m")
    plain = Engine(target, None, SpecParams(method="plain", weights="native"))
    ids = chat_input_ids(target.tokenizer, [{"role": "user", "content": "Name three rivers and their countries."}])
    runs = {}
    for isa in kernels.supported_isas():
        kernels.select_isa(isa)
        runs[isa] = plain.generate(ids, SamplingParams(max_new_tokens=40)).token_ids
    assert len(runs["portable"]) == 40
    assert all(r == runs["portable"] for r in runs.values()), runs
