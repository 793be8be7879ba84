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
too, so this holds no more than the app would, and no more than the launcher's
message size limit (`--max-message-bytes`, gRPC's too): a larger
`Content-Length` is refused 413 before a byte of the body is read, and a
chunked body as soon as its bytes pass the limit (uvicorn itself sets none).
It is parsed only when it can name `request_id` at all: the key's own bytes,
or a JSON escape that could spell them.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from ..budgets import check_request_id
from ..errors import InvalidRequestError

__all__ = ["HEADER", "Refusal", "checked", "error_body"]

Receive = Callable[[], Awaitable[dict[str, Any]]]
Refusal = tuple[int, dict[str, Any]]
"""An HTTP status and its body in vLLM's error shape."""

HEADER = "X-Request-Id"
_HEADER = HEADER.lower().encode()
_FIELD = "request_id"
_METHODS_WITH_BODIES = frozenset({"POST", "PUT", "PATCH"})
_CONTENT_LENGTH = b"content-length"
_TOO_LARGE = 413


async def checked(
    scope: dict[str, Any], receive: Receive, max_body_bytes: int | None = None
) -> tuple[Refusal | None, Receive]:
    """Check the request's ids and its body's size; the receive callable to hand the app on.

    Args:
        scope: the request's ASGI scope.
        receive: its ASGI receive callable.
        max_body_bytes: the largest body read (`--max-message-bytes`); None: any.

    Returns:
        (refusal, receive): a 400 naming the id's field or a 413 naming the
        limit, else None; once the body has been read, `receive` gives it
        again as one message.
    """
    for name, value in scope["headers"]:
        if name == _HEADER:
            refusal = _refusal(HEADER, value.decode("latin-1"))
            if refusal is not None:
                return refusal, receive
    if scope["type"] != "http" or scope.get("method") not in _METHODS_WITH_BODIES:
        return None, receive
    if max_body_bytes is not None:
        declared = _content_length(scope)
        if declared is not None and declared > max_body_bytes:
            return _too_large(declared, max_body_bytes), receive
    body, receive = await _whole_body(receive, max_body_bytes)
    if body is None:
        return _too_large(None, max_body_bytes), receive
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


def _content_length(scope: dict[str, Any]) -> int | None:
    for name, value in scope["headers"]:
        if name == _CONTENT_LENGTH:
            try:
                return int(value)
            except ValueError:  # uvicorn's parser refuses these before us
                return None
    return None


def _too_large(size: int | None, limit: int | None) -> Refusal:
    what = f"{size} bytes" if size is not None else "more bytes"
    message = (
        f"request body: {what}, more than this server's limit of {limit} bytes "
        "(--max-message-bytes)"
    )
    return _TOO_LARGE, error_body("body", message, _TOO_LARGE, "RequestEntityTooLargeError")


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


def error_body(
    field: str | None, message: str, code: int = 400, kind: str = "BadRequestError"
) -> dict[str, Any]:
    """An error's body as vLLM's own (`ErrorResponse`), so OpenAI clients read it."""
    return {"error": {"message": message, "type": kind, "param": field, "code": code}}


def _refusal(field: str, request_id: str) -> Refusal | None:
    try:
        check_request_id(field, request_id)
    except InvalidRequestError as exc:
        return 400, error_body(field, str(exc))
    return None


async def _whole_body(receive: Receive, max_bytes: int | None) -> tuple[bytes | None, Receive]:
    """The body (None: past `max_bytes`), and a receive that gives it as one
    message, then what follows."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client went: the app sees it too
            return b"", _replaying([message], receive)
        chunk = message.get("body", b"")
        size += len(chunk)
        if max_bytes is not None and size > max_bytes:
            # Counted as it streams: a chunked body has no Content-Length.
            chunks.clear()
            return None, receive
        chunks.append(chunk)
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
