"""Every metadata file eyas reads, damaged field by field and path by path: one error line naming the file and the
field (exit 2, no traceback), for each field of each schema in eyas.metadata; every path an artifact records
resolves inside its folder; `eyas doctor seal` verifies the digests already recorded; an error about a file's
content names the file."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from eyas import metadata as md
from eyas.schema import INT_MAX, Field, Schema
from tests.test_hardening_artifacts import TRAIN_FLAGS

CK = "run/checkpoint"


def cli(argv: list[str]) -> tuple[int, str]:
    from typer.testing import CliRunner

    from eyas.cli import app

    r = CliRunner().invoke(app, [str(a) for a in argv])
    assert r.exception is None or isinstance(r.exception, SystemExit), f"{type(r.exception).__name__}: {r.exception}"
    return r.exit_code, r.output


def one_error(argv: list[str]) -> str:
    code, out = cli(argv)
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in out, out
    return errors[0]


def save_replay_rows(out: Path, identity: dict[str, Any]) -> None:
    from eyas.layout import TargetIdentity
    from eyas.replay.rows import ReplayRows, save_rows

    H = identity["hidden_size"]
    save_rows(ReplayRows(tokens=[[3, 4, 5, 6]], prompt_lens=[2], states=[torch.zeros(3, 2, H)], streams=[1, 2],
                         max_new_tokens=2, eos=[1], identity=TargetIdentity.from_dict(identity), numerics="eyas-fp32",
                         source={"prompts": "test"}), out)


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """A tiny target's shards, a finished training run (draft + checkpoint), its vLLM export, an n-gram table, replay
    rows and a recipe's latest-train record: one of every metadata file eyas writes."""
    from tests.test_train import make_shards, make_tiny_target

    root = tmp_path_factory.mktemp("metadata")
    target = make_tiny_target(root / "target")
    make_shards(target, root / "shards")
    assert cli(["train", "--data", root / "shards", "--out", root / "run", *TRAIN_FLAGS])[0] == 0
    assert cli(["export", "--draft", root / "run" / "draft", "--format", "vllm", "--out", root / "exported"])[0] == 0
    assert cli(["ngram", "--data", root / "shards", "--out", root / "table"])[0] == 0
    save_replay_rows(root / "rows", target.identity.to_dict())
    (root / "work" / "train-abc").mkdir(parents=True)
    (root / "work" / "latest-train.json").write_text(json.dumps({"train_dir": "train-abc", "data": []}))
    return root


def copy(made: Path, what: str, root: Path) -> Path:
    """A copy of made/what under root: JSON files copied (the test edits them), tensor files hard-linked (fast)."""
    def one(src: str, dst: str) -> None:
        (shutil.copy2 if src.endswith(".json") else os.link)(src, dst)

    shutil.copytree(made / what, root / what, copy_function=one)
    return root / what


def edit(path: Path, keys: tuple[Any, ...], value: Any, drop: bool = False) -> None:
    data = json.loads(path.read_text())
    parent = data
    for k in keys[:-1]:
        parent = parent[k]
    if drop:
        del parent[keys[-1]]
    else:
        parent[keys[-1]] = value
    path.write_text(json.dumps(data))


# ---- 1. paths: everything an artifact's metadata names is a file inside its folder ------------------------------

def hostile(made: Path, root: Path, folder: Path, name: str) -> dict[str, str]:
    """Names a manifest in `folder` might record for its file `name`, each pointing outside: an absolute path to a
    copy with the same bytes (so the digest matches), a system file, a climb out, and a link left in place of the
    file that leads to the copy."""
    outside = root / "elsewhere"
    outside.mkdir(exist_ok=True)
    shutil.copy2(folder / name, outside / name)
    return {"absolute copy": str(outside / name), "system file": "/etc/hostname",
            "climb out": "../../../../etc/hostname", "link out": f"link:{outside / name}"}


