"""`mount()`: add vLLM's gRPC protocol to a host's own grpc.aio server."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc  # type: ignore[import-untyped]
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc  # type: ignore[import-untyped]
from grpc_reflection.v1alpha import reflection_pb2 as _reflection_pb2  # noqa: F401

from ._registration import HandlerRecorder, register, server_started
from .budgets import RequestBudgets
from .engine import EngineClient
from .frontends import FrontendGroup
from .guard import EngineGuard
from .health import EngineHealthServicer
from .interceptors import InflightInterceptor, MetricsInterceptor, Pipeline
from .multimodal.decoded import DecodedMedia
from .multimodal.media import MediaRefOptions
from .options import DEFAULT_MAX_KV_SUBSCRIBERS
from .proto import (
    CONTROL_SERVICE,
    INFERENCE_SERVICE,
    SERVICE_NAME,
    control_pb2_grpc,
    inference_pb2_grpc,
    vllm_engine_pb2_grpc,
)
from .reflection import ChainedPool
from .servicer.control import ControlServicer
from .servicer.engine_call import EngineCallSteps
from .servicer.inference import InferenceServicer
from .servicer.lora import LoraRegistry
from .servicer.service import VllmEngineServicer
from .servicer.tenancy import RunningRequests
from .status import error_layer

HEALTH_SERVICE_NAME: str = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
REFLECTION_SERVICE_NAME: str = reflection.SERVICE_NAME


SERVICES: tuple[str, ...] = (SERVICE_NAME, INFERENCE_SERVICE, CONTROL_SERVICE)
"""Every protocol service `mount()` can serve, by full name."""
DEFAULT_SERVICES: tuple[str, ...] = (SERVICE_NAME, INFERENCE_SERVICE)
"""What `mount()` serves unless told: the inference protocols, not vLLM's Control."""


class MountError(RuntimeError):
    """`mount()` cannot add the services to this server."""


@dataclasses.dataclass(frozen=True)
class MountedServices:
    """What `mount()` added to the server.

    Attributes:
        servicer: the VllmEngine servicer.
        health: the `grpc.health.v1` servicer, or None when health was not mounted.
        service_names: full names of every service mounted, for reflection lists.
        inflight: the count of calls in flight (the one passed in `interceptors`,
            else one mount added): what GetServerInfo, the metrics gauge, a
            limit and a drain (`wait_idle`) read.
        inference: the `vllm.Inference` servicer, or None when not mounted.
        control: the `vllm.Control` servicer, or None when not mounted.
        guard: where every engine request claims its id and in-flight slot,
            for other ways in on the same engine (the launcher's HTTP API).
    """

    servicer: VllmEngineServicer
    health: EngineHealthServicer | None
    service_names: tuple[str, ...]
    inflight: InflightInterceptor
    inference: InferenceServicer | None = None
    control: ControlServicer | None = None
    guard: EngineGuard | None = None


