"""What checking a shard folder's digests costs next to reading it for one training epoch.

    python benchmarks/bench_checksum.py [--folder SHARDS] [--build runs/bench-checksum] [--gib 1.0]
                                        [--hidden 576] [--n-aux 3] [--repeats 3] [--out checksum.json]

Without --folder it first writes a synthetic shard folder of about --gib GiB under --build with eyas's own shard
writer (eyas.data.shards.write_shard): random bf16 hidden states of a SmolLM2-135M-sized target (hidden 576, three
aux streams), samples of 64-1024 tokens, shards of at most 65,536 tokens as datagen writes them. An existing
folder is reused when its manifest lists the same size.

Then, --repeats times, interleaved so load drift hits all of them alike:
  read    every shard read as training reads it (eyas.train.sources.ShardSource: sizes checked and the token index
          read once, then each shard's whole file read once, eyas.data.shards.read_verified as ShardSource._load
          calls it), aux/final widened to fp32 as each batch widens them; each file checked by size only, nothing
          hashed
  verify  the same read as training does it (ShardSource._load): each file hashed (xxh3_128) piece by piece as
          it lands and checked against the manifest's digest, the startup token index compared with the verified
          bytes; verify - read is what checking costs training now
  mmap / pass  the read before 2026-12 (safetensors maps each file; read_fields) and the separate digest pass it
          needed first (ShardSet.verify()), for comparison
and prints each repeat's wall and CPU times and the ratio (verify - read) / read (wall and CPU) measured within it
(on a shared machine the CPU ratio is the steadier one), pass / mmap, the old check's cost, and the CPU time of
the verified read over that of the old read and its pass (the whole epoch's read, before and after). One warm-up read
first, so every timing reads from the page cache: the ratio is the CPU cost of checking, the part a faster disk
does not hide. The goal is (verify - read) / read <= 0.05. Compare ratios within one run, never across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from eyas.data.shards import KIND, MANIFEST, Sample, ShardSet, read_fields, read_verified, write_shard
from eyas.files import atomic_write_json, recorded_digest
from eyas.layout import Layout, TargetIdentity
from eyas.train.sources import ShardSource

SHARD_TOKENS = 65536  # datagen's default --shard-tokens


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build(folder: Path, gib: float, hidden: int, n_aux: int, seed: int = 0) -> None:
    """A shard folder of about `gib` GiB: random bf16 states (aux [S, n_aux*H], final [S, H]) per sample."""
    per_token = 2 * hidden * (n_aux + 1) + 4 + 1  # bf16 aux + final, int32 id, uint8 mask
    total = int(gib * (1 << 30) / per_token)
    g = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    entries, row, done = [], 0, 0
    while done < total:
        samples, n = [], 0
        while done + n < total:
            S = min(int(torch.randint(64, 1025, (1,), generator=g)), total - done - n)
            if n + S > SHARD_TOKENS:
                break
            samples.append(Sample(row_id=row, input_ids=torch.randint(0, 49152, (S,), generator=g),
                                  loss_mask=torch.rand(S, generator=g) < 0.6,
                                  aux=torch.randn(S, n_aux * hidden, generator=g, dtype=torch.float32),
                                  final=torch.randn(S, hidden, generator=g, dtype=torch.float32)))
            row, n = row + 1, n + S
        entries.append(write_shard(folder / f"shard-{len(entries):05d}.safetensors", samples))
        done += n
    ident = TargetIdentity("LlamaForCausalLM", "llama", 30, hidden, 49152, "synthetic", name="synthetic")
    layout = Layout(aux_indices=list(range(1, n_aux + 1)), target=ident)
    atomic_write_json(folder / MANIFEST, {"kind": KIND, "format_version": 1, "layout": layout.to_dict(),
                                          "shards": entries, "synthetic": {"gib": gib, "hidden": hidden}})


def train_epoch(folder: Path, check: bool) -> None:
    """Every shard read as training reads it (ShardSource: startup index, then each shard loaded once); `check`:
    with the manifest's digests, hashed inside the read, else with sizes only. Widened as a batch widens them."""
    src = ShardSource([str(folder)], heldout_pct=0.0, buffer_mb=1 << 20)
    for si, (p, record) in enumerate(zip(src.paths, src.records, strict=True)):
        # the read training does when a batch first needs shard si (hash + token index compared with the startup
        # one); without `check`, the same whole-file read checked by size only and nothing compared
        t = src._load(si) if check else read_verified(p, {"bytes": record.get("bytes")}, ("aux", "final", "offsets"))
        t["aux"].float(), t["final"].float()


