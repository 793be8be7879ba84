"""`grpc.health.v1` status that follows the engine.

grpc's own asyncio HealthServicer keeps the statuses and streams changes to
Watch callers; this adds the engine as their source. Check re-reads the engine
on every call (one attribute read), and a small background task, started with
the first health call, turns an engine death into a Watch update within
`poll_interval` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health_pb2

from .engine import EngineClient

if TYPE_CHECKING:
    import grpc.aio

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class EngineHealthServicer(health_aio.HealthServicer):
    """The standard health service, reporting the engine's state for `services`.

    Args:
        engine: the engine whose liveness decides SERVING / NOT_SERVING.
        services: service names to report ("" is the whole server).
        poll_interval: seconds between engine checks while anyone watches.
    """

    def __init__(
        self, engine: EngineClient, services: tuple[str, ...], poll_interval: float = 0.5
    ) -> None:
        super().__init__()
        self._engine = engine
        self._services = services
        self._poll_interval = poll_interval
        self._draining = False
        self._poller: asyncio.Task[None] | None = None
        for service in services:
            self._server_status[service] = self._engine_status()

    def _engine_status(self) -> int:
        if self._draining or self._engine.errored:
            return NOT_SERVING
        return SERVING

    @property
    def serving(self) -> bool:
        """Whether the engine can take requests and the server is not draining."""
        return self._engine_status() == SERVING

    async def refresh(self) -> None:
        """Publish the engine's current state to Check and Watch callers."""
        status = self._engine_status()
        for service in self._services:
            if self._server_status.get(service) != status:
                await self._set(service, status)  # type: ignore[arg-type]

    async def start_draining(self) -> None:
        """Report NOT_SERVING from now on (the server is shutting down)."""
        self._draining = True
        await self.refresh()

    def _ensure_poller(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(
                self._poll(), name="vllm-servicer-health"
            )

    async def _poll(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self._poll_interval)

    async def close(self) -> None:
        """Stop the background engine check."""
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> health_pb2.HealthCheckResponse:
        await self.refresh()
        return await super().Check(request, context)  # type: ignore[no-any-return]

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        self._ensure_poller()
        await self.refresh()
        await super().Watch(request, context)
