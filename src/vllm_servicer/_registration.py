"""Collecting a service's method handlers before they reach the server.

grpc's generated `add_*_to_server` functions register straight onto a server.
Running them against a recorder instead gives this package each service's
method handlers, so `mount` can wrap them (interceptors for its services only)
and then register them on the host's server in one place.
"""

from __future__ import annotations

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
