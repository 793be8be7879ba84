"""A call holds its slots while it moves, at the launcher as shipped.

Two tenants' keys and an admin key, `--max-inflight 4 --max-concurrent-rpcs 8`
and short deadlines. Before, tenant A's calls that stopped moving kept their
slots: four `DerenderCompletionStream`s that sent their `start` and nothing
more held every engine slot (B's Generate RESOURCE_EXHAUSTED, B's HTTP
completion 503, for as long as A liked); eight header-only calls held every
call slot (the admin's GetServerInfo refused too); Generates whose client
grants no HTTP/2 flow-control window never ended. Now a caller refused for a
full pool takes back the slot of such a call from a tenant over its share,
and each wait on the client ends at its deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import pytest
from support import bearer, collect, request, settle
from support.h2_grpc import HalfOpen, RawReply
from support.launcher import START_TIMEOUT, Launched, launched, launcher_env

from vllm_servicer.interceptors._reclaim import STILL_AFTER_S
from vllm_servicer.proto import render_pb2, render_pb2_grpc, vllm_engine_pb2, vllm_engine_pb2_grpc
from vllm_servicer.proto.methods import SERVICE_NAME

pytestmark = pytest.mark.timeout(START_TIMEOUT + 300)

TENANT_A = "still-tenant-a-0123456789abcdefABCDEF"
TENANT_B = "still-tenant-b-0123456789abcdefABCDEF"
ADMIN = "still-admin-0123456789abcdefABCDEFGHIJ"
MAX_INFLIGHT = 4
MAX_CONCURRENT_RPCS = 8
READ_TIMEOUT = 10
WRITE_TIMEOUT = 10
GENERATE = f"/{SERVICE_NAME}/Generate"
MODEL_INFO = f"/{SERVICE_NAME}/GetModelInfo"
DEADLINE_EXCEEDED = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]


@pytest.fixture(scope="module")
async def launcher(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Launched]:
    flags = ["--api-key", TENANT_A, "--api-key", TENANT_B, "--admin-api-key", ADMIN]
    flags += ["--max-inflight", str(MAX_INFLIGHT)]
    flags += ["--max-concurrent-rpcs", str(MAX_CONCURRENT_RPCS)]
    flags += ["--request-read-timeout", str(READ_TIMEOUT)]
    flags += ["--response-write-timeout", str(WRITE_TIMEOUT), "--http-port", "0"]
    async with launched(*flags, env=launcher_env(tmp_path_factory.mktemp("cache"))) as served:
        yield served


@pytest.fixture(scope="module")
async def channel(launcher: Launched) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(launcher.address) as opened:
        yield opened


async def generate(channel: grpc.aio.Channel, key: str) -> str:
    """A Generate: its finish reason, or how it was refused."""
    stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    try:
        replies = await collect(
            stub.Generate(request(max_tokens=2, ignore_eos=True), metadata=bearer(key), timeout=30)
        )
    except grpc.aio.AioRpcError as err:
        return f"{err.code().name}: {err.details()}"
    return str(replies[-1].complete.finish_reason)


async def server_info(channel: grpc.aio.Channel, key: str) -> vllm_engine_pb2.GetServerInfoResponse:
    stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    reply: vllm_engine_pb2.GetServerInfoResponse = await stub.GetServerInfo(
        vllm_engine_pb2.GetServerInfoRequest(), metadata=bearer(key), timeout=10
    )
    return reply


async def idle(channel: grpc.aio.Channel) -> bool:
    """Whether the engine runs none of the test's requests any more."""
    return (await server_info(channel, ADMIN)).active_requests == 0


