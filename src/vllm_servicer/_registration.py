"""Collecting a service's method handlers before they reach the server.

grpc's generated `add_*_to_server` functions register straight onto a server.
Running them against a recorder instead gives this package each service's
method handlers, so `mount` can wrap them (interceptors for its services only)
and then register them on the host's server in one place.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import grpc


class HandlerRecorder:
    """Stands in for a server while generated code registers a service."""

    def __init__(self) -> None:
        self.services: dict[str, dict[str, grpc.RpcMethodHandler[Any, Any]]] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        # Generated code registers every method here too; the registered
        # handlers below carry the same methods, by name.
        pass

    def add_registered_method_handlers(
        self, service_name: str, method_handlers: dict[str, grpc.RpcMethodHandler[Any, Any]]
    ) -> None:
        self.services[service_name] = dict(method_handlers)


def server_started(server: Any) -> bool:
    """Whether a grpc.aio server has been started (False when it cannot tell)."""
    # grpc.aio.Server has no public "started" query; its core server is the only witness.
    core = getattr(server, "_server", None)
    is_running = getattr(core, "is_running", None)
    return bool(is_running()) if callable(is_running) else False


def register(
    server: Any, service_name: str, method_handlers: dict[str, grpc.RpcMethodHandler[Any, Any]]
) -> None:
    """Register one service's handlers on a server, as generated code would."""
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service_name, method_handlers),)
    )
    server.add_registered_method_handlers(service_name, method_handlers)


class UndecodableRequest:
    """Stands in for a request whose bytes did not parse (a DecodeError)."""

    __slots__ = ("error", "message_name")

    def __init__(self, message_name: str, error: Exception) -> None:
        self.message_name = message_name
        self.error = error


def _tolerant(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    message_name = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
    name = getattr(message_name, "full_name", "request")

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # grpc would answer UNKNOWN and log a traceback
            return UndecodableRequest(name, exc)

    return parse


async def _reject(context: Any, request: UndecodableRequest, method: str) -> None:
    from .errors import InvalidRequestError, abort_for_exception

    error = InvalidRequestError("request", f"not a valid {request.message_name}: {request.error}")
    await abort_for_exception(context, error, method=method)


def reject_undecodable(
    method: str, handler: grpc.RpcMethodHandler[Any, Any]
) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler that answers INVALID_ARGUMENT to bytes that do not parse as the request.

    grpc itself answers a request its deserializer rejects (e.g. invalid UTF-8
    in a string field) with UNKNOWN, which tells the client nothing. Only
    unary-request methods are wrapped (every method of VllmEngine).
    """
    if handler.request_streaming or handler.request_deserializer is None:
        return handler
    # A coroutine function or an async generator function: grpc's stubs describe
    # only the sync server's plain callables.
    behaviour: Any = handler.unary_stream if handler.response_streaming else handler.unary_unary
    if handler.response_streaming:

        async def unary_stream(request: Any, context: Any) -> Any:
            if type(request) is UndecodableRequest:
                await _reject(context, request, method)
            result = behaviour(request, context)
            if inspect.isasyncgen(result):
                async for message in result:
                    yield message
            else:
                await result

        return grpc.unary_stream_rpc_method_handler(
            unary_stream, _tolerant(handler.request_deserializer), handler.response_serializer
        )

    async def unary_unary(request: Any, context: Any) -> Any:
        if type(request) is UndecodableRequest:
            await _reject(context, request, method)
        return await behaviour(request, context)

    return grpc.unary_unary_rpc_method_handler(
        unary_unary, _tolerant(handler.request_deserializer), handler.response_serializer
    )
