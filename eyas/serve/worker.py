"""The engine worker: one thread runs queued generation jobs in arrival order on one engine.

The model is not thread-safe, so requests queue FIFO and run off the event loop. A job whose prompt is
prefilled in chunks (Engine.prefill_chunk, set by the server) lets the jobs queued behind it start between its
chunks: the worker steps every started job one round (or chunk) in turn, so a short request's first token waits
about one chunk, not for someone else's whole prompt. Once a started job decodes, newcomers queue behind it.
The worker pushes each round's accepted tokens (as decoded text) to the request's own asyncio queue, so
streams see tokens as soon as a round is verified and two requests' tokens never meet. A client that
disconnects sets its job's cancel flag; the worker checks it at every round boundary (and before starting a
queued job) and drops the generation.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..engine.params import EngineError
from ..text import TextStream
from .metrics import Metrics
from .openai_schema import APIError

log = logging.getLogger("eyas.server")
MAX_ACTIVE = 4  # jobs started at once (each holds its own KV cache); the rest wait in the queue

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
    params: Any  # eyas.engine.params.SamplingParams
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
    """Runs jobs in arrival order on one engine, in one thread (interleaved only while prompts prefill)."""

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
        active: list[_Running] = []
        ending = False
        while True:
            # admit queued jobs: wait for one when nothing runs; otherwise only while every running job is still
            # prefilling (a long prompt's chunks then interleave with a newcomer's rounds, so its first token does
            # not wait for someone else's prompt); behind a decoding job the queue keeps its arrival order
            while not ending and len(active) < MAX_ACTIVE and all(r.prefilling for r in active):
                try:
                    job = self._queue.get(block=not active)
                except queue.Empty:
                    break
                if job is None:
                    ending = True
                    break
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
                run = self._guard(job, lambda job=job: _Running(self, job))
                if run is not None:
                    active.append(run)
            self.metrics.set("eyas_requests_running", len(active))
            if not active:
                if ending:
                    return
                continue
            for run in list(active):  # one round (or one prefill chunk) each, oldest first
                self._current = run.job
                if not self._guard(run.job, run.step, run.close):
                    active.remove(run)
                self._current = None
            self.metrics.set("eyas_requests_running", len(active))

    def _guard(self, job: Job, call: Callable[[], Any], close: Callable[[], None] | None = None) -> Any:
        """call() for one job; an error ends that job only (its client gets it) and returns None."""
        try:
            return call()
        except EngineError as e:  # the engine refused this request's input: the client's to fix
            error = APIError(400, str(e), code="invalid_value")
        except Exception as e:  # the engine failed on this request; the worker and server live on
            log.exception("generation failed")
            error = APIError(500, f"generation failed: {type(e).__name__}: {e}", type="server_error",
                             code="internal_error")
        if close is not None:
            close()
        self.metrics.inc("eyas_requests_finished_total", endpoint=job.endpoint, finish_reason="error")
        job.emit(Event("error", error=error))
        return None


class _Running:
    """One started job: its engine stream and its text, stepped one engine round (or prefill chunk) at a time
    by the worker, which may step other jobs in between."""

    def __init__(self, worker: Worker, job: Job):
        self.w, self.job = worker, job
        worker.metrics.observe("eyas_queue_wait_seconds", time.perf_counter() - job.arrived)
        job.emit(Event("start"))
        self.ts = TextStream(worker.tokenizer, job.stop, job.params.max_new_tokens)
        # the engine applies the same stop sequences and token limit, so it ends on the round where the
        # text ends and its GenResult (acceptance stats) is complete
        self.stream: Iterator[list[int]] = worker.engine.stream(job.input_ids, job.params)
        self.prefilling = True  # no token yet: only empty rounds (prefill chunks) so far
        worker.metrics.inc("eyas_generations_started_total")

    def close(self) -> None:
        self.stream.close()

    def step(self) -> bool:
        """One round; False once the job has ended (done, cancelled or stopped by shutdown)."""
        w, job, ts = self.w, self.job, self.ts
        w.engine.last_result = None  # jobs take turns on one engine: its result is read right after our round
        try:
            ids = next(self.stream)
        except StopIteration:
            self.done(w.engine.last_result)
            return False
        if job.cancelled.is_set() or w._stopping:  # round boundary: the client is gone, or the server
            self.close()
            self.cancelled()
            return False
        if ts.finish_reason is not None:  # the engine went past where the text ended: stop it
            self.close()
            self.done(None)
            return False
        if ids:
            self.prefilling = False
        w.metrics.inc("eyas_worker_tokens_total", len(ids))
        if job.first_token_at is None and ids:
            job.first_token_at = time.perf_counter()
        delta = ts.push(list(ids))
        if delta:
            job.emit(Event("delta", text=delta, completion_tokens=len(ts.ids)))
        return True

    def cancelled(self) -> None:
        w, job = self.w, self.job
        if w._stopping:  # the client may still be there: tell it why its answer ends here
            w.metrics.inc("eyas_requests_finished_total", endpoint=job.endpoint, finish_reason="shutdown")
            job.emit(Event("error", error=shutting_down()))
            return
        w.metrics.inc("eyas_requests_finished_total", endpoint=job.endpoint, finish_reason="cancelled")
        job.emit(Event("cancelled"))  # releases a non-streaming handler still waiting on this job

    def done(self, result: Any) -> None:
        """result: the engine's GenResult when it ended on its own, None when it was stopped early."""
        w, job, ts = self.w, self.job, self.ts
        if result is not None:
            w.metrics.record_generation(result.stats)
        finish = ts.finish_reason or (result.finish_reason if result is not None else "length")
        tail = ts.finish() if ts.finish_reason is None else ""
        if job.first_token_at is None and ts.ids:
            job.first_token_at = time.perf_counter()
        job.emit(Event("done", text=tail, finish_reason=finish, completion_tokens=len(ts.ids)))