async def test_derender_streams_that_stop_sending_give_their_engine_slots_to_another_tenant(
    launcher: Launched, channel: grpc.aio.Channel
) -> None:
    stalled = asyncio.Event()

    async def start_then_nothing() -> AsyncIterator[Any]:
        start = render_pb2.DerenderCompletionStart(prompt_token_ids=[1, 5])
        yield render_pb2.DerenderCompletionStreamRequest(start=start)
        await stalled.wait()

    render = render_pb2_grpc.RenderStub(channel)
    streams = [
        render.DerenderCompletionStream(start_then_nothing(), metadata=bearer(TENANT_A))
        for _ in range(MAX_INFLIGHT)
    ]
    try:
        await asyncio.sleep(STILL_AFTER_S + 0.5)  # every engine slot held, none moving
        assert all(not s.done() for s in streams)
        # B's Generate takes the slot of A's stream that has waited longest.
        assert await generate(channel, TENANT_B) == "length"
        assert await settle(lambda: sum(s.done() for s in streams) == 1)
        cut = [s for s in streams if s.done()]
        assert await cut[0].code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "slot taken back" in (await cut[0].details() or "")
        # ...and B's HTTP completion the next one's.
        async with httpx.AsyncClient(base_url=launcher.http_url, timeout=60) as http:
            models = await http.get("/v1/models", headers=dict(bearer(TENANT_B)))
            body = {"model": models.json()["data"][0]["id"], "prompt": "hi", "max_tokens": 2}
            reply = await http.post("/v1/completions", json=body, headers=dict(bearer(TENANT_B)))
        assert reply.status_code == 200, reply.text
        # The rest end at the read deadline, each message's.
        codes = await asyncio.wait_for(
            asyncio.gather(*(stream.code() for stream in streams)), READ_TIMEOUT + 10
        )
        assert codes == [grpc.StatusCode.DEADLINE_EXCEEDED] * MAX_INFLIGHT
    finally:
        stalled.set()
        for stream in streams:
            stream.cancel()


async def test_header_only_calls_give_their_call_slots_to_the_admin_and_another_tenant(
    launcher: Launched, channel: grpc.aio.Channel
) -> None:
    async with HalfOpen(launcher.address) as held:
        await held.start(MODEL_INFO, bearer(TENANT_A), MAX_CONCURRENT_RPCS)
        await asyncio.sleep(STILL_AFTER_S + 0.5)
        assert not held.ended  # A alone: every call slot its own
        # The admin is answered: it takes a slot A holds for nothing.
        assert (await server_info(channel, ADMIN)).uptime_seconds > 0
        assert await settle(lambda: len(held.ended) == 1), held.ended
        # A, alone again, fills the slot; then B takes one of A's the same way.
        await held.start(MODEL_INFO, bearer(TENANT_A), 1)
        await asyncio.sleep(STILL_AFTER_S + 0.5)
        assert len(held.ended) == 1
        assert (await server_info(channel, TENANT_B)).uptime_seconds > 0
        assert await settle(lambda: len(held.ended) == 2), held.ended
        assert {r.status for r in held.ended.values()} == {DEADLINE_EXCEEDED}
        assert await settle(lambda: not held.open_ids(), timeout=READ_TIMEOUT + 10)


async def test_generates_whose_client_takes_nothing_end_and_give_their_slots_back(
    launcher: Launched, channel: grpc.aio.Channel
) -> None:
    message = request(max_tokens=64, ignore_eos=True, stream=True).SerializeToString()
    async with HalfOpen(launcher.address, window=0) as held:
        await held.start(GENERATE, bearer(TENANT_A), MAX_INFLIGHT, message=message)
        started = time.monotonic()
        await asyncio.sleep(STILL_AFTER_S + 1)
        # The engine ran them; grpc cannot send a byte of their answers. B is
        # served once one of A's writes has waited a second (on a busy machine
        # A's first tokens may come late: B retries, as a client does on its hint).
        assert not any(_answered(r) for r in held.ended.values())
        served = await generate(channel, TENANT_B)
        while served != "length" and time.monotonic() - started < WRITE_TIMEOUT - 2:
            await asyncio.sleep(0.5)
            served = await generate(channel, TENANT_B)
        assert served == "length"
        assert time.monotonic() - started < WRITE_TIMEOUT  # before A's own deadline
        # Each of A's calls ends at the write deadline at the latest, its engine
        # request gone and its slot back.
        for _ in range(int(WRITE_TIMEOUT + 10) * 4):
            if await idle(channel):
                break
            await asyncio.sleep(0.25)
        assert await idle(channel)
        replies = await asyncio.gather(*(generate(channel, TENANT_B) for _ in range(MAX_INFLIGHT)))
        assert replies == ["length"] * MAX_INFLIGHT


def _answered(reply: RawReply) -> bool:
    return bool(reply.messages)
