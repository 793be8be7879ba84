"""TracingInterceptor against a real engine: spans, attributes, status, propagation.

Each placement (the interceptor passed to `grpc.aio.server(interceptors=...)`,
and to `mount(..., interceptors=...)`) gets a server of its own on the session
engine, with a TracerProvider of its own exporting to memory; the global
OpenTelemetry provider is never set.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode, get_current_span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from support import collect, completes, placed, request, serving, wait_until_idle

from vllm_servicer import SERVICE_NAME
from vllm_servicer.context import engine_trace_headers
from vllm_servicer.interceptors._base import all_methods
from vllm_servicer.interceptors.tracing import (
    DEFAULT_METHODS,
    FIRST_TOKEN_EVENT,
    SEMCONV_OPT_IN,
    TracingInterceptor,
    configure_tracing_from_env,
    served_model_name,
)
from vllm_servicer.proto import vllm_engine_pb2 as pb
from vllm_servicer.proto import vllm_engine_pb2_grpc

GENERATE = f"/{SERVICE_NAME}/Generate"
ABORT = f"/{SERVICE_NAME}/Abort"
EMBED = f"/{SERVICE_NAME}/Embed"
WATCH = "/grpc.health.v1.Health/Watch"
CHECK = "/grpc.health.v1.Health/Check"


@dataclasses.dataclass
class Traced:
    placement: str
    address: str
    stub: vllm_engine_pb2_grpc.VllmEngineStub
    exporter: InMemorySpanExporter
    model: str


def _provider() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()  # sampler: always on (no OTEL_TRACES_SAMPLER set)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


@pytest.fixture(scope="module")
async def traced(placement: str, engine: Any) -> AsyncIterator[Traced]:
    provider, exporter = _provider()
    tracing = TracingInterceptor.for_engine(engine, provider)
    async with serving(engine, **placed(placement, [tracing])) as running:
        yield Traced(
            placement,
            running.address,
            vllm_engine_pb2_grpc.VllmEngineStub(running.channel),
            exporter,
            served_model_name(engine),
        )
    provider.shutdown()


async def _spans(
    exporter: InMemorySpanExporter, match: Any, *, count: int = 1, timeout: float = 10.0
) -> list[ReadableSpan]:
    """The finished spans `match` accepts, once there are `count` (the server
    ends a span after the client may already have its status)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [s for s in exporter.get_finished_spans() if match(s)]
        if len(found) >= count or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.02)


def _by_request_id(rid: str) -> Any:
    return lambda span: (span.attributes or {}).get("gen_ai.request.id") == rid


async def _one_span(exporter: InMemorySpanExporter, rid: str) -> ReadableSpan:
    spans = await _spans(exporter, _by_request_id(rid))
    await asyncio.sleep(0.05)  # a duplicate would arrive about now
    spans = [s for s in exporter.get_finished_spans() if _by_request_id(rid)(s)]
    assert len(spans) == 1, [s.name for s in spans]
    return spans[0]


def _attrs(span: ReadableSpan) -> Mapping[str, Any]:
    return span.attributes or {}


# Attributes only one of the two RPC conventions has.
_OLD_ONLY = ("rpc.system", "rpc.service", "rpc.grpc.status_code", "net.peer.ip", "net.peer.port")
_CURRENT_ONLY = (
    "rpc.system.name",
    "rpc.response.status_code",
    "network.peer.address",
    "network.peer.port",
)


