import json

import pytest
import torch

from eyas.data.shards import KIND, MANIFEST, Sample, ShardError, ShardSet, read_shard, write_shard
from eyas.files import atomic_write_json
from eyas.layout import Layout, LayoutError, TargetIdentity


def _sample(row, S=7, H=8):
    return Sample(row_id=row, input_ids=torch.arange(S) + row, loss_mask=torch.arange(S) % 2 == 0,
                  aux=torch.randn(S, 3 * H), final=torch.randn(S, H))


def _folder(tmp_path, name, layout, rows):
    d = tmp_path / name
    d.mkdir()
    entry = write_shard(d / "shard-00000.safetensors", [_sample(r) for r in rows], dtype=torch.float32)
    atomic_write_json(d / MANIFEST, {"kind": KIND, "format_version": 1, "layout": layout.to_dict(),
                                     "shards": [entry]})
    return d


def test_shard_round_trip(tmp_path):
    samples = [_sample(3, S=5), _sample(9, S=11)]
    entry = write_shard(tmp_path / "s.safetensors", samples, dtype=torch.float32)
    assert entry["samples"] == 2 and entry["tokens"] == 16 and entry["row_ids"] == [3, 9]
    back = read_shard(tmp_path / "s.safetensors")
    for a, b in zip(samples, back, strict=True):
        assert a.row_id == b.row_id
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        assert torch.equal(a.aux, b.aux) and torch.equal(a.final, b.final)


def test_corrupt_shard_is_loud(tmp_path):
    p = tmp_path / "bad.safetensors"
    p.write_bytes(b"not a shard")
    with pytest.raises(ShardError, match="not a readable eyas shard"):
        read_shard(p)


def test_shardset_split_and_layout_check(tmp_path):
    t = TargetIdentity("LlamaForCausalLM", "llama", 6, 8, 128, "sha256:x")
    lay = Layout(aux_indices=[2, 3, 3], target=t)
    a = _folder(tmp_path, "a", lay, range(0, 40))
    ss = ShardSet([a])
    assert ss.num_samples == 40
    held = [s.row_id for s in ss.samples("heldout", 20.0)]
    train = [s.row_id for s in ss.samples("train", 20.0)]
    assert sorted(held + train) == list(range(40)) and 0 < len(held) < 20
    other = Layout(aux_indices=[1, 3, 4], target=t)
    b = _folder(tmp_path, "b", other, range(5))
    with pytest.raises(LayoutError, match="aux_indices"):
        ShardSet([a, b])
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / MANIFEST).write_text(json.dumps({"kind": "something-else"}))
    with pytest.raises(ShardError, match="kind"):
        ShardSet([tmp_path / "c"])


def test_heldout_split_of_small_data_is_never_empty_nor_larger_than_asked():
    from eyas.data.shards import SMALL_SPLIT, heldout_rows, is_heldout

    assert heldout_rows(range(4), 0.0) == set() and heldout_rows([7], 50.0) == set()
    for n, pct, want in ((4, 5.0, 1), (4, 25.0, 1), (4, 50.0, 2), (2, 90.0, 1), (10, 30.0, 3), (40, 5.0, 2)):
        held = heldout_rows(range(n), pct)
        assert len(held) == want and held < set(range(n)), (n, pct, held)
        assert heldout_rows(reversed(range(n)), pct) == held  # the rows decide, not their order
    # enough rows asked for: is_heldout's rule, stable as data grows (row r is held out in every run)
    n = 1000
    assert n * 5 / 100 >= SMALL_SPLIT
    assert heldout_rows(range(n), 5.0) == {r for r in range(n) if is_heldout(r, 5.0)}
    # a small split takes the rows the rule ranks first: where the rule holds out exactly what was asked, the same
    small = [r for r in range(200) if is_heldout(r, 5.0)][:1] + [r for r in range(200) if not is_heldout(r, 5.0)][:9]
    assert heldout_rows(small, 10.0) == {small[0]}
