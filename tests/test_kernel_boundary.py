"""The boundary between Python and the C kernels: the verified build cache (a library is loaded only for the key it
was built for and only with the bytes recorded when it was built), the argument structs' layout check, the
C side's out-of-memory and bad-struct codes, and every wrapper's input checks (bad input is one KernelError,
never a crash)."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from eyas.native import boundary as bd
from eyas.native import build, kernels
from eyas.native.boundary import KernelError

TINY_C = "int eyas_tiny(void) { return 7; }\n"


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """A one-function C source and a private cache folder: the cache's rules, at a tenth of a second per build."""
    if shutil.which(build.compiler()) is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "tiny.c"
    src.write_text(TINY_C)
    return build.compiler(), [src], ["-O1", "-shared", "-fPIC"]


def _load(tiny):
    so, key = build.cached_library(*tiny)
    path = Path(so._name)
    return so, key, path, path.stat().st_ino


def test_a_cached_library_is_reused_and_records_its_key_and_digest(tiny):
    so, key, path, ino = _load(tiny)
    assert so.eyas_tiny() == 7
    rec = json.loads(path.with_suffix(".json").read_text())
    assert rec["key"] == key and rec["digest"] == build.file_digest(path)
    assert rec["key"]["compiler"] and rec["key"]["cpu"] and rec["key"]["flags"] == "-O1 -shared -fPIC"
    _, key2, path2, ino2 = _load(tiny)
    assert (key2, path2, ino2) == (key, path, ino)  # verified and loaded, not rebuilt