# ----- Generate: success, invalid argument, client cancel, Abort -----------------


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
async def test_generate_span_has_genai_attributes(traced: Traced, stream: bool) -> None:
    req = request(stream=stream, max_tokens=4, ignore_eos=True, top_p=0.9)
    messages = await collect(traced.stub.Generate(req))
    assert completes(messages)[0].finish_reason == "length"

    span = await _one_span(traced.exporter, req.request_id)
    attrs = _attrs(span)
    assert span.name == GENERATE
    assert span.kind is SpanKind.SERVER
    assert span.status.status_code is StatusCode.UNSET
    # What the instrumentation sets (the old RPC conventions, the default)...
    assert attrs["rpc.system"] == "grpc"
    assert attrs["rpc.service"] == SERVICE_NAME
    assert attrs["rpc.method"] == "Generate"
    assert attrs["rpc.grpc.status_code"] == grpc.StatusCode.OK.value[0]
    assert attrs["net.peer.ip"] == "127.0.0.1"
    assert not set(attrs) & {*_CURRENT_ONLY, "server.address"}
    # ... and what this package adds.
    assert attrs["gen_ai.provider.name"] == "vllm"
    assert attrs["gen_ai.operation.name"] == "text_completion"
    assert attrs["gen_ai.request.model"] == traced.model != ""
    assert attrs["gen_ai.request.max_tokens"] == 4
    assert attrs["gen_ai.request.temperature"] == 0.0
    assert attrs["gen_ai.request.top_p"] == pytest.approx(0.9, rel=1e-6)
    assert attrs["gen_ai.usage.input_tokens"] == len(req.tokenized.input_ids)
    assert attrs["gen_ai.usage.output_tokens"] == 4
    assert tuple(attrs["gen_ai.response.finish_reasons"]) == ("length",)
    events = [e for e in span.events if e.name == FIRST_TOKEN_EVENT]
    assert len(events) == 1
    assert 0 < (events[0].attributes or {})["gen_ai.server.time_to_first_token"] < 60


async def test_generate_n2_counts_every_choice(traced: Traced) -> None:
    req = request(stream=True, max_tokens=3, ignore_eos=True, n=2, temperature=1.0, seed=7)
    await collect(traced.stub.Generate(req))
    attrs = _attrs(await _one_span(traced.exporter, req.request_id))
    assert attrs["gen_ai.usage.output_tokens"] == 6
    assert tuple(attrs["gen_ai.response.finish_reasons"]) == ("length", "length")
    assert attrs["gen_ai.request.choice.count"] == 2


