"""OpenAI-compatible HTTP server on the speculative engine (`eyas serve`).

One engine, one worker thread (eyas.serve.worker); the request checks (auth, model name, tokenization and
limits) are plain functions here, and `create_app` wires them into FastAPI routes. Starting it (the engine, the
exposure and template warnings, uvicorn with the worker drained first) is eyas.serve.launch.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.params import EngineError, SamplingParams
from ..engine.prompt import chat_input_ids
from ..errors import EyasError
from ..target.template import raw_ids
from . import bounds
from . import openai_schema as oai
from .bounds import read_body
from .config import PREFILL_CHUNK, ServeConfig
from .metrics import CountRequests, Metrics
from .openai_schema import APIError, GenRequest
from .worker import Job, Worker

log = logging.getLogger("eyas.server")


# ---- the app -------------------------------------------------------------------------------------

# Text longer than this many characters per allowed prompt token is refused before tokenizing: real text
# runs 3-5 characters per token, and tokenizing megabytes only to refuse them stalls every other request.
CHARS_PER_TOKEN = 16


def _error_response(e: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
    if e.retry_after is not None:
        headers = {"Retry-After": str(e.retry_after)}
    if e.status in (408, 413) or e.code == "ambiguous_framing":  # the body was not read to its end (or its
        # end is ambiguous): this connection cannot carry another request
        headers = {"Connection": "close"}
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def check_auth(request: Request, api_key: str | None) -> None:
    """Bearer-key check; no key configured = open server. The header must be exactly the scheme, one space and
    the key (constant-time compare): the scheme in any case (RFC 7235 2.1: auth schemes are case-insensitive,
    so `bearer KEY` passes), anything else is a 401 — two spaces, a tab, a second token or a second
    Authorization header. Whitespace around the whole value is not part of it (RFC 9110 5.5): h11 drops it
    before it gets here, so `Bearer KEY ` is the key; a value that still carries it (another front end) is not."""
    if api_key is None:
        return
    values = request.headers.getlist("authorization")
    if not values or values == [""]:
        raise APIError(401, "Missing API key: send the header 'Authorization: Bearer KEY'.",
                       code="invalid_api_key")
    if len(values) > 1:
        raise APIError(401, f"The request has {len(values)} Authorization headers; send one: "
                            "'Authorization: Bearer KEY'.", code="invalid_api_key")
    scheme, _, key = values[0].partition(" ")
    # exactly one space after the scheme, as vLLM and OpenAI compare it: "Bearer  KEY" is not the key
    if scheme.lower() != "bearer" or not hmac.compare_digest(key.encode(), api_key.encode()):
        raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")


def check_model(name: str, cfg: ServeConfig) -> None:
    if name != cfg.model_name:
        raise APIError(404, f"The model '{name}' does not exist; this server serves '{cfg.model_name}' "
                            "(GET /v1/models).", param="model", code="model_not_found")


def check_text_size(req: GenRequest, cfg: ServeConfig) -> None:
    """Refuse text that cannot fit in --max-prompt-tokens before paying to tokenize it."""
    what = "messages" if req.kind == "chat" else "prompt"
    if req.kind == "chat":
        assert req.messages is not None
        if len(req.messages) > cfg.max_prompt_tokens:  # every message costs at least one token
            raise APIError(400, f"The request has {len(req.messages)} messages; a prompt of at most "
                                f"{cfg.max_prompt_tokens} tokens (--max-prompt-tokens) cannot hold more messages "
                                "than that. Send fewer.", param=what, code="context_length_exceeded")
        chars = sum(len(m["content"]) for m in req.messages)
    else:
        assert isinstance(req.prompt, str)
        chars = len(req.prompt)
    limit = cfg.max_prompt_tokens * CHARS_PER_TOKEN
    if chars > limit:
        raise APIError(400, f"The prompt text is {chars} characters; this server reads at most {limit} "
                            f"({CHARS_PER_TOKEN} characters per token x --max-prompt-tokens {cfg.max_prompt_tokens}), "
                            "which no prompt that fits in the token limit exceeds. Shorten it.", param=what,
                       code="context_length_exceeded")


def tokenize(req: GenRequest, tokenizer: Any, lock: threading.Lock) -> list[int]:
    """A chat request through the chat template, a string prompt through the tokenizer (one caller at a
    time per tokenizer copy: HF fast tokenizers are not thread-safe, and this copy is the event loop's
    alone — the engine worker decodes with its own, so tokenizing never waits on a generation)."""
    with lock:
        if req.kind == "chat":
            assert req.messages is not None  # a validated chat request has them
            try:
                return list(chat_input_ids(tokenizer, req.messages))
            except (EngineError, EyasError) as e:  # EyasError: the template's TemplateError (raise_exception)
                raise APIError(400, str(e), param="messages", code="invalid_value") from None
        assert isinstance(req.prompt, str)  # prepare tokenizes text prompts only
        return raw_ids(tokenizer, req.prompt)


async def prepare(req: GenRequest, cfg: ServeConfig, encode: Callable[[GenRequest], list[int]],
                  vocab: int) -> tuple[list[int], int]:
    """Tokenize (off the event loop: a long prompt must not stall other streams) and check limits
    -> (input ids, max new tokens)."""
    if req.kind == "chat" or isinstance(req.prompt, str):
        check_text_size(req, cfg)
        input_ids = await asyncio.to_thread(encode, req)
    else:
        assert req.prompt is not None  # a validated completion request has one
        bad = [t for t in req.prompt if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"'prompt' token ids must be in 0..{vocab - 1}; found {bad[:5]}.", param="prompt",
                           code="invalid_value")
        input_ids = list(req.prompt)
    n = len(input_ids)
    what = "messages" if req.kind == "chat" else "prompt"
    if n > cfg.max_prompt_tokens:
        raise APIError(400, f"The prompt is {n} tokens; this server accepts at most {cfg.max_prompt_tokens} "
                            "(--max-prompt-tokens). Shorten it.", param=what, code="context_length_exceeded")
    if req.max_tokens is not None and req.max_tokens > cfg.max_new_tokens:
        raise APIError(400, f"max_tokens is {req.max_tokens}; this server generates at most {cfg.max_new_tokens} "
                            "tokens per request (--max-new-tokens).", param="max_tokens", code="invalid_value")
    max_new = req.max_tokens or cfg.max_new_tokens
    if cfg.context_length is not None and n + max_new > cfg.context_length:
        if req.max_tokens is not None or n >= cfg.context_length:
            raise APIError(400, f"The prompt ({n} tokens) plus max_tokens ({max_new}) exceeds the model's "
                                f"context length of {cfg.context_length} tokens; shorten one of them.",
                           param=what, code="context_length_exceeded")
        max_new = cfg.context_length - n  # no explicit max_tokens: use what the context allows
    return input_ids, max_new


@dataclass
class ServeState:
    """What the route handlers share: the config, the engine's worker, the metrics, the request encoder (the
    event loop's own tokenizer copy) and the vocab size token-id prompts are checked against."""
    cfg: ServeConfig
    worker: Worker
    metrics: Metrics
    encode: Callable[[GenRequest], list[int]]
    vocab: int
    created: int  # the model card's creation time: when the app was made


