"""Load test for `eyas serve`: concurrent streaming clients with MT-bench prompts, localhost only, bounded.

    python benchmarks/load_test.py --requests 16 --clients 4 --max-tokens 64 --draft none
    python benchmarks/load_test.py --url http://127.0.0.1:8000 --draft random   # a server already running

Without --url it starts `eyas serve` on a free localhost port as a subprocess (same --target/--draft/--method
flags) and stops it at the end. Three phases, one run:
  1. single client: the first --single prompts one after another (greedy, streaming) -> served tok/s;
  2. in-process: Engine.generate on the same requests (same engine flags, chat template included in the
     time), alternating with (1) prompt by prompt -> tok/s, and whether the texts equal the served ones;
  3. load: --clients concurrent clients send --requests requests in total -> requests/s, tokens/s,
     p50/p95 latency and time to first token, errors; plus the server's /metrics (tau, acceptance).
The headline ratio is served tok/s (1) / in-process tok/s (2); the goal is >= 0.9.
The in-process run happens while the server is idle, on a thread of its own like the server's engine
worker: on a busy CPU, torch's thread pool in the main thread can be far slower than in a fresh thread,
which would skew the ratio. Prints JSON (and writes it to --out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from eyas.option import DEFAULT_TARGET


@dataclass
class Sample:
    prompt_id: str
    ok: bool
    latency_s: float
    ttft_s: float | None
    completion_tokens: int
    text: str
    error: str | None = None


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(a: argparse.Namespace, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "eyas", "serve", "--target", a.target, "--draft", a.draft, "--port", str(port),
           "--host", "127.0.0.1", "--dtype", a.dtype, "--device", a.device, "--log-level", "warning",
           "--max-new-tokens", str(max(a.max_tokens, 1))]
    for flag in ("method", "steps", "depth", "topk", "tokens"):
        if getattr(a, flag) is not None:
            cmd += [f"--{flag}", str(getattr(a, flag))]
    env = dict(os.environ)
    if a.api_key:
        env["EYAS_API_KEY"] = a.api_key
    return subprocess.Popen(cmd, env=env)


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode} before it was ready (see its output)")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"{url}/health did not answer 200 within {timeout:.0f} s")


async def one_request(client: httpx.AsyncClient, model: str, prompt_id: str, messages: list[dict],
                      max_tokens: int) -> Sample:
    body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, text, tokens = None, "", 0
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                detail = (await r.aread()).decode(errors="replace")[:300]
                dt = time.perf_counter() - t0
                return Sample(prompt_id, False, dt, None, 0, "", f"HTTP {r.status_code}: {detail}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Sample(prompt_id, False, time.perf_counter() - t0, ttft, 0, text, chunk["error"]["message"])
                for c in chunk.get("choices", []):
                    piece = c["delta"].get("content") or ""
                    if piece and ttft is None:
                        ttft = time.perf_counter() - t0
                    text += piece
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        return Sample(prompt_id, False, time.perf_counter() - t0, ttft, 0, text, f"{type(e).__name__}: {e}")
    return Sample(prompt_id, True, time.perf_counter() - t0, ttft, tokens, text)


async def run_clients(url: str, headers: dict, model: str, jobs: list[tuple[str, list[dict]]], clients: int,
                      max_tokens: int) -> tuple[list[Sample], float]:
    queue = list(jobs)
    out: list[Sample] = []

    async def client_loop():
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=httpx.Timeout(600.0)) as c:
            while queue:
                pid, messages = queue.pop(0)
                out.append(await one_request(c, model, pid, messages, max_tokens))

    t0 = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(clients)))
    return out, time.perf_counter() - t0


def summarize(samples: list[Sample], wall: float) -> dict:
    ok = [s for s in samples if s.ok]
    toks = sum(s.completion_tokens for s in ok)
    lat = [s.latency_s for s in ok]
    ttft = [s.ttft_s for s in ok if s.ttft_s is not None]
    return {"requests": len(samples), "errors": len(samples) - len(ok), "wall_s": round(wall, 3),
            "requests_per_s": round(len(ok) / wall, 4) if wall else None,
            "completion_tokens": toks, "tokens_per_s": round(toks / wall, 3) if wall else None,
            "latency_p50_s": pct(lat, 0.5), "latency_p95_s": pct(lat, 0.95),
            "ttft_p50_s": pct(ttft, 0.5), "ttft_p95_s": pct(ttft, 0.95),
            "error_messages": sorted({s.error for s in samples if s.error})[:5]}


def scrape_metrics(url: str, headers: dict) -> dict:
    text = httpx.get(url + "/metrics", headers=headers, timeout=30).text
    out: dict = {"acceptance_rate_per_depth": {}}
    for line in text.splitlines():
        if line.startswith("eyas_spec_tau "):
            out["tau"] = float(line.split()[-1])
        elif line.startswith("eyas_spec_acceptance_rate{"):
            depth = line.split('depth="')[1].split('"')[0]
            out["acceptance_rate_per_depth"][depth] = float(line.split()[-1])
        elif line.startswith(("eyas_spec_rounds_total ", "eyas_spec_generated_tokens_total ")):
            out[line.split()[0]] = float(line.split()[-1])
    return out


class InProcess:
    """Engine.generate with the script's engine flags, on a thread of its own (see the module docstring)."""

    def __init__(self, a: argparse.Namespace):
        from eyas.engine.load import EngineOptions
        from eyas.engine.params import TreeSettings
        from eyas.serve.launch import build_engine

        self.a = a
        tree = TreeSettings(steps=a.steps, depth=a.depth, topk=a.topk, tokens=a.tokens)
        self.engine, self.target = build_engine(EngineOptions(target=a.target, draft=a.draft, method=a.method,
                                                              tree=tree, dtype=a.dtype, device=a.device))
        self.pool = ThreadPoolExecutor(1)

    def _run(self, messages: list[dict]):
        from eyas.engine.params import SamplingParams
        from eyas.engine.prompt import chat_input_ids

        t0 = time.perf_counter()  # the chat template counts, as it does for the server
        r = self.engine.generate(chat_input_ids(self.target.tokenizer, messages),
                                 SamplingParams(temperature=0.0, max_new_tokens=self.a.max_tokens))
        return r, time.perf_counter() - t0

    def generate(self, prompt_id: str, messages: list[dict]) -> Sample:
        r, dt = self.pool.submit(self._run, messages).result()
        return Sample(prompt_id, True, dt, None, len(r.token_ids), r.text)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", help="an already running server (default: start one on a free localhost port)")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--draft", default="none", help="eyas draft folder | default | random | none")
    p.add_argument("--method", default=None, help="tree | chain | plain (default: tree, plain with --draft none)")
    for flag in ("steps", "depth", "topk", "tokens"):
        p.add_argument(f"--{flag}", type=int, default=None)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--requests", type=int, default=16, help="requests in the concurrent phase")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--single", type=int, default=4, help="requests in the single-client and in-process phases")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompts", default="mt-bench", help="mt-bench | humaneval | a JSONL of prompts")
    p.add_argument("--model", default=None, help="model name to send (default: the server's /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("EYAS_API_KEY"))
    p.add_argument("--no-baseline", action="store_true", help="skip the in-process phase")
    p.add_argument("--startup-timeout", type=float, default=300)
    p.add_argument("--out", default=None, help="write the JSON here too")
    a = p.parse_args(argv)
    for name in ("requests", "clients", "single", "max_tokens"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.url and not a.url.startswith(("http://127.", "http://localhost", "http://[::1]")):
        p.error(f"--url {a.url}: this load test only targets localhost servers")

    from eyas.bench.prompts import load_prompts

    prompts = load_prompts(a.prompts, limit=None)
    jobs = [(pr.id, pr.messages) for pr in prompts]
    single_jobs = jobs[:a.single]
    load_jobs = [jobs[i % len(jobs)] for i in range(a.requests)]

    proc = None
    url = a.url
    if url is None:
        url = f"http://127.0.0.1:{free_port()}"
        proc = start_server(a, int(url.rsplit(":", 1)[1]))
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    base = None
    try:
        wait_healthy(url, proc, a.startup_timeout)
        model = a.model or httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        base = None if a.no_baseline else InProcess(a)
        # warm-up (not measured): first-call costs belong to neither side
        asyncio.run(run_clients(url, headers, model, single_jobs[:1], 1, a.max_tokens))
        if base is not None:
            base.generate(*single_jobs[0])
        # single client and in-process alternate prompt by prompt, so drifting load on a shared machine
        # hits both sides alike; the server is idle while the in-process run works
        single: list[Sample] = []
        inproc: list[Sample] = []
        single_wall = 0.0
        for job in single_jobs:
            got, wall = asyncio.run(run_clients(url, headers, model, [job], 1, a.max_tokens))
            single += got
            single_wall += wall
            if base is not None:
                inproc.append(base.generate(*job))
        load, load_wall = asyncio.run(run_clients(url, headers, model, load_jobs, a.clients, a.max_tokens))
        server_metrics = scrape_metrics(url, headers)
    finally:
        if base is not None:
            base.pool.shutdown()
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()

    single_sum = summarize(single, single_wall)
    served_tok_s = (sum(s.completion_tokens for s in single if s.ok) / sum(s.latency_s for s in single if s.ok)
                    if any(s.ok for s in single) else None)
    result: dict = {
        "config": {k: v for k, v in vars(a).items() if k != "api_key"},
        "single_client": {**single_sum, "served_tok_s": served_tok_s},
        "load": summarize(load, load_wall),
        "server_metrics": server_metrics,
    }
    if inproc:
        base_tok_s = sum(s.completion_tokens for s in inproc) / sum(s.latency_s for s in inproc)
        match = [s.ok and s.text == b.text for s, b in zip(single, inproc, strict=True)]
        result["in_process"] = {"requests": len(inproc), "tok_s": base_tok_s,
                                "completion_tokens": sum(s.completion_tokens for s in inproc),
                                "outputs_equal_served": sum(match)}
        result["served_over_in_process"] = round(served_tok_s / base_tok_s, 4) if served_tok_s else None
        result["goal"] = ">= 0.9"
        if not all(match):
            result["warning"] = ("served and in-process greedy outputs differ: the server does not run the same "
                                 "target/draft/method flags as this script (or decoding is not lossless)")
    result["samples"] = {"single": [asdict(s) | {"text": s.text[:80]} for s in single],
                         "load_errors": [asdict(s) for s in load if not s.ok][:5]}
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return result


if __name__ == "__main__":
    main()
