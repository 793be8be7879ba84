"""The keyed calls' slots by weight and role, on a server of their own (no engine).

`CallSlotsInterceptor` holds each tenant to its weighted fair share of the
slots while others want them, and administrators to the total only; a call
that never sends its message gives its slot back at the read deadline. The
launcher's own stack is tested on the wire in `test_tenant_call_slots.py`;
here identities of any weight and role come from a verifier of the test's.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
from support import settle
from support.h2_grpc import HalfOpen

from vllm_servicer._registration import register
from vllm_servicer.context import ADMIN_ROLE, Identity
from vllm_servicer.interceptors._pipeline import wrapped_handler
from vllm_servicer.interceptors.auth import AuthInterceptor, CallableVerifier
from vllm_servicer.interceptors.call_slots import CallSlotsInterceptor

SERVICE = "test.Keyed"
METHOD = f"/{SERVICE}/Echo"
MAX_CALLS = 6
READ_TIMEOUT = 4.0
IDENTITIES = {
    "heavy": Identity("heavy", weight=2.0),
    "light": Identity("light"),
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
    async with serving(None) as (address, slots), half_open(address, "light", 1):
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
            # An administrator is held to the total only: one slot is left.
            async with half_open(address, "admin", 2) as admin:
                assert await settle(lambda: len(admin.ended) == 1), admin.ended
                [refused] = admin.ended.values()
                assert refused.status == RESOURCE_EXHAUSTED
                assert "the limit (--max-concurrent-rpcs) is 6" in refused.details


async def test_a_call_without_its_message_gives_its_slot_back() -> None:
    # The read deadline is long enough for the refused call below to reach a busy
    # server while the half-open calls still hold every slot.
    async with (
        serving(READ_TIMEOUT) as (address, slots),
        half_open(address, "light", MAX_CALLS) as held,
    ):
        assert await settle(lambda: slots.held("light") == MAX_CALLS)
        assert (await echo(address, "heavy")).startswith("RESOURCE_EXHAUSTED")
        assert await settle(lambda: not held.open_ids(), timeout=30), held.open_ids()
        for reply in held.ended.values():
            assert reply.status == DEADLINE_EXCEEDED
            assert reply.details == (
                "request message not received in time: the limit (--request-read-timeout) "
                f"is {READ_TIMEOUT:g} s from the call's start; send the message with the call"
            )
        assert await echo(address, "heavy") == "OK"