async def test_invalid_argument_leaves_status_unset(traced: Traced) -> None:
    req = request(stream=True, top_p=1.5)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(traced.stub.Generate(req))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    span = await _one_span(traced.exporter, req.request_id)
    attrs = _attrs(span)
    assert attrs["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert span.status.status_code is StatusCode.UNSET  # the client's mistake
    assert attrs["gen_ai.request.top_p"] == pytest.approx(1.5)
    assert not [e for e in span.events if e.name == FIRST_TOKEN_EVENT]


@pytest.mark.parametrize(
    "request_id",
    ["x" * (2 << 20) + "\nforged: line", "line\nbreak"],
    ids=["2MiB-with-newline", "newline"],
)
async def test_a_request_id_the_servicer_refuses_never_reaches_a_span(
    traced: Traced, request_id: str
) -> None:
    """The summary is stated before the id is checked; the span records the
    id only if it passes the check (length, control characters)."""
    before = len(traced.exporter.get_finished_spans())
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(traced.stub.Generate(request(request_id=request_id, max_tokens=2)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (info.value.details() or "").startswith("request_id: ")

    def refused(span: ReadableSpan) -> bool:
        return _attrs(span).get("rpc.grpc.status_code") == grpc.StatusCode.INVALID_ARGUMENT.value[0]

    spans = []
    deadline = time.monotonic() + 10
    while not spans and time.monotonic() < deadline:
        spans = [s for s in traced.exporter.get_finished_spans()[before:] if refused(s)]
        await asyncio.sleep(0.02)
    assert len(spans) == 1
    attrs = _attrs(spans[0])
    assert attrs["gen_ai.operation.name"] == "text_completion"  # the summary was noted
    assert "gen_ai.request.id" not in attrs
    assert not [v for v in attrs.values() if isinstance(v, str) and "\n" in v]


async def test_client_cancel_records_cancelled(traced: Traced, engine: Any) -> None:
    req = request(stream=True, max_tokens=400, ignore_eos=True)
    call = traced.stub.Generate(req)
    first = await call.read()
    assert first.WhichOneof("response") == "chunk"
    call.cancel()

    span = await _one_span(traced.exporter, req.request_id)
    attrs = _attrs(span)
    assert attrs["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
    assert span.status.status_code is StatusCode.UNSET
    assert "gen_ai.response.finish_reasons" not in attrs
    assert attrs["gen_ai.usage.output_tokens"] >= 1
    assert [e for e in span.events if e.name == FIRST_TOKEN_EVENT]
    assert await wait_until_idle(engine) == 0


async def test_abort_ends_with_finish_reason_abort(traced: Traced, engine: Any) -> None:
    req = request(stream=True, max_tokens=400, ignore_eos=True)
    call = traced.stub.Generate(req)
    messages = [await call.read()]
    await traced.stub.Abort(pb.AbortRequest(request_ids=[req.request_id]))
    while (message := await call.read()) is not grpc.aio.EOF:
        messages.append(message)
    assert await call.code() == grpc.StatusCode.OK
    assert completes(messages)[0].finish_reason == "abort"

    span = await _one_span(traced.exporter, req.request_id)
    attrs = _attrs(span)
    assert attrs["rpc.grpc.status_code"] == grpc.StatusCode.OK.value[0]
    assert span.status.status_code is StatusCode.UNSET
    assert tuple(attrs["gen_ai.response.finish_reasons"]) == ("abort",)
    abort_spans = await _spans(traced.exporter, lambda s: s.name == ABORT)
    assert abort_spans and _attrs(abort_spans[-1])["rpc.grpc.status_code"] == 0
    assert await wait_until_idle(engine) == 0


async def test_embed_span_on_a_generate_engine(traced: Traced) -> None:
    rid = f"embed-{traced.placement}"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await traced.stub.Embed(
            pb.EmbedRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]))
        )
    code = info.value.code()
    span = await _one_span(traced.exporter, rid)
    attrs = _attrs(span)
    assert span.name == EMBED
    assert attrs["gen_ai.operation.name"] == "embeddings"
    assert attrs["gen_ai.request.model"] == traced.model
    assert attrs["rpc.grpc.status_code"] == code.value[0]


# ----- propagation --------------------------------------------------------------


async def test_parent_is_the_clients_span(traced: Traced) -> None:
    client_provider, client_exporter = _provider()
    tracer = client_provider.get_tracer("test-client")
    req = request(stream=True, max_tokens=2, ignore_eos=True)
    with tracer.start_as_current_span("gateway", kind=SpanKind.CLIENT) as client_span:
        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier)
        await collect(traced.stub.Generate(req, metadata=tuple(carrier.items())))
    client_ctx = client_span.get_span_context()

    span = await _one_span(traced.exporter, req.request_id)
    assert span.parent is not None and span.parent.is_remote
    assert span.parent.span_id == client_ctx.span_id
    assert span.context.trace_id == client_ctx.trace_id
    client_provider.shutdown()


async def test_no_traceparent_makes_a_root_span(traced: Traced) -> None:
    req = request(max_tokens=1)
    await collect(traced.stub.Generate(req))
    assert (await _one_span(traced.exporter, req.request_id)).parent is None


class EngineFault(Exception):
    """A failure no real engine produces on demand."""


