"""Fair shares of a pooled resource among the identities that want it.

A server's pools (`--max-inflight` engine requests, `--max-concurrent-rpcs`
calls) are shared by every tenant. Without shares one key can take a whole
pool, and every other tenant is refused for as long as it holds it. The rule
here is max-min fairness among the identities that want the pool now:

- an identity alone takes the whole pool (one router on one key loses nothing);
- once others want it too (they hold part of it, or were refused for want of
  a free slot within the last `window` seconds), each is held to
  `ceil(limit * weight / weights of all who want it)`, at least 1: a tenant
  past its share is refused while the others take the slots it gives back.

Nothing is taken away from a call already running: a tenant over its share
after another arrives keeps what it holds and gets no more until it is under
its share again. Calls without credentials and administrators are held to the
pool's total only (`context.tenant()` is None for them): the operator can
change the server for everyone anyway.

No grpc and no vLLM here; the pools' interceptors and the HTTP API's guard
ask one `FairShares` each.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

__all__ = ["DEFAULT_WANT_WINDOW", "FairShares", "fair_share", "share_message"]

DEFAULT_WANT_WINDOW = 10.0
"""Seconds an identity refused for want of a free slot counts as wanting the
pool: clients retry after the pushback (1 s by default) well within it."""


def fair_share(limit: int, weight: float, wanting_weights: Iterable[float]) -> int:
    """An identity's share of `limit` slots: `ceil(limit * weight / total)`, at least 1.

    Args:
        limit: the pool's size.
        weight: the identity's weight.
        wanting_weights: the weights of every identity that wants the pool,
            this one included.
    """
    total = sum(wanting_weights)
    if total <= 0 or weight >= total:
        return limit
    return max(1, math.ceil(limit * weight / total))


def share_message(name: str, held: int, share: int, wanting: int, pool: str) -> str:
    """A refusal's text for a tenant past its share, the same for every protocol."""
    return (
        f"tenant {name!r} holds {held} of {pool}, its share while {wanting} tenants "
        f"want them is {share}; retry later"
    )


class FairShares:
    """Per-identity counts of one pool's slots, and the fair share of each.

    The pool's total is its owner's to check (`InflightInterceptor`, the call
    cap): this class only says whether an identity is past its share, counts
    what each holds, and remembers who was refused a slot recently.

    Args:
        limit: the pool's size.
        window: seconds an identity refused for want of a slot counts as wanting.
        clock: the time source (monotonic seconds).
    """

    def __init__(
        self,
        limit: int,
        *,
        window: float = DEFAULT_WANT_WINDOW,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if limit < 1:
            raise ValueError(f"a pool needs at least one slot, got {limit}")
        self.limit = limit
        self._window = window
        self._clock = clock
        self._held: dict[str, int] = {}
        self._weights: dict[str, float] = {}
        self._wanting_until: dict[str, float] = {}

    def held(self, name: str) -> int:
        """Slots `name` holds now."""
        return self._held.get(name, 0)

    def wanting(self) -> dict[str, float]:
        """Every identity that wants the pool now, with its weight."""
        now = self._clock()
        for name, until in list(self._wanting_until.items()):
            if until <= now and name not in self._held:
                del self._wanting_until[name]
                self._weights.pop(name, None)
        return {name: self._weights[name] for name in self._held.keys() | self._wanting_until}

    def share(self, name: str, weight: float = 1.0) -> int:
        """The share `name` is held to now, were it to ask for a slot."""
        wanting = self.wanting()
        wanting[name] = weight
        return fair_share(self.limit, weight, wanting.values())

    def refusal(self, name: str | None, weight: float = 1.0, pool: str = "the slots") -> str | None:
        """None when `name` may take one more slot under its share; else the refusal's text.

        Counts nothing (`take` does). None for a caller held to the total only.
        """
        if name is None:
            return None
        held = self.held(name)
        if held == 0:
            return None  # a share is one slot at least
        wanting = self.wanting()
        wanting[name] = weight
        share = fair_share(self.limit, weight, wanting.values())
        if held < share:
            return None
        return share_message(name, held, share, len(wanting), pool)

    def take(self, name: str | None, weight: float = 1.0) -> None:
        """`name` took one slot (after `refusal` said it may)."""
        if name is None:
            return
        self._held[name] = self._held.get(name, 0) + 1
        self._weights[name] = weight

    def give_back(self, name: str | None) -> None:
        """`name` let one slot go."""
        if name is None:
            return
        left = self._held.get(name, 0) - 1
        if left > 0:
            self._held[name] = left
            return
        self._held.pop(name, None)
        if name not in self._wanting_until:
            self._weights.pop(name, None)

    def wants(self, name: str | None, weight: float = 1.0) -> None:
        """`name` was refused for want of a free slot: it counts as wanting for `window` s."""
        if name is None:
            return
        self._wanting_until[name] = self._clock() + self._window
        self._weights[name] = weight