def test_a_library_built_for_another_cpu_feature_set_is_never_loaded(tiny, monkeypatch):
    _, key, path, ino = _load(tiny)
    full = build.cpu_features()
    monkeypatch.setattr(build, "cpu_features", lambda: full[: len(full) // 2])
    _, small_key, small_path, _ = _load(tiny)
    assert small_key["cpu"] != key["cpu"] and small_path != path
    # the same file name holding the other CPU's library and record (a copied cache, a tag collision): rebuilt
    # copied to a new file then renamed over: writing into the library this process has mapped would crash it
    shutil.copy(path, small_path.with_name("copied"))
    os.replace(small_path.with_name("copied"), small_path)
    shutil.copy(path.with_suffix(".json"), small_path.with_suffix(".json"))
    assert "another" in build.verified(small_path, small_key)
    before = small_path.stat().st_ino
    _, _, _, after = _load(tiny)
    assert after != before and build.verified(small_path, small_key) is None


def test_compiler_identity_and_flags_are_part_of_the_key(tiny, monkeypatch):
    cc, srcs, flags = tiny
    key = build.cache_key(cc, srcs, flags)
    assert build.cache_key(cc, srcs, [*flags, "-g"])["tag"] != key["tag"]
    monkeypatch.setattr(build, "compiler_identity", lambda cc: "gcc (Debian 99.1) 99.1.0")
    assert build.cache_key(cc, srcs, flags)["tag"] != key["tag"]
    srcs[0].write_text(TINY_C + "int eyas_other(void) { return 8; }\n")
    monkeypatch.undo()
    assert build.cache_key(cc, srcs, flags)["tag"] != key["tag"]


def test_a_flipped_byte_in_a_cached_library_is_detected_and_rebuilt(tiny):
    _, key, path, ino = _load(tiny)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    tampered = path.with_name("tampered")
    tampered.write_bytes(bytes(raw))
    os.replace(tampered, path)  # a new file: rewriting the one this process has mapped would crash it
    assert "bytes differ" in build.verified(path, key)
    so, _, _, ino2 = _load(tiny)
    assert ino2 != ino and so.eyas_tiny() == 7 and build.verified(path, key) is None


def test_a_missing_record_means_a_rebuild(tiny):
    _, key, path, ino = _load(tiny)
    path.with_suffix(".json").unlink()
    assert "record" in build.verified(path, key)
    assert _load(tiny)[3] != ino


def test_only_variants_unused_for_a_day_are_removed(tmp_path):
    now = time.time()
    for tag, age in (("aaaa", 0), ("bbbb", 2 * 86400), ("cccc", 3600)):
        for suffix in (".so", ".json", ".speed.json"):
            f = tmp_path / f"{build.PREFIX}{tag}{suffix}"
            f.write_text("x")
            os.utime(f, (now - age, now - age))
    old = tmp_path / f"{build.PREFIX}dddd.so"  # written before libraries had records: aged by its own mtime
    old.write_text("x")
    os.utime(old, (now - 3 * 86400, now - 3 * 86400))
    removed = {p.name for p in build.remove_stale(tmp_path, keep="aaaa", now=now)}
    assert removed == {f"{build.PREFIX}bbbb{s}" for s in (".so", ".json", ".speed.json")} | {old.name}
    left = {p.name for p in tmp_path.iterdir()}
    assert f"{build.PREFIX}cccc.so" in left and f"{build.PREFIX}aaaa.so" in left


def test_a_failing_or_hanging_compiler_is_one_kernel_error(tiny, tmp_path, monkeypatch):
    _, srcs, flags = tiny
    bad = tmp_path / "broken.c"
    bad.write_text("int eyas_tiny(void) { return }\n")
    with pytest.raises(KernelError, match="failed: .*--weights fp32") as e:
        build.compile_library(tiny[0], flags, [bad], tmp_path / "x.so")
    assert "\n" not in str(e.value)
    slow = tmp_path / "slowcc"
    slow.write_text("#!/bin/sh\nsleep 30\n")
    slow.chmod(0o755)
    monkeypatch.setattr(build, "COMPILE_TIMEOUT_S", 1)
    with pytest.raises(KernelError, match="took over 1 s"):
        build.compile_library(str(slow), flags, srcs, tmp_path / "y.so")


def test_a_library_without_an_entry_point_or_with_other_struct_sizes_is_refused(tiny, monkeypatch):
    so, *_ = _load(tiny)
    with pytest.raises(KernelError, match="has no eyas_attention"):
        bd.declare(so)

    class Bigger(ctypes.Structure):
        _fields_ = [*bd.Q4LayersArgs._fields_, ("extra", ctypes.c_int64)]

    real = kernels.lib()
    monkeypatch.setattr(bd, "STRUCTS", (Bigger, bd.DraftLayerArgs))
    with pytest.raises(KernelError, match="do not match"):
        bd.declare(real)


def test_every_entry_point_has_its_signature():
    so = kernels.lib()
    for name, (args, res) in bd.SIGNATURES.items():
        fn = getattr(so, name)
        assert fn.argtypes == args and fn.restype == res, name
    assert so.eyas_q4_layers.restype is ctypes.c_int and so.eyas_draft_layer.restype is ctypes.c_int


def test_out_of_memory_and_a_foreign_struct_size_are_error_codes_not_crashes():
    so = kernels.lib()
    huge = 1 << 30  # R x H scratch of ~2^61 bytes: malloc refuses it, and nothing is read or written
    a = bd.Q4LayersArgs(ctypes.sizeof(bd.Q4LayersArgs), R=huge, H=huge, L=0, nh=1, kvh=1, hd=64, I=huge)
    rc = so.eyas_q4_layers(ctypes.byref(a))
    assert rc == bd.EYAS_ENOMEM
    with pytest.raises(KernelError, match="out of memory"):
        bd.check_status(rc, "the 4-bit decoder stack")
    d = bd.DraftLayerArgs(ctypes.sizeof(bd.DraftLayerArgs), R=huge, H=huge, nh=1, kvh=1, hd=64, I=huge)
    assert so.eyas_draft_layer(ctypes.byref(d)) == bd.EYAS_ENOMEM
    for fn in (so.eyas_q4_matmul_bf16, so.eyas_q8q8_matmul):  # M x K activation scratch: refused, out untouched
        assert fn(None, None, None, huge, 8, huge, 1) == bd.EYAS_ENOMEM
    a.struct_size = 8
    d.struct_size = ctypes.sizeof(bd.DraftLayerArgs) + 8
    assert so.eyas_q4_layers(ctypes.byref(a)) == bd.EYAS_EARGS
    assert so.eyas_draft_layer(ctypes.byref(d)) == bd.EYAS_EARGS
    with pytest.raises(KernelError, match="refused its arguments"):
        bd.check_status(bd.EYAS_EARGS, "the draft layer")


# ---- every wrapper refuses what its kernel cannot take -----------------------------------------------------

def _q8():
    qw = torch.randint(-127, 128, (16, 64), dtype=torch.int8)
    return qw, torch.rand(16, 2)


def _q4_tiles(n=16, k=64):
    return kernels.pack_q4(torch.randint(0, 16, (n, k)), torch.rand(n, k // 32), torch.rand(n, k // 32))


F32, BF = torch.float32, torch.bfloat16
KC = torch.zeros(1, 2, 8, 16)  # one layer's cache [B, kvh, max_len, hd]
QKV = torch.zeros(1, 2, (4 + 2 * 2) * 16, dtype=BF)
CS = torch.zeros(1, 2, 16)

BAD = {
    "attention fp64 q": lambda: kernels.attention(torch.zeros(1, 2, 4, 16, dtype=torch.float64), KC, KC, 0, None, 1.),
    "attention 3-dim q": lambda: kernels.attention(torch.zeros(2, 4, 16), KC, KC, 0, None, 1.),
    "attention head_dim 512": lambda: kernels.attention(torch.zeros(1, 2, 4, 512), torch.zeros(1, 2, 8, 512),
                                                        torch.zeros(1, 2, 8, 512), 0, None, 1.),
    "attention non-contiguous cache": lambda: kernels.attention(torch.zeros(1, 2, 4, 16), KC.transpose(2, 3)
                                                                .contiguous().transpose(2, 3), KC, 0, None, 1.),
    "attention cache of another head_dim": lambda: kernels.attention(torch.zeros(1, 2, 4, 16),
                                                                     torch.zeros(1, 2, 8, 32), KC, 0, None, 1.),
    "attention k/v caches differ": lambda: kernels.attention(torch.zeros(1, 2, 4, 16), KC, torch.zeros(1, 2, 9, 16),
                                                             0, None, 1.),
    "attention past the cache": lambda: kernels.attention(torch.zeros(1, 2, 4, 16), KC, KC, 7, None, 1.),
    "attention negative start": lambda: kernels.attention(torch.zeros(1, 2, 4, 16), KC, KC, -1, None, 1.),
    "attention heads not grouped": lambda: kernels.attention(torch.zeros(1, 2, 3, 16), KC, KC, 0, None, 1.),
    "attention batch mismatch": lambda: kernels.attention(torch.zeros(2, 2, 4, 16), KC, KC, 0, None, 1.),
    "attention mask of the wrong size": lambda: kernels.attention(torch.zeros(1, 2, 4, 16), KC, KC, 1,
                                                                  torch.ones(1, 1, 2, 2, dtype=torch.bool), 1.),
    "attention on the meta device": lambda: kernels.attention(torch.zeros(1, 2, 4, 16, device="meta"), KC, KC, 0,
                                                              None, 1.),
    "attention_kv keys of another size": lambda: kernels.attention_kv(torch.zeros(1, 2, 4, 16),
                                                                    torch.zeros(1, 2, 8, 32), KC, 0, None, 1.),
    "attention_kv values of another batch": lambda: kernels.attention_kv(torch.zeros(1, 2, 4, 16), KC,
                                                                        torch.zeros(2, 2, 8, 16), 0, None, 1.),
    "attention_kv past the values": lambda: kernels.attention_kv(torch.zeros(1, 2, 4, 16), KC,
                                                                torch.zeros(1, 2, 2, 16), 1, None, 1.),
    "attention_kv sinks per kv head": lambda: kernels.attention_kv(torch.zeros(1, 2, 4, 16), KC, KC, 0, None, 1.,
                                                                  torch.zeros(2)),
    "attention_kv heads not grouped": lambda: kernels.attention_kv(torch.zeros(1, 2, 3, 16), KC, KC, 0, None, 1.),
    "f32_matmul_kn x of another K": lambda: kernels.f32_matmul_kn(torch.zeros(1, 9), torch.zeros(8, 4)),
    "f32_matmul_kn non-contiguous weight": lambda: kernels.f32_matmul_kn(torch.zeros(1, 8), torch.zeros(4, 8).t()),
    "q8_matmul K not in blocks": lambda: kernels.q8_matmul(torch.zeros(1, 48), torch.zeros(16, 48, dtype=torch.int8),
                                                           torch.zeros(16, 1)),
    "q8_matmul x of another K": lambda: kernels.q8_matmul(torch.zeros(1, 32), *_q8()),
    "q8_matmul int32 weight": lambda: kernels.q8_matmul(torch.zeros(1, 64), _q8()[0].int(), _q8()[1]),
    "q8_matmul scales shape": lambda: kernels.q8_matmul(torch.zeros(1, 64), _q8()[0], torch.zeros(16, 3)),
    "q8_matmul integer x": lambda: kernels.q8_matmul(torch.zeros(1, 64, dtype=torch.int64), *_q8()),
    "pack_q8 K not in blocks": lambda: kernels.pack_q8(torch.zeros(8, 40, dtype=torch.int8), torch.zeros(8, 1)),
    "pack_q4 scales shape": lambda: kernels.pack_q4(torch.zeros(8, 64), torch.zeros(8, 3), torch.zeros(8, 2)),
    "q8q8 tiles of another matrix": lambda: kernels.q8q8_matmul(torch.zeros(1, 64), kernels.pack_q8(*_q8()), 24),
    "q8q8 x of another K": lambda: kernels.q8q8_matmul(torch.zeros(1, 96), kernels.pack_q8(*_q8()), 16),
    "q8q8 x K not in blocks": lambda: kernels.q8q8_matmul(torch.zeros(1, 50), kernels.pack_q8(*_q8()), 16),
    "q8q8 non-contiguous tiles": lambda: kernels.q8q8_matmul(torch.zeros(1, 64), torch.zeros(288, 2, 2, dtype=
                                                             torch.uint8).permute(1, 2, 0), 16),
    "q4 tiles as int8": lambda: kernels.q4_matmul_bf16(torch.zeros(1, 64), _q4_tiles().view(torch.int8), 16),
    "q4 zero outputs": lambda: kernels.q4_matmul_bf16(torch.zeros(1, 64), _q4_tiles(), 0),
    "f32_matmul bf16 weight": lambda: kernels.f32_matmul(torch.zeros(1, 8), torch.zeros(4, 8, dtype=BF)),
    "f32_matmul x of another K": lambda: kernels.f32_matmul(torch.zeros(1, 9), torch.zeros(4, 8)),
    "f32_matmul non-contiguous weight": lambda: kernels.f32_matmul(torch.zeros(1, 4), torch.zeros(4, 8).t()),
    "add_rms bf16 x": lambda: kernels.add_rms_bf16(torch.zeros(2, 8, dtype=BF), None, torch.ones(8), 1e-6),
    "add_rms non-contiguous x": lambda: kernels.add_rms_bf16(torch.zeros(8, 2).t(), None, torch.ones(8), 1e-6),
    "add_rms y of another shape": lambda: kernels.add_rms_bf16(torch.zeros(2, 8), torch.zeros(3, 8, dtype=BF),
                                                               torch.ones(8), 1e-6),
    "add_rms fp32 y": lambda: kernels.add_rms_bf16(torch.zeros(2, 8), torch.zeros(2, 8), torch.ones(8), 1e-6),
    "add_rms weight of another size": lambda: kernels.add_rms_bf16(torch.zeros(2, 8), None, torch.ones(9), 1e-6),
    "silu_mul odd width": lambda: kernels.silu_mul_bf16(torch.zeros(2, 7, dtype=BF)),
    "silu_mul fp32": lambda: kernels.silu_mul_bf16(torch.zeros(2, 8)),
    "rope_attend qkv width": lambda: kernels.rope_attend(QKV[..., :-16], CS, CS, KC, KC, 0, None, 1., 4, 2, 16),
    "rope_attend fp32 qkv": lambda: kernels.rope_attend(QKV.float(), CS, CS, KC, KC, 0, None, 1., 4, 2, 16),
    "rope_attend cos shape": lambda: kernels.rope_attend(QKV, CS[:, :1], CS, KC, KC, 0, None, 1., 4, 2, 16),
    "rope_attend odd head_dim": lambda: kernels.rope_attend(torch.zeros(1, 2, 8 * 15, dtype=BF),
                                                            torch.zeros(1, 2, 15), torch.zeros(1, 2, 15),
                                                            torch.zeros(1, 2, 8, 15), torch.zeros(1, 2, 8, 15), 0,
                                                            None, 1., 4, 2, 15),
    "rope_attend cache heads": lambda: kernels.rope_attend(QKV, CS, CS, torch.zeros(1, 1, 8, 16),
                                                           torch.zeros(1, 1, 8, 16), 0, None, 1., 4, 2, 16),
    "rope_attend past the cache": lambda: kernels.rope_attend(QKV, CS, CS, KC, KC, 7, None, 1., 4, 2, 16),
    "rope_attend slots with S > 1": lambda: kernels.rope_attend(QKV, CS, CS, KC, KC, 0, None, 1., 4, 2, 16,
                                                                torch.zeros(1, dtype=torch.int64)),
    "rope_attend slot outside the cache": lambda: kernels.rope_attend(QKV[:, :1], CS[:, :1], CS[:, :1], KC, KC, 3,
                                                                      None, 1., 4, 2, 16,
                                                                      torch.tensor([8], dtype=torch.int64)),
    "rope_attend int32 slots": lambda: kernels.rope_attend(QKV[:, :1], CS[:, :1], CS[:, :1], KC, KC, 3, None, 1.,
                                                           4, 2, 16, torch.tensor([1], dtype=torch.int32)),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_kernel_error(case):
    with pytest.raises(KernelError) as e:
        BAD[case]()
    assert "\n" not in str(e.value) and str(e.value)


def test_the_checked_wrappers_still_compute():
    """The checks pass what the kernels take: each wrapper against torch on a small input."""
    x = torch.randn(3, 64)
    qw, d = _q8()
    ref = x @ (qw.float() * d.repeat_interleave(32, 1)).t()
    assert torch.allclose(kernels.q8_matmul(x, qw, d), ref, atol=1e-4, rtol=1e-4)
    w = torch.randn(5, 64)
    assert torch.allclose(kernels.f32_matmul(x, w), x @ w.t(), atol=1e-4, rtol=1e-4)
    q = torch.randn(1, 3, 4, 16)
    kc, vc = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    out = kernels.attention(q, kc, vc, 2, None, 0.25)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), kc[:, :, :5].repeat_interleave(2, 1), vc[:, :, :5].repeat_interleave(2, 1), scale=0.25,
        attn_mask=torch.ones(3, 5, dtype=torch.bool).tril(2)).transpose(1, 2)
    assert torch.allclose(out, ref, atol=1e-5)
    assert torch.allclose(kernels.attention_kv(q, kc, vc, 2, None, 0.25), out, atol=1e-6)
    assert torch.allclose(kernels.f32_matmul_kn(x, w.t().contiguous()), x @ w.t(), atol=1e-4, rtol=1e-4)


# ---- --weights auto: native only where it is known or measured faster ----------------------------------------

@pytest.fixture
def portable(tmp_path, monkeypatch):
    """The kernels' portable variant (what a CPU without AVX2 runs) and a private cache for the probe's record."""
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    best = kernels.isa()
    kernels.select_isa("portable")
    yield tmp_path / "cache" / "kernels" / f"{build.PREFIX}{kernels.library_key()['tag']}.speed.json"
    kernels.select_isa(best)


def test_auto_runs_native_on_the_avx2_and_avx512_variants_without_measuring(monkeypatch):
    from eyas.native import auto

    def no_probe(isa):
        raise AssertionError("measured a variant whose answer is known")

    monkeypatch.setattr(auto, "probe", no_probe)
    for isa in auto.FAST_ISAS:
        monkeypatch.setattr(kernels, "isa", lambda isa=isa: isa)
        choice = auto.auto_native()
        assert choice.native and choice.isa == isa and isa in choice.why


def test_auto_on_the_portable_variant_measures_once_and_follows_the_measurement(portable, monkeypatch):
    from eyas.native import auto

    first = auto.auto_native()
    rec = json.loads(portable.read_text())["portable"]
    assert first.native == (rec["fp32_s"] > rec["native_s"]) and "measured on this CPU" in first.why
    monkeypatch.setattr(auto, "probe", lambda isa: (_ for _ in ()).throw(AssertionError("measured twice")))
    assert auto.auto_native().native == first.native  # read from the record
    for native_s, want in ((9.0, False), (0.001, True)):
        portable.write_text(json.dumps({"portable": {**rec, "native_s": native_s, "fp32_s": 0.01}}))
        assert auto.auto_native().native is want


def test_engine_auto_on_a_slow_portable_cpu_runs_fp32_and_says_why(portable, tmp_path):
    from eyas.engine.weights import engine_model
    from eyas.target.load import load_target
    from tests.gguf_write import write_gguf
    from tests.tiny import tiny_model

    t = load_target(str(write_gguf(tiny_model("llama", hidden=64), tmp_path / "q8.gguf", "Q8_0")))
    portable.parent.mkdir(parents=True, exist_ok=True)
    portable.write_text(json.dumps({"portable": {"native_s": 0.02, "fp32_s": 0.01, "shape": [4096, 4096]}}))
    tm = engine_model(t, "auto")
    assert tm.native is None and "native not faster" in tm.fallback and "portable" in tm.fallback
    portable.write_text(json.dumps({"portable": {"native_s": 0.005, "fp32_s": 0.01, "shape": [4096, 4096]}}))
    assert engine_model(t, "auto").native is not None
    assert engine_model(t, "native").native is not None  # an explicit --weights native is never second-guessed


def test_inspect_names_the_variant_and_what_auto_picks_for_which_target():
    from eyas.native import auto

    gguf = auto.describe(gguf=True)
    assert gguf["isa"] == kernels.isa() and gguf["isa"] in gguf["variants"]
    assert gguf["weights_auto"] == ("native" if auto.auto_native().native else "fp32") and gguf["why"]
    hf = auto.describe(gguf=False)
    assert hf["weights_auto"] == "fp32" and "not a GGUF" in hf["why"]
    assert auto.describe(gguf=True, on_cpu_fp32=False)["weights_auto"] == "fp32"


def test_an_unwritable_cache_is_one_kernel_error(tiny, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("EYAS_CACHE", str(blocker))  # $EYAS_CACHE/kernels cannot be created under a file
    with pytest.raises(KernelError, match="cannot use the kernel cache .*EYAS_CACHE"):
        build.cached_library(*tiny)