class RecordingEngine:
    """The real engine, with the `trace_headers` of each generate call recorded.

    Generate fails with EngineFault for request ids starting with "fail-".
    """

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.trace_headers: dict[str, Mapping[str, str] | None] = {}

    model_config = property(lambda self: self._engine.model_config)
    vllm_config = property(lambda self: self._engine.vllm_config)
    errored = property(lambda self: self._engine.errored)

    def generate(self, prompt: Any, params: Any, request_id: str, **kwargs: Any) -> Any:
        self.trace_headers[request_id] = kwargs.get("trace_headers")
        if request_id.startswith("fail-"):
            raise EngineFault(request_id)
        return self._engine.generate(prompt, params, request_id, **kwargs)

    def encode(self, prompt: Any, params: Any, request_id: str, **kwargs: Any) -> Any:
        self.trace_headers[request_id] = kwargs.get("trace_headers")
        return self._engine.encode(prompt, params, request_id, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def _parent_in(headers: Mapping[str, str] | None) -> Any:
    """The span context W3C `headers` name (what vLLM makes its span's parent)."""
    assert headers and "traceparent" in headers
    return get_current_span(
        TraceContextTextMapPropagator().extract(dict(headers))
    ).get_span_context()


async def test_engine_span_is_a_child_of_the_server_span(engine: Any) -> None:
    recording = RecordingEngine(engine)
    provider, exporter = _provider()
    client_provider, _ = _provider()
    try:
        async with serving(
            recording, **placed("server_wide", [TracingInterceptor(provider)])
        ) as running:
            req = request(stream=True, max_tokens=2, ignore_eos=True)
            with client_provider.get_tracer("t").start_as_current_span("gateway") as client_span:
                carrier: dict[str, str] = {}
                TraceContextTextMapPropagator().inject(carrier)
                async with grpc.aio.insecure_channel(running.address) as channel:
                    stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
                    await collect(stub.Generate(req, metadata=tuple(carrier.items())))
            server_span = await _one_span(exporter, req.request_id)
            parent = _parent_in(recording.trace_headers[req.request_id])
            assert parent.trace_id == client_span.get_span_context().trace_id
            assert parent.span_id == server_span.context.span_id
            assert parent.span_id != client_span.get_span_context().span_id
    finally:
        provider.shutdown()
        client_provider.shutdown()


async def test_engine_receives_the_clients_trace_without_tracing(engine: Any) -> None:
    recording = RecordingEngine(engine)
    client_provider, _ = _provider()
    try:
        async with serving(recording) as running:
            req = request(stream=True, max_tokens=2, ignore_eos=True)
            with client_provider.get_tracer("t").start_as_current_span("gateway") as client_span:
                carrier: dict[str, str] = {}
                TraceContextTextMapPropagator().inject(carrier)
                async with grpc.aio.insecure_channel(running.address) as channel:
                    stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
                    await collect(stub.Generate(req, metadata=tuple(carrier.items())))
            parent = _parent_in(recording.trace_headers[req.request_id])
            assert parent.span_id == client_span.get_span_context().span_id
    finally:
        client_provider.shutdown()


# ----- engine_trace_headers, on its own ---------------------------------------------

_HEADERS_METHOD = "/test.TraceHeaders/Get"


async def _headers_server(*interceptors: grpc.aio.ServerInterceptor) -> tuple[grpc.aio.Server, str]:
    """A server whose one method answers with `engine_trace_headers(context)` as JSON."""

    async def get(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        return json.dumps(engine_trace_headers(context)).encode()

    server = grpc.aio.server(interceptors=interceptors)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "test.TraceHeaders", {"Get": grpc.unary_unary_rpc_method_handler(get)}
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _get_headers(address: str, metadata: tuple[tuple[str, str], ...] = ()) -> Any:
    async with grpc.aio.insecure_channel(address) as channel:
        answer = await channel.unary_unary(_HEADERS_METHOD)(b"", metadata=metadata)
    return json.loads(answer)


@pytest.mark.parametrize("tracestate", [False, True], ids=["traceparent", "tracestate"])
async def test_engine_trace_headers_name_the_server_span(tracestate: bool) -> None:
    provider, exporter = _provider()
    server, address = await _headers_server(TracingInterceptor(provider))
    client_provider, _ = _provider()
    try:
        with client_provider.get_tracer("t").start_as_current_span("gateway") as client_span:
            carrier: dict[str, str] = {}
            TraceContextTextMapPropagator().inject(carrier)
        if tracestate:
            carrier["tracestate"] = "vendor=abc"
        headers = await _get_headers(address, tuple(carrier.items()))
        (server_span,) = await _spans(exporter, lambda s: s.name == _HEADERS_METHOD)
        assert set(headers) == ({"traceparent", "tracestate"} if tracestate else {"traceparent"})
        client_ctx = client_span.get_span_context()
        parent = _parent_in(headers)
        assert parent.trace_id == client_ctx.trace_id == server_span.context.trace_id
        assert parent.span_id == server_span.context.span_id != client_ctx.span_id
        assert parent.trace_flags.sampled
        if tracestate:
            assert headers["tracestate"] == "vendor=abc"
    finally:
        await server.stop(None)
        provider.shutdown()
        client_provider.shutdown()


async def test_engine_trace_headers_of_a_root_span() -> None:
    provider, exporter = _provider()
    server, address = await _headers_server(TracingInterceptor(provider))
    try:
        headers = await _get_headers(address)
        (server_span,) = await _spans(exporter, lambda s: s.name == _HEADERS_METHOD)
        assert server_span.parent is None
        parent = _parent_in(headers)
        assert (parent.trace_id, parent.span_id) == (
            server_span.context.trace_id,
            server_span.context.span_id,
        )
    finally:
        await server.stop(None)
        provider.shutdown()


async def test_engine_trace_headers_without_tracing_are_the_callers() -> None:
    server, address = await _headers_server()
    try:
        assert await _get_headers(address) is None
        traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        sent = (("traceparent", traceparent), ("tracestate", "a=1"), ("x-other", "v"))
        assert await _get_headers(address, sent) == {
            "traceparent": traceparent,
            "tracestate": "a=1",
        }
    finally:
        await server.stop(None)


# ----- the RPC conventions: OTEL_SEMCONV_STABILITY_OPT_IN --------------------------


@dataclasses.dataclass
class Conventions:
    opt_in: str
    stub: vllm_engine_pb2_grpc.VllmEngineStub
    exporter: InMemorySpanExporter

    @property
    def old(self) -> bool:
        return self.opt_in == "rpc/dup"


@pytest.fixture(scope="module", params=["rpc", "rpc/dup"])
async def conventions(request: pytest.FixtureRequest, engine: Any) -> AsyncIterator[Conventions]:
    provider, exporter = _provider()
    with pytest.MonkeyPatch.context() as env:
        # Read when the interceptor is built; "http" shows other domains do not matter.
        env.setenv(SEMCONV_OPT_IN, f"http, {request.param}")
        tracing = TracingInterceptor.for_engine(
            engine, provider, server_address="llm.example.internal", server_port=50051
        )
    async with serving(RecordingEngine(engine), **placed("server_wide", [tracing])) as running:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(running.channel)
        yield Conventions(request.param, stub, exporter)
    provider.shutdown()


async def test_current_rpc_conventions_on_success(conventions: Conventions) -> None:
    req = request(stream=True, max_tokens=2, ignore_eos=True)
    await collect(conventions.stub.Generate(req))
    span = await _one_span(conventions.exporter, req.request_id)
    attrs = _attrs(span)
    assert span.kind is SpanKind.SERVER
    assert span.name == (GENERATE if conventions.old else f"{SERVICE_NAME}/Generate")
    assert attrs["rpc.system.name"] == "grpc"
    assert attrs["rpc.method"] == f"{SERVICE_NAME}/Generate"
    assert attrs["rpc.response.status_code"] == "OK"
    assert "error.type" not in attrs
    assert attrs["server.address"] == "llm.example.internal"
    assert attrs["server.port"] == 50051
    assert attrs["network.peer.address"] == "127.0.0.1"
    assert isinstance(attrs["network.peer.port"], int) and attrs["network.peer.port"] > 0
    assert attrs["user_agent.original"].startswith("grpc-python")
    assert attrs["gen_ai.provider.name"] == "vllm"
    assert attrs["gen_ai.usage.output_tokens"] == 2
    if conventions.old:
        assert attrs["rpc.system"] == "grpc"
        assert attrs["rpc.service"] == SERVICE_NAME
        assert attrs["rpc.method.deprecated"] == "Generate"
        assert attrs["rpc.grpc.status_code"] == 0
        assert attrs["net.peer.ip"] == "127.0.0.1"
        assert int(attrs["net.peer.port"]) == attrs["network.peer.port"]
        assert attrs["rpc.user_agent"] == attrs["user_agent.original"]
    else:
        assert not set(attrs) & {*_OLD_ONLY, "rpc.method.deprecated", "rpc.user_agent"}
        assert "net.peer.name" not in attrs


async def test_current_rpc_conventions_on_a_client_error(conventions: Conventions) -> None:
    req = request(stream=True, top_p=1.5)
    with pytest.raises(grpc.aio.AioRpcError):
        await collect(conventions.stub.Generate(req))
    span = await _one_span(conventions.exporter, req.request_id)
    attrs = _attrs(span)
    assert attrs["rpc.response.status_code"] == "INVALID_ARGUMENT"
    assert "error.type" not in attrs  # the client's mistake, not a server error
    assert span.status.status_code is StatusCode.UNSET
    assert (attrs.get("rpc.grpc.status_code") == 3) is conventions.old


async def test_current_rpc_conventions_on_a_server_error(conventions: Conventions) -> None:
    req = request(stream=False, max_tokens=2, request_id=f"fail-{conventions.opt_in}")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(conventions.stub.Generate(req))
    assert info.value.code() == grpc.StatusCode.INTERNAL
    span = await _one_span(conventions.exporter, req.request_id)
    attrs = _attrs(span)
    assert attrs["rpc.response.status_code"] == "INTERNAL"
    assert attrs["error.type"] == "INTERNAL"
    assert span.status.status_code is StatusCode.ERROR
    assert (attrs.get("rpc.grpc.status_code") == 13) is conventions.old


@pytest.mark.parametrize(
    ("opt_in", "old", "current"),
    [
        (None, True, False),
        ("", True, False),
        ("http,database", True, False),
        ("rpc", False, True),
        (" http , rpc ", False, True),
        ("rpc/dup", True, True),
        ("rpc,rpc/dup", True, True),  # dup wins
        ("rpcx", True, False),
    ],
)
def test_semconv_opt_in_values(opt_in: str | None, old: bool, current: bool) -> None:
    from vllm_servicer.interceptors.tracing import _rpc_conventions

    assert _rpc_conventions(opt_in) == (old, current)


async def test_server_address_alone_keeps_the_old_conventions(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SEMCONV_OPT_IN, raising=False)
    provider, exporter = _provider()
    tracing = TracingInterceptor(provider, server_address="llm.example.internal")
    try:
        async with serving(engine, **placed("server_wide", [tracing])) as running:
            async with grpc.aio.insecure_channel(running.address) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                await health.Check(health_pb2.HealthCheckRequest(service=""))
            (span,) = await _spans(exporter, lambda s: s.name == CHECK)
            attrs = _attrs(span)
            assert attrs["server.address"] == "llm.example.internal"
            assert "server.port" not in attrs
            assert attrs["rpc.system"] == "grpc" and attrs["rpc.grpc.status_code"] == 0
            assert not set(attrs) & set(_CURRENT_ONLY)
    finally:
        provider.shutdown()


# ----- handlers the instrumentation alone would break ------------------------------


@pytest.mark.parametrize("watch_traced", [False, True], ids=["default", "all_methods"])
async def test_health_watch_streams_with_tracing_server_wide(
    engine: Any, watch_traced: bool
) -> None:
    provider, exporter = _provider()
    methods = all_methods if watch_traced else DEFAULT_METHODS
    try:
        async with serving(
            engine, **placed("server_wide", [TracingInterceptor(provider, methods=methods)])
        ) as running:
            async with grpc.aio.insecure_channel(running.address) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                check = await health.Check(health_pb2.HealthCheckRequest(service=""))
                assert check.status == health_pb2.HealthCheckResponse.SERVING
                watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
                first = await asyncio.wait_for(watch.read(), 10)
                assert first.status == health_pb2.HealthCheckResponse.SERVING
                watch.cancel()
            assert await _spans(exporter, lambda s: s.name == CHECK)
            watch_spans = await _spans(
                exporter, lambda s: s.name == WATCH, timeout=1 if not watch_traced else 10
            )
            if watch_traced:
                assert len(watch_spans) == 1
                assert _attrs(watch_spans[0])["rpc.grpc.status_code"] == 1  # CANCELLED
                assert watch_spans[0].status.status_code is StatusCode.UNSET
            else:
                assert watch_spans == []
    finally:
        provider.shutdown()


async def test_reflection_stream_is_traced(traced: Traced) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    async with grpc.aio.insecure_channel(traced.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)

        async def one() -> AsyncIterator[Any]:
            yield reflection_pb2.ServerReflectionRequest(list_services="")

        responses = await collect(stub.ServerReflectionInfo(one()))
    names = {s.name for s in responses[0].list_services_response.service}
    assert SERVICE_NAME in names
    spans = await _spans(traced.exporter, lambda s: s.name.endswith("/ServerReflectionInfo"))
    assert spans and _attrs(spans[-1])["rpc.grpc.status_code"] == 0


# ----- the extra, and the launcher's env configuration ------------------------------

_HIDE_OTEL = """
import sys
sys.modules["opentelemetry"] = None  # every opentelemetry.* import now fails
import vllm_servicer, vllm_servicer.interceptors
from vllm_servicer.interceptors import tracing
try:
    tracing.TracingInterceptor()
except ImportError as exc:
    print("ImportError:", exc)
else:
    raise SystemExit("TracingInterceptor() worked without opentelemetry")
import os
os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = "http://127.0.0.1:4317"
try:
    tracing.configure_tracing_from_env()
except ImportError as exc:
    print("ImportError:", exc)
"""


def test_without_the_otel_extra() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _HIDE_OTEL], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ImportError:")]
    assert len(lines) == 2
    for line in lines:
        assert "pip install 'vllm-servicer[otel]'" in line


@pytest.fixture
def otel_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)
    yield monkeypatch


