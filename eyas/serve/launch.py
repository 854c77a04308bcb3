"""Starting `eyas serve`: the engine through the one assembly, the API key and exposure warning, the startup
warnings and line, uvicorn run so that shutdown drains the engine worker first (the app is eyas.serve.app), and
every way the process ends logged with its cause (exit_logged)."""

from __future__ import annotations

import faulthandler
import io
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from ..engine.decode import Engine
from ..engine.load import EngineOptions, EngineUse, load_engine
from ..heartbeat import stage
from ..target.family import text_config
from ..target.load import Target
from ..target.template import draft_template_warning
from .bounds import server_limits
from .config import API_KEY_ENV, ServeConfig
from .worker import Worker

if TYPE_CHECKING:
    import uvicorn


def is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")


def exposure_warning(host: str, api_key: str | None) -> str | None:
    if is_loopback(host) or api_key:
        return None
    return (f"binding to {host} without an API key: anyone who can reach this machine can use the model. "
            f"Pass --api-key KEY (or set ${API_KEY_ENV}), or bind to 127.0.0.1.")


SERVE_USE = EngineUse("eyas serve", "`eyas export --format sglang|vllm` writes a draft trained on it for an engine "
                      "that serves this family", draft_instead="--draft none for plain decoding",
                      template_required=False)


def build_engine(opts: EngineOptions) -> tuple[Engine, Target]:
    """Load the target, the draft and the n-gram table (eyas.engine.load; the method rule is EngineOptions') ->
    (engine, target). Without a chat template (none given and the tokenizer has none) the server still starts:
    completions need no template (template_warnings)."""
    engine, parts = load_engine(opts, SERVE_USE)
    return engine, parts.target


def template_warnings(engine: Any, target: Any) -> list[str]:
    """Startup warnings: no chat template (chat requests will be refused), or a draft trained under another
    template than the one chat requests render with."""
    if target.chat_template is None:
        return ["the target has no chat template, so /v1/chat/completions requests will get a 400 (/v1/completions "
                "works on raw text); restart with --chat-template chatml (or gemma, llama3, a Jinja file) to serve "
                "chats"]
    manifest = getattr(engine, "draft_manifest", None)
    w = draft_template_warning(manifest, target.chat_template) if manifest is not None else None
    return [w] if w else []


def make_server(app: FastAPI, **config: Any) -> uvicorn.Server:
    """A uvicorn.Server for the app (config: uvicorn.Config's arguments) that drains the engine worker as
    soon as shutdown begins (SIGTERM, Ctrl-C). Uvicorn's own order — wait for open requests, then run the
    lifespan shutdown — would let queued requests wait out the grace period and then be cancelled into
    plain-text 500s, and cut an open stream off mid-answer; draining first answers queued requests with a
    JSON 503 and ends a running stream with an error event and [DONE] within one decoding round.
    The connection limits of eyas.serve.bounds (request-head deadline and size) apply unless config overrides them."""
    import uvicorn

    worker: Worker = app.state.worker

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if not self.should_exit:
                say(f"received {signal.Signals(sig).name}: draining (waiting requests get a 503, running ones end "
                    "at their next round) and stopping")
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets=None) -> None:
            worker.drain()
            await super().shutdown(sockets=sockets)

    server = Server(uvicorn.Config(app, **{**server_limits(), **config}))
    route_log()
    return server


class ToUvicorn(logging.Handler):
    """Hands eyas.server's records to uvicorn's own log at emit time, so they share its handlers (as configured
    now, whatever replaced them since) and its level (--log-level)."""

    def emit(self, record: logging.LogRecord) -> None:
        target = logging.getLogger("uvicorn.error")
        if target.isEnabledFor(record.levelno):
            target.handle(record)


def route_log() -> None:
    """eyas.server's lines (a half-close answered, a request dropped because its client left, a failed
    generation) go where uvicorn's go: unrouted, logging's last resort would print them only from WARNING up.
    Idempotent: one server after another adds no second route."""
    ours = logging.getLogger("eyas.server")
    if not any(isinstance(h, ToUvicorn) for h in ours.handlers):
        ours.addHandler(ToUvicorn())
    ours.setLevel(logging.DEBUG)  # uvicorn's level decides, in ToUvicorn
    ours.propagate = False  # the route above prints it; the root's last resort would print errors twice


def say(line: str) -> None:
    """One line of the server's own log (stderr, beside uvicorn's)."""
    print(f"eyas serve: {line}", file=sys.stderr, flush=True)


def where(e: BaseException) -> str:
    """The innermost frame an exception was raised in: 'file:line in function'."""
    frames = traceback.extract_tb(e.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else "unknown place"


class Signalled(BaseException):
    """SIGINT or SIGTERM outside uvicorn's own handling (while the engine loads, or re-raised by uvicorn after its
    graceful shutdown): unwinds to exit_logged, which says so and ends the process by that signal."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def enable_faulthandler() -> None:
    """A native crash (segfault, abort in a kernel or library) prints every thread's Python stack to stderr."""
    try:
        faulthandler.enable(file=sys.stderr, all_threads=True)
    except (AttributeError, ValueError, io.UnsupportedOperation):  # stderr replaced by an object without a fd
        if sys.__stderr__ is not None:  # None without a console: no stream to write a crash to
            faulthandler.enable(file=sys.__stderr__, all_threads=True)


@contextmanager
def exit_logged() -> Iterator[None]:
    """Every way `eyas serve` ends leaves its cause in the log: a signal (which one; the process then ends by it,
    as uvicorn lets it), an exception (its type, message and where; the traceback follows), an exit status, a
    native crash (faulthandler's stacks), or a plain stop. SIGKILL alone leaves nothing: nothing runs."""
    enable_faulthandler()
    old: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        def on_signal(signum: int, _frame: Any) -> None:
            raise Signalled(signum)

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    except Signalled as e:
        say(f"stopped by {e}")
        for s, h in old.items():
            signal.signal(s, h)
        signal.signal(e.signum, signal.SIG_DFL)
        signal.raise_signal(e.signum)  # end as that signal ends a process: exit status 128 + signum
        raise
    except BaseException as e:
        code = e.code if isinstance(e, SystemExit) else getattr(e, "exit_code", None)  # click's Exit: exit_code
        if code is not None:
            say("stopped" if code == 0 else f"exiting with status {code} (the error above)")
        else:
            say(f"stopped by an unexpected error: {type(e).__name__}: {e} (at {where(e)})")
        raise
    else:
        say("stopped")
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def run(app: FastAPI, host: str, port: int, log_level: str = "info") -> None:
    stage(None)  # waiting for requests is idle, not silent
    make_server(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5).run()


def context_length_of(target: Any) -> int | None:
    cfg = text_config(target.model.config)
    n = getattr(cfg, "max_position_embeddings", None)
    return int(n) if n else None


def resolve_api_key(flag: str | None) -> str | None:
    return flag if flag is not None else (os.environ.get(API_KEY_ENV) or None)


def startup_line(cfg: ServeConfig, host: str, port: int, engine_desc: str) -> str:
    auth = "API key required" if cfg.api_key else "no API key"
    return (f"eyas serve: {cfg.model_name} ({engine_desc}) on http://{host}:{port}/v1 — {auth}; "
            f"max prompt {cfg.max_prompt_tokens} tokens, max new {cfg.max_new_tokens}")


