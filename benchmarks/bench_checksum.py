"""What checking a shard folder's digests costs next to reading it for one training epoch.

    python benchmarks/bench_checksum.py [--folder SHARDS] [--build runs/bench-checksum] [--gib 1.0]
                                        [--hidden 576] [--n-aux 3] [--repeats 3] [--out checksum.json]

Without --folder it first writes a synthetic shard folder of about --gib GiB under --build with eyas's own shard
writer (eyas.data.shards.write_shard): random bf16 hidden states of a SmolLM2-135M-sized target (hidden 576, three
aux streams), samples of 64-1024 tokens, shards of at most 65,536 tokens as datagen writes them. An existing
folder is reused when its manifest lists the same size.

Then, --repeats times, interleaved so load drift hits all of them alike:
  read    every shard's tensors as training reads them (eyas.train.sources.ShardSource: the token index once,
          then aux/final/offsets per shard; eyas.data.shards.read_fields), widened as training widens them
  copy    the same tensors only copied: the least any reader does with the bytes (a stricter denominator)
  verify  ShardSet.verify(), the check training runs before its first step (size + recorded digest per shard)
  sha256  the same files through sha256, the digest eyas recorded before xxh3_128, for comparison
  chunked / inread  each file read into memory in 4 MiB pieces, without and with xxh3_128 over each piece as it
          lands: the difference is what verifying inside the read (no second pass) would cost
and prints each repeat's wall and CPU times and the ratios verify/read (wall and CPU) and sha256/read measured
within it (on a shared machine the CPU ratio is the steadier one). One warm-up read first, so every timing reads
from the page cache: the ratio is the CPU cost of checking, the part a faster disk does not hide (from a cold
cache the check's pass also brings the files into memory, which the epoch's read then finds there). The goal is
verify/read <= 0.05. Compare ratios within one run, never across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import xxhash

from eyas.bench.environment import cpu_name
from eyas.data.shards import KIND, MANIFEST, Sample, ShardSet, read_fields, write_shard
from eyas.files import atomic_write_json, file_digest, recorded_digest
from eyas.layout import Layout, TargetIdentity

SHARD_TOKENS = 65536  # datagen's default --shard-tokens


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


def read_epoch(paths: list[Path], as_training: bool = True) -> int:
    """Every tensor training reads from each shard, its bytes touched; returns the bytes of tensor data read.
    safetensors maps the file, so read_fields alone reads nothing: training reads the bytes when it widens them
    (ids to int64, masks to bool at indexing; aux/final to fp32 per batch, eyas.train.sources.ShardSource), which
    `as_training` does; otherwise each tensor is only copied, the least any reader does with the bytes."""
    n = 0
    for p in paths:
        tok = read_fields(p, ("offsets", "row_ids", "input_ids", "loss_mask"))
        hid = read_fields(p, ("aux", "final", "offsets"))
        for t in (*tok.values(), *hid.values()):
            n += t.numel() * t.element_size()
        if as_training:
            tok["input_ids"].long(), tok["loss_mask"].bool(), hid["aux"].float(), hid["final"].float()
        else:
            [t.clone() for t in (*tok.values(), *hid.values())]
    return n


def chunked_read(paths: list[Path], digest: bool, chunk: int = 4 << 20) -> None:
    """Each file read into one buffer in `chunk`-byte pieces; `digest`: xxh3_128 over each piece right after it
    lands, while it is still in the CPU's cache. The difference between the two is what a reader that verified
    the bytes it reads anyway would add (eyas's check is a separate pass: ShardSet.verify)."""
    for p in paths:
        size = p.stat().st_size
        view = memoryview(torch.empty(size, dtype=torch.uint8).numpy()).cast("B")  # not zero-filled
        h = xxhash.xxh3_128()
        with open(p, "rb", buffering=0) as f:
            pos = 0
            while pos < size and (n := f.readinto(view[pos:pos + chunk])):
                if digest:
                    h.update(view[pos:pos + n])
                pos += n


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
    tensor_bytes = read_epoch(paths)  # warm-up: every timing below reads from the page cache
    rows = []
    for i in range(a.repeats):
        r: dict[str, float] = {}
        steps = (("read", lambda: read_epoch(paths)), ("copy", lambda: read_epoch(paths, as_training=False)),
                 ("verify", shard_set.verify), ("sha256", lambda: [file_digest(p, "sha256") for p in paths]),
                 ("chunked", lambda: chunked_read(paths, False)), ("inread", lambda: chunked_read(paths, True)))
        for name, fn in steps:
            r[f"{name}_s"], r[f"{name}_cpu_s"] = cpu_timed(fn)
        r["load_avg"] = os.getloadavg()[0]
        r.update(verify_over_read=r["verify_s"] / r["read_s"], sha256_over_read=r["sha256_s"] / r["read_s"],
                 verify_over_copy=r["verify_s"] / r["copy_s"], verify_over_read_cpu=r["verify_cpu_s"] / r["read_cpu_s"],
                 inread_over_read_cpu=(r["inread_cpu_s"] - r["chunked_cpu_s"]) / r["read_cpu_s"])
        rows.append(r)
        print(f"repeat {i + 1}: wall: read {r['read_s']:.3f} s ({tensor_bytes / r['read_s'] / 1e9:.2f} GB/s), copy "
              f"only {r['copy_s']:.3f} s, verify {r['verify_s']:.3f} s, sha256 {r['sha256_s']:.3f} s; CPU: read "
              f"{r['read_cpu_s']:.3f} s, verify {r['verify_cpu_s']:.3f} s; verify/read {r['verify_over_read']:.3f} "
              f"(CPU {r['verify_over_read_cpu']:.3f}), sha256/read {r['sha256_over_read']:.3f}, verify/copy "
              f"{r['verify_over_copy']:.3f}; hashing while reading adds {r['inread_cpu_s'] - r['chunked_cpu_s']:.3f} "
              f"CPU s (/read {r['inread_over_read_cpu']:.3f}) (load {r['load_avg']:.2f})")
    keys = ("verify_over_read", "verify_over_read_cpu", "sha256_over_read", "verify_over_copy", "inread_over_read_cpu")
    med = {k: statistics.median(r[k] for r in rows) for k in keys}
    print(f"median verify/read {med['verify_over_read']:.3f} wall, {med['verify_over_read_cpu']:.3f} CPU (goal <= "
          f"0.05); sha256/read {med['sha256_over_read']:.3f}; verify/copy-only {med['verify_over_copy']:.3f}; "
          f"hashing while reading / read {med['inread_over_read_cpu']:.3f} CPU")
    if a.out:
        Path(a.out).write_text(json.dumps({"folder": str(folder), "bytes": size, "shards": len(paths),
                                           "digests": algos, "cpu": cpu_name(), "repeats": rows,
                                           "median": med}, indent=2))


if __name__ == "__main__":
    main()