def test_configure_tracing_from_env_off_by_default(otel_env: pytest.MonkeyPatch) -> None:
    assert configure_tracing_from_env() is None
    otel_env.setenv("OTEL_SERVICE_NAME", "svc")
    assert configure_tracing_from_env() is None  # no endpoint: nowhere to send
    otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    otel_env.setenv("OTEL_TRACES_EXPORTER", "none")
    assert configure_tracing_from_env() is None


@pytest.mark.parametrize(
    "variable", ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
)
def test_configure_tracing_from_env_builds_an_otlp_provider(
    otel_env: pytest.MonkeyPatch, variable: str
) -> None:
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    otel_env.setenv(variable, "http://127.0.0.1:1")
    otel_env.setenv("OTEL_SERVICE_NAME", "edge-gateway-llm")
    global_before = trace.get_tracer_provider()
    provider = configure_tracing_from_env()
    try:
        assert isinstance(provider, TracerProvider)
        assert provider.resource.attributes["service.name"] == "edge-gateway-llm"
        processors = provider._active_span_processor._span_processors
        assert len(processors) == 1 and isinstance(processors[0], BatchSpanProcessor)
        assert isinstance(processors[0].span_exporter, OTLPSpanExporter)
        assert trace.get_tracer_provider() is global_before
    finally:
        if provider is not None:
            provider.shutdown()


