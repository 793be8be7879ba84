"""One tenant cannot hold the call slots others need, at the launcher as shipped.

Two tenants' keys, `--max-inflight 8 --max-concurrent-rpcs 40`, and calls opened
over raw HTTP/2 that send their headers and never their message (grpc's client
always sends it). Before, such calls held every slot they took for as long as
their client liked: tenant A's eight half-open Generates refused B's Generate
(`--max-inflight`) indefinitely, 168 half-open keyed calls filled grpc's cap and
a health `Check` on the main port failed, and 64 header-only `Check`s from
eight connections refused a probe's.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import bearer, collect, request, settle
from support.h2_grpc import HalfOpen, RawReply
from support.launcher import START_TIMEOUT, Launched, launched, launcher_env

from vllm_servicer.interceptors._reclaim import STILL_AFTER_S
from vllm_servicer.interceptors.keyless import KeylessLimits
from vllm_servicer.proto import vllm_engine_pb2_grpc
from vllm_servicer.proto.methods import SERVICE_NAME

pytestmark = pytest.mark.timeout(START_TIMEOUT + 400)

TENANT_A = "slots-tenant-a-0123456789abcdefABCDEF"
TENANT_B = "slots-tenant-b-0123456789abcdefABCDEF"
MAX_INFLIGHT = 8
MAX_CONCURRENT_RPCS = 40
GRPC_CAP = KeylessLimits().grpc_cap(MAX_CONCURRENT_RPCS)  # 168: what grpc itself admits
GENERATE = f"/{SERVICE_NAME}/Generate"
MODEL_INFO = f"/{SERVICE_NAME}/GetModelInfo"  # keyed, no engine slot
CHECK = "/grpc.health.v1.Health/Check"
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
DEADLINE_EXCEEDED = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
READ_WAIT = 30 + 30  # the default --request-read-timeout, and a wide margin


@pytest.fixture(scope="module")
async def launcher(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Launched]:
    flags = ["--api-key", TENANT_A, "--api-key", TENANT_B]
    flags += ["--max-inflight", str(MAX_INFLIGHT)]
    flags += ["--max-concurrent-rpcs", str(MAX_CONCURRENT_RPCS)]
    async with launched(*flags, env=launcher_env(tmp_path_factory.mktemp("cache"))) as served:
        yield served


@pytest.fixture(scope="module")
async def stub(launcher: Launched) -> AsyncIterator[vllm_engine_pb2_grpc.VllmEngineStub]:
    async with grpc.aio.insecure_channel(launcher.address) as channel:
        yield vllm_engine_pb2_grpc.VllmEngineStub(channel)


@contextlib.asynccontextmanager
async def half_open(
    address: str, path: str, key: str | None, count: int, per_connection: int = 40
) -> AsyncIterator[list[HalfOpen]]:
    """`count` calls of `path` that send headers only, `per_connection` on each
    connection; every connection closed (its calls cancelled) at the end."""
    metadata = bearer(key) if key else ()
    connections: list[HalfOpen] = []
    try:
        while count > 0:
            conn = HalfOpen(address)
            connections.append(await conn.__aenter__())
            await conn.start(path, metadata, min(count, per_connection))
            count -= per_connection
        yield connections
    finally:
        for conn in connections:
            await conn.close()
        await asyncio.sleep(1)  # the server cancels their calls and gives their slots back


def ended(connections: list[HalfOpen]) -> list[RawReply]:
    return [reply for conn in connections for reply in conn.ended.values()]


def still_open(connections: list[HalfOpen]) -> int:
    return sum(len(conn.open_ids()) for conn in connections)


async def generate(stub: vllm_engine_pb2_grpc.VllmEngineStub, key: str) -> str:
    """B's Generate: its finish reason, or how it was refused."""
    try:
        replies = await collect(
            stub.Generate(request(max_tokens=2, ignore_eos=True), metadata=bearer(key), timeout=60)
        )
    except grpc.aio.AioRpcError as err:
        return f"{err.code().name}: {err.details()}"
    return str(replies[-1].complete.finish_reason)


