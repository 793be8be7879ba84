"""Counting the RPCs in flight, with an optional limit on engine requests."""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc

from ..frontends import FrontendGroup
from ..proto import COUNTED_METHODS
from ._base import CallInterceptor, MethodFilter, all_methods, only_methods
from ._call import Call

ENGINE_REQUESTS: MethodFilter = only_methods(*COUNTED_METHODS)
"""The calls that occupy the engine or its renderer (`proto.COUNTED_METHODS`):
VllmEngine's Generate and Embed, vllm.Inference's Generate and GenerateStream,
Pooling's Classify, Score and Rerank, Render's RenderChat and RenderCompletion."""

RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"


class InflightInterceptor(CallInterceptor):
    """Counts RPCs in flight per method; optionally rejects engine requests past a limit.

    A call counts from the moment its handler starts until it ends, however it
    ends (success, error, abort, client cancel, deadline). Past `max_inflight`
    limited calls in flight, a new limited call is rejected at once with
    RESOURCE_EXHAUSTED and a `grpc-retry-pushback-ms` trailer (clients with a
    retry policy wait that long), instead of queueing in the engine without
    bound. Engine requests that come another way (vLLM's HTTP API beside)
    count under the same limit through `enter` and `leave`.

    Args:
        max_inflight: the most limited calls in flight at once; None: no limit.
        limited: which calls the limit applies to (default: `ENGINE_REQUESTS`).
        retry_pushback_ms: the retry hint sent with a rejection.
        methods: which methods are counted at all (default: every method).
        group: the frontend processes sharing one engine (`serve
            --api-server-count`): the limit holds for their calls together.
    """

    def __init__(
        self,
        max_inflight: int | None = None,
        *,
        limited: MethodFilter = ENGINE_REQUESTS,
        retry_pushback_ms: int = 1000,
        methods: MethodFilter = all_methods,
        group: FrontendGroup | None = None,
    ) -> None:
        super().__init__(methods=methods)
        if max_inflight is not None and max_inflight < 1:
            raise ValueError(f"max_inflight must be at least 1, got {max_inflight}")
        self.max_inflight = max_inflight
        self._limited = limited
        self._limited_cache: dict[str, bool] = {}
        self._pushback = ((RETRY_PUSHBACK_KEY, str(int(retry_pushback_ms))),)
        self._counts: Counter[str] = Counter()
        self._total = 0
        self._limited_total = 0
        self.rejected = 0
        self._group = group
        # Created lazily: an Event made outside a running loop binds to the first loop using it.
        self._idle: asyncio.Event | None = None
        self._limited_idle: asyncio.Event | None = None

    # ----- what a host can read ----------------------------------------------------

    @property
    def total(self) -> int:
        """All counted calls in flight (long-lived streams such as health Watch included)."""
        return self._total

    @property
    def limited_total(self) -> int:
        """Limited calls (by default `ENGINE_REQUESTS`) in flight, in this process."""
        return self._limited_total

    @property
    def limited_everywhere(self) -> int:
        """Limited calls in flight in every frontend process on the engine (this one alone)."""
        return self._limited_total if self._group is None else self._group.inflight

    def count(self, method: str) -> int:
        """Calls of one method ("/package.Service/Method") in flight."""
        return self._counts.get(method, 0)

    def counts(self) -> dict[str, int]:
        """Every method with calls in flight, and how many."""
        return {method: n for method, n in self._counts.items() if n}

    async def wait_idle(self, timeout: float | None = None, *, include_all: bool = False) -> bool:
        """Wait until no limited call is in flight (or no counted call at all).

        A host draining its server waits for engine work; health `Watch` and
        reflection streams stay open until the server stops, so they are left
        out unless `include_all` is set.

        Args:
            timeout: seconds to wait at most; None waits as long as it takes.
            include_all: wait for every counted call, not only limited ones.

        Returns:
            True when idle, False when the timeout passed first.
        """
        if (self._total if include_all else self._limited_total) == 0:
            return True
        event = self._event(include_all)
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            return False
        return True

    # ----- engine requests counted outside a gRPC call ---------------------------

    def room_for(self, n: int = 1) -> int | None:
        """None when `n` more limited requests fit under the limit now; else the count in flight.

        Counts nothing: the HTTP API asks before it answers a stream's
        headers, as vLLM's own `check_admission` is asked, then `enter`s.
        """
        if self.max_inflight is None:
            return None
        busy = self.limited_everywhere
        return busy if busy + n > self.max_inflight else None

    def enter(self) -> int | None:
        """Count one more limited request (any protocol's); the count in flight
        instead, counting nothing, when at the limit. Pair with `leave`."""
        busy = self._admit()
        if busy is not None:
            self.rejected += 1
            return busy
        self._limited_total += 1
        if self._limited_idle is not None:
            self._limited_idle.clear()
        return None

    def leave(self) -> None:
        """One limited request counted by `enter` ended."""
        self._limited_total -= 1
        if self._group is not None:
            self._group.add_inflight(-1)
        if self._limited_total == 0 and self._limited_idle is not None:
            self._limited_idle.set()

    def busy_message(self, busy: int) -> str:
        """The refusal's text, the same for every protocol."""
        return (
            f"server busy: {busy} requests in flight, the limit "
            f"(max_inflight) is {self.max_inflight}; retry later"
        )

    # ----- hooks ----------------------------------------------------------------------

    def _admit(self) -> int | None:
        """Count one more limited call; the calls in flight instead when at the limit."""
        group = self._group
        if group is None:
            if self.max_inflight is not None and self._limited_total >= self.max_inflight:
                return self._limited_total
            return None
        with group.locked():  # another process may be admitting one too
            if self.max_inflight is not None and group.inflight >= self.max_inflight:
                return group.inflight
            group.add_inflight(1)
        return None

    def _is_limited(self, method: str) -> bool:
        cached = self._limited_cache.get(method)
        if cached is None:
            cached = self._limited_cache[method] = bool(self._limited(method))
        return cached

    async def on_start(self, call: Call) -> None:
        limited = self._is_limited(call.method)
        if limited:
            busy = self.enter()
            if busy is not None:
                await call.context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    self.busy_message(busy),
                    trailing_metadata=self._pushback,
                )
        # Marks the call as counted: a rejected call also reaches on_finish.
        call.state = limited
        self._counts[call.method] += 1
        self._total += 1
        if self._idle is not None:
            self._idle.clear()

    def on_finish(self, call: Call) -> None:
        limited = call.state
        if limited is None:
            return
        self._counts[call.method] -= 1
        self._total -= 1
        if self._total == 0 and self._idle is not None:
            self._idle.set()
        if limited:
            self.leave()

    def _event(self, include_all: bool) -> asyncio.Event:
        if include_all:
            if self._idle is None:
                self._idle = asyncio.Event()
            return self._idle
        if self._limited_idle is None:
            self._limited_idle = asyncio.Event()
        return self._limited_idle