def test_configure_tracing_from_env_exports_over_http_when_asked(
    otel_env: pytest.MonkeyPatch,
) -> None:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    otel_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    provider = configure_tracing_from_env()
    try:
        processors = provider._active_span_processor._span_processors  # type: ignore[union-attr]
        assert isinstance(processors[0].span_exporter, OTLPSpanExporter)
    finally:
        if provider is not None:
            provider.shutdown()


# ----- many traced streams at once ---------------------------------------------------
# What tracing costs in tokens per second is the benchmarks' to print
# (benchmarks/interceptor_overhead.py, its "tracing" row against "bare"); here,
# that concurrent traced streams each get every token and a span of their own.


async def test_concurrent_traced_streams_each_get_every_token_and_one_span(engine: Any) -> None:
    provider, exporter = _provider()
    tracing = TracingInterceptor.for_engine(engine, provider)
    calls, in_flight, tokens = 32, 16, 32
    async with serving(engine, **placed("server_wide", [tracing])) as on:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(on.channel)
        slots = asyncio.Semaphore(in_flight)

        async def one(i: int) -> tuple[list[int], str]:
            async with slots:
                messages = await collect(
                    stub.Generate(
                        request(
                            max_tokens=tokens, ignore_eos=True, stream=True, request_id=f"many-{i}"
                        )
                    )
                )
            ids = [t for m in messages if m.HasField("chunk") for t in m.chunk.token_ids]
            return ids, completes(messages)[0].finish_reason

        results = await asyncio.gather(*(one(i) for i in range(calls)))
        spans = await _spans(exporter, lambda s: s.name == GENERATE, count=calls)
    provider.shutdown()
    assert all(len(ids) == tokens and finish == "length" for ids, finish in results), results
    assert len(spans) == calls
    assert {(s.attributes or {}).get("gen_ai.request.id") for s in spans} == {
        f"many-{i}" for i in range(calls)
    }
    assert all(s.status.status_code is StatusCode.UNSET for s in spans)
    assert await wait_until_idle(engine) == 0
