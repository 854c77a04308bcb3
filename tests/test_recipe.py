"""`eyas recipe`: config checks, and one small end-to-end run of every stage on the real bundled target."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from eyas.data.shards import ShardSet
from eyas.files import portable_paths
from eyas.recipe import RecipeConfig, RecipeError, _data_folders, data_jobs, run_recipe, trained_dir, use_bf16


def test_bad_recipe_config_is_refused():
    with pytest.raises(RecipeError, match="unknown recipe 'llama-70b'"):
        RecipeConfig(name="llama-70b").validate()
    with pytest.raises(RecipeError, match=r"unknown stage\(s\) \['deploy'\]"):
        RecipeConfig(stages=("data", "deploy")).validate()
    with pytest.raises(RecipeError, match="must be >= 0"):
        RecipeConfig(orig_num=-1).validate()


def shard_folder(path, watermark: int, files: list[str]) -> None:
    """A shard folder's manifest as datagen commits it (the shards themselves are not read here)."""
    from eyas.data.shards import FORMAT_VERSION, KIND

    path.mkdir()
    (path / "manifest.json").write_text(json.dumps({
        "kind": KIND, "format_version": FORMAT_VERSION, "layout": {"aux_indices": [1, 2, 3]},
        "watermark": watermark, "shards": [{"file": f, "samples": 1, "tokens": 8} for f in files]}))


def test_regen_start_adds_a_folder_of_later_rows_and_refuses_an_overlap(tmp_path):
    def folder(name, watermark, files):
        shard_folder(tmp_path / name, watermark, files)

    folder("data-regen", 3399, ["a"])
    folder("data-regen-from-12000", 12100, ["b"])
    folder("data-regen-from-5200", 5300, ["c"])
    folder("data-regen-from-20000", 19999, [])  # nothing committed yet: not trained on
    cfg = RecipeConfig(work=str(tmp_path), orig_num=0, regen_num=10, regen_start=3000)
    assert [f.name for f in _data_folders(cfg)] == ["data-regen", "data-regen-from-5200", "data-regen-from-12000"]
    with pytest.raises(RecipeError, match="already read source rows up to 3399.*--regen-start 3400 or more"):
        data_jobs(cfg)
    with pytest.raises(RecipeError, match="data-regen-from-5200 already read source rows up to 5300.*--regen-start "
                                          "5301 or more"):  # any folder that starts earlier, not just data-regen
        data_jobs(replace(cfg, regen_start=5250))
    job, = data_jobs(replace(cfg, regen_start=5301))  # a folder that starts later bounds this one's rows
    assert (job.out, job.start_row, job.end_row) == (str(tmp_path / "data-regen-from-5301"), 5301, 12000)
    assert data_jobs(replace(cfg, regen_start=20000))[0].end_row is None
    with pytest.raises(RecipeError, match="must be >= 0"):
        RecipeConfig(regen_start=-1).validate()


def test_self_num_adds_self_prompted_folders_under_the_same_overlap_rules(tmp_path):
    def folder(name, watermark):
        shard_folder(tmp_path / name, watermark, ["f"])

    folder("data-regen-from-7020", 8326)
    folder("data-self", 1999)
    folder("data-self-from-5000", 5100)
    cfg = RecipeConfig(work=str(tmp_path), orig_num=0, self_num=500, self_start=2000)
    assert [f.name for f in _data_folders(cfg)] == ["data-regen-from-7020", "data-self", "data-self-from-5000"]
    job, = data_jobs(cfg)  # the regen folders' rows are ShareGPT rows: they do not bound self-prompted ones
    assert (job.data, job.out, job.start_row, job.end_row, job.regenerate) == \
        ("self", str(tmp_path / "data-self-from-2000"), 2000, 5000, True)
    with pytest.raises(RecipeError, match="data-self already read source rows up to 1999.*--self-start 2000 or more"):
        data_jobs(replace(cfg, self_start=1500))
    both = data_jobs(replace(cfg, regen_num=10, regen_start=9000))
    assert [(j.data, j.start_row) for j in both] == [("sharegpt", 9000), ("self", 2000)]
    with pytest.raises(RecipeError, match="must be >= 0"):
        RecipeConfig(self_num=-1).validate()


def test_bf16_only_on_cuda_unless_asked():
    assert use_bf16(RecipeConfig(device="cpu")) is False  # AVX2 CPUs emulate bf16 matmuls: slower than fp32
    assert use_bf16(RecipeConfig(device="cuda")) is True
    assert use_bf16(RecipeConfig(device="cpu", bf16=True)) is True


def test_eval_and_ship_need_a_trained_run(tmp_path):
    with pytest.raises(RecipeError, match="run the data stage first"):
        trained_dir(RecipeConfig(work=str(tmp_path)))


