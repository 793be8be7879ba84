"""Graceful shutdown for a server that mounted vllm-servicer.

The order matters to load balancers and clients:

1. health turns NOT_SERVING at once, so probes and balancers stop sending;
2. the server keeps answering for `grace_period` seconds while they notice;
3. new RPCs are refused (UNAVAILABLE) and in-flight calls run on, for up to
   `timeout` seconds;
4. calls still running then are aborted in the engine, so their streams end
   with finish_reason "abort" and status OK instead of being cut;
5. the server stops; the caller then shuts the engine down.

A second `request_stop()` (a second signal) skips the waiting in 2 and 3.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from .mount import MountedServices

logger = logging.getLogger("vllm_servicer.drain")

# After aborting the stragglers in the engine: time for their final messages.
_ABORT_FLUSH_SECONDS = 5.0


class GracefulShutdown:
    """Drives the shutdown sequence of one server.

    Args:
        server: the grpc.aio server.
        mounted: what `mount()` returned for it.
        grace_period: seconds the server keeps answering after health turned
            NOT_SERVING.
        timeout: seconds in-flight calls get to finish once new calls are refused.
        on_drain: callables run when draining starts (e.g. a metrics
            interceptor's `mark_shutdown`).
    """

    def __init__(
        self,
        server: Any,
        mounted: MountedServices,
        *,
        grace_period: float = 2.0,
        timeout: float = 30.0,
        on_drain: Iterable[Callable[[], object]] = (),
    ) -> None:
        self._server = server
        self._mounted = mounted
        self._grace_period = grace_period
        self._timeout = timeout
        self._on_drain = tuple(on_drain)
        self._stop_requested = asyncio.Event()
        self._hurry = asyncio.Event()

    def request_stop(self) -> None:
        """Start draining; a second call skips the remaining waits."""
        if self._stop_requested.is_set():
            logger.warning("second stop request: skipping the wait for in-flight calls")
            self._hurry.set()
        self._stop_requested.set()

    async def wait_for_stop_request(self) -> None:
        """Return once `request_stop()` was called."""
        await self._stop_requested.wait()

    async def _wait(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._hurry.wait(), seconds)

    async def _wait_idle(self, seconds: float, *, interruptible: bool = True) -> bool:
        servicer = self._mounted.servicer
        deadline = time.monotonic() + seconds
        while servicer.active_requests and not (interruptible and self._hurry.is_set()):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return servicer.active_requests == 0

    async def run(self) -> None:
        """Drain and stop the server (the engine is left to the caller)."""
        servicer = self._mounted.servicer
        health = self._mounted.health
        logger.info(
            "draining: health now NOT_SERVING, %d calls in flight", servicer.active_requests
        )
        if health is not None:
            await health.start_draining()
        for callback in self._on_drain:
            callback()
        if self._grace_period > 0:
            await self._wait(self._grace_period)

        logger.info(
            "refusing new calls; waiting up to %.1f s for %d in flight",
            self._timeout,
            servicer.active_requests,
        )
        stopped = asyncio.ensure_future(self._server.stop(self._timeout + _ABORT_FLUSH_SECONDS))
        if not await self._wait_idle(self._timeout):
            running = servicer.running_request_ids
            logger.warning(
                "aborting %d calls still running (%s)",
                len(running),
                "second stop request" if self._hurry.is_set() else "drain timeout",
            )
            await servicer.abort_running()
            # The aborted streams still send their final "abort" message.
            await self._wait_idle(_ABORT_FLUSH_SECONDS, interruptible=False)
        if self._hurry.is_set() and not stopped.done():
            await self._server.stop(0)
        await stopped
        if health is not None:
            await health.close()
        logger.info("server stopped; %d calls left", servicer.active_requests)
