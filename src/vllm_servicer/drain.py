"""Graceful shutdown for a server that mounted vllm-servicer.

The order matters to load balancers and clients:

1. health turns NOT_SERVING at once, so probes and balancers stop sending;
2. the server keeps answering for `grace_period` seconds while they notice;
3. new RPCs are refused (UNAVAILABLE) and in-flight calls run on, for up to
   `timeout` seconds;
4. calls still running then are aborted in the engine, so their streams end
   with finish_reason "abort" and status OK instead of being cut;
5. the server stops once what the engine calls answered is sent (a few
   seconds at most): what still runs then are long-lived streams (health
   Watch, reflection, KV events) or calls of the host's own services, and
   they are cancelled rather than waited for. The caller then shuts the
   engine down.

Health Watch streams end, after their NOT_SERVING, when step 3 begins. A
second `request_stop()` (a second signal) skips the waiting in 2 and 3.
Companion servers on the same engine (the launcher's HTTP API) drain in step
with it: unhealthy at 1, then from 3 they stop accepting and get the same
`timeout` for their requests in flight. A
`HardStop` given to `GracefulShutdown` is the owner's last resort: it fires if
the whole sequence (engine shutdown included) overruns its ceiling.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .mounting import MountedServices

logger = logging.getLogger("vllm_servicer.drain")

# After aborting the stragglers in the engine: time for their final messages.
_ABORT_FLUSH_SECONDS = 5.0
# Once the last engine call's handler has returned: time for grpc to send what
# it answered. The count drops as the handler ends, while its last messages and
# its status may still wait on the connection (for a client that reads slowly,
# or for the CPU on a busy machine: seconds, not a few loop turns); the server's
# stop then cuts the connection under them, and every such call ends UNAVAILABLE
# ("GOAWAY ... Server shutdown") on the client. A server with nothing else open
# stops by itself as soon as they are sent; only long-lived streams hold it this long.
_STATUS_FLUSH_SECONDS = 5.0
# What a HardStop allows beyond the drain for the owner to shut the engine down.
_ENGINE_SHUTDOWN_SECONDS = 15.0


class HardStop:
    """Calls `on_expiry` once a deadline passes, from a thread of its own.

    A thread keeps the time so that it fires even when the event loop is
    blocked (by a stuck shutdown step, say). `on_expiry` is meant to end the
    process; `arm()` sets the deadline and later calls can only bring it nearer.
    """

    def __init__(self, on_expiry: Callable[[], object]) -> None:
        self._on_expiry = on_expiry
        self._deadline: float | None = None
        self._wakeup = threading.Condition()
        self._thread: threading.Thread | None = None

    def arm(self, seconds: float) -> None:
        """Fire in `seconds` at the latest."""
        with self._wakeup:
            deadline = time.monotonic() + seconds
            if self._deadline is None or deadline < self._deadline:
                self._deadline = deadline
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="vllm-servicer-hard-stop", daemon=True
                )
                self._thread.start()
            self._wakeup.notify()

    def disarm(self) -> None:
        """Do not fire."""
        with self._wakeup:
            self._deadline = None
            self._wakeup.notify()

    def _run(self) -> None:
        with self._wakeup:
            while self._deadline is not None:
                left = self._deadline - time.monotonic()
                if left <= 0:
                    break
                self._wakeup.wait(left)
            else:
                return
        logger.error("shutdown overran its ceiling: stopping now")
        self._on_expiry()


class CompanionServer(Protocol):
    """Another server on the same engine, drained with the gRPC one."""

    def start_draining(self) -> None:
        """Look unhealthy to probes; keep serving."""

    async def stop(self, timeout: float) -> None:
        """Stop accepting; give requests in flight `timeout` seconds, then end them."""

    def hurry(self) -> None:
        """A second stop request: end what still runs now."""


class GracefulShutdown:
    """Drives the shutdown sequence of one server.

    Args:
        server: the grpc.aio server.
        mounted: what `mount()` returned for it: the in-flight count waited
            on, the state whose running requests a timeout aborts, and its
            health service.
        grace_period: seconds the server keeps answering after health turned
            NOT_SERVING.
        timeout: seconds in-flight calls get to finish once new calls are refused.
        on_drain: callables run when draining starts (e.g. a metrics
            interceptor's `mark_shutdown`).
        hard_stop: armed by each stop request with what is left of the
            sequence plus `_ENGINE_SHUTDOWN_SECONDS` (a second request leaves
            only the abort and status flushes): the process owner's ceiling.
        companions: other servers on the engine; `run()` returns once they stopped too.
    """

    def __init__(
        self,
        server: Any,
        mounted: MountedServices,
        *,
        grace_period: float = 2.0,
        timeout: float = 30.0,
        on_drain: Iterable[Callable[[], object]] = (),
        hard_stop: HardStop | None = None,
        companions: Iterable[CompanionServer] = (),
    ) -> None:
        self._server = server
        self._mounted = mounted
        self._grace_period = grace_period
        self._timeout = timeout
        self._on_drain = tuple(on_drain)
        self._hard_stop = hard_stop
        self._companions = tuple(companions)
        self._stop_requested = asyncio.Event()
        self._hurry = asyncio.Event()

    def request_stop(self) -> None:
        """Start draining; a second call skips the remaining waits."""
        if self._stop_requested.is_set():
            logger.warning("second stop request: skipping the wait for in-flight calls")
            self._hurry.set()
            for companion in self._companions:
                companion.hurry()
            ceiling = _ABORT_FLUSH_SECONDS + _STATUS_FLUSH_SECONDS + _ENGINE_SHUTDOWN_SECONDS
        else:
            ceiling = self._grace_period + self._timeout + _ABORT_FLUSH_SECONDS
            ceiling += _STATUS_FLUSH_SECONDS + _ENGINE_SHUTDOWN_SECONDS
        self._stop_requested.set()
        if self._hard_stop is not None:
            self._hard_stop.arm(ceiling)

    async def wait_for_stop_request(self) -> None:
        """Return once `request_stop()` was called."""
        await self._stop_requested.wait()

    async def _wait(self, seconds: float) -> None:
        # asyncio's TimeoutError: not the builtin one before Python 3.11.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._hurry.wait(), seconds)

    async def _wait_idle(self, seconds: float, *, interruptible: bool = True) -> bool:
        """Wait until no engine request runs (woken by the count, not by polling)."""
        # The timeout is asyncio.wait's: it returns at the deadline instead of raising.
        idle = asyncio.ensure_future(self._mounted.inflight.wait_idle())
        waits: set[asyncio.Future[Any]] = {idle}
        if interruptible:
            waits.add(asyncio.ensure_future(self._hurry.wait()))
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        return self._mounted.inflight.limited_total == 0

    async def run(self) -> None:
        """Drain and stop the server (the engine is left to the caller)."""
        state = self._mounted.state
        health = self._mounted.health
        logger.info("draining: health now NOT_SERVING, %d calls in flight", state.active_requests)
        if health is not None:
            # Never waits on a client (a Watch caller can stall only its own stream).
            await health.start_draining()
        for companion in self._companions:
            companion.start_draining()
        for callback in self._on_drain:
            callback()
        if self._grace_period > 0:
            await self._wait(self._grace_period)

        logger.info(
            "refusing new calls; waiting up to %.1f s for %d in flight",
            self._timeout,
            state.active_requests,
        )
        if health is not None:
            await health.close()  # Watch streams end now, after their NOT_SERVING
        stopped = asyncio.ensure_future(self._server.stop(self._timeout + _ABORT_FLUSH_SECONDS))
        others = [asyncio.ensure_future(c.stop(self._timeout)) for c in self._companions]
        if not await self._wait_idle(self._timeout):
            logger.warning(
                "aborting %d calls still running (%s)",
                len(state.running.ids),
                "second stop request" if self._hurry.is_set() else "drain timeout",
            )
            await state.abort_running()
            # The aborted streams still send their final "abort" message.
            await self._wait_idle(_ABORT_FLUSH_SECONDS, interruptible=False)
        if not stopped.done():
            # The calls drained are all the server waits for: what runs on are
            # long-lived streams (reflection, KV events, a Watch stuck on a
            # client that reads nothing), which would hold it to the timeout.
            # A server with none stops as soon as what the calls answered is sent.
            await self._server.stop(_STATUS_FLUSH_SECONDS)
        await stopped
        await asyncio.gather(*others)
        logger.info("server stopped; %d calls left", state.active_requests)
