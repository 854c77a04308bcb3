"""What `--weights auto` runs when the native kernels could: native only where it is known or measured faster.

The rule (auto_native): the kernels' AVX2 and AVX-512 VNNI variants run native; the portable variant runs fp32
unless a one-time probe on this CPU says native is faster. Evidence: `python benchmarks/native_auto.py --tokens 24
--rounds 2 --threads 1` (plain greedy decoding of the bundled SmolLM2-135M Q4_1 GGUF, native and fp32 alternated in
one process, each kernel variant selected in turn), AMD EPYC Zen 4, shared machine (load 5-6), 2026-12: native/fp32
7.9x on avx512vnni, 7.3x on avx2, 1.08x on portable. With 2 threads on the same loaded machine the ratios swung
(avx2 1.5-20x, avx512vnni 0.7-1.5x, portable 0.33-0.37x): OpenMP barriers stall when the OS parks a thread, so
those runs measure the load more than the kernels. docs/RESULTS.md ("--weights auto") lists every run.

The probe: one 4-bit x 8-bit matvec [4096, 4096] against torch's fp32 matvec of the same shape, the minimum of a
few runs each. In the 1-thread run it agreed with decoding on avx2 and avx512vnni (native 7-8x faster) and called
the portable variant slower (17.9 vs 12.1 ms) where decoding found the two about even: it leans to fp32, the safe
side where the two are close. It decides only where nothing better is known (a CPU without AVX2). Its result is
cached next to the kernel library under the library's key (a new compiler, flag set, source or CPU measures
again), per variant.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..files import atomic_write_json, cache_dir
from . import kernels
from .boundary import KernelError
from .build import PREFIX

FAST_ISAS = ("avx2", "avx512vnni")  # the variants native is measured faster with (see the module docstring)
PROBE_SHAPE = (4096, 4096)  # [N, K]: 64 MB of fp32 weights, past the caches, as a decode step's matrices are
PROBE_RUNS = 5


@dataclass
class AutoChoice:
    native: bool
    isa: str
    why: str


def probe(isa: str) -> dict[str, Any]:  # native_s, fp32_s; isa and shape for the record
    """Seconds for one [1, K] x [N, K]^T product: eyas's 4-bit kernel (8-bit activations) and torch's fp32, each
    the minimum of PROBE_RUNS after one warm-up."""
    N, K = PROBE_SHAPE
    g = torch.Generator().manual_seed(0)
    tiles = kernels.pack_q4(torch.randint(0, 16, (N, K), generator=g), torch.rand(N, K // 32, generator=g) * 0.01,
                            -torch.rand(N, K // 32, generator=g) * 0.08)
    w = torch.randn(N, K, generator=g)
    x = torch.randn(1, K, generator=g)
    xb = x.to(torch.bfloat16)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(PROBE_RUNS):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    return {"native_s": best(lambda: kernels.q4_matmul_bf16(xb, tiles, N)),
            "fp32_s": best(lambda: torch.nn.functional.linear(x, w)), "isa": isa, "shape": [N, K]}


def measured(isa: str) -> dict[str, Any]:
    """The probe for variant `isa`, from the cache when this library has run it before."""
    path = cache_dir() / "kernels" / f"{PREFIX}{kernels.library_key()['tag']}.speed.json"
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        rec = {}
    if not isinstance(rec, dict):
        rec = {}
    got = rec.get(isa)
    if not (isinstance(got, dict) and isinstance(got.get("native_s"), float) and isinstance(got.get("fp32_s"), float)):
        got = probe(isa)
        rec[isa] = got
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, rec)
    return got


def auto_native() -> AutoChoice:
    """Whether --weights auto runs native on this CPU (when the GGUF's matrices are ones the kernels cover)."""
    isa = kernels.isa()
    if isa in FAST_ISAS:
        return AutoChoice(True, isa, f"the kernels run their {isa} variant, where native was measured faster than "
                                     "fp32 (benchmarks/native_auto.py)")
    r = measured(isa)
    ratio = r["fp32_s"] / r["native_s"]
    verdict = "faster" if ratio > 1 else "not faster"
    why = (f"the kernels run their {isa} variant (no AVX2 here); a {r['shape'][0]}x{r['shape'][1]} matvec measured "
           f"on this CPU took {r['native_s'] * 1e3:.2f} ms native vs {r['fp32_s'] * 1e3:.2f} ms fp32: native "
           f"{verdict}")
    return AutoChoice(ratio > 1, isa, why)


def describe(gguf: bool, on_cpu_fp32: bool = True, misfit: str | None = None) -> dict[str, str]:
    """For `eyas inspect`: the kernels' variant, the ones this CPU runs, and what --weights auto picks and why.
    misfit: why the file's matrices cannot run native (quant.native_misfit, from its tensor headers), so inspect
    says what generate will run."""
    try:
        choice = auto_native()
        variants = ", ".join(kernels.supported_isas())
    except KernelError as e:
        return {"isa": "unavailable", "variants": "", "weights_auto": "fp32", "why": str(e)}
    if not gguf:
        pick, why = "fp32", "not a GGUF target (native weights are read from the .gguf file)"
    elif not on_cpu_fp32:
        pick, why = "fp32", "native weights run on the CPU with fp32 activations (--device cpu --dtype fp32)"
    elif misfit is not None:
        pick, why = "fp32", misfit
    else:
        pick, why = ("native" if choice.native else "fp32"), choice.why
    return {"isa": choice.isa, "variants": variants, "weights_auto": pick, "why": why}
