"""The vLLM CPU-build launch export prints: the module form with the python that runs it, float32, eager mode, a
KV cache and memory share that fit the memory free when it was printed (vLLM refuses to start when its share
exceeds what is free), localhost, a port and a short model name."""

from __future__ import annotations

import shlex

from eyas.interop.export import memory_share, served_name, vllm_cpu_command

GIB_KIB = 1 << 20
LAUNCH = ("vllm serve /models/T --speculative-config '{\"method\": \"eagle3\", \"model\": \"/d\", "
          "\"num_speculative_tokens\": 3}'")


def meminfo(total_gib: float, free_gib: float) -> str:
    return f"MemTotal: {int(total_gib * GIB_KIB)} kB\nMemFree: 1 kB\nMemAvailable: {int(free_gib * GIB_KIB)} kB\n"


def test_the_memory_share_fits_what_is_free():
    # the founding report: 10.11 of 23.54 GiB free, vLLM's default 0.92 asked for 21.66 GiB and refused to start
    share = memory_share(meminfo(23.54, 10.11))
    assert share == 0.35 and share * 23.54 <= 10.11 - 1
    assert memory_share(meminfo(24, 23.5)) == 0.9  # a quiet machine: never more than 0.9
    assert memory_share(meminfo(24, 0.5)) == 0.05  # nearly full: the least, and vLLM says what it needs
    assert memory_share("") is None and memory_share("MemTotal: 100 kB\n") is None


def test_the_cpu_launch_is_runnable_as_printed():
    line = vllm_cpu_command(LAUNCH, "/opt/venv-vllm/bin/python", "smollm2-135m", meminfo=meminfo(23.54, 10.11))
    words = shlex.split(line)
    assert words[0] == "VLLM_CPU_KVCACHE_SPACE=2" and words[1:4] == [
        "/opt/venv-vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(words[4::2], words[5::2], strict=False))
    assert flags["--model"] == "/models/T" and '"eagle3"' in flags["--speculative-config"]
    assert (flags["--served-model-name"], flags["--host"], flags["--port"], flags["--dtype"]) == (
        "smollm2-135m", "127.0.0.1", "8000", "float32")
    assert flags["--gpu-memory-utilization"] == "0.35" and words[-1] == "--enforce-eager"
    assert vllm_cpu_command("python -m sglang.launch_server --model-path T", "py", "t") is None
    assert "--gpu-memory-utilization" not in vllm_cpu_command(LAUNCH, "py", "t", meminfo="")


def test_the_served_name_is_one_short_word():
    assert served_name({"target_source": "smollm2-135m"}) == "smollm2-135m"
    assert served_name({"target_source": "/models/My Model.gguf"}) == "My-Model"
    assert served_name({"serving_target": "/root/.cache/eyas/targets/SmolLM2-135M"}) == "SmolLM2-135M"
    assert served_name({}) == "target"
