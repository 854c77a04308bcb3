"""The engine worker: one thread runs queued generation jobs one at a time, in arrival order, on one engine.

The model is not thread-safe, so requests queue FIFO and run off the event loop. The worker pushes each
round's accepted tokens (as decoded text) to the request's own asyncio queue, so streams see tokens as soon
as a round is verified and two requests' tokens never meet. A client that disconnects sets its job's cancel
flag; the worker checks it at every round boundary (and before starting a queued job) and drops the generation.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..engine.params import EngineError
from ..text import TextStream
from .metrics import Metrics
from .openai_schema import APIError

log = logging.getLogger("eyas.server")

@dataclass
class Event:
    kind: str  # "start" | "delta" | "done" | "error" | "cancelled"
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    error: APIError | None = None


@dataclass
class Job:
    input_ids: list[int]
    params: Any  # eyas.engine.SamplingParams
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    arrived: float
    endpoint: str
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    first_token_at: float | None = None
    done: bool = False

    def emit(self, ev: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, ev)
        except RuntimeError:  # the event loop is gone (server shutting down): nobody is listening
            self.cancelled.set()


def shutting_down() -> APIError:
    return APIError(503, "The server is shutting down and starts no new generations; retry the request once it is "
                         "back (or against another replica).", type="server_error", code="shutting_down")


class Worker:
    """Runs jobs one at a time, in arrival order, on one engine, in one thread."""

    def __init__(self, engine: Any, tokenizer: Any, metrics: Metrics):
        self.engine = engine
        self.tokenizer = tokenizer  # the worker's own copy: HF fast tokenizers are not safe across threads
        self.metrics = metrics
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._waiting = 0
        self._lock = threading.Lock()
        self._current: Job | None = None
        self._stopping = False

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="eyas-engine", daemon=True)
            self._thread.start()

    def drain(self) -> None:
        """Begin shutting down without waiting: new jobs are refused with a 503, queued ones are answered with
        a 503, and the running generation stops at its next round with a 503 (a stream: an error event, then
        [DONE]). Idempotent."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            # under the lock, after the flag: every job a submit() put in the queue is ahead of this
            self._queue.put(None)

    def stop(self) -> None:
        """Shut down (drain) and wait for the worker thread to finish."""
        if self._thread is not None:
            self.drain()
            self._thread.join(timeout=60)
            self._thread = None

    def submit(self, job: Job) -> None:
        with self._lock:
            if self._stopping:
                raise shutting_down()
            self._waiting += 1
            self.metrics.set("eyas_queue_depth", self._waiting)
            self._queue.put(job)

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            with self._lock:
                self._waiting -= 1
                self.metrics.set("eyas_queue_depth", self._waiting)
            if self._stopping:
                self.metrics.inc("eyas_requests_finished_total", endpoint=job.endpoint, finish_reason="shutdown")
                job.emit(Event("error", error=shutting_down()))
                continue
            if job.cancelled.is_set():  # the client left while queued: never start it
                self.metrics.inc("eyas_requests_finished_total", endpoint=job.endpoint, finish_reason="cancelled")
                job.emit(Event("cancelled"))
                continue
            self.metrics.set("eyas_requests_running", 1)
            self._current = job
            try:
                self._run(job)
            except EngineError as e:  # the engine refused this request's input: the client's to fix
                self.metrics.inc("eyas_requests_finished_total", endpoint=job.endpoint, finish_reason="error")
                job.emit(Event("error", error=APIError(400, str(e), code="invalid_value")))
            except Exception as e:  # the engine failed on this request; the worker and server live on
                log.exception("generation failed")
                self.metrics.inc("eyas_requests_finished_total", endpoint=job.endpoint, finish_reason="error")
                job.emit(Event("error", error=APIError(500, f"generation failed: {type(e).__name__}: {e}",
                                                       type="server_error", code="internal_error")))
            finally:
                self._current = None
                self.metrics.set("eyas_requests_running", 0)

    def _run(self, job: Job) -> None:
        started = time.perf_counter()
        self.metrics.observe("eyas_queue_wait_seconds", started - job.arrived)
        job.emit(Event("start"))
        ts = TextStream(self.tokenizer, job.stop, job.params.max_new_tokens)
        # the engine applies the same stop sequences and token limit, so it ends on the round where the
        # text ends and its GenResult (acceptance stats) is complete
        stream: Iterator[list[int]] = self.engine.stream(job.input_ids, job.params)
        self.engine.last_result = None
        self.metrics.inc("eyas_generations_started_total")
        ended_early = cancelled = False
        try:
            for ids in stream:
                if job.cancelled.is_set() or self._stopping:  # round boundary: the client is gone, or the server
                    ended_early = cancelled = True
                    break
                if ts.finish_reason is not None:  # the engine went past where the text ended: stop it
                    ended_early = True
                    break
                self.metrics.inc("eyas_worker_tokens_total", len(ids))
                if job.first_token_at is None and ids:
                    job.first_token_at = time.perf_counter()
                delta = ts.push(list(ids))
                if delta:
                    job.emit(Event("delta", text=delta, completion_tokens=len(ts.ids)))
        finally:
            stream.close()
        if cancelled and self._stopping:  # the client may still be there: tell it why its answer ends here
            self.metrics.inc("eyas_requests_finished_total", endpoint=job.endpoint, finish_reason="shutdown")
            job.emit(Event("error", error=shutting_down()))
            return
        if cancelled:
            self.metrics.inc("eyas_requests_finished_total", endpoint=job.endpoint, finish_reason="cancelled")
            job.emit(Event("cancelled"))  # releases a non-streaming handler still waiting on this job
            return
        result = None if ended_early else self.engine.last_result
        if result is not None:
            self.metrics.record_generation(result.stats)
        finish = ts.finish_reason or (result.finish_reason if result is not None else "length")
        tail = ts.finish() if ts.finish_reason is None else ""
        if job.first_token_at is None and ts.ids:
            job.first_token_at = time.perf_counter()
        job.emit(Event("done", text=tail, finish_reason=finish, completion_tokens=len(ts.ids)))
