"""What one client can make the server hold, bounded: the request body's size, counted as it streams in
(a chunked body has no Content-Length to check first), the time the body may take, and the time a connection may
take to send its request headers (uvicorn's h11 protocol has none: a client that trickles header bytes would
hold its socket forever).

The limits are module constants read at call time, so a test can lower them.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import ClientDisconnect, Request

from .openai_schema import APIError

MAX_BODY = 16 << 20  # bytes; far above any prompt the token limit admits
BODY_IDLE_TIMEOUT_S = 15.0  # no body byte for this long: 408
BODY_TOTAL_TIMEOUT_S = 120.0  # the whole body, however it trickles in: 408 (16 MiB at ~140 KB/s still fits)
HEADER_TIMEOUT_S = 15.0  # from connect (or the previous response) to a complete request head: the socket is closed
MAX_HEADER_BYTES = 32 << 10  # h11's bound on an incomplete request head (request line + headers)
LINGER_S = 2.0  # after a response that closes the connection: how long unread request bytes are still drained


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


class LingeringTransport:
    """A connection's transport whose close() sends the response's end (FIN) first and closes for good once the
    client closes its side or LINGER_S have passed, discarding what still arrives meanwhile. Closing a socket that
    holds unread request bytes (a 413 for a body not read) makes the kernel send a reset, which can destroy the
    response before the client has read it: the client then sees a dropped connection instead of the 413."""

    def __init__(self, transport: Any, loop: asyncio.AbstractEventLoop):
        self._transport = transport
        self._loop = loop
        self.lingering = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def close(self) -> None:
        if self.lingering:
            return
        if self._transport.is_closing() or not self._transport.can_write_eof():
            self._transport.close()
            return
        self.lingering = True
        self._transport.write_eof()  # after the buffered response is flushed
        self._transport.resume_reading()  # flow control may have paused it on the unread body: drain it instead
        self._loop.call_later(LINGER_S, self._transport.close)

    def close_now(self) -> None:
        self._transport.close()

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()


def protocol_class() -> type:
    """uvicorn's h11 protocol plus a deadline for the request head (armed when a connection opens and after
    each response, disarmed once h11 has a complete request, and closing the socket if it fires first) and a
    lingering close (LingeringTransport).
    (Uvicorn's keep-alive timer is reset by every byte received, so a trickling client never trips it.)"""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class BoundedH11Protocol(H11Protocol):
        head_deadline: asyncio.TimerHandle | None = None

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
            super().connection_made(LingeringTransport(transport, self.loop))
            self.arm()

        def data_received(self, data: bytes) -> None:
            if self.transport.lingering:  # the response is sent and the connection closing: drain, discard
                return
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self.disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self.arm()

        def eof_received(self) -> None:
            if self.transport.lingering:  # the client read the response and closed its side
                self.transport.close_now()
            return super().eof_received()

        def connection_lost(self, exc: Exception | None) -> None:
            self.disarm()
            super().connection_lost(exc)

    return BoundedH11Protocol


def server_limits() -> dict[str, Any]:
    """uvicorn.Config arguments that bound a connection: the h11 protocol with a head deadline and a head size."""
    return {"http": protocol_class(), "h11_max_incomplete_event_size": MAX_HEADER_BYTES}
