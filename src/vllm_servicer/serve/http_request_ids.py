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
or a JSON escape that could spell them; or when it is a `/tokenize` or
`/detokenize` body large enough to pass a render budget (`http_budgets.py`).

The read has the gRPC calls' deadline (`--request-read-timeout`, the call
slots' `read_deadline`) for each part of the body, as a gRPC client stream has
for each message, the first counted from just after the request's slot was
taken: a body that stalls (ten of a hundred declared bytes, then nothing) held
that slot, and its connection, for as long as its client liked. Past the
deadline the request is answered 408 naming the flag, its connection closed
(the rest of the body is never read) and its slot given back.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, TypedDict

from ..budgets import RequestBudgets, check_request_id
from ..errors import InvalidRequestError
from ..prefix_cache import keyed_body_uuids
from . import http_budgets
from .http_asgi import Message, Receive, Scope, body_of, headers_of

if TYPE_CHECKING:
    from ..interceptors._call import ClientWait, ReadDeadline

__all__ = ["HEADER", "UNREAD_BODY", "ErrorBody", "Refusal", "checked", "error_body"]


class ErrorDetail(TypedDict):
    """An error as vLLM's `ErrorResponse` states it."""

    message: str
    type: str
    param: str | None
    code: int


class ErrorBody(TypedDict):
    """The body of an error answer, in vLLM's shape."""

    error: ErrorDetail


Refusal = tuple[int, ErrorBody]
"""An HTTP status and its body in vLLM's error shape."""

HEADER = "X-Request-Id"
_HEADER = HEADER.lower().encode()
_FIELD = "request_id"
_UUID = b'"uuid"'
_FEATURES = b'"features"'
# The scale-out routes that take precomputed multimodal features (`--enable-scale-out`).
_FEATURE_PATHS = frozenset({"/inference/v1/generate"})
_FEATURES_REFUSAL = (
    "features: precomputed multimodal features are a router's (vLLM's caches find an item "
    "by the hash they name, another tenant's too); it needs the router role: a router key "
    "or an admin key"
)
_METHODS_WITH_BODIES = frozenset({"POST", "PUT", "PATCH"})
_CONTENT_LENGTH = b"content-length"
_TRANSFER_ENCODING = b"transfer-encoding"
_BODY_FRAMING = (_CONTENT_LENGTH, _TRANSFER_ENCODING)
_TOO_LARGE = 413
_TOO_LATE = 408

UNREAD_BODY = frozenset({_TOO_LARGE, _TOO_LATE})
"""Refusals sent before the body was read to its end: their connection must close."""


async def checked(
    scope: Scope,
    receive: Receive,
    max_body_bytes: int | None = None,
    *,
    read_deadline: ReadDeadline | None = None,
    wait: ClientWait | None = None,
    budgets: RequestBudgets | None = None,
    path: str = "",
    media_tenant: str | None = None,
) -> tuple[Refusal | None, Receive]:
    """Check the request's ids and its body's size; the receive callable to hand the app on.

    Args:
        scope: the request's ASGI scope.
        receive: its ASGI receive callable.
        max_body_bytes: the largest body read (`--max-message-bytes`); None: any.
        read_deadline: how long the whole body may take to arrive, from now
            (`--request-read-timeout`); None: as long as it likes.
        wait: the request's wait on its client, marked while a part of the
            body is awaited: the call slots may take its slot back then
            (`interceptors/_reclaim.py`), which ends the read with a 408.
        budgets: the render budgets `/tokenize` and `/detokenize` meet; None:
            not checked.
        path: the request's path without the root path (which budgets apply).
        media_tenant: the tenant whose media uuids the body's content parts
            name (`prefix_cache.keyed_tenant`): each is keyed for it before
            vLLM renders the chat and looks its media up by them, and its
            precomputed multimodal features (named by hash) are refused 403;
            None (a router, an admin, no keys): as sent.

    Returns:
        (refusal, receive): a 400 naming the id's field or a budget's, a 413
        naming the size limit or a 408 naming the read deadline, else None;
        once the body has been read, `receive` gives it again as one message.
    """
    refusal = _header_refusal(scope)
    if refusal is not None:
        return refusal, receive
    if scope["type"] != "http" or not _has_body(scope):
        return None, receive
    if max_body_bytes is not None:
        declared = _content_length(scope)
        if declared is not None and declared > max_body_bytes:
            return _too_large(declared, max_body_bytes), receive
    body, receive = await _whole_body(receive, max_body_bytes, read_deadline, wait)
    if isinstance(body, _Late):
        return _too_late(body.deadline, body.reason), receive
    if body is None:
        return _too_large(None, max_body_bytes), receive
    return await _checked_body(scope, receive, body, budgets, path, media_tenant)


def _header_refusal(scope: Scope) -> Refusal | None:
    """A 400 for an `X-Request-Id` header `budgets.check_request_id` refuses."""
    for name, value in headers_of(scope):
        if name == _HEADER:
            refusal = _refusal(HEADER, value.decode("latin-1"))
            if refusal is not None:
                return refusal
    return None


