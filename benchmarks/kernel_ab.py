"""A/B of two builds of eyas's C kernels (eyas/native/*.c) on the 4-bit matmul, interleaved in one process.

This machine's speed drifts by 20-30% from one minute to the next (shared host), so two separate runs cannot
tell a 5% kernel change from noise. This script builds the kernels as they are in the work tree (A) and a
second set (B: the work tree's with one file replaced by a variant, named like the file it replaces, e.g.
matmul_q4.c; or REV's eyas/native/*.c with --rev), loads both, and alternates them call by call on the same
random 4-bit matrix and activations; medians and B/A per row count.

    python benchmarks/kernel_ab.py --b /tmp/variant/matmul_q4.c [--rows 1,2,4,8] [--n 3072 --k 576] [--threads 1]
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
import io
import shutil
import statistics
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

import torch

from eyas.native.build import compile_library, compiler
from eyas.native.kernels import FLAGS, HEADERS, SOURCES, pack_q4


def load(sources: list[Path], out: Path) -> ctypes.CDLL:
    """Build `sources` into `out` and bind the 4-bit matmul."""
    compile_library(compiler(), FLAGS, sources, out)
    so = ctypes.CDLL(str(out))
    p, i32 = ctypes.c_void_p, ctypes.c_int
    so.eyas_q4_matmul_bf16.argtypes = [p, p, p, i32, i32, i32, i32]
    so.eyas_q4_matmul_bf16.restype = None
    return so


def b_sources(a: argparse.Namespace, tmp: Path) -> Path:
    """A folder holding B's kernel sources: REV's eyas/native/*.c and *.h, or the work tree's with --b in place."""
    b = tmp / "b"
    b.mkdir()
    if a.rev:
        tar = subprocess.run(["git", "archive", a.rev, "eyas/native"], capture_output=True, check=True).stdout
        with tarfile.open(fileobj=io.BytesIO(tar)) as t:
            for m in t.getmembers():
                if m.isfile() and m.name.endswith((".c", ".h")):
                    (b / Path(m.name).name).write_bytes(t.extractfile(m).read())
        return b
    for f in (*SOURCES, *HEADERS):
        shutil.copy(f, b / f.name)
    variant = Path(a.b)
    if not (b / variant.name).exists():
        raise SystemExit(f"--b {variant}: name it after the kernel file it replaces "
                         f"({', '.join(f.name for f in SOURCES)})")
    shutil.copy(variant, b / variant.name)
    return b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--b", help="B: a variant of one kernel file, named like it (e.g. matmul_q4.c)")
    src.add_argument("--rev", help="git revision whose eyas/native/*.c are B")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--n", type=int, default=3072)
    ap.add_argument("--k", type=int, default=576)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--cold-mb", type=float, default=0.0, help="cycle over distinct matrices totalling this much")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="eyas-ab-"))
    libs = {"A": load(list(SOURCES), tmp / "a.so"), "B": load(sorted(b_sources(a, tmp).glob("*.c")), tmp / "b.so")}
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