# (manifest, what to copy, how the entry is reached, the command that reads it, the entry as the error names it)
PATHS = [
    ("shards/manifest.json", "shards", ("shards", 0, "file"), ["ngram", "--data", "{root}/shards", "--out",
                                                               "{root}/table"], "shards[0].file"),
    ("shards/manifest.json", "shards", ("shards", 0, "file"), ["train", "--data", "{root}/shards", "--out",
                                                               "{root}/new", *TRAIN_FLAGS], "shards[0].file"),
    ("run/draft/eyas_manifest.json", "run/draft", ("files", "model.safetensors"),
     ["generate", "--target", "{made}/target", "--draft", "{root}/run/draft", "--raw", "--prompt", "t5 t6",
      "--max-new-tokens", "1"], "files"),
    ("exported/eyas_manifest.json", "exported", ("files", "model.safetensors"),
     ["doctor", "flags", "--draft", "{root}/exported", "--", "vllm", "serve", "M"], "files"),
    (f"{CK}/trainer_state.json", CK, ("files", "rng.safetensors"), ["doctor", "seal", "{root}/" + CK], "files"),
    ("table/eyas_manifest.json", "table", ("files", "ngram.safetensors"), ["inspect", "{root}/table"], "files"),
    ("rows/manifest.json", "rows", ("files", "rows.safetensors"), ["inspect", "{root}/rows"], "files"),
]


@pytest.mark.parametrize("how", ["absolute copy", "system file", "climb out", "link out"])
@pytest.mark.parametrize("manifest,what,keys,argv,entry", PATHS, ids=[f"{p[0]} {p[3][0]}" for p in PATHS])
def test_a_path_out_of_the_artifact_folder_is_one_error_naming_manifest_and_entry(made, tmp_path, how, manifest, what,
                                                                                   keys, argv, entry):
    root = tmp_path / "copy"
    folder = copy(made, what, root)
    name = keys[-1] if keys[0] == "files" else json.loads((root / manifest).read_text())["shards"][0]["file"]
    value = hostile(made, root, folder, name)[how]
    if value.startswith("link:"):  # the name stays; the file becomes a link that leads out
        (folder / name).unlink()
        (folder / name).symlink_to(value[5:])
    elif keys[0] == "files":  # a files record keyed by the hostile name
        rec = json.loads((root / manifest).read_text())["files"].pop(name)
        edit(root / manifest, ("files",), {value: rec})
    else:
        edit(root / manifest, keys, value)
    error = one_error([a.format(root=root, made=made) for a in argv])
    assert Path(manifest).name in error and entry in error and "inside" in error, error


def test_a_file_name_inside_the_folder_still_reads(made, tmp_path):
    """The rule refuses paths out of the folder, not paths: a shard in a subfolder of its folder is read."""
    root = tmp_path / "copy"
    folder = copy(made, "shards", root)
    (folder / "sub").mkdir()
    os.replace(folder / "shard-00000.safetensors", folder / "sub" / "shard-00000.safetensors")
    edit(folder / "manifest.json", ("shards", 0, "file"), "sub/shard-00000.safetensors")
    assert cli(["ngram", "--data", folder, "--out", root / "table"])[0] == 0


def test_recipe_record_names_a_run_inside_work(made, tmp_path):
    from eyas.recipe import RecipeConfig, RecipeError, trained_dir

    work = copy(made, "work", tmp_path)
    assert trained_dir(RecipeConfig(work=str(work))) == work / "train-abc"
    for bad in ("/etc", "../elsewhere", str(work / "train-abc")):
        edit(work / "latest-train.json", ("train_dir",), bad)
        with pytest.raises(RecipeError, match=r"latest-train.json: 'train_dir' should be a file name inside"):
            trained_dir(RecipeConfig(work=str(work)))


# ---- 2. every field of every schema: a wrong type and a value out of bounds ------------------------------------

# metadata file -> what to copy and the lightest command that reads it through its schema
READERS = {
    "shards/manifest.json": ("shards", ["inspect", "{root}/shards"], md.SHARD_MANIFEST),
    "run/draft/eyas_manifest.json": ("run/draft", ["inspect", "{root}/run/draft"], md.DRAFT_MANIFEST),
    f"{CK}/eyas_manifest.json": (CK, ["doctor", "seal", "{root}/" + CK], md.CHECKPOINT_MANIFEST),
    f"{CK}/trainer_state.json": (CK, ["doctor", "seal", "{root}/" + CK], md.TRAINER_STATE),
    "exported/eyas_manifest.json": ("exported", ["inspect", "{root}/exported"], md.EXPORT_MANIFEST),
    "exported/config.json": ("exported", ["doctor", "flags", "--draft", "{root}/exported", "--", "vllm", "serve",
                                          "M"], md.DRAFT_CONFIG),
    "table/eyas_manifest.json": ("table", ["inspect", "{root}/table"], md.NGRAM_MANIFEST),
    "rows/manifest.json": ("rows", ["inspect", "{root}/rows"], md.REPLAY_MANIFEST),
}
WRONG_TYPE = {"int": "7", "number": "7", "string": 7, "file": 7, "bool": 1, "object": [1], "array": "oops",
              "value": {"nested": 1}}


