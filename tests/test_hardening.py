"""Hostile and faulty inputs, one table per surface: the server (bodies, timeouts, templates that raise,
redirects, loose types, what /health tells a stranger) and the CLI/artifact faults (eyas.files, state files,
checksums). Every case is answered by one clean error; none by a 500, a traceback or a hang.

The server here runs on a stub engine (a few fixed tokens) and the bundled target's tokenizer: no model loads.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import select
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from eyas.serve import bounds
from eyas.serve.app import ServeConfig, create_app
from eyas.serve.launch import make_server

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
        self.server = make_server(self.app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.time() < deadline, "the server did not start"
            time.sleep(0.02)
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


# ---- damaged artifacts: state files, checkpoints, shards, drafts --------------------------------------------

TRAIN_FLAGS = ["--draft-vocab", "64", "--ttt-steps", "3", "--lr", "3e-3", "--batch-tokens", "512", "--max-len", "64",
               "--heldout-pct", "20", "--eval-every", "1000", "--save-every", "1000", "--quiet", "--threads", "1"]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A tiny target, its two shards and one finished training run (OUT/checkpoint, OUT/draft), via the CLI."""
    from typer.testing import CliRunner

    from eyas.cli import app
    from tests.test_train import make_shards, make_tiny_target

    root = tmp_path_factory.mktemp("hardening")
    make_shards(make_tiny_target(root / "target"), root / "shards")
    r = CliRunner().invoke(app, ["train", "--data", str(root / "shards"), "--out", str(root / "run"), *TRAIN_FLAGS])
    assert r.exit_code == 0, r.output
    assert (root / "run" / "checkpoint" / "trainer_state.json").is_file()
    return root


def flip_byte(path: Path, from_end: int = 16) -> None:
    """One byte changed inside the tensor data (the header, at the front, stays valid): same size, other bytes."""
    b = bytearray(path.read_bytes())
    b[-from_end] ^= 0x5A
    path.write_bytes(bytes(b))


def cut(path: Path, keep: float = 0.5) -> None:
    path.write_bytes(path.read_bytes()[: int(path.stat().st_size * keep)])


def edit_state(path: Path, **changes: Any) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def forget_digests(path: Path) -> None:
    """What a checkpoint written before eyas recorded digests looks like: no `files`."""
    state = json.loads(path.read_text())
    del state["files"]
    path.write_text(json.dumps(state))


def corrupt_header(path: Path) -> None:
    b = bytearray(path.read_bytes())
    b[8:16] = b"{oops!!!"
    path.write_bytes(bytes(b))


def old_shards(folder: Path) -> None:
    """Shards listed without size or digest (written before either was recorded): read unchecked."""
    m = json.loads((folder / "manifest.json").read_text())
    for s in m["shards"]:
        s.pop("digest", None)
        s.pop("bytes", None)
    (folder / "manifest.json").write_text(json.dumps(m))


def flipped_export(root: Path) -> None:
    """The trained draft exported (its manifest records the weights' digest), then one byte of the export flipped."""
    from eyas.interop.export import export_draft

    export_draft(root / "run" / "draft", "vllm", root / "exported")
    flip_byte(root / "exported" / "model.safetensors")


