"""The served tiny target the server tests share: its constants, a uvicorn server in a thread, the Served harness
(server, openai client, httpx client, in-process reference engine) and the OpenAI error-shape check. The
fixtures building it (served_target, served) are in tests/conftest.py."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import uvicorn

from eyas.draft import load_draft
from eyas.engine.decode import Engine
from eyas.engine.params import SamplingParams, SpecParams
from eyas.engine.prompt import chat_input_ids
from eyas.serve.app import ServeConfig, create_app

KEY = "sk-eyas-test"
MODEL = "tiny-eyas"
SPEC = SpecParams(method="tree", depth=3, topk=2, tokens=6)
MAX_NEW = 512
CHAT, COMPL = "/v1/chat/completions", "/v1/completions"


def chat_target(tokenizer, folder, layers: int, context: int):
    """A tiny random Llama with `tokenizer` (SmolLM2's: <|im_start|> 1, <|im_end|> 2), saved to `folder` and
    loaded back as an eyas target."""
    import torch

    from eyas.target.load import load_target
    from tests.tiny import tiny_config

    cfg, cls = tiny_config("llama", vocab=len(tokenizer), hidden=32, layers=layers)
    cfg.max_position_embeddings = context
    cfg.bos_token_id, cfg.eos_token_id = 1, 2
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(cfg).eval()
    model.config.architectures = [cls.__name__]
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return load_target(str(folder))


def serve_in_thread(server: uvicorn.Server) -> tuple[str, uvicorn.Server, threading.Thread]:
    """Run `server` on a free localhost port in a daemon thread; return once it accepts connections."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "the server did not start"
        time.sleep(0.02)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread


class Served:
    def __init__(self, target, draft_path):
        self.target = target
        self.engine = Engine(target, load_draft(draft_path), SpecParams(**vars(SPEC)))
        self.ref = Engine(target, load_draft(draft_path), SpecParams(**vars(SPEC)))  # in-process reference
        self.pool = ThreadPoolExecutor(1)
        cfg = ServeConfig(model_name=MODEL, api_key=KEY, max_prompt_tokens=300, max_new_tokens=MAX_NEW,
                          context_length=target.config.max_position_embeddings)
        self.app = create_app(self.engine, target.tokenizer, cfg)
        self.url, self.server, self.thread = serve_in_thread(
            uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="on")))
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0)
        self.http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)

    def reference(self, input_ids, max_tokens, stop=(), temperature=0.0, seed=None):
        # in a thread of its own, like the server's worker: on a loaded machine torch's OpenMP pool in the
        # main thread can run ~50x slower than in a fresh thread (measured), which would only slow the test
        params = SamplingParams(temperature=temperature, max_new_tokens=max_tokens, stop=list(stop), seed=seed)
        return self.pool.submit(self.ref.generate, list(input_ids), params).result()

    def chat_ids(self, messages):
        return chat_input_ids(self.target.tokenizer, messages)

    def metric(self, name: str) -> float:
        """Sum of a metric's samples whose name+labels start with `name` (0 if absent)."""
        text = self.http.get("/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name) and not line.startswith("#"))

    def wait_idle(self):
        deadline = time.time() + 60
        while self.metric("eyas_requests_running") or self.metric("eyas_queue_depth"):
            assert time.time() < deadline, "the engine worker did not become idle"
            time.sleep(0.05)

    def close(self):
        self.pool.shutdown()
        self.http.close()
        self.server.should_exit = True
        self.thread.join(timeout=30)


def msgs(text):
    return [{"role": "user", "content": text}]


def _err(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]
