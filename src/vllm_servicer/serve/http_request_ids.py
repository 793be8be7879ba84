"""HTTP request ids checked as gRPC's are, before vLLM's app reads them.

vLLM's HTTP handlers take a request's id from the `X-Request-Id` header, else
the JSON body's `request_id`, and copy it into each engine request's id
(`cmpl-<id>-<i>` for each prompt, each text of a pooling call) and on to the
engine core: a 512 KiB id with 1,024 prompts grew the launcher by 1.18 GB.
Every route does so in its own handler, so the one point before all of them
is the front of the app: here, after the caller's key is checked, the header
and the body's top-level `request_id` meet `budgets.check_request_id` (at most
`MAX_REQUEST_ID_CHARS`, no control characters), and a refusal is a 400 in
vLLM's error shape naming the field.

The body is read whole here and handed on as one message: vLLM reads it whole
too, so this holds no more than the app would. It is parsed only when it can
name `request_id` at all: the key's own bytes, or a JSON escape that could
spell them.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from ..budgets import check_request_id
from ..errors import InvalidRequestError

__all__ = ["HEADER", "checked", "error_body"]

Receive = Callable[[], Awaitable[dict[str, Any]]]

HEADER = "X-Request-Id"
_HEADER = HEADER.lower().encode()
_FIELD = "request_id"
_METHODS_WITH_BODIES = frozenset({"POST", "PUT", "PATCH"})


async def checked(
    scope: dict[str, Any], receive: Receive
) -> tuple[tuple[str, str] | None, Receive]:
    """Check the request's ids; the receive callable to hand the app on.

    Returns:
        ((field, message), receive) for an id refused, or (None, receive);
        once the body has been read, `receive` gives it again as one message.
    """
    for name, value in scope["headers"]:
        if name == _HEADER:
            refusal = _refusal(HEADER, value.decode("latin-1"))
            if refusal is not None:
                return refusal, receive
    if scope["type"] != "http" or scope.get("method") not in _METHODS_WITH_BODIES:
        return None, receive
    body, receive = await _whole_body(receive)
    text = _as_utf8(body)
    if _FIELD.encode() not in text and b"\\u" not in text:
        return None, receive
    try:
        data = json.loads(body)
    except ValueError:  # not JSON: vLLM's app answers that itself
        return None, receive
    given = data.get(_FIELD) if isinstance(data, dict) else None
    if isinstance(given, str):
        return _refusal(_FIELD, given), receive
    return None, receive


def _as_utf8(body: bytes) -> bytes:
    """The body's text in UTF-8, for the look for the field: JSON may come in
    UTF-16 or UTF-32 too (the parser detects them), where the field's name
    is not these bytes."""
    encoding = json.detect_encoding(body)
    if encoding == "utf-8":
        return body
    try:
        return body.decode(encoding).encode()
    except UnicodeDecodeError:
        return body


def error_body(field: str, message: str) -> dict[str, Any]:
    """A 400's body as vLLM's own (`ErrorResponse`), so OpenAI clients read it."""
    return {"error": {"message": message, "type": "BadRequestError", "param": field, "code": 400}}


def _refusal(field: str, request_id: str) -> tuple[str, str] | None:
    try:
        check_request_id(field, request_id)
    except InvalidRequestError as exc:
        return field, str(exc)
    return None


async def _whole_body(receive: Receive) -> tuple[bytes, Receive]:
    """The body, and a receive that gives it as one message, then what follows."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client went: the app sees it too
            return b"", _replaying([message], receive)
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    body = b"".join(chunks)
    chunks.clear()
    return body, _replaying([{"type": "http.request", "body": body, "more_body": False}], receive)


def _replaying(messages: list[dict[str, Any]], receive: Receive) -> Receive:
    async def replay() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        return await receive()

    return replay