CK = "run/checkpoint"
# (name, what to copy, damage(root copy), command kind, file the error names, phrase in the error)
DAMAGE = [
    ("negative step", CK, lambda r: edit_state(r / CK / "trainer_state.json", step=-5), "resume",
     "trainer_state.json", "'step' should be a whole number >= 0, found -5"),
    ("step not a number", CK, lambda r: edit_state(r / CK / "trainer_state.json", step="7"), "resume",
     "trainer_state.json", "found '7'"),
    ("tokens_seen a bool", CK, lambda r: edit_state(r / CK / "trainer_state.json", tokens_seen=True), "resume",
     "trainer_state.json", "'tokens_seen'"),
    ("state not JSON", CK, lambda r: (r / CK / "trainer_state.json").write_text('{"step": 3,'), "resume",
     "trainer_state.json", "not valid JSON"),
    ("optimizer truncated", CK, lambda r: cut(r / CK / "optimizer.safetensors"), "resume",
     "optimizer.safetensors", "truncated"),
    ("optimizer byte flipped", CK, lambda r: flip_byte(r / CK / "optimizer.safetensors"), "resume",
     "optimizer.safetensors", "digest differs"),
    ("optimizer truncated, no digests", CK, lambda r: (forget_digests(r / CK / "trainer_state.json"),
                                                       cut(r / CK / "optimizer.safetensors")), "resume",
     "optimizer.safetensors", "not a readable safetensors file"),
    ("checkpoint weights flipped", CK, lambda r: flip_byte(r / CK / "model.safetensors"), "resume",
     "model.safetensors", "digest differs"),
    ("shard truncated", "shards", lambda r: cut(r / "shards" / "shard-00001.safetensors"), "train",
     "shard-00001.safetensors", "truncated"),
    ("shard byte flipped", "shards", lambda r: flip_byte(r / "shards" / "shard-00000.safetensors", 1000), "train",
     "shard-00000.safetensors", "digest differs"),
    ("shard header corrupt, no record", "shards", lambda r: (old_shards(r / "shards"),
                                                             corrupt_header(r / "shards" / "shard-00000.safetensors")),
     "train", "shard-00000.safetensors", "not a readable eyas shard"),
    ("shard byte flipped, ngram", "shards", lambda r: flip_byte(r / "shards" / "shard-00000.safetensors", 1000),
     "ngram", "shard-00000.safetensors", "digest differs"),
    ("shard byte flipped, doctor --data", "shards",
     lambda r: flip_byte(r / "shards" / "shard-00001.safetensors", 1000), "doctor-data", "shard-00001.safetensors",
     "digest differs"),
    ("draft byte flipped", "run/draft", lambda r: flip_byte(r / "run" / "draft" / "model.safetensors"), "export",
     "model.safetensors", "digest differs"),
    ("draft byte flipped, generate", "run/draft", lambda r: flip_byte(r / "run" / "draft" / "model.safetensors"),
     "generate", "model.safetensors", "digest differs"),
    ("rng state byte flipped", CK, lambda r: flip_byte(r / CK / "rng.safetensors"), "resume",
     "rng.safetensors", "digest differs"),
    ("export byte flipped, import", "run/draft", flipped_export, "import", "model.safetensors", "digest differs"),
    ("export byte flipped, doctor flags", "run/draft", flipped_export, "flags", "model.safetensors",
     "digest differs"),
]


def damaged_command(trained_run: Path, root: Path, what: str, kind: str) -> list[str]:
    """The command line of `kind` run on the damaged copy under root (the rest from the intact run)."""
    import shutil

    shards = root / "shards" if what == "shards" else trained_run / "shards"
    target = str(trained_run / "target")
    if kind == "resume":
        shutil.copytree(trained_run / "run" / "draft", root / "run" / "draft")
        return ["train", "--data", str(shards), "--out", str(root / "run"), *TRAIN_FLAGS, "--resume"]
    argv = {
        "train": ["train", "--data", str(shards), "--out", str(root / "new"), *TRAIN_FLAGS],
        "doctor": ["doctor", "--target", target, "--draft", str(root / what), "--quick"],
        "ngram": ["ngram", "--data", str(shards), "--out", str(root / "table")],
        "inspect": ["inspect", str(root / what)],
        "doctor-data": ["doctor", "--target", target, "--draft", str(trained_run / "run" / "draft"), "--data",
                        str(shards), "--samples", "2"],
        "generate": ["generate", "--target", target, "--draft", str(root / what), "--raw", "--prompt", "t5 t6 t7",
                     "--max-new-tokens", "2"],
        "import": ["import", str(root / "exported"), "--target", target, "--out", str(root / "imported")],
        "flags": ["doctor", "flags", "--draft", str(root / "exported"), "--", "vllm", "serve", "M"],
        "export": ["export", "--draft", str(root / what), "--format", "vllm", "--out", str(root / "exported")],
    }
    return argv[kind]


def one_error_line(argv: list[str]) -> str:
    from typer.testing import CliRunner

    from eyas.cli import app

    r = CliRunner().invoke(app, argv)
    assert r.exception is None or isinstance(r.exception, SystemExit), f"{type(r.exception).__name__}: {r.exception}"
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert r.exit_code == 2 and len(errors) == 1 and "Traceback" not in r.output, r.output
    return errors[0]


