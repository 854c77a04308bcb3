"""The README's examples, run as a reader would run them.

Each runnable block in README.md follows an HTML comment `<!-- test: NAME -->`. The tests read the blocks from the
file, so an edit to an example is tested as edited. The generate and serve examples run exactly as written (the
serve port is swapped for a free one); the train-your-own-draft chain runs its commands as written with tiny
sizes put in (the README says so), because at the written sizes it takes hours on a CPU.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BLOCK = re.compile(r"<!-- test: ([\w-]+) -->\s*\n```(\w+)\n(.*?)\n```", re.S)
README_PORT = "8000"
SERVE_WAIT_S = 900  # loading the target and building the kernels on a loaded 2-core machine

# The train chain runs with the README's own sizes; added are only what the test reads: no progress bars, and the
# doctor's report as JSON. (flag, value or None for a bare flag); a flag the README gives is replaced.
TRAIN_OVERRIDES: dict[str, list[tuple[str, str | None]]] = {
    "datagen": [("--quiet", None)],
    "train": [("--quiet", None)],
    "doctor": [("--json", None)],
    "export": [],
}
SIZE_FLAGS = ("--num", "--max-turns", "--max-new-tokens", "--max-len", "--max-steps", "--epochs", "--samples")


def readme_blocks() -> dict[str, tuple[str, str]]:
    """name -> (language, code) for every block marked `<!-- test: NAME -->`."""
    blocks: dict[str, tuple[str, str]] = {}
    for name, lang, code in BLOCK.findall(README.read_text()):
        assert name not in blocks, f"README marks two blocks '{name}'"
        blocks[name] = (lang, code)
    return blocks


def command_lines(code: str) -> list[str]:
    """A shell block's commands: comments and blank lines dropped, backslash continuations joined."""
    joined = code.replace("\\\n", " ")
    return [line for line in (ln.strip() for ln in joined.splitlines()) if line and not line.startswith("#")]


def eyas_env() -> dict[str, str]:
    """The environment after `. .venv/bin/activate`: this interpreter's bin first on PATH."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def with_overrides(argv: list[str], overrides: list[tuple[str, str | None]]) -> list[str]:
    argv = list(argv)
    for flag, value in overrides:
        if flag in argv:
            i = argv.index(flag)
            if value is not None:
                argv[i + 1] = value
        else:
            argv += [flag] if value is None else [flag, value]
    return argv


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_readme_marks_each_example():
    blocks = readme_blocks()
    assert {"generate", "serve", "serve-curl", "serve-python", "serve-openai", "train"} <= set(blocks)
    for name in ("serve", "serve-curl", "serve-python", "serve-openai"):
        assert README_PORT in blocks[name][1], f"README block '{name}' no longer uses port {README_PORT}"


def test_readme_main_job_matches_the_makefile():
    """The README spells out what `make demo` runs; it must be the Makefile's demo recipe at its defaults."""
    make = (ROOT / "Makefile").read_text()
    defaults = dict(re.findall(r"^(BENCH_\w+) \?= ?(.*)$", make, re.M))
    recipe = re.search(r"^demo: setup\n\t(.*?)\n\n", make, re.M | re.S)
    assert recipe, "Makefile has no `demo: setup` recipe"
    words = recipe.group(1).replace("\\\n", " ")
    for var, value in defaults.items():
        words = words.replace(f"$({var})", value)
    argv = shlex.split(words.replace("$(VENV)/bin/eyas", "eyas"))
    readme = README.read_text()
    main_job = re.search(r"The main job is (`eyas bench[^`]*`)\s*\n(`[^`]*`)", readme)
    assert main_job, "README no longer states the main job's command"
    stated = shlex.split(" ".join(part.strip("`") for part in main_job.groups()))
    assert sorted(stated) == sorted(argv), f"README says {stated}, the Makefile runs {argv}"


@pytest.mark.integration
@pytest.mark.slow
def test_readme_generate(tmp_path):
    lang, code = readme_blocks()["generate"]
    assert lang == "bash"
    (line,) = command_lines(code)
    argv = shlex.split(line)
    assert argv[:2] == ["eyas", "generate"]
    spec = subprocess.run(argv, cwd=tmp_path, env=eyas_env(), capture_output=True, text=True, timeout=1200)
    assert spec.returncode == 0, spec.stderr[-3000:]
    assert spec.stdout.strip(), "the example generated no text"
    assert re.search(r"^tau [\d.]+ tokens/forward", spec.stderr, re.M), spec.stderr[-2000:]
    # The README promises the same text as plain decoding.
    plain = subprocess.run([*argv, "--draft", "none"], cwd=tmp_path, env=eyas_env(), capture_output=True,
                           text=True, timeout=1200)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert spec.stdout == plain.stdout


