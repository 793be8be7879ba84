"""Keyed calls' slots: `--max-concurrent-rpcs` per process, each identity its fair share,
and how long a call may hold one before its request arrives.

grpc's own cap (`maximum_concurrent_rpcs`) counts every call before any
interceptor runs, and the launcher sets it to `--max-concurrent-rpcs` plus the
keyless calls' slots (`KeylessLimits.grpc_cap`). Nothing in grpc keeps keyed
calls out of those keyless slots: enough keyed calls held open and a health
`Check` on the same port is refused (a liveness probe there restarts the pod).
`CallSlotsInterceptor` counts the keyed calls themselves, after authentication
admitted them, against `--max-concurrent-rpcs`, so the keyless slots stay
keyless; and, through `shares.FairShares`, no one identity holds more than its
share of them while others want them.

A call that sends its headers and never its message would hold its slot for
nothing: its read deadline (`--request-read-timeout`) ends it with
DEADLINE_EXCEEDED, and the slot (with its in-flight slot) comes back.
"""

from __future__ import annotations

import grpc

from ..context import blame_caller, current_identity, tenant
from ..shares import FairShares
from ._base import CallInterceptor, MethodFilter
from ._call import Call, ReadDeadline
from .auth import requires_auth_by_default
from .inflight import RETRY_PUSHBACK_KEY

__all__ = ["DEFAULT_REQUEST_READ_TIMEOUT", "CallSlotsInterceptor"]

DEFAULT_REQUEST_READ_TIMEOUT = 30.0
"""Seconds a keyed call waits for its request message. The largest message
(32 MiB by default) takes ~13 s at 20 Mbit/s; a tenant holding slots for
nothing holds them this long at most, and its share of them only."""


class CallSlotsInterceptor(CallInterceptor):
    """Refuses a keyed call past `max_calls` or past its caller's fair share of them.

    A call counts from its start (after authentication) until it ends, however
    it ends. Past `max_calls` calls at once in this process, or when the
    caller's tenant holds its fair share (`shares.fair_share`) while other
    tenants want slots too, the call is refused RESOURCE_EXHAUSTED naming the
    limit or the share, with a `grpc-retry-pushback-ms` trailer. Callers
    without credentials and administrators are held to `max_calls` only.

    Args:
        max_calls: the most keyed calls at once; None: no limit (the read
            deadline still holds).
        read_timeout: seconds a call waits for its unary request message;
            None: as long as it likes.
        methods: which calls are counted (default: every call that needs a key).
        retry_pushback_ms: the retry hint sent with a refusal.
    """

    def __init__(
        self,
        max_calls: int | None,
        *,
        read_timeout: float | None = DEFAULT_REQUEST_READ_TIMEOUT,
        methods: MethodFilter = requires_auth_by_default,
        retry_pushback_ms: int = 1000,
    ) -> None:
        super().__init__(methods=methods)
        if max_calls is not None and max_calls < 1:
            raise ValueError(f"max_calls must be at least 1, got {max_calls}")
        if read_timeout is not None and read_timeout <= 0:
            raise ValueError(f"read_timeout must be above 0, got {read_timeout}")
        self.max_calls = max_calls
        self._shares = FairShares(max_calls) if max_calls is not None else None
        self._pool = f"the call slots (--max-concurrent-rpcs {max_calls})"
        self._deadline = (
            None if read_timeout is None else ReadDeadline(read_timeout, "--request-read-timeout")
        )
        self._pushback = ((RETRY_PUSHBACK_KEY, str(int(retry_pushback_ms))),)
        self._total = 0
        self.refused = 0

    @property
    def total(self) -> int:
        """Keyed calls running now, in this process."""
        return self._total

    def held(self, name: str) -> int:
        """Slots the tenant `name` holds now."""
        return 0 if self._shares is None else self._shares.held(name)

    def read_deadline(self, method: str) -> ReadDeadline | None:
        return self._deadline

    async def on_start(self, call: Call) -> None:
        shares = self._shares
        name, weight = None, 1.0
        if shares is not None:
            name = tenant()
            identity = current_identity.get()
            weight = 1.0 if identity is None else identity.weight
            refusal = None
            if self._total >= shares.limit:
                shares.wants(name, weight)
                refusal = (
                    f"server busy: {self._total} calls at once, the limit "
                    f"(--max-concurrent-rpcs) is {shares.limit}; retry later"
                )
            else:
                refusal = shares.refusal(name, weight, self._pool)
                if refusal is not None:
                    blame_caller()  # past its own share: the server is not at fault
            if refusal is not None:
                self.refused += 1
                await call.context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, refusal, trailing_metadata=self._pushback
                )
            shares.take(name, weight)
        self._total += 1
        call.state = (name, weight)  # counted (a refused call reaches on_finish too)

    def on_finish(self, call: Call) -> None:
        if call.state is None:
            return
        self._total -= 1
        if self._shares is not None:
            self._shares.give_back(*call.state)
