"""Starting `eyas serve`: the engine through the one assembly, the API key and exposure warning, the startup
warnings and line, and uvicorn run so that shutdown drains the engine worker first (the app is eyas.serve.app)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from ..engine.decode import Engine
from ..engine.load import EngineOptions, EngineUse, load_engine
from ..target.load import Target
from ..target.template import draft_template_warning
from .app import API_KEY_ENV, ServeConfig
from .bounds import server_limits
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
        async def shutdown(self, sockets=None) -> None:
            worker.drain()
            await super().shutdown(sockets=sockets)

    return Server(uvicorn.Config(app, **{**server_limits(), **config}))


def run(app: FastAPI, host: str, port: int, log_level: str = "info") -> None:
    make_server(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5).run()


def context_length_of(target: Any) -> int | None:
    cfg = getattr(target.model.config, "text_config", None) or target.model.config
    n = getattr(cfg, "max_position_embeddings", None)
    return int(n) if n else None


def resolve_api_key(flag: str | None) -> str | None:
    return flag if flag is not None else (os.environ.get(API_KEY_ENV) or None)


def startup_line(cfg: ServeConfig, host: str, port: int, engine_desc: str) -> str:
    auth = "API key required" if cfg.api_key else "no API key"
    return (f"eyas serve: {cfg.model_name} ({engine_desc}) on http://{host}:{port}/v1 — {auth}; "
            f"max prompt {cfg.max_prompt_tokens} tokens, max new {cfg.max_new_tokens}")