@pytest.mark.integration
def test_recipe_end_to_end_and_resume(smollm2, tmp_path):
    """data (3 original + 1 regenerated conversations) -> train -> eval -> ship on the real target; then the same
    command again finds every stage done (same shards, the finished run) and ships the same weights."""
    from eyas.draft import load_draft

    work, ship = tmp_path / "work", tmp_path / "shipped"
    cfg = RecipeConfig(work=str(work), orig_num=3, regen_num=1, regen_max_new_tokens=16, max_len=192, epochs=1.0,
                       batch_tokens=384, heldout_pct=50.0, eval_limit=1, eval_max_new_tokens=8, ship_to=str(ship),
                       ngram_min_count=1)
    done = run_recipe(cfg, log=lambda *a: None)
    assert list(done) == ["data", "ngram", "train", "eval", "ship"]
    shards = {n: json.loads((work / n / "manifest.json").read_text())["shards"] for n in ("data-orig", "data-regen")}
    assert all(shards.values())
    run = trained_dir(cfg)
    assert run.parent == work and (run / "metrics.jsonl").exists()
    ck = load_draft(ship)
    with safe_open(ship / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} <= {"F16", "I64", "BOOL"}  # fp16 weights; d2t/t2d maps
    assert ck.layout.target.fingerprint == smollm2.identity.fingerprint
    assert ck.manifest["shipped"]["recipe"]["orig_num"] == 3
    res = json.loads((work / f"eval-{run.name}" / "results.json").read_text())
    assert set(res["summary"]["methods"]) == {"hf-greedy", "plain", "tree", "tree-lookup"}
    # the table counted over the regenerated reply: benched by the eval stage, shipped beside the draft
    table = json.loads((work / "ngram" / "eyas_manifest.json").read_text())
    assert res["ngram"]["path"] == str(work / "ngram") and table["reply_tokens"] > 0
    assert table["data_hash"] == ShardSet([work / "data-regen"]).hash()
    shipped_table = json.loads((tmp_path / "shipped-ngram" / "eyas_manifest.json").read_text())
    assert shipped_table == portable_paths(table, work, "WORK")  # the same record, paths named inside WORK
    assert shipped_table["sources"][0]["folder"] == "WORK/data-regen"
    assert str(work) not in json.dumps(shipped_table) + json.dumps(ck.manifest)
    before = load_file(ship / "model.safetensors")
    steps = (run / "train_log.jsonl").read_text().splitlines()  # one line per training step

    again = run_recipe(cfg, log=lambda *a: None)
    assert json.loads((work / "data-orig" / "manifest.json").read_text())["shards"] == shards["data-orig"]
    assert trained_dir(cfg) == run
    after = load_file(ship / "model.safetensors")  # same tensors (the header's key order may differ)
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert again["train"]["result"] == done["train"]["result"]
    assert (run / "train_log.jsonl").read_text().splitlines() == steps  # the finished run trained no further step

    # a later round's continuation: warm start from the shipped draft, frozen into WORK/init-<hash>
    warm = replace(cfg, stages=("train",), init_from=str(ship))
    run_recipe(warm, log=lambda *a: None)
    run2 = trained_dir(warm)
    assert run2 != run and run2.name.startswith(run.name + "-from-")
    init = work / ("init-" + run2.name.split("-from-")[1])
    assert torch.equal(load_file(init / "model.safetensors")["fc.weight"], before["fc.weight"])
    man = json.loads((run2 / "draft" / "eyas_manifest.json").read_text())
    assert man["training"]["init_from"] == str(init), man["training"]
    run_recipe(replace(warm, stages=("ship",)), log=lambda *a: None)  # the lineage adds up both runs' time
    shipped = load_draft(ship).manifest
    assert [r["data_hash"] for r in shipped["lineage"]] == [load_draft(init).manifest["data"]["hash"]]
    assert shipped["lineage"][0]["draft"] == f"WORK/{init.name}" and str(work) not in json.dumps(shipped)
    assert shipped["total_training_time_s"] == pytest.approx(
        shipped["lineage"][0]["training_time_s"] + shipped["training_time_s"], abs=0.02)


@pytest.mark.parametrize("inner", [False, True])
def test_a_signal_names_the_stage_and_the_recipe_command_that_resumes(tmp_path, monkeypatch, inner):
    """Ctrl-C in a stage: the recipe stops with one line naming the stage (and, when the stage saved work, what
    it saved, less the stage's own resume command) and the recipe command to rerun; the stages before stay done."""
    import os
    import signal

    import eyas.recipe as recipe
    from eyas.interrupt import Interrupted

    calls = []

    def ngram(cfg, log):
        calls.append("ngram")
        if inner:  # a stage that saved its work and said so (as train and datagen do)
            raise Interrupted("eyas train: stopped by SIGINT at step 3/9; checkpoint saved in X. Resume with: eyas "
                              "train --resume")
        os.kill(os.getpid(), signal.SIGINT)  # a stage without its own handling: stopped at once
        raise AssertionError("the signal should have stopped the stage")

    monkeypatch.setattr(recipe, "stage_ngram", ngram)
    with pytest.raises(Interrupted) as e:
        recipe.run_recipe(RecipeConfig(work=str(tmp_path), stages=("ngram", "train")), log=lambda m: None)
    said = str(e.value)
    assert calls == ["ngram"] and "eyas recipe: stopped in stage ngram" in said and "Rerun the recipe" in said
    if inner:
        assert "(eyas train: stopped by SIGINT at step 3/9; checkpoint saved in X)" in said, said
        assert "eyas train --resume" not in said  # the recipe's command is the one to rerun
