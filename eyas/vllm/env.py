"""Where vLLM lives: its own Python environment, never eyas's (their pins differ).

eyas drives vLLM through worker scripts run by that environment's python (files in, files out), and through
a live server's HTTP API. The python is, in order: --vllm-python, $EYAS_VLLM_PYTHON, then the project's
`.venv-vllm` (built by `make vllm`) beside the current working directory or the eyas checkout. A GPU user
points either setting at their own CUDA vLLM.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

from ..errors import EyasError

ENV_VAR = "EYAS_VLLM_PYTHON"
VENV = ".venv-vllm"
WORKERS = Path(__file__).parent  # the worker scripts run by vLLM's python: they import vLLM, never eyas


class VllmError(EyasError):
    pass


def _candidates(given: str | None) -> list[tuple[str, Path]]:
    if given:
        return [("--vllm-python", Path(given))]
    if os.environ.get(ENV_VAR):
        return [(f"${ENV_VAR}", Path(os.environ[ENV_VAR]))]
    roots = [Path.cwd(), Path(__file__).resolve().parents[2]]
    return [(f"{r / VENV}", r / VENV / "bin" / "python") for r in dict.fromkeys(roots)]


def vllm_python_path(given: str | None = None) -> Path | None:
    """The python of a vLLM environment where one exists, without importing vLLM there (seconds saved): for
    reading its files, not for running it."""
    return next((py for _, py in _candidates(given) if py.is_file() and os.access(py, os.X_OK)), None)


def vllm_python(given: str | None = None, needed_for: str = "this command") -> Path:
    """The python of a vLLM environment; a VllmError naming `make vllm` when there is none."""
    tried = []
    for where, py in _candidates(given):
        if py.is_file() and os.access(py, os.X_OK):
            _check_import(str(py), where)
            return py
        tried.append(f"{where} ({py})")
    raise VllmError(f"{needed_for} needs vLLM, and no vLLM python was found (tried {', '.join(tried)}): run "
                    f"`make vllm` to build {VENV}, or pass --vllm-python PATH / set ${ENV_VAR} to the python of "
                    "an environment where `import vllm` works")


@cache
def _check_import(py: str, where: str) -> str:
    """vLLM's version in that environment (cached per python); a VllmError when `import vllm` fails there."""
    r = subprocess.run([py, "-c", "import vllm, sys; sys.stdout.write(vllm.__version__)"], capture_output=True,
                       text=True, timeout=300)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise VllmError(f"{where}: `import vllm` fails in {py} ({last}); rebuild it with `make vllm` (which also "
                        "removes the torchvision/torchaudio/torchcodec wheels that break vLLM on a CPU torch)")
    return r.stdout.strip()


def vllm_version(py: Path) -> str:
    return _check_import(str(py), str(py))


def worker_env() -> dict[str, str]:
    """The environment a vLLM worker runs in: offline, no usage stats, a modest CPU KV cache (each settable)."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB: vLLM's CPU default reserves far more than eyas needs
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    return env


def run_worker(py: Path, script: str, request: dict, out_dir: Path, timeout: float | None = None,
               log=None) -> dict:
    """Run worker `script` (a file in eyas/vllm) under vLLM's python with `request` as JSON; the worker writes
    its result to out_dir/result.json (and any tensors beside it). Its stderr streams to ours, so vLLM's
    progress shows; a failure is one VllmError with the worker's last lines."""
    out_dir.mkdir(parents=True, exist_ok=True)
    req = out_dir / "request.json"
    req.write_text(json.dumps(request, indent=2))
    env = worker_env()
    cmd = [str(py), str(WORKERS / script), str(req), str(out_dir)]
    tail: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as p:
        assert p.stdout is not None
        for line in p.stdout:
            tail = (tail + [line.rstrip()])[-15:]
            if log is not None:
                log(line.rstrip())
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired as e:
            p.kill()
            raise VllmError(f"the vLLM worker {script} ran past {timeout:.0f} s") from e
    result = out_dir / "result.json"
    if rc != 0 or not result.is_file():
        raise VllmError(f"the vLLM worker {script} failed (exit {rc}); its last lines:\n  " + "\n  ".join(tail))
    return json.loads(result.read_text())


if __name__ == "__main__":  # `python -m eyas.vllm.env`: where eyas finds vLLM
    try:
        p = vllm_python()
        print(f"{p} (vLLM {vllm_version(p)})")
    except VllmError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
