"""`eyas serve` and clients that stop talking: one that half-closes after its request (it still reads) gets its
whole answer and a log line, whatever its HTTP version; one that is gone mid-prefill has its request dropped between
two prefill chunks (a metric and a log line), not when its first token cannot be sent. The real server
(eyas.serve.launch.make_server: the connection protocol of eyas.serve.bounds) over a tiny random Llama, driven by raw
sockets and by a client process that is killed."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import h11
import httpx
import pytest

from eyas.engine.decode import Engine
from eyas.engine.params import SpecParams
from eyas.serve import bounds
from eyas.serve.app import ServeConfig, create_app
from eyas.serve.launch import make_server
from tests.serving import chat_target, serve_in_thread

MODEL = "tiny-clients"
CHUNK = 16  # the smallest prefill chunk the server takes: a long prompt is many chunks
CHUNK_S = 0.1  # each prefill chunk also sleeps this long, so a 1600-token prefill takes 10 s however fast the CPU
CHAT, COMPL = "/v1/chat/completions", "/v1/completions"


class SlowPrefill(Engine):
    """The engine with a floor on each prefill chunk's time; it records, per generation, the prompt's length and
    the chunks it ran, so a test can tell how far a prefill got before it was dropped."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.runs: list[dict] = []

    def stream(self, input_ids, params=None):
        inner = super().stream(input_ids, params)  # validates now, as Engine.stream does
        run = {"prompt": len(input_ids), "chunks": 0, "ended": False}
        self.runs.append(run)
        return self._slowed(inner, run)

    @staticmethod
    def _slowed(inner: Iterator[list[int]], run: dict) -> Iterator[list[int]]:
        try:
            for ids in inner:
                if not ids:
                    run["chunks"] += 1
                    time.sleep(CHUNK_S)
                yield ids
        finally:
            inner.close()
            run["ended"] = True


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def lines(self) -> list[str]:
        return [r.getMessage() for r in self.records]


