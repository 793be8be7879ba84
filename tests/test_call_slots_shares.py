"""The keyed calls' slots by weight and role, on a server of their own (no engine).

`CallSlotsInterceptor` holds each tenant to its weighted fair share of the
slots while others want them, and administrators to the total only; a call
holds its slot while it moves: one that never sends its message, a client
stream that stops sending, a streamed answer its client does not take gives
its slot back at its deadline, and before that to a caller that wants a full
pool when its tenant is over its share. The
launcher's own stack is tested on the wire in `test_tenant_call_slots.py`;
here identities of any weight and role come from a verifier of the test's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from support import settle
from support.h2_grpc import HalfOpen

from vllm_servicer._registration import register
from vllm_servicer.context import ADMIN_ROLE, Identity
from vllm_servicer.interceptors._pipeline import wrapped_handler
from vllm_servicer.interceptors._reclaim import STILL_AFTER_S
from vllm_servicer.interceptors.auth import AuthInterceptor
from vllm_servicer.interceptors.call_slots import CallSlotsInterceptor
from vllm_servicer.interceptors.inflight import InflightInterceptor
from vllm_servicer.interceptors.verifiers import CallableVerifier

SERVICE = "test.Keyed"
METHOD = f"/{SERVICE}/Echo"
MAX_CALLS = 6
READ_TIMEOUT = 4.0
WRITE_TIMEOUT = 3.0
IDENTITIES = {
    "heavy": Identity("heavy", weight=2.0),
    "light": Identity("light"),
    "other": Identity("other"),
    "admin": Identity("admin", roles=frozenset({ADMIN_ROLE})),
}
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
DEADLINE_EXCEEDED = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]


def _identity(metadata: Any, auth_context: Any) -> Identity | None:
    return IDENTITIES.get(dict(metadata).get("x-who", ""))


@contextlib.asynccontextmanager
async def serving(read_timeout: float | None) -> AsyncIterator[tuple[str, CallSlotsInterceptor]]:
    """A server of the test's service behind auth and the call slots: its address, the slots."""

    async def echo(request: bytes, context: Any) -> bytes:
        return request

    slots = CallSlotsInterceptor(MAX_CALLS, read_timeout=read_timeout)
    stack = [AuthInterceptor(CallableVerifier(_identity, reads_auth_context=False)), slots]
    handler = grpc.unary_unary_rpc_method_handler(echo, bytes, bytes)
    server = grpc.aio.server()
    register(server, SERVICE, {"Echo": wrapped_handler(stack, METHOD, handler)})
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", slots
    finally:
        await server.stop(None)


@contextlib.asynccontextmanager
async def half_open(address: str, who: str, count: int) -> AsyncIterator[HalfOpen]:
    async with HalfOpen(address) as conn:
        await conn.start(METHOD, (("x-who", who),), count)
        yield conn


async def echo(address: str, who: str) -> str:
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            await channel.unary_unary(METHOD)(b"x", metadata=(("x-who", who),), timeout=10)
        except grpc.aio.AioRpcError as err:
            return f"{err.code().name}: {err.details()}"
    return "OK"


async def test_a_tenant_is_held_to_its_weighted_share_and_an_admin_to_the_total() -> None:
    async with serving(None) as (address, slots), half_open(address, "light", 1) as light:
        assert await settle(lambda: slots.held("light") == 1)
        async with half_open(address, "heavy", MAX_CALLS) as heavy:
            # Weights 2 and 1 want the pool: heavy's share is ceil(6 * 2 / 3) = 4.
            assert await settle(lambda: len(heavy.ended) == 2), heavy.ended
            assert len(heavy.open_ids()) == 4
            assert {r.status for r in heavy.ended.values()} == {RESOURCE_EXHAUSTED}
            assert {r.details for r in heavy.ended.values()} == {
                f"tenant 'heavy' holds 4 of the call slots (--max-concurrent-rpcs {MAX_CALLS}), "
                "its share while 2 tenants want them is 4; retry later"
            }
            assert await echo(address, "light") == "OK"  # light is under its share (2)
            # An administrator is held to the total only: one slot is left, and
            # its second call takes the slot of the tenant's call that has waited
            # longest on nothing (neither tenant is over its share): light's.
            async with half_open(address, "admin", 1) as admin:
                assert await settle(lambda: slots.total == MAX_CALLS)
                await asyncio.sleep(STILL_AFTER_S)
                assert await echo(address, "admin") == "OK"
                assert await settle(lambda: len(light.ended) == 1), light.ended
                [reply] = light.ended.values()
                assert reply.status == DEADLINE_EXCEEDED
                assert "an administrator's call wanted one of the call slots" in reply.details
                assert not admin.ended and len(heavy.ended) == 2


