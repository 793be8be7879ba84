"""The shared plumbing every interceptor of this package is built on.

`CallInterceptor` owns the gRPC details (the four handler kinds, their
serializers, unknown methods passed through as None, async-generator and
`context.write` streaming, and how a call ended); a subclass supplies only
its own logic through four hooks:

- `on_start(call)`: before the handler runs; may `await call.context.abort(...)`
  to reject the call (the handler then never runs).
- `on_request(call, message)`: each request message (unary or streamed).
- `on_response(call, message)`: each response message, either streaming style.
- `on_finish(call)`: exactly once per call that started, with `call.code` set:
  OK, the aborted code, CANCELLED (client cancel), DEADLINE_EXCEEDED or UNKNOWN.

Hooks that a subclass does not override cost nothing per message.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

MethodFilter = Callable[[str], bool]


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


class Call:
    """One RPC as the hooks see it.

    Attributes:
        method: "/package.Service/Method".
        service: "package.Service".
        name: "Method".
        kind: "unary_unary", "unary_stream", "stream_unary" or "stream_stream".
        metadata: the invocation metadata, a tuple of (key, value) pairs.
        context: the call's ServicerContext (None in on_finish of a call never run).
        started: time.perf_counter() when the call reached the interceptor.
        code: how the call ended (set before on_finish).
        state: free per-call storage for the interceptor.
    """

    __slots__ = ("code", "context", "kind", "metadata", "method", "name", "service", "started",
                 "state")

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
        self.state: dict[str, Any] = {}


def _ended_code(context: Any, exc: BaseException | None) -> grpc.StatusCode:
    if exc is None:
        code = context.code()
        # A handler may set a code without raising (context.set_code).
        return code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.OK
    if isinstance(exc, grpc.aio.AbortError):
        code = context.code()
        return code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN
    if isinstance(exc, asyncio.CancelledError):
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            return grpc.StatusCode.DEADLINE_EXCEEDED
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN


class _CountingContext:
    """Passes every attribute through to the real context; counts `write` calls."""

    __slots__ = ("_call", "_context", "_on_response")

    def __init__(self, context: Any, call: Call, on_response: Callable[[Call, Any], None]) -> None:
        self._context = context
        self._call = call
        self._on_response = on_response

    async def write(self, message: Any) -> None:
        self._on_response(self._call, message)
        await self._context.write(message)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


class CallInterceptor(grpc.aio.ServerInterceptor):
    """Base class: a grpc.aio server interceptor built from per-call hooks.

    Works both server-wide (`grpc.aio.server(interceptors=[...])`) and for the
    services `mount(..., interceptors=[...])` adds.

    Args:
        methods: which methods the interceptor applies to (default: all); the
            rest pass through untouched.
    """

    def __init__(self, *, methods: MethodFilter = all_methods) -> None:
        self._applies = methods
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

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method  # type: ignore[attr-defined]
        if handler is None or not self._applies(method):
            return handler
        metadata = handler_call_details.invocation_metadata  # type: ignore[attr-defined]
        return self._wrap(handler, method, metadata)

    def _wrap(self, handler: Any, method: str, metadata: Any) -> grpc.RpcMethodHandler:
        if handler.request_streaming and handler.response_streaming:
            kind, behaviour, factory = (
                "stream_stream", handler.stream_stream, grpc.stream_stream_rpc_method_handler
            )
        elif handler.request_streaming:
            kind, behaviour, factory = (
                "stream_unary", handler.stream_unary, grpc.stream_unary_rpc_method_handler
            )
        elif handler.response_streaming:
            kind, behaviour, factory = (
                "unary_stream", handler.unary_stream, grpc.unary_stream_rpc_method_handler
            )
        else:
            kind, behaviour, factory = (
                "unary_unary", handler.unary_unary, grpc.unary_unary_rpc_method_handler
            )
        if handler.response_streaming:
            wrapped: Any = self._streaming(behaviour, method, kind, metadata)
        else:
            wrapped = self._unary(behaviour, method, kind, metadata)
        return factory(  # type: ignore[no-any-return]
            wrapped,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _requests(self, call: Call, request: Any) -> Any:
        """The request (or request iterator) as the handler receives it."""
        if call.kind.startswith("unary"):
            if self._has_request_hook:
                self.on_request(call, request)
            return request
        if not self._has_request_hook:
            return request
        return self._counted_requests(call, request)

    async def _counted_requests(self, call: Call, requests: Any) -> AsyncIterator[Any]:
        async for message in requests:
            self.on_request(call, message)
            yield message

    def _unary(self, behaviour: Any, method: str, kind: str, metadata: Any) -> Any:
        async def unary_response(request: Any, context: Any) -> Any:
            call = Call(method, kind, metadata, context)
            await self._start(call)
            exc: BaseException | None = None
            try:
                response = await behaviour(self._requests(call, request), context)
                if self._has_response_hook:
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
            try:
                target = _CountingContext(context, call, self.on_response) if hooked else context
                result = behaviour(self._requests(call, request), target)
                if inspect.isasyncgen(result):
                    if hooked:
                        on_response = self.on_response
                        async for message in result:
                            on_response(call, message)
                            yield message
                    else:
                        async for message in result:
                            yield message
                elif inspect.isawaitable(result):
                    await result  # a context.write-style handler
                else:
                    for message in result:
                        if hooked:
                            self.on_response(call, message)
                        yield message
            except BaseException as error:
                exc = error
                raise
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
        call.code = _ended_code(call.context, exc)
        self.on_finish(call)
