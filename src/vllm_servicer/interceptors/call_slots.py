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

A call holds its slot while it moves. One that sends its headers and never
its message, a client stream that stops sending, a streamed answer whose
client stops taking it would hold its slot for nothing: its read deadline
(`--request-read-timeout`, for each request message) or its write deadline
(`--response-write-timeout`, for each response message) ends it, and the
slot (with its in-flight slot) comes back. Before that, a caller refused for
want of a free slot takes the slot of such a call from a tenant over its
share (`_reclaim.py`).

The HTTP API's requests take their slots from the same interceptor
(`claim`/`release`, from `serve/http_front.py`), so both protocols' keyed callers
share one pool and one tenant's share of it per process.
"""

from __future__ import annotations

import grpc

from ..context import blame_caller, current_identity, tenant
from ..shares import FairShares
from ._base import CallInterceptor, MethodFilter
from ._call import Call, ClientWait, ReadDeadline, WriteDeadline, client_wait
from ._reclaim import Holders
from .auth import requires_auth_by_default
from .inflight import RETRY_PUSHBACK_KEY

__all__ = [
    "DEFAULT_REQUEST_READ_TIMEOUT",
    "DEFAULT_RESPONSE_WRITE_TIMEOUT",
    "CallSlotsInterceptor",
    "CallSlotsRefused",
    "SlotHold",
]

DEFAULT_REQUEST_READ_TIMEOUT = 30.0
"""Seconds a keyed call waits for each request message. The largest message
(32 MiB by default) takes ~13 s at 20 Mbit/s; a tenant holding slots for
nothing holds them this long at most while no one else wants them."""

DEFAULT_RESPONSE_WRITE_TIMEOUT = 30.0
"""Seconds a streamed response message waits for its client to take it: a
client reading as it goes takes each in milliseconds, one that stops reading
(or grants no flow-control window) never does."""


class CallSlotsRefused(Exception):
    """No call slot for this caller: the message names the limit or the share."""


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
        read_timeout: seconds a call waits for each request message; None: as
            long as it likes.
        write_timeout: seconds each streamed response message waits for the
            client to take it; None: as long as it likes.
        methods: which calls are counted (default: every call that needs a key).
        retry_pushback_ms: the retry hint sent with a refusal.
    """

    def __init__(
        self,
        max_calls: int | None,
        *,
        read_timeout: float | None = DEFAULT_REQUEST_READ_TIMEOUT,
        write_timeout: float | None = DEFAULT_RESPONSE_WRITE_TIMEOUT,
        methods: MethodFilter = requires_auth_by_default,
        retry_pushback_ms: int = 1000,
    ) -> None:
        super().__init__(methods=methods)
        if max_calls is not None and max_calls < 1:
            raise ValueError(f"max_calls must be at least 1, got {max_calls}")
        if read_timeout is not None and read_timeout <= 0:
            raise ValueError(f"read_timeout must be above 0, got {read_timeout}")
        if write_timeout is not None and write_timeout <= 0:
            raise ValueError(f"write_timeout must be above 0, got {write_timeout}")
        self.max_calls = max_calls
        self._shares = FairShares(max_calls) if max_calls is not None else None
        self._pool = f"the call slots (--max-concurrent-rpcs {max_calls})"
        self._deadline = (
            None if read_timeout is None else ReadDeadline(read_timeout, "--request-read-timeout")
        )
        self._write_deadline = (
            None
            if write_timeout is None
            else WriteDeadline(write_timeout, "--response-write-timeout")
        )
        self._holders: Holders[SlotHold] = Holders(self._pool)
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

    def write_deadline(self, method: str) -> WriteDeadline | None:
        return self._write_deadline

    def claim(self) -> tuple[str | None, float]:
        """Take a slot for the current caller, gRPC call or HTTP request alike.

        Returns:
            What `release` gives back: the tenant's name and weight.

        Past `max_calls`, the slot of a tenant's call that waits on its client
        is taken back first when its tenant is over its share (`_reclaim.py`).

        Raises:
            CallSlotsRefused: past `max_calls`, or the caller holds its share.
        """
        shares = self._shares
        name, weight = None, 1.0
        if shares is not None:
            name = tenant()
            identity = current_identity.get()
            weight = 1.0 if identity is None else identity.weight
            if self._total >= shares.limit:
                shares.wants(name, weight)
                operator = identity is not None and name is None
                if not self._holders.reclaim(
                    shares, name, SlotHold.release, operator=operator, weight=weight
                ):
                    self.refused += 1
                    raise CallSlotsRefused(
                        f"server busy: {self._total} calls at once, the limit "
                        f"(--max-concurrent-rpcs) is {shares.limit}; retry later"
                    )
            refusal = shares.refusal(name, weight, self._pool)
            if refusal is not None:
                blame_caller()  # past its own share: the server is not at fault
                self.refused += 1
                raise CallSlotsRefused(refusal)
            shares.take(name, weight)
        self._total += 1
        return name, weight

    def hold(self, wait: ClientWait | None = None) -> SlotHold:
        """`claim`, held: a gRPC call's slot or an HTTP request's, which a
        tenant's `wait` (its wait on its client, marked while it waits) may lose
        to a caller that wants the full pool.

        Raises:
            CallSlotsRefused: as `claim`.
        """
        held = self.claim()
        hold = SlotHold(self, held, wait)
        if wait is not None and held[0] is not None:
            self._holders.add(wait, held[0], held[1], hold)
        return hold

    def release(self, held: tuple[str | None, float]) -> None:
        """Give back a slot `claim` took."""
        self._total -= 1
        if self._shares is not None:
            self._shares.give_back(*held)

    async def on_start(self, call: Call) -> None:
        try:
            call.state = self.hold(client_wait())  # a refused call reaches on_finish too
        except CallSlotsRefused as exc:
            await call.context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), trailing_metadata=self._pushback
            )
            raise  # abort raises; not reached

    def on_finish(self, call: Call) -> None:
        if call.state is not None:
            call.state.release()


class SlotHold:
    """One call slot taken (`CallSlotsInterceptor.hold`), let go once: by the
    call's end, or by a caller that took it back while the call stood still."""

    __slots__ = ("_held", "_slots", "_wait")

    def __init__(
        self, slots: CallSlotsInterceptor, held: tuple[str | None, float], wait: ClientWait | None
    ) -> None:
        self._slots = slots
        self._held: tuple[str | None, float] | None = held
        self._wait = wait

    def release(self) -> None:
        """Give the slot back, unless it was given back already."""
        held, self._held = self._held, None
        if held is None:
            return
        if self._wait is not None:
            self._slots._holders.discard(self._wait)
        self._slots.release(held)