def create_app(engine: Any, tokenizer: Any, cfg: ServeConfig) -> FastAPI:
    """The FastAPI app over one engine (an eyas.engine.decode.Engine; its tokenizer is passed separately)."""
    cfg.check()
    if hasattr(engine, "prefill_chunk"):  # an eyas Engine (test stubs have no prefill)
        engine.prefill_chunk = cfg.prefill_chunk
    metrics = Metrics()
    # separate tokenizer copies: the event loop encodes while the worker decodes
    enc_tok = copy.deepcopy(tokenizer)
    worker = Worker(engine, copy.deepcopy(tokenizer), metrics, max_long=cfg.max_long_prompts,
                    long_prompt=cfg.prefill_chunk or PREFILL_CHUNK)
    enc_lock = threading.Lock()  # requests tokenize on worker threads; one tokenizer copy, one at a time

    def encode(req: GenRequest) -> list[int]:
        return tokenize(req, enc_tok, enc_lock)

    target = getattr(engine, "target", None)
    vocab = target.identity.vocab_size if target is not None else len(tokenizer)
    state = ServeState(cfg, worker, metrics, encode, vocab, oai.now())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        try:
            yield
        finally:
            worker.stop()

    # redirect_slashes off: Starlette's trailing-slash redirect builds its Location from the Host header (an open
    # redirect, sent before auth); a path with a slash too many gets the JSON 404 instead
    app = FastAPI(title="eyas", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  redirect_slashes=False)
    app.state.worker, app.state.metrics, app.state.config = worker, metrics, cfg
    app.state.serve = state  # what the routes read at request time (tests wrap state.encode to count calls)
    add_error_handlers(app)
    add_routes(app, state)
    app.add_middleware(CountRequests, metrics=metrics)
    return app


