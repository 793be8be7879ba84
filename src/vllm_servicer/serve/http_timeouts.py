"""What uvicorn leaves open on the HTTP API's connections: a deadline for a
request's headers, and a cap on the connections held at once.

uvicorn's only timer on a connection is its keep-alive (`timeout_keep_alive`):
armed once a response is sent, cancelled by the first byte that follows. A
connection that opens and sends nothing, or sends part of a request line or of
its headers and then nothing (before its first request, or after a response
on a kept-alive connection), is held for ever: a socket, a file descriptor and
a parser each, in the process that serves the gRPC port too. No call slot
bounds them either: a request takes one only once its headers are read and
its key checked. uvicorn's `limit_concurrency` answers 503 only to a request
whose headers have come, so the connections that never finish theirs are
past its reach too.

`guarded_protocol` subclasses the HTTP protocol class uvicorn's config loads by
default ("auto": httptools when it is installed, else h11; both keep the
attributes used here) with both bounds:

- **Headers within a deadline** (`--http-header-timeout`): from the
  connection's opening, and from the end of each response on a kept-alive
  connection, a request's headers must be complete within the deadline; past
  it the connection is closed, with a 408 naming the flag when part of a
  request came (a connection that sent nothing is closed silently, as uvicorn
  closes an idle kept-alive one). The body has a deadline of its own once the
  headers are in (`--request-read-timeout`, `http_request_ids.py`). A TLS
  handshake comes before the protocol sees the connection; asyncio bounds it
  (60 s).
- **Connections at once** (`--max-http-connections`, per process): a
  connection past the cap is answered 503 naming the flag and closed as soon
  as it opens, before a byte of it is read, so a flood of them costs the
  process its descriptors for a moment only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

__all__ = [
    "DEFAULT_HTTP_HEADER_TIMEOUT",
    "DEFAULT_MAX_HTTP_CONNECTIONS",
    "guarded_protocol",
]

logger = logging.getLogger(__name__)

DEFAULT_HTTP_HEADER_TIMEOUT = 10.0
"""Seconds for a request's headers: a client sends them in one write, so a
slow link takes milliseconds; nginx's `client_header_timeout` is 60 s, but a
connection here also sits in the gRPC process's descriptor table."""

DEFAULT_MAX_HTTP_CONNECTIONS = 1024
"""Connections one process holds at once: each HTTP/1.1 connection runs one
request at a time, and `--max-inflight` (1,024 by default) bounds the requests
that do work anyway; the rest are a client pool's idle connections, which
uvicorn closes after 5 s."""

_LOG_EVERY_S = 60.0  # one warning a minute at most for refused connections


def _response(status: int, reason: str, message: str, kind: str) -> bytes:
    """A whole HTTP/1.1 response closing its connection, its body in vLLM's error shape."""
    body = json.dumps(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}
    ).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body


def _default_protocol() -> type[asyncio.Protocol]:
    """The class uvicorn's `Config(http="auto")` loads: httptools', else h11's."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    return AutoHTTPProtocol


def guarded_protocol(
    header_timeout: float,
    max_connections: int | None,
    base: type[asyncio.Protocol] | None = None,
) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class with a header deadline and a connection cap;
    pass it to `uvicorn.Config(http=...)`.

    Args:
        header_timeout: seconds a connection has to complete a request's headers,
            from its opening and from the end of each response.
        max_connections: most connections open at once in this process; None: any.
        base: the protocol class to extend (default: the one uvicorn loads for
            `http="auto"`).

    Raises:
        ValueError: a deadline not above 0, or a cap below 1.
    """
    _check_bounds(header_timeout, max_connections)
    parent = base if base is not None else _default_protocol()
    return _guarded_class(
        parent,
        header_timeout,
        max_connections,
        late=_late_response(header_timeout),
        full=_full_response(max_connections),
        refusals=_RefusalLog(max_connections),
    )


def _check_bounds(header_timeout: float, max_connections: int | None) -> None:
    if header_timeout <= 0:
        raise ValueError(f"header_timeout must be above 0, got {header_timeout}")
    if max_connections is not None and max_connections < 1:
        raise ValueError(f"max_connections must be at least 1, got {max_connections}")


def _late_response(header_timeout: float) -> bytes:
    """The 408 for a connection whose request's headers came late."""
    return _response(
        408,
        "Request Timeout",
        f"request headers not received in time: the limit (--http-header-timeout) is "
        f"{header_timeout:g} s from the connection's opening or the previous response; "
        "send a request's headers together",
        "RequestTimeoutError",
    )


def _full_response(max_connections: int | None) -> bytes:
    """The 503 for a connection past the cap."""
    return _response(
        503,
        "Service Unavailable",
        f"server busy: {max_connections} HTTP connections open, the limit "
        f"(--max-http-connections) is {max_connections}; retry later or reuse a connection",
        "ServiceUnavailableError",
    )


def _guarded_class(
    parent: Any,
    header_timeout: float,
    max_connections: int | None,
    *,
    late: bytes,
    full: bytes,
    refusals: _RefusalLog,
) -> type[asyncio.Protocol]:
    """`parent` (uvicorn's protocol class, whose attributes are not typed) closing
    connections whose headers come later than `header_timeout` (with `late`
    when part of a request came) and answering `full` to those past
    `max_connections`."""

    class GuardedHttpProtocol(parent):  # type: ignore[misc]
        """uvicorn's HTTP protocol, closing connections whose headers come late
        and refusing those past the cap."""

        _header_timer: asyncio.TimerHandle | None = None
        _bytes_since_armed = False

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)  # adds it to the server's connections
            if max_connections is not None and len(self.connections) > max_connections:
                refusals.note()
                transport.write(full)  # type: ignore[attr-defined]
                transport.close()
                return
            self._await_headers()

        def data_received(self, data: bytes) -> None:
            if self._header_timer is not None:
                self._bytes_since_armed = True  # a request has begun: a 408 tells it why
            super().data_received(data)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # Idle now, unless a request queued behind this one (pipelined)
            # already started: its headers are in.
            if not self.transport.is_closing() and (
                self.cycle is None or self.cycle.response_complete
            ):
                self._await_headers()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_header_timer()
            super().connection_lost(exc)

        def _await_headers(self) -> None:
            self._stop_header_timer()
            self._bytes_since_armed = False
            self._header_timer = self.loop.call_later(header_timeout, self._headers_late)

        def _stop_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            transport = self.transport
            # Closed already, or a websocket's now (its protocol took the transport).
            if transport.is_closing() or transport.get_protocol() is not self:
                return
            # A request whose headers came since the timer was armed is being
            # served: its body has a deadline of its own, in the app's front.
            if self.cycle is not None and not self.cycle.response_complete:
                return
            if self._bytes_since_armed:
                transport.write(late)
            transport.close()

    return GuardedHttpProtocol


class _RefusalLog:
    """Warns of refused connections at most once a minute, with their count."""

    def __init__(self, limit: int | None) -> None:
        self._limit = limit
        self._count = 0
        self._next = 0.0

    def note(self) -> None:
        self._count += 1
        now = time.monotonic()
        if now >= self._next:
            logger.warning(
                "HTTP API: %d connections refused past --max-http-connections (%s) "
                "since the last warning",
                self._count,
                self._limit,
            )
            self._count = 0
            self._next = now + _LOG_EVERY_S
