"""vLLM's data-parallel layouts with a launcher per node or rank, on the real engine.

Two launchers as users start them on one machine, sharing vLLM's own
coordination (`--data-parallel-address`, `--data-parallel-rpc-port`):

- hybrid: a launcher per node, four ranks, two each (`--data-parallel-size 4
  --data-parallel-size-local 2 --data-parallel-start-rank 0|2`; any model);
- external: a launcher per rank (`--data-parallel-size 2
  --data-parallel-rank 0|1`); vLLM takes it only for a mixture-of-experts
  model, and the tiny Llama's config here declares experts, which sends it
  down the whole external path.

A router pins a call by the rank GetLoads names (the global one); vLLM's
`AsyncLLM` takes an index among the frontend's own engines, which the
launcher translates (`ranks.py`). Each launcher names one KV-event source per
rank it serves, by the global rank, and relays those ranks' batches so
numbered. Each layout is started once, its launchers
together; the ranks share the two cores (`VLLM_CPU_OMP_THREADS_BIND=nobind`,
a small KV cache each).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc  # type: ignore[import-untyped]
from support import collect, free_port, loopback_kv_events
from support.launcher import START_TIMEOUT, Launched, launch, launcher_env, stop_launched
from support.ranks import kept_running, pinned, relayed_events, running, stored_on, until_running

from vllm_servicer.proto import (
    control_pb2,
    control_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    orca_pb2,
    orca_pb2_grpc,
    vllm_engine_pb2_grpc,
)
from vllm_servicer.proto import vllm_engine_pb2 as pb
from vllm_servicer.testing.tiny_model import tiny_engine_flags, write_tiny_model

# Several engine cores per layout: run apart from the suite's other worker
# (make test-dp), where they have the machine's cores to themselves.
pytestmark = [
    pytest.mark.engine,
    pytest.mark.data_parallel,
    pytest.mark.timeout(2 * START_TIMEOUT + 300),
]

LAYOUTS: dict[str, tuple[range, range]] = {
    # Four ranks, two per launcher (a launcher of one rank would be the external layout).
    "hybrid": (range(0, 2), range(2, 4)),
    "external": (range(0, 1), range(1, 2)),
}
"""Each layout's launchers, by the ranks each serves."""


class Node:
    """A launcher and the ranks it serves."""

    def __init__(self, launched: Launched, ranks: range, events_port: int) -> None:
        self.launched = launched
        self.ranks = ranks
        self.events_port = events_port  # rank 0's publisher port; rank N's is N above


def _experts_model(directory: Path) -> Path:
    """The tiny Llama, its config declaring experts (vLLM then counts it a MoE model)."""
    model = write_tiny_model(directory)
    config_path = model / "config.json"
    config = json.loads(config_path.read_text())
    config.update(num_local_experts=2, num_experts_per_tok=1)
    config_path.write_text(json.dumps(config))
    return model


def _flags(
    layout: str, ranks: range, size: int, rpc_port: int, model: Path | None, events_port: int
) -> list[str]:
    flags = [
        "--data-parallel-size",
        str(size),
        "--data-parallel-address",
        "127.0.0.1",
        "--data-parallel-rpc-port",
        str(rpc_port),
        "--kv-events-config",
        loopback_kv_events(events_port),
        "--services",
        "vllm-engine",
        "inference",
        "control",
    ]
    if layout == "hybrid":
        flags += ["--data-parallel-size-local", str(len(ranks))]
        flags += ["--data-parallel-start-rank", str(ranks.start)]
    else:
        flags += ["--data-parallel-rank", str(ranks.start)]
    if model is not None:
        flags += ["--model", str(model), *tiny_engine_flags()]
    return flags


