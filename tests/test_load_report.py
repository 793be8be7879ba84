"""ORCA load reports: what they say of the engine, and where they travel.

The rule and the rates first (no server). Then through a real server with
stand-in handlers: which calls carry the trailer and which ends count as the
server's errors; the out-of-band stream's floor on its interval. Then on the
session's real engine: the trailer of VllmEngine's Generate and Embed and
vllm.Inference's Generate and GenerateStream, read off the wire (grpc's own
client hands `endpoint-load-metrics-bin` to its balancer, never to the
caller) and parsed with the vendored message; the out-of-band stream over a
real channel; what keys and the keyless caps do to both; the switch.
The balancers' own reading of them is `test_load_balancing.py`'s.
"""

from __future__ import annotations

import asyncio
import datetime
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from support import bearer, request, serving
from support.h2_grpc import RawReply, raw_call

from vllm_servicer.context import blame_caller
from vllm_servicer.frontends import FrontendGroup
from vllm_servicer.interceptors import (
    AuthInterceptor,
    InflightInterceptor,
    KeylessLimitInterceptor,
    KeylessLimits,
    LoadReportInterceptor,
)
from vllm_servicer.interceptors.api_keys import ApiKeyVerifier
from vllm_servicer.load_reports.report import (
    TRAILER_KEY,
    CallRates,
    EngineLoad,
    LoadReporter,
    RankLoad,
    report_of,
    utilization,
)
from vllm_servicer.proto import (
    ORCA_SERVICE,
    inference_pb2,
    orca_load_report_pb2,
    orca_pb2,
    orca_pb2_grpc,
    vllm_engine_pb2_grpc,
)
from vllm_servicer.proto import vllm_engine_pb2 as pb
from vllm_servicer.servicer.orca import OpenRcaServicer
from vllm_servicer.testing.tiny_model import TINY_ENGINE_KWARGS

OrcaLoadReport = orca_load_report_pb2.OrcaLoadReport
GENERATE = "/vllm.grpc.engine.VllmEngine/Generate"
HEALTH_CHECK = "/vllm.grpc.engine.VllmEngine/HealthCheck"
KEY = "orca-test-0123456789abcdefABCDEF"
VLLM_NAMES = {"kv_cache_usage_perc", "num_requests_running", "num_requests_waiting"}
# And the work queued in tokens, which vLLM has no series for.
REPORTED_NAMES = VLLM_NAMES | {"num_waiting_prompt_tokens"}


