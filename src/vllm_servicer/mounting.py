"""`mount()`: add vLLM's gRPC protocol to a host's own grpc.aio server."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, NamedTuple

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
from .interceptors import (
    CallInterceptor,
    InflightInterceptor,
    LoadReportInterceptor,
    MountContext,
    Pipeline,
)
from .multimodal.media import MediaRefOptions
from .options import DEFAULT_MAX_KV_SUBSCRIBERS, MountOptions
from .proto import (
    CONTROL_SERVICE,
    INFERENCE_SERVICE,
    ORCA_SERVICE,
    POOLING_SERVICE,
    RENDER_SERVICE,
    SERVICE_NAME,
    control_pb2_grpc,
    inference_pb2_grpc,
    orca_pb2_grpc,
    pooling_pb2_grpc,
    render_pb2_grpc,
    vllm_engine_pb2_grpc,
)
from .reflection import ChainedPool
from .servicer.control import ControlServicer
from .servicer.inference import InferenceServicer
from .servicer.orca import OpenRcaServicer
from .servicer.pooling import PoolingServicer
from .servicer.render import RenderServicer
from .servicer.service import VllmEngineServicer
from .servicer.state import MountState
from .status import error_layer
from .wire import fields

HEALTH_SERVICE_NAME: str = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
REFLECTION_SERVICE_NAME: str = reflection.SERVICE_NAME


SERVICES: tuple[str, ...] = (
    SERVICE_NAME,
    INFERENCE_SERVICE,
    CONTROL_SERVICE,
    POOLING_SERVICE,
    RENDER_SERVICE,
)
"""Every protocol service `mount()` can serve, by full name."""
DEFAULT_SERVICES: tuple[str, ...] = (
    SERVICE_NAME,
    INFERENCE_SERVICE,
    POOLING_SERVICE,
    RENDER_SERVICE,
)
"""What `mount()` serves unless told: the inference protocols, pooling and
rendering (each refuses what the model cannot do), not vLLM's Control."""


class MountError(RuntimeError):
    """`mount()` cannot add the services to this server."""


