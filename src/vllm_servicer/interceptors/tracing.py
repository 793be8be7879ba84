"""OpenTelemetry tracing: one server span per RPC, with GenAI attributes.

`TracingInterceptor` composes two layers around each traced handler:

1. **outer**: `opentelemetry-instrumentation-grpc`'s aio server interceptor.
   It extracts the caller's W3C context from the metadata, starts the SERVER
   span (name "/package.Service/Method", `rpc.*` and `net.peer.*` attributes),
   makes it current for the handler, and sets the span status when the handler
   aborts.
2. **inner**: a `CallInterceptor` (the package's shared hook plumbing), which
   runs inside that span and adds what the instrumentation lacks: GenAI
   attributes on the engine calls (every protocol's generation, Embed), read
   from the call's record the servicer keeps (`context.kept_usage`: a
   neutral summary of the request, what it sent), never from a protocol's
   messages; a `gen_ai.first_token` event, and the
   real `rpc.grpc.status_code` and status for calls that end without an abort
   (the instrumentation leaves code 0 on a client cancel, and no status for a
   deadline or an unhandled exception).

Composing in this order rather than installing the two side by side is what
makes it sound: the instrumentation only ever wraps the inner layer's handler,
which is an `async def` or an async generator whatever the real handler is. Its
known gap (it iterates every streaming handler as an async generator, so a
`context.write` handler such as health `Watch` breaks) therefore never applies;
handlers run as sync code in grpc's thread pool, which it cannot wrap either,
pass through untraced.

Status follows the OpenTelemetry RPC conventions for servers: UNKNOWN,
DEADLINE_EXCEEDED, UNIMPLEMENTED, INTERNAL, UNAVAILABLE and DATA_LOSS mark the
span ERROR; every other code (INVALID_ARGUMENT, CANCELLED, NOT_FOUND, ...) is
the client's business and leaves it UNSET. The instrumentation applies the same
table on aborts; the inner layer applies it to the other endings.

Conventions: the instrumentation writes the RPC conventions of OpenTelemetry
semantic conventions 1.37 and earlier (`rpc.system`, `rpc.service`, the short
`rpc.method`, an integer `rpc.grpc.status_code`, `net.peer.*`), and so does
this module by default. `OTEL_SEMCONV_STABILITY_OPT_IN` set to `rpc` switches
to the current ones (`rpc.system.name`, the full `rpc.method`, the code's name
in `rpc.response.status_code`, `error.type`, `network.peer.*`, span name
`package.Service/Method`); `rpc/dup` emits both, the migration path the RPC
conventions define. The instrumentation is not changed for this: it gets a
tracer that renames what it writes, when it starts the span (where samplers see
it) and on every later write through the span it was handed.

The servicer hands the engine the server span's W3C headers
(`vllm_servicer.context.engine_trace_headers`), so vLLM's `llm_request` span
is its child.

The `opentelemetry-*` packages are the `otel` extra: this module imports
without them, and `TracingInterceptor` then raises ImportError saying so.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from ..budgets import check_request_id
from ..context import shared_usage
from ..engine import served_model_name
from ..proto import COUNTED_METHODS, GENERATION_METHODS
from ..wire import usage as generation_usage
from ._base import CallInterceptor, MethodFilter
from ._call import Call

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Status, StatusCode, Tracer
    from opentelemetry.trace import TracerProvider as AnyTracerProvider
    from opentelemetry.util.types import Attributes, AttributeValue

    from ..engine import EngineClient

__all__ = [
    "DEFAULT_METHODS",
    "FIRST_TOKEN_EVENT",
    "GEN_AI_PROVIDER",
    "SEMCONV_OPT_IN",
    "SERVER_FAULT_CODES",
    "TracingInterceptor",
    "configure_tracing_from_env",
    "served_model_name",
]

logger = logging.getLogger("vllm_servicer.interceptors")

_MISSING_EXTRA = "tracing needs the OpenTelemetry packages: pip install 'vllm-servicer[otel]'"

HEALTH_WATCH = "/grpc.health.v1.Health/Watch"

FIRST_TOKEN_EVENT = "gen_ai.first_token"
"""Event added to the Generate span at the first response message that carried output tokens."""

SERVER_FAULT_CODES: frozenset[grpc.StatusCode] = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)
"""Codes that mark a server span ERROR (OpenTelemetry RPC conventions)."""

GEN_AI_PROVIDER = "vllm"
"""The `gen_ai.provider.name` of Generate and Embed spans."""

SEMCONV_OPT_IN = "OTEL_SEMCONV_STABILITY_OPT_IN"
"""The variable that selects the RPC conventions: `rpc` (current), `rpc/dup` (both)."""

_STATUS_NAMES: dict[object, str] = {code.value[0]: code.name for code in grpc.StatusCode}
_FAULT_NAMES = frozenset(code.name for code in SERVER_FAULT_CODES)
# Old attributes the current conventions dropped without a successor.
_DROPPED = frozenset({"rpc.service", "net.peer.name"})


def DEFAULT_METHODS(method: str) -> bool:  # noqa: N802 - a constant-like default
    """Every method except health `Watch`.

    A Watch stream lives as long as the client's connection, so its span would
    be one endless span per watcher; tracing it would not break it.
    """
    return method != HEALTH_WATCH


def _require_otel() -> None:
    try:
        import opentelemetry.instrumentation.grpc  # noqa: F401
        import opentelemetry.trace  # noqa: F401
    except ImportError as exc:
        raise ImportError(_MISSING_EXTRA) from exc


def _rpc_conventions(opt_in: str | None) -> tuple[bool, bool]:
    """(old, current): the RPC conventions an OTEL_SEMCONV_STABILITY_OPT_IN value asks for."""
    opted = {value.strip() for value in (opt_in or "").split(",")}
    if "rpc/dup" in opted:  # takes precedence over "rpc"
        return True, True
    if "rpc" in opted:
        return False, True
    return True, False


class _RpcConventions:
    """Rewrites attributes in the old RPC conventions into the ones asked for."""

    __slots__ = ("current", "old", "server")

    def __init__(self, *, old: bool, current: bool, server: Mapping[str, AttributeValue]) -> None:
        self.old = old
        self.current = current
        self.server = dict(server)

    def span_name(self, name: str) -> str:
        # Current: `{rpc.method}`. With both, the old name stays: a span has one
        # name, and the old one still contains the new.
        return name if self.old else name.lstrip("/")

    def attributes(self, attrs: Mapping[str, AttributeValue]) -> dict[str, AttributeValue]:
        if not self.current:
            return dict(attrs)
        out: dict[str, AttributeValue] = dict(attrs) if self.old else {}
        for key, value in attrs.items():
            if key == "rpc.system":
                out["rpc.system.name"] = value
            elif key == "rpc.method":
                service = attrs.get("rpc.service")
                out["rpc.method"] = f"{service!s}/{value!s}" if service else value
                if self.old:
                    # Both conventions name the attribute `rpc.method`; the old
                    # value moves aside, as the OpenTelemetry Java agent does.
                    out["rpc.method.deprecated"] = value
            elif key == "rpc.grpc.status_code":
                name = _STATUS_NAMES.get(value, str(value))
                out["rpc.response.status_code"] = name
                if name in _FAULT_NAMES:
                    out["error.type"] = name
            elif key == "net.peer.ip":
                out["network.peer.address"] = str(value).strip("[]")  # IPv6 comes bracketed
            elif key == "net.peer.port":
                with contextlib.suppress(TypeError, ValueError):
                    out["network.peer.port"] = _port(value)  # the instrumentation's is a string
            elif key == "rpc.user_agent":
                out["user_agent.original"] = value
            elif not self.old and key not in _DROPPED:
                out[key] = value
        return out


def _port(value: AttributeValue) -> int:
    """A port attribute as an integer; TypeError or ValueError when it is none."""
    if isinstance(value, str | bytes | int | float):
        return int(value)
    raise TypeError(f"not a port: {value!r}")


class _RenamingTracerProvider:
    """What the instrumentation gets instead of the provider: its spans come out renamed."""

    def __init__(self, provider: AnyTracerProvider, conventions: _RpcConventions) -> None:
        self._provider = provider
        self._conventions = conventions

    def get_tracer(self, *args: Any, **kwargs: Any) -> _RenamingTracer:
        # As the API calls it, whatever its release's parameters.
        return _RenamingTracer(self._provider.get_tracer(*args, **kwargs), self._conventions)


class _RenamingTracer:
    def __init__(self, tracer: Tracer, conventions: _RpcConventions) -> None:
        self._tracer = tracer
        self._conventions = conventions

    def _start_attributes(self, attributes: Attributes) -> dict[str, AttributeValue]:
        attrs = self._conventions.attributes(attributes or {})
        attrs.update(self._conventions.server)
        return attrs

    # The instrumentation passes all but the name by keyword; the rest go to the
    # tracer as they came.

    def start_span(
        self, name: str, *, attributes: Attributes = None, **options: Any
    ) -> _RenamingSpan:
        span = self._tracer.start_span(
            self._conventions.span_name(name),
            attributes=self._start_attributes(attributes),
            **options,
        )
        return _RenamingSpan(span, self._conventions)

    @contextlib.contextmanager
    def start_as_current_span(
        self, name: str, *, attributes: Attributes = None, **options: Any
    ) -> Iterator[_RenamingSpan]:
        with self._tracer.start_as_current_span(
            self._conventions.span_name(name),
            attributes=self._start_attributes(attributes),
            **options,
        ) as span:
            # The context keeps the real span current; the instrumentation
            # writes the status code (on abort and set_code) through this one.
            yield _RenamingSpan(span, self._conventions)


class _RenamingSpan:
    __slots__ = ("_conventions", "_span")

    def __init__(self, span: Span, conventions: _RpcConventions) -> None:
        self._span = span
        self._conventions = conventions

    def set_attribute(self, key: str, value: AttributeValue) -> None:
        self._span.set_attributes(self._conventions.attributes({key: value}))

    def set_attributes(self, attributes: Mapping[str, AttributeValue]) -> None:
        self._span.set_attributes(self._conventions.attributes(attributes))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._span, name)


class _ServerSpan(Protocol):
    """What this module uses of a call's server span: the API's `Span`, with the
    start time and status the SDK's keeps (read only while it records)."""

    @property
    def start_time(self) -> int | None: ...
    @property
    def status(self) -> Status: ...
    def is_recording(self) -> bool: ...
    def set_attributes(self, attributes: Mapping[str, AttributeValue]) -> None: ...
    def add_event(
        self, name: str, attributes: Attributes = None, timestamp: int | None = None
    ) -> None: ...
    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None: ...


