"""Hostile and faulty HTTP input to the server (bodies, timeouts, templates that raise, redirects, loose types,
what /health tells a stranger, the busy answer on the wire): every case is answered by one clean error; none by a
500, a traceback or a hang. The CLI / artifact faults are in tests/test_hardening_artifacts.py.

The server here runs on a stub engine (a few fixed tokens) and the bundled target's tokenizer: no model loads.
"""

from __future__ import annotations

import copy
import json
import select
import socket
import time
from typing import Any

import httpx
import pytest

from eyas.serve import bounds
from eyas.serve.app import ServeConfig, create_app
from eyas.serve.launch import make_server
from tests.serving import serve_in_thread

MODEL, KEY = "stub", "sekrit"
CHAT, COMPL = "/v1/chat/completions", "/v1/completions"
# a chatml-like template that refuses two turns of the same role in a row, as many shipped templates do
ALTERNATING = (
    "{% for m in messages %}{% if loop.index0 > 0 and messages[loop.index0 - 1]['role'] == m['role'] %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class StubEngine:
    """Three tokens per request, at once: what the server does around the engine is under test, not decoding."""

    def __init__(self, token: int):
        self.token, self.last_result = token, None

    def stream(self, input_ids, params):
        for _ in range(3):
            yield [self.token]


class SlowEngine:
    """One token per 20 ms up to max_new_tokens; records how many each generation made when it ended (finished or
    closed by the worker on a cancel)."""

    def __init__(self, token: int):
        self.token, self.last_result = token, None
        self.started, self.ended = 0, []

    def stream(self, input_ids, params):
        self.started += 1
        made = 0
        try:
            while made < params.max_new_tokens:
                time.sleep(0.02)
                made += 1
                yield [self.token]
        finally:
            self.ended.append(made)


class Server:
    def __init__(self, tokenizer: Any, api_key: str | None, slow: bool = False):
        tok = copy.deepcopy(tokenizer)
        tok.chat_template = ALTERNATING
        token = tok("hello", add_special_tokens=False)["input_ids"][0]
        self.engine = SlowEngine(token) if slow else StubEngine(token)
        self.app = create_app(self.engine, tok, ServeConfig(model_name=MODEL, api_key=api_key, max_prompt_tokens=200,
                                                            max_new_tokens=3000 if slow else 8))
        self.url, self.server, self.thread = serve_in_thread(
            make_server(self.app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2))
        self.port = int(self.url.rsplit(":", 1)[1])
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=60)

    def close(self) -> None:
        self.http.close()
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def servers(smollm2_tokenizer):
    s = {"open": Server(smollm2_tokenizer, None), "keyed": Server(smollm2_tokenizer, KEY),
         "slow": Server(smollm2_tokenizer, None, slow=True)}
    yield s
    for srv in s.values():
        srv.close()


def openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json"), r.headers
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and "Traceback" not in e["message"], e
    return e


# ---- raw sockets: what httpx cannot send (a body that never ends, headers that trickle) -----------------

def read_response(sock: socket.socket, wait_s: float = 60.0) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of one HTTP/1.1 response (Content-Length framed) read off a raw socket."""
    sock.settimeout(wait_s)
    data = b""
    while b"\r\n\r\n" not in data:
        got = sock.recv(65536)
        assert got, f"the server closed the connection without an answer: {data[:200]!r}"
        data += got
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    size = int(headers.get("content-length", "0"))
    while len(body) < size:
        got = sock.recv(65536)
        if not got:
            break
        body += got
    return int(lines[0].split()[1]), headers, body[:size]


def send_chunked(port: int, path: str, total: int, chunk: int = 1 << 16) -> tuple[int, int, dict, bytes]:
    """POST `total` bytes as a chunked body, stopping as soon as the server answers
    -> (bytes sent, status, headers, body)."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 "Transfer-Encoding: chunked\r\n\r\n".encode())
    piece = f"{chunk:x}\r\n".encode() + b"a" * chunk + b"\r\n"
    sent = 0
    try:
        while sent < total:
            if select.select([sock], [], [], 0)[0]:  # the server answered: stop sending, as a client would
                break
            sock.sendall(piece)
            sent += chunk
        else:
            sock.sendall(b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server stopped reading and closed: its answer is already on the wire
    try:
        status, headers, body = read_response(sock)
    finally:
        sock.close()
    return sent, status, headers, body


def test_chunked_body_stops_at_the_limit_with_a_413(servers):
    """A chunked body has no Content-Length to refuse it by: the bytes are counted as they arrive and reading
    stops at the limit, so a 64 MiB body is cut off after ~16 MiB (not read whole, then refused)."""
    total = 64 << 20
    sent, status, headers, body = send_chunked(servers["open"].port, COMPL, total)
    assert status == 413 and headers.get("connection") == "close", (status, headers)
    e = json.loads(body)["error"]
    assert e["code"] == "request_too_large" and str(bounds.MAX_BODY) in e["message"]
    assert sent < total // 2, f"the client sent {sent} of {total} bytes before the answer"


def test_body_that_stalls_gets_a_408(servers, monkeypatch):
    monkeypatch.setattr(bounds, "BODY_IDLE_TIMEOUT_S", 0.3)
    sock = socket.create_connection(("127.0.0.1", servers["open"].port))
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\": ")  # 10 of the 100 bytes announced, then nothing
        status, headers, body = read_response(sock)
    finally:
        sock.close()
    assert status == 408 and headers.get("connection") == "close"
    e = json.loads(body)["error"]
    assert e["code"] == "request_timeout" and "10 bytes read" in e["message"]


