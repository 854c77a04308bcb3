"""Faulty artifacts on the CLI (eyas.files, state files, checkpoints, shards, drafts, exports, every metadata file
through its one reader): each is answered by one clean error line naming the file; an artifact written before
digests were recorded is read with one "not verified" note; a killed writer's temporaries are removed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

# ---- damaged artifacts: state files, checkpoints, shards, drafts --------------------------------------------

TRAIN_FLAGS = ["--draft-vocab", "64", "--ttt-steps", "3", "--lr", "3e-3", "--batch-tokens", "512", "--max-len", "64",
               "--heldout-pct", "20", "--eval-every", "1000", "--save-every", "1000", "--quiet", "--threads", "1"]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A tiny target, its two shards and one finished training run (OUT/checkpoint, OUT/draft), via the CLI."""
    from typer.testing import CliRunner

    from eyas.cli import app
    from tests.test_train import make_shards, make_tiny_target

    root = tmp_path_factory.mktemp("hardening")
    make_shards(make_tiny_target(root / "target"), root / "shards")
    r = CliRunner().invoke(app, ["train", "--data", str(root / "shards"), "--out", str(root / "run"), *TRAIN_FLAGS])
    assert r.exit_code == 0, r.output
    assert (root / "run" / "checkpoint" / "trainer_state.json").is_file()
    return root


def flip_byte(path: Path, from_end: int = 16) -> None:
    """One byte changed inside the tensor data (the header, at the front, stays valid): same size, other bytes."""
    b = bytearray(path.read_bytes())
    b[-from_end] ^= 0x5A
    path.write_bytes(bytes(b))


def cut(path: Path, keep: float = 0.5) -> None:
    path.write_bytes(path.read_bytes()[: int(path.stat().st_size * keep)])


def edit_state(path: Path, **changes: Any) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def forget_digests(path: Path) -> None:
    """What a checkpoint written before eyas recorded digests looks like: no `files`."""
    state = json.loads(path.read_text())
    del state["files"]
    path.write_text(json.dumps(state))


def corrupt_header(path: Path) -> None:
    b = bytearray(path.read_bytes())
    b[8:16] = b"{oops!!!"
    path.write_bytes(bytes(b))


def old_shards(folder: Path) -> None:
    """Shards listed without size or digest (written before either was recorded): read unchecked."""
    m = json.loads((folder / "manifest.json").read_text())
    for s in m["shards"]:
        s.pop("digest", None)
        s.pop("bytes", None)
    (folder / "manifest.json").write_text(json.dumps(m))


def flipped_export(root: Path) -> None:
    """The trained draft exported (its manifest records the weights' digest), then one byte of the export flipped."""
    from eyas.interop.export import export_draft

    export_draft(root / "run" / "draft", "vllm", root / "exported")
    flip_byte(root / "exported" / "model.safetensors")