def mmap_epoch(paths: list[Path]) -> int:
    """The read before 2026-12: safetensors maps each file (read_fields), so the bytes are read when training
    widens them (ids to int64, masks to bool, aux/final to fp32); returns the bytes of tensor data read."""
    n = 0
    for p in paths:
        tok = read_fields(p, ("offsets", "row_ids", "input_ids", "loss_mask"))
        hid = read_fields(p, ("aux", "final", "offsets"))
        for t in (*tok.values(), *hid.values()):
            n += t.numel() * t.element_size()
        tok["input_ids"].long(), tok["loss_mask"].bool(), hid["aux"].float(), hid["final"].float()
    return n


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def cpu_timed(fn) -> tuple[float, float]:
    """(wall s, CPU s of this process, all threads): on a shared machine the CPU seconds are what the step costs,
    while the wall time also counts the waits for a core that other jobs hold."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--folder", default=None, help="an existing shard folder (default: build one under --build)")
    ap.add_argument("--build", default="runs/bench-checksum")
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--n-aux", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    folder = Path(a.folder) if a.folder else Path(a.build) / f"shards-{a.gib:g}gib-h{a.hidden}"
    if a.folder is None:
        man = folder / MANIFEST
        if not (man.exists() and json.loads(man.read_text()).get("synthetic") == {"gib": a.gib, "hidden": a.hidden}):
            t = timed(lambda: build(folder, a.gib, a.hidden, a.n_aux))
            print(f"built {folder} in {t:.1f} s")
    shard_set = ShardSet(folder)
    paths = shard_set.shard_paths()
    size = sum(p.stat().st_size for p in paths)
    algos = sorted({str(recorded_digest(e) or "none").split(":")[0]
                    for m in shard_set.manifests for e in m["shards"]})
    print(f"{folder}: {len(paths)} shards, {size / (1 << 30):.2f} GiB, recorded digests: {', '.join(algos)}")
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; torch threads {torch.get_num_threads()}; "
          f"load average at start {os.getloadavg()[0]:.2f}")
    tensor_bytes = mmap_epoch(paths)  # warm-up: every timing below reads from the page cache
    rows = []
    for i in range(a.repeats):
        r: dict[str, float] = {}
        pair = [("read", lambda: train_epoch(folder, False)), ("verify", lambda: train_epoch(folder, True))]
        # the pair's order alternates: whichever runs first also pays for memory the previous step freed
        steps = (*(pair if i % 2 == 0 else pair[::-1]), ("mmap", lambda: mmap_epoch(paths)), ("pass", shard_set.verify))
        for name, fn in steps:
            r[f"{name}_s"], r[f"{name}_cpu_s"] = cpu_timed(fn)
        r["load_avg"] = os.getloadavg()[0]
        r.update(verify_over_read=(r["verify_s"] - r["read_s"]) / r["read_s"],
                 verify_over_read_cpu=(r["verify_cpu_s"] - r["read_cpu_s"]) / r["read_cpu_s"],
                 pass_over_mmap=r["pass_s"] / r["mmap_s"], pass_over_mmap_cpu=r["pass_cpu_s"] / r["mmap_cpu_s"],
                 new_over_old_cpu=r["verify_cpu_s"] / (r["mmap_cpu_s"] + r["pass_cpu_s"]))
        rows.append(r)
        print(f"repeat {i + 1}: wall: read {r['read_s']:.3f} s ({tensor_bytes / r['read_s'] / 1e9:.2f} GB/s), "
              f"verified read {r['verify_s']:.3f} s, mmap read {r['mmap_s']:.3f} s, separate pass {r['pass_s']:.3f} s; "
              f"CPU: read {r['read_cpu_s']:.3f} s, verified read {r['verify_cpu_s']:.3f} s, mmap read "
              f"{r['mmap_cpu_s']:.3f} s, separate pass {r['pass_cpu_s']:.3f} s; (verify-read)/read "
              f"{r['verify_over_read']:.3f} wall, {r['verify_over_read_cpu']:.3f} CPU; pass/mmap "
              f"{r['pass_over_mmap']:.3f} wall, {r['pass_over_mmap_cpu']:.3f} CPU (load {r['load_avg']:.2f})")
    keys = ("verify_over_read", "verify_over_read_cpu", "pass_over_mmap", "pass_over_mmap_cpu", "new_over_old_cpu")
    med = {k: statistics.median(r[k] for r in rows) for k in keys}
    print(f"median (verified read - read) / read {med['verify_over_read']:.3f} wall, {med['verify_over_read_cpu']:.3f} "
          f"CPU (goal <= 0.05); the separate pass before 2026-12 / mmap read {med['pass_over_mmap']:.3f} wall, "
          f"{med['pass_over_mmap_cpu']:.3f} CPU; verified read / (mmap read + separate pass) "
          f"{med['new_over_old_cpu']:.3f} CPU")
    if a.out:
        Path(a.out).write_text(json.dumps({"folder": str(folder), "bytes": size, "shards": len(paths),
                                           "digests": algos, "cpu": cpu_name(), "repeats": rows,
                                           "median": med}, indent=2))


if __name__ == "__main__":
    main()