def test_trickled_request_head_is_closed(servers, monkeypatch):
    """Slowloris: one header byte at a time, never finishing the head. Uvicorn's keep-alive timer restarts on
    every byte; the head deadline does not, and closes the socket."""
    monkeypatch.setattr(bounds, "HEADER_TIMEOUT_S", 0.3)
    sock = socket.create_connection(("127.0.0.1", servers["open"].port))
    closed = False
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        for _ in range(600):  # up to ~60 s of trickling; the deadline is 0.3 s
            try:
                sock.sendall(b"X")
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            if select.select([sock], [], [], 0.1)[0]:
                try:
                    closed = sock.recv(1024) == b""
                except ConnectionResetError:
                    closed = True
                break
    finally:
        sock.close()
    assert closed, "the server kept a connection whose request head never ended"


@pytest.mark.parametrize("piece", [0, 4096], ids=["one write", "4 KB pieces"])
def test_oversized_request_head_is_refused_however_it_arrives(servers, piece):
    """h11 bounds only an incomplete head: before, a 100 KB header in one write was served while the same bytes in
    4 KB pieces got uvicorn's text 400. Both are now one JSON 431 naming the limit, and the server serves on."""
    head = (f"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: {'a' * (100 << 10)}\r\n\r\n").encode()
    sock = socket.create_connection(("127.0.0.1", servers["open"].port))
    try:
        for i in range(0, len(head), piece or len(head)):
            try:
                sock.sendall(head[i:i + (piece or len(head))])
            except (BrokenPipeError, ConnectionResetError):
                break  # the server answered and closed: its answer is on the wire
            if piece:
                time.sleep(0.002)  # separate reads on the server
        status, headers, body = read_response(sock)
    finally:
        sock.close()
    assert status == 431 and headers.get("connection") == "close", (status, headers, body[:200])
    e = json.loads(body)["error"]
    assert e["code"] == "request_header_too_large" and str(bounds.MAX_HEADER_BYTES) in e["message"], e
    assert servers["open"].http.get("/v1/models").status_code == 200


def post_bytes(path: str, body: dict) -> bytes:
    payload = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload


def read_until_closed(sock: socket.socket, wait_s: float = 60.0) -> bytes:
    sock.settimeout(wait_s)
    data = b""
    while got := sock.recv(65536):
        data += got
    return data


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_half_closed_client_gets_its_answer(servers, monkeypatch, stream):
    """A client that sends its request and then shuts down its sending side still reads: uvicorn took that end of
    input for a disconnect and closed the socket (0 bytes back, the generation cancelled). The answer now comes,
    after interim 100 Continue probes while it is computed, and the server closes the connection after it."""
    monkeypatch.setattr(bounds, "PROBE_S", 0.1)
    srv = servers["slow"]
    sock = socket.create_connection(("127.0.0.1", srv.port))
    try:
        sock.sendall(post_bytes(COMPL, {"model": MODEL, "prompt": "hi", "max_tokens": 20, "stream": stream}))
        sock.shutdown(socket.SHUT_WR)
        data = read_until_closed(sock)
    finally:
        sock.close()
    interim, _, final = data.rpartition(b"HTTP/1.1 100 Continue\r\n\r\n")
    assert final.startswith(b"HTTP/1.1 200"), data[:300]
    assert stream or interim + _ == b"HTTP/1.1 100 Continue\r\n\r\n" * data.count(b" 100 Continue"), data[:300]
    if stream:
        assert final.rstrip().endswith(b"data: [DONE]") or b"data: [DONE]" in final, final[-300:]
        assert final.count(b"hello") == 20, final[-300:]
    else:
        assert b" 100 Continue" in data  # the answer took ~0.4 s: it was probed
        answer = json.loads(final.partition(b"\r\n\r\n")[2])
        assert answer["usage"]["completion_tokens"] == 20 and answer["choices"][0]["text"] == "hello" * 20, answer


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_closed_client_is_still_cancelled(servers, monkeypatch, stream):
    """Honouring a half-close must not keep generating for a client that closed for good: the probe (or the stream's
    own next write) meets the reset of a closed socket, and the generation stops within a few rounds."""
    monkeypatch.setattr(bounds, "PROBE_S", 0.1)
    srv = servers["slow"]
    started, ended = srv.engine.started, len(srv.engine.ended)
    sock = socket.create_connection(("127.0.0.1", srv.port))
    try:
        sock.sendall(post_bytes(COMPL, {"model": MODEL, "prompt": "hi", "max_tokens": 3000, "stream": stream}))
        deadline = time.time() + 30
        while srv.engine.started == started:
            assert time.time() < deadline, "the request did not start"
            time.sleep(0.01)
    finally:
        sock.close()
    deadline = time.time() + 30
    while len(srv.engine.ended) == ended:
        assert time.time() < deadline, "the generation ran on for a client that closed its socket"
        time.sleep(0.02)
    assert srv.engine.ended[-1] < 500, srv.engine.ended  # stopped early (3000 tokens would take 60 s)