@dataclasses.dataclass(frozen=True)
class MountedServices:
    """What `mount()` added to the server, and the state its servicers share.

    Attributes:
        state: what every mounted servicer shares: the running requests (every
            protocol's, which a drain aborts), the count in flight, the LoRA
            adapters, the frontend group (`MountState`).
        inflight: the count of calls in flight (`state.inflight`: the one
            passed in `interceptors`, else one mount added): what
            GetServerInfo, the metrics gauge, a limit and a drain (`wait_idle`) read.
        guard: where every engine request claims its id and in-flight slot,
            for other ways in on the same engine (the launcher's HTTP API).
        service_names: full names of every service mounted, for reflection lists.
        health: the `grpc.health.v1` servicer, or None when health was not mounted.
        servicer: the VllmEngine servicer, or None when not mounted.
        inference: the `vllm.Inference` servicer, or None when not mounted.
        control: the `vllm.Control` servicer, or None when not mounted.
        pooling: the `vllm_servicer.v1.Pooling` servicer, or None when not mounted.
        render: the `vllm_servicer.v1.Render` servicer, or None when not mounted.
        load_reports: the ORCA `OpenRcaService` servicer, or None when the
            mount sends no load reports.
    """

    state: MountState
    inflight: InflightInterceptor
    guard: EngineGuard
    service_names: tuple[str, ...]
    health: EngineHealthServicer | None
    servicer: VllmEngineServicer | None = None
    inference: InferenceServicer | None = None
    control: ControlServicer | None = None
    pooling: PoolingServicer | None = None
    render: RenderServicer | None = None
    load_reports: OpenRcaServicer | None = None


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
    load_reports: bool = True,
    stream_interval: int = 1,
    stream_interval_min_inflight: int = 0,
    chat_template: str | None = None,
    routing_data_for_every_key: bool = False,
    shared_prefix_cache: bool = False,
) -> MountedServices:
    """Serve vLLM's gRPC protocols from `engine` on the host's `server`.

    `vllm.grpc.engine.VllmEngine` and vLLM's own `vllm.Inference` by default,
    this package's `vllm_servicer.v1.Pooling` (Classify, Score, Rerank) and
    `vllm_servicer.v1.Render` (a prompt as the engine would run it), and
    `vllm.Control` when `services` names it. Also mounts the standard health
    service (services "" and each mounted name; NOT_SERVING while the engine
    is dead), server reflection, and the engine's load for balancers (ORCA:
    a report in every engine call's trailer and `xds.service.orca.v3.
    OpenRcaService`), each switchable. Call it before `server.start()`.

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
        load_reports: send the engine's load to balancers (gRPC's
            `weighted_round_robin`, Envoy's client-side weighted round robin):
            an ORCA report in the trailer `endpoint-load-metrics-bin` of every
            engine call that ends OK, and `OpenRcaService` (no key needed, as
            health). The trailer is added just outside the in-flight count in
            `interceptors`, so calls it refuses count as errors.
        stream_interval: the new tokens a streamed generation's message
            gathers before it leaves, both gRPC protocols (vLLM's per-request
            `stream_interval`; the first and the last token leave at once); 1,
            the default, sends each engine step's tokens. Under load a
            message per engine step and stream is most of the serving
            process's CPU; N cuts the messages about N-fold, and a token
            waits up to N - 1 engine steps. The engine's own
            `stream_interval` (all its frontends, vLLM's HTTP server too)
            stays the floor.
        stream_interval_min_inflight: apply `stream_interval` only to streams
            that start while at least this many engine calls are in flight
            (the new one counted): a lightly loaded server streams every step.
        chat_template: the chat template Render uses instead of the model's
            (a file or the template itself, as vLLM's `--chat-template`).
        routing_data_for_every_key: take KV transfer parameters (which make a
            prefill engine hold blocks, a decode engine connect where the
            caller says) from every authenticated caller. Off, the default,
            only identities with the router or admin role may send them
            (PERMISSION_DENIED for others); calls without credentials always
            may. KV events are kept to routers by the interceptors'
            permissions (`role_permissions`), not by this option.
        shared_prefix_cache: share the engine's prefix cache between tenants.
            Off, the default, each tenant's engine requests (an authenticated
            caller's but an administrator's) carry a cache salt made from its
            name, joined with the client's own `cache_salt`, so that no tenant
            finds another's prompts in the cache (`cached_tokens` would tell
            it). On, tenants reuse each other's common prefixes again.

    Returns:
        What was mounted: the servicers (None for a protocol not served), the
        service names, the state they share, the in-flight count and the guard.

    Raises:
        MountError: the server has already been started.
        TypeError: `engine` lacks a member of `EngineClient` (the message names it).
        ValueError: `services` names a service this package does not serve,
            `frontends` has not been joined, or a stream interval is out of
            range or not taken per request by the installed vLLM.
    """
    _check_mountable(server, services, frontends)
    options = MountOptions(
        max_kv_subscribers=max_kv_subscribers,
        media_refs=media_refs,
        shm_tensors=shm_tensors,
        lora_modules=lora_modules or {},
        budgets=budgets if budgets is not None else RequestBudgets(),
        load_reports=load_reports,
        stream_interval=stream_interval,
        stream_interval_min_inflight=stream_interval_min_inflight,
        chat_template=chat_template,
        routing_data_for_every_key=routing_data_for_every_key,
        shared_prefix_cache=shared_prefix_cache,
    )
    given = _inflight_of(interceptors)
    inflight = given if given is not None else InflightInterceptor()
    # One state for every protocol: an id belongs to its caller whichever
    # protocol started it, a drain aborts them all, an adapter Control loads
    # is one Inference can name, one load report covers them all.
    state = MountState.build(engine, options, inflight=inflight, frontends=frontends)
    reporter = state.load_reporter
    pipeline, _ = engine_pipeline(
        interceptors,
        inflight=inflight,
        load_reports=LoadReportInterceptor(reporter) if reporter is not None else None,
    )
    served = tuple(name for name in SERVICES if name in services)
    # Built first: Control tells it when the engine's state changes. Readiness
    # for the whole server ("") and each protocol served.
    health_servicer = EngineHealthServicer(engine, services=("", *served)) if health else None
    recheck = health_servicer.recheck if health_servicer is not None else None
    servicers: dict[str, Any] = {
        name: _PROTOCOLS[name].build(state, options, recheck) for name in served
    }
    recorder = HandlerRecorder()
    for name, servicer in servicers.items():
        _PROTOCOLS[name].add(servicer, recorder)
    names = list(served)
    if health_servicer is not None:
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, recorder)
        names.append(HEALTH_SERVICE_NAME)
    orca = OpenRcaServicer(reporter) if reporter is not None else None
    if orca is not None:
        orca_pb2_grpc.add_OpenRcaServiceServicer_to_server(orca, recorder)  # type: ignore[no-untyped-call]
        names.append(ORCA_SERVICE)
    if reflection_service:
        names.append(REFLECTION_SERVICE_NAME)
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
            reflection.aio.ReflectionServicer(tuple(names), pool=ChainedPool(services=names)),
            recorder,
        )
    _register_wrapped(server, recorder, pipeline)
    return MountedServices(
        state=state,
        inflight=inflight,
        guard=EngineGuard(state.running, inflight),
        service_names=tuple(names),
        health=health_servicer,
        servicer=servicers.get(SERVICE_NAME),
        inference=servicers.get(INFERENCE_SERVICE),
        control=servicers.get(CONTROL_SERVICE),
        pooling=servicers.get(POOLING_SERVICE),
        render=servicers.get(RENDER_SERVICE),
        load_reports=orca,
    )