@pytest.mark.parametrize("name,what,damage,kind,file,phrase", DAMAGE, ids=[c[0] for c in DAMAGE])
def test_damaged_artifact_is_one_error_line(trained_run, tmp_path, name, what, damage, kind, file, phrase):
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(trained_run / what, root / what)
    damage(root)
    error = one_error_line(damaged_command(trained_run, root, what, kind))
    assert file in error and phrase in error, error


# ---- every metadata file through its one reader (eyas.metadata), for every command that reads it ------------

def exported(root: Path) -> None:
    from eyas.interop.export import export_draft

    export_draft(root / "run" / "draft", "vllm", root / "exported")


# file (relative to the run's root), what to copy, how to make it (None: copied), the commands that read it, and
# per damage the JSON edit: a field of the wrong type, a required field removed (None where the schema requires
# none: foreign configs vary), a field out of its range
METADATA = [
    ("shards/manifest.json", "shards", None, ("train", "ngram", "inspect"),
     {"shards": "oops"}, "layout", {"shards": [{"file": "shard-00000.safetensors", "samples": -1, "tokens": 4}]}),
    (f"{CK}/eyas_manifest.json", CK, None, ("resume",), {"draft_vocab": []}, "data", {"step": -1}),
    (f"{CK}/trainer_state.json", CK, None, ("resume",), {"step": "7"}, "optimizer", {"epoch": -1}),
    ("run/draft/eyas_manifest.json", "run/draft", None, ("generate", "export", "doctor", "inspect"),
     {"draft_config": "x"}, "layout", {"step": -3}),
    ("run/draft/config.json", "run/draft", None, ("doctor",), {"eagle_config": [1]}, None, {"hidden_size": 0}),
    ("exported/config.json", "run/draft", exported, ("import", "flags"), {"eagle_config": [1]}, None,
     {"draft_vocab_size": -1}),
    ("exported/eyas_manifest.json", "run/draft", exported, ("import", "flags"), {"files": "x"}, "kind",
     {"format_version": 0}),
]


def metadata_cases() -> list[tuple]:
    cases = []
    for file, what, make, kinds, wrong, missing, out_of_range in METADATA:
        damages = [("not JSON", lambda p: p.write_text('{"kind": '), "not valid JSON"),
                   ("empty", lambda p: p.write_text(""), "is empty"),
                   ("wrong type", lambda p, w=wrong: patch_json(p, w), f"'{next(iter(wrong))}' should be")]
        if missing:
            damages.append(("missing key", lambda p, k=missing: patch_json(p, {k: None}),
                            f"'{missing}' should be"))
        key = next(iter(out_of_range))
        damages.append(("out of range", lambda p, o=out_of_range: patch_json(p, o), "found -1" if key == "shards"
                        else f"found {out_of_range[key]}"))
        for kind in kinds:
            cases += [(f"{file} {label}, {kind}", file, what, make, damage, kind, phrase)
                      for label, damage, phrase in damages]
    return cases


def patch_json(path: Path, fields: dict[str, Any]) -> None:
    """Set top-level fields of a JSON file (None drops the field)."""
    data = json.loads(path.read_text())
    for k, v in fields.items():
        if v is None:
            data.pop(k, None)
        else:
            data[k] = v
    path.write_text(json.dumps(data))


METADATA_CASES = metadata_cases()


@pytest.mark.slow
@pytest.mark.parametrize("name,file,what,make,damage,kind,phrase", METADATA_CASES, ids=[c[0] for c in METADATA_CASES])
def test_damaged_metadata_is_one_error_line_naming_file_and_field(trained_run, tmp_path, name, file, what, make,
                                                                  damage, kind, phrase):
    """Not JSON, empty, a field of the wrong type, missing or out of range: in every metadata file, for every
    command that reads it, one error line naming the file (and the field) -- never a traceback."""
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(trained_run / what, root / what)
    if make:
        make(root)
    damage(root / file)
    error = one_error_line(damaged_command(trained_run, root, what, kind))
    assert Path(file).name in error and phrase in error, error


def test_every_metadata_schema_is_covered():
    """Each schema eyas.metadata defines has rows in the table above (the two draft-config rows share one), but the
    n-gram, replay-rows and recipe records, whose every field tests/test_metadata.py damages (as it does all)."""
    from eyas.metadata import LATEST_TRAIN, NGRAM_MANIFEST, REPLAY_MANIFEST, SCHEMAS

    there = {NGRAM_MANIFEST, REPLAY_MANIFEST, LATEST_TRAIN}
    assert there <= set(SCHEMAS) and len(SCHEMAS) - len(there) == len(METADATA) - 1