def add_error_handlers(app: FastAPI) -> None:
    """Every error as an OpenAI-style JSON body: ours, FastAPI's validation, Starlette's (404: the routes there
    are) and anything unexpected (a 500; the server lives on)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return _error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        return _error_response(APIError(400, f"invalid request: {e.errors()[:1]}", code="invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        if e.status_code == 404:
            msg = (f"no route {request.method} {request.url.path}; eyas serves POST /v1/chat/completions, "
                   "POST /v1/completions, GET /v1/models, GET /health, GET /metrics")
        else:
            msg = f"{e.detail} ({request.method} {request.url.path})"
        return _error_response(APIError(e.status_code, msg, code="not_found" if e.status_code == 404 else None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        log.exception("unexpected error")
        return _error_response(APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error",
                                        code="internal_error"))


def add_routes(app: FastAPI, state: ServeState) -> None:
    """The OpenAI routes (completions, models), /health and /metrics."""
    cfg = state.cfg

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(state, request, oai.parse_chat)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(state, request, oai.parse_completion)

    @app.get("/v1/models")
    async def models(request: Request):
        check_auth(request, cfg.api_key)
        return {"object": "list", "data": [oai.model_card(cfg.model_name, state.created)]}

    @app.get("/v1/models/{name:path}")
    async def model(request: Request, name: str):
        check_auth(request, cfg.api_key)
        check_model(name, cfg)
        return oai.model_card(cfg.model_name, state.created)

    @app.get("/health")
    async def health(request: Request):
        worker = state.worker
        alive = worker._thread is not None and worker._thread.is_alive()
        status = "shutting down" if worker._stopping else "ok" if alive else "engine worker not running"
        body = {"status": status, "model": cfg.model_name}
        try:  # health stays open to probes; what is served is for key holders only
            check_auth(request, cfg.api_key)
        except APIError:
            del body["model"]
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics_text(request: Request):
        check_auth(request, cfg.api_key)
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")


async def generate(state: ServeState, request: Request, parse) -> Response:
    """One completion request: checked, tokenized and queued on the engine worker; answered as a stream of
    server-sent events or as one JSON body."""
    arrived = time.perf_counter()
    cfg = state.cfg
    check_auth(request, cfg.api_key)
    body = await read_body(request)
    if body is None:
        return Response(status_code=499)  # the client left before sending its request
    # off the event loop: parsing and checking a body of up to MAX_BODY bytes takes a while
    req = await asyncio.to_thread(parse, body)
    check_model(req.model, cfg)
    input_ids, max_new = await prepare(req, cfg, state.encode, state.vocab)
    params = SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                            max_new_tokens=max_new, stop=list(req.stop), seed=req.seed)
    try:
        params.validate()
    except EngineError as e:
        raise APIError(400, str(e), code="invalid_value") from None
    job = Job(input_ids=input_ids, params=params, stop=req.stop, loop=asyncio.get_running_loop(),
              arrived=arrived, endpoint=request.url.path)
    rid, created = oai.new_id(req.kind), oai.now()
    state.worker.submit(job)  # raises the 503 once the server is shutting down
    if req.stream:
        return StreamingResponse(stream_events(state.metrics, job, req, rid, created, len(input_ids)),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await whole_answer(state.metrics, request, job, req, rid, created, len(input_ids))


async def watch_disconnect(request: Request, job: Job) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            job.cancelled.set()
            return


def finish_metrics(metrics: Metrics, job: Job, endpoint: str, finish: str, prompt_tokens: int,
                   completion_tokens: int) -> None:
    metrics.inc("eyas_requests_finished_total", endpoint=endpoint, finish_reason=finish)
    metrics.inc("eyas_prompt_tokens_total", prompt_tokens)
    metrics.inc("eyas_completion_tokens_total", completion_tokens)
    metrics.observe("eyas_request_latency_seconds", time.perf_counter() - job.arrived, endpoint=endpoint)
    if job.first_token_at is not None:
        metrics.observe("eyas_time_to_first_token_seconds", job.first_token_at - job.arrived, endpoint=endpoint)


async def whole_answer(metrics: Metrics, request: Request, job: Job, req: GenRequest, rid: str, created: int,
                       prompt_tokens: int) -> Response:
    """A non-streamed answer: the job's text in one JSON body once it is done; the generation stops when the
    client leaves meanwhile."""
    watcher = asyncio.create_task(watch_disconnect(request, job))
    parts: list[str] = []
    try:
        while True:
            ev = await job.events.get()
            if ev.kind == "error":
                raise ev.error
            if ev.kind == "cancelled":  # the client is gone; this answer is never read
                return Response(status_code=499)
            parts.append(ev.text)
            if ev.kind == "done":
                job.done = True
                break
    finally:
        watcher.cancel()
        if not job.done:  # the client left (or the handler failed): stop the generation
            job.cancelled.set()
    finish_metrics(metrics, job, job.endpoint, ev.finish_reason, prompt_tokens, ev.completion_tokens)
    return JSONResponse(oai.completion_body(req.kind, rid, created, req.model, "".join(parts), ev.finish_reason,
                                            prompt_tokens, ev.completion_tokens))


# An SSE comment (clients skip lines that start with ':'), sent while a stream waits bounds.PROBE_S for its next
# event (queued, or a long prompt's prefill). A client that ended its input may have half-closed (it still reads) or
# be gone, and only a write tells them apart: a gone client's socket answers this one with a reset, the next write
# fails and the server sees the disconnect, which cancels the request between two prefill chunks instead of after
# the whole prefill, when its first token could not be sent. (It also keeps proxies from timing the stream out.)
KEEP_ALIVE = b": keep-alive\n\n"


async def stream_events(metrics: Metrics, job: Job, req: GenRequest, rid: str, created: int, prompt_tokens: int
                        ) -> AsyncIterator[bytes]:
    def chunk(text: str | None, finish: str | None = None, first: bool = False) -> bytes:
        return oai.sse(oai.chunk_body(req.kind, rid, created, req.model, text, finish, req.include_usage, first))

    pending: asyncio.Future | None = None  # the next event, awaited across keep-alives (a get is never lost)
    try:
        if req.kind == "chat":  # the role comes first, as OpenAI sends it
            yield chunk("", first=True)
        while True:
            if pending is None and not job.events.empty():  # a decoding stream: no task per token
                ev = job.events.get_nowait()
            else:
                pending = pending or asyncio.ensure_future(job.events.get())
                done, _ = await asyncio.wait({pending}, timeout=bounds.PROBE_S)
                if not done:
                    yield KEEP_ALIVE
                    continue
                ev, pending = pending.result(), None
            if ev.kind == "start":
                continue
            if ev.kind == "cancelled":
                return
            if ev.kind == "error":
                yield oai.sse(ev.error.body())
                break
            if ev.text:
                yield chunk(ev.text)
            if ev.kind == "done":
                yield chunk(None, ev.finish_reason) if req.kind == "chat" else chunk("", ev.finish_reason)
                if req.include_usage:
                    yield oai.sse(oai.usage_chunk(req.kind, rid, created, req.model, prompt_tokens,
                                                  ev.completion_tokens))
                job.done = True
                finish_metrics(metrics, job, job.endpoint, ev.finish_reason, prompt_tokens, ev.completion_tokens)
                break
        yield oai.sse("[DONE]")
    finally:
        # reached on completion, and on disconnect (Starlette cancels this generator's task)
        if pending is not None:
            pending.cancel()
        if not job.done:
            job.cancelled.set()
