"""`eyas serve`: a real uvicorn server on 127.0.0.1 over a tiny random Llama (SmolLM2 tokenizer) with a random
EAGLE-3 draft, driven by the official `openai` client and raw httpx. Served outputs are checked token-for-token
(via text and usage counts) against Engine.generate in-process for the same greedy or seeded requests; shutdown,
exit logging and concurrency. Error answers are in tests/test_server_errors.py, the pieces that need no server
(TextStream, Metrics, exposure warning) in tests/test_server_parts.py."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import uvicorn

from eyas.engine.decode import Engine
from eyas.engine.params import SamplingParams, SpecParams
from eyas.engine.prompt import chat_input_ids
from eyas.serve.app import ServeConfig, create_app
from eyas.serve.openai_schema import APIError
from tests.serving import CHAT, COMPL, KEY, MAX_NEW, MODEL, _err, msgs, serve_in_thread

# ---- the served API -------------------------------------------------------------------------------

def test_health_and_models(served):
    assert httpx.get(served.url + "/health").json()["status"] == "ok"  # no key needed
    models = served.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert served.client.models.retrieve(MODEL).id == MODEL


def test_chat_non_streaming_matches_engine(served):
    m = msgs("Tell me about hawks.")
    ref = served.reference(served.chat_ids(m), 24)
    r = served.client.chat.completions.create(model=MODEL, messages=m, temperature=0, max_tokens=24)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(served.chat_ids(m))
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streaming_matches_engine(served):
    m = [{"role": "system", "content": "Be brief."}, *msgs("Name a bird.")]
    ref = served.reference(served.chat_ids(m), 30)
    chunks = list(served.client.chat.completions.create(model=MODEL, messages=m, temperature=0,
                                                        max_completion_tokens=30, stream=True,
                                                        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [ref.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert chunks[-1].usage.prompt_tokens == len(served.chat_ids(m))
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # really streamed


def test_completions_text_and_token_prompts(served):
    prompt = "Once upon a time"
    ids = served.target.tokenizer.encode(prompt)
    ref = served.reference(ids, 20)
    r = served.client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=20)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(ref.token_ids))
    r2 = served.client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=20)
    assert r2.choices[0].text == ref.text
    chunks = list(served.client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=20,
                                                   stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_stop_sequences_match_engine(served):
    m = msgs("Write a list of colours.")
    ids = served.chat_ids(m)
    full = served.reference(ids, 40)
    assert full.finish_reason == "length" and len(full.text) > 30
    stop = full.text[12:18]  # spans token boundaries of the random model's output
    ref = served.reference(ids, 40, stop=[stop])
    assert ref.finish_reason == "stop" and stop not in ref.text
    r = served.client.chat.completions.create(model=MODEL, messages=m, temperature=0, max_tokens=40,
                                              stop=[stop, "never-appears"])
    assert r.choices[0].message.content == ref.text == full.text[:full.text.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(ref.token_ids) < 40
    chunks = list(served.client.chat.completions.create(model=MODEL, messages=m, temperature=0, max_tokens=40,
                                                        stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text


def test_seeded_sampling_matches_engine(served):
    m = msgs("Pick a number.")
    ref = served.reference(served.chat_ids(m), 16, temperature=0.8, seed=1234)
    r = served.client.chat.completions.create(model=MODEL, messages=m, temperature=0.8, seed=1234, max_tokens=16)
    assert r.choices[0].message.content == ref.text
    assert r.usage.completion_tokens == len(ref.token_ids)


# ---- shutdown -------------------------------------------------------------------------------------

class EndlessEngine:
    """Generates one token every 20 ms until told to stop: a request that is still running at shutdown."""

    def __init__(self, token: int):
        self.token, self.last_result = token, None

    def stream(self, input_ids, params):
        while True:
            time.sleep(0.02)
            yield [self.token]


class EndlessServer:
    def __init__(self, tokenizer):
        from eyas.serve.launch import make_server

        token = tokenizer("hello", add_special_tokens=False)["input_ids"][0]
        self.app = create_app(EndlessEngine(token), tokenizer, ServeConfig(model_name=MODEL, max_prompt_tokens=50))
        self.url, self.server, self.thread = serve_in_thread(
            make_server(self.app, log_level="warning", lifespan="on", timeout_graceful_shutdown=20))

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)


def test_shutdown_answers_queued_503_and_ends_stream(smollm2_tokenizer):
    """At SIGTERM (uvicorn's handle_exit sets should_exit) a running stream ends with an error event and
    [DONE], queued requests get a JSON 503, and neither waits out uvicorn's graceful-shutdown timeout."""
    srv = EndlessServer(smollm2_tokenizer)
    worker = srv.app.state.worker
    worker.max_short = 1  # one short request runs at a time: the next two wait to start
    body = {"model": MODEL, "prompt": "go", "max_tokens": 1000}
    events: list[str] = []
    results: dict[int, httpx.Response] = {}
    first_delta = threading.Event()

    def stream():
        with httpx.stream("POST", srv.url + COMPL, json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first_delta.set()

    def queued(i: int):
        results[i] = httpx.post(srv.url + COMPL, json=body, timeout=60)

    try:
        threads = [threading.Thread(target=stream)]
        threads[0].start()
        assert first_delta.wait(30), "the stream did not start"
        threads += [threading.Thread(target=queued, args=(i,)) for i in range(2)]
        for t in threads[1:]:
            t.start()
        deadline = time.time() + 30
        while worker._waiting < 2:
            assert time.time() < deadline, "the requests did not queue"
            time.sleep(0.01)
        srv.server.should_exit = True
        for t in threads:
            t.join(timeout=30)
        # answered by the drain (JSON 503 below), not by the 20 s grace-period cancel (a plain-text 500)
        for r in results.values():
            assert r.headers["content-type"].startswith("application/json"), r.text
            e = _err(r, 503)
            assert e["code"] == "shutting_down" and e["type"] == "server_error"
        assert len(results) == 2
        assert events[-1] == "[DONE]", events[-3:]
        err = json.loads(events[-2])["error"]
        assert err["code"] == "shutting_down" and "retry" in err["message"]
        assert json.loads(events[0])["choices"][0]["text"]  # it was a real stream before the cut
    finally:
        srv.close()
    # after the drain the worker refuses new jobs at once instead of queueing them behind a dead thread
    with pytest.raises(APIError) as ex:
        worker.submit(None)
    assert ex.value.status == 503 and ex.value.code == "shutting_down"


# a server process on a stub engine, started the way `eyas serve` starts one (exit_logged around launch.run)
SERVER_SCRIPT = """
from eyas.serve import launch
from eyas.serve.app import ServeConfig, create_app

class Tokenizer:  # what create_app needs of one without a target: a vocabulary size
    def __len__(self):
        return 100

class Engine:
    last_result = None

    def stream(self, input_ids, params):
        yield [1]

with launch.exit_logged():
    launch.run(create_app(Engine(), Tokenizer(), ServeConfig(model_name="stub")), "127.0.0.1", 0)
"""


def test_server_logs_its_exit_cause():
    """SIGTERM: the log names the signal when it arrives and when the process ends (by that signal, after the
    drain)."""
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", SERVER_SCRIPT], stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stderr:  # blocks per line; the process prints its startup, then waits
            lines.append(line)
            if "Uvicorn running on" in line:
                break
        assert any("Uvicorn running on" in x for x in lines), "".join(lines)
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=60)[1]
    finally:
        proc.kill()
    log = "".join(lines) + rest
    assert proc.returncode == -signal.SIGTERM, log
    assert "eyas serve: received SIGTERM: draining" in log and "eyas serve: stopped by SIGTERM" in log, log


def test_exit_logged_names_errors_and_statuses(capsys):
    """An exception: one line with its type, message and where it was raised (the traceback follows it); an
    exit status; a plain stop. A native crash prints every thread's stack: faulthandler is on (capsys' stderr has
    no file descriptor: it falls back to the real one)."""
    import faulthandler

    from eyas.serve.launch import exit_logged

    faulthandler.disable()

    def boom():
        raise RuntimeError("engine exploded")

    with pytest.raises(RuntimeError), exit_logged():
        boom()
    with pytest.raises(SystemExit), exit_logged():
        raise SystemExit(3)
    with exit_logged():
        assert faulthandler.is_enabled()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3, err
    assert err[0].startswith("eyas serve: stopped by an unexpected error: RuntimeError: engine exploded (at ") and \
        "test_server.py:" in err[0] and err[0].endswith(" in boom)"), err[0]
    assert err[1:] == ["eyas serve: exiting with status 3 (the error above)", "eyas serve: stopped"]


def test_tokenizing_does_not_wait_for_the_engine(smollm2_tokenizer):
    """While the engine is busy with an endless generation, other requests still tokenize: a too-long prompt
    gets its 400 at once rather than after the running generation."""
    srv = EndlessServer(smollm2_tokenizer)
    try:
        with httpx.stream("POST", srv.url + COMPL, json={"model": MODEL, "prompt": "go", "stream": True,
                                                          "max_tokens": 1000}, timeout=60) as r:
            next(line for line in r.iter_lines() if line.startswith("data: "))
            # the endless generation never ends on its own: an answer at all proves tokenizing did not wait for it
            e = _err(httpx.post(srv.url + CHAT, json={"model": MODEL, "messages": msgs("word " * 100)},
                                timeout=60), 400)
            assert e["code"] == "context_length_exceeded"
    finally:
        srv.close()


# ---- concurrency ----------------------------------------------------------------------------------

def test_interleaved_long_and_short_prompts_match_engine(served, monkeypatch):
    """Long prompts prefilled in chunks of 16 while short ones start between their chunks and all of them decode
    in turn, greedy and seeded: each answer is the one Engine.generate gives the request alone."""
    served.wait_idle()
    monkeypatch.setattr(served.engine, "prefill_chunk", 16)
    monkeypatch.setattr(served.app.state.worker, "long_prompt", 16)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    texts = [" ".join(words[(i + j) % 10] for j in range(n)) for i, n in enumerate((90, 70, 60, 3, 2, 4))]
    temps = [0.0, 0.8, 0.0, 0.8, 0.0, 0.0]

    def ask(i: int):
        return served.client.completions.create(model=MODEL, prompt=texts[i], max_tokens=12, temperature=temps[i],
                                                seed=i)

    with ThreadPoolExecutor(len(texts)) as pool:
        answers = list(pool.map(ask, range(len(texts))))
    assert served.metric("eyas_generations_started_total") > 0
    for i, r in enumerate(answers):
        ids = served.target.tokenizer.encode(texts[i])
        ref = served.reference(ids, 12, temperature=temps[i], seed=i)
        assert (r.choices[0].text, r.usage.prompt_tokens) == (ref.text, len(ids)), f"request {i}"
    assert max(len(served.target.tokenizer.encode(t)) for t in texts) > 3 * 16  # the long ones took chunks


@pytest.mark.slow
def test_load_50_requests_8_clients_match_engine(served):
    """50 greedy requests (chat/completions x stream/non-stream) from 8 concurrent clients: zero errors and
    every output equal to Engine.generate for the same request (so no two requests' tokens ever mix)."""
    n_req, n_clients = 50, 8
    reqs = []
    for i in range(n_req):
        kind, stream, mt = ("chat", "completion")[i % 2], bool(i // 2 % 2), 4 + 2 * (i % 5)
        text = f"Request {i}: describe the number {i * 7919 % 1000} in a few words."
        reqs.append((i, kind, stream, mt, text))
    results: dict[int, tuple[str, int, int, str]] = {}
    errors: list[str] = []

    async def one(client, i, kind, stream, mt, text):
        if kind == "chat":
            kw = dict(model=MODEL, messages=msgs(text), temperature=0, max_tokens=mt)
            if stream:
                out, usage, fin = "", None, None
                async for c in await client.chat.completions.create(**kw, stream=True,
                                                                    stream_options={"include_usage": True}):
                    if c.choices:
                        out += c.choices[0].delta.content or ""
                        fin = c.choices[0].finish_reason or fin
                    usage = c.usage or usage
                return out, usage.prompt_tokens, usage.completion_tokens, fin
            r = await client.chat.completions.create(**kw)
            return r.choices[0].message.content, r.usage.prompt_tokens, r.usage.completion_tokens, \
                r.choices[0].finish_reason
        kw = dict(model=MODEL, prompt=text, temperature=0, max_tokens=mt)
        if stream:
            out, usage, fin = "", None, None
            async for c in await client.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
                if c.choices:
                    out += c.choices[0].text
                    fin = c.choices[0].finish_reason or fin
                usage = c.usage or usage
            return out, usage.prompt_tokens, usage.completion_tokens, fin
        r = await client.completions.create(**kw)
        return r.choices[0].text, r.usage.prompt_tokens, r.usage.completion_tokens, r.choices[0].finish_reason

    async def main():
        pending = list(reqs)

        async def client_loop():
            async with openai.AsyncOpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0,
                                          timeout=300) as client:
                while pending:
                    i, *rest = pending.pop(0)
                    try:
                        results[i] = await one(client, i, *rest)
                    except Exception as e:  # collected: the assertion below lists them all
                        errors.append(f"request {i}: {type(e).__name__}: {e}")

        await asyncio.gather(*(client_loop() for _ in range(n_clients)))

    done_before = served.metric('eyas_requests_finished_total{endpoint="/v1/c')
    asyncio.run(main())
    assert errors == []
    assert len(results) == n_req
    for i, kind, _stream, mt, text in reqs:
        ids = served.chat_ids(msgs(text)) if kind == "chat" else served.target.tokenizer.encode(text)
        ref = served.reference(ids, mt)
        assert results[i] == (ref.text, len(ids), len(ref.token_ids), ref.finish_reason), f"request {i}"
    assert served.metric('eyas_requests_finished_total{endpoint="/v1/c') - done_before == n_req
    assert served.metric("eyas_spec_rounds_total") > 0 and served.metric("eyas_spec_tau") >= 1.0
    assert served.metric('eyas_spec_proposed_tokens_total{depth="1"}') > 0


def test_disconnect_cancels_generation(served, monkeypatch):
    """A client that leaves mid-stream stops its generation at the next round; a queued one never starts."""
    monkeypatch.setattr(served.app.state.worker, "max_short", 1)  # the second request waits behind the first
    served.wait_idle()
    cancelled0 = served.metric('eyas_requests_finished_total{endpoint="/v1/completions",finish_reason="cancelled"}')
    started0, tokens0 = served.metric("eyas_generations_started_total"), served.metric("eyas_worker_tokens_total")
    body = {"model": MODEL, "prompt": "Count forever:", "max_tokens": MAX_NEW, "temperature": 0, "stream": True}
    ref = served.reference(served.target.tokenizer.encode("Count forever:"), 64)
    assert ref.finish_reason == "length"  # the request would run on (no early EOS)
    with httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as running:
            lines = running.iter_lines()
            next(line for line in lines if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"])
            with c.stream("POST", "/v1/completions", json=body) as queued:
                assert queued.status_code == 200  # headers sent; it waits in the queue behind `running`
            # leaving the `with` closed the queued stream's connection; now leave the running one too
    deadline = time.time() + 60
    while served.metric('eyas_requests_finished_total{endpoint="/v1/completions",finish_reason="cancelled"}') \
            < cancelled0 + 2:
        assert time.time() < deadline, "the disconnected requests were not cancelled"
        time.sleep(0.05)
    served.wait_idle()
    assert served.metric("eyas_generations_started_total") - started0 == 1  # the queued one never ran
    assert served.metric("eyas_worker_tokens_total") - tokens0 < MAX_NEW  # the running one stopped early

    # a non-streaming client that leaves while its request runs
    tokens0 = served.metric("eyas_worker_tokens_total")
    payload = json.dumps({k: v for k, v in body.items() if k != "stream"}).encode()
    raw = socket.create_connection(("127.0.0.1", int(served.url.rsplit(":", 1)[1])))
    raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer " + KEY.encode() +
                b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(payload)).encode() +
                b"\r\n\r\n" + payload)
    deadline = time.time() + 60
    while served.metric("eyas_generations_started_total") - started0 < 2:
        assert time.time() < deadline, "the non-streaming request did not start"
        time.sleep(0.02)
    raw.close()
    while served.metric('eyas_requests_finished_total{endpoint="/v1/completions",finish_reason="cancelled"}') \
            < cancelled0 + 3:
        assert time.time() < deadline, "the disconnected non-streaming request was not cancelled"
        time.sleep(0.05)
    served.wait_idle()
    assert served.metric("eyas_worker_tokens_total") - tokens0 < MAX_NEW
    assert served.client.completions.create(model=MODEL, prompt="x", max_tokens=3).usage.completion_tokens >= 1


