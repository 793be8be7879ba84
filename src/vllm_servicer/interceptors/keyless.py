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
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import grpc

from ..errors import KeylessLimitError
from ._base import CallInterceptor, MethodFilter
from ._call import Call
from .auth import requires_auth_by_default

__all__ = ["KeylessLimitInterceptor", "KeylessLimits", "keyless_methods"]


def keyless_methods(method: str) -> bool:
    """The calls that need no key by default: health, reflection, ORCA's load reports
    (`AuthInterceptor`'s rule)."""
    return not requires_auth_by_default(method)


@dataclass(frozen=True)
class KeylessLimits:
    """How many keyless calls may run at once, per process.

    Attributes:
        max_keyless_streams: streaming keyless calls (health Watch, reflection,
            ORCA's StreamCoreMetrics) open at once.
        max_keyless_checks: keyless calls of one answer (health Check) at once;
            apart from the streams, so a probe is answered while they are full.
        max_keyless_per_connection: keyless calls of either kind at once on one
            connection (as grpc names its peer: address and port).
    """

    max_keyless_streams: int = 64
    max_keyless_checks: int = 64
    max_keyless_per_connection: int = 8

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")

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
        self.refused = 0

    @property
    def streams(self) -> int:
        """Keyless streams open now."""
        return self._streams

    @property
    def checks(self) -> int:
        """Keyless checks running now."""
        return self._checks

    async def on_start(self, call: Call) -> None:
        streams = call.kind != "unary_unary"
        peer = _peer(call.context)
        refusal = self._refusal(streams, peer)
        if refusal is not None:
            self.refused += 1
            await call.context.abort(grpc.StatusCode[refusal.status_code], str(refusal))
        if streams:
            self._streams += 1
        else:
            self._checks += 1
        self._per_connection[peer] += 1
        call.state = (streams, peer)

    def on_finish(self, call: Call) -> None:
        if call.state is None:  # refused: it took no slot
            return
        streams, peer = call.state
        if streams:
            self._streams -= 1
        else:
            self._checks -= 1
        self._per_connection[peer] -= 1
        if not self._per_connection[peer]:
            del self._per_connection[peer]

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
