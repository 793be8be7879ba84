"""How the frontend processes on one engine reach each other: an abort for a
request another process runs.

vLLM's `AsyncLLM.abort` drops ids its own process did not start, so an Abort
that arrives at one process for a request another runs is handed over: each
process answers its peers on a Unix socket in the group's private directory,
on a gRPC server of its own with no interceptors. The process the Abort
arrived at has already authenticated the caller and kept only the ids it may
abort (`RunningRequests.abort`); its peer aborts them. Never on a public port.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import grpc

from ..frontends import FrontendGroup

logger = logging.getLogger("vllm_servicer.serve")

_SERVICE = "vllm_servicer.Peers"
_ABORT = f"/{_SERVICE}/Abort"
_TIMEOUT = 5.0  # seconds: a peer that does not answer is stopping or gone


async def start_peers(group: FrontendGroup, engine: Any) -> grpc.aio.Server:
    """Answer this process's peers, and set `group.abort_elsewhere` to reach them."""

    async def abort(request: bytes, context: Any) -> bytes:
        await engine.abort(json.loads(request))
        return b""

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                _SERVICE, {"Abort": grpc.unary_unary_rpc_method_handler(abort)}
            ),
        )
    )
    server.add_insecure_port(group.peer_address(group.index))
    await server.start()
    channels: dict[int, grpc.aio.Channel] = {}

    async def abort_elsewhere(index: int, request_ids: list[str]) -> None:
        channel = channels.get(index)
        if channel is None:
            channel = channels[index] = grpc.aio.insecure_channel(group.peer_address(index))
        try:
            send: Any = channel.unary_unary(_ABORT)  # bytes both ways: no serializers
            await send(json.dumps(request_ids).encode(), timeout=_TIMEOUT)
        except grpc.RpcError as failed:
            # Abort is idempotent: a peer that is gone has no request left to stop.
            logger.warning("frontend %d did not take an abort: %s", index, failed)

    group.abort_elsewhere = abort_elsewhere
    return server
