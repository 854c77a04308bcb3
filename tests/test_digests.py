"""File digests (eyas/files.py): xxh3_128 records for what eyas writes now, sha256 records from before still
verified, and tensor files whose bytes depend only on their tensors, so identical runs record identical digests."""

import hashlib
import json
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors import safe_open

from eyas.data.shards import Sample, write_shard
from eyas.files import bytes_digest, damaged, file_digest, file_record, save_safetensors


def _flip(path: Path, at: int = -5) -> None:
    b = bytearray(path.read_bytes())
    b[at] ^= 0x01
    path.write_bytes(bytes(b))


def test_digest_of_a_file_is_xxh3_128_of_its_bytes(tmp_path):
    data = torch.randint(0, 256, (3 << 20,), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    p = tmp_path / "f.bin"
    p.write_bytes(data.numpy().tobytes())
    want = "xxh3_128:" + xxhash.xxh3_128(p.read_bytes()).hexdigest()
    assert file_digest(p) == want == bytes_digest(p.read_bytes())
    assert file_digest(p, "sha256") == "sha256:" + hashlib.sha256(p.read_bytes()).hexdigest()
    assert file_record(p) == {"bytes": 3 << 20, "digest": want}
    empty = tmp_path / "empty"
    empty.write_bytes(b"")  # nothing to map: read instead
    assert file_digest(empty) == "xxh3_128:" + xxhash.xxh3_128(b"").hexdigest()


def test_sha256_records_from_before_still_verify(tmp_path):
    p = tmp_path / "model.safetensors"
    p.write_bytes(bytes(range(256)) * 64)
    old = {"bytes": p.stat().st_size, "sha256": "sha256:" + hashlib.sha256(p.read_bytes()).hexdigest()}
    assert damaged(p, old) is None and damaged(p, file_record(p)) is None
    _flip(p)
    for record, algo in ((old, "sha256"), ({"bytes": old["bytes"], "digest": file_digest(p) + "0"}, "xxh3_128")):
        why = damaged(p, record)
        assert why is not None and f"its {algo} digest differs" in why, why
    assert "cannot check" in damaged(p, {"digest": "blake9:00"})


def _samples(seed: int) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    return [Sample(row_id=r, input_ids=torch.randint(0, 100, (S,), generator=g),
                   loss_mask=torch.rand(S, generator=g) < 0.5, aux=torch.randn(S, 3 * 16, generator=g),
                   final=torch.randn(S, 16, generator=g)) for r, S in ((4, 9), (11, 23))]


def test_the_same_shard_written_again_has_the_same_bytes(tmp_path):
    """safetensors writes header metadata from a hash map in an order that changes between writes; eyas sorts it,
    so rewriting a shard (a datagen rerun, a second identical run) gives the same bytes and the same digest."""
    entries, blobs = [], set()
    for i in range(8):  # unsorted, 2 metadata keys come out in the same order 8 times with chance 1/128
        entries.append(write_shard(tmp_path / f"s{i}.safetensors", _samples(0)))
        blobs.add((tmp_path / f"s{i}.safetensors").read_bytes())
    assert len(blobs) == 1
    assert len({e["digest"] for e in entries}) == 1 and entries[0]["digest"].startswith("xxh3_128:")
    with safe_open(str(tmp_path / "s0.safetensors"), framework="pt") as f:
        assert f.metadata() == {"producer": "eyas", "kind": "eyas-shards"}


def test_saved_metadata_is_sorted_and_readable(tmp_path):
    tensors = {"b": torch.arange(5.0), "a": torch.ones(2, 3, dtype=torch.bfloat16)}
    meta = {"zeta": "1", "alpha": "a \"quoted\" value", "mid": "ünïcode"}
    p = tmp_path / "t.safetensors"
    save_safetensors(tensors, p, metadata=meta)
    n = int.from_bytes(p.read_bytes()[:8], "little")
    header = json.loads(p.read_bytes()[8:8 + n])
    assert list(header["__metadata__"]) == ["alpha", "mid", "zeta"]
    with safe_open(str(p), framework="pt") as f:
        assert f.metadata() == meta
        assert all(torch.equal(f.get_tensor(k), v) for k, v in tensors.items())


def test_drafts_and_exports_are_byte_identical_across_writes(tmp_path):
    from eyas.draft import DraftConfig, Eagle3Draft, save_draft
    from eyas.interop.export import export_draft
    from eyas.layout import Layout, TargetIdentity

    cfg = DraftConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=8, vocab_size=64, draft_vocab_size=32, target_hidden_size=16, num_aux=3)
    torch.manual_seed(0)
    model = Eagle3Draft(cfg)
    layout = Layout(aux_indices=[1, 2, 3], target=TargetIdentity("LlamaForCausalLM", "llama", 4, 16, 64, "sha256:t"))
    drafts, exports = set(), set()
    for i in range(6):
        d = save_draft(tmp_path / f"d{i}", model, layout)
        drafts.add((d / "model.safetensors").read_bytes())
        e = export_draft(d, "vllm", tmp_path / f"e{i}").path
        exports.add((e / "model.safetensors").read_bytes())
    assert len(drafts) == 1 and len(exports) == 1


@pytest.mark.parametrize("algo", ["xxh3_128", "sha256"])
def test_a_flipped_byte_anywhere_changes_the_digest(tmp_path, algo):
    p = tmp_path / "f.bin"
    p.write_bytes(bytes(1 << 16))
    before = file_digest(p, algo)
    for at in (0, 1 << 15, -1):
        _flip(p, at)
        assert file_digest(p, algo) != before
        _flip(p, at)
    assert file_digest(p, algo) == before


def test_an_atomic_folder_removes_what_a_killed_writer_of_it_left(tmp_path):
    """A writer killed mid-write leaves `<out>.tmp-<pid>`; the next write of the same folder removes it (a dead
    pid), while a live writer's temporary and other folders' are kept."""
    import os

    from eyas.files import atomic_folder

    out = tmp_path / "export"
    dead = tmp_path / "export.tmp-999999999"  # no such process
    (dead / "sub").mkdir(parents=True)
    (dead / "sub" / "model.safetensors").write_bytes(b"x" * 1024)
    live = tmp_path / f"export.tmp-{os.getppid()}"  # a running process: its write may be in progress
    live.mkdir()
    other = tmp_path / "other.tmp-999999999"
    other.mkdir()
    atomic_folder(out, lambda tmp: (tmp / "config.json").write_text("{}"))
    assert (out / "config.json").is_file() and not dead.exists() and live.exists() and other.exists()
