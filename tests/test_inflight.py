"""InflightInterceptor against the real engine, server-wide and through mount()."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import collect, placed, request, serving, settle, wait_until_idle

from vllm_servicer import SERVICE_NAME
from vllm_servicer.context import ADMIN_ROLE, Identity
from vllm_servicer.interceptors import AuthInterceptor, InflightInterceptor
from vllm_servicer.interceptors.verifiers import CallableVerifier
from vllm_servicer.proto import vllm_engine_pb2 as pb
from vllm_servicer.proto import vllm_engine_pb2_grpc

GENERATE = f"/{SERVICE_NAME}/Generate"
LONG = {"max_tokens": 5000, "ignore_eos": True}


@pytest.fixture(scope="module")
async def served(
    placement: str, engine: Any
) -> AsyncIterator[tuple[vllm_engine_pb2_grpc.VllmEngineStub, InflightInterceptor, Any]]:
    inflight = InflightInterceptor()
    async with serving(engine, **placed(placement, [inflight])) as running:
        channel = running.channel
        yield vllm_engine_pb2_grpc.VllmEngineStub(channel), inflight, channel


@pytest.fixture
def stub(served: Any) -> vllm_engine_pb2_grpc.VllmEngineStub:
    return served[0]


@pytest.fixture
def inflight(served: Any) -> InflightInterceptor:
    served[1].max_inflight = None
    return served[1]


async def _idle(inflight: InflightInterceptor) -> None:
    assert await inflight.wait_idle(10), inflight.counts()
    assert inflight.total == 0 and inflight.count(GENERATE) == 0, inflight.counts()


async def test_counts_a_running_stream_and_releases_on_cancel(
    stub: Any, inflight: InflightInterceptor, engine: Any
) -> None:
    call = stub.Generate(request(stream=True, **LONG))
    await call.read()
    assert inflight.count(GENERATE) == 1
    assert inflight.limited_total == 1 and inflight.total == 1
    assert inflight.counts() == {GENERATE: 1}
    assert not await inflight.wait_idle(0.05)
    call.cancel()
    await _idle(inflight)
    assert await wait_until_idle(engine) == 0


async def test_released_however_the_call_ends(
    stub: Any, inflight: InflightInterceptor, engine: Any
) -> None:
    # Success, streaming and not.
    await collect(stub.Generate(request(max_tokens=3)))
    await collect(stub.Generate(request(stream=True, max_tokens=3)))
    await _idle(inflight)
    # INVALID_ARGUMENT from the engine's validation.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub.Generate(request(top_p=1.5)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    await _idle(inflight)
    # Deadline.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub.Generate(request(stream=True, **LONG), timeout=0.5))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await _idle(inflight)
    # Abort RPC: the stream ends OK with finish_reason "abort".
    call = stub.Generate(request(request_id="inflight-abort", stream=True, **LONG))
    await call.read()
    await stub.Abort(pb.AbortRequest(request_ids=["inflight-abort"]))
    while await call.read() is not grpc.aio.EOF:
        pass
    assert await call.code() == grpc.StatusCode.OK
    await _idle(inflight)
    # Unary methods are counted too, and released.
    await stub.HealthCheck(pb.HealthCheckRequest())
    await _idle(inflight)
    assert await wait_until_idle(engine) == 0


async def test_limit_rejects_at_once_with_a_retry_hint(
    stub: Any, inflight: InflightInterceptor, engine: Any
) -> None:
    inflight.max_inflight = 2
    running = [stub.Generate(request(stream=True, **LONG)) for _ in range(2)]
    for call in running:
        await call.read()
    assert inflight.limited_total == 2
    rejected_before = inflight.rejected
    for attempt in (
        stub.Generate(request(stream=True, max_tokens=3)),
        stub.Generate(request(max_tokens=3)),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(collect(attempt), 5)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_inflight" in err.value.details() and "2" in err.value.details()
        assert dict(err.value.trailing_metadata())["grpc-retry-pushback-ms"] == "1000"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Embed(pb.EmbedRequest(tokenized=pb.TokenizedInput(input_ids=[1, 2])))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert inflight.rejected == rejected_before + 3
    # Calls the limit does not cover still pass, and rejections were never counted.
    assert (await stub.HealthCheck(pb.HealthCheckRequest())).healthy
    assert inflight.limited_total == 2
    for call in running:
        call.cancel()
    await _idle(inflight)
    # Room again.
    inflight.max_inflight = 1
    assert len(await collect(stub.Generate(request(max_tokens=3)))) == 1
    await _idle(inflight)
    assert await wait_until_idle(engine) == 0


async def test_long_lived_watch_does_not_block_draining(
    served: Any, inflight: InflightInterceptor
) -> None:
    health = health_pb2_grpc.HealthStub(served[2])
    watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
    await watch.read()
    assert inflight.count("/grpc.health.v1.Health/Watch") == 1
    assert inflight.total == 1 and inflight.limited_total == 0
    assert await inflight.wait_idle(0.1)
    assert not await inflight.wait_idle(0.1, include_all=True)
    waiter = asyncio.ensure_future(inflight.wait_idle(5, include_all=True))
    await asyncio.sleep(0.05)
    watch.cancel()
    assert await waiter
    assert inflight.total == 0


WEIGHTED = {
    "heavy": Identity("heavy", weight=3.0),
    "light": Identity("light"),
    "operator": Identity("operator", roles=frozenset({ADMIN_ROLE})),
}


def _as(name: str) -> tuple[tuple[str, str], ...]:
    return (("x-tenant", name),)


async def test_weights_divide_the_slots_among_the_tenants_that_want_them(engine: Any) -> None:
    """Identities of weights 3 and 1 share 4 slots 3:1 once the light one was
    refused for want of a free slot; an administrator is held to the total only."""
    verifier = CallableVerifier(
        lambda metadata, _: WEIGHTED.get(dict(metadata).get("x-tenant", "")),
        reads_auth_context=False,
    )
    inflight = InflightInterceptor(4)
    interceptors = [AuthInterceptor(verifier), inflight]
    async with serving(engine, interceptors=interceptors) as running:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(running.channel)

        async def opened(name: str) -> Any:
            call = stub.Generate(request(stream=True, **LONG), metadata=_as(name))
            await call.read()
            return call

        async def refusal(name: str) -> str:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(stub.Generate(request(max_tokens=3), metadata=_as(name)))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert dict(err.value.trailing_metadata())["grpc-retry-pushback-ms"] == "1000"
            return str(err.value.details())

        heavy = [await opened("heavy") for _ in range(4)]  # alone: the whole pool
        assert "server busy" in await refusal("light")  # the pool is full: light wants
        for call in heavy[2:]:
            call.cancel()
        assert await settle(lambda: inflight.limited_total == 2, 30)
        # Weights 3 and 1 want 4 slots: heavy's share is 3 (equal weights: 2).
        heavy[2] = await opened("heavy")
        assert "'heavy' holds 3 of the 4 engine slots (max_inflight), its share while 2 " in (
            message := await refusal("heavy")
        ) and message.endswith("is 3; retry later"), message
        assert len(await collect(stub.Generate(request(max_tokens=3), metadata=_as("light"))))
        # An administrator past what a tenant's share would be (2 of 4 beside
        # light's stream): held to the total only.
        for call in heavy[:3]:
            call.cancel()
        assert await settle(lambda: inflight.limited_total == 0, 30)
        running_calls = [await opened("light")] + [await opened("operator") for _ in range(2)]
        assert len(await collect(stub.Generate(request(max_tokens=3), metadata=_as("operator"))))
        for call in running_calls:
            call.cancel()
        await _idle(inflight)
    assert await wait_until_idle(engine) == 0


def test_max_inflight_must_be_positive() -> None:
    with pytest.raises(ValueError):
        InflightInterceptor(0)
