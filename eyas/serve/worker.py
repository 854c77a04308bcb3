"""The engine worker: one thread runs the generation jobs on one engine, a round (or a prefill chunk) at a time.

The model is not thread-safe, so jobs run off the event loop in this one thread, and each started job holds its
own KV cache and engine stream. Each pass of the worker gives every decoding job one round, then one prefill
chunk (Engine.prefill_chunk, set by the server) to the prefilling job whose turn it is: newly started jobs first,
shortest prompt first, then the prefilling ones in rotation. A decoding round costs a few tokens' forward and a
chunk hundreds, so a short request's first token waits for the chunk in progress and its own prefill, and each
later token about one chunk, however many long prompts are prefilling; those prompts still advance a chunk per pass
and none waits for another's whole prompt or generation.

Which jobs start: a long prompt (more than one prefill chunk) at once, up to `max_long` held by the server
(running or not yet started; the next one is refused with a 503 and Retry-After instead of queueing without
bound); a short prompt while fewer than `max_short` short ones run, else it waits in arrival order.

The worker pushes each round's accepted tokens (as decoded text) to the request's own asyncio queue, so
streams see tokens as soon as a round is verified and two requests' tokens never meet. A client that
disconnects sets its job's cancel flag; the worker checks it at every round boundary, prefill chunks included (and
before starting a waiting job), drops the generation, counts it in eyas_requests_abandoned_total by the phase it
was in and logs one line. Each job's tokens are what it gets alone: its stream, cache and sampler
are its own, and rounds of other jobs in between change nothing in it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from ..engine.params import EngineError
from ..text import TextStream
from .config import MAX_LONG_PROMPTS, PREFILL_CHUNK
from .metrics import Metrics
from .openai_schema import APIError

log = logging.getLogger("eyas.server")
MAX_SHORT_RUNNING = 4  # short-prompt jobs started at once (each holds its own KV cache); more wait in order


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
    long: bool = False  # more prompt tokens than one prefill chunk: counted against max_long until it ends
    ended: bool = False  # its last event is sent (the worker's own mark: counted out exactly once)

    def emit(self, ev: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, ev)
        except RuntimeError:  # the event loop is gone (server shutting down): nobody is listening
            self.cancelled.set()


def shutting_down() -> APIError:
    return APIError(503, "The server is shutting down and starts no new generations; retry the request once it is "
                         "back (or against another replica).", type="server_error", code="shutting_down")


def too_many_long(held: int, retry_s: int) -> APIError:
    return APIError(503, f"The server already holds {held} long prompts (--max-long-prompts {held}), the most it "
                         f"interleaves without making every request wait longer; retry in about {retry_s} s, or "
                         "send a shorter prompt.", type="server_error", code="server_busy", retry_after=retry_s)


class Worker:
    """Runs jobs on one engine, in one thread, a round at a time each (module docstring: which start, in what
    order). max_long: long prompts held at once; long_prompt: prompt tokens above which a prompt is long."""

    def __init__(self, engine: Any, tokenizer: Any, metrics: Metrics, max_long: int = MAX_LONG_PROMPTS,
                 long_prompt: int = PREFILL_CHUNK, max_short: int = MAX_SHORT_RUNNING):
        self.engine = engine
        self.tokenizer = tokenizer  # the worker's own copy: HF fast tokenizers are not safe across threads
        self.metrics = metrics
        self.max_long, self.long_prompt, self.max_short = max_long, long_prompt, max_short
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._waiting = 0  # submitted, not started
        self._long = 0  # long prompts held: submitted, not ended
        self._long_s = 0.0  # recent seconds from arrival to end of a long prompt's job (moving average)
        self._lock = threading.Lock()
        self._current: Job | None = None
        self._stopping = False

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="eyas-engine", daemon=True)
            self._thread.start()

    def drain(self) -> None:
        """Begin shutting down without waiting: new jobs are refused with a 503, waiting ones are answered with
        a 503, and running generations stop at their next round with a 503 (a stream: an error event, then
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
        """Queue a job; a 503 when shutting down, or when it is a long prompt and max_long are held."""
        with self._lock:
            if self._stopping:
                raise shutting_down()
            job.long = len(job.input_ids) > self.long_prompt
            if job.long:
                if self._long >= self.max_long:
                    raise too_many_long(self.max_long, self.retry_after())
                self._long += 1
            self._waiting += 1
            self.metrics.set("eyas_queue_depth", self._waiting)
            self._queue.put(job)

    def retry_after(self) -> int:
        """Seconds until a long prompt's place is likely free: a long job's recent duration over the number held
        (they end about that far apart), 1 to 60 (1 before any has ended)."""
        return min(60, max(1, math.ceil(self._long_s / max(1, self.max_long))))

    def _end(self, job: Job, ev: Event) -> None:
        """A job's last event: sent, and the job counted out (once, however it ended)."""
        if not job.ended:
            job.ended = True
            if job.long:
                with self._lock:
                    self._long -= 1
                    took = time.perf_counter() - job.arrived
                    self._long_s = took if self._long_s == 0 else 0.7 * self._long_s + 0.3 * took
        job.emit(ev)

    def _receive(self, waiting: deque[Job], block: bool) -> bool:
        """Move submitted jobs from the queue to `waiting` (blocking for the first one if asked); True once the
        drain's end marker is reached."""
        try:
            job = self._queue.get(block=block)
            while True:
                if job is None:
                    return True
                waiting.append(job)
                job = self._queue.get_nowait()
        except queue.Empty:
            return False

    def _admit(self, decoding: list[_Running], prefilling: deque[_Running], waiting: deque[Job]) -> None:
        """Start what may start (long prompts at once, short ones while a slot is free, in arrival order); answer
        waiting jobs whose client left, or all of them once draining. Started jobs go to the front of
        `prefilling`, shortest prompt first: each gets the next prefill turn."""
        short = sum(not r.job.long for r in (*decoding, *prefilling))
        started: list[_Running] = []
        for job in list(waiting):
            gone = self._stopping or job.cancelled.is_set()
            if not gone and not job.long and short >= self.max_short:
                continue
            waiting.remove(job)
            with self._lock:
                self._waiting -= 1
                self.metrics.set("eyas_queue_depth", self._waiting)
            if self._stopping:
                self.metrics.inc("eyas_requests_finished_total", endpoint=job.endpoint, finish_reason="shutdown")
                self._end(job, Event("error", error=shutting_down()))
            elif job.cancelled.is_set():  # the client left while it waited: never start it
                self.abandoned(job, "queued", "before it started")
            elif (run := self._guard(job, partial(_Running, self, job))) is not None:
                started.append(run)
                short += not job.long
        started.sort(key=lambda r: len(r.job.input_ids))
        prefilling.extendleft(reversed(started))

    def abandoned(self, job: Job, phase: str, when: str) -> None:
        """A job dropped because its client left (phase: queued, prefill or decode): counted, logged, ended."""
        self.metrics.inc("eyas_requests_finished_total", endpoint=job.endpoint, finish_reason="cancelled")
        self.metrics.inc("eyas_requests_abandoned_total", endpoint=job.endpoint, phase=phase)
        log.info("the client of a %s request (%d prompt tokens) left %s: dropped after %.1f s", job.endpoint,
                 len(job.input_ids), when, time.perf_counter() - job.arrived)
        self._end(job, Event("cancelled"))  # releases a non-streaming handler still waiting on this job

    def _loop(self) -> None:
        """Passes until drained: start what may start, one round for every decoding job, one prefill chunk."""
        decoding: list[_Running] = []
        prefilling: deque[_Running] = deque()
        waiting: deque[Job] = deque()  # taken off the queue, not started
        ending = False
        while True:
            if not ending:  # the thread sleeps only when nothing can run
                ending = self._receive(waiting, block=not decoding and not prefilling and not waiting)
            self._admit(decoding, prefilling, waiting)
            self.metrics.set("eyas_requests_running", len(decoding) + len(prefilling))
            if not decoding and not prefilling:  # (then a short one always had a slot: `waiting` is empty)
                if ending:
                    return
                continue
            for run in list(decoding):
                if not self._step(run):
                    decoding.remove(run)
            if prefilling:
                run = prefilling.popleft()
                if self._step(run):
                    (prefilling if run.prefilling else decoding).append(run)
            # before the thread may sleep on an empty queue: the gauge must not show ended jobs running
            self.metrics.set("eyas_requests_running", len(decoding) + len(prefilling))

    def _step(self, run: _Running) -> bool:
        """One round (or prefill chunk) of a started job; False once it has ended."""
        self._current = run.job
        try:
            return bool(self._guard(run.job, run.step, run.close))
        finally:
            self._current = None

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
        self._end(job, Event("error", error=error))
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
        self.stream: Generator[list[int], None, None] = worker.engine.stream(job.input_ids, job.params)
        self.prefilling = True  # no token yet: its rounds so far were prefill chunks
        self.chunks = 0  # prefill chunks run (for the line logged if its client leaves)
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
        if ids:
            self.prefilling = False
        elif self.prefilling:
            self.chunks += 1
        if job.cancelled.is_set() or w._stopping:  # round boundary: the client is gone, or the server
            self.close()
            self.cancelled()
            return False
        if ts.finish_reason is not None:  # the engine went past where the text ended: stop it
            self.close()
            self.done(None)
            return False
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
            w._end(job, Event("error", error=shutting_down()))
            return
        if self.prefilling:
            w.abandoned(job, "prefill", f"during its prefill ({self.chunks} chunks run)")
        else:
            w.abandoned(job, "decode", f"after {len(self.ts.ids)} generated tokens")

    def done(self, result: Any) -> None:
        """result: the engine's GenResult when it ended on its own, None when it was stopped early."""
        w, job, ts = self.w, self.job, self.ts
        if result is not None:
            w.metrics.record_generation(result.stats)
        finish = ts.finish_reason or (result.finish_reason if result is not None else "length")
        tail = ts.finish() if ts.finish_reason is None else ""
        if job.first_token_at is None and ts.ids:
            job.first_token_at = time.perf_counter()
        w._end(job, Event("done", text=tail, finish_reason=finish, completion_tokens=len(ts.ids)))