def out_of_bounds(f: Field) -> Any:
    """A value of the field's kind beyond its bounds (None: the field has none)."""
    if f.choices:
        return "not-one-of-these"
    if f.kind == "int":
        return f.low - 1 if f.low is not None else f.high + 1 if f.high is not None and f.high < INT_MAX else 2**64
    if f.kind == "number":
        return f.low - 1 if f.low is not None else f.high + 1 if f.high is not None else float("inf")
    if f.kind == "string" and f.pattern:
        return "not:a-digest"
    if f.kind == "file":
        return "../outside"
    if f.kind == "array" and f.low:
        return []
    return None


def shown_name(keys: tuple[Any, ...]) -> str:
    """The field as eyas.schema names it: `shards[0].file`, `files['model.safetensors'].digest`."""
    import re

    out = ""
    for k in keys:
        if isinstance(k, int):
            out += f"[{k}]"
        elif re.fullmatch(r"\w+", k):
            out += f".{k}" if out else k
        else:
            out += f"[{k!r}]"
    return out


def field_paths(value: Any, f: Field, keys: tuple[Any, ...]) -> list[tuple[tuple[Any, ...], Field]]:
    """Every (keys, field) the schema describes below `f` that the written `value` reaches."""
    out = [(keys, f)]
    if isinstance(value, dict):
        for sub in f.fields:
            if sub.key in value:
                out += field_paths(value[sub.key], sub, (*keys, sub.key))
        if f.each is not None:
            for k, v in list(value.items())[:1]:
                out += field_paths(v, f.each, (*keys, k))
    if isinstance(value, list) and value:
        if f.entries:
            out += [p for sub in f.entries if sub.key in value[0]
                    for p in field_paths(value[0][sub.key], sub, (*keys, 0, sub.key))]
        if f.each is not None:
            out += field_paths(value[0], f.each, (*keys, 0))
    return out


def schema_cases(data: dict[str, Any], schema: Schema) -> list[tuple[str, tuple[Any, ...], Any, str]]:
    """(label, keys, value or None to drop the key, phrase) for each field of `schema` the written `data` holds: a
    value of the wrong type, one out of the field's bounds (where it has any) and, for a required one, none."""
    cases = []
    for keys, f in field_paths(data, Field("", "object", fields=schema.fields), ())[1:]:
        name = shown_name(keys)
        damages = [("wrong type", WRONG_TYPE[f.kind])]
        if (bad := out_of_bounds(f)) is not None:
            damages.append(("out of bounds", bad))
        if f.required and f.key:  # a map's value or an array's entry (key "") may be absent
            damages.append(("missing", None))
        cases += [(f"{name} {label}", keys, value, f"'{name}'") for label, value in damages]
    return cases


@pytest.mark.parametrize("file", list(READERS))
def test_each_damaged_field_is_one_error_naming_file_and_field(made, tmp_path, file):
    """Each field of the file, one at a time: a value of the wrong type, one out of bounds, a required one missing.
    The command that reads the file says so in one error line naming the file and the field (exit 2)."""
    what, argv, schema = READERS[file]
    cases = schema_cases(json.loads((made / file).read_text()), schema)
    failed = []
    for i, (label, keys, value, phrase) in enumerate(cases):
        root = tmp_path / str(i)
        copy(made, what, root)
        edit(root / file, keys, value, drop=value is None)
        code, out = cli([a.format(root=root) for a in argv])
        errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
        if not (code == 2 and len(errors) == 1 and "Traceback" not in out and Path(file).name in errors[0]
                and phrase in errors[0]):
            failed.append(f"{label} ({shown(value)}): exit {code}, {out.strip()[-400:]}")
        shutil.rmtree(root)
    assert not failed, f"{len(failed)} of {len(cases)} damages not reported as one line:\n" + "\n".join(failed)
    assert len(cases) >= 10


