"""Slots of their own for the calls that need no key: health, reflection, load reports.

Health `Watch`, reflection and ORCA load-report (`StreamCoreMetrics`) streams
stay open as long as their client likes, and so does a health `Check` whose
client never sends its request (the wrapper reads it once the call has
started); none of them needs a key. grpc's own cap on calls at once
(`maximum_concurrent_rpcs`) counts them with every other call, before any
interceptor runs: enough of them, from anyone who reaches the port, and every
later call is RESOURCE_EXHAUSTED, keyed or not.

`KeylessLimitInterceptor` caps them apart: the streams (any keyless call that
streams) and the checks (keyless calls of one request and one answer) each
have a total, and every connection a share of them all, so one connection
cannot take a whole total and a flood of streams leaves the checks their own
slots (a liveness probe keeps its answer). Give grpc's cap `KeylessLimits.slots`
on top of what keyed calls need (`grpc_cap`), and no number of keyless calls
takes a slot a keyed call needs.

A keyless call waits `read_timeout` (2 s) at most for its request message, and
a check still waiting for its message gives its slot to a new check when the
checks are full: the oldest such wait is cut short (DEADLINE_EXCEEDED). A
probe's check sends its message with its headers, so checks held open without
one never keep it from an answer; checks that did send theirs are answered in
microseconds.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

import grpc

from ..errors import KeylessLimitError
from ..flags import flag, flag_name, not_a_flag
from ._base import CallInterceptor, MethodFilter
from ._call import Call, ClientWait, ReadDeadline, client_wait
from .auth import requires_auth_by_default

__all__ = ["KeylessLimitInterceptor", "KeylessLimits", "keyless_methods"]


def keyless_methods(method: str) -> bool:
    """The calls that need no key by default: health, reflection, ORCA's load reports
    (`AuthInterceptor`'s rule)."""
    return not requires_auth_by_default(method)


@dataclass(frozen=True)
class KeylessLimits:
    """Calls that need no key: how many may run at once, per process.

    Their slots come on top of --max-concurrent-rpcs, so keyless calls never
    take one a keyed call needs.

    Attributes:
        max_keyless_streams: streaming keyless calls (health Watch, reflection,
            ORCA's StreamCoreMetrics) open at once.
        max_keyless_checks: keyless calls of one answer (health Check) at once;
            apart from the streams, so a probe is answered while they are full.
        max_keyless_per_connection: keyless calls of either kind at once on one
            connection (as grpc names its peer: address and port).
        read_timeout: seconds a keyless call waits for its request message
            (a few bytes: health's service name, ORCA's interval).
    """

    FLAG_TITLE: ClassVar[str] = "vllm-servicer: calls that need no key"

    max_keyless_streams: int = flag(
        64,
        help="most health Watch, reflection and ORCA load-report streams (no key needed) open "
        "at once; past it RESOURCE_EXHAUSTED. Slots of their own, on top of "
        "--max-concurrent-rpcs (default 64)",
    )
    max_keyless_checks: int = flag(
        64,
        help="most health Check calls at once, apart from the streams so that probes are "
        "answered while those are full; on top of --max-concurrent-rpcs (default 64)",
    )
    max_keyless_per_connection: int = flag(
        8,
        help="most health, reflection and load-report calls at once on one connection (default 8)",
    )
    read_timeout: float = not_a_flag(2.0)

    def __post_init__(self) -> None:
        for name in ("max_keyless_streams", "max_keyless_checks", "max_keyless_per_connection"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"{name} must be at least 1, got {getattr(self, name)} "
                    f"(the launcher's {flag_name(name)})"
                )
        if self.read_timeout <= 0:
            raise ValueError(f"read_timeout must be above 0, got {self.read_timeout}")

    @property
    def slots(self) -> int:
        """Keyless calls at once in all: what grpc's cap must leave them."""
        return self.max_keyless_streams + self.max_keyless_checks

    def grpc_cap(self, keyed: int | None) -> int | None:
        """grpc's `maximum_concurrent_rpcs` that keeps `keyed` slots (None: no cap)
        for every other call, whatever keyless calls hold."""
        return None if keyed is None else keyed + self.slots


class KeylessLimitInterceptor(CallInterceptor):
    """Refuses a keyless call past `limits`: RESOURCE_EXHAUSTED naming the limit.

    The call is refused once it has started, before its request is read, and
    holds no slot afterwards; an admitted one holds its slot until it ends,
    however it ends.

    Args:
        limits: the caps.
        methods: which calls are keyless (default: health, reflection, load reports).
    """

    def __init__(
        self, limits: KeylessLimits | None = None, *, methods: MethodFilter = keyless_methods
    ) -> None:
        super().__init__(methods=methods)
        self.limits = limits or KeylessLimits()
        self._streams = 0
        self._checks = 0
        self._per_connection: Counter[str] = Counter()
        # Checks still waiting for their message, oldest first (dicts keep order).
        self._waiting: dict[ClientWait, Call] = {}
        self._deadline = ReadDeadline(
            self.limits.read_timeout, "read_timeout of calls that need no key"
        )
        self.refused = 0

    @property
    def streams(self) -> int:
        """Keyless streams open now."""
        return self._streams

    @property
    def checks(self) -> int:
        """Keyless checks running now."""
        return self._checks

    def read_deadline(self, method: str) -> ReadDeadline:
        return self._deadline

    async def on_start(self, call: Call) -> None:
        streams = call.kind != "unary_unary"
        peer = _peer(call.context)
        limits = self.limits
        if (
            not streams
            and self._checks >= limits.max_keyless_checks
            and self._per_connection[peer] < limits.max_keyless_per_connection
        ):
            self._give_a_waiting_slot()
        refusal = self._refusal(streams, peer)
        if refusal is not None:
            self.refused += 1
            await call.context.abort(grpc.StatusCode[refusal.status_code], str(refusal))
        waiting = None
        if streams:
            self._streams += 1
        else:
            self._checks += 1
            waiting = client_wait()
            self._waiting[waiting] = call
        self._per_connection[peer] += 1
        call.state = (streams, peer, waiting)

    def on_request(self, call: Call, message: Any) -> None:
        # None once its slot went to another check: its message came as the
        # wait was cut short, and it is answered all the same.
        if call.state is not None and call.state[2] is not None:
            self._waiting.pop(call.state[2], None)

    def on_finish(self, call: Call) -> None:
        if call.state is None:  # refused, or its slot given to another: it holds none
            return
        streams, peer, waiting = call.state
        call.state = None
        if waiting is not None:
            self._waiting.pop(waiting, None)
        if streams:
            self._streams -= 1
        else:
            self._checks -= 1
        self._per_connection[peer] -= 1
        if not self._per_connection[peer]:
            del self._per_connection[peer]

    def _give_a_waiting_slot(self) -> None:
        """Free the slot of the oldest check still waiting for its message: its
        wait ends now (DEADLINE_EXCEEDED), and a check that came with its message
        (a probe's) takes the slot."""
        if not self._waiting:
            return
        waiting, call = next(iter(self._waiting.items()))
        self.on_finish(call)  # the slot now; its call ends on its own task's next turn
        waiting.cut_short(
            "request message not received before the keyless checks filled up "
            f"(max_keyless_checks is {self.limits.max_keyless_checks}): the slot went to a "
            "check that sent its message; send the message with the call"
        )

    def _refusal(self, streams: bool, peer: str) -> KeylessLimitError | None:
        limits = self.limits
        if streams and self._streams >= limits.max_keyless_streams:
            return KeylessLimitError(
                f"too many keyless streams: {self._streams} health Watch, reflection and "
                f"load-report streams are open, the limit (max_keyless_streams) is "
                f"{limits.max_keyless_streams}; retry later"
            )
        if not streams and self._checks >= limits.max_keyless_checks:
            return KeylessLimitError(
                f"too many keyless checks: {self._checks} health checks are running, "
                f"the limit (max_keyless_checks) is {limits.max_keyless_checks}; retry later"
            )
        if self._per_connection[peer] >= limits.max_keyless_per_connection:
            return KeylessLimitError(
                f"too many keyless calls on this connection: {self._per_connection[peer]} "
                "health, reflection and load-report calls are open on it, the limit "
                f"(max_keyless_per_connection) is {limits.max_keyless_per_connection}; "
                "close some or open another connection"
            )
        return None


def _peer(context: Any) -> str:
    """The call's connection as grpc names it ("ipv4:10.0.0.7:53412")."""
    try:
        return str(context.peer())
    except Exception:  # pragma: no cover - a context without a transport
        return "?"
