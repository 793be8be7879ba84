"""`mount()`: add vLLM's gRPC protocol to a host's own grpc.aio server."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc  # type: ignore[import-untyped]
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc  # type: ignore[import-untyped]
from grpc_reflection.v1alpha import reflection_pb2 as _reflection_pb2  # noqa: F401

from ._registration import HandlerRecorder, register, reject_undecodable, server_started
from .engine import EngineClient
from .health import EngineHealthServicer
from .kv_events import DEFAULT_MAX_SUBSCRIBERS
from .media import MediaRefOptions
from .proto import SERVICE_NAME, vllm_engine_pb2_grpc
from .reflection import ChainedPool
from .servicer import VllmEngineServicer

HEALTH_SERVICE_NAME: str = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
REFLECTION_SERVICE_NAME: str = reflection.SERVICE_NAME


class MountError(RuntimeError):
    """`mount()` cannot add the services to this server."""


@dataclasses.dataclass(frozen=True)
class MountedServices:
    """What `mount()` added to the server.

    Attributes:
        servicer: the VllmEngine servicer (its `active_requests` feeds drain logic).
        health: the `grpc.health.v1` servicer, or None when health was not mounted.
        service_names: full names of every service mounted, for reflection lists.
    """

    servicer: VllmEngineServicer
    health: EngineHealthServicer | None
    service_names: tuple[str, ...]


def mount(
    server: grpc.aio.Server,
    engine: EngineClient,
    *,
    health: bool = True,
    reflection_service: bool = True,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    max_kv_subscribers: int = DEFAULT_MAX_SUBSCRIBERS,
    media_refs: MediaRefOptions | None = None,
) -> MountedServices:
    """Serve `vllm.grpc.engine.VllmEngine` from `engine` on the host's `server`.

    Also mounts the standard health service (services "" and the VllmEngine
    name; NOT_SERVING while the engine is dead) and server reflection, each
    switchable. Call it before `server.start()`.

    Args:
        server: the host's grpc.aio server, built with its own options and
            interceptors; its other services are left as they are.
        engine: the host's vLLM `AsyncLLM` (or any `EngineClient`).
        health: mount `grpc.health.v1.Health`. Turn off when the host runs its
            own; `MountedServices.health` is then None.
        reflection_service: mount server reflection (v1alpha) for the mounted
            services: it resolves their files and imports, nothing else of the process.
        interceptors: grpc.aio server interceptors applied to the services
            mounted here only, outermost first.
        max_kv_subscribers: SubscribeKvEvents streams allowed at once; the
            next one is answered RESOURCE_EXHAUSTED.
        media_refs: serve Generate's `media_refs` (images by URL) by these
            rules; None (the default) refuses them with UNIMPLEMENTED.

    Returns:
        The servicers and service names mounted.

    Raises:
        MountError: the server has already been started.
    """
    if server_started(server):
        raise MountError(
            "mount() must be called before server.start(): grpc.aio serves handlers "
            "added after start only through a slow fallback path"
        )
    recorder = HandlerRecorder()
    servicer = VllmEngineServicer(
        engine, max_kv_subscribers=max_kv_subscribers, media_refs=media_refs
    )
    # Generated without annotations (grpc's plugin writes no types).
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(servicer, recorder)  # type: ignore[no-untyped-call]
    names = [SERVICE_NAME]

    health_servicer = None
    if health:
        health_servicer = EngineHealthServicer(engine, services=("", SERVICE_NAME))
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, recorder)
        names.append(HEALTH_SERVICE_NAME)

    if reflection_service:
        names.append(REFLECTION_SERVICE_NAME)
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
            reflection.aio.ReflectionServicer(tuple(names), pool=ChainedPool(services=names)),
            recorder,
        )

    wrap = _interceptor_chain(interceptors)
    engine_handlers = recorder.services[SERVICE_NAME]
    for method, handler in engine_handlers.items():
        engine_handlers[method] = reject_undecodable(f"/{SERVICE_NAME}/{method}", handler)
    for service_name, handlers in recorder.services.items():
        if wrap is not None:
            handlers = {
                method: wrap(f"/{service_name}/{method}", handler)
                for method, handler in handlers.items()
            }
        register(server, service_name, handlers)
    return MountedServices(servicer=servicer, health=health_servicer, service_names=tuple(names))


def _interceptor_chain(
    interceptors: Sequence[grpc.aio.ServerInterceptor],
) -> Callable[[str, grpc.RpcMethodHandler[Any, Any]], grpc.RpcMethodHandler[Any, Any]] | None:
    if not interceptors:
        return None
    from .interceptors._apply import apply_interceptors

    def wrap(
        method: str, handler: grpc.RpcMethodHandler[Any, Any]
    ) -> grpc.RpcMethodHandler[Any, Any]:
        return apply_interceptors(interceptors, method, handler)

    return wrap