# ---- the real bundled target ----------------------------------------------------------------------

@pytest.mark.integration
def test_real_target_served_equals_engine(smollm2):
    """SmolLM2-135M with an untrained EAGLE-3 draft (the real layout [2, 15, 27]) served: streamed greedy chat
    equals Engine.generate, usage exact."""
    from eyas.draft import random_draft

    spec = SpecParams(method="chain", steps=2)
    engine = Engine(smollm2, random_draft(smollm2, draft_vocab=2048), spec)
    ref_engine = Engine(smollm2, random_draft(smollm2, draft_vocab=2048), spec)
    app = create_app(engine, smollm2.tokenizer, ServeConfig(model_name="smollm2", max_new_tokens=64,
                                                            context_length=smollm2.config.max_position_embeddings))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 60
        while not server.started:
            assert thread.is_alive() and time.time() < deadline
            time.sleep(0.05)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        m = msgs("What is a hawk?")
        chunks = list(client.chat.completions.create(model="smollm2", messages=m, temperature=0, max_tokens=12,
                                                     stream=True, stream_options={"include_usage": True}))
        ids = chat_input_ids(smollm2.tokenizer, m)
        with ThreadPoolExecutor(1) as pool:
            ref = pool.submit(ref_engine.generate, ids, SamplingParams(max_new_tokens=12)).result()
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
        assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (len(ids), len(ref.token_ids))
        assert ref.text.strip()  # a real reply
    finally:
        server.should_exit = True
        thread.join(timeout=30)
