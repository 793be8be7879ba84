"""The launcher's tracing end to end: OTEL_* variables in, OTLP spans out, one trace.

A real OTLP trace receiver (the official `TraceService` stubs on a grpc.aio
server in this process) records every export. One launcher, with the standard
OTEL_* variables pointing at it and vLLM's own engine tracing sent there too
(`--otlp-traces-endpoint`), serves one streamed Generate that carries a
client's W3C `traceparent`. The receiver must then hold the launcher's SERVER
span under the client's span, with its GenAI attributes and the configured
`service.name`, and vLLM's `llm_request` span under the server span.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import os
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2
from support import request
from support.launcher import START_TIMEOUT, drain_output, spawn, stop, wait_for_line

from vllm_servicer import SERVICE_NAME
from vllm_servicer.proto import vllm_engine_pb2_grpc

pytestmark = pytest.mark.timeout(START_TIMEOUT + 180)

GENERATE = f"/{SERVICE_NAME}/Generate"
ENGINE_SPAN = "llm_request"  # vLLM's per-request span (vllm/v1/engine/output_processor.py)
OTEL_SERVICE = "vllm-servicer-otlp-e2e"
MAX_TOKENS = 4
SPAN_WAIT = 20.0


class _Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace collector that keeps every export request it is sent."""

    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []

    async def Export(  # noqa: N802 - the generated service's method name
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()


@dataclasses.dataclass
class Collector:
    receiver: _Receiver
    endpoint: str


@dataclasses.dataclass(frozen=True)
class Span:
    """One received span, ids in lower-case hex as W3C headers write them."""

    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any]
    resource: dict[str, Any]


@dataclasses.dataclass
class Launcher:
    address: str
    output: collections.deque[str]


@dataclasses.dataclass
class TracedCall:
    trace_id: str
    client_span_id: str
    request_id: str
    tokens: int


def _value(value: common_pb2.AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return _attributes(value.kvlist_value.values)
    return getattr(value, kind) if kind is not None else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


def _received(receiver: _Receiver) -> list[Span]:
    spans = []
    for export in list(receiver.requests):
        for resource_spans in export.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append(
                        Span(
                            name=span.name,
                            kind=span.kind,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            attributes=_attributes(span.attributes),
                            resource=resource,
                        )
                    )
    return spans


async def _wait_for_spans(
    receiver: _Receiver, match: Callable[[Span], bool], *, timeout: float = SPAN_WAIT
) -> list[Span]:
    """The received spans `match` accepts, as soon as there is one (or at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [s for s in _received(receiver) if match(s)]
        if found or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.1)


@pytest.fixture(scope="module")
async def collector() -> AsyncIterator[Collector]:
    receiver = _Receiver()
    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield Collector(receiver, f"http://127.0.0.1:{port}")
    finally:
        await server.stop(None)


@pytest.fixture(scope="module")
async def launcher(
    collector: Collector, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Launcher]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(
        {
            "VLLM_SERVICER_CACHE": str(tmp_path_factory.mktemp("cache")),
            "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint,
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_SERVICE_NAME": OTEL_SERVICE,
            # Milliseconds between batch exports (default 5000).
            "OTEL_BSP_SCHEDULE_DELAY": "200",
        }
    )
    proc = await spawn(
        "-m",
        "vllm_servicer",
        "serve",
        "--port",
        "0",
        "--otlp-traces-endpoint",
        collector.endpoint,
        env=env,
    )
    output: collections.deque[str] = collections.deque(maxlen=200)
    drain: asyncio.Future[None] | None = None
    try:
        match = await wait_for_line(proc, r"listening on (\S+:\d+)")
        drain = asyncio.ensure_future(drain_output(proc, output))
        yield Launcher(match.group(1), output)
    finally:
        try:
            await stop(proc)
        finally:
            if proc.returncode is None:
                proc.kill()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(proc.wait(), 30)
            if drain is not None:
                drain.cancel()


@pytest.fixture(scope="module")
async def traced_call(launcher: Launcher) -> TracedCall:
    """One streamed Generate under a client span of a fresh trace."""
    trace_id, client_span_id = secrets.token_hex(16), secrets.token_hex(8)
    req = request(stream=True, max_tokens=MAX_TOKENS, ignore_eos=True)
    metadata = (("traceparent", f"00-{trace_id}-{client_span_id}-01"),)
    tokens = 0
    async with grpc.aio.insecure_channel(launcher.address) as channel:
        call = vllm_engine_pb2_grpc.VllmEngineStub(channel).Generate(
            req, metadata=metadata, timeout=60
        )
        async for message in call:
            if message.HasField("chunk"):
                tokens += len(message.chunk.token_ids)
        assert await call.code() == grpc.StatusCode.OK
    assert tokens == MAX_TOKENS
    return TracedCall(trace_id, client_span_id, req.request_id, tokens)


async def _server_span(collector: Collector, call: TracedCall) -> Span:
    spans = await _wait_for_spans(
        collector.receiver, lambda s: s.name == GENERATE and s.trace_id == call.trace_id
    )
    assert len(spans) == 1, f"Generate spans of the trace: {spans}"
    return spans[0]


async def test_server_span_continues_the_client_trace_with_gen_ai_attributes(
    collector: Collector, traced_call: TracedCall
) -> None:
    span = await _server_span(collector, traced_call)
    assert span.kind == trace_pb2.Span.SPAN_KIND_SERVER
    assert span.parent_span_id == traced_call.client_span_id
    assert span.resource["service.name"] == OTEL_SERVICE
    attrs = span.attributes
    assert attrs["rpc.system"] == "grpc"
    assert attrs["rpc.grpc.status_code"] == 0
    assert attrs["gen_ai.provider.name"] == "vllm"
    assert attrs["gen_ai.operation.name"] == "text_completion"
    assert attrs["gen_ai.request.id"] == traced_call.request_id
    assert attrs["gen_ai.request.max_tokens"] == MAX_TOKENS
    assert attrs["gen_ai.usage.output_tokens"] == traced_call.tokens
    assert attrs["gen_ai.usage.input_tokens"] == len(request().tokenized.input_ids)
    assert attrs["gen_ai.response.finish_reasons"] == ["length"]
    assert attrs["gen_ai.request.model"]


async def test_engine_span_is_a_child_of_the_server_span(
    collector: Collector, traced_call: TracedCall, launcher: Launcher
) -> None:
    server = await _server_span(collector, traced_call)
    spans = await _wait_for_spans(
        collector.receiver,
        lambda s: s.name == ENGINE_SPAN and s.trace_id == traced_call.trace_id,
    )
    assert spans, (
        f"no {ENGINE_SPAN} span in the trace; span names received: "
        f"{sorted({s.name for s in _received(collector.receiver)})}; launcher output:\n"
        + "".join(list(launcher.output)[-40:])
    )
    assert len(spans) == 1, spans
    engine = spans[0]
    assert engine.parent_span_id == server.span_id
    assert engine.attributes["gen_ai.request.id"] == traced_call.request_id
    assert engine.attributes["gen_ai.usage.completion_tokens"] == traced_call.tokens
    # vLLM builds its own resource; the standard variable names the service there too.
    assert engine.resource["service.name"] == OTEL_SERVICE