async def _checked_body(
    scope: Scope,
    receive: Receive,
    body: bytes,
    budgets: RequestBudgets | None,
    path: str,
    media_tenant: str | None,
) -> tuple[Refusal | None, Receive]:
    """`checked`'s verdict on the body read whole: parsed only when it can
    name what is checked (the id, a budget's field, media uuids, features),
    its media uuids keyed for `media_tenant`."""
    text = _as_utf8(body)
    escaped = b"\\u" in text  # a name may hide behind JSON escapes
    names_id = _FIELD.encode() in text or escaped
    names_uuid = media_tenant is not None and (_UUID in text or escaped)
    names_features = (
        media_tenant is not None and path in _FEATURE_PATHS and (_FEATURES in text or escaped)
    )
    budgeted = budgets is not None and http_budgets.may_pass(path, len(body), budgets)
    if not names_id and not budgeted and not names_uuid and not names_features:
        return None, receive
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # not JSON (or nested past the parser): vLLM's app answers
        return None, receive
    if budgeted and budgets is not None:
        try:
            http_budgets.check(path, data, budgets)
        except InvalidRequestError as exc:
            return (400, error_body(exc.field, str(exc))), receive
    if names_features and isinstance(data, dict) and data.get("features") is not None:
        # Precomputed multimodal features name their items by hash: vLLM's
        # caches hand another tenant's item to whoever names its hash.
        refused = error_body("features", _FEATURES_REFUSAL, 403, "PermissionDeniedError")
        return (403, refused), receive
    given = data.get(_FIELD) if isinstance(data, dict) else None
    if isinstance(given, str) and (refusal := _refusal(_FIELD, given)) is not None:
        return refusal, receive
    if names_uuid and media_tenant is not None and keyed_body_uuids(data, media_tenant):
        receive = await _with_body(scope, receive, json.dumps(data).encode())
    return None, receive


async def _with_body(scope: Scope, receive: Receive, body: bytes) -> Receive:
    """`receive` (which replays the body read) giving `body` in its place, the
    scope's `Content-Length` made to match."""
    await receive()  # the body read, replayed: in memory
    headers = [(k, v) for k, v in headers_of(scope) if k not in _BODY_FRAMING]
    scope["headers"] = [*headers, (_CONTENT_LENGTH, str(len(body)).encode())]
    return _replaying([{"type": "http.request", "body": body, "more_body": False}], receive)


def _has_body(scope: Scope) -> bool:
    """Whether the request may carry a body: its method's kind, or headers
    declaring one (a GET may send one too, which its connection waits on)."""
    if scope.get("method") in _METHODS_WITH_BODIES:
        return True
    for name, value in headers_of(scope):
        if name == _TRANSFER_ENCODING or (name == _CONTENT_LENGTH and value.strip() != b"0"):
            return True
    return False


def _content_length(scope: Scope) -> int | None:
    for name, value in headers_of(scope):
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


def _too_late(deadline: ReadDeadline | None, reason: str = "") -> Refusal:
    message = reason or (
        f"request body not received in time: the limit ({deadline.limit}) is "
        f"{deadline.seconds:g} s for each part of the body; send the body with the headers"
        if deadline is not None
        else "request body not received"
    )
    return _TOO_LATE, error_body("body", message, _TOO_LATE, "RequestTimeoutError")


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
) -> ErrorBody:
    """An error's body as vLLM's own (`ErrorResponse`), so OpenAI clients read it."""
    return {"error": {"message": message, "type": kind, "param": field, "code": code}}


def _refusal(field: str, request_id: str) -> Refusal | None:
    try:
        check_request_id(field, request_id)
    except InvalidRequestError as exc:
        return 400, error_body(field, str(exc))
    return None


class _Late:
    """A body that did not arrive within its deadline, or whose slot was taken
    back while it stalled (`reason`)."""

    __slots__ = ("deadline", "reason")

    def __init__(self, deadline: ReadDeadline | None, reason: str = "") -> None:
        self.deadline = deadline
        self.reason = reason


async def _whole_body(
    receive: Receive,
    max_bytes: int | None,
    deadline: ReadDeadline | None = None,
    wait: ClientWait | None = None,
) -> tuple[bytes | None | _Late, Receive]:
    """The body (None: past `max_bytes`; `_Late`: not all there within
    `deadline`, or `wait` cut short), and a receive that gives it as one
    message, then what follows."""
    chunks: list[bytes] = []
    size = 0
    # Each part within the deadline, as each message of a gRPC client stream:
    # a large body over a slow link keeps coming; a stalled one ends here. (A
    # body that keeps trickling holds its slot on, one of its tenant's share.)
    late = None if deadline is None else _Late(deadline)
    seconds = None if deadline is None else deadline.seconds
    while True:
        try:
            if wait is not None:
                wait.since = asyncio.get_running_loop().time()
            async with asyncio.timeout(seconds):
                message = await receive()
        except TimeoutError:
            if late is None:  # not this read's: a deadline of its caller's
                raise
            chunks.clear()
            return late, receive
        except asyncio.CancelledError:
            # Its slot went to another tenant's caller while it stalled.
            if wait is None or not wait.expired or wait.task is None or wait.task.uncancel():
                raise
            chunks.clear()
            return _Late(deadline, wait.reason), receive
        finally:
            if wait is not None:
                wait.since = None
        if message["type"] != "http.request":  # the client went: the app sees it too
            return b"", _replaying([message], receive)
        chunk = body_of(message)
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


def _replaying(messages: list[Message], receive: Receive) -> Receive:
    async def replay() -> Message:
        if messages:
            return messages.pop(0)
        return await receive()

    return replay
