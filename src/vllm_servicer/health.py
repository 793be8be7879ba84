"""`grpc.health.v1` status that follows the engine.

Readiness and liveness differ: the services given (by `mount`, "" and the
VllmEngine name) mean *ready*: the engine alive and accepting requests (not
paused, asleep or half way through a weight update: `vllm_releases.
accepts_new_requests`, what vLLM's own gRPC frontend publishes) and the server
not draining. Routers stop sending to a replica that is not ready. The
`liveness` service means *alive*: NOT_SERVING only once the engine died, so a
liveness probe restarts neither a server that is draining its streams nor a
paused or sleeping engine.

A data-parallel engine has a service per rank this server serves, named by its
global number (`rank_service`: "data_parallel_rank/2"): ready as the server
is, and NOT_SERVING while that rank's engine, on another node, leaves the
head's questions unanswered (`rank_answered`, from the launcher's watch over
remote engines); a router pinning calls to ranks stops sending to that one
before enough misses count the whole engine dead.

Check reads the engine's death on every call (one attribute read) and its
paused or asleep state at most once per `poll_interval`, however many Check
calls arrive (a probe flood costs the engine nothing more); a control call
that changes the state asks for a re-read at once (`engine_state_changed`). A
small background task, started with the first Watch, turns either change into
a Watch update within `poll_interval` seconds.

Unlike grpc's own asyncio HealthServicer, whose Watch holds a lock shared with
every status change while it awaits a write, no status change here ever waits
for a client: a Watch caller that grants no flow-control window stalls its own
stream, not the server's drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc  # type: ignore[import-untyped]

from . import vllm_releases
from .engine import EngineClient
from .ranks import served_ranks

if TYPE_CHECKING:
    import grpc.aio

SERVING: int = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING: int = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN: int = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN

logger = logging.getLogger("vllm_servicer")

LIVENESS_SERVICE = "liveness"
"""The service name for a liveness probe: SERVING until the engine dies, draining too."""

RANK_SERVICE_PREFIX = "data_parallel_rank/"


def rank_service(rank: int) -> str:
    """The health service name of a data-parallel rank (its global number)."""
    return f"{RANK_SERVICE_PREFIX}{rank}"


# grpcio-health-checking ships no type information: its base class is Any to mypy.
class EngineHealthServicer(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    """The standard health service, reporting the engine's state for `services`.

    Args:
        engine: the engine whose liveness decides SERVING / NOT_SERVING.
        services: service names to report readiness for ("" is the whole
            server); `LIVENESS_SERVICE` is reported besides them, and each
            rank served (`rank_service`) when the engine is data-parallel.
        poll_interval: seconds between engine checks while anyone watches.
    """

    def __init__(
        self, engine: EngineClient, services: tuple[str, ...], poll_interval: float = 0.5
    ) -> None:
        self._engine = engine
        self._services = (*services, *_rank_services(engine))
        # Services of ranks whose remote engine left the last question unanswered.
        self._silent: set[str] = set()
        self._poll_interval = poll_interval
        self._draining = False
        # Whether the engine accepts requests (not paused or asleep), as last read.
        self._accepting = True
        self._state_read: asyncio.Task[bool] | None = None
        self._state_read_at = -float("inf")
        self._closed = False
        self._poller: asyncio.Task[None] | None = None
        self._status: dict[str, int] = {}
        # Set, then replaced, on every change: watchers wait on the current one
        # and hold nothing that a status change would need.
        self._changed = asyncio.Event()
        for service in (*self._services, LIVENESS_SERVICE):
            self._status[service] = self._engine_status(service)

    def _engine_status(self, service: str) -> int:
        if self._engine.errored:
            return NOT_SERVING
        if service != LIVENESS_SERVICE and (self._draining or not self._accepting):
            return NOT_SERVING
        return NOT_SERVING if service in self._silent else SERVING

    def rank_answered(self, rank: int, answered: bool) -> None:
        """Whether `rank`'s engine on another node answered the head's last
        question: its service is NOT_SERVING until it answers again."""
        service = rank_service(rank)
        if service not in self._status:
            return
        if answered:
            self._silent.discard(service)
        else:
            self._silent.add(service)
        self._publish(service, self._engine_status(service))

    async def _read_engine_state(self) -> None:
        """Re-read whether the engine accepts requests, at most once per poll interval.

        Concurrent callers share one read. A read that fails or outlasts the
        interval keeps the state last read (a dead engine shows in `errored`).
        """
        if self._draining or self._closed or self._engine.errored:
            return  # NOT_SERVING whatever the engine says: ask it nothing while it stops
        if time.monotonic() - self._state_read_at < self._poll_interval:
            return
        if self._state_read is None or self._state_read.done():
            self._state_read = asyncio.get_running_loop().create_task(
                vllm_releases.accepts_new_requests(self._engine)
            )
        try:
            self._accepting = await asyncio.wait_for(
                asyncio.shield(self._state_read), max(self._poll_interval, 1.0)
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - readiness keeps its last value
            logger.debug("could not read whether the engine accepts requests: %r", exc)
        self._state_read_at = time.monotonic()

    def engine_state_changed(self) -> None:
        """The engine's paused or asleep state may have changed: re-read it at the next refresh."""
        self._state_read_at = -float("inf")

    async def recheck(self) -> None:
        """Re-read the engine's state now and publish it (after a pause, a wake-up...)."""
        self.engine_state_changed()
        await self.refresh()

    def _publish(self, service: str, status: int) -> None:
        if self._status.get(service) != status:
            self._status[service] = status
            self._wake_watchers()

    def _wake_watchers(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def refresh(self) -> None:
        """Publish the engine's current state to Check and Watch callers."""
        await self._read_engine_state()
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


def _rank_services(engine: EngineClient) -> tuple[str, ...]:
    """A service per rank served when the engine has several ranks in all."""
    parallel = getattr(getattr(engine, "vllm_config", None), "parallel_config", None)
    if int(getattr(parallel, "data_parallel_size", 1) or 1) <= 1:
        return ()
    return tuple(rank_service(rank) for rank in served_ranks(engine))
