"""vLLM's internal data-parallel layout: one launcher, two ranks, both its own engines.

`--data-parallel-size 2`: the launcher starts both engine cores and vLLM
balances unpinned calls between them. A call pinned to a rank runs there, on
both protocols (GetLoads shows it); Abort ends a pinned stream; a rank past
the engine's is refused naming those served; each rank has its readiness.
Each rank publishes its KV events where GetKvEventSources names it (one
source per rank, numbered by its global rank), and SubscribeKvEvents relays
both ranks' batches, each with its rank.
When one rank's engine dies, the launcher ends the call on it UNAVAILABLE and
exits 1 within seconds, as with one engine. The layout is started once for
the module, and once more for the engine's death.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import msgspec
import pytest
import zmq
import zmq.asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc  # type: ignore[import-untyped]
from support import KV_TOPIC, collect, free_port, loopback_kv_events
from support.launcher import (
    START_TIMEOUT,
    Launched,
    children,
    exit_code,
    launch,
    launcher_env,
    named,
    stop_launched,
)
from support.ranks import pinned, relayed_events, running, stored_on, until_running

from vllm_servicer.proto import (
    control_pb2,
    control_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    vllm_engine_pb2_grpc,
)
from vllm_servicer.proto import vllm_engine_pb2 as pb

# Several engine cores: run apart from the suite's other worker (make test-dp).
pytestmark = [
    pytest.mark.engine,
    pytest.mark.data_parallel,
    pytest.mark.timeout(START_TIMEOUT + 300),
]


@pytest.fixture(scope="module")
def events_port() -> int:
    """Rank 0's publisher port; vLLM gives rank N the port N above it."""
    return free_port()


@contextlib.asynccontextmanager
async def _two_ranks(cache: Path, events_port: int) -> AsyncIterator[Launched]:
    env = launcher_env(cache, VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_CPU_KVCACHE_SPACE="1")
    served = await launch(
        "--data-parallel-size", "2",
        "--services", "vllm-engine", "inference", "control",
        "--kv-events-config", loopback_kv_events(events_port),
        env=env,
    )  # fmt: skip
    try:
        yield served
    finally:
        # Also after an engine's death ended it: its output read to the end.
        with contextlib.suppress(TimeoutError):
            await stop_launched(served, expect=None)


@pytest.fixture(scope="module")
async def launched(
    tmp_path_factory: pytest.TempPathFactory, events_port: int
) -> AsyncIterator[Launched]:
    async with _two_ranks(tmp_path_factory.mktemp("cache"), events_port) as served:
        yield served


@pytest.fixture
async def dying(tmp_path: Path) -> AsyncIterator[Launched]:
    """A layout of its own for the test that kills a rank: the others' stays up."""
    async with _two_ranks(tmp_path / "cache", free_port()) as served:
        yield served


@pytest.mark.parametrize("rank", [0, 1])
async def test_a_call_pinned_to_a_rank_runs_there_on_both_protocols(
    launched: Launched, rank: int
) -> None:
    async with grpc.aio.insecure_channel(launched.address) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        other = 1 - rank
        stream = stub.Generate(
            pinned(rank, max_tokens=400, ignore_eos=True, stream=True), timeout=120
        )
        try:
            assert (await stream.read()).WhichOneof("response") == "chunk"
            assert await until_running(stub, rank, 1) == 1
            assert await running(stub, other) in (-1, 0)
        finally:
            stream.cancel()
        assert await until_running(stub, rank, 0) == 0
        call = inference_pb2_grpc.InferenceStub(channel).GenerateStream(
            inference_pb2.GenerateRequest(
                token_ids=inference_pb2.TokenIds(ids=[5, 17, 42, 99]),
                stopping=inference_pb2.StoppingCriteria(max_new_tokens=400, ignore_eos=True),
            ),
            metadata=(("x-data-parallel-rank", str(rank)),),
            timeout=120,
        )
        try:
            await call.read()
            assert await until_running(stub, rank, 1) == 1
            assert await running(stub, other) in (-1, 0)
        finally:
            call.cancel()
        assert await until_running(stub, rank, 0) == 0


async def test_abort_ends_a_pinned_stream_and_a_rank_not_served_is_refused(
    launched: Launched,
) -> None:
    async with grpc.aio.insecure_channel(launched.address) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        message = pinned(1, max_tokens=400, ignore_eos=True, stream=True, request_id="pinned")
        stream = stub.Generate(message, timeout=120)
        assert (await stream.read()).WhichOneof("response") == "chunk"
        await stub.Abort(pb.AbortRequest(request_ids=["pinned"]), timeout=30)
        rest = []
        while (reply := await stream.read()) is not grpc.aio.EOF:
            rest.append(reply)
        assert rest[-1].complete.finish_reason == "abort"
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await collect(stub.Generate(pinned(2), timeout=60))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details() == (
            "data_parallel_rank: rank 2 is not served here: this server serves ranks 0-1"
        )
        health = health_pb2_grpc.HealthStub(channel)
        for rank in (0, 1):
            reply = await health.Check(
                health_pb2.HealthCheckRequest(service=f"data_parallel_rank/{rank}")
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_each_rank_publishes_where_its_source_says_and_the_relay_names_the_rank(
    launched: Launched, events_port: int
) -> None:
    async with grpc.aio.insecure_channel(launched.address) as channel:
        control = control_pb2_grpc.ControlStub(channel)
        reply = await control.GetKvEventSources(control_pb2.GetKvEventSourcesRequest())
        sources = {s.data_parallel_rank: s.endpoint for s in reply.sources}
        assert sources == {rank: f"tcp://127.0.0.1:{events_port + rank}" for rank in (0, 1)}, reply

        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        context = zmq.asyncio.Context()
        subscriber = context.socket(zmq.SUB)  # a router's own, at rank 1's source
        subscriber.setsockopt(zmq.LINGER, 0)
        subscriber.setsockopt(zmq.SUBSCRIBE, KV_TOPIC.encode())
        subscriber.connect(sources[1])
        try:
            async with relayed_events(stub) as relayed:
                await stored_on(stub, relayed, 1)
                frames = await asyncio.wait_for(subscriber.recv_multipart(), 30)
                _, _, published_rank = msgspec.msgpack.decode(frames[2])
                assert published_rank == 1
                await stored_on(stub, relayed, 0)
            # Rank 1's publisher carries rank 1's events only.
            assert not await subscriber.poll(timeout=1000)
        finally:
            subscriber.close(linger=0)
            context.term()


async def test_a_dead_rank_ends_its_calls_and_the_launcher(dying: Launched) -> None:
    engines = {
        pid: line for pid, line in named(children(dying.proc.pid)).items() if "EngineCore" in line
    }
    # vLLM names each engine core's process by its rank (EngineCore_DP1).
    rank_1 = [pid for pid, line in engines.items() if "DP1" in line] or list(engines)[-1:]
    assert rank_1, f"no engine process under the launcher: {engines}"
    async with grpc.aio.insecure_channel(dying.address) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        stream = stub.Generate(pinned(1, max_tokens=400, ignore_eos=True, stream=True), timeout=120)
        assert (await stream.read()).WhichOneof("response") == "chunk"
        killed = asyncio.get_running_loop().time()
        for pid in rank_1:
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            while await stream.read() is not grpc.aio.EOF:
                pass
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
        assert asyncio.get_running_loop().time() - killed < 30
    assert await asyncio.wait_for(exit_code(dying.proc), 90) == 1
