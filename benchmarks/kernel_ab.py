"""A/B of two builds of eyas/kernels.c on the 4-bit matmul, interleaved in one process.

This machine's speed drifts by 20-30% from one minute to the next (shared host), so two separate runs cannot
tell a 5% kernel change from noise. This script builds eyas/kernels.c as it is in the work tree (A) and a
second source (B: a file, or `git show REV:eyas/kernels.c` with --rev), loads both, and alternates them call
by call on the same random 4-bit matrix and activations; medians and B/A per row count.

    python benchmarks/kernel_ab.py --b /tmp/kernels-variant.c [--rows 1,2,4,8] [--n 3072 --k 576] [--threads 1]
    python benchmarks/kernel_ab.py --rev HEAD~1
    python benchmarks/kernel_ab.py --b VARIANT.c --cold-mb 128 --threads 2   # weights streamed from DRAM

By default every call reuses one matrix, which then sits in L2/L3: that measures the arithmetic. A decode step
reads ~126 MB of weights once, more than the L3, so --cold-mb N cycles the calls over distinct matrices
totalling N MB: that measures how well the kernel overlaps its arithmetic with streaming the weights.

It also checks that both builds give the same bits (a kernel change must not change the numerics unless it
means to: the lossless tests compare against plain decoding in the same build, not across builds).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from eyas.native.kernels import _FLAGS, _SRC, _compiler, pack_q4


def build(src: Path, out: Path) -> ctypes.CDLL:
    r = subprocess.run([_compiler(), *_FLAGS, str(src), "-o", str(out), "-lm"], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"building {src} failed: {r.stderr.strip()[:400]}")
    so = ctypes.CDLL(str(out))
    p, i32 = ctypes.c_void_p, ctypes.c_int
    so.eyas_q4_matmul_bf16.argtypes = [p, p, p, i32, i32, i32, i32]
    so.eyas_q4_matmul_bf16.restype = None
    return so


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--b", help="the B source file")
    src.add_argument("--rev", help="git revision whose eyas/kernels.c is B")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--n", type=int, default=3072)
    ap.add_argument("--k", type=int, default=576)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--cold-mb", type=float, default=0.0, help="cycle over distinct matrices totalling this much")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="eyas-ab-"))
    b_src = Path(a.b) if a.b else tmp / "b.c"
    if a.rev:
        b_src.write_bytes(subprocess.run(["git", "show", f"{a.rev}:eyas/kernels.c"], capture_output=True,
                                         check=True).stdout)
    libs = {"A": build(_SRC, tmp / "a.so"), "B": build(b_src, tmp / "b.so")}
    torch.manual_seed(0)
    n, k = a.n, a.k
    d = torch.rand(n, k // 32) * 0.01
    tiles = pack_q4(torch.randint(0, 16, (n, k)), d, -8 * d)
    copies = max(1, int(a.cold_mb * 2**20 / tiles.numel() / tiles.element_size()))
    mats = [tiles] + [tiles.clone() for _ in range(copies - 1)]  # same values: same bits expected
    print(f"{len(mats)} matrix copies of {tiles.numel() * tiles.element_size() / 2**20:.2f} MB", flush=True)
    for m in [int(r) for r in a.rows.split(",")]:
        x = torch.randn(m, k).to(torch.bfloat16)
        outs = {v: torch.empty(m, n, dtype=torch.bfloat16) for v in libs}
        ts: dict[str, list[float]] = {v: [] for v in libs}
        for it in range(a.rounds):
            for v in ("A", "B") if it % 2 else ("B", "A"):
                so, o = libs[v], outs[v]
                t0 = time.perf_counter()
                for c in range(a.calls):
                    w = mats[(it * a.calls + c) % len(mats)]
                    so.eyas_q4_matmul_bf16(x.data_ptr(), w.data_ptr(), o.data_ptr(), m, n, k, a.threads)
                ts[v].append((time.perf_counter() - t0) / a.calls)
        ma, mb = statistics.median(ts["A"]), statistics.median(ts["B"])
        same = torch.equal(outs["A"], outs["B"])
        print(f"rows {m}: A {ma * 1e6:.1f} us ({m * n * k / ma / 1e9:.1f} GMAC/s)  B {mb * 1e6:.1f} us  "
              f"B/A {mb / ma:.3f}  same bits: {'yes' if same else 'NO'}", flush=True)


if __name__ == "__main__":
    main()