class Clock:
    """Monotonic seconds a test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _report(reply: RawReply) -> OrcaLoadReport:
    value = reply.binary(TRAILER_KEY)
    assert value is not None, f"no {TRAILER_KEY} in {reply.trailers}"
    return OrcaLoadReport.FromString(value)


# ----- the rule, the rates, the cache -----------------------------------------------


def test_utilization_is_the_fuller_of_kv_cache_and_sequence_slots() -> None:
    assert (
        utilization(EngineLoad(running=4, waiting=0, max_num_seqs=16, kv_cache_usage=0.1)) == 0.25
    )
    assert utilization(EngineLoad(running=4, waiting=0, max_num_seqs=16, kv_cache_usage=0.6)) == 0.6
    # A queue reads above capacity: the replica is more than full.
    assert utilization(EngineLoad(running=16, waiting=8, max_num_seqs=16)) == 1.5
    # Idle is lighter than one request running, but never zero: gRPC's and
    # Envoy's weighted round robin drop a report of zero utilization.
    idle = utilization(EngineLoad(running=0, waiting=0, max_num_seqs=16, kv_cache_usage=0.0))
    assert 0 < idle < utilization(EngineLoad(running=1, waiting=0, max_num_seqs=16))


def test_the_report_names_its_figures_as_vllm_does() -> None:
    report = report_of(EngineLoad(3, 2, 8, 0.5, waiting_prompt_tokens=3700), rps=4.5, eps=0.5)
    assert report.application_utilization == 0.625  # (3 + 2) / 8
    assert (report.rps_fractional, report.eps) == (4.5, 0.5)
    assert dict(report.named_metrics) == {
        "kv_cache_usage_perc": 0.5,
        "num_requests_running": 3.0,
        "num_requests_waiting": 2.0,
        # The work queued, in tokens: two requests of 1,850 read apart from two of 8.
        "num_waiting_prompt_tokens": 3700.0,
    }
    # Without the engine's stats the KV cache is unknown: left out, not zero.
    assert "kv_cache_usage_perc" not in report_of(EngineLoad(1, 0, 8), 0, 0).named_metrics


def test_a_data_parallel_engine_reports_each_rank_by_its_global_number() -> None:
    # A launcher serving ranks 2 and 3 of four (the hybrid layout).
    ranks = (RankLoad(2, 3, 1, 0.25), RankLoad(3, 0, 0, 0.75))
    named = dict(report_of(EngineLoad(3, 1, 8, 0.5, ranks), 0, 0).named_metrics)
    assert named["num_requests_running"] == 3.0
    assert {key: value for key, value in named.items() if key.startswith("rank.")} == {
        "rank.2.num_requests_running": 3.0,
        "rank.2.num_requests_waiting": 1.0,
        "rank.2.kv_cache_usage_perc": 0.25,
        "rank.3.num_requests_running": 0.0,
        "rank.3.num_requests_waiting": 0.0,
        "rank.3.kv_cache_usage_perc": 0.75,
    }


def test_rates_cover_the_recent_window_however_seldom_read() -> None:
    clock = Clock()
    rates = CallRates(window=10, clock=clock)
    clock.now += 5
    for failed in [False] * 40 + [True] * 10:
        rates.ended(failed)
    assert rates.rates() == (10.0, 2.0)  # 50 calls, 10 failed, in 5 s
    clock.now += 15  # nothing since: the window holds no call
    assert rates.rates() == (0.0, 0.0)
    fresh = CallRates(window=10, clock=clock)
    fresh.ended(False)
    clock.now += 0.1
    # One call a tenth of a second after the start is not ten a second.
    assert fresh.rates() == (1.0, 0.0)


def test_rates_are_every_frontend_process_together() -> None:
    group = FrontendGroup(2)
    group.join(0)
    rates = CallRates(group)
    for _ in range(3):
        rates.ended(False)
    group.join(1)  # the same shared counts, from the other process
    rates.ended(True)
    assert rates.totals() == (4, 1)
    assert group.ended == (4, 1)


def test_the_engine_is_read_at_most_once_per_refresh() -> None:
    clock = Clock()
    reads: list[float] = []

    def read() -> EngineLoad:
        reads.append(clock.now)
        return EngineLoad(len(reads), 0, 8, 0.0)

    reporter = LoadReporter(read, CallRates(clock=clock), refresh=0.25, clock=clock)
    first = reporter.serialized()
    for _ in range(100):
        assert reporter.serialized() is first  # cached bytes, no read, no serialization
    assert len(reads) == 1
    clock.now += 0.25
    assert (
        OrcaLoadReport.FromString(reporter.serialized()).named_metrics["num_requests_running"]
        == 2.0
    )
    assert reporter.report().named_metrics["num_requests_running"] == 2.0
    assert len(reads) == 2


async def test_a_report_that_can_wait_takes_the_newest_figures() -> None:
    clock = Clock()
    peers = {"running": 1}

    async def update() -> bool:  # the other processes' figures fetched anew
        peers["running"] = 5
        return True

    reporter = LoadReporter(
        lambda: EngineLoad(peers["running"], 0, 8),
        CallRates(clock=clock),
        update=update,
        clock=clock,
    )
    assert reporter.report().named_metrics["num_requests_running"] == 1
    # Within the cached report's life, yet made anew: the stream's report waits for them.
    assert (await reporter.fresh_report()).named_metrics["num_requests_running"] == 5


# ----- the trailer and the stream through a real server, stand-in handlers ---------


@pytest.fixture
async def stand_in() -> AsyncIterator[tuple[str, LoadReporter]]:
    """A server with VllmEngine's Generate and HealthCheck as stand-ins: a Generate
    answers, or aborts with the code its request names."""
    reporter = LoadReporter(lambda: EngineLoad(3, 1, 16, 0.2), CallRates(), refresh=0)

    async def generate(request: bytes, context: Any) -> AsyncIterator[bytes]:
        if request.startswith(b"CALLERS:"):
            # A refusal for the caller's own doing (past its share), as the pools mark it.
            blame_caller()
            request = request.removeprefix(b"CALLERS:")
        if request != b"OK":
            await context.abort(grpc.StatusCode[request.decode()], "as asked")
        context.set_trailing_metadata((("x-handler", "kept"),))
        yield b"token"

    async def health_check(request: bytes, context: Any) -> bytes:
        return b"healthy"

    server = grpc.aio.server(interceptors=[LoadReportInterceptor(reporter)])
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(generate),
        "HealthCheck": grpc.unary_unary_rpc_method_handler(health_check),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("vllm.grpc.engine.VllmEngine", handlers),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", reporter
    finally:
        await server.stop(None)


async def test_engine_calls_ending_ok_carry_the_report_and_server_faults_count_as_errors(
    stand_in: tuple[str, LoadReporter],
) -> None:
    address, reporter = stand_in
    ok = await raw_call(address, GENERATE, b"OK")
    assert ok.status == 0 and ok.messages == [b"token"]
    assert ok.trailers["x-handler"] == "kept"  # the handler's own trailers stay
    report = _report(ok)
    assert report.application_utilization == 0.25  # (3 running + 1 waiting) / 16 slots
    assert dict(report.named_metrics) == {
        "kv_cache_usage_perc": 0.2,
        "num_requests_running": 3.0,
        "num_requests_waiting": 1.0,
        "num_waiting_prompt_tokens": 0.0,
    }
    assert report.rps_fractional > 0
    # Not an engine call: no report, not counted.
    health = await raw_call(address, HEALTH_CHECK, b"")
    assert health.status == 0 and TRAILER_KEY not in health.trailers
    failed = ("UNAVAILABLE", "RESOURCE_EXHAUSTED", "INTERNAL")
    clients = (
        "INVALID_ARGUMENT",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "PERMISSION_DENIED",
        "UNIMPLEMENTED",  # a field this server does not serve
        "DEADLINE_EXCEEDED",  # the client's own deadline
        "CALLERS:RESOURCE_EXHAUSTED",  # a tenant past its own share
        "CALLERS:DEADLINE_EXCEEDED",  # a request message never sent
    )
    for code in failed + clients:
        reply = await raw_call(address, GENERATE, code.encode())
        assert reply.status == grpc.StatusCode[code.removeprefix("CALLERS:")].value[0]
        assert TRAILER_KEY not in reply.trailers  # the status left before the hook ran
    # Every engine call counts; only the server's own faults count as errors.
    # (A refused call's end is counted just after its status has left.)
    expected = (1 + len(failed) + len(clients), len(failed))
    for _ in range(50):
        if reporter.rates.totals() == expected:
            break
        await asyncio.sleep(0.1)
    assert reporter.rates.totals() == expected
    last = _report(await raw_call(address, GENERATE, b"OK"))
    assert last.eps > 0


async def test_the_stream_reports_no_more_often_than_its_floor() -> None:
    reporter = LoadReporter(lambda: EngineLoad(0, 0, 8), CallRates(), refresh=0)
    server = grpc.aio.server()
    orca_pb2_grpc.add_OpenRcaServiceServicer_to_server(
        OpenRcaServicer(reporter, min_interval=0.3), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = orca_pb2_grpc.OpenRcaServiceStub(channel)
            for asked, floor in ((0.01, 0.3), (0.6, 0.6)):
                interval = datetime.timedelta(seconds=asked)
                opened = time.monotonic()
                call = stub.StreamCoreMetrics(
                    orca_pb2.OrcaLoadReportRequest(report_interval=interval)
                )
                for _ in range(3):
                    report = await call.read()
                    assert report.application_utilization > 0
                took = time.monotonic() - opened
                call.cancel()
                # The first report leaves at once, each next one a floor later. From
                # the call's start, not between reads: a busy machine may hand two
                # queued reports to the reader back to back, never earlier than sent.
                assert took >= 2 * floor * 0.9, (asked, took)
    finally:
        await server.stop(None)


# ----- on the session's engine -------------------------------------------------------


def _inference_request(max_tokens: int = 4) -> bytes:
    return inference_pb2.GenerateRequest(
        token_ids=inference_pb2.TokenIds(ids=[5, 17, 42, 99]),
        stopping=inference_pb2.StoppingCriteria(max_new_tokens=max_tokens, ignore_eos=True),
    ).SerializeToString()


@pytest.fixture
async def long_stream(server: Any) -> AsyncIterator[None]:
    """A streamed Generate running on the session engine while the test runs."""
    stub = vllm_engine_pb2_grpc.VllmEngineStub(server.channel)
    call = stub.Generate(request(max_tokens=500, ignore_eos=True, stream=True))
    await call.read()
    yield
    call.cancel()


async def test_every_generation_call_carries_the_engines_report(server: Any) -> None:
    calls = {
        "VllmEngine Generate": (GENERATE, request(max_tokens=3).SerializeToString()),
        "VllmEngine Generate, streamed": (
            GENERATE,
            request(max_tokens=3, stream=True).SerializeToString(),
        ),
        "vllm.Inference Generate": ("/vllm.Inference/Generate", _inference_request()),
        "vllm.Inference GenerateStream": ("/vllm.Inference/GenerateStream", _inference_request()),
    }
    max_num_seqs = server.mounted.state.engine.vllm_config.scheduler_config.max_num_seqs
    for name, (path, message) in calls.items():
        reply = await raw_call(server.address, path, message)
        assert reply.status == 0 and reply.messages, name
        report = _report(reply)
        assert set(report.named_metrics) == REPORTED_NAMES, name
        assert 0 <= report.named_metrics["kv_cache_usage_perc"] <= 1
        # Idle between calls: half a slot, never zero.
        assert report.application_utilization >= 0.5 / max_num_seqs, name
        assert report.rps_fractional > 0, name


async def test_the_report_follows_the_engine(server: Any, long_stream: None) -> None:
    max_num_seqs = server.mounted.state.engine.vllm_config.scheduler_config.max_num_seqs
    await asyncio.sleep(0.3)  # past the cached report's life
    report = _report(await raw_call(server.address, GENERATE, request().SerializeToString()))
    assert report.named_metrics["num_requests_running"] >= 1
    assert report.application_utilization >= 1 / max_num_seqs


async def test_embed_carries_the_report(embedding_engine: Any) -> None:
    async with serving(embedding_engine) as served:
        message = pb.EmbedRequest(
            request_id="orca-embed", tokenized=pb.TokenizedInput(input_ids=[5, 6, 7])
        )
        reply = await raw_call(
            served.address, "/vllm.grpc.engine.VllmEngine/Embed", message.SerializeToString()
        )
    assert reply.status == 0
    report = _report(reply)
    assert set(report.named_metrics) == REPORTED_NAMES and report.rps_fractional > 0


async def test_the_out_of_band_stream_follows_the_engine(server: Any, engine: Any) -> None:
    stub = orca_pb2_grpc.OpenRcaServiceStub(server.channel)
    interval = datetime.timedelta(seconds=1)
    call = stub.StreamCoreMetrics(orca_pb2.OrcaLoadReportRequest(report_interval=interval))
    try:
        first = await call.read()
        assert set(first.named_metrics) == REPORTED_NAMES and first.application_utilization > 0
        generate = vllm_engine_pb2_grpc.VllmEngineStub(server.channel).Generate(
            request(max_tokens=500, ignore_eos=True, stream=True)
        )
        await generate.read()
        # Frozen mid-stream, the request runs for as long as the reports take: on a
        # quiet machine the tiny model would finish it before the second report.
        await engine.pause_generation(mode="keep", clear_cache=False)
        try:
            seen = [await asyncio.wait_for(call.read(), 5) for _ in range(3)]
        finally:
            await engine.resume_generation()
            generate.cancel()
        assert max(r.named_metrics["num_requests_running"] for r in seen) >= 1
        # At least one of the engine's slots in use: above an idle engine's half slot
        # (other tests' requests may be running too, so not compared with `first`).
        slots = TINY_ENGINE_KWARGS["max_num_seqs"]
        assert max(r.application_utilization for r in seen) >= 1 / slots
    finally:
        call.cancel()


async def test_reports_need_no_key_on_the_stream_but_one_on_the_calls(engine: Any) -> None:
    limits = KeylessLimits(max_keyless_streams=2)
    interceptors = [
        KeylessLimitInterceptor(limits),
        AuthInterceptor(ApiKeyVerifier([KEY])),
        InflightInterceptor(1),
    ]
    async with serving(engine, interceptors=interceptors) as served:
        stub = orca_pb2_grpc.OpenRcaServiceStub(served.channel)
        streams = []
        try:
            # A balancer's stream carries no key, as health's; its slots are the keyless ones.
            for _ in range(2):
                streams.append(stub.StreamCoreMetrics(orca_pb2.OrcaLoadReportRequest()))
                assert (await streams[-1].read()).application_utilization > 0
            streams.append(stub.StreamCoreMetrics(orca_pb2.OrcaLoadReportRequest()))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await streams[-1].read()
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_keyless_streams" in str(refused.value.details())
        finally:
            for call in streams:
                call.cancel()
        message = request(max_tokens=2).SerializeToString()
        # No key: refused before anything is read, and told nothing of the load.
        stranger = await raw_call(served.address, GENERATE, message)
        assert stranger.status == grpc.StatusCode.UNAUTHENTICATED.value[0]
        assert TRAILER_KEY not in stranger.trailers and TRAILER_KEY not in stranger.headers
        keyed = await raw_call(served.address, GENERATE, message, bearer(KEY))
        assert _report(keyed).eps == 0
        # A call past the in-flight limit is the server's refusal: counted as an error.
        holder = vllm_engine_pb2_grpc.VllmEngineStub(served.channel).Generate(
            request(max_tokens=500, ignore_eos=True, stream=True), metadata=bearer(KEY)
        )
        await holder.read()
        busy = await raw_call(served.address, GENERATE, message, bearer(KEY))
        assert busy.status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        holder.cancel()
        await asyncio.sleep(0.3)  # the slot freed, the cached report stale
        assert _report(await raw_call(served.address, GENERATE, message, bearer(KEY))).eps > 0
        # Reflection tells a client (grpcurl) the service is there.
        reflection = reflection_pb2_grpc.ServerReflectionStub(served.channel)
        replies = reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        listed = [s.name async for r in replies for s in r.list_services_response.service]
        assert ORCA_SERVICE in listed


async def test_switched_off_nothing_is_reported(engine: Any) -> None:
    async with serving(engine, load_reports=False) as served:
        reply = await raw_call(served.address, GENERATE, request(max_tokens=2).SerializeToString())
        assert reply.status == 0 and TRAILER_KEY not in reply.trailers
        call = orca_pb2_grpc.OpenRcaServiceStub(served.channel).StreamCoreMetrics(
            orca_pb2.OrcaLoadReportRequest()
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call.read()
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


# ----- the Envoy example -------------------------------------------------------------

ENVOY_EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "envoy" / "envoy.yaml"
CSWRR = "envoy.load_balancing_policies.client_side_weighted_round_robin"
# The policy's fields, from its proto (client_side_weighted_round_robin/v3).
CSWRR_FIELDS = {
    "@type",
    "enable_oob_load_report",
    "oob_reporting_period",
    "blackout_period",
    "weight_expiration_period",
    "weight_update_period",
    "error_utilization_penalty",
    "metric_names_for_computing_utilization",
}


def test_the_envoy_example_balances_two_replicas_by_their_reports() -> None:
    """Its shape only: no Envoy is installable where the tests run (docs/scale-out.md)."""
    config = yaml.safe_load(ENVOY_EXAMPLE.read_text())
    resources = config["static_resources"]
    (listener,) = resources["listeners"]
    assert listener["address"]["socket_address"]["address"] == "127.0.0.1"
    (manager,) = listener["filter_chains"][0]["filters"]
    typed = manager["typed_config"]
    assert typed["@type"].endswith("http_connection_manager.v3.HttpConnectionManager")
    assert typed["http_filters"][-1]["name"] == "envoy.filters.http.router"
    (route,) = typed["route_config"]["virtual_hosts"][0]["routes"]
    assert route["route"]["timeout"] == "0s"  # streams run as long as generation does
    (cluster,) = resources["clusters"]
    assert route["route"]["cluster"] == cluster["name"]
    # gRPC upstream: HTTP/2 to each replica, health by grpc.health.v1 (no key needed).
    protocol = cluster["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]
    assert "http2_protocol_options" in protocol["explicit_http_config"]
    assert "grpc_health_check" in cluster["health_checks"][0]
    (policy,) = cluster["load_balancing_policy"]["policies"]
    extension = policy["typed_extension_config"]
    assert extension["name"] == CSWRR
    settings = extension["typed_config"]
    assert settings["@type"] == (
        "type.googleapis.com/envoy.extensions.load_balancing_policies."
        "client_side_weighted_round_robin.v3.ClientSideWeightedRoundRobin"
    )
    assert set(settings) <= CSWRR_FIELDS, set(settings) - CSWRR_FIELDS
    for name in ("blackout_period", "weight_update_period", "weight_expiration_period"):
        assert re.fullmatch(r"\d+(\.\d+)?s", settings[name]), name
    endpoints = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    ports = {e["endpoint"]["address"]["socket_address"]["port_value"] for e in endpoints}
    assert len(ports) == 2
