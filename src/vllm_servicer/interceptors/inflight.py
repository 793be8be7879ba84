"""Counting the RPCs in flight, with an optional limit on engine requests and
each tenant's fair share of it."""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc

from ..context import Identity, blame_caller, current_identity, tenant_of
from ..frontends import FrontendGroup
from ..proto import COUNTED_METHODS
from ..shares import FairShares
from ._base import CallInterceptor, MethodFilter, all_methods, only_methods
from ._call import Call, client_wait
from ._reclaim import Holders

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

    Under a limit, each tenant (`context.tenant_of`: an identity without the
    admin role) is held to its fair share of it while other tenants want
    slots (`shares.FairShares`: they hold some, or were refused for want of a
    free one within the last 10 s): past its share a call is refused the same
    way, the message naming the share. A tenant alone takes the whole limit;
    calls without credentials and administrators count toward the total only.
    Past the limit, the slot of a tenant's call that waits on its client (for
    a request message, or for it to take a response) is taken back first when
    that tenant is over its share (`_reclaim.py`).

    Args:
        max_inflight: the most limited calls in flight at once; None: no limit.
        limited: which calls the limit applies to (default: `ENGINE_REQUESTS`).
        retry_pushback_ms: the retry hint sent with a rejection.
        methods: which methods are counted at all (default: every method).
        group: the frontend processes sharing one engine (`serve
            --api-server-count`): the limit and the shares hold for their
            calls together.
        fair_shares: hold each tenant to its fair share of the limit while
            others want slots; False: first come, first served up to the limit.
    """

    def __init__(
        self,
        max_inflight: int | None = None,
        *,
        limited: MethodFilter = ENGINE_REQUESTS,
        retry_pushback_ms: int = 1000,
        methods: MethodFilter = all_methods,
        group: FrontendGroup | None = None,
        fair_shares: bool = True,
    ) -> None:
        super().__init__(methods=methods)
        self._shares: FairShares | None = None
        if fair_shares:
            self._shares = FairShares(1, book=None if group is None else group.share_book())
        self.max_inflight = max_inflight
        if group is not None and self._shares is not None and max_inflight is not None:
            records = group.share_book().capacity
            if records <= max_inflight:
                raise ValueError(
                    f"the frontend group counts the shares of {records} identities, not more "
                    f"than max_inflight ({max_inflight}): build it with share_records above it"
                )
        self._limited = limited
        self._limited_cache: dict[str, bool] = {}
        self._pushback = ((RETRY_PUSHBACK_KEY, str(int(retry_pushback_ms))),)
        self._holders: Holders[Call] = Holders("the engine slots (max_inflight)")
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
    def max_inflight(self) -> int | None:
        """The most limited calls in flight at once (None: no limit)."""
        return self._max_inflight

    @max_inflight.setter
    def max_inflight(self, value: int | None) -> None:
        if value is not None and value < 1:
            raise ValueError(f"max_inflight must be at least 1, got {value}")
        self._max_inflight = value
        if self._shares is not None and value is not None:
            self._shares.limit = value

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

    def refusal(self, caller: Identity | None = None, n: int = 1) -> str | None:
        """None when `n` more of `caller`'s limited requests fit now; else the refusal's text.

        They fit under the limit and under the caller's fair share. Counts
        nothing, but a caller refused for want of a free slot counts as
        wanting one (its share is then kept for it), and the slot of a still
        call of a tenant over its share is taken back first, as `enter` does:
        the HTTP API asks before it answers a stream's headers, as vLLM's own
        `check_admission` is asked, then `enter`s.
        """
        if self._max_inflight is None:
            return None
        refusal = self._checked(caller, n)
        if refusal is not None and self._reclaim(caller):
            # A still call's slot taken back: the caller's `enter` takes it.
            refusal = self._checked(caller, n)
        return refusal

    def _checked(self, caller: Identity | None, n: int) -> str | None:
        tenant, group = self._tenant(caller), self._group
        if group is None:
            return self._check(tenant, n)
        with group.locked():
            return self._check(tenant, n)

    def enter(self, caller: Identity | None = None) -> str | None:
        """Count one more limited request (any protocol's) for `caller`; the
        refusal's text instead, counting nothing, past the limit or its share.
        Pair with `leave(caller)`."""
        refusal = self._admit(caller)
        if refusal is not None and self._reclaim(caller):
            refusal = self._admit(caller)
        if refusal is not None:
            self.rejected += 1
            return refusal
        self._limited_total += 1
        if self._limited_idle is not None:
            self._limited_idle.clear()
        return None

    def leave(self, caller: Identity | None = None) -> None:
        """One limited request `enter(caller)` counted ended."""
        self._limited_total -= 1
        tenant, shares, group = self._tenant(caller), self._shares, self._group
        if group is None:
            if tenant is not None and shares is not None:
                shares.give_back(*tenant)
        elif tenant is None or shares is None:
            group.add_inflight(-1)
        else:
            with group.locked():
                group.add_inflight(-1)
                shares.give_back(*tenant)
        if self._limited_total == 0 and self._limited_idle is not None:
            self._limited_idle.set()

    def busy_message(self, busy: int) -> str:
        """The refusal's text past the limit, the same for every protocol."""
        return (
            f"server busy: {busy} requests in flight, the limit "
            f"(max_inflight) is {self._max_inflight}; retry later"
        )

    # ----- the limit and the shares -------------------------------------------------

    def _tenant(self, caller: Identity | None) -> tuple[str, float] | None:
        """The name and weight `caller`'s slots count against in the shares;
        None: the total's only."""
        name = tenant_of(caller)
        if name is None or caller is None or self._shares is None or self._max_inflight is None:
            return None
        return name, caller.weight

    def _check(self, tenant: tuple[str, float] | None, n: int) -> str | None:
        """The limit, then the tenant's share (under the group's lock, if any)."""
        limit, shares = self._max_inflight, self._shares
        assert limit is not None
        busy = self.limited_everywhere
        if busy + n > limit:
            if tenant is not None and shares is not None:
                shares.wants(*tenant)  # its share is kept for it while it retries
            return self.busy_message(busy)
        if tenant is None or shares is None:
            return None
        refusal = shares.refusal(*tenant, pool=f"the {limit} engine slots (max_inflight)")
        if refusal is not None:
            blame_caller()  # past its own share: the server is not at fault
        return refusal

    def _reclaim(self, caller: Identity | None) -> bool:
        """Past the limit, take back the slot of a still call of a tenant over its share."""
        limit, shares = self._max_inflight, self._shares
        if limit is None or shares is None or not self._holders:
            return False
        if self.limited_everywhere < limit:
            return False  # refused for its own share, not for want of a slot
        tenant = self._tenant(caller)
        operator = caller is not None and tenant_of(caller) is None
        name, weight = (None, 1.0) if tenant is None else tenant
        return self._holders.reclaim(
            shares, name, self._give_back, operator=operator, weight=weight
        )

    def _give_back(self, call: Call) -> None:
        """The slot of `call`, taken back while it waits on its client: let go now
        (the call still counts among the calls in flight until it ends)."""
        _limited, caller, _wait = call.state
        call.state = (False, caller, None)
        self.leave(caller)

    def _admit(self, caller: Identity | None) -> str | None:
        """Count one more limited call; the refusal's text instead."""
        group = self._group
        if self._max_inflight is None:
            if group is not None:
                group.add_inflight(1)
            return None
        tenant = self._tenant(caller)
        if group is None:
            refusal = self._check(tenant, 1)
            if refusal is None and tenant is not None and self._shares is not None:
                self._shares.take(*tenant)
            return refusal
        with group.locked():  # another process may be admitting one too
            refusal = self._check(tenant, 1)
            if refusal is None:
                group.add_inflight(1)
                if tenant is not None and self._shares is not None:
                    self._shares.take(*tenant)
        return refusal

    # ----- hooks ----------------------------------------------------------------------

    def _is_limited(self, method: str) -> bool:
        cached = self._limited_cache.get(method)
        if cached is None:
            cached = self._limited_cache[method] = bool(self._limited(method))
        return cached

    async def on_start(self, call: Call) -> None:
        limited = self._is_limited(call.method)
        caller = None
        if limited:
            # Auth set it in its on_admit; kept for on_finish, whose context may not have it.
            caller = current_identity.get()
            refusal = self.enter(caller)
            if refusal is not None:
                await call.context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, refusal, trailing_metadata=self._pushback
                )
        wait = None
        if limited and self._shares is not None and self._max_inflight is not None:
            tenant = self._tenant(caller)
            if tenant is not None:  # a tenant's: its slot may be taken back while it waits
                wait = client_wait()
                self._holders.add(wait, tenant[0], tenant[1], call)
        # Marks the call as counted: a rejected call also reaches on_finish.
        call.state = (limited, caller, wait)
        self._counts[call.method] += 1
        self._total += 1
        if self._idle is not None:
            self._idle.clear()

    def on_finish(self, call: Call) -> None:
        state = call.state
        if state is None:
            return
        limited, caller, wait = state
        if wait is not None:
            self._holders.discard(wait)
        self._counts[call.method] -= 1
        self._total -= 1
        if self._total == 0 and self._idle is not None:
            self._idle.set()
        if limited:
            self.leave(caller)

    def _event(self, include_all: bool) -> asyncio.Event:
        if include_all:
            if self._idle is None:
                self._idle = asyncio.Event()
            return self._idle
        if self._limited_idle is None:
            self._limited_idle = asyncio.Event()
        return self._limited_idle
