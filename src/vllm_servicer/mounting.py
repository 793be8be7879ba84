"""`mount()`: add vLLM's gRPC protocol to a host's own grpc.aio server."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar, cast

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc  # type: ignore[import-untyped]
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc  # type: ignore[import-untyped]
from grpc_reflection.v1alpha import reflection_pb2 as _reflection_pb2  # noqa: F401

from ._registration import HandlerRecorder, register, server_started
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
from .interceptors._wrapping import with_deserializer
from .options import DEFAULT_SERVICES, SERVICES, MountOptions
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
from .servicer.state import MountState
from .servicer.vllm_engine import VllmEngineServicer
from .status import error_layer
from .wire import fields

if TYPE_CHECKING:
    from .interceptors._wrapping import Handler

HEALTH_SERVICE_NAME: str = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
REFLECTION_SERVICE_NAME: str = reflection.SERVICE_NAME

__all__ = [
    "DEFAULT_SERVICES",  # defined in options.py, importable from here as before
    "HEALTH_SERVICE_NAME",
    "REFLECTION_SERVICE_NAME",
    "SERVICES",
    "MountError",
    "MountedServices",
    "engine_pipeline",
    "mount",
]


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
        options: what the mount serves and how, as it was given.
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
    options: MountOptions = dataclasses.field(default_factory=MountOptions)


def mount(
    server: grpc.aio.Server,
    engine: EngineClient,
    options: MountOptions | None = None,
    *,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    frontends: FrontendGroup | None = None,
    **keywords: Any,
) -> MountedServices:
    """Serve vLLM's gRPC protocols from `engine` on the host's `server`.

    `vllm.grpc.engine.VllmEngine` and vLLM's own `vllm.Inference` by default,
    this package's `vllm_servicer.v1.Pooling` (Classify, Score, Rerank) and
    `vllm_servicer.v1.Render` (a prompt as the engine would run it), and
    `vllm.Control` when `options.served.services` names it. Also mounts the standard
    health service (services "" and each mounted name; NOT_SERVING while the
    engine is dead), server reflection, and the engine's load for balancers
    (ORCA: a report in every engine call's trailer and `xds.service.orca.v3.
    OpenRcaService`), each switchable. Call it before `server.start()`.

    Args:
        server: the host's grpc.aio server, built with its own options and
            interceptors; its other services are left as they are.
        engine: the host's vLLM `AsyncLLM` (or any `EngineClient`).
        options: what to serve and how (`MountOptions`: each field's help
            says what it does); None: the defaults.
        interceptors: grpc.aio server interceptors applied to the services
            mounted here only, outermost first. Those built on `CallInterceptor`
            (all of this package's) run from one wrapper per call, and learn
            what they need of the mount through their `on_mount` hook. Without
            an `InflightInterceptor` among them, one without a limit is added
            innermost, to count the calls in flight.
        frontends: when this process is one of several serving one engine
            (`serve --api-server-count`, which builds it): their shared
            request ids, in-flight count and KV-event streams; joined
            (`FrontendGroup.join`) as this process's index.
        **keywords: deprecated: `MountOptions`' fields by name, as `mount()`
            took them before `options` (a `DeprecationWarning`; gone in the
            next release).

    Returns:
        What was mounted: the servicers (None for a protocol not served), the
        service names, the state they share, the in-flight count and the guard.

    Raises:
        MountError: the server has already been started.
        TypeError: `engine` lacks a member of `EngineClient` (the message
            names it); `options` and keywords both given, or an unknown keyword.
        ValueError: `frontends` has not been joined, or a stream interval is
            not taken per request by the installed vLLM (`MountOptions`
            refuses the rest).
    """
    options = _options_of(options, keywords)
    _check_mountable(server, frontends)
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
    added = _add_services(server, engine, state, options, pipeline)
    return added.mounted(state, inflight, options)


_Servicer = (
    VllmEngineServicer | InferenceServicer | ControlServicer | PoolingServicer | RenderServicer
)
"""A protocol's servicer, as `mount()` builds it."""

_S = TypeVar("_S", bound=_Servicer)


class _Added(NamedTuple):
    """What `_add_services` added to the server."""

    servicers: dict[str, _Servicer]  # each protocol's, by service name
    health: EngineHealthServicer | None
    load_reports: OpenRcaServicer | None
    names: tuple[str, ...]  # every service mounted

    def servicer(self, name: str, kind: type[_S]) -> _S | None:
        """The servicer of the protocol `name`, or None when it is not served."""
        # As built: a host's own build (a subclass or a stand-in) is returned too.
        return cast("_S | None", self.servicers.get(name))

    def mounted(
        self, state: MountState, inflight: InflightInterceptor, options: MountOptions
    ) -> MountedServices:
        """What `mount()` returns: these services, with the state they share."""
        return MountedServices(
            state=state,
            inflight=inflight,
            guard=EngineGuard(state.tenant, inflight),
            service_names=self.names,
            health=self.health,
            servicer=self.servicer(SERVICE_NAME, VllmEngineServicer),
            inference=self.servicer(INFERENCE_SERVICE, InferenceServicer),
            control=self.servicer(CONTROL_SERVICE, ControlServicer),
            pooling=self.servicer(POOLING_SERVICE, PoolingServicer),
            render=self.servicer(RENDER_SERVICE, RenderServicer),
            load_reports=self.load_reports,
            options=options,
        )


def _add_services(
    server: grpc.aio.Server,
    engine: EngineClient,
    state: MountState,
    options: MountOptions,
    pipeline: Pipeline,
) -> _Added:
    """Build the servicers `options` serves, with health, load reports and
    reflection, and register their handlers on `server` wrapped by `pipeline`."""
    served = tuple(name for name in SERVICES if name in options.served.services)
    # Built first: Control tells it when the engine's state changes. Readiness
    # for the whole server ("") and each protocol served.
    health = EngineHealthServicer(engine, services=("", *served)) if options.served.health else None
    recheck = health.recheck if health is not None else None
    servicers = {name: _PROTOCOLS[name].build(state, recheck) for name in served}
    recorder = HandlerRecorder()
    for name, servicer in servicers.items():
        _PROTOCOLS[name].add(servicer, recorder)
    reporter = state.load_reporter
    orca = OpenRcaServicer(reporter) if reporter is not None else None
    names = _add_standard_services(
        recorder, served, health, orca, options.served.reflection_service
    )
    _register_wrapped(server, recorder, pipeline)
    return _Added(servicers, health, orca, names)


def _options_of(options: MountOptions | None, keywords: dict[str, Any]) -> MountOptions:
    """`options`, or the deprecated keywords `mount()` took before it as `MountOptions`."""
    if not keywords:
        return options if options is not None else MountOptions()
    unknown = sorted(set(keywords) - MountOptions.option_names())
    if unknown:
        raise TypeError(f"mount() got an unexpected keyword argument {unknown[0]!r}")
    if options is not None:
        raise TypeError("mount() takes options or MountOptions' fields as keywords, not both")
    named = ", ".join(f"{name}=..." for name in keywords)
    warnings.warn(
        f"mount(server, engine, {named}) is deprecated: pass "
        f"mount(server, engine, MountOptions.of({named})); the keywords go in the next release",
        DeprecationWarning,
        stacklevel=3,
    )
    # The keyword form took None for "the defaults" here.
    given = {
        name: value
        for name, value in keywords.items()
        if value is not None or name not in ("budgets", "lora_modules")
    }
    return MountOptions.of(**given)


def _add_standard_services(
    recorder: HandlerRecorder,
    served: tuple[str, ...],
    health: EngineHealthServicer | None,
    orca: OpenRcaServicer | None,
    reflection_service: bool,
) -> tuple[str, ...]:
    """Add health, load reports and reflection to `recorder` when mounted; every
    name mounted, the protocols' `served` first."""
    names = list(served)
    if health is not None:
        health_pb2_grpc.add_HealthServicer_to_server(health, recorder)
        names.append(HEALTH_SERVICE_NAME)
    if orca is not None:
        orca_pb2_grpc.add_OpenRcaServiceServicer_to_server(orca, recorder)  # type: ignore[no-untyped-call]
        names.append(ORCA_SERVICE)
    if reflection_service:
        names.append(REFLECTION_SERVICE_NAME)
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
            reflection.aio.ReflectionServicer(tuple(names), pool=ChainedPool(services=names)),
            recorder,
        )
    return tuple(names)


def _check_mountable(server: grpc.aio.Server, frontends: FrontendGroup | None) -> None:
    """Raise what `mount()` documents for a server or group it cannot serve."""
    if server_started(server):
        raise MountError(
            "mount() must be called before server.start(): grpc.aio serves handlers "
            "added after start only through a slow fallback path"
        )
    if frontends is not None and frontends.index < 0:
        raise ValueError("this process has not joined the frontend group: call join(index) first")


StateChanged = Callable[[], Awaitable[None]] | None


class _Protocol(NamedTuple):
    """How `mount()` builds one protocol's servicer and adds it to a server."""

    build: Callable[[MountState, StateChanged], _Servicer]
    add: Callable[[_Servicer, HandlerRecorder], None]


_PROTOCOLS: dict[str, _Protocol] = {
    SERVICE_NAME: _Protocol(
        lambda state, _: VllmEngineServicer(state),
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server,
    ),
    INFERENCE_SERVICE: _Protocol(
        lambda state, _: InferenceServicer(state),
        inference_pb2_grpc.add_InferenceServicer_to_server,
    ),
    CONTROL_SERVICE: _Protocol(
        lambda state, changed: ControlServicer(state, on_state_change=changed),
        control_pb2_grpc.add_ControlServicer_to_server,
    ),
    POOLING_SERVICE: _Protocol(
        lambda state, _: PoolingServicer(state),
        pooling_pb2_grpc.add_PoolingServicer_to_server,
    ),
    RENDER_SERVICE: _Protocol(
        lambda state, _: RenderServicer(state),
        render_pb2_grpc.add_RenderServicer_to_server,
    ),
}
"""Each protocol `mount()` serves, by full service name."""


def _refusing_unknown_fields(handler: Handler, service_name: str) -> Handler:
    """`handler` (grpc's method-handler tuple) parsing its request with `UnknownFieldParser`."""
    parse = handler.request_deserializer
    if parse is None:
        return handler
    return with_deserializer(handler, fields.UnknownFieldParser(parse, service_name))


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
