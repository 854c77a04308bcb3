"""Shards verified inside the read that loads them for training (eyas.data.shards.read_verified): one read of the
whole file, hashed piece by piece as it lands, checked against the manifest's record before any tensor is returned;
training checks sizes at startup and each shard's digest when it first loads that shard, before any batch holds it."""

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from eyas.data.shards import KIND, MANIFEST, Sample, ShardError, read_verified, write_shard
from eyas.files import atomic_write_json
from eyas.layout import Layout, TargetIdentity
from eyas.train.sources import ShardSource

FIELDS = ("input_ids", "loss_mask", "aux", "final", "offsets", "row_ids")


def _samples(first_row: int, n: int, seed: int, H: int = 8) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(first_row, first_row + n):
        S = int(torch.randint(5, 20, (1,), generator=g))
        out.append(Sample(row_id=r, input_ids=torch.randint(2, 100, (S,), generator=g),
                          loss_mask=torch.rand(S, generator=g) < 0.7, aux=torch.randn(S, 3 * H, generator=g),
                          final=torch.randn(S, H, generator=g)))
    return out


def _folder(d: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Two shards of 12 samples each, as datagen writes them."""
    d.mkdir(parents=True)
    entries = [write_shard(d / f"shard-{i:05d}.safetensors", _samples(12 * i, 12, i), dtype=dtype) for i in range(2)]
    lay = Layout(aux_indices=[1, 2, 3], target=TargetIdentity("LlamaForCausalLM", "llama", 6, 8, 128, "sha256:x"))
    atomic_write_json(d / MANIFEST, {"kind": KIND, "format_version": 1, "layout": lay.to_dict(), "shards": entries})
    return d


def _entry(d: Path, i: int) -> dict:
    return json.loads((d / MANIFEST).read_text())["shards"][i]


def flip_in(path: Path, field: str) -> None:
    """One byte in the middle of `field`'s data flipped (found from the file's own header): same size."""
    b = bytearray(path.read_bytes())
    n = int.from_bytes(b[:8], "little")
    lo, hi = json.loads(b[8:8 + n])[field]["data_offsets"]
    b[8 + n + (lo + hi) // 2] ^= 0x5A
    path.write_bytes(bytes(b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_verified_read_equals_safe_open(tmp_path, dtype):
    d = _folder(tmp_path / "d", dtype)
    p = d / "shard-00001.safetensors"
    got = read_verified(p, _entry(d, 1), FIELDS)
    with safe_open(str(p), framework="pt") as f:
        for k in FIELDS:
            want = f.get_tensor(k)
            assert got[k].dtype == want.dtype and got[k].shape == want.shape and torch.equal(got[k], want), k
    # sha256 records (written before xxh3_128) and records without a digest still read
    old = {"bytes": p.stat().st_size, "sha256": "sha256:" + hashlib.sha256(p.read_bytes()).hexdigest()}
    for record in (old, {"bytes": p.stat().st_size}, None):
        assert torch.equal(read_verified(p, record, ("aux",))["aux"], got["aux"])


def test_a_flipped_byte_is_named_before_any_tensor(tmp_path):
    d = _folder(tmp_path / "d")
    p = d / "shard-00000.safetensors"
    record = _entry(d, 0)
    old = {"bytes": record["bytes"], "sha256": "sha256:" + hashlib.sha256(p.read_bytes()).hexdigest()}
    flip_in(p, "aux")
    for rec, algo in ((record, "xxh3_128"), (old, "sha256")):
        with pytest.raises(ShardError, match=f"shard-00000.safetensors: its {algo} digest differs") as e:
            read_verified(p, rec, FIELDS)
        assert "rerun the `eyas datagen`" in str(e.value)
    assert read_verified(p, {"bytes": record["bytes"]}, ("aux",))["aux"].numel() > 0  # unchecked: reads as it is
    p.write_bytes(p.read_bytes()[:-10])
    with pytest.raises(ShardError, match="truncated or overwritten"):
        read_verified(p, record, FIELDS)


@pytest.mark.parametrize("damage", ["json", "length", "offsets", "dtype"])
def test_a_malformed_header_is_one_shard_error(tmp_path, damage):
    d = _folder(tmp_path / "d")
    p = d / "shard-00000.safetensors"
    b = bytearray(p.read_bytes())
    n = int.from_bytes(b[:8], "little")
    header = json.loads(b[8:8 + n])
    if damage == "json":
        b[8:16] = b"{oops!!!"
    elif damage == "length":
        b[:8] = (len(b) + 1).to_bytes(8, "little")
    else:
        if damage == "offsets":
            header["aux"]["data_offsets"][1] += 4
        else:
            header["aux"]["dtype"] = "Q7"
        text = json.dumps(header, separators=(",", ":")).encode()
        assert len(text) <= n
        b[8:8 + n] = text + b" " * (n - len(text))
    p.write_bytes(bytes(b))
    with pytest.raises(ShardError, match="shard-00000.safetensors is not a readable eyas shard"):
        read_verified(p, None, FIELDS)


def test_training_checks_each_shard_when_it_first_loads_it(tmp_path):
    """Startup checks sizes only; the damaged shard is named by the read that loads it, before a batch holds any
    of its samples, while batches of the intact shard form as before."""
    d = _folder(tmp_path / "d", torch.float32)
    intact = ShardSource([str(d)], 0, 64)
    flip_in(d / "shard-00001.safetensors", "aux")
    src = ShardSource([str(d)], 0, 64)
    items = {si: [it for it in src.train if it.key[0] == si] for si in (0, 1)}
    b = src.batch(items[0], torch.device("cpu"), 64)
    want = intact.batch(items[0], torch.device("cpu"), 64)
    assert torch.equal(b.aux, want.aux) and torch.equal(b.input_ids, want.input_ids)
    with pytest.raises(ShardError, match="shard-00001.safetensors: its xxh3_128 digest differs"):
        src.batch(items[0][:1] + items[1][:1], torch.device("cpu"), 64)
    # the token index read at startup (unverified) must equal the verified read's: here one that read other row ids
    src = ShardSource([str(_folder(tmp_path / "other", torch.float32))], 0, 64)
    off, rows, ids, mask = src._index[0]
    src._index[0] = (off, rows + 1, ids, mask)
    with pytest.raises(ShardError, match="shard-00000.safetensors: its token index differs"):
        src.batch(src.train[:1], torch.device("cpu"), 64)


def test_eyas_train_names_a_damaged_shard_in_one_error_line(tmp_path):
    from eyas.cli import app
    from tests.test_train import make_shards, make_tiny_target

    make_shards(make_tiny_target(tmp_path / "target"), tmp_path / "shards", n=30, gen=10)
    flip_in(tmp_path / "shards" / "shard-00001.safetensors", "aux")
    r = CliRunner().invoke(app, ["train", "--data", str(tmp_path / "shards"), "--out", str(tmp_path / "run"),
                                 "--draft-vocab", "64", "--ttt-steps", "2", "--batch-tokens", "512", "--max-len", "64",
                                 "--heldout-pct", "20", "--quiet", "--threads", "1", "--max-steps", "2"])
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert r.exit_code == 2 and len(errors) == 1 and "Traceback" not in r.output, r.output
    assert "shard-00001.safetensors" in errors[0] and "digest differs" in errors[0], errors[0]
    assert not (tmp_path / "run" / "draft").exists()