async def test_a_call_without_its_message_gives_its_slot_back() -> None:
    # The read deadline is long enough for the calls below to reach a full
    # server while the half-open calls still hold every slot.
    async with (
        serving(READ_TIMEOUT) as (address, slots),
        half_open(address, "light", MAX_CALLS) as held,
    ):
        assert await settle(lambda: slots.held("light") == MAX_CALLS)
        # Light itself gets no more: its own idle calls are not taken from for it.
        assert (await echo(address, "light")).startswith("RESOURCE_EXHAUSTED")
        assert await settle(lambda: not held.open_ids(), timeout=30), held.open_ids()
        for reply in held.ended.values():
            assert reply.status == DEADLINE_EXCEEDED
            assert reply.details == (
                "request message not received in time: the limit (--request-read-timeout) "
                f"is {READ_TIMEOUT:g} s for each message; send the message with the call, and "
                "each message of a stream within it"
            )
        assert await echo(address, "heavy") == "OK"


async def test_a_tenant_over_its_share_gives_an_idle_slot_to_another() -> None:
    # Without a read deadline light's calls would hold every slot for ever.
    async with (
        serving(None) as (address, slots),
        half_open(address, "light", MAX_CALLS) as held,
    ):
        assert await settle(lambda: slots.held("light") == MAX_CALLS)
        # A call that has waited less than STILL_AFTER_S may still be sending.
        assert (await echo(address, "heavy")).startswith("RESOURCE_EXHAUSTED")
        await asyncio.sleep(STILL_AFTER_S)
        assert await echo(address, "heavy") == "OK"
        assert await settle(lambda: len(held.ended) == 1), held.ended
        [reply] = held.ended.values()
        assert reply.status == DEADLINE_EXCEEDED
        assert "on its client: tenant 'light' held more than its share of the call slots" in (
            reply.details
        )
        assert slots.total == MAX_CALLS - 1 and slots.held("light") == MAX_CALLS - 1


async def test_a_tenant_within_its_share_keeps_its_idle_slots() -> None:
    half = MAX_CALLS // 2
    async with (
        serving(None) as (address, slots),
        half_open(address, "light", half) as light,
        half_open(address, "other", half) as other,
    ):
        assert await settle(lambda: slots.total == MAX_CALLS)
        await asyncio.sleep(STILL_AFTER_S)
        # Each holds its share (3 of 6): neither gives way to the other.
        assert (await echo(address, "other")).startswith("RESOURCE_EXHAUSTED")
        assert (await echo(address, "light")).startswith("RESOURCE_EXHAUSTED")
        assert not light.ended and not other.ended