CK = "run/checkpoint"
# (name, what to copy, damage(root copy), command kind, file the error names, phrase in the error)
DAMAGE = [
    ("negative step", CK, lambda r: edit_state(r / CK / "trainer_state.json", step=-5), "resume",
     "trainer_state.json", "'step' should be a whole number >= 0, found -5"),
    ("step not a number", CK, lambda r: edit_state(r / CK / "trainer_state.json", step="7"), "resume",
     "trainer_state.json", "found '7'"),
    ("tokens_seen a bool", CK, lambda r: edit_state(r / CK / "trainer_state.json", tokens_seen=True), "resume",
     "trainer_state.json", "'tokens_seen'"),
    ("state not JSON", CK, lambda r: (r / CK / "trainer_state.json").write_text('{"step": 3,'), "resume",
     "trainer_state.json", "not valid JSON"),
    ("optimizer truncated", CK, lambda r: cut(r / CK / "optimizer.safetensors"), "resume",
     "optimizer.safetensors", "truncated"),
    ("optimizer byte flipped", CK, lambda r: flip_byte(r / CK / "optimizer.safetensors"), "resume",
     "optimizer.safetensors", "digest differs"),
    ("optimizer truncated, no digests", CK, lambda r: (forget_digests(r / CK / "trainer_state.json"),
                                                       cut(r / CK / "optimizer.safetensors")), "resume",
     "optimizer.safetensors", "not a readable safetensors file"),
    ("checkpoint weights flipped", CK, lambda r: flip_byte(r / CK / "model.safetensors"), "resume",
     "model.safetensors", "digest differs"),
    ("shard truncated", "shards", lambda r: cut(r / "shards" / "shard-00001.safetensors"), "train",
     "shard-00001.safetensors", "truncated"),
    ("shard byte flipped", "shards", lambda r: flip_byte(r / "shards" / "shard-00000.safetensors", 1000), "train",
     "shard-00000.safetensors", "digest differs"),
    ("shard header corrupt, no record", "shards", lambda r: (old_shards(r / "shards"),
                                                             corrupt_header(r / "shards" / "shard-00000.safetensors")),
     "train", "shard-00000.safetensors", "not a readable eyas shard"),
    ("shard byte flipped, ngram", "shards", lambda r: flip_byte(r / "shards" / "shard-00000.safetensors", 1000),
     "ngram", "shard-00000.safetensors", "digest differs"),
    ("shard byte flipped, doctor --data", "shards",
     lambda r: flip_byte(r / "shards" / "shard-00001.safetensors", 1000), "doctor-data", "shard-00001.safetensors",
     "digest differs"),
    ("draft byte flipped", "run/draft", lambda r: flip_byte(r / "run" / "draft" / "model.safetensors"), "export",
     "model.safetensors", "digest differs"),
    ("draft byte flipped, generate", "run/draft", lambda r: flip_byte(r / "run" / "draft" / "model.safetensors"),
     "generate", "model.safetensors", "digest differs"),
    ("rng state byte flipped", CK, lambda r: flip_byte(r / CK / "rng.safetensors"), "resume",
     "rng.safetensors", "digest differs"),
    ("export byte flipped, import", "run/draft", flipped_export, "import", "model.safetensors", "digest differs"),
    ("export byte flipped, doctor flags", "run/draft", flipped_export, "flags", "model.safetensors",
     "digest differs"),
]


def damaged_command(trained_run: Path, root: Path, what: str, kind: str) -> list[str]:
    """The command line of `kind` run on the damaged copy under root (the rest from the intact run)."""
    import shutil

    shards = root / "shards" if what == "shards" else trained_run / "shards"
    target = str(trained_run / "target")
    if kind == "resume":
        shutil.copytree(trained_run / "run" / "draft", root / "run" / "draft")
        return ["train", "--data", str(shards), "--out", str(root / "run"), *TRAIN_FLAGS, "--resume"]
    argv = {
        "train": ["train", "--data", str(shards), "--out", str(root / "new"), *TRAIN_FLAGS],
        "doctor": ["doctor", "--target", target, "--draft", str(root / what), "--quick"],
        "ngram": ["ngram", "--data", str(shards), "--out", str(root / "table")],
        "inspect": ["inspect", str(root / what)],
        "doctor-data": ["doctor", "--target", target, "--draft", str(trained_run / "run" / "draft"), "--data",
                        str(shards), "--samples", "2"],
        "generate": ["generate", "--target", target, "--draft", str(root / what), "--raw", "--prompt", "t5 t6 t7",
                     "--max-new-tokens", "2"],
        "import": ["import", str(root / "exported"), "--target", target, "--out", str(root / "imported")],
        "flags": ["doctor", "flags", "--draft", str(root / "exported"), "--", "vllm", "serve", "M"],
        "export": ["export", "--draft", str(root / what), "--format", "vllm", "--out", str(root / "exported")],
    }
    return argv[kind]


def one_error_line(argv: list[str]) -> str:
    from typer.testing import CliRunner

    from eyas.cli import app

    r = CliRunner().invoke(app, argv)
    assert r.exception is None or isinstance(r.exception, SystemExit), f"{type(r.exception).__name__}: {r.exception}"
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert r.exit_code == 2 and len(errors) == 1 and "Traceback" not in r.output, r.output
    return errors[0]