def shown(v: Any) -> str:
    return json.dumps(v)[:40] if v is not None else "dropped"


def unchecked(value: Any, f: Field, name: str) -> list[str]:
    """The keys under `name` in a written file that no field of `f` describes."""
    out: list[str] = []
    if isinstance(value, dict) and f.kind == "object":
        known = {s.key: s for s in f.fields}
        if not known and f.each is None and value:
            return [f"{name} (an object whose keys no schema names)"]
        for k, v in value.items():
            sub = known.get(k) or f.each
            out += [f"{name}.{k}"] if sub is None else unchecked(v, sub, f"{name}.{k}")
    elif isinstance(value, list) and f.kind == "array" and value:
        if f.entries:
            out += unchecked(value[0], Field("", "object", fields=f.entries), f"{name}[0]")
        elif f.each is not None:
            out += unchecked(value[0], f.each, f"{name}[0]")
        else:
            out.append(f"{name}[0] (entries no schema describes)")
    return out


def test_every_written_field_has_a_schema_field(made):
    """Nothing eyas writes into a metadata file goes unchecked when it is read back: every key of every file a run
    writes (and of the shipped draft and table) is a field of its schema (a map's keys are its values' field)."""
    import eyas

    assets = Path(eyas.__file__).parent / "assets"
    files = {**{made / file: schema for file, (_, _, schema) in READERS.items()},
             assets / "drafts" / "default" / "eyas_manifest.json": md.DRAFT_MANIFEST,
             assets / "drafts" / "default" / "config.json": md.DRAFT_CONFIG,
             assets / "ngram" / "default" / "eyas_manifest.json": md.NGRAM_MANIFEST,
             made / "work" / "latest-train.json": md.LATEST_TRAIN}
    missing = {str(p): unchecked(json.loads(p.read_text()), Field("", "object", fields=s.fields), "")
               for p, s in files.items()}
    assert not any(missing.values()), {p: m for p, m in missing.items() if m}


def test_every_schema_has_a_reader_here():
    assert {s.what for s in md.SCHEMAS} == {s.what for _, _, s in READERS.values()} | {md.LATEST_TRAIN.what}


# ---- the examples that used to end in a traceback or exit 0 -----------------------------------------------------

EXAMPLES = [
    ("aux_indices not ints, train", "shards", ("layout", "aux_indices"), ["x"],
     ["train", "--data", "{root}/shards", "--out", "{root}/new", *TRAIN_FLAGS], "layout.aux_indices[0]"),
    ("hidden_size a string, generate", "run/draft", ("draft_config", "hidden_size"), "576",
     ["generate", "--target", "{made}/target", "--draft", "{root}/run/draft", "--raw", "--prompt", "t5 t6",
      "--max-new-tokens", "1"], "draft_config.hidden_size"),
    ("shard tokens 1e15, ngram", "shards", ("shards", 0, "tokens"), 10**15,
     ["ngram", "--data", "{root}/shards", "--out", "{root}/table"], "shards[0].tokens"),
    ("row_ids a string, train", "shards", ("shards", 0, "row_ids"), "oops",
     ["train", "--data", "{root}/shards", "--out", "{root}/new", *TRAIN_FLAGS], "shards[0].row_ids"),
    ("watermark 1e12, inspect", "shards", ("watermark",), 10**12, ["inspect", "{root}/shards"], "'watermark'"),
    ("draft vocab beyond the target's, generate", "run/draft", ("draft_config", "draft_vocab_size"), 97,
     ["generate", "--target", "{made}/target", "--draft", "{root}/run/draft", "--raw", "--prompt", "t5 t6",
      "--max-new-tokens", "1"], "draft_config.draft_vocab_size"),
]


