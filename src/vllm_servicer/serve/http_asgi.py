"""The ASGI shapes the HTTP API's front hands around: a request's scope, its
events, the receive and send callables, an app.

A scope and an event are mappings of ASGI's keys (`type`, `path`, `headers`,
`body`, ...) to values of several types; what the front reads of them is
narrowed here, once, to what the ASGI specification says they hold.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import cast

__all__ = ["App", "Headers", "Message", "Receive", "Scope", "Send", "body_of", "headers_of"]

Scope = MutableMapping[str, object]
"""A connection's ASGI scope (`type`, `path`, `root_path`, `method`, `headers`, ...)."""

Message = MutableMapping[str, object]
"""An ASGI event received or sent (`{"type": "http.request", "body": ..., ...}`)."""

Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

Headers = Iterable[tuple[bytes, bytes]]
"""A scope's headers: (lower-case name, value) pairs, as bytes."""


def headers_of(scope: Scope) -> Headers:
    """The request's headers (ASGI's `scope["headers"]`)."""
    return cast(Headers, scope["headers"])


def body_of(message: Message) -> bytes:
    """An `http.request` event's part of the body (ASGI's `body`, empty when left out)."""
    return cast(bytes, message.get("body", b""))