@pytest.mark.parametrize("name,what,damage,kind,file,phrase", DAMAGE, ids=[c[0] for c in DAMAGE])
def test_damaged_artifact_is_one_error_line(trained_run, tmp_path, name, what, damage, kind, file, phrase):
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(trained_run / what, root / what)
    damage(root)
    error = one_error_line(damaged_command(trained_run, root, what, kind))
    assert file in error and phrase in error, error


# ---- every metadata file through its one reader (eyas.metadata), for every command that reads it ------------

def exported(root: Path) -> None:
    from eyas.interop.export import export_draft

    export_draft(root / "run" / "draft", "vllm", root / "exported")


# file (relative to the run's root), what to copy, how to make it (None: copied), the commands that read it, and
# per damage the JSON edit: a field of the wrong type, a required field removed (None where the schema requires
# none: foreign configs vary), a field out of its range
METADATA = [
    ("shards/manifest.json", "shards", None, ("train", "ngram", "inspect"),
     {"shards": "oops"}, "layout", {"shards": [{"file": "shard-00000.safetensors", "samples": -1, "tokens": 4}]}),
    (f"{CK}/eyas_manifest.json", CK, None, ("resume",), {"draft_vocab": []}, "data", {"step": -1}),
    (f"{CK}/trainer_state.json", CK, None, ("resume",), {"step": "7"}, "optimizer", {"epoch": -1}),
    ("run/draft/eyas_manifest.json", "run/draft", None, ("generate", "export", "doctor", "inspect"),
     {"draft_config": "x"}, "layout", {"step": -3}),
    ("run/draft/config.json", "run/draft", None, ("doctor",), {"eagle_config": [1]}, None, {"hidden_size": 0}),
    ("exported/config.json", "run/draft", exported, ("import", "flags"), {"eagle_config": [1]}, None,
     {"draft_vocab_size": -1}),
    ("exported/eyas_manifest.json", "run/draft", exported, ("import", "flags"), {"files": "x"}, "kind",
     {"format_version": 0}),
]


def metadata_cases() -> list[tuple]:
    cases = []
    for file, what, make, kinds, wrong, missing, out_of_range in METADATA:
        damages = [("not JSON", lambda p: p.write_text('{"kind": '), "not valid JSON"),
                   ("empty", lambda p: p.write_text(""), "is empty"),
                   ("wrong type", lambda p, w=wrong: patch_json(p, w), f"'{next(iter(wrong))}' should be")]
        if missing:
            damages.append(("missing key", lambda p, k=missing: patch_json(p, {k: None}),
                            f"'{missing}' should be"))
        key = next(iter(out_of_range))
        damages.append(("out of range", lambda p, o=out_of_range: patch_json(p, o), "found -1" if key == "shards"
                        else f"found {out_of_range[key]}"))
        for kind in kinds:
            cases += [(f"{file} {label}, {kind}", file, what, make, damage, kind, phrase)
                      for label, damage, phrase in damages]
    return cases


def patch_json(path: Path, fields: dict[str, Any]) -> None:
    """Set top-level fields of a JSON file (None drops the field)."""
    data = json.loads(path.read_text())
    for k, v in fields.items():
        if v is None:
            data.pop(k, None)
        else:
            data[k] = v
    path.write_text(json.dumps(data))


METADATA_CASES = metadata_cases()


@pytest.mark.slow
@pytest.mark.parametrize("name,file,what,make,damage,kind,phrase", METADATA_CASES, ids=[c[0] for c in METADATA_CASES])
def test_damaged_metadata_is_one_error_line_naming_file_and_field(trained_run, tmp_path, name, file, what, make,
                                                                  damage, kind, phrase):
    """Not JSON, empty, a field of the wrong type, missing or out of range: in every metadata file, for every
    command that reads it, one error line naming the file (and the field) -- never a traceback."""
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(trained_run / what, root / what)
    if make:
        make(root)
    damage(root / file)
    error = one_error_line(damaged_command(trained_run, root, what, kind))
    assert Path(file).name in error and phrase in error, error