class _GenAiState:
    """One engine call's record, and whether its request was told to the span yet."""

    __slots__ = ("generation", "noted", "record")

    def __init__(self, record: generation_usage.GenerationUsage, generation: bool) -> None:
        self.record = record  # the servicer's: the request's summary, Embed's usage
        # Generation: its usage, read when the call ends (from the messages of
        # a handler that keeps no record).
        self.generation = generation_usage.UsageReader(record) if generation else None
        self.noted = False


class TracingInterceptor(CallInterceptor):
    """A grpc.aio server interceptor that traces RPCs with OpenTelemetry.

    Pass it to `grpc.aio.server(interceptors=[...])` (every service of the
    server) or to `mount(..., interceptors=[...])` (the mounted services only).

    Args:
        tracer_provider: the provider to create spans with; None uses the
            global one (`opentelemetry.trace.set_tracer_provider`).
        model: the served model name for `gen_ai.request.model`;
            `served_model_name(engine)` gives it.
        methods: which methods to trace (default: all but health `Watch`).
        server_address: `server.address` of every span: the name clients use
            for this group of servers (e.g. "llm.internal"); grpc does not
            tell a server the authority a client dialled.
        server_port: `server.port`, set only along with `server_address`.

    Which RPC conventions the spans follow is read from
    `OTEL_SEMCONV_STABILITY_OPT_IN` when the interceptor is built.

    Raises:
        ImportError: the `otel` extra is not installed.
    """

    def __init__(
        self,
        tracer_provider: AnyTracerProvider | None = None,
        *,
        model: str | None = None,
        methods: MethodFilter = DEFAULT_METHODS,
        server_address: str | None = None,
        server_port: int | None = None,
    ) -> None:
        _require_otel()
        from opentelemetry import trace
        from opentelemetry.instrumentation.grpc import aio_server_interceptor
        from opentelemetry.trace import Status, StatusCode

        super().__init__(methods=methods)
        old, current = _rpc_conventions(os.environ.get(SEMCONV_OPT_IN))
        server: dict[str, AttributeValue] = {}
        if server_address:
            server["server.address"] = server_address
            if server_port is not None:
                server["server.port"] = int(server_port)
        self._conventions = _RpcConventions(old=old, current=current, server=server)
        provider: AnyTracerProvider | _RenamingTracerProvider | None = tracer_provider
        if current or server:
            provider = _RenamingTracerProvider(
                tracer_provider or trace.get_tracer_provider(), self._conventions
            )
        # The instrumentation's factory is unannotated; it returns a grpc.aio.ServerInterceptor.
        # OpenTelemetry's own server span, around this interceptor's hooks.
        self.enclosing: grpc.aio.ServerInterceptor = aio_server_interceptor(  # type: ignore[no-untyped-call]
            tracer_provider=provider
        )
        self._model = model
        self._current_span = trace.get_current_span
        self._status = Status
        self._error = StatusCode.ERROR

    @classmethod
    def for_engine(
        cls,
        engine: EngineClient,
        tracer_provider: AnyTracerProvider | None = None,
        *,
        methods: MethodFilter = DEFAULT_METHODS,
        server_address: str | None = None,
        server_port: int | None = None,
    ) -> TracingInterceptor:
        """A TracingInterceptor naming the model `engine` serves."""
        return cls(
            tracer_provider,
            model=served_model_name(engine),
            methods=methods,
            server_address=server_address,
            server_port=server_port,
        )

    # ----- hooks (run inside the RPC span) ------------------------------------

    async def on_start(self, call: Call) -> None:
        span = self._current_span()
        # The span object, not the context: on_finish may run after the
        # handler's context was detached.
        if call.method in COUNTED_METHODS:
            # An engine call or a render, any protocol: its servicer keeps the call's record.
            generation = call.method in GENERATION_METHODS
            call.state = (span, _GenAiState(shared_usage(), generation))
        else:
            call.state = (span, None)

    def _note_request(self, span: _ServerSpan, state: _GenAiState) -> None:
        """The request's attributes, once the servicer has stated its summary.

        Told at the first response (a stream dropped later may find its span
        ended already) or at the end. A call refused before its handler ran
        (its request never read, or unparsable) has no summary to tell.
        """
        state.noted = True
        summary = state.record.request
        if summary is None or not span.is_recording():
            return
        attrs: dict[str, AttributeValue] = {
            "gen_ai.provider.name": GEN_AI_PROVIDER,
            "gen_ai.operation.name": summary.operation,
        }
        if summary.max_tokens is not None:
            attrs["gen_ai.request.max_tokens"] = summary.max_tokens
        if summary.temperature is not None:
            attrs["gen_ai.request.temperature"] = summary.temperature
        if summary.top_p is not None:
            attrs["gen_ai.request.top_p"] = summary.top_p
        if summary.n > 1:
            attrs["gen_ai.request.choice.count"] = summary.n
        if self._model:
            attrs["gen_ai.request.model"] = self._model
        if summary.request_id and _checked(summary.request_id):
            # The name vLLM's own engine spans use for the same id; one the
            # servicer refuses (32 MiB, a newline) stays out of the trace.
            attrs["gen_ai.request.id"] = summary.request_id
        span.set_attributes(attrs)

    def reads_responses(self, call: Call) -> bool:
        span, state = call.state
        if state is None:
            return False
        if not state.noted:
            self._note_request(span, state)
        return state.generation is not None and state.generation.reads_messages

    def on_response(self, call: Call, message: object) -> None:
        span, state = call.state
        if state is not None and state.generation is not None:
            state.generation.read(message)

    def on_finish(self, call: Call) -> None:
        span, state = call.state
        if state is not None and not state.noted:
            self._note_request(span, state)
        generation = state.generation if state is not None else None
        usage = generation.usage if generation is not None else None
        if usage is not None and usage.first_token_at and span.is_recording():
            # A perf_counter() time, placed on the span's clock.
            ago = time.perf_counter() - usage.first_token_at
            first_token_ns = time.time_ns() - int(ago * 1e9)
            ttft = (first_token_ns - span.start_time) / 1e9
            span.add_event(
                FIRST_TOKEN_EVENT,
                {"gen_ai.server.time_to_first_token": max(ttft, 0.0)},
                timestamp=first_token_ns,
            )
        self._end(call, span, state)

    def _end(self, call: Call, span: _ServerSpan, state: _GenAiState | None) -> None:
        if not span.is_recording():
            # Ended already (a stream dropped while grpc was writing is closed
            # by the garbage collector, outer layer first), or not sampled.
            return
        code = call.code
        assert code is not None
        attrs = self._conventions.attributes({"rpc.grpc.status_code": code.value[0]})
        if state is not None:
            generation = state.generation
            if generation is None:  # Embed
                record = state.record
                if record.prompt_tokens >= 0:
                    attrs["gen_ai.usage.input_tokens"] = record.prompt_tokens
                if record.embedding_dim:
                    attrs["gen_ai.embeddings.dimension.count"] = record.embedding_dim
            else:
                usage = generation.usage
                if usage.prompt_tokens >= 0:
                    attrs["gen_ai.usage.input_tokens"] = usage.prompt_tokens
                attrs["gen_ai.usage.output_tokens"] = usage.output_tokens
                if usage.finish_reasons:
                    reasons = usage.finish_reasons
                    attrs["gen_ai.response.finish_reasons"] = [reasons[i] for i in sorted(reasons)]
        span.set_attributes(attrs)
        if code in SERVER_FAULT_CODES and span.status.status_code is not self._error:
            details = (
                call.context.details() if code is not grpc.StatusCode.DEADLINE_EXCEEDED else ""
            )
            span.set_status(self._status(self._error, f"{code}:{details or ''}"))