class Served:
    def __init__(self, target):
        self.engine = SlowPrefill(target, None, SpecParams(method="plain"))
        cfg = ServeConfig(model_name=MODEL, max_prompt_tokens=3000, max_new_tokens=64, prefill_chunk=CHUNK,
                          context_length=target.config.max_position_embeddings)
        self.app = create_app(self.engine, target.tokenizer, cfg)
        self.metrics = self.app.state.metrics
        url, self.server, self.thread = serve_in_thread(
            make_server(self.app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2))
        self.port = int(url.rsplit(":", 1)[1])
        self.http = httpx.Client(base_url=url, timeout=120)

    def wait_idle(self) -> None:
        deadline = time.time() + 60
        while self.metrics.get("eyas_requests_running") or self.metrics.get("eyas_queue_depth"):
            assert time.time() < deadline, "the engine worker did not become idle"
            time.sleep(0.05)

    def close(self) -> None:
        self.http.close()
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def served(smollm2_tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("clients")
    s = Served(chat_target(smollm2_tokenizer, root / "target", layers=2, context=4096))
    yield s
    s.close()


@pytest.fixture
def logs(monkeypatch):
    """What the server logs at INFO: its own lines (eyas.server) and uvicorn's access lines, which the
    warning-level test server would drop."""
    rec = Records()
    for name in ("eyas.server", "uvicorn.access"):
        logger = logging.getLogger(name)
        monkeypatch.setattr(logger, "level", logging.INFO)
        logger.addHandler(rec)
    yield rec
    for name in ("eyas.server", "uvicorn.access"):
        logging.getLogger(name).removeHandler(rec)


def request_bytes(path: str, body: dict, version: str = "1.1", close: bool = False) -> bytes:
    payload = json.dumps(body).encode()
    head = f"POST {path} HTTP/{version}\r\nHost: x\r\nContent-Type: application/json\r\n"
    if close:
        head += "Connection: close\r\n"
    return (head + f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload


def parse_response(data: bytes) -> tuple[int, int, bytes]:
    """-> (interim 1xx responses, status, body) of the one response in `data` (read until the server closed)."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="POST", target="/", headers=[("Host", "x"), ("Content-Length", "0")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(data)
    conn.receive_data(b"")
    interim, status, body = 0, 0, b""
    while True:
        ev = conn.next_event()
        if isinstance(ev, h11.InformationalResponse):
            interim += 1
        elif isinstance(ev, h11.Response):
            status = ev.status_code
        elif isinstance(ev, h11.Data):
            body += ev.data
        else:
            assert isinstance(ev, h11.EndOfMessage), (ev, data[-300:])
            return interim, status, body


def streamed_text(body: bytes, kind: str) -> str:
    """The text of an SSE answer (keep-alive comments skipped, as clients skip them); it must end in [DONE]."""
    events = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", body[-300:]
    choices = [json.loads(e)["choices"][0] for e in events[:-1]]
    return "".join((c["delta"].get("content") or "") if kind == "chat" else c["text"] for c in choices)


def body_for(path: str, prompt: str | list[int], stream: bool, max_tokens: int) -> dict:
    body: dict = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


# ---- a client that half-closes ---------------------------------------------------------------------------------

@pytest.mark.parametrize("path", [COMPL, CHAT], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("version, close", [("1.0", False), ("1.1", True), ("1.1", False)],
                         ids=["HTTP/1.0", "HTTP/1.1 close", "HTTP/1.1 keep-alive"])
def test_half_closed_client_gets_its_answer_in_every_http_version(served, logs, monkeypatch, path, stream, version,
                                                                  close):
    """A request, then shutdown(SHUT_WR): before, only a keep-alive HTTP/1.1 request was answered; one that closes
    the connection (HTTP/1.0, or 'Connection: close') got 0 bytes and nothing was logged (h11 marks such a request
    MUST_CLOSE, not DONE, and its end of input was taken for a disconnect). Now each gets the answer a client that
    kept its side open gets, the access line and the server's half-close line; an HTTP/1.0 client no 1xx probe."""
    monkeypatch.setattr(bounds, "PROBE_S", 0.05)
    served.wait_idle()
    prompt = "The hawk flew over the"
    expected = served.http.post(path, json=body_for(path, prompt, False, 12)).json()
    sock = socket.create_connection(("127.0.0.1", served.port))
    port = sock.getsockname()[1]
    try:
        sock.sendall(request_bytes(path, body_for(path, prompt, stream, 12), version, close))
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(60)
        data = b""
        while got := sock.recv(65536):
            data += got
    finally:
        sock.close()
    assert data, "the half-closed client got no answer"
    interim, status, body = parse_response(data)
    assert status == 200, data[:300]
    if version == "1.0":
        assert interim == 0, data[:300]  # RFC 9110 15.2: no 1xx to an HTTP/1.0 client
    kind = "chat" if path == CHAT else "text"
    want = expected["choices"][0]["message"]["content"] if path == CHAT else expected["choices"][0]["text"]
    if stream:
        assert streamed_text(body, kind) == want
    else:
        answer = json.loads(body)
        assert answer["usage"] == expected["usage"]
        assert (answer["choices"][0]["message"]["content"] if path == CHAT else answer["choices"][0]["text"]) == want
    deadline = time.time() + 10
    while not any(f":{port}" in line and path in line for line in logs.lines()):
        assert time.time() < deadline, logs.lines()
        time.sleep(0.02)
    mine = [line for line in logs.lines() if f":{port}" in line]
    assert any(f'"POST {path} HTTP/{version}" 200' in line for line in mine), mine  # the access line
    assert any("ended its input after its request" in line for line in mine), mine


# ---- a client that is gone while its prompt prefills ------------------------------------------------------------

# The client process: it sends the request, reports the response's status line, then reads everything the server
# sends until it is killed (so it dies with nothing unread: its kernel sends a FIN, as a half-closed client's does,
# not a reset the server would notice at once).
CLIENT = r"""
import socket, sys
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
sock.sendall(sys.stdin.buffer.read())
data = b""
while b"\r\n\r\n" not in data:
    data += sock.recv(65536)
print(data.split(b"\r\n")[0].decode(), flush=True)
while sock.recv(65536):
    pass
"""


@pytest.mark.parametrize("path", [COMPL, CHAT], ids=["completions", "chat"])
def test_stream_whose_client_is_killed_is_dropped_during_prefill(served, logs, monkeypatch, path):
    """A streaming request with a ~1600-token prompt (100 chunks of 16, >= 10 s of prefill here) whose client
    process is killed after 2 chunks: before, the server kept the slot and prefilled the whole prompt (its socket in
    CLOSE-WAIT) and cancelled only when the first token could not be sent. Now it is dropped a few chunks after the
    kill, counted in eyas_requests_abandoned_total{phase="prefill"} and logged; the slot is free and the server
    serves the next request."""
    monkeypatch.setattr(bounds, "PROBE_S", 0.1)
    served.wait_idle()
    labels = {"endpoint": path, "phase": "prefill"}
    abandoned0 = served.metrics.get("eyas_requests_abandoned_total", **labels)
    prompt: str | list[int] = " ".join(["hawk"] * 1600) if path == CHAT else [500 + i % 1000 for i in range(1600)]
    runs0 = len(served.engine.runs)
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, str(served.port)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=False)
    try:
        proc.stdin.write(request_bytes(path, body_for(path, prompt, True, 8)))
        proc.stdin.close()
        assert proc.stdout.readline().startswith(b"HTTP/1.1 200"), "the stream did not start"
        deadline = time.time() + 60
        while len(served.engine.runs) == runs0 or served.engine.runs[-1]["chunks"] < 2:
            assert time.time() < deadline, "the prefill did not start"
            time.sleep(0.02)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    run = served.engine.runs[-1]
    total = -(-run["prompt"] // CHUNK) - 1  # the chunks its whole prefill runs (engine: one yield between two)
    assert run["prompt"] > 1000 and total >= 60, run
    deadline = time.time() + 60
    while not run["ended"]:
        assert time.time() < deadline, f"the abandoned stream's generation ran on: {run}"
        time.sleep(0.05)
    assert run["chunks"] < total // 2, f"{run['chunks']} of {total} prefill chunks ran for a client killed after 2"
    served.wait_idle()  # its slot is free
    assert served.metrics.get("eyas_requests_abandoned_total", **labels) == abandoned0 + 1
    assert any(f"{path} request" in line and "left during its prefill" in line for line in logs.lines()), logs.lines()
    assert "eyas_requests_abandoned_total" in served.http.get("/metrics").text
    ok = served.http.post(COMPL, json=body_for(COMPL, "x", False, 2))
    assert ok.status_code == 200, ok.text
