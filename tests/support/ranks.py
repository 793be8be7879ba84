"""Calls pinned to a data-parallel rank, and what GetLoads reads running there.

For the data-parallel layouts' tests (`test_dp_*.py`). A rank is named by its
global number, as routers pin calls and GetLoads names ranks (`vllm_servicer.ranks`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc

from vllm_servicer.proto import common_pb2
from vllm_servicer.proto import vllm_engine_pb2 as pb

from .calls import collect, next_kv_event, request

LONG_TOKENS = 400
"""A long stream's tokens: most of what the tiny model's 512-token context leaves
after the prompt, yet about a second's work for a warm engine on an idle machine."""


def pinned(rank: int, **sampling: Any) -> pb.GenerateRequest:
    """A GenerateRequest (`request`'s) pinned to `rank`."""
    message = request(**sampling)
    message.data_parallel_rank = rank
    return message


async def running(stub: Any, rank: int) -> int:
    """The running requests GetLoads reports for `rank` (-1: no figures yet)."""
    loads = await stub.GetLoads(pb.GetLoadsRequest(dp_rank=rank))
    return loads.loads[0].num_running_reqs if loads.loads else -1


async def until_running(stub: Any, rank: int, wanted: int, timeout: float = 30) -> int:
    """What GetLoads reads running on `rank` once it is `wanted`, or when `timeout` passes
    (polled: GetLoads has no event to wait on)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while (now := await running(stub, rank)) != wanted and loop.time() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.2)
    return now


@contextlib.asynccontextmanager
async def kept_running(stub: Any, rank: int) -> AsyncIterator[None]:
    """One long stream pinned to `rank` running all along: each started as the last ends.

    Entered once the first stream's first message (a chunk) has come. A stream
    of `LONG_TOKENS` ends within about a second once the engine is warm: a
    figure sampled seconds apart (ORCA's out-of-band reports, one a second at
    most) can fall before one starts and after it ends. One after another, a
    sample finds exactly one running, bar the instant between two. Leaving
    cancels the stream then running (its end is not awaited).
    """

    def start() -> Any:
        message = pinned(rank, max_tokens=LONG_TOKENS, ignore_eos=True, stream=True)
        call = stub.Generate(message, timeout=120)
        current[0] = call
        return call

    current: list[Any] = [None]
    first = start()

    async def keep(call: Any) -> None:
        while True:
            while await call.read() is not grpc.aio.EOF:
                pass
            call = start()

    try:
        assert (await first.read()).WhichOneof("response") == "chunk"
        keeping = asyncio.ensure_future(keep(first))
        try:
            yield
        finally:
            keeping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeping
    finally:
        current[0].cancel()


@contextlib.asynccontextmanager
async def relayed_events(stub: Any) -> AsyncIterator[Any]:
    """A SubscribeKvEvents stream once it reads every rank's publisher; cancelled after."""
    relayed = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())
    try:
        await asyncio.wait_for(relayed.initial_metadata(), 30)
        await asyncio.sleep(0.5)  # ZMQ subscriptions reach the publishers asynchronously
        yield relayed
    finally:
        relayed.cancel()


async def stored_on(stub: Any, relayed: Any, rank: int) -> list[int]:
    """A prompt new to every cache (a little over one 128-token block) run on
    `rank`: the relay's next stored block is that rank's, and is the prompt's.
    Returns the prompt."""
    prompt = [(7 * i + 13 * rank + 3) % 240 + 3 for i in range(133)]
    message = request(prompt, max_tokens=1)
    message.data_parallel_rank = rank
    await collect(stub.Generate(message, timeout=120))
    batch, event = await next_kv_event(relayed, "stored", timeout=60)
    assert batch.dp_rank == rank, batch
    assert list(event.stored.blocks[0].token_ids) == prompt[:128]
    return prompt