def _checked(request_id: str) -> bool:
    """Whether `request_id` passes the servicers' own check (length first: a
    refused id may be megabytes), so that only an id a request could run
    under reaches a span."""
    try:
        check_request_id("request_id", request_id)
    except ValueError:
        return False
    return True


def configure_tracing_from_env() -> TracerProvider | None:
    """A TracerProvider exporting over OTLP, when the standard OTEL_* variables ask for one.

    Tracing is on when `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or
    `OTEL_EXPORTER_OTLP_ENDPOINT` is set and `OTEL_TRACES_EXPORTER` is unset or
    includes "otlp" (and `OTEL_SDK_DISABLED` is not "true"). The provider
    batches spans to an OTLP exporter (gRPC, or HTTP when
    `OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL` is "http/protobuf"), which reads
    its endpoint, headers, TLS and timeout settings from the same variables;
    `OTEL_SERVICE_NAME` (default "vllm-servicer"), `OTEL_RESOURCE_ATTRIBUTES`
    and `OTEL_TRACES_SAMPLER[_ARG]` apply as usual. The global provider is left
    alone.

    Returns:
        The provider (flushed and shut down at interpreter exit), or None when
        tracing is off: nothing is imported and nothing costs anything.

    Raises:
        ImportError: tracing was asked for but the `otel` extra is missing.
    """
    env = os.environ
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    exporters = {e.strip().lower() for e in env.get("OTEL_TRACES_EXPORTER", "otlp").split(",")}
    if (
        not endpoint
        or "none" in exporters
        or env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
    ):
        return None
    if "otlp" not in exporters:
        logger.warning(
            "OTEL_TRACES_EXPORTER=%s: only 'otlp' is built in; tracing stays off",
            env["OTEL_TRACES_EXPORTER"],
        )
        return None
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or ""
    )
    try:
        from opentelemetry.sdk.resources import SERVICE_NAME as SERVICE_NAME_KEY
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        if protocol.strip().lower().startswith("http"):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter,
            )
        else:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[assignment]
                OTLPSpanExporter,
            )
    except ImportError as exc:
        raise ImportError(_MISSING_EXTRA) from exc
    resource = Resource.create({SERVICE_NAME_KEY: env.get("OTEL_SERVICE_NAME") or "vllm-servicer"})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    logger.info("tracing: exporting spans over OTLP to %s", endpoint)
    return provider