def _wait_healthy(proc: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + SERVE_WAIT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"eyas serve exited with {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise AssertionError(f"eyas serve did not answer /health within {SERVE_WAIT_S} s")


def _run_client(name: str, port: int, tmp_path: Path) -> subprocess.CompletedProcess:
    lang, code = readme_blocks()[name]
    code = code.replace(README_PORT, str(port))
    argv = ["bash", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
    done = subprocess.run(argv, cwd=tmp_path, env=eyas_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"README block '{name}' failed: {done.stderr[-3000:]}"
    return done


@pytest.mark.integration
@pytest.mark.slow
def test_readme_serve_and_clients(tmp_path):
    blocks = readme_blocks()
    (line,) = command_lines(blocks["serve"][1])
    argv = shlex.split(line, comments=True)
    assert argv[:2] == ["eyas", "serve"] and argv[-1] == "&", argv
    port = free_port()
    argv = [str(port) if a == README_PORT else a for a in argv[:-1]]
    log = tmp_path / "serve.log"  # a file, not a pipe: an unread pipe would block the server once full
    with log.open("w") as sink:
        proc = subprocess.Popen(argv, cwd=tmp_path, env=eyas_env(), stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        _wait_healthy(proc, port, log)
        reply = json.loads(_run_client("serve-curl", port, tmp_path).stdout)
        assert reply["object"] == "chat.completion"
        assert reply["choices"][0]["message"]["content"].strip()
        assert reply["usage"]["completion_tokens"] <= 32
        assert _run_client("serve-python", port, tmp_path).stdout.strip()
        has_openai = subprocess.run([sys.executable, "-c", "import openai"], capture_output=True).returncode == 0
        if has_openai:
            assert _run_client("serve-openai", port, tmp_path).stdout.strip()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    if not has_openai:
        pytest.skip("the openai package is not installed: its README example was not run (curl and urllib were)")


def _train_chain(code: str) -> tuple[str, list[list[str]]]:
    """The README's train block as (TARGET, argv per eyas command)."""
    lines = command_lines(code)
    target = re.fullmatch(r"TARGET=(\S+)(\s+#.*)?", lines[0])
    assert target, f"the train block should start by setting TARGET, got {lines[0]!r}"
    chain = []
    for line in lines[1:]:
        chain.append([target.group(1) if a == "$TARGET" else a for a in shlex.split(line, comments=True)])
    return target.group(1), chain


@pytest.fixture(scope="module")
def example3(tmp_path_factory) -> tuple[Path, dict[str, tuple[list[str], subprocess.CompletedProcess]]]:
    """Example 3's chain as written, tiny sizes put in: (its folder, each command's argv and result)."""
    tmp_path = tmp_path_factory.mktemp("example3")
    target, chain = _train_chain(readme_blocks()["train"][1])
    assert target == "smollm2-135m", "the test runs the chain on the bundled target, as the README's block does"
    assert [argv[1] for argv in chain] == list(TRAIN_OVERRIDES), [argv[:2] for argv in chain]
    for command, added in TRAIN_OVERRIDES.items():  # the README's sizes are what runs
        assert not {flag for flag, _ in added} & set(SIZE_FLAGS), (command, added)
    results = {}
    for argv in chain:
        command = argv[1]
        argv = with_overrides(argv, TRAIN_OVERRIDES[command])
        done = subprocess.run(argv, cwd=tmp_path, env=eyas_env(), capture_output=True, text=True, timeout=1500)
        # A 4-step draft is untrained, so doctor exits 1 on its head check; every other command must succeed.
        assert done.returncode == (1 if command == "doctor" else 0), f"{shlex.join(argv)}: {done.stderr[-3000:]}"
        results[command] = (argv, done)
    return tmp_path, results


@pytest.mark.integration
@pytest.mark.slow
def test_readme_train_your_own_draft(example3):
    tmp_path, results = example3
    data = Path(tmp_path, results["datagen"][0][results["datagen"][0].index("--out") + 1])
    manifest = json.loads((data / "manifest.json").read_text())
    num = int(results["datagen"][0][results["datagen"][0].index("--num") + 1])
    assert manifest["complete"] and manifest["counts"]["conversations"] == num, manifest["counts"]

    train_out = Path(tmp_path, results["train"][0][results["train"][0].index("--out") + 1])
    assert (train_out / "draft" / "model.safetensors").is_file()
    metrics = [json.loads(line) for line in (train_out / "metrics.jsonl").read_text().splitlines()]
    assert metrics and metrics[-1]["step"] > 0
    data_record = json.loads((train_out / "draft" / "eyas_manifest.json").read_text())["data"]
    assert data_record["train_samples"] + data_record["heldout_samples"] == manifest["counts"]["samples"]
    assert data_record["heldout_samples"] >= 1, data_record
    assert "heldout_loss" in metrics[-1], metrics[-1]

    report = json.loads(results["doctor"][1].stdout)
    failed = {c["name"] for c in report["checks"] if c["status"] == "fail"}
    assert failed == {"head"}, report["checks"]
    assert {c["name"]: c["status"] for c in report["checks"]}["data_layout"] == "pass"

    export_argv, export = results["export"]
    out = (tmp_path / export_argv[export_argv.index("--out") + 1]).resolve()
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == manifest["layout"]["aux_indices"]
    launch = [line.strip() for line in export.stdout.splitlines() if line.strip().startswith("vllm serve")]
    assert len(launch) == 1, export.stdout
    spec = json.loads(shlex.split(launch[0])[shlex.split(launch[0]).index("--speculative-config") + 1])
    assert spec["method"] == "eagle3" and Path(spec["model"]) == out


@pytest.mark.integration
@pytest.mark.slow
def test_readme_replay(tmp_path):
    """Example 4 as written with the shipped draft (DRAFT=default, as its comment offers) and 2 prompts x 24
    tokens: capture rows, then replay a vLLM chain and an SGLang tree; each prints its τ."""
    lines = command_lines(readme_blocks()["replay"][1])
    head = re.fullmatch(r"TARGET=(\S+); DRAFT=(\S+)(\s+#.*)?", lines[0])
    assert head and "DRAFT=default" in lines[0], lines[0]
    outs = []
    for line in lines[1:]:
        argv = [head.group(1) if a == "$TARGET" else "default" if a == "$DRAFT" else a
                for a in shlex.split(line, comments=True)]
        if argv[:3] == ["eyas", "replay", "capture"]:
            argv = with_overrides(argv, [("--prompts", "2")]) + ["--max-new-tokens", "24"]
        done = subprocess.run(argv, cwd=tmp_path, env=eyas_env(), capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"{shlex.join(argv)}: {done.stderr[-3000:]}"
        outs.append(done.stdout)
    assert "2 rows" in outs[0] and "eyas-fp32" in outs[0]
    assert "chain k=3" in outs[1] and "tau " in outs[1]
    assert "tree depth 3, topk 4, 8 tokens" in outs[2] and "should log an accept length near" in outs[2]


@pytest.mark.integration
@pytest.mark.vllm
@pytest.mark.slow
def test_readme_example3_draft_is_served_by_the_launch_command_export_prints(example3, vllm_py):
    """Example 3 to its end: the CPU-build launch its own export printed (vLLM's python, memory share, KV cache,
    served name), run as printed but for a free port, serves the draft the chain trained and answers a chat sent
    to the short model name."""
    import httpx

    from tests.test_doctor_serving import _stop, wait_up

    tmp_path, results = example3
    argv, done = results["export"]
    assert "runs/my-train/draft" in argv, f"the export line should name the trained draft: {argv}"
    lines = [ln.strip() for ln in done.stdout.splitlines()]
    assert any(ln.startswith("vllm serve ") for ln in lines), done.stdout  # the command vLLM's own builds run
    launch = next(ln for ln in lines if ln.startswith("VLLM_CPU_KVCACHE_SPACE="))
    assert f" {vllm_py} -m vllm.entrypoints.openai.api_server " in launch, launch  # the python that runs it here
    assert " --port 8000 " in launch and " --served-model-name smollm2-135m " in launch, launch
    port = free_port()
    log = tmp_path / "vllm.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    with open(log, "w") as f:
        p = subprocess.Popen(["bash", "-c", launch.replace(" --port 8000 ", f" --port {port} ")],
                             cwd=tmp_path, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_up(p, url, log)
        assert httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"] == "smollm2-135m"
        r = httpx.post(url + "/v1/chat/completions", timeout=300, json={
            "model": "smollm2-135m", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "Name three colors."}]})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
        serve = shlex.split(launch)
        spec = json.loads(serve[serve.index("--speculative-config") + 1])
        assert spec["method"] == "eagle3" and Path(spec["model"]).is_relative_to(tmp_path), spec  # the chain's draft
    finally:
        _stop(p)