def test_every_metadata_schema_is_covered():
    """Each schema eyas.metadata defines has rows in the table above (the two draft-config rows share one), but the
    n-gram, replay-rows and recipe records, whose every field tests/test_metadata.py damages (as it does all)."""
    from eyas.metadata import LATEST_TRAIN, NGRAM_MANIFEST, REPLAY_MANIFEST, SCHEMAS

    there = {NGRAM_MANIFEST, REPLAY_MANIFEST, LATEST_TRAIN}
    assert there <= set(SCHEMAS) and len(SCHEMAS) - len(there) == len(METADATA) - 1


def forget_files(path: Path) -> None:
    """An eyas_manifest.json as written before eyas recorded digests: no `files`."""
    patch_json(path, {"files": None})


# (name, what to copy, make it old (no digest records), command kind, what the note names)
UNVERIFIED = [
    ("shards", "shards", lambda r: old_shards(r / "shards"), "train", "2 of 2 shards in"),
    ("shards, ngram", "shards", lambda r: old_shards(r / "shards"), "ngram", "2 of 2 shards in"),
    ("checkpoint", CK, lambda r: (forget_digests(r / CK / "trainer_state.json"),
                                  forget_files(r / CK / "eyas_manifest.json")), "resume", "optimizer.safetensors"),
    ("draft", "run/draft", lambda r: forget_files(r / "run" / "draft" / "eyas_manifest.json"), "generate",
     "model.safetensors"),
    ("export", "run/draft", lambda r: (exported(r), forget_files(r / "exported" / "eyas_manifest.json")), "import",
     "the export"),
]


@pytest.mark.parametrize("name,what,make_old,kind,names", UNVERIFIED, ids=[c[0] for c in UNVERIFIED])
def test_artifact_without_digest_records_is_read_with_one_not_verified_line(trained_run, tmp_path, name, what,
                                                                              make_old, kind, names):
    """An artifact written before eyas recorded digests still works, and the command says, once per file, that it
    was not verified and which command records a digest."""
    import shutil

    from typer.testing import CliRunner

    from eyas.cli import app
    from eyas.files import NOTED

    NOTED.clear()
    root = tmp_path / "copy"
    shutil.copytree(trained_run / what, root / what)
    make_old(root)
    argv = damaged_command(trained_run, root, what, kind)
    if kind == "resume":  # a finished run resumes into nothing to do: ask for more steps
        argv += ["--max-steps", "1000"]
    r = CliRunner().invoke(app, argv)
    assert r.exit_code == 0, r.output
    notes = [ln for ln in r.output.splitlines() if "not verified" in ln]
    assert notes and all(ln.startswith("note: ") and "eyas doctor seal " in ln for ln in notes), r.output
    assert any(names in ln for ln in notes) and len(notes) == len(set(notes)), notes


def test_seal_records_digests_that_then_catch_damage(trained_run, tmp_path):
    """`eyas doctor seal` gives an old artifact its digest records: the note is gone, a later flipped byte is
    named, a second seal has nothing to do, and a file already damaged (size off its record) is refused."""
    import shutil

    from eyas.files import NOTED

    root = tmp_path / "copy"
    shutil.copytree(trained_run / "shards", root / "shards")
    old_shards(root / "shards")
    out = one_line_ok(["doctor", "seal", str(root / "shards")])
    assert "sealed 2 file(s)" in out, out
    assert "nothing to do" in one_line_ok(["doctor", "seal", str(root / "shards")])
    NOTED.clear()
    assert "not verified" not in one_line_ok(damaged_command(trained_run, root, "shards", "ngram"))
    flip_byte(root / "shards" / "shard-00000.safetensors", 1000)
    error = one_error_line(damaged_command(trained_run, root, "shards", "ngram"))
    assert "shard-00000.safetensors" in error and "digest differs" in error, error

    shutil.copytree(trained_run / CK, root / CK)
    forget_digests(root / CK / "trainer_state.json")
    forget_files(root / CK / "eyas_manifest.json")
    patch_json(root / CK / "trainer_state.json", {"files": {"rng.safetensors": {"bytes": 3}}})
    error = one_error_line(["doctor", "seal", str(root / CK)])
    assert "rng.safetensors" in error and "3 were written" in error, error
    patch_json(root / CK / "trainer_state.json", {"files": None})
    assert "sealed 3 file(s)" in one_line_ok(["doctor", "seal", str(root / CK)])
    state = json.loads((root / CK / "trainer_state.json").read_text())
    assert set(state["files"]) == {"optimizer.safetensors", "rng.safetensors"}
    assert set(json.loads((root / CK / "eyas_manifest.json").read_text())["files"]) == {"model.safetensors"}