def forget_files(path: Path) -> None:
    """An eyas_manifest.json as written before eyas recorded digests: no `files`."""
    patch_json(path, {"files": None})


# (name, what to copy, make it old (no digest records), command kind, what the note names)
UNVERIFIED = [
    ("shards", "shards", lambda r: old_shards(r / "shards"), "train", "2 of 2 shards in"),
    ("shards, ngram", "shards", lambda r: old_shards(r / "shards"), "ngram", "2 of 2 shards in"),
    ("checkpoint", CK, lambda r: (forget_digests(r / CK / "trainer_state.json"),
                                  forget_files(r / CK / "eyas_manifest.json")), "resume", "optimizer.safetensors"),
    ("draft", "run/draft", lambda r: forget_files(r / "run" / "draft" / "eyas_manifest.json"), "generate",
     "model.safetensors"),
    ("export", "run/draft", lambda r: (exported(r), forget_files(r / "exported" / "eyas_manifest.json")), "import",
     "the export"),
]


@pytest.mark.parametrize("name,what,make_old,kind,names", UNVERIFIED, ids=[c[0] for c in UNVERIFIED])
def test_artifact_without_digest_records_is_read_with_one_not_verified_line(trained_run, tmp_path, name, what,
                                                                              make_old, kind, names):
    """An artifact written before eyas recorded digests still works, and the command says, once per file, that it
    was not verified and which command records a digest."""
    import shutil

    from typer.testing import CliRunner

    from eyas.cli import app
    from eyas.files import NOTED

    NOTED.clear()
    root = tmp_path / "copy"
    shutil.copytree(trained_run / what, root / what)
    make_old(root)
    argv = damaged_command(trained_run, root, what, kind)
    if kind == "resume":  # a finished run resumes into nothing to do: ask for more steps
        argv += ["--max-steps", "1000"]
    r = CliRunner().invoke(app, argv)
    assert r.exit_code == 0, r.output
    notes = [ln for ln in r.output.splitlines() if "not verified" in ln]
    assert notes and all(ln.startswith("note: ") and "eyas doctor seal " in ln for ln in notes), r.output
    assert any(names in ln for ln in notes) and len(notes) == len(set(notes)), notes


def test_seal_records_digests_that_then_catch_damage(trained_run, tmp_path):
    """`eyas doctor seal` gives an old artifact its digest records: the note is gone, a later flipped byte is
    named, a second seal has nothing to do, and a file already damaged (size off its record) is refused."""
    import shutil

    from eyas.files import NOTED

    root = tmp_path / "copy"
    shutil.copytree(trained_run / "shards", root / "shards")
    old_shards(root / "shards")
    out = one_line_ok(["doctor", "seal", str(root / "shards")])
    assert "sealed 2 file(s)" in out, out
    assert "nothing to do" in one_line_ok(["doctor", "seal", str(root / "shards")])
    NOTED.clear()
    assert "not verified" not in one_line_ok(damaged_command(trained_run, root, "shards", "ngram"))
    flip_byte(root / "shards" / "shard-00000.safetensors", 1000)
    error = one_error_line(damaged_command(trained_run, root, "shards", "ngram"))
    assert "shard-00000.safetensors" in error and "digest differs" in error, error

    shutil.copytree(trained_run / CK, root / CK)
    forget_digests(root / CK / "trainer_state.json")
    forget_files(root / CK / "eyas_manifest.json")
    patch_json(root / CK / "trainer_state.json", {"files": {"rng.safetensors": {"bytes": 3}}})
    error = one_error_line(["doctor", "seal", str(root / CK)])
    assert "rng.safetensors" in error and "3 were written" in error, error
    patch_json(root / CK / "trainer_state.json", {"files": None})
    assert "sealed 3 file(s)" in one_line_ok(["doctor", "seal", str(root / CK)])
    state = json.loads((root / CK / "trainer_state.json").read_text())
    assert set(state["files"]) == {"optimizer.safetensors", "rng.safetensors"}
    assert set(json.loads((root / CK / "eyas_manifest.json").read_text())["files"]) == {"model.safetensors"}


