"""How the frontend processes on one engine reach each other: an abort for a
request another process runs, and each one's GetLoads figures.

vLLM's `AsyncLLM.abort` drops ids its own process did not start, so an Abort
that arrives at one process for a request another runs is handed over: each
process answers its peers on a Unix socket in the group's private directory,
on a gRPC server of its own with no interceptors. The process the Abort
arrived at has already authenticated the caller and kept only the ids it may
abort (`RunningRequests.abort`); its peer aborts them. GetLoads merges every
process's figures (`loads.SchedulerStatsTap.window`), pickled: the peers are
this launcher's own processes, behind the directory's permissions. Never on a
public port.
"""

from __future__ import annotations

import asyncio
import json
import logging
import pickle
from typing import Any

import grpc

from ..frontends import FrontendGroup
from ..servicer import loads

logger = logging.getLogger("vllm_servicer.serve")

_SERVICE = "vllm_servicer.Peers"
_ABORT = f"/{_SERVICE}/Abort"
_LOADS = f"/{_SERVICE}/Loads"
_TIMEOUT = 5.0  # seconds: a peer that does not answer is stopping or gone


async def start_peers(group: FrontendGroup, engine: Any) -> grpc.aio.Server:
    """Answer this process's peers, and set `group.abort_elsewhere` to reach them."""

    tap = loads.attach(engine)

    async def abort(request: bytes, context: Any) -> bytes:
        await engine.abort(json.loads(request))
        return b""

    async def windows(request: bytes, context: Any) -> bytes:
        return pickle.dumps(tap.window() if tap is not None else {})

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                _SERVICE,
                {
                    "Abort": grpc.unary_unary_rpc_method_handler(abort),
                    "Loads": grpc.unary_unary_rpc_method_handler(windows),
                },
            ),
        )
    )
    server.add_insecure_port(group.peer_address(group.index))
    await server.start()
    channels: dict[int, grpc.aio.Channel] = {}

    def channel_to(index: int) -> grpc.aio.Channel:
        channel = channels.get(index)
        if channel is None:
            channel = channels[index] = grpc.aio.insecure_channel(group.peer_address(index))
        return channel

    async def abort_elsewhere(index: int, request_ids: list[str]) -> None:
        channel = channel_to(index)
        try:
            send: Any = channel.unary_unary(_ABORT)  # bytes both ways: no serializers
            await send(json.dumps(request_ids).encode(), timeout=_TIMEOUT)
        except grpc.RpcError as failed:
            # Abort is idempotent: a peer that is gone has no request left to stop.
            logger.warning("frontend %d did not take an abort: %s", index, failed)

    async def loads_elsewhere() -> list[Any]:
        others = [i for i in range(group.count) if i != group.index]
        calls: list[Any] = [channel_to(i).unary_unary(_LOADS) for i in others]
        replies: list[Any] = await asyncio.gather(
            *(call(b"", timeout=_TIMEOUT) for call in calls), return_exceptions=True
        )
        # A peer that does not answer is stopping: its figures are left out.
        return [pickle.loads(r) for r in replies if isinstance(r, bytes)]  # noqa: S301 - our own processes

    group.abort_elsewhere = abort_elsewhere
    group.loads_elsewhere = loads_elsewhere
    return server
