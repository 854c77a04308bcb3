"""What one client can make the server hold, bounded: the request body's size, counted as it streams in
(a chunked body has no Content-Length to check first), the time the body may take, the time a connection may
take to send its request headers (uvicorn's h11 protocol has none: a client that trickles header bytes would
hold its socket forever) and the size of the request head however it arrives (h11 bounds only a head still
incomplete, so one that arrives whole in one read passed at any size).

The connection protocol also answers a client that half-closes (shuts down its sending side after a complete
request, as `nc -N` and some scripted clients do), whatever its HTTP version or Connection header: uvicorn takes
the end of input for a disconnect, closes the socket and the request is cancelled unanswered; here the request runs
on and its answer is sent.

The limits are module constants read at call time, so a test can lower them.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, cast

from starlette.requests import ClientDisconnect, Request

from .openai_schema import APIError

log = logging.getLogger("eyas.server")
MAX_BODY = 16 << 20  # bytes; far above any prompt the token limit admits
BODY_IDLE_TIMEOUT_S = 15.0  # no body byte for this long: 408
BODY_TOTAL_TIMEOUT_S = 120.0  # the whole body, however it trickles in: 408 (16 MiB at ~140 KB/s still fits)
HEADER_TIMEOUT_S = 15.0  # from connect (or the previous response) to a complete request head: the socket is closed
MAX_HEADER_BYTES = 32 << 10  # the request head (request line + headers), however it arrives: 431 above it
LINGER_S = 10.0  # after a response that closes the connection: how long unread request bytes are still drained
# (a client still sending a 16 MiB body on a loaded 2-core machine can take longer than 2 s: its 413 was lost)
# a client that ended its input while its request runs may have half-closed (it still reads) or closed for good:
# only a write tells them apart (a closed socket answers it with a reset), so a request whose answer has not
# started is probed this often with an interim "100 Continue" (RFC 9110 15.2: clients must accept unexpected 1xx),
# and a stream waiting for its next event sends an SSE comment this often (eyas.serve.app.stream_events)
PROBE_S = 1.0


def too_large(size: int | str) -> APIError:
    return APIError(413, f"the request body is {size} bytes; at most {MAX_BODY} are accepted. Send a smaller body.",
                    code="request_too_large")


async def read_body(request: Request) -> bytes | None:
    """The request body, refused (413) above MAX_BODY bytes: by its declared size before reading any of it, and
    by the bytes counted as they arrive (reading stops at the limit, so no more than MAX_BODY is ever held);
    408 when it stalls for BODY_IDLE_TIMEOUT_S or takes longer than BODY_TOTAL_TIMEOUT_S. None when the client
    left before sending it."""
    size = request.headers.get("content-length")
    if size is not None and "transfer-encoding" in request.headers:
        # two lengths for one body: the request-smuggling shape; RFC 9112 6.1 lets a server refuse it and close
        raise APIError(400, "the request has both Content-Length and Transfer-Encoding; send one of them",
                       code="ambiguous_framing")
    if size is not None and size.isdigit() and int(size) > MAX_BODY:
        raise too_large(int(size))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + BODY_TOTAL_TIMEOUT_S
    chunks = request.stream().__aiter__()
    body = bytearray()
    while True:
        wait = min(BODY_IDLE_TIMEOUT_S, deadline - loop.time())
        try:
            if wait <= 0:
                raise TimeoutError
            chunk = await asyncio.wait_for(chunks.__anext__(), wait)
        except StopAsyncIteration:
            return bytes(body)
        except ClientDisconnect:
            return None
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive in time ({len(body)} bytes read; a body may pause "
                                f"at most {BODY_IDLE_TIMEOUT_S:g} s and take at most {BODY_TOTAL_TIMEOUT_S:g} s). "
                                "Send the whole body at once.", code="request_timeout") from None
        body += chunk
        if len(body) > MAX_BODY:
            raise too_large(f"more than {MAX_BODY}")


def head_size(event: Any) -> int:
    """Bytes of an h11 Request's head as parsed: the request line and each header line (whitespace around a
    value, which h11 drops, is not counted)."""
    line = len(event.method) + len(event.target) + len(event.http_version) + 9  # "M T HTTP/v\r\n"
    return line + sum(len(k) + len(v) + 4 for k, v in event.headers.raw_items()) + 2


def head_problem(error: Exception | None, limit: int) -> tuple[int, str]:
    """(status, message) for a request head h11 refused with `error` (its RemoteProtocolError, when known)."""
    status = getattr(error, "error_status_hint", 400)
    if status != 431:
        return status, f"the request could not be read as HTTP/1.1 ({error or 'malformed'}); send a valid request"
    if str(error) == "Receive buffer too long":  # h11's words for a head still incomplete past the limit
        return 431, (f"the request head (request line and headers) is over {limit} bytes; at most {limit} are "
                     "accepted. Send fewer or shorter headers.")
    return 431, str(error)


def head_error(message: str, status: int) -> bytes:
    """The body of the answer to a request whose head could not be read (OpenAI's error shape)."""
    code = "request_header_too_large" if status == 431 else "invalid_http_request"
    return json.dumps(APIError(status, message, code=code).body()).encode()


class LingeringTransport:
    """A connection's transport whose close() sends the response's end (FIN) first and closes for good once the
    client closes its side or LINGER_S have passed, discarding what still arrives meanwhile. Closing a socket that
    holds unread request bytes (a 413 for a body not read) makes the kernel send a reset, which can destroy the
    response before the client has read it: the client then sees a dropped connection instead of the 413."""

    def __init__(self, transport: Any, loop: asyncio.AbstractEventLoop):
        self._transport = transport
        self._loop = loop
        self.lingering = False
        self.peer_eof = False  # the client ended its input (a half-close, or a close not yet known as one)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def close(self) -> None:
        if self.lingering:
            return
        if self.peer_eof or self._transport.is_closing() or not self._transport.can_write_eof():
            self._transport.close()  # after a client's end of input no unread bytes can follow: no reset
            return
        self.lingering = True
        self._transport.write_eof()  # after the buffered response is flushed
        self._transport.resume_reading()  # flow control may have paused it on the unread body: drain it instead
        self._loop.call_later(LINGER_S, self._transport.close)

    def close_now(self) -> None:
        self._transport.close()

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()


def connection_class() -> type:
    """h11's server connection with its head-size bound applied to every request head: h11 checks
    max_incomplete_event_size only while a head is incomplete, so a head that arrives whole in one read was
    accepted at any size while the same bytes in pieces got an error. Each protocol error it raises is kept
    (`error`) for the answer to name."""
    import h11

    class HeadBoundConnection(h11.Connection):
        error: h11.RemoteProtocolError | None = None

        def __init__(self, limit: int):
            super().__init__(h11.SERVER, max_incomplete_event_size=limit)
            self.limit = limit

        def next_event(self) -> Any:
            try:
                event = super().next_event()
            except h11.RemoteProtocolError as e:
                self.error = e
                raise
            if isinstance(event, h11.Request) and (size := head_size(event)) > self.limit:
                self.error = h11.RemoteProtocolError(
                    f"the request head (request line and headers) is {size} bytes; at most {self.limit} are "
                    "accepted. Send fewer or shorter headers.", error_status_hint=431)
                raise self.error
            return event

    return HeadBoundConnection


def half_close_mixin() -> type:
    """What a protocol needs to answer a client that half-closes: uvicorn's eof_received lets asyncio close the
    socket, which ends the request as a disconnect (the generation cancelled, nothing sent)."""
    import h11

    class AnswersHalfClose:
        probe_timer: asyncio.TimerHandle | None = None
        cycle: Any
        conn: Any
        loop: asyncio.AbstractEventLoop
        transport: Any
        client: tuple[str, int] | None

        def eof_received(self) -> bool | None:
            cycle = self.cycle
            # the whole request is here: h11 says DONE after a keep-alive request, MUST_CLOSE after one that
            # closes the connection (HTTP/1.0, or "Connection: close"); both were read to their end
            whole = self.conn.their_state in (h11.DONE, h11.MUST_CLOSE)
            if cycle is not None and not cycle.response_complete and whole:
                # and its answer is not: a half-close (RFC 9112 9.6 lets a client end its input and still
                # read), so keep the socket open to answer; a client gone for good is found by the next write
                # (the answer's own, or the probe's)
                self.transport.peer_eof = True
                cycle.keep_alive = False  # no further request can come: close once the answer is sent
                self.probe_timer = self.loop.call_later(PROBE_S, self.probe)
                host, port = (self.client or ("?", 0))[:2]
                log.info("%s:%s ended its input after its request (%s %s HTTP/%s): answering, then closing", host,
                         port, cycle.scope["method"], cycle.scope["path"], cycle.scope["http_version"])
                return True
            return super().eof_received()  # type: ignore[misc]

        def probe(self) -> None:
            """An interim 100 Continue to a client that ended its input while its answer is not started: a socket
            closed for good answers it with a reset, and the next probe's write then fails, which uvicorn reports as
            a disconnect (the generation is cancelled). A streamed answer probes by itself (its SSE comments). An
            HTTP/1.0 client gets no probe (RFC 9110 15.2: a server must not send it a 1xx): a whole answer to one
            that closed for good is found to be unread only when it is written."""
            self.probe_timer = None
            cycle = self.cycle
            if cycle is None or cycle.response_started or cycle.disconnected or self.transport.is_closing():
                return
            if (self.conn.their_http_version or b"1.0") < b"1.1":
                return
            try:
                interim = h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue")
                self.transport.write(self.conn.send(interim))
            except h11.LocalProtocolError:
                return
            self.probe_timer = self.loop.call_later(PROBE_S, self.probe)

        def connection_lost(self, exc: Exception | None) -> None:
            if self.probe_timer is not None:
                self.probe_timer.cancel()
            super().connection_lost(exc)  # type: ignore[misc]

    return AnswersHalfClose


def protocol_class() -> type:
    """uvicorn's h11 protocol plus a deadline for the request head (armed when a connection opens and after
    each response, disarmed once h11 has a complete request, and closing the socket if it fires first), a bound on
    the head's size however it arrives (connection_class) answered with one JSON error, a lingering close
    (LingeringTransport), and an answer for a client that half-closes after its request (eof_received).
    (Uvicorn's keep-alive timer is reset by every byte received, so a trickling client never trips it.)"""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    connection = connection_class()
    # the mixin is a class made at call time (h11 is imported lazily), which mypy cannot take as a base
    class BoundedH11Protocol(half_close_mixin(), H11Protocol):  # type: ignore[misc]
        head_deadline: asyncio.TimerHandle | None = None
        transport: Any  # a LingeringTransport (connection_made)
        conn: Any  # a HeadBoundConnection (connection_class)

        def __init__(self, config: Any, *args: Any, **kwargs: Any):
            super().__init__(config, *args, **kwargs)
            self.conn = connection(config.h11_max_incomplete_event_size or MAX_HEADER_BYTES)

        def arm(self) -> None:
            self.disarm()
            self.head_deadline = self.loop.call_later(HEADER_TIMEOUT_S, self.head_timed_out)

        def disarm(self) -> None:
            if self.head_deadline is not None:
                self.head_deadline.cancel()
                self.head_deadline = None

        def head_timed_out(self) -> None:
            self.head_deadline = None
            # still waiting for a request head (not inside a request: its body has timeouts of its own)
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            # duck-typed: it forwards what it does not override to the real transport
            super().connection_made(cast(asyncio.Transport, LingeringTransport(transport, self.loop)))
            self.arm()

        def data_received(self, data: bytes) -> None:
            if self.transport.lingering:  # the response is sent and the connection closing: drain, discard
                return
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self.disarm()

        def send_400_response(self, msg: str) -> None:
            """uvicorn's answer to a head h11 could not read (a text "Invalid HTTP request received.", always a
            400) as one JSON error with the status h11 suggests (431: the head is too large) and what was wrong,
            then close."""
            status, message = head_problem(self.conn.error, self.conn.limit)
            body = head_error(message, status)
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            try:
                for event in (h11.Response(status_code=status, headers=headers), h11.Data(data=body),
                              h11.EndOfMessage()):
                    self.transport.write(self.conn.send(event))
            except h11.LocalProtocolError:  # a response was already under way: nothing more can be said
                pass
            self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self.arm()

        # asyncio.Protocol's eof_received returns bool | None (True: keep the socket open); uvicorn's says None
        def eof_received(self) -> bool | None:  # type: ignore[override]
            if self.transport.lingering:  # the client read the response and closed its side
                self.transport.close_now()
                return None
            return super().eof_received()

        def connection_lost(self, exc: Exception | None) -> None:
            self.disarm()
            super().connection_lost(exc)

    return BoundedH11Protocol


def server_limits() -> dict[str, Any]:
    """uvicorn.Config arguments that bound a connection: the h11 protocol with a head deadline and a head size."""
    return {"http": protocol_class(), "h11_max_incomplete_event_size": MAX_HEADER_BYTES}