def one_line_ok(argv: list[str]) -> str:
    from typer.testing import CliRunner

    from eyas.cli import app

    r = CliRunner().invoke(app, argv)
    assert r.exit_code == 0, r.output
    return r.output


def test_shipped_assets_record_digests():
    """The shipped draft and n-gram table carry digest records (sealed), so using them verifies them."""
    from eyas.draft import bundled_draft_path, load_draft
    from eyas.engine.ngram import bundled_ngram_path

    for folder, name in ((bundled_draft_path(), "model.safetensors"), (bundled_ngram_path(), "ngram.safetensors")):
        man = json.loads((folder / "eyas_manifest.json").read_text())
        assert man["files"][name]["digest"].startswith("xxh3_128:"), folder
    assert load_draft("default").model is not None


def test_written_artifacts_record_digests(trained_run):
    from eyas.files import file_digest

    shard_man = json.loads((trained_run / "shards" / "manifest.json").read_text())
    for s in shard_man["shards"]:
        assert s["digest"].startswith("xxh3_128:") and s["digest"] == file_digest(trained_run / "shards" / s["file"])
    draft_man = json.loads((trained_run / "run" / "draft" / "eyas_manifest.json").read_text())
    assert draft_man["files"]["model.safetensors"]["digest"] == \
        file_digest(trained_run / "run" / "draft" / "model.safetensors")
    state = json.loads((trained_run / "run" / "checkpoint" / "trainer_state.json").read_text())
    assert set(state["files"]) == {"optimizer.safetensors", "rng.safetensors"}


def test_export_records_digests_and_foreign_exports_still_import(trained_run, tmp_path):
    """An export's manifest records its weights' size and digest, and `eyas import` takes the intact folder; the
    same folder without the record (as another tool writes it) imports as before, unchecked."""
    from typer.testing import CliRunner

    from eyas.cli import app
    from eyas.files import file_record
    from eyas.interop.export import export_draft

    out = export_draft(trained_run / "run" / "draft", "vllm", tmp_path / "exported").path
    man = json.loads((out / "eyas_manifest.json").read_text())
    assert man["files"] == {"model.safetensors": file_record(out / "model.safetensors")}
    for name, edit in (("intact", lambda m: m), ("foreign", lambda m: {k: v for k, v in m.items() if k != "files"})):
        (out / "eyas_manifest.json").write_text(json.dumps(edit(man)))
        r = CliRunner().invoke(app, ["import", str(out), "--target", str(trained_run / "target"), "--out",
                                     str(tmp_path / name)])
        assert r.exit_code == 0, r.output
        assert (tmp_path / name / "model.safetensors").is_file()


def test_datagen_rerun_redoes_a_damaged_shard(trained_run, tmp_path):
    """A truncated shard (a kill or a full disk outside eyas's writes) or one with a flipped byte is found on the
    rerun, which rolls the folder back to the commit before it and captures those rows again: the same rows in
    the same shard files as before, not "nothing to do" over a file training would then choke on."""
    from eyas.data.datagen import DatagenConfig, run_datagen
    from eyas.files import file_digest

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": " ".join(f"t{(i * 7 + j) % 90 + 2}" for j in range(20))}) + "\n"
                            for i in range(8)))
    cfg = DatagenConfig(out=str(tmp_path / "d"), target=str(trained_run / "target"), data=str(rows), raw=True,
                        regenerate=False, dtype="fp32", shard_samples=2, max_len=32, threads=1)
    first = run_datagen(cfg, command="a", progress=False, log=lambda s: None)
    assert len(first["shards"]) >= 3
    for damage in (cut, flip_byte):
        damage(tmp_path / "d" / first["shards"][1]["file"])
        logs: list[str] = []
        again = run_datagen(cfg, command="b", progress=False, log=logs.append)
        assert any(first["shards"][1]["file"] in line and "rolling back" in line for line in logs), logs
        assert not any("nothing to do" in line for line in logs), logs
        # the same rows in the same files (capture batches differ, so the hidden states match to fp32 noise)
        same = ("file", "samples", "tokens", "loss_tokens", "row_ids")
        assert [[s[k] for k in same] for s in again["shards"]] == [[s[k] for k in same] for s in first["shards"]]
        assert again["shards"][0]["digest"] == first["shards"][0]["digest"]  # before the damage: kept as it was
        assert all(file_digest(tmp_path / "d" / s["file"]) == s["digest"] for s in again["shards"])
        assert again["counts"]["samples"] == first["counts"]["samples"] and again["watermark"] == first["watermark"]


