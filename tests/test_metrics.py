"""MetricsInterceptor against the real engine, server-wide and through mount(),
a real Prometheus server scraping it, and the gRPC-only launcher's endpoint
showing these series next to vLLM's own."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import shutil
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from support import free_port, placed, request, serving, wait_until_idle
from support.launcher import START_TIMEOUT, drain_output, spawn, stop, wait_for_line

from vllm_servicer import SERVICE_NAME
from vllm_servicer.engine import served_model_name
from vllm_servicer.interceptors import (
    InflightInterceptor,
    MetricsInterceptor,
    start_metrics_server,
)
from vllm_servicer.proto import vllm_engine_pb2 as pb
from vllm_servicer.proto import vllm_engine_pb2_grpc
from vllm_servicer.testing.tiny_model import apply_cpu_env_defaults, tiny_engine_flags

LONG = {"max_tokens": 5000, "ignore_eos": True}
GENERATE = {"grpc_type": "server_stream", "grpc_service": SERVICE_NAME, "grpc_method": "Generate"}
ABORT = {"grpc_type": "unary", "grpc_service": SERVICE_NAME, "grpc_method": "Abort"}


class Served:
    def __init__(self, stub: Any, metrics: MetricsInterceptor, inflight: InflightInterceptor):
        self.stub = stub
        self.metrics = metrics
        self.inflight = inflight
        self.registry = metrics.registry
        self.model_name = metrics.model_name

    def labels(self, name: str, labels: dict[str, str]) -> dict[str, str]:
        if name.startswith("vllm_servicer_"):
            # Every generation series is per model; the grpc_server_* ones are not.
            return {"model_name": self.model_name, **labels}
        return labels

    def value(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, self.labels(name, labels)) or 0.0

    def snapshot(self) -> Callable[..., float]:
        """A function giving how much a sample grew since now."""
        before = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in self.registry.collect()
            for s in family.samples
        }

        def delta(name: str, **labels: str) -> float:
            key = (name, tuple(sorted(self.labels(name, labels).items())))
            return self.value(name, **labels) - before.get(key, 0.0)

        return delta

    async def settle(self) -> None:
        """Wait until every call has reached on_finish."""
        assert await self.inflight.wait_idle(10, include_all=True)
        assert self.value("vllm_servicer_requests_in_flight") == 0


@asynccontextmanager
async def _serve(
    engine: Any, placement: str, outer: tuple[Any, ...] = ()
) -> AsyncIterator[tuple[grpc.aio.Server, Served]]:
    metrics = MetricsInterceptor(CollectorRegistry(), model_name=served_model_name(engine))
    # Inside metrics, so metrics sees the limit's rejections too.
    inflight = InflightInterceptor()
    async with serving(engine, **placed(placement, [*outer, metrics, inflight])) as running:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(running.channel)
        yield running.server, Served(stub, metrics, inflight)


@pytest.fixture(scope="module")
async def served(placement: str, engine: Any) -> AsyncIterator[Served]:
    async with _serve(engine, placement) as (_, served):
        yield served


async def _read_all(call: Any) -> list[Any]:
    messages = []
    while (message := await call.read()) is not grpc.aio.EOF:
        messages.append(message)
    return messages


def _token_chunks(messages: list[Any]) -> int:
    return sum(1 for m in messages if m.HasField("chunk") and m.chunk.token_ids)


async def test_successes_exact(served: Served, engine: Any) -> None:
    delta = served.snapshot()
    sent = 0
    chunks_per_stream = []
    for stream in (False, False, True, True):
        call = served.stub.Generate(request(stream=stream, max_tokens=4, ignore_eos=True))
        messages = await _read_all(call)
        sent += len(messages)
        if stream:
            chunks_per_stream.append(_token_chunks(messages))
    await served.settle()

    assert delta("grpc_server_started_total", **GENERATE) == 4
    assert delta("grpc_server_handled_total", **GENERATE, grpc_code="OK") == 4
    assert delta("grpc_server_msg_received_total", **GENERATE) == 4
    assert delta("grpc_server_msg_sent_total", **GENERATE) == sent
    assert delta("grpc_server_handling_seconds_count", **GENERATE) == 4
    assert delta("vllm_servicer_request_duration_seconds_count") == 4
    assert delta("vllm_servicer_prompt_tokens_total") == 4 * 8
    assert delta("vllm_servicer_generation_tokens_total") == 4 * 4
    assert delta("vllm_servicer_request_finish_total", finish_reason="length") == 4
    # Streaming calls only, once per request (the second only with tokens after the first).
    assert delta("vllm_servicer_time_to_first_token_seconds_count") == 2
    assert delta("vllm_servicer_time_per_output_token_seconds_count") == sum(
        1 for n in chunks_per_stream if n > 1
    )
    for cause in ("client_cancel", "deadline", "abort_rpc", "shutdown"):
        assert delta("vllm_servicer_request_cancelled_total", cause=cause) == 0
    assert await wait_until_idle(engine) == 0


async def test_a_running_stream_shows_up_within_about_a_second(served: Served, engine: Any) -> None:
    # The counters read a running call's usage once a second: a long stream
    # must show while it runs, not only when it ends. Frozen mid-stream, the
    # call stays running for as long as the check needs.
    delta = served.snapshot()
    call = served.stub.Generate(request(stream=True, max_tokens=480, ignore_eos=True))
    received = 0
    while received < 2:
        message = await call.read()
        received += len(message.chunk.token_ids)
    await engine.pause_generation(mode="keep", clear_cache=False)
    try:
        loop = asyncio.get_running_loop()
        paused_at = loop.time()
        while delta("vllm_servicer_generation_tokens_total") < received:
            # Read once a second; ten, for a busy machine, still tells "while it
            # runs" from "at its end" (the stream is frozen until the check ends).
            assert loop.time() - paused_at < 10, "a running stream's tokens were not counted"
            await asyncio.sleep(0.05)
        assert delta("vllm_servicer_time_to_first_token_seconds_count") == 1
        assert delta("grpc_server_msg_sent_total", **GENERATE) >= 2
        assert delta("vllm_servicer_request_duration_seconds_count") == 0  # still running
    finally:
        await engine.resume_generation()
    while (message := await call.read()) is not grpc.aio.EOF:
        received += len(message.chunk.token_ids) if message.HasField("chunk") else 0
    await served.settle()
    assert delta("vllm_servicer_generation_tokens_total") == received == 480
    assert delta("vllm_servicer_time_to_first_token_seconds_count") == 1
    assert delta("vllm_servicer_request_duration_seconds_count") == 1
    assert await wait_until_idle(engine) == 0


async def test_failures_exact(served: Served, engine: Any) -> None:
    delta = served.snapshot()
    stub = served.stub
    # INVALID_ARGUMENT.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _read_all(stub.Generate(request(top_p=1.5)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # Client cancel after three messages.
    call = stub.Generate(request(stream=True, **LONG))
    for _ in range(3):
        await call.read()
    call.cancel()
    # Deadline.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _read_all(stub.Generate(request(stream=True, **LONG), timeout=0.5))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # Abort RPC: the stream ends OK with finish_reason "abort".
    call = stub.Generate(request(request_id="metrics-abort", stream=True, **LONG))
    await call.read()
    await stub.Abort(pb.AbortRequest(request_ids=["metrics-abort"]))
    assert (await _read_all(call))[-1].complete.finish_reason == "abort"
    await served.settle()

    assert delta("grpc_server_started_total", **GENERATE) == 4
    for code, n in (("OK", 1), ("INVALID_ARGUMENT", 1), ("CANCELLED", 1), ("DEADLINE_EXCEEDED", 1)):
        assert delta("grpc_server_handled_total", **GENERATE, grpc_code=code) == n, code
    assert delta("grpc_server_handled_total", **ABORT, grpc_code="OK") == 1
    assert delta("grpc_server_msg_received_total", **ABORT) == 1
    assert delta("grpc_server_msg_sent_total", **ABORT) == 1
    assert delta("vllm_servicer_request_duration_seconds_count") == 4
    assert delta("vllm_servicer_request_finish_total", finish_reason="abort") == 1
    assert delta("vllm_servicer_request_finish_total", finish_reason="length") == 0
    for cause, n in (("client_cancel", 1), ("deadline", 1), ("abort_rpc", 1), ("shutdown", 0)):
        assert delta("vllm_servicer_request_cancelled_total", cause=cause) == n, cause
    # The cancelled and aborted streams had sent tokens: one TTFT each.
    assert delta("vllm_servicer_time_to_first_token_seconds_count") >= 2
    assert await wait_until_idle(engine) == 0


async def _cancel_at(served: Served, point: str) -> None:
    """One streaming Generate, cancelled by the client at `point` once it started."""
    started = served.value("grpc_server_started_total", **GENERATE)
    # Top-20 logprobs make each message a few hundred bytes: a client that stops
    # reading fills the flow-control window within a fraction of a second.
    call = served.stub.Generate(request(stream=True, logprobs=20, **LONG))
    if point == "before_first_message":
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while served.value("grpc_server_started_total", **GENERATE) == started:
            assert loop.time() < deadline, "the call never reached the server"
            await asyncio.sleep(0.001)
    elif point == "between_messages":
        for _ in range(2):
            await call.read()
    else:  # during a blocked write
        await call.read()
        await asyncio.sleep(0.5)
    call.cancel()


@pytest.mark.parametrize(
    "point", ["before_first_message", "between_messages", "during_blocked_write"]
)
@pytest.mark.parametrize("traced", [False, True], ids=["metrics", "traced"])
async def test_client_cancel_counted_once_wherever_it_lands(
    engine: Any, point: str, traced: bool
) -> None:
    """Each cancel is one CANCELLED, promptly, and leaves the engine.

    The garbage collector is off: the count and the engine abort may not wait
    for it to close a response generator that grpc left suspended. Traced, the
    stack is the launcher's: OpenTelemetry's own wrapper outermost.
    """
    outer: tuple[Any, ...] = ()
    spans = None
    if traced:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        from vllm_servicer.interceptors import TracingInterceptor

        spans = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(spans))
        outer = (TracingInterceptor(tracer_provider=provider),)
    calls = 6
    async with _serve(engine, "server_wide", outer) as (_, served):
        delta = served.snapshot()
        gc.disable()
        try:
            for _ in range(calls):
                await _cancel_at(served, point)
            assert await served.inflight.wait_idle(5, include_all=True), "calls left in flight"
            assert await wait_until_idle(engine, timeout=5) == 0, "cancelled requests left running"
        finally:
            gc.enable()
    assert delta("grpc_server_handled_total", **GENERATE, grpc_code="CANCELLED") == calls
    assert delta("grpc_server_handled_total", **GENERATE, grpc_code="OK") == 0
    assert delta("vllm_servicer_request_cancelled_total", cause="client_cancel") == calls
    assert delta("vllm_servicer_requests_in_flight") == 0
    if spans is not None:
        # Each span ends with the call's code, though OpenTelemetry's wrapper
        # (outermost) is closed at the cancel before the layer that sets it.
        codes = [s.attributes["rpc.grpc.status_code"] for s in spans.get_finished_spans()]
        assert codes == [grpc.StatusCode.CANCELLED.value[0]] * calls


async def test_limit_rejections_are_counted(served: Served, engine: Any) -> None:
    delta = served.snapshot()
    served.inflight.max_inflight = 1
    try:
        running = served.stub.Generate(request(stream=True, **LONG))
        await running.read()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _read_all(served.stub.Generate(request(max_tokens=2)))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        running.cancel()
        await served.settle()
    finally:
        served.inflight.max_inflight = None
    assert delta("grpc_server_handled_total", **GENERATE, grpc_code="RESOURCE_EXHAUSTED") == 1
    assert delta("grpc_server_handled_total", **GENERATE, grpc_code="CANCELLED") == 1
    assert delta("vllm_servicer_request_duration_seconds_count") == 2
    assert await wait_until_idle(engine) == 0


async def test_shutdown_cause(engine: Any) -> None:
    async with _serve(engine, "mounted") as (server, served):
        call = served.stub.Generate(request(stream=True, **LONG))
        await call.read()
        served.metrics.mark_shutdown()
        await server.stop(0.2)
        with pytest.raises(grpc.aio.AioRpcError):
            await _read_all(call)
        await served.settle()
        assert served.value("vllm_servicer_request_cancelled_total", cause="shutdown") == 1
        assert served.value("vllm_servicer_request_cancelled_total", cause="client_cancel") == 0
    assert await wait_until_idle(engine) == 0


def test_generation_series_carry_the_model_name_and_rpc_series_do_not() -> None:
    registry = CollectorRegistry()
    MetricsInterceptor(registry, model_name="tiny-served")
    families = list(registry.collect())
    ours = [s for f in families if f.name.startswith("vllm_servicer_") for s in f.samples]
    grpcs = [s for f in families if f.name.startswith("grpc_server_") for s in f.samples]
    # Bound up front: every generation series exists before the first call.
    assert {s.name for s in ours} >= {
        "vllm_servicer_generation_tokens_total",
        "vllm_servicer_time_to_first_token_seconds_count",
        "vllm_servicer_requests_in_flight",
        "vllm_servicer_request_finish_total",
    }
    assert all(s.labels.get("model_name") == "tiny-served" for s in ours)
    assert all("model_name" not in s.labels for s in grpcs)


def test_draining_reads_one_from_mark_shutdown_on() -> None:
    registry = CollectorRegistry()
    metrics = MetricsInterceptor(registry, model_name="tiny-served")
    labels = {"model_name": "tiny-served"}
    # Present at 0 from the start, so a dashboard shows "serving", not "no data".
    assert registry.get_sample_value("vllm_servicer_draining", labels) == 0
    metrics.mark_shutdown()
    assert registry.get_sample_value("vllm_servicer_draining", labels) == 1


def test_separate_registries_do_not_collide() -> None:
    first, second = CollectorRegistry(), CollectorRegistry()
    MetricsInterceptor(first)
    MetricsInterceptor(second)
    with pytest.raises(ValueError):
        MetricsInterceptor(first)


# ----- a real Prometheus --------------------------------------------------------


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=2) as reply:
        return json.load(reply)


async def _query(base: str, promql: str) -> float | None:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    try:
        body = await asyncio.to_thread(_get_json, url)
    except OSError:
        return None
    result = body["data"]["result"]
    return float(result[0]["value"][1]) if result else None


@pytest.fixture
def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        pytest.skip("the prometheus binary is not installed (Debian: apt-get install prometheus)")
    return found


async def test_real_prometheus_scrapes_the_series(
    served: Served, prometheus_binary: str, tmp_path: Path, engine: Any
) -> None:
    http_server, _ = start_metrics_server(0, registry=served.registry)
    metrics_port = http_server.server_port
    web_port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: vllm_servicer\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{metrics_port}']\n"
    )
    for stream in (False, True, True):
        await _read_all(served.stub.Generate(request(stream=stream, max_tokens=5, ignore_eos=True)))
    await served.settle()
    per_model = f'model_name="{served.model_name}"'
    expected = {
        'grpc_server_handled_total{grpc_method="Generate",grpc_code="OK"}': served.value(
            "grpc_server_handled_total", **GENERATE, grpc_code="OK"
        ),
        f"vllm_servicer_generation_tokens_total{{{per_model}}}": served.value(
            "vllm_servicer_generation_tokens_total"
        ),
        "vllm_servicer_time_to_first_token_seconds_count": served.value(
            "vllm_servicer_time_to_first_token_seconds_count"
        ),
        f'vllm_servicer_request_finish_total{{finish_reason="length",{per_model}}}': served.value(
            "vllm_servicer_request_finish_total", finish_reason="length"
        ),
        "vllm_servicer_requests_in_flight": 0.0,
    }
    assert expected[f"vllm_servicer_generation_tokens_total{{{per_model}}}"] >= 15
    log = tmp_path / "prometheus.log"
    with log.open("wb") as sink:
        process = await asyncio.create_subprocess_exec(
            prometheus_binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{web_port}",
            stdout=sink,
            stderr=sink,
        )
    base = f"http://127.0.0.1:{web_port}"
    try:
        got: dict[str, float | None] = {}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while loop.time() < deadline:
            assert process.returncode is None, log.read_text()[-2000:]
            got = {promql: await _query(base, promql) for promql in expected}
            if got == expected:
                break
            await asyncio.sleep(0.5)
        assert got == expected
        assert await _query(base, 'up{job="vllm_servicer"}') == 1.0
    finally:
        process.terminate()
        await asyncio.wait_for(process.wait(), 10)
        http_server.shutdown()


# ----- the gRPC-only launcher's endpoint ------------------------------------------


SERVED_NAME = "tiny-served"


def _scrape_text(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus text page, keyed by name and sorted labels."""
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _sum(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    return sum(
        value
        for (n, items), value in samples.items()
        if n == name and labels.items() <= dict(items).items()
    )


@pytest.mark.timeout(START_TIMEOUT + 180)
async def test_launcher_endpoint_shows_both_families_per_model(tiny_model_dir: Path) -> None:
    """`serve --metrics-port` without the HTTP API: one scrape shows this
    package's series and vLLM's own `vllm:*` ones, labelled with the same
    served model name, and both count what a Generate produced."""
    # A served name differs from the model path only with --model given, so the
    # tiny model's settings are passed as flags.
    env = {**os.environ, **apply_cpu_env_defaults()}
    engine_flags = tiny_engine_flags()
    proc = await spawn(
        "-m",
        "vllm_servicer",
        "serve",
        "--model",
        str(tiny_model_dir),
        *engine_flags,
        "--served-model-name",
        SERVED_NAME,
        "--port",
        "0",
        "--metrics-port",
        "0",
        env=env,
    )
    output = None
    try:
        url = (await wait_for_line(proc, r"metrics on (http://\S+/metrics)")).group(1)
        address = (await wait_for_line(proc, r"listening on (\S+:\d+)")).group(1)
        output = asyncio.ensure_future(drain_output(proc))
        before = await asyncio.to_thread(_scrape_text, url)
        async with grpc.aio.insecure_channel(address) as channel:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            messages = await _read_all(
                stub.Generate(request(stream=True, max_tokens=6, ignore_eos=True))
            )
        produced = sum(len(m.chunk.token_ids) for m in messages if m.HasField("chunk"))
        assert produced == 6

        model = {"model_name": SERVED_NAME}

        def grew(after: Any, name: str, **labels: str) -> float:
            return _sum(after, name, **labels) - _sum(before, name, **labels)

        # vLLM records its stats after the outputs went out: wait for them.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while True:
            after = await asyncio.to_thread(_scrape_text, url)
            moved = (
                grew(after, "vllm:request_success_total", **model) == 1
                and grew(after, "vllm:generation_tokens_total", **model) == produced
                and grew(after, "vllm_servicer_generation_tokens_total", **model) == produced
                and _sum(after, "vllm_servicer_requests_in_flight", **model) == 0
            )
            if moved or loop.time() > deadline:
                break
            await asyncio.sleep(0.2)

        ours = {k: v for k, v in after.items() if k[0].startswith("vllm_servicer_")}
        assert ours
        assert {dict(labels).get("model_name") for _, labels in ours} == {SERVED_NAME}
        assert all(
            "model_name" not in dict(labels) for name, labels in after if name.startswith("grpc_")
        )
        for name in (
            "vllm:generation_tokens_total",
            "vllm:prompt_tokens_total",
            "vllm:request_success_total",
            "vllm:time_to_first_token_seconds_count",
            "vllm:num_requests_running",
        ):
            found = {dict(labels).get("model_name") for n, labels in after if n == name}
            assert found == {SERVED_NAME}, (name, found)
        assert grew(after, "vllm:request_success_total", **model, finished_reason="length") == 1
        assert grew(after, "vllm:generation_tokens_total", **model) == produced
        assert grew(after, "vllm:time_to_first_token_seconds_count", **model) == 1
        assert grew(after, "vllm_servicer_generation_tokens_total", **model) == produced
        assert grew(after, "vllm_servicer_time_to_first_token_seconds_count", **model) == 1
        assert (
            grew(after, "vllm_servicer_request_finish_total", **model, finish_reason="length") == 1
        )
        assert _sum(after, "vllm_servicer_requests_in_flight", **model) == 0
        assert await stop(proc) == 0
    finally:
        if output is not None:
            output.cancel()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_the_load_reports_utilization_is_a_gauge_balancers_and_dashboards_agree_on() -> None:
    from vllm_servicer.interceptors.load_reports import LoadReportInterceptor
    from vllm_servicer.load_reports.report import CallRates, EngineLoad, LoadReporter
    from vllm_servicer.mounting import engine_pipeline

    registry = CollectorRegistry()
    metrics = MetricsInterceptor(registry, model_name="tiny-served")
    load = EngineLoad(running=8, waiting=0, max_num_seqs=16, kv_cache_usage=0.25)
    reporter = LoadReporter(lambda: load, CallRates(), refresh=0)
    engine_pipeline([metrics], load_reports=LoadReportInterceptor(reporter))
    labels = {"model_name": "tiny-served"}
    # 8 of 16 slots outweighs a quarter of the KV cache: what the trailer says too.
    assert registry.get_sample_value("vllm_servicer_orca_application_utilization", labels) == 0.5
    assert reporter.report().application_utilization == 0.5
    load = EngineLoad(running=1, waiting=0, max_num_seqs=16, kv_cache_usage=0.75)
    assert registry.get_sample_value("vllm_servicer_orca_application_utilization", labels) == 0.75