def mount(
    server: grpc.aio.Server,
    engine: EngineClient,
    *,
    health: bool = True,
    reflection_service: bool = True,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    max_kv_subscribers: int = DEFAULT_MAX_KV_SUBSCRIBERS,
    media_refs: MediaRefOptions | None = None,
    shm_tensors: bool = False,
    services: Sequence[str] = DEFAULT_SERVICES,
    lora_modules: Mapping[str, str] | None = None,
    frontends: FrontendGroup | None = None,
    budgets: RequestBudgets | None = None,
) -> MountedServices:
    """Serve vLLM's gRPC protocols from `engine` on the host's `server`.

    `vllm.grpc.engine.VllmEngine` and vLLM's own `vllm.Inference` by default,
    `vllm.Control` when `services` names it. Also mounts the standard health
    service (services "" and each mounted name; NOT_SERVING while the engine
    is dead) and server reflection, each switchable. Call it before
    `server.start()`.

    Args:
        server: the host's grpc.aio server, built with its own options and
            interceptors; its other services are left as they are.
        engine: the host's vLLM `AsyncLLM` (or any `EngineClient`).
        health: mount `grpc.health.v1.Health`. Turn off when the host runs its
            own; `MountedServices.health` is then None.
        reflection_service: mount server reflection (v1alpha) for the mounted
            services: it resolves their files and imports, nothing else of the process.
        interceptors: grpc.aio server interceptors applied to the services
            mounted here only, outermost first. Those built on `CallInterceptor`
            (all of this package's) run from one wrapper per call. Without an
            `InflightInterceptor` among them, one without a limit is added
            innermost, to count the calls in flight.
        max_kv_subscribers: SubscribeKvEvents streams allowed at once; the
            next one is answered RESOURCE_EXHAUSTED.
        media_refs: serve Generate's `media_refs` (images by URL) by these
            rules; None (the default) refuses them with UNIMPLEMENTED.
        shm_tensors: take Generate's preprocessed tensors (`mm_inputs`)
            through this host's shared memory too. Off by default: a caller
            names the segment, and the server reads any its user can, so turn
            it on only where every caller is trusted with this host's shared
            memory (a router beside the server). Off, they come inline.
        services: the protocol services to mount, by full name (`SERVICES`).
            `vllm.Control` changes the engine for everyone (adapters, pause,
            sleep, shutdown): mount it where callers are authenticated and
            only administrators may call it (`AuthInterceptor` does so).
        lora_modules: LoRA adapters `vllm.Control` loads at first use, by
            name: their paths on this host (vLLM's `--lora-modules`).
        frontends: when this process is one of several serving one engine
            (`serve --api-server-count`, which builds it): their shared
            request ids, in-flight count and KV-event streams; joined
            (`FrontendGroup.join`) as this process's index.
        budgets: what one request may cost (decoded image pixels and bytes,
            `n`, constraint size, ids per Abort, shared-memory bytes) and the
            decoded images the process holds at once; None: the defaults
            (`RequestBudgets`). Past one, a call is refused before any engine work.

    Returns:
        The servicers and service names mounted.

    Raises:
        MountError: the server has already been started.
        TypeError: `engine` lacks a member of `EngineClient` (the message names it).
        ValueError: `services` names a service this package does not serve,
            or `frontends` has not been joined.
    """
    if server_started(server):
        raise MountError(
            "mount() must be called before server.start(): grpc.aio serves handlers "
            "added after start only through a slow fallback path"
        )
    unknown = sorted(set(services) - set(SERVICES))
    if unknown or not services:
        raise ValueError(f"services must be some of {', '.join(SERVICES)}; got {unknown or 'none'}")
    if frontends is not None and frontends.index < 0:
        raise ValueError("this process has not joined the frontend group: call join(index) first")
    pipeline, inflight = engine_pipeline(interceptors)
    recorder = HandlerRecorder()
    # One registry of running requests for every protocol: an id belongs to
    # its caller whichever protocol started it, and a drain aborts them all.
    running = RunningRequests(frontends)
    # One preparation of the engine call too: each protocol only converts its messages.
    steps = EngineCallSteps(engine, running)
    # One account of decoded images in flight for every protocol.
    budgets = budgets if budgets is not None else RequestBudgets()
    decoded_media = DecodedMedia(budgets)
    servicer = VllmEngineServicer(
        engine,
        max_kv_subscribers=max_kv_subscribers,
        media_refs=media_refs,
        active_calls=lambda: inflight.limited_everywhere,
        shm_tensors=shm_tensors,
        running=running,
        group=frontends,
        budgets=budgets,
        decoded_media=decoded_media,
        steps=steps,
    )
    # One adapter registry too (built once the engine's members are checked):
    # an adapter Control loads is one Inference's lora_name can name.
    loras = LoraRegistry(
        engine, lora_modules or {}, fixed=frontends is not None and frontends.count > 1
    )
    # Built first: Control tells it when the engine's state changes. Readiness
    # for the whole server ("") and each protocol served.
    served = tuple(
        name for name in (SERVICE_NAME, INFERENCE_SERVICE, CONTROL_SERVICE) if name in services
    )
    health_servicer = EngineHealthServicer(engine, services=("", *served)) if health else None
    names: list[str] = []
    if SERVICE_NAME in services:
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(servicer, recorder)  # type: ignore[no-untyped-call]
        names.append(SERVICE_NAME)
    inference = None
    if INFERENCE_SERVICE in services:
        inference = InferenceServicer(
            engine,
            running=running,
            media_refs=media_refs,
            loras=loras,
            budgets=budgets,
            decoded_media=decoded_media,
            steps=steps,
        )
        inference_pb2_grpc.add_InferenceServicer_to_server(inference, recorder)  # type: ignore[no-untyped-call]
        names.append(INFERENCE_SERVICE)
    control = None
    if CONTROL_SERVICE in services:
        control = ControlServicer(
            engine,
            running=running,
            active_calls=lambda: inflight.limited_everywhere,
            loras=loras,
            group=frontends,
            on_state_change=health_servicer.recheck if health_servicer is not None else None,
            budgets=budgets,
        )
        control_pb2_grpc.add_ControlServicer_to_server(control, recorder)  # type: ignore[no-untyped-call]
        names.append(CONTROL_SERVICE)

    if health_servicer is not None:
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, recorder)
        names.append(HEALTH_SERVICE_NAME)
    if reflection_service:
        names.append(REFLECTION_SERVICE_NAME)
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
            reflection.aio.ReflectionServicer(tuple(names), pool=ChainedPool(services=names)),
            recorder,
        )
    _register_wrapped(server, recorder, pipeline)
    return MountedServices(
        servicer=servicer,
        health=health_servicer,
        service_names=tuple(names),
        inflight=inflight,
        inference=inference,
        control=control,
        guard=EngineGuard(running, inflight),
    )