# ---- fair serving: a short request starts between long prompts' prefill chunks and decoding rounds ------------

class ChunkedStub:
    """An engine whose prefill takes one empty round per 2 prompt tokens, then max_new_tokens rounds of one
    token; it logs what ran, in order, by prompt (prompt i of `longs` has 40 + i tokens). A long prompt's first
    round waits for `gate`, and its second token for `resume`, so the test can queue requests at a known point."""

    def __init__(self, token: int):
        self.last_result, self.log, self.token = None, [], token
        self.gate, self.resume = threading.Event(), threading.Event()

    def stream(self, input_ids, params):
        who = len(input_ids)
        if who > 10:
            assert self.gate.wait(30)
        for _ in range(who // 2 - 1):
            self.log.append(("chunk", who))
            yield []
        for i in range(params.max_new_tokens):
            if who > 10 and i == 1:
                assert self.resume.wait(30)
            self.log.append(("token", who))
            yield [self.token]


def run_behind(tokenizer, longs: int, long_new: int = 3, while_decoding: bool = False,
               max_long: int = 8) -> tuple[list[tuple[str, int]], list[Any]]:
    """`longs` prompts of 40+ tokens, then a 2-token one, submitted while the first long prompt is in its first
    prefill chunk (or, while_decoding, once it has its first token) -> (the engine's log, the refusals)."""
    from eyas.engine.params import SamplingParams
    from eyas.serve.metrics import Metrics
    from eyas.serve.openai_schema import APIError
    from eyas.serve.worker import Job, Worker

    engine = ChunkedStub(token=tokenizer("hello", add_special_tokens=False)["input_ids"][0])
    worker = Worker(engine, tokenizer, Metrics(), max_long=max_long, long_prompt=16)
    refused: list[APIError] = []

    async def go() -> None:
        loop = asyncio.get_running_loop()

        def job(n_prompt: int, n_new: int) -> Job:
            return Job(input_ids=[7] * n_prompt, params=SamplingParams(max_new_tokens=n_new), stop=[], loop=loop,
                       arrived=time.perf_counter(), endpoint="test")

        jobs = [job(40 + i, long_new) for i in range(longs)] + [job(2, 2)]
        worker.submit(jobs[0])
        if while_decoding:
            engine.gate.set()
            while (await jobs[0].events.get()).kind != "delta":
                pass
        for j in jobs[1:]:
            try:
                worker.submit(j)
            except APIError as e:
                refused.append(e)
                jobs.remove(j)
        engine.gate.set()
        engine.resume.set()
        for j in jobs:
            while (ev := await j.events.get()).kind not in ("done", "error"):
                pass
            assert ev.kind == "done", ev

    worker.start()
    try:
        asyncio.run(asyncio.wait_for(go(), 120))  # a deadline, not a timing: a lost event fails instead of hanging
    finally:
        worker.stop()
    return engine.log, refused


def long_rounds_before(log: list[tuple[str, int]], index: int) -> int:
    return sum(1 for e in log[:index] if e[1] > 2)


def long_rounds_before_first_token(log: list[tuple[str, int]]) -> int:
    return long_rounds_before(log, log.index(("token", 2)))


@pytest.mark.parametrize("longs", [1, 4, 8])
def test_short_request_runs_between_long_prompts_chunks(smollm2_tokenizer, longs):
    """Behind 1, 4 or 8 long prompts (19-23 chunks each) a 2-token request's first token comes after the chunk in
    progress and its second after one more; before, it waited FIFO behind 4 started prompts' whole prefills and
    generations (and 8 queued ones' too). Every long prompt still ran all its chunks and tokens, in its order."""
    log, refused = run_behind(smollm2_tokenizer, longs)
    assert not refused
    assert long_rounds_before_first_token(log) <= 1, log
    short = [i for i, e in enumerate(log) if e[1] == 2]
    assert long_rounds_before(log, short[-1]) <= 2, log
    assert short[-1] < min(log.index(("token", 40 + i)) for i in range(longs)), log  # done before any long token
    for i in range(longs):
        n = 40 + i
        assert [e for e in log if e[1] == n] == [("chunk", n)] * (n // 2 - 1) + [("token", n)] * 3


def test_short_request_starts_while_a_long_one_decodes(smollm2_tokenizer):
    """Before, a decoding job kept newcomers queued until its generation ended; now a short request starts at the
    next round boundary and the two decode in turn."""
    log, _ = run_behind(smollm2_tokenizer, 1, long_new=6, while_decoding=True)
    first = log.index(("token", 2))
    assert log[first - 2:first] == [("token", 40)] * 2, log  # right after the round that was in progress
    assert first < max(i for i, e in enumerate(log) if e[1] == 40), log  # the long one was not finished


def test_long_prompts_beyond_the_limit_get_a_503_with_retry_after(smollm2_tokenizer):
    """--max-long-prompts 3: the 4th and 5th long prompts are refused at once with a 503 and Retry-After; the short
    request is never refused, and the 3 held ones run to their end."""
    log, refused = run_behind(smollm2_tokenizer, 5, max_long=3)
    assert [(e.status, e.code) for e in refused] == [(503, "server_busy")] * 2
    assert all(e.retry_after is not None and 1 <= e.retry_after <= 60 for e in refused)
    assert "--max-long-prompts 3" in refused[0].message and "retry" in refused[0].message
    assert {e[1] for e in log} == {40, 41, 42, 2} and long_rounds_before_first_token(log) <= 1


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


# JSON reads that name a metadata file outside eyas.metadata, each another artifact's own file: the n-gram table's
# and replay rows' manifests, a target's config.json, a bench folder's config
OTHER_JSON = {"eyas/engine/ngram.py": {"MANIFEST"}, "eyas/replay/rows.py": {"MANIFEST"},
              "eyas/recipe.py": {"MANIFEST", "man"}, "eyas/target/family.py": {"config.json"},
              "eyas/target/load.py": {"config.json"}, "eyas/bench/outdir.py": {"cfg_path"}}


def test_metadata_files_have_one_reader():
    """No module but eyas.metadata parses a manifest, trainer state or draft config: every json.loads / read_json
    call elsewhere names none of those files (the allowlist names other artifacts' files that share a name)."""
    import ast

    import eyas

    root = Path(eyas.__file__).parent
    names = ("MANIFEST", "manifest.json", "STATE_FILE", "trainer_state.json", "config.json", "cfg_path", "man")
    found = []
    for path in root.rglob("*.py"):
        rel = f"eyas/{path.relative_to(root)}"
        if rel in ("eyas/metadata.py", "eyas/files.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("json.loads", "json.load", "read_json"):
                text = ast.unparse(node.args[0]) if node.args else ""
                hits = [n for n in names if re.search(rf"\b{re.escape(n)}\b", text)]
                if not set(hits) <= OTHER_JSON.get(rel, set()):
                    found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "metadata read outside eyas.metadata.read_metadata:\n" + "\n".join(found)


DEAD_PID = 2**22 + 12345  # above Linux's pid_max default on these machines: no process has it


@pytest.mark.parametrize("kind", ["export", "train", "ngram"])
def test_killed_writers_temporaries_are_removed_with_one_line(trained_run, tmp_path, kind):
    """A `<out>.tmp-<pid>` folder (export, draft, checkpoint, table) or a `*.tmp-<pid>` file inside the output (a
    shard or log) whose writer is gone is removed on the next run, which says so; a live writer's is kept."""
    import os
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(trained_run / "run" / "draft", root / "run" / "draft")
    out = {"export": root / "exported", "train": root / "new", "ngram": root / "table"}[kind]
    stale = out.with_name(f"{out.name}.tmp-{DEAD_PID}")
    (stale / "deep").mkdir(parents=True)
    (stale / "deep" / "model.safetensors").write_bytes(b"x" * 4096)
    live = out.with_name(f"{out.name}.tmp-{os.getppid()}")
    live.mkdir()
    inside = None
    if kind == "train":
        out.mkdir()
        inside = out / f"train_log.jsonl.tmp-{DEAD_PID}"
        inside.write_text("{")
    output = one_line_ok(damaged_command(trained_run, root, "run/draft", kind))
    notes = [ln for ln in output.splitlines() if "temporary file(s) a killed eyas run left" in ln]
    assert len(notes) == 1 and stale.name in notes[0], output
    assert not stale.exists() and live.exists() and (inside is None or not inside.exists())
