"""ClaimingEngine: the engine vLLM's pooling handlers are handed, on a stand-in engine.

The stand-in (an engine whose `encode` yields when told) stands for a fault a
real engine does not produce on demand: vLLM's handler failing one text of a
batch while the others still run, its merged iterator left unclosed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from vllm_servicer.errors import RequestIdInUseError
from vllm_servicer.servicer.tenancy import RunningRequests
from vllm_servicer.servicer.tenant_engine import TenantEngine
from vllm_servicer.servicer.vllm_app import ClaimingEngine


class StandInEngine:
    """Yields one output per `encode` once `go` is set; records aborts, and the
    ids `running` counted at each."""

    def __init__(self, running: RunningRequests | None = None) -> None:
        self.go = asyncio.Event()
        self.aborted: list[str] = []
        self.running = running
        self.running_at_abort: list[list[str]] = []
        self.dead = False

    async def encode(self, *, request_id: str, **_: Any) -> AsyncGenerator[str, None]:
        await self.go.wait()
        yield request_id

    async def abort(self, request_ids: list[str]) -> None:
        self.aborted.extend(request_ids)
        if self.running is not None:
            self.running_at_abort.append(self.running.ids)
        if self.dead:
            raise RuntimeError("engine is dead")


async def test_each_encode_is_claimed_while_it_runs_and_released_at_its_end() -> None:
    running = RunningRequests()
    engine = StandInEngine()
    claiming = ClaimingEngine(TenantEngine(engine, running), "pooling")
    engine.go.set()
    async with claiming.claims_of_call():
        outputs = [o async for o in claiming.encode(request_id="score-a-0", prompt="x")]
    assert outputs == ["score-a-0"]
    assert running.ids == [] and engine.aborted == []


async def test_a_call_that_fails_mid_batch_releases_and_aborts_what_still_runs() -> None:
    running = RunningRequests()
    engine = StandInEngine(running)
    claiming = ClaimingEngine(TenantEngine(engine, running), "pooling")
    left_running: list[Any] = []
    with pytest.raises(RuntimeError, match="one text failed"):
        async with claiming.claims_of_call():
            stuck = claiming.encode(request_id="score-b-1", prompt="x")
            task = asyncio.ensure_future(stuck.__anext__())  # as vLLM's merge task reads it
            left_running.append((stuck, task))
            await asyncio.sleep(0)
            assert running.ids == ["score-b-1"]
            raise RuntimeError("one text failed")
    assert running.ids == []
    assert engine.aborted == ["score-b-1"]
    # Aborted while still claimed: no other call could take the id before the engine let it go.
    assert engine.running_at_abort == [["score-b-1"]]
    # Another caller may take the id at once; the orphan, cancelled and closed
    # late (as vLLM's merge does), frees nothing twice and aborts nothing of theirs.
    running.claim("score-b-1", "Score")
    stuck, task = left_running[0]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await stuck.aclose()
    assert running.ids == ["score-b-1"]
    assert engine.aborted == ["score-b-1"]


async def test_an_id_running_for_another_caller_is_refused_before_the_engine_starts() -> None:
    from vllm_servicer.context import Identity, current_identity

    running = RunningRequests()
    engine = StandInEngine()
    claiming = ClaimingEngine(TenantEngine(engine, running), "pooling")
    token = current_identity.set(Identity(name="tenant-a", kind="key"))
    try:
        running.claim("score-c-0", "Rerank")
    finally:
        current_identity.reset(token)
    with pytest.raises(RequestIdInUseError):
        async with claiming.claims_of_call():
            await claiming.encode(request_id="score-c-0", prompt="x").__anext__()
    assert engine.aborted == [] and running.ids == ["score-c-0"]


async def test_a_cancelled_encode_is_aborted_before_its_id_is_free_unless_shared() -> None:
    """vLLM's `encode` aborts nothing when a cancel lands as it hands its request
    to the engine core: the claim aborts it, while the id is still claimed. vLLM
    aborts by id every request under it, so an id the caller also runs in
    another call is left to that call."""
    running = RunningRequests()
    engine = StandInEngine(running)
    claiming = ClaimingEngine(TenantEngine(engine, running), "pooling")

    async def cancelled(request_id: str) -> None:
        read = asyncio.ensure_future(claiming.encode(request_id=request_id).__anext__())
        await asyncio.sleep(0)  # waiting in the engine
        read.cancel()
        with pytest.raises(asyncio.CancelledError):
            await read

    await cancelled("embed-alone")
    assert engine.aborted == ["embed-alone"]
    assert engine.running_at_abort == [["embed-alone"]]
    assert running.ids == []
    running.claim("embed-shared", "Embed")  # the same caller's other call on the id
    await cancelled("embed-shared")
    assert engine.aborted == ["embed-alone"]
    assert running.ids == ["embed-shared"]


async def test_a_cancel_stays_a_cancel_when_the_abort_fails() -> None:
    running = RunningRequests()
    engine = StandInEngine(running)
    engine.dead = True
    claiming = ClaimingEngine(TenantEngine(engine, running), "pooling")
    read = asyncio.ensure_future(claiming.encode(request_id="embed-dead").__anext__())
    await asyncio.sleep(0)
    read.cancel()
    with pytest.raises(asyncio.CancelledError):
        await read
    assert engine.aborted == ["embed-dead"] and running.ids == []
