"""`grpc.health.v1` status that follows the engine.

Check re-reads the engine on every call (one attribute read), and a small
background task, started with the first Watch, turns an engine death into a
Watch update within `poll_interval` seconds.

Readiness and liveness differ: the services given (by `mount`, "" and the
VllmEngine name) mean *ready*: engine alive and not draining. The
`liveness` service means *alive*: NOT_SERVING only once the engine died, so a
liveness probe does not restart a server that is draining its streams.

Unlike grpc's own asyncio HealthServicer, whose Watch holds a lock shared with
every status change while it awaits a write, no status change here ever waits
for a client: a Watch caller that grants no flow-control window stalls its own
stream, not the server's drain.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc  # type: ignore[import-untyped]

from .engine import EngineClient

if TYPE_CHECKING:
    import grpc.aio

SERVING: int = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING: int = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN: int = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN

LIVENESS_SERVICE = "liveness"
"""The service name for a liveness probe: SERVING until the engine dies, draining too."""


# grpcio-health-checking ships no type information: its base class is Any to mypy.
class EngineHealthServicer(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    """The standard health service, reporting the engine's state for `services`.

    Args:
        engine: the engine whose liveness decides SERVING / NOT_SERVING.
        services: service names to report readiness for ("" is the whole
            server); `LIVENESS_SERVICE` is reported besides them.
        poll_interval: seconds between engine checks while anyone watches.
    """

    def __init__(
        self, engine: EngineClient, services: tuple[str, ...], poll_interval: float = 0.5
    ) -> None:
        self._engine = engine
        self._services = services
        self._poll_interval = poll_interval
        self._draining = False
        self._closed = False
        self._poller: asyncio.Task[None] | None = None
        self._status: dict[str, int] = {}
        # Set, then replaced, on every change: watchers wait on the current one
        # and hold nothing that a status change would need.
        self._changed = asyncio.Event()
        for service in (*services, LIVENESS_SERVICE):
            self._status[service] = self._engine_status(service)

    def _engine_status(self, service: str) -> int:
        if self._engine.errored or (self._draining and service != LIVENESS_SERVICE):
            return NOT_SERVING
        return SERVING

    def _publish(self, service: str, status: int) -> None:
        if self._status.get(service) != status:
            self._status[service] = status
            self._wake_watchers()

    def _wake_watchers(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def refresh(self) -> None:
        """Publish the engine's current state to Check and Watch callers."""
        for service in (*self._services, LIVENESS_SERVICE):
            self._publish(service, self._engine_status(service))

    async def set(self, service: str, status: int) -> None:
        """Set the status of a service of the host's (grpc_health's API); ignored once draining."""
        if not self._draining:
            self._publish(service, status)

    async def start_draining(self) -> None:
        """Report NOT_SERVING for every service but liveness from now on (shutting down)."""
        self._draining = True
        for service in list(self._status):
            if service != LIVENESS_SERVICE:
                self._publish(service, NOT_SERVING)

    async def enter_graceful_shutdown(self) -> None:
        """The same as `start_draining()`, under grpc_health's name."""
        await self.start_draining()

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
        """Stop the background engine check and end Watch streams after their last status."""
        self._closed = True
        self._wake_watchers()
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> health_pb2.HealthCheckResponse:
        await self.refresh()
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND)
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        if not self._closed:
            self._ensure_poller()
        await self.refresh()
        last = None
        while True:
            changed = self._changed
            status = self._status.get(request.service, SERVICE_UNKNOWN)
            if status != last:
                # A client that grants no flow-control window blocks this write;
                # nothing shared is held while it waits.
                await context.write(health_pb2.HealthCheckResponse(status=status))
                last = status
            if self._closed:
                return
            await changed.wait()