def _register_wrapped(
    server: grpc.aio.Server, recorder: HandlerRecorder, pipeline: Pipeline
) -> None:
    """Register each recorded handler on `server`, wrapped once by `pipeline`."""
    for service_name, handlers in recorder.services.items():
        # The protocols' methods raise; the error layer turns that into statuses.
        errors = error_layer if service_name in SERVICES else None
        wrapped = {
            method: pipeline.wrap(f"/{service_name}/{method}", handler, errors=errors)
            for method, handler in handlers.items()
        }
        register(server, service_name, wrapped)


def engine_pipeline(
    interceptors: Sequence[grpc.aio.ServerInterceptor],
) -> tuple[Pipeline, InflightInterceptor]:
    """The pipeline `mount()` runs its services' calls through, and its in-flight count.

    The count is the `InflightInterceptor` among `interceptors`, else one
    added innermost; every `MetricsInterceptor` reports it as its gauge.
    """
    stack = list(interceptors)
    inflight = _inflight_of(stack)
    if inflight is None:
        inflight = InflightInterceptor()
        stack.append(inflight)
    for interceptor in _flattened(stack):
        if isinstance(interceptor, MetricsInterceptor):
            interceptor.read_in_flight_from(inflight)
    return Pipeline(stack), inflight


def _flattened(
    interceptors: Sequence[grpc.aio.ServerInterceptor],
) -> list[grpc.aio.ServerInterceptor]:
    flat: list[grpc.aio.ServerInterceptor] = []
    for interceptor in interceptors:
        if isinstance(interceptor, Pipeline):
            flat.extend(_flattened(interceptor.interceptors))
        else:
            flat.append(interceptor)
    return flat


def _inflight_of(
    interceptors: Sequence[grpc.aio.ServerInterceptor],
) -> InflightInterceptor | None:
    found = [i for i in _flattened(interceptors) if isinstance(i, InflightInterceptor)]
    if len(found) > 1:
        raise MountError("more than one InflightInterceptor: calls would be counted twice")
    return found[0] if found else None