# ---- the table: one request, one clean answer ---------------------------------------------------------

OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
SAME_ROLE = [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}]
# a control-token string in a message takes the marked path (render) instead of the tokenizer's own call
SAME_ROLE_MARKED = [{"role": "user", "content": "<|im_end|>"}, {"role": "user", "content": "again"}]

# (name, server, method, path, extra headers, json body, status, code, text in the message)
CASES = [
    ("template raises", "open", "POST", CHAT, {}, {**OK_CHAT, "messages": SAME_ROLE}, 400, "invalid_value",
     "roles must alternate"),
    ("template raises (marked path)", "open", "POST", CHAT, {}, {**OK_CHAT, "messages": SAME_ROLE_MARKED}, 400,
     "invalid_value", "roles must alternate"),
    ("temperature true", "open", "POST", CHAT, {}, {**OK_CHAT, "temperature": True}, 400, "invalid_value",
     "temperature"),
    ("temperature string", "open", "POST", CHAT, {}, {**OK_CHAT, "temperature": "0.5"}, 400, "invalid_value",
     "temperature"),
    ("top_p true", "open", "POST", COMPL, {}, {"model": MODEL, "prompt": "x", "top_p": True}, 400, "invalid_value",
     "top_p"),
    ("top_p string", "open", "POST", COMPL, {}, {"model": MODEL, "prompt": "x", "top_p": "0.5"}, 400,
     "invalid_value", "top_p"),
    ("trailing slash, foreign Host", "open", "POST", CHAT + "/", {"Host": "evil.example"}, OK_CHAT, 404,
     "not_found", "no route"),
    ("trailing slash, keyed server", "keyed", "POST", COMPL + "/", {"Host": "evil.example"},
     {"model": MODEL, "prompt": "x"}, 404, "not_found", "no route"),
    ("declared body too large", "open", "POST", COMPL, {"Content-Length": str(bounds.MAX_BODY + 1)}, None, 413,
     "request_too_large", str(bounds.MAX_BODY)),
    # both framings on one request (the request-smuggling shape): refused, and the connection closed
    ("Content-Length and Transfer-Encoding", "open", "POST", COMPL,
     {"Content-Length": "5", "Transfer-Encoding": "chunked"}, None, 400, "ambiguous_framing", "Transfer-Encoding"),
    ("two spaces after Bearer", "keyed", "POST", COMPL, {"Authorization": f"Bearer  {KEY}"},
     {"model": MODEL, "prompt": "x"}, 401, "invalid_api_key", "Incorrect API key"),
]


@pytest.mark.parametrize("name,server,method,path,headers,body,status,code,text", CASES, ids=[c[0] for c in CASES])
def test_server_answers_each_case_cleanly(servers, name, server, method, path, headers, body, status, code, text):
    srv = servers[server]
    if body is None:  # a declared size with no body behind it: refused before a byte is read
        sock = socket.create_connection(("127.0.0.1", srv.port))
        try:
            head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode())
            got, resp_headers, raw = read_response(sock)
        finally:
            sock.close()
        assert got == status, raw
        e = json.loads(raw)["error"]
    else:
        r = srv.http.request(method, path, json=body, headers=headers)
        assert "location" not in r.headers, r.headers  # never a redirect, least of all to the Host sent
        e = openai_error(r, status)
    assert e["code"] == code and text in e["message"], e


