"""Running grpc.aio server interceptors for the mounted services only.

A grpc.aio server freezes its interceptor list when it is built. `mount()`
applies the host's interceptors to its own services by wrapping each method
handler: per call, the wrapper asks the interceptor chain for the handler
(exactly as the server would, with the call's method and metadata) and runs
what it returns. The same interceptor objects therefore behave the same
whether the host passes them to `grpc.aio.server(interceptors=...)` or to
`mount(..., interceptors=...)`.

A unary request reaches the wrapper as raw bytes and is parsed only after the
chain has resolved, with the deserializer of the handler it resolved to: a
call that an interceptor refuses (authentication) is never parsed, as with a
server-wide interceptor. Streamed requests are read only when the resolved
handler iterates them, which a refusing handler never does.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc

if TYPE_CHECKING:
    # grpc's generic aliases are not subscriptable at runtime.
    Continuation = Callable[
        [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
    ]


class CallDetails(grpc.HandlerCallDetails):
    """The method and metadata of one call, as interceptors receive them."""

    __slots__ = ("invocation_metadata", "method")

    def __init__(self, method: str, invocation_metadata: Any) -> None:
        self.method = method
        self.invocation_metadata = invocation_metadata


def _chain(interceptors: Sequence[grpc.aio.ServerInterceptor], handler: Any) -> Continuation:
    async def terminal(details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        return handler  # type: ignore[no-any-return]

    continuation: Continuation = terminal
    for interceptor in reversed(interceptors):
        continuation = _link(interceptor, continuation)
    return continuation


def _link(interceptor: grpc.aio.ServerInterceptor, following: Continuation) -> Continuation:
    async def continuation(
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        return await interceptor.intercept_service(following, details)

    return continuation


def apply_interceptors(
    interceptors: Sequence[grpc.aio.ServerInterceptor],
    method: str,
    handler: grpc.RpcMethodHandler[Any, Any],
) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler of the same kind as `handler` that runs `interceptors` around it."""
    chain = _chain(interceptors, handler)

    async def resolve(context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        resolved = await chain(CallDetails(method, context.invocation_metadata()))
        if resolved is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"method {method} not found")
        return resolved

    h: Any = handler
    if not h.request_streaming and not h.response_streaming:

        async def unary_unary(raw: bytes, context: Any) -> Any:
            resolved = await resolve(context)
            return await resolved.unary_unary(await _parse(resolved, raw, context), context)

        # No deserializer: grpc hands over the bytes, parsed once resolved.
        return grpc.unary_unary_rpc_method_handler(unary_unary, None, h.response_serializer)
    if not h.request_streaming:
        return grpc.unary_stream_rpc_method_handler(
            _streaming(resolve, "unary_stream"), None, h.response_serializer
        )
    if not h.response_streaming:

        async def stream_unary(requests: Any, context: Any) -> Any:
            return await (await resolve(context)).stream_unary(requests, context)

        return grpc.stream_unary_rpc_method_handler(
            stream_unary, h.request_deserializer, h.response_serializer
        )

    return grpc.stream_stream_rpc_method_handler(
        _streaming(resolve, "stream_stream"), h.request_deserializer, h.response_serializer
    )


def _streaming(resolve: Callable[[Any], Awaitable[Any]], kind: str) -> Any:
    """The wrapper of a response-streaming handler: relays the resolved behaviour's messages.

    The relay is inline (not a helper generator) so that each message makes one
    generator hop here, whether the behaviour yields or calls context.write.
    """

    async def streaming(request: Any, context: Any) -> AsyncIterator[Any]:
        resolved = await resolve(context)
        if kind == "unary_stream":
            request = await _parse(resolved, request, context)
        result = getattr(resolved, kind)(request, context)
        if inspect.isasyncgen(result):
            try:
                async for message in result:
                    yield message
            except BaseException:
                # Cancelled at our `yield`: close the handler's generator now, not at GC.
                await result.aclose()
                raise
        elif inspect.isawaitable(result):
            await result
        else:  # a sync iterator is the only other shape grpc accepts
            for message in result:
                yield message

    return streaming


async def _parse(handler: Any, raw: bytes, context: Any) -> Any:
    """The request as `handler` reads it, from the bytes grpc received."""
    deserializer = handler.request_deserializer
    if deserializer is None:
        return raw
    try:
        return deserializer(raw)
    except Exception:
        # grpc would answer UNKNOWN with the exception's class and text.
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request could not be parsed")
