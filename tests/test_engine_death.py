"""An engine that dies mid-stream: every client learns it at once, and nothing hangs.

The death is injected with `FaultEngine` (vllm_servicer.testing.stand_in), a stand-in
shaped like `AsyncLLM`: a real engine cannot be made to die at a chosen moment
mid-stream. Each test gets a fresh stand-in and server, because death is final.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import collect, request, serving, settle

from vllm_servicer import SERVICE_NAME, MountedServices
from vllm_servicer.proto import vllm_engine_pb2 as pb
from vllm_servicer.proto import vllm_engine_pb2_grpc
from vllm_servicer.testing.stand_in import FaultEngine

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# A dead engine must be reported well within this; the health poller runs every
# 0.5 s. Twenty polls: room for a busy machine, yet a death left unreported
# would hold the calls to their 60 s deadline and the watches for ever.
PROMPT_S = 10.0


class Rig:
    def __init__(self, fault: FaultEngine, mounted: MountedServices, channel: grpc.aio.Channel):
        self.fault = fault
        self.mounted = mounted
        self.channel = channel
        self.stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    fault = FaultEngine(step_interval=0.02)
    async with serving(fault, reflection_service=False) as served:
        yield Rig(fault, served.mounted, served.channel)


async def _wait_running(fault: FaultEngine, n: int) -> None:
    assert await settle(lambda: len(fault.running) >= n)


async def _read_until_error(call: Any, chunks: list[int]) -> grpc.StatusCode:
    try:
        async for message in call:
            chunks.append(1 if message.HasField("chunk") else 0)
    except grpc.aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


async def test_streams_in_flight_end_with_unavailable(rig: Rig) -> None:
    chunks: list[list[int]] = [[] for _ in range(6)]
    calls = [
        rig.stub.Generate(request(max_tokens=10_000, stream=i % 2 == 0), timeout=60)
        for i in range(6)
    ]
    readers = [asyncio.create_task(_read_until_error(c, chunks[i])) for i, c in enumerate(calls)]
    await _wait_running(rig.fault, 6)
    await asyncio.sleep(0.2)  # the streaming calls are mid-stream now
    rig.fault.die()
    started = time.monotonic()
    codes = await asyncio.wait_for(asyncio.gather(*readers), PROMPT_S)
    assert codes == [grpc.StatusCode.UNAVAILABLE] * 6
    assert time.monotonic() - started < PROMPT_S
    assert all(sum(chunks[i]) > 0 for i in (0, 2, 4)), "streams were not mid-stream"
    for call in calls:
        assert "engine" in (await call.details()).lower()
    assert rig.mounted.servicer.active_requests == 0
    assert not rig.fault.running


async def test_health_goes_not_serving_and_watch_sees_it(rig: Rig) -> None:
    watches = {
        name: rig.health.Watch(health_pb2.HealthCheckRequest(service=name), timeout=30)
        for name in ("", SERVICE_NAME)
    }
    for watch in watches.values():
        assert (await watch.read()).status == SERVING
    reply = await rig.stub.HealthCheck(pb.HealthCheckRequest(), timeout=5)
    assert reply.healthy

    rig.fault.die()
    for watch in watches.values():
        update = await asyncio.wait_for(watch.read(), PROMPT_S)
        assert update.status == NOT_SERVING
        watch.cancel()
    for name in watches:
        check = await rig.health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
        assert check.status == NOT_SERVING
    reply = await rig.stub.HealthCheck(pb.HealthCheckRequest(), timeout=5)
    assert not reply.healthy and reply.message == "Engine is not alive"


@pytest.mark.parametrize("stream", [True, False])
async def test_new_calls_fail_fast_with_unavailable(rig: Rig, stream: bool) -> None:
    rig.fault.die()
    for _ in range(20):
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(rig.stub.Generate(request(max_tokens=50, stream=stream), timeout=5))
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        # At once, not after waiting on the dead engine (the call's 5 s deadline
        # would end that); an in-process call takes milliseconds, even on a busy machine.
        assert time.monotonic() - started < 2.5
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await rig.stub.Embed(pb.EmbedRequest(tokenized=pb.TokenizedInput(input_ids=[1])), timeout=5)
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    # Abort on a dead engine: told plainly, never INTERNAL, never a hang.
    try:
        await rig.stub.Abort(pb.AbortRequest(request_ids=["x"]), timeout=5)
    except grpc.aio.AioRpcError as abort_err:
        assert abort_err.code() is grpc.StatusCode.UNAVAILABLE
    info = await rig.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
    assert info.active_requests == 0