async def check(address: str) -> str:
    """A probe's Check, on a connection of its own as a kubelet's."""
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
        except grpc.aio.AioRpcError as err:
            return f"{err.code().name}: {err.details()}"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def test_header_only_checks_do_not_keep_a_probe_from_its_answer(launcher: Launched) -> None:
    limits = KeylessLimits()
    per = limits.max_keyless_per_connection
    async with half_open(launcher.address, CHECK, None, limits.max_keyless_checks, per) as held:
        assert len(held) == limits.max_keyless_checks // per  # 8 connections x 8
        await asyncio.sleep(0.3)  # started (well within their 2 s read deadline)
        assert not ended(held), [r.details for r in ended(held)]  # every check slot taken
        assert await check(launcher.address) == "SERVING"
        # ...because the oldest check still waiting for its message gave its slot.
        [given] = ended(held)
        assert given.status == DEADLINE_EXCEEDED and "max_keyless_checks" in given.details
        # The rest end at the keyless read deadline.
        assert await settle(lambda: still_open(held) == 0, timeout=30), still_open(held)
        assert {r.status for r in ended(held)} == {DEADLINE_EXCEEDED}


async def test_half_open_keyed_calls_past_the_cap_are_refused_and_a_probe_answered(
    launcher: Launched,
) -> None:
    count = GRPC_CAP + 32
    async with half_open(launcher.address, MODEL_INFO, TENANT_A, count) as held:
        refused = count - MAX_CONCURRENT_RPCS
        assert await settle(lambda: len(ended(held)) >= refused, timeout=30), len(ended(held))
        assert still_open(held) == MAX_CONCURRENT_RPCS
        for reply in ended(held):
            assert reply.status == RESOURCE_EXHAUSTED, reply.details
            assert f"the limit (--max-concurrent-rpcs) is {MAX_CONCURRENT_RPCS}" in reply.details
        # The keyless slots stay keyless: a probe on the main port is answered.
        assert await check(launcher.address) == "SERVING"


async def test_one_tenant_holds_no_more_than_its_share_of_call_slots(
    launcher: Launched, stub: vllm_engine_pb2_grpc.VllmEngineStub
) -> None:
    async with half_open(launcher.address, MODEL_INFO, TENANT_B, 1) as b_waiting:
        # A asks for every slot grpc has: held to its share while B holds one.
        async with half_open(launcher.address, MODEL_INFO, TENANT_A, GRPC_CAP) as a_held:
            share = MAX_CONCURRENT_RPCS // 2
            assert await settle(lambda: still_open(a_held) <= share, timeout=30), still_open(a_held)
            assert still_open(a_held) == share
            details = {reply.details for reply in ended(a_held)}
            assert {reply.status for reply in ended(a_held)} == {RESOURCE_EXHAUSTED}
            assert details == {
                f"tenant {name!r} holds {share} of the call slots (--max-concurrent-rpcs "
                f"{MAX_CONCURRENT_RPCS}), its share while 2 tenants want them is {share}; "
                "retry later"
                for name in _names(details)
            }
            # B is served.
            assert await generate(stub, TENANT_B) == "length"
        assert still_open(b_waiting) == 1


def _names(details: set[str]) -> set[str]:
    """The tenant names the refusals give (a key's label, which the test does not know)."""
    return {d.split("'")[1] for d in details if d.startswith("tenant '")}


async def test_half_open_generates_give_their_slots_back(
    launcher: Launched, stub: vllm_engine_pb2_grpc.VllmEngineStub
) -> None:
    # At the defaults but --max-inflight 8: before, B was refused for the whole
    # 30 s read deadline, and again each time A reopened its calls.
    async with half_open(launcher.address, GENERATE, TENANT_A, MAX_INFLIGHT) as held:
        await asyncio.sleep(STILL_AFTER_S + 0.5)
        assert not ended(held)
        started = time.monotonic()
        assert await generate(stub, TENANT_B) == "length"
        assert time.monotonic() - started < 15
        [given] = ended(held)
        assert given.status == DEADLINE_EXCEEDED
        assert "slot taken back" in given.details and "max_inflight" in given.details
        # The rest end within the read deadline (and a wide margin).
        assert await settle(lambda: still_open(held) == 0, timeout=READ_WAIT), still_open(held)
        for reply in ended(held):
            assert reply.status == DEADLINE_EXCEEDED, reply.details
        assert await generate(stub, TENANT_B) == "length"