def one_line_ok(argv: list[str]) -> str:
    from typer.testing import CliRunner

    from eyas.cli import app

    r = CliRunner().invoke(app, argv)
    assert r.exit_code == 0, r.output
    return r.output


def test_shipped_assets_record_digests():
    """The shipped draft and n-gram table carry digest records (sealed), so using them verifies them."""
    from eyas.draft import bundled_draft_path, load_draft
    from eyas.engine.ngram import bundled_ngram_path

    for folder, name in ((bundled_draft_path(), "model.safetensors"), (bundled_ngram_path(), "ngram.safetensors")):
        man = json.loads((folder / "eyas_manifest.json").read_text())
        assert man["files"][name]["digest"].startswith("xxh3_128:"), folder
    assert load_draft("default").model is not None


def test_written_artifacts_record_digests(trained_run):
    from eyas.files import file_digest

    shard_man = json.loads((trained_run / "shards" / "manifest.json").read_text())
    for s in shard_man["shards"]:
        assert s["digest"].startswith("xxh3_128:") and s["digest"] == file_digest(trained_run / "shards" / s["file"])
    draft_man = json.loads((trained_run / "run" / "draft" / "eyas_manifest.json").read_text())
    assert draft_man["files"]["model.safetensors"]["digest"] == \
        file_digest(trained_run / "run" / "draft" / "model.safetensors")
    state = json.loads((trained_run / "run" / "checkpoint" / "trainer_state.json").read_text())
    assert set(state["files"]) == {"optimizer.safetensors", "rng.safetensors"}


def test_export_records_digests_and_foreign_exports_still_import(trained_run, tmp_path):
    """An export's manifest records its weights' size and digest, and `eyas import` takes the intact folder; the
    same folder without the record (as another tool writes it) imports as before, unchecked."""
    from typer.testing import CliRunner

    from eyas.cli import app
    from eyas.files import file_record
    from eyas.interop.export import export_draft

    out = export_draft(trained_run / "run" / "draft", "vllm", tmp_path / "exported").path
    man = json.loads((out / "eyas_manifest.json").read_text())
    assert man["files"] == {"model.safetensors": file_record(out / "model.safetensors")}
    for name, edit in (("intact", lambda m: m), ("foreign", lambda m: {k: v for k, v in m.items() if k != "files"})):
        (out / "eyas_manifest.json").write_text(json.dumps(edit(man)))
        r = CliRunner().invoke(app, ["import", str(out), "--target", str(trained_run / "target"), "--out",
                                     str(tmp_path / name)])
        assert r.exit_code == 0, r.output
        assert (tmp_path / name / "model.safetensors").is_file()