@pytest.mark.parametrize("name,what,keys,value,argv,phrase", EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_examples_are_one_error_line(made, tmp_path, name, what, keys, value, argv, phrase):
    root = tmp_path / "copy"
    folder = copy(made, what, root)
    manifest = folder / ("manifest.json" if what == "shards" else "eyas_manifest.json")
    if keys == ("watermark",):  # a datagen folder records the rows it read: 90 of them from row 0
        edit(manifest, ("counts",), {"rows": 90})
    edit(manifest, keys, value)
    error = one_error([a.format(root=root, made=made) for a in argv])
    assert manifest.name in error and phrase in error, error


def test_shard_counts_are_checked_against_its_tensors(made, tmp_path):
    """A manifest entry whose counts fit its bounds but not the file (one token fewer) is named when read."""
    root = tmp_path / "copy"
    folder = copy(made, "shards", root)
    m = json.loads((folder / "manifest.json").read_text())
    edit(folder / "manifest.json", ("shards", 1, "tokens"), m["shards"][1]["tokens"] - 1)
    error = one_error(["ngram", "--data", folder, "--out", root / "table"])
    assert "shard-00001.safetensors" in error and "'shards[1]' records" in error, error


# ---- 3. seal verifies what is already recorded ---------------------------------------------------------------

def flip(path: Path, from_end: int = 1000) -> None:
    b = bytearray(path.read_bytes())
    b[-from_end] ^= 0x01  # one bit
    path.unlink()  # the copy's tensor files are links to the fixture's: replace, never write through
    path.write_bytes(bytes(b))


@pytest.mark.parametrize("what,file", [("shards", "shard-00000.safetensors"), ("run/draft", "model.safetensors"),
                                       (CK, "optimizer.safetensors"), ("table", "ngram.safetensors")])
def test_seal_reports_a_recorded_file_whose_bytes_changed(made, tmp_path, what, file):
    from eyas.files import file_digest

    root = tmp_path / "copy"
    folder = copy(made, what, root)
    before = (folder / ("manifest.json" if what == "shards" else "eyas_manifest.json")).read_text()
    assert "nothing to do" in cli(["doctor", "seal", folder])[1]
    flip(folder / file)
    error = one_error(["doctor", "seal", folder])
    assert file in error and file_digest(folder / file) in error and "its record says xxh3_128:" in error, error
    assert "nothing to do" not in error and "restore the file" in error, error
    after = (folder / ("manifest.json" if what == "shards" else "eyas_manifest.json")).read_text()
    assert after == before  # nothing rewritten


# ---- 4. hostile content in a sealed file: the error names the file ------------------------------------------

def test_token_id_outside_the_vocab_names_the_shard(made, tmp_path):
    """A shard whose bytes were rewritten and then sealed (its digest is its own) holding an id beyond the target's
    vocab: train refuses it naming the shard file, not only the id."""
    from safetensors.torch import load_file

    from eyas.files import save_safetensors

    root = tmp_path / "copy"
    folder = copy(made, "shards", root)
    shard = folder / "shard-00001.safetensors"
    t = load_file(str(shard))
    t["input_ids"][5] = 1_000_000_000
    shard.unlink()
    save_safetensors(t, shard, metadata={"producer": "eyas", "kind": "eyas-shards"})
    m = json.loads((folder / "manifest.json").read_text())
    for e in m["shards"]:
        e.pop("digest"), e.pop("bytes")
    (folder / "manifest.json").write_text(json.dumps(m))
    assert cli(["doctor", "seal", folder])[0] == 0
    error = one_error(["train", "--data", folder, "--out", root / "new", *TRAIN_FLAGS])
    assert "holds token id 1000000000" in error and str(shard) in error, error


def test_about_names_the_file_once():
    from eyas.errors import EyasError, about

    with pytest.raises(EyasError, match=r"^/x/f: bad$"):
        with about("/x/f"):
            raise EyasError("bad")
    with pytest.raises(EyasError, match=r"^/x/f is bad$"):
        with about("/x/f"):
            raise EyasError("/x/f is bad")


def test_schema_language_names_nested_fields():
    from eyas.schema import check_schema

    s = Schema("test", (md.ints("ids", 0, 9, size=2), md.obj("m", each=md.whole("", 1)),
                        md.arr("rows", entries=(Field("file", "file"),))))
    assert check_schema({"ids": [1, 2], "m": {"a": 1}, "rows": [{"file": "x"}]}, s, Path("/tmp")) is None
    assert check_schema({"ids": [1, 10]}, s) == "'ids[1]' should be a whole number in 0..9, found 10"
    assert check_schema({"ids": [1]}, s).startswith("'ids' should be a JSON array of 2 entries, each a whole number")
    assert check_schema({"m": {"a": 0}}, s) == "'m.a' should be a whole number >= 1, found 0"
    assert "a '..' step" in check_schema({"rows": [{"file": "a/../../b"}]}, s, Path("/tmp"))
