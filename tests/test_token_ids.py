"""Stored token ids outside the vocabulary: every reader (eyas ngram, doctor --data, train, replay, a datagen
resume) refuses them in one line that names the file and the row, even when the file's digest was recomputed to
match (a digest says a file is what was written, not that its ids fit the target).

The shards are a tiny random Llama's own greedy replies (tests.test_train); the draft is one short `eyas train`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from typer.testing import CliRunner

from eyas.cli import app
from eyas.files import file_record, save_safetensors
from eyas.vocab import TokenIdError, check_token_ids
from tests.test_hardening_artifacts import one_error_line

BAD = 10**9  # the repro's id: far past any vocabulary, still an int32
FLAGS = ["--draft-vocab", "64", "--ttt-steps", "2", "--lr", "3e-3", "--batch-tokens", "512", "--max-len", "64",
         "--heldout-pct", "20", "--eval-every", "1000", "--save-every", "1000", "--quiet", "--threads", "1"]




def plant(file: Path, field: str, row: int, pos: int, records: dict) -> None:
    """Write BAD at position `pos` of row `row` of the file's packed `field`, then record the new size and digest
    where the manifest keeps them (records: the dict holding "bytes"/"digest"), as a careless edit would."""
    with safe_open(str(file), framework="pt") as f:
        meta = f.metadata()
    t = load_file(str(file))
    t[field][int(t["offsets"][row]) + pos] = BAD
    save_safetensors(t, file, metadata=meta)
    records.update(file_record(file))


def plant_shard(folder: Path, shard: str = "shard-00000.safetensors", sample: int = 3) -> int:
    """A planted out-of-vocabulary id in a shard whose manifest entry is made to match; returns its source row."""
    man = json.loads((folder / "manifest.json").read_text())
    entry = next(e for e in man["shards"] if e["file"] == shard)
    plant(folder / shard, "input_ids", sample, 5, entry)
    (folder / "manifest.json").write_text(json.dumps(man))
    return int(load_file(str(folder / shard))["row_ids"][sample])


def test_check_names_the_row_the_id_and_the_bound():
    ids = torch.tensor([1, 2, 3, 4, 5, 99, 6])
    check_token_ids(ids[:5], [0, 2, 5], 96, "f", [7, 8], "fix it")  # all in range: silent
    with pytest.raises(TokenIdError) as e:
        check_token_ids(ids, [0, 2, 5, 7], 96, "f.safetensors", [7, 8, 9], "fix it")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("f.safetensors: row 9 (sample 2) holds token id 99 at position 0")
    assert "expected ids < 96" in msg and msg.endswith("fix it")
    with pytest.raises(TokenIdError, match="row 0 holds token id -1 at position 1"):
        check_token_ids(torch.tensor([3, -1]), [0, 2], 96, "f", None, "fix")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny target, its shards, a trained draft and replay rows of that target."""
    from eyas.replay.rows import capture_rows_eyas, plant_streams, save_rows
    from tests.test_train import make_shards, make_tiny_target

    root = tmp_path_factory.mktemp("token-ids")
    target = make_tiny_target(root / "target")
    make_shards(target, root / "shards", n=30, gen=24)
    r = CliRunner().invoke(app, ["train", "--data", str(root / "shards"), "--out", str(root / "run"), *FLAGS])
    assert r.exit_code == 0, r.output
    streams = plant_streams(target.default_layout().aux_indices, target.num_layers)
    save_rows(capture_rows_eyas(target, [[5, 6, 7, 8], [9, 10, 11]], 12, streams), root / "rows")
    return root


@pytest.fixture
def bad_shards(world, tmp_path):
    shards = tmp_path / "shards"
    shutil.copytree(world / "shards", shards)
    return shards, plant_shard(shards)


READERS = {
    "ngram": lambda w, s, t: ["ngram", "--data", str(s), "--out", str(t / "table")],
    "train": lambda w, s, t: ["train", "--data", str(s), "--out", str(t / "run"), *FLAGS],
    "doctor --data": lambda w, s, t: ["doctor", "--target", str(w / "target"), "--draft", str(w / "run" / "draft"),
                                      "--data", str(s), "--samples", "2"],
}


@pytest.mark.parametrize("reader", list(READERS))
def test_shard_readers_refuse_an_out_of_vocab_id_naming_shard_and_row(world, bad_shards, tmp_path, reader):
    shards, row = bad_shards
    error = one_error_line(READERS[reader](world, shards, tmp_path))
    assert f"{shards / 'shard-00000.safetensors'}: row {row} (sample 3) holds token id {BAD}" in error, error
    assert "expected ids < 96" in error and "eyas datagen" in error, error
    assert not (tmp_path / "table").exists()  # eyas ngram writes no table that generate would refuse later


def test_replay_refuses_rows_with_an_out_of_vocab_id(world, tmp_path):
    rows = tmp_path / "rows"
    shutil.copytree(world / "rows", rows)
    man = json.loads((rows / "manifest.json").read_text())
    plant(rows / "rows.safetensors", "tokens", 1, 2, man["files"]["rows.safetensors"])
    (rows / "manifest.json").write_text(json.dumps(man))
    error = one_error_line(["replay", "run", "--rows", str(rows), "--draft", str(world / "run" / "draft"),
                            "--target", str(world / "target"), "--k", "2"])
    assert f"{rows / 'rows.safetensors'}: row 1 holds token id {BAD} at position 2" in error, error
    assert "expected ids < 96" in error and "eyas replay capture" in error, error


def test_datagen_resume_refuses_a_committed_shard_with_an_out_of_vocab_id(smollm2_tokenizer, tmp_path):
    from tests.test_datagen import _save_tiny

    target = _save_tiny(tmp_path / "target", smollm2_tokenizer, seed=0)
    data = tmp_path / "convs.jsonl"
    data.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": f"Count to {i}."},
                                                          {"from": "gpt", "value": f"Sure: {' '.join('1' * i)}."}]})
                            + "\n" for i in range(1, 9)))
    out = tmp_path / "out"

    def datagen(num: int) -> list[str]:
        return ["datagen", "--target", str(target), "--data", str(data), "--out", str(out), "--max-len", "64",
                "--dtype", "fp32", "--shard-samples", "2", "--no-regenerate", "--quiet", "--threads", "1",
                "--num", str(num)]

    r = CliRunner().invoke(app, datagen(4))
    assert r.exit_code == 0, r.output
    row = plant_shard(out, sample=1)
    error = one_error_line(datagen(8))
    assert f"{out / 'shard-00000.safetensors'}: row {row} (sample 1) holds token id {BAD}" in error, error
    assert f"expected ids < {len(smollm2_tokenizer)}" in error, error


def test_every_reader_of_shard_token_ids_passes_the_vocab():
    """The range check lives in eyas.data.shards.read_fields: a new reader that reads input_ids without giving it
    a vocabulary would skip it silently, so each call site says which vocabulary it checks against."""
    import ast

    root = Path(__file__).resolve().parents[1] / "eyas"
    unchecked = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", getattr(node.func, "attr", None))
            reads_ids = name == "read_shard" or (
                name == "read_fields" and len(node.args) > 1 and "input_ids" in ast.unparse(node.args[1]))
            given = len(node.args) > (1 if name == "read_shard" else 2) or any(k.arg == "vocab" for k in node.keywords)
            if reads_ids and not given:
                unchecked.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    assert not unchecked, unchecked