@contextlib.asynccontextmanager
async def serving_streams(
    read_timeout: float | None, write_timeout: float | None
) -> AsyncIterator[tuple[str, CallSlotsInterceptor, list[str]]]:
    """A server of a client stream (Count) and a server stream (Flood) behind
    auth and the call slots: its address, the slots, and what the handlers saw end."""
    ended: list[str] = []

    async def count(requests: AsyncIterator[bytes], context: Any) -> bytes:
        n = 0
        try:
            async for _ in requests:
                n += 1
        finally:
            ended.append(f"count {n}")
        return b"%d" % n

    async def flood(request: bytes, context: Any) -> AsyncIterator[bytes]:
        try:
            for _ in range(100_000):
                yield b"x" * 1024
        finally:
            ended.append("flood")

    slots = CallSlotsInterceptor(MAX_CALLS, read_timeout=read_timeout, write_timeout=write_timeout)
    stack = [AuthInterceptor(CallableVerifier(_identity, reads_auth_context=False)), slots]
    handlers = {
        "Count": grpc.stream_unary_rpc_method_handler(count, bytes, bytes),
        "Flood": grpc.unary_stream_rpc_method_handler(flood, bytes, bytes),
    }
    server = grpc.aio.server()
    register(
        server,
        SERVICE,
        {name: wrapped_handler(stack, f"/{SERVICE}/{name}", h) for name, h in handlers.items()},
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", slots, ended
    finally:
        await server.stop(None)


async def test_a_client_stream_that_stops_sending_gives_its_slot_back() -> None:
    async def one_then_nothing() -> AsyncIterator[bytes]:
        yield b"first"
        await asyncio.Event().wait()  # never sends again, never ends its stream
        yield b"never"  # pragma: no cover

    async with (
        serving_streams(READ_TIMEOUT, None) as (address, slots, ended),
        grpc.aio.insecure_channel(address) as channel,
    ):
        count = channel.stream_unary(f"/{SERVICE}/Count")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await count(one_then_nothing(), metadata=(("x-who", "light"),), timeout=30)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "(--request-read-timeout) is 4 s for each message" in (caught.value.details() or "")
        assert ended == ["count 1"]
        assert slots.total == 0
        # A stream that keeps sending is served whole.
        replies = await count(iter([b"a"] * 5), metadata=(("x-who", "light"),), timeout=30)
        assert replies == b"5"


async def test_a_stream_its_client_does_not_take_gives_its_slot_back() -> None:
    async with (
        serving_streams(None, WRITE_TIMEOUT) as (address, slots, ended),
        HalfOpen(address, window=0) as conn,
    ):
        [stream] = await conn.start(f"/{SERVICE}/Flood", (("x-who", "light"),), 1, message=b"")
        assert await settle(lambda: slots.total == 1)
        # grpc cannot send a byte of the answer: the write waits until its deadline.
        assert await settle(lambda: ended == ["flood"], timeout=WRITE_TIMEOUT + 10), ended
        assert slots.total == 0
        assert stream in conn.open_ids() or conn.ended[stream].status != 0


async def test_a_claimant_at_its_own_share_takes_no_slot_back() -> None:
    # Light alone takes 3, other 2 and heavy 1 (weights 1, 1, 2): with all
    # three wanting, light's share is 2 (it is over), other's 2 (it is at it).
    async with (
        serving(None) as (address, slots),
        half_open(address, "light", 3) as light,
    ):
        assert await settle(lambda: slots.held("light") == 3)
        async with half_open(address, "other", 2) as other, half_open(address, "heavy", 1):
            assert await settle(lambda: slots.total == MAX_CALLS)
            await asyncio.sleep(STILL_AFTER_S)
            # Other is refused by its own share: no slot of light's is cut for nothing.
            refused = await echo(address, "other")
            assert refused.startswith("RESOURCE_EXHAUSTED"), refused
            assert not light.ended and not other.ended
            assert slots.total == MAX_CALLS


async def test_an_engine_slot_asked_outside_a_call_takes_a_still_calls_slot() -> None:
    """The HTTP API asks the in-flight count before it answers (`refusal`): a
    still gRPC call of a tenant over its share gives way there too."""
    inflight = InflightInterceptor(2, limited=lambda method: True)
    stack = [AuthInterceptor(CallableVerifier(_identity, reads_auth_context=False)), inflight]

    async def echo_handler(request: bytes, context: Any) -> bytes:
        return request

    server = grpc.aio.server()
    handler = grpc.unary_unary_rpc_method_handler(echo_handler, bytes, bytes)
    register(server, SERVICE, {"Echo": wrapped_handler(stack, METHOD, handler)})
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with half_open(f"127.0.0.1:{port}", "light", 2) as held:
            assert await settle(lambda: inflight.limited_total == 2)
            await asyncio.sleep(STILL_AFTER_S)
            assert inflight.refusal(IDENTITIES["other"]) is None
            assert inflight.enter(IDENTITIES["other"]) is None
            inflight.leave(IDENTITIES["other"])
            assert await settle(lambda: len(held.ended) == 1), held.ended
    finally:
        await server.stop(None)