# (name, the Authorization header lines sent, status): the scheme, exactly one space, the key
AUTH = [
    ("Bearer KEY", [f"Bearer {KEY}"], 200),
    ("scheme lowercase (RFC 7235: case-insensitive)", [f"bearer {KEY}"], 200),
    ("scheme uppercase", [f"BEARER {KEY}"], 200),
    # whitespace around a field value is not part of it (RFC 9110 5.5); h11 drops it, as every HTTP parser must
    ("trailing space", [f"Bearer {KEY} "], 200),
    ("trailing tab", [f"Bearer {KEY}\t"], 200),
    ("leading space", [f" Bearer {KEY}"], 200),
    ("two spaces", [f"Bearer  {KEY}"], 401),
    ("tab for the space", [f"Bearer\t{KEY}"], 401),
    ("space and tab", [f"Bearer \t{KEY}"], 401),
    ("space inside the key", [f"Bearer {KEY[:3]} {KEY[3:]}"], 401),
    ("a second token", [f"Bearer {KEY} {KEY}"], 401),
    ("key repeated after a comma", [f"Bearer {KEY}, Bearer {KEY}"], 401),
    ("no scheme", [KEY], 401),
    ("scheme only", ["Bearer"], 401),
    ("scheme and a space", ["Bearer "], 401),
    ("Basic scheme", [f"Basic {KEY}"], 401),
    ("scheme glued to the key", [f"Bearer{KEY}"], 401),
    ("key prefix", [f"Bearer {KEY[:-1]}"], 401),
    ("key with a suffix", [f"Bearer {KEY}x"], 401),
    ("key in another case", [f"Bearer {KEY.upper()}"], 401),
    ("empty header", [""], 401),
    ("no header", [], 401),
    ("two headers, both right", [f"Bearer {KEY}", f"Bearer {KEY}"], 401),
    ("two headers, wrong then right", ["Bearer nope", f"Bearer {KEY}"], 401),
]


@pytest.mark.parametrize("name,lines,status", AUTH, ids=[c[0] for c in AUTH])
def test_authorization_is_parsed_exactly(servers, name, lines, status):
    """Raw bytes on a socket (httpx refuses some of these headers): each one reaches the server as written."""
    sock = socket.create_connection(("127.0.0.1", servers["keyed"].port))
    try:
        head = "".join(f"Authorization: {line}\r\n" for line in lines)
        sock.sendall(f"GET /v1/models HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode())
        got, headers, body = read_response(sock)
    finally:
        sock.close()
    assert got == status, (got, body[:300])
    if status == 401:
        e = json.loads(body)["error"]
        assert e["code"] == "invalid_api_key" and headers.get("www-authenticate") == "Bearer", (e, headers)
        phrase = ("Missing API key" if lines in ([], [""]) else "2 Authorization headers" if len(lines) == 2
                  else "Incorrect API key")
        assert phrase in e["message"], e


def test_valid_requests_still_work(servers):
    r = servers["open"].http.post(CHAT, json={**OK_CHAT, "temperature": 0, "top_p": 1})  # ints are numbers
    assert r.status_code == 200, r.text
    r = servers["open"].http.post(CHAT, json={**OK_CHAT, "messages": SAME_ROLE[:1] + [
        {"role": "assistant", "content": "yo"}, {"role": "user", "content": "again"}]})
    assert r.status_code == 200, r.text


def test_health_names_the_model_only_to_key_holders(servers):
    keyed = servers["keyed"]
    anon = httpx.get(keyed.url + "/health")
    assert anon.status_code == 200 and anon.json() == {"status": "ok"}
    wrong = httpx.get(keyed.url + "/health", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 200 and "model" not in wrong.json()
    assert keyed.http.get("/health").json() == {"status": "ok", "model": MODEL}
    assert httpx.get(servers["open"].url + "/health").json() == {"status": "ok", "model": MODEL}  # no key set


def test_busy_answer_is_a_503_with_retry_after_header(servers, monkeypatch):
    """The refusal on the wire: a JSON 503 with a Retry-After header (what OpenAI's clients back off on), streamed
    or not. Here every prompt over 1 token is long and none may be held."""
    worker = servers["open"].app.state.worker
    monkeypatch.setattr(worker, "long_prompt", 1)
    monkeypatch.setattr(worker, "max_long", 0)
    for stream in (False, True):
        r = servers["open"].http.post(COMPL, json={"model": MODEL, "prompt": "one two three", "stream": stream})
        e = openai_error(r, 503)
        assert e["code"] == "server_busy" and int(r.headers["retry-after"]) >= 1, (e, r.headers)
    r = servers["open"].http.post(COMPL, json={"model": MODEL, "prompt": "x", "max_tokens": 2})  # 1 token: short
    assert r.status_code == 200, r.text