@pytest.fixture(scope="module", params=list(LAYOUTS))
async def nodes(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[list[Node]]:
    """The layout's launchers, in rank order, started together."""
    layout = request.param
    env = launcher_env(
        tmp_path_factory.mktemp("cache"),
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        VLLM_CPU_KVCACHE_SPACE="1",
    )
    model = None
    if layout == "external":
        model = _experts_model(tmp_path_factory.mktemp("moe") / "model")
    served_ranks = LAYOUTS[layout]
    size = sum(len(r) for r in served_ranks)
    port, events_port = free_port(), free_port()
    started = await asyncio.gather(
        *(
            launch(*_flags(layout, r, size, port, model, events_port), env=env)
            for r in served_ranks
        ),
        return_exceptions=True,
    )
    served = [s for s in started if isinstance(s, Launched)]
    try:
        for failed in started:
            if isinstance(failed, BaseException):
                raise failed
        yield [Node(s, r, events_port) for s, r in zip(served, served_ranks, strict=True)]
    finally:
        # The first launcher's last: it runs the coordinator the others use.
        for launched in reversed(served):
            await stop_launched(launched, expect=None)


@contextlib.asynccontextmanager
async def _channel(launched: Launched) -> AsyncIterator[grpc.aio.Channel]:
    channel = grpc.aio.insecure_channel(launched.address)
    try:
        yield channel
    finally:
        await channel.close()


def _describe(ranks: range) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"


@pytest.mark.parametrize("node", [0, 1])
async def test_a_call_pinned_by_its_global_rank_runs_on_that_rank(
    nodes: list[Node], node: int
) -> None:
    served = nodes[node]
    async with _channel(served.launched) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        # The launcher names its ranks globally, as vLLM's metrics do.
        loads = await stub.GetLoads(pb.GetLoadsRequest())
        assert loads.dp_rank_count == len(served.ranks)
        assert {load.dp_rank for load in loads.loads} <= set(served.ranks)
        for rank in served.ranks:
            done = await collect(stub.Generate(pinned(rank, max_tokens=4), timeout=60))
            assert done[-1].complete.completion_tokens == 4
        # A long stream pinned to a rank is what GetLoads shows running there, and
        # nowhere else.
        for rank in served.ranks:
            stream = stub.Generate(
                pinned(rank, max_tokens=400, ignore_eos=True, stream=True), timeout=120
            )
            try:
                assert (await stream.read()).WhichOneof("response") == "chunk"
                assert await until_running(stub, rank, 1) == 1
                for other in served.ranks:
                    if other != rank:
                        assert await running(stub, other) in (-1, 0)
            finally:
                stream.cancel()
            assert await until_running(stub, rank, 0) == 0


@pytest.mark.parametrize("node", [0, 1])
async def test_kv_event_sources_and_batches_are_named_by_the_global_rank(
    nodes: list[Node], node: int
) -> None:
    served = nodes[node]
    async with _channel(served.launched) as channel:
        control = control_pb2_grpc.ControlStub(channel)
        reply = await control.GetKvEventSources(control_pb2.GetKvEventSourcesRequest())
        assert {s.data_parallel_rank: s.endpoint for s in reply.sources} == {
            rank: f"tcp://127.0.0.1:{served.events_port + rank}" for rank in served.ranks
        }, reply
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        async with relayed_events(stub) as relayed:
            for rank in served.ranks:
                await stored_on(stub, relayed, rank)


@pytest.mark.parametrize("node", [0, 1])
async def test_a_rank_another_launcher_serves_is_refused_naming_this_ones(
    nodes: list[Node], node: int
) -> None:
    served, elsewhere = nodes[node], nodes[1 - node]
    other = elsewhere.ranks[-1]
    expected = f"rank {other} is not served here: this server serves {_describe(served.ranks)}"
    async with _channel(served.launched) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await collect(stub.Generate(pinned(other), timeout=60))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details() == f"data_parallel_rank: {expected}"
        inference = inference_pb2_grpc.InferenceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await inference.Generate(
                _inference_request(), metadata=(("x-data-parallel-rank", str(other)),), timeout=60
            )
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details() == f"x-data-parallel-rank: {expected}"


def _inference_request(max_new_tokens: int = 4, **fields: Any) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(
        token_ids=inference_pb2.TokenIds(ids=[5, 17, 42, 99]),
        temperature=0.0,
        stopping=inference_pb2.StoppingCriteria(max_new_tokens=max_new_tokens, ignore_eos=True),
        **fields,
    )


@pytest.mark.parametrize("node", [0, 1])
async def test_vllm_inference_pins_by_the_global_rank(nodes: list[Node], node: int) -> None:
    served = nodes[node]
    async with _channel(served.launched) as channel:
        inference = inference_pb2_grpc.InferenceStub(channel)
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        rank = served.ranks[-1]
        call = inference.GenerateStream(
            _inference_request(400),
            metadata=(("x-data-parallel-rank", str(rank)),),
            timeout=120,
        )
        try:
            await call.read()
            assert await until_running(stub, rank, 1) == 1
        finally:
            call.cancel()
        assert await until_running(stub, rank, 0) == 0


async def test_abort_ends_a_stream_pinned_to_a_rank_of_the_second_launcher(
    nodes: list[Node],
) -> None:
    served = nodes[1]
    rank = served.ranks[-1]
    async with _channel(served.launched) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        message = pinned(rank, max_tokens=400, ignore_eos=True, stream=True, request_id="pinned")
        stream = stub.Generate(message, timeout=120)
        assert (await stream.read()).WhichOneof("response") == "chunk"
        await stub.Abort(pb.AbortRequest(request_ids=["pinned"]), timeout=30)
        rest = []
        while (message := await stream.read()) is not grpc.aio.EOF:
            rest.append(message)
        assert rest[-1].complete.finish_reason == "abort"
        assert await until_running(stub, rank, 0) == 0


def _rank_figures(report: Any) -> dict[int, dict[str, float]]:
    """An ORCA report's per-rank figures, by rank."""
    ranks: dict[int, dict[str, float]] = {}
    for key, value in report.named_metrics.items():
        if key.startswith("rank."):
            _, rank, name = key.split(".", 2)
            ranks.setdefault(int(rank), {})[name] = value
    return ranks


@pytest.mark.parametrize("node", [0, 1])
async def test_readiness_and_load_reports_name_each_rank_this_launcher_serves(
    nodes: list[Node], node: int
) -> None:
    served, elsewhere = nodes[node], nodes[1 - node]
    busy = served.ranks[-1]
    async with _channel(served.launched) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for rank in served.ranks:
            service = f"data_parallel_rank/{rank}"
            check = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert check.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            other = f"data_parallel_rank/{elsewhere.ranks[0]}"
            await health.Check(health_pb2.HealthCheckRequest(service=other))
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        # A stream running on one rank shows in that rank's figures and no other's.
        # One ends within about a second once the engine is warm, and the reports
        # come a second apart: one is kept running until a report shows it.
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        async with kept_running(stub, busy):
            assert await until_running(stub, busy, 1) == 1
            reports = orca_pb2_grpc.OpenRcaServiceStub(channel).StreamCoreMetrics(
                orca_pb2.OrcaLoadReportRequest(report_interval=datetime.timedelta(seconds=1))
            )
            try:
                for _ in range(30):
                    figures = _rank_figures(await asyncio.wait_for(reports.read(), 10))
                    if figures.get(busy, {}).get("num_requests_running") == 1.0:
                        break
                assert figures[busy]["num_requests_running"] == 1.0, figures
                assert set(figures) <= set(served.ranks)
                for rank in set(figures) - {busy}:
                    assert figures[rank]["num_requests_running"] == 0.0
            finally:
                reports.cancel()