def test_datagen_rerun_redoes_a_damaged_shard(trained_run, tmp_path):
    """A truncated shard (a kill or a full disk outside eyas's writes) or one with a flipped byte is found on the
    rerun, which rolls the folder back to the commit before it and captures those rows again: the same rows in
    the same shard files as before, not "nothing to do" over a file training would then choke on."""
    from eyas.data.datagen import DatagenConfig, run_datagen
    from eyas.files import file_digest

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": " ".join(f"t{(i * 7 + j) % 90 + 2}" for j in range(20))}) + "\n"
                            for i in range(8)))
    cfg = DatagenConfig(out=str(tmp_path / "d"), target=str(trained_run / "target"), data=str(rows), raw=True,
                        regenerate=False, dtype="fp32", shard_samples=2, max_len=32, threads=1)
    first = run_datagen(cfg, command="a", progress=False, log=lambda s: None)
    assert len(first["shards"]) >= 3
    for damage in (cut, flip_byte):
        damage(tmp_path / "d" / first["shards"][1]["file"])
        logs: list[str] = []
        again = run_datagen(cfg, command="b", progress=False, log=logs.append)
        assert any(first["shards"][1]["file"] in line and "rolling back" in line for line in logs), logs
        assert not any("nothing to do" in line for line in logs), logs
        # the same rows in the same files (capture batches differ, so the hidden states match to fp32 noise)
        same = ("file", "samples", "tokens", "loss_tokens", "row_ids")
        assert [[s[k] for k in same] for s in again["shards"]] == [[s[k] for k in same] for s in first["shards"]]
        assert again["shards"][0]["digest"] == first["shards"][0]["digest"]  # before the damage: kept as it was
        assert all(file_digest(tmp_path / "d" / s["file"]) == s["digest"] for s in again["shards"])
        assert again["counts"]["samples"] == first["counts"]["samples"] and again["watermark"] == first["watermark"]


# JSON reads that name a metadata file outside eyas.metadata, each another artifact's own file: the n-gram table's
# and replay rows' manifests, a target's config.json, a bench folder's config
OTHER_JSON = {"eyas/engine/ngram.py": {"MANIFEST"}, "eyas/replay/rows.py": {"MANIFEST"},
              "eyas/recipe.py": {"MANIFEST", "man"}, "eyas/target/family.py": {"config.json"},
              "eyas/target/load.py": {"config.json"}, "eyas/bench/outdir.py": {"cfg_path"}}


def test_metadata_files_have_one_reader():
    """No module but eyas.metadata parses a manifest, trainer state or draft config: every json.loads / read_json
    call elsewhere names none of those files (the allowlist names other artifacts' files that share a name)."""
    import ast

    import eyas

    root = Path(eyas.__file__).parent
    names = ("MANIFEST", "manifest.json", "STATE_FILE", "trainer_state.json", "config.json", "cfg_path", "man")
    found = []
    for path in root.rglob("*.py"):
        rel = f"eyas/{path.relative_to(root)}"
        if rel in ("eyas/metadata.py", "eyas/files.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("json.loads", "json.load", "read_json"):
                text = ast.unparse(node.args[0]) if node.args else ""
                hits = [n for n in names if re.search(rf"\b{re.escape(n)}\b", text)]
                if not set(hits) <= OTHER_JSON.get(rel, set()):
                    found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "metadata read outside eyas.metadata.read_metadata:\n" + "\n".join(found)


DEAD_PID = 2**22 + 12345  # above Linux's pid_max default on these machines: no process has it


@pytest.mark.parametrize("kind", ["export", "train", "ngram"])
def test_killed_writers_temporaries_are_removed_with_one_line(trained_run, tmp_path, kind):
    """A `<out>.tmp-<pid>` folder (export, draft, checkpoint, table) or a `*.tmp-<pid>` file inside the output (a
    shard or log) whose writer is gone is removed on the next run, which says so; a live writer's is kept."""
    import os
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(trained_run / "run" / "draft", root / "run" / "draft")
    out = {"export": root / "exported", "train": root / "new", "ngram": root / "table"}[kind]
    stale = out.with_name(f"{out.name}.tmp-{DEAD_PID}")
    (stale / "deep").mkdir(parents=True)
    (stale / "deep" / "model.safetensors").write_bytes(b"x" * 4096)
    live = out.with_name(f"{out.name}.tmp-{os.getppid()}")
    live.mkdir()
    inside = None
    if kind == "train":
        out.mkdir()
        inside = out / f"train_log.jsonl.tmp-{DEAD_PID}"
        inside.write_text("{")
    output = one_line_ok(damaged_command(trained_run, root, "run/draft", kind))
    notes = [ln for ln in output.splitlines() if "temporary file(s) a killed eyas run left" in ln]
    assert len(notes) == 1 and stale.name in notes[0], output
    assert not stale.exists() and live.exists() and (inside is None or not inside.exists())