def _check_mountable(
    server: grpc.aio.Server, services: Sequence[str], frontends: FrontendGroup | None
) -> None:
    """Raise what `mount()` documents for a server, services or group it cannot serve."""
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


StateChanged = Callable[[], Awaitable[None]] | None


class _Protocol(NamedTuple):
    """How `mount()` builds one protocol's servicer and adds it to a server."""

    build: Callable[[MountState, MountOptions, StateChanged], Any]
    add: Callable[[Any, Any], None]


_PROTOCOLS: dict[str, _Protocol] = {
    SERVICE_NAME: _Protocol(
        lambda state, options, _: VllmEngineServicer(state, options),
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server,
    ),
    INFERENCE_SERVICE: _Protocol(
        lambda state, options, _: InferenceServicer(state, options),
        inference_pb2_grpc.add_InferenceServicer_to_server,
    ),
    CONTROL_SERVICE: _Protocol(
        lambda state, options, changed: ControlServicer(state, options, on_state_change=changed),
        control_pb2_grpc.add_ControlServicer_to_server,
    ),
    POOLING_SERVICE: _Protocol(
        lambda state, options, _: PoolingServicer(state, options),
        pooling_pb2_grpc.add_PoolingServicer_to_server,
    ),
    RENDER_SERVICE: _Protocol(
        lambda state, options, _: RenderServicer(state, options),
        render_pb2_grpc.add_RenderServicer_to_server,
    ),
}
"""Each protocol `mount()` serves, by full service name."""


def _refusing_unknown_fields(handler: Any, service_name: str) -> Any:
    """`handler` (grpc's method-handler tuple) parsing its request with `UnknownFieldParser`."""
    parse = handler.request_deserializer
    if parse is None:
        return handler
    return handler._replace(request_deserializer=fields.UnknownFieldParser(parse, service_name))


def _register_wrapped(
    server: grpc.aio.Server, recorder: HandlerRecorder, pipeline: Pipeline
) -> None:
    """Register each recorded handler on `server`, wrapped once by `pipeline`."""
    for service_name, handlers in recorder.services.items():
        # The protocols' methods raise; the error layer turns that into statuses.
        errors = error_layer if service_name in SERVICES else None
        if service_name in fields.SCHEMA_VERSIONS:
            # A field its schema lacks is refused, not dropped (wire/fields.py).
            handlers = {
                method: _refusing_unknown_fields(handler, service_name)
                for method, handler in handlers.items()
            }
        wrapped = {
            method: pipeline.wrap(f"/{service_name}/{method}", handler, errors=errors)
            for method, handler in handlers.items()
        }
        register(server, service_name, wrapped)


def engine_pipeline(
    interceptors: Sequence[grpc.aio.ServerInterceptor],
    *,
    inflight: InflightInterceptor | None = None,
    load_reports: LoadReportInterceptor | None = None,
) -> tuple[Pipeline, InflightInterceptor]:
    """The pipeline `mount()` runs its services' calls through, and its in-flight count.

    The count is the `InflightInterceptor` among `interceptors`, else
    `inflight` (a new one if None) added innermost; each interceptor of the
    stack learns it, and the load reports, through its `on_mount` hook (a
    `MetricsInterceptor` reports both as gauges).
    `load_reports` goes just outside the count, where
    the count's refusals reach it and a refusal by authentication (which comes
    before the count) does not; last, when the count is inside a nested
    `Pipeline` (the count's refusals then pass it by).
    """
    stack = list(interceptors)
    found = _inflight_of(stack)
    if found is None:
        found = inflight if inflight is not None else InflightInterceptor()
        stack.append(found)
    inflight = found
    if load_reports is not None:
        stack.insert(stack.index(inflight) if inflight in stack else len(stack), load_reports)
    mounted = MountContext(inflight, load_reports.reporter if load_reports is not None else None)
    for interceptor in _flattened(stack):
        if isinstance(interceptor, CallInterceptor):
            interceptor.on_mount(mounted)
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
