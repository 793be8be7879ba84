"""The hooks every interceptor of this package is built from.

A `CallInterceptor` supplies only its own logic, through hooks; the pipeline
(`_pipeline.py`) owns the gRPC details (the four handler kinds, their
serializers, async-generator and `context.write` streaming, how a call ended)
and calls the hooks of every interceptor of a call from one wrapper:

- `on_admit(method, metadata, context)`: before the request is parsed; raise
  `Refusal` to refuse the call (authentication). `context` is None when the
  server asks before the call runs (a server-wide interceptor).
- `on_start(call)`: before the handler runs and before any request message is
  read; may `await call.context.abort(...)` to reject the call (the handler
  then never runs).
- `on_request(call, message)`: each request message (unary, iterated or `context.read()`).
- `on_response(call, message)`: each response message, either streaming style;
  for a handler that streams by `yield`, only when `reads_responses(call)`
  said yes at the first one (a hook may read a record the handler keeps
  instead, see `vllm_servicer.wire.usage`).
- `on_finish(call)`: exactly once per call that started, with `call.code` set:
  OK, the aborted code, CANCELLED (client cancel), DEADLINE_EXCEEDED or UNKNOWN.

A hook that a subclass does not override is never called. However many
interceptors a call has, each streamed message makes one generator hop through
the wrapper, not one per interceptor.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

logger = logging.getLogger("vllm_servicer.interceptors")

MethodFilter = Callable[[str], bool]
"""A predicate on the full method name, "/package.Service/Method"."""

# A cancel this close to the deadline is the deadline (see ended_code): a
# fixed allowance plus a share of the call's age, since the server learns its
# deadline only when the call arrives, later than the client started its timer.
_DEADLINE_SLACK_S = 0.25
_DEADLINE_SLACK_SHARE = 0.1


def all_methods(method: str) -> bool:
    """The default filter: every method."""
    return True


def methods_of(*services: str) -> MethodFilter:
    """A filter matching every method of the named services (full names)."""
    prefixes = tuple(f"/{s}/" for s in services)
    return lambda method: method.startswith(prefixes)


def except_methods_of(*services: str) -> MethodFilter:
    """A filter matching every method except those of the named services."""
    inner = methods_of(*services)
    return lambda method: not inner(method)


def only_methods(*methods: str) -> MethodFilter:
    """A filter matching exactly the named methods ("/package.Service/Method")."""
    names = frozenset(methods)
    return names.__contains__


class Call:
    """One RPC as the hooks see it.

    Attributes:
        method: "/package.Service/Method".
        service: "package.Service".
        name: "Method".
        kind: "unary_unary", "unary_stream", "stream_unary" or "stream_stream".
        metadata: the invocation metadata, a tuple of (key, value) pairs.
        context: the call's ServicerContext.
        started: time.perf_counter() when the call reached the handler wrapper.
        code: how the call ended (None until just before on_finish).
        state: free per-call slot for the interceptor (None until it sets one).
    """

    __slots__ = (
        "code",
        "context",
        "kind",
        "metadata",
        "method",
        "name",
        "service",
        "started",
        "state",
    )

    def __init__(self, method: str, kind: str, metadata: Any, context: Any) -> None:
        self.method = method
        service, _, name = method[1:].rpartition("/")
        self.service = service
        self.name = name
        self.kind = kind
        self.metadata = metadata
        self.context = context
        self.started = time.perf_counter()
        self.code: grpc.StatusCode | None = None
        self.state: Any = None


def ended_code(context: Any, exc: BaseException | None, started: float) -> grpc.StatusCode:
    if exc is None:
        code = context.code()
        # A handler may set a code without raising (context.set_code).
        return code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.OK
    if isinstance(exc, grpc.aio.AbortError):
        code = context.code()
        return code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        # grpc cancels the handler task both for a client cancel and at the
        # deadline; only the time left tells them apart. The client's own timer
        # usually fires first and its cancel arrives a transit time before ours.
        # A cancel that lands while grpc awaits a write leaves the response
        # generators suspended: they are closed (GeneratorExit), not cancelled.
        remaining = context.time_remaining()
        slack = _DEADLINE_SLACK_S + _DEADLINE_SLACK_SHARE * (time.perf_counter() - started)
        if remaining is not None and remaining <= slack:
            return grpc.StatusCode.DEADLINE_EXCEEDED
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN


class Refusal(Exception):
    """Raised by `on_admit` to refuse a call before its request is read.

    Args:
        code: the status the call ends with.
        details: the status message.
        log: called with the call's context when the refusal is sent (to log it).
    """

    def __init__(
        self, code: grpc.StatusCode, details: str, log: Callable[[Any], None] | None = None
    ) -> None:
        super().__init__(details)
        self.code = code
        self.details = details
        self.log = log

    async def abort(self, context: Any, method: str) -> None:
        if self.log is not None:
            self.log(context)
        await context.abort(self.code, self.details)


class CallInterceptor(grpc.aio.ServerInterceptor):
    """Base class: a grpc.aio server interceptor built from per-call hooks.

    Works both server-wide (`grpc.aio.server(interceptors=[...])`, better as
    one `Pipeline([...])` for a stack) and for the services `mount(...,
    interceptors=[...])` adds. Handlers written as plain (sync) functions,
    which grpc.aio runs in its thread pool, pass through without hooks (or are
    refused, by an interceptor that `fails_closed`).

    Args:
        methods: which methods the interceptor applies to (default: all); the
            rest pass through untouched.
    """

    enclosing: grpc.aio.ServerInterceptor | None = None
    """An interceptor that must wrap this one's hooks (tracing's span), or None."""

    fails_closed = False
    """Whether a call this interceptor cannot check (a sync handler) is refused."""

    def __init__(self, *, methods: MethodFilter = all_methods) -> None:
        self._applies = methods
        self._applies_cache: dict[str, bool] = {}
        own = type(self)
        self.has_admit_hook = own.on_admit is not CallInterceptor.on_admit
        self.has_request_hook = own.on_request is not CallInterceptor.on_request
        self.has_response_hook = own.on_response is not CallInterceptor.on_response
        self._alone: Any = None

    # ----- hooks --------------------------------------------------------------

    async def on_admit(self, method: str, metadata: Any, context: Any) -> None:
        """Before the request is parsed; raise `Refusal` to refuse the call."""

    async def on_start(self, call: Call) -> None:
        """Before the handler; abort through `call.context` to reject the call."""

    def on_request(self, call: Call, message: Any) -> None:
        """Each request message."""

    def on_response(self, call: Call, message: Any) -> None:
        """Each response message."""

    def reads_responses(self, call: Call) -> bool:
        """Whether `on_response` sees the messages of `call` (default: yes).

        Asked once, at the call's first response message (the handler has
        begun by then), by a handler that streams by `yield`.
        """
        return True

    def on_finish(self, call: Call) -> None:
        """Once per started call, after it ended; `call.code` says how."""

    # ----- plumbing -----------------------------------------------------------

    def applies_to(self, method: str) -> bool:
        """Whether this interceptor runs for `method` ("/package.Service/Method")."""
        cached = self._applies_cache.get(method)
        if cached is None:
            # Unknown method names come from clients: bound the cache.
            cached = bool(self._applies(method))
            if len(self._applies_cache) < 4096:
                self._applies_cache[method] = cached
        return cached

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        # Alone (server-wide, not in a Pipeline): a pipeline of one.
        if self._alone is None:
            from ._pipeline import Pipeline

            self._alone = Pipeline((self,))
        return await self._alone.intercept_service(continuation, handler_call_details)  # type: ignore[no-any-return]

    def finish(self, call: Call, code: grpc.StatusCode) -> None:
        """Record how `call` ended and run `on_finish`, once."""
        if call.code is not None:
            return
        call.code = code
        try:
            self.on_finish(call)
        except Exception:
            # Bookkeeping must never change how the call ends.
            logger.exception("on_finish of %s failed for %s", type(self).__name__, call.method)
