"""The shared plumbing every interceptor of this package is built on.

`CallInterceptor` owns the gRPC details (the four handler kinds, their
serializers, unknown methods passed through as None, async-generator and
`context.write` streaming, and how a call ended); a subclass supplies only
its own logic through four hooks:

- `on_start(call)`: before the handler runs and before any request message is
  read; may `await call.context.abort(...)` to reject the call (the handler
  then never runs).
- `on_request(call, message)`: each request message (unary, iterated or `context.read()`).
- `on_response(call, message)`: each response message, either streaming style.
- `on_finish(call)`: exactly once per call that started, with `call.code` set:
  OK, the aborted code, CANCELLED (client cancel), DEADLINE_EXCEEDED or UNKNOWN.

A hook that a subclass does not override is never called, but every response
message of a streamed call still makes one generator hop through the wrapper.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

logger = logging.getLogger("vllm_servicer.interceptors")

MethodFilter = Callable[[str], bool]
"""A predicate on the full method name, "/package.Service/Method"."""

# grpc.aio's own test for "run on the event loop" (anything else goes to its thread pool).
_is_async = inspect.iscoroutinefunction
_is_async_gen = inspect.isasyncgenfunction

# A cancel this close to the deadline is the deadline (see _ended_code): a
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


def _ended_code(context: Any, exc: BaseException | None, started: float) -> grpc.StatusCode:
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


class _HookedContext:
    """The real context, with `read` and `write` reported to the hooks."""

    __slots__ = ("_call", "_context", "_on_request", "_on_response")

    def __init__(
        self,
        context: Any,
        call: Call,
        on_request: Callable[[Call, Any], None] | None,
        on_response: Callable[[Call, Any], None] | None,
    ) -> None:
        self._context = context
        self._call = call
        self._on_request = on_request
        self._on_response = on_response

    async def read(self) -> Any:
        message = await self._context.read()
        if self._on_request is not None and message is not grpc.aio.EOF:
            self._on_request(self._call, message)
        return message

    async def write(self, message: Any) -> None:
        if self._on_response is not None:
            self._on_response(self._call, message)
        await self._context.write(message)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


class CallInterceptor(grpc.aio.ServerInterceptor):
    """Base class: a grpc.aio server interceptor built from per-call hooks.

    Works both server-wide (`grpc.aio.server(interceptors=[...])`) and for the
    services `mount(..., interceptors=[...])` adds. Handlers written as plain
    (sync) functions, which grpc.aio runs in its thread pool, pass through
    without hooks.

    Args:
        methods: which methods the interceptor applies to (default: all); the
            rest pass through untouched.
    """

    def __init__(self, *, methods: MethodFilter = all_methods) -> None:
        self._applies = methods
        self._applies_cache: dict[str, bool] = {}
        own = type(self)
        self._has_request_hook = own.on_request is not CallInterceptor.on_request
        self._has_response_hook = own.on_response is not CallInterceptor.on_response

    # ----- hooks --------------------------------------------------------------

    async def on_start(self, call: Call) -> None:
        """Before the handler; abort through `call.context` to reject the call."""

    def on_request(self, call: Call, message: Any) -> None:
        """Each request message."""

    def on_response(self, call: Call, message: Any) -> None:
        """Each response message."""

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
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or not self.applies_to(method):
            return handler
        metadata = handler_call_details.invocation_metadata
        return self._wrap(handler, method, metadata)

    def _wrap(self, handler: Any, method: str, metadata: Any) -> grpc.RpcMethodHandler[Any, Any]:
        if handler.request_streaming and handler.response_streaming:
            kind, behaviour, factory = (
                "stream_stream",
                handler.stream_stream,
                grpc.stream_stream_rpc_method_handler,
            )
        elif handler.request_streaming:
            kind, behaviour, factory = (
                "stream_unary",
                handler.stream_unary,
                grpc.stream_unary_rpc_method_handler,
            )
        elif handler.response_streaming:
            kind, behaviour, factory = (
                "unary_stream",
                handler.unary_stream,
                grpc.unary_stream_rpc_method_handler,
            )
        else:
            kind, behaviour, factory = (
                "unary_unary",
                handler.unary_unary,
                grpc.unary_unary_rpc_method_handler,
            )
        if not (_is_async(behaviour) or _is_async_gen(behaviour)):
            # Our wrapper would run it on the event loop instead of grpc's thread pool.
            return handler  # type: ignore[no-any-return]
        if handler.response_streaming:
            wrapped: Any = self._streaming(behaviour, method, kind, metadata)
        else:
            wrapped = self._unary(behaviour, method, kind, metadata)
        return factory(
            wrapped,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _context_for(self, call: Call, context: Any) -> Any:
        """The context the handler gets: hooked where it can read or write messages."""
        on_request = self.on_request if self._has_request_hook and call.kind[0] == "s" else None
        on_response = (
            self.on_response if self._has_response_hook and call.kind.endswith("stream") else None
        )
        if on_request is None and on_response is None:
            return context
        return _HookedContext(context, call, on_request, on_response)

    def _requests(self, call: Call, request: Any) -> Any:
        """The request (or request iterator) as the handler receives it."""
        if not self._has_request_hook:
            return request
        if call.kind[0] == "u":
            self.on_request(call, request)
            return request
        return self._counted_requests(call, request)

    async def _counted_requests(self, call: Call, requests: Any) -> AsyncIterator[Any]:
        on_request = self.on_request
        async for message in requests:
            on_request(call, message)
            yield message

    def _unary(self, behaviour: Any, method: str, kind: str, metadata: Any) -> Any:
        hooked = self._has_response_hook

        async def unary_response(request: Any, context: Any) -> Any:
            call = Call(method, kind, metadata, context)
            await self._start(call)
            exc: BaseException | None = None
            try:
                response = await behaviour(
                    self._requests(call, request), self._context_for(call, context)
                )
                if hooked and response is not None:
                    self.on_response(call, response)
                return response
            except BaseException as error:
                exc = error
                raise
            finally:
                self._finish(call, exc)

        return unary_response

    def _streaming(self, behaviour: Any, method: str, kind: str, metadata: Any) -> Any:
        hooked = self._has_response_hook

        async def streaming_response(request: Any, context: Any) -> AsyncIterator[Any]:
            call = Call(method, kind, metadata, context)
            await self._start(call)
            exc: BaseException | None = None
            result: Any = None
            try:
                result = behaviour(self._requests(call, request), self._context_for(call, context))
                if inspect.isasyncgen(result):
                    if hooked:
                        on_response = self.on_response
                        async for message in result:
                            on_response(call, message)
                            yield message
                    else:
                        async for message in result:
                            yield message
                else:
                    await result  # a context.write-style handler
            except BaseException as error:
                exc = error
                raise
            finally:
                try:
                    if exc is not None and inspect.isasyncgen(result):
                        # Cancelled at our `yield`, the handler's generator is still
                        # suspended at its own: close it now (its cleanup, e.g. an
                        # engine abort, runs before on_finish) rather than at GC.
                        await result.aclose()
                finally:
                    self._finish(call, exc)

        return streaming_response

    async def _start(self, call: Call) -> None:
        try:
            await self.on_start(call)
        except BaseException as error:
            # A rejected call still ends exactly once, with the code it got.
            self._finish(call, error)
            raise

    def _finish(self, call: Call, exc: BaseException | None) -> None:
        if call.code is not None:
            return
        call.code = _ended_code(call.context, exc, call.started)
        try:
            self.on_finish(call)
        except Exception:
            # Bookkeeping must never change how the call ends.
            logger.exception("on_finish of %s failed for %s", type(self).__name__, call.method)
