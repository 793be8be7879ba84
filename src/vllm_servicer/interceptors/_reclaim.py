"""Taking back the slot of a call that does not move, for a caller that would.

A pool's slots (`--max-inflight` engine requests, `--max-concurrent-rpcs`
calls) go to the calls that ask first, and fair shares keep a tenant from
taking more while others want them (`shares.py`). A call that holds a slot
keeps it while it waits on its client, though: a request message that does
not come, a response message the client does not take. The deadlines end
such a wait (`--request-read-timeout`, `--response-write-timeout`, each 30 s
a message by default), but until then one tenant's calls that wait on
nothing can hold a whole pool, and every other tenant is refused meanwhile.

So a pool that must refuse a caller for want of a free slot first takes one
back: from a call that has waited on its client for `STILL_AFTER_S` or more,
of a tenant over its fair share now that the caller wants the pool too (for
an operator's call, of any tenant, those over their share first), the call
that has waited longest first.
That call ends (DEADLINE_EXCEEDED, naming why) and the caller takes its
slot. A call that moves is never taken from, nor one of a tenant within its
share, nor an operator's call, nor any call of a server without tenants.
Only this process's calls are taken from: with `--api-server-count` each
process gives back its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

from ..shares import FairShares
from ._call import ClientWait

__all__ = ["STILL_AFTER_S", "Holders"]

Token = TypeVar("Token")
"""What a pool's `give_back` takes to let a holder's slot go."""

STILL_AFTER_S = 1.0
"""Seconds a call must have waited on its client before its slot can be taken
back: a stream between two messages a client sends at once waits microseconds,
a client that sends nothing waits for ever."""


class Holders(Generic[Token]):
    """The tenants' calls holding one pool's slots, each with its wait on its client.

    Args:
        pool: the pool as a refusal names it ("the engine slots (max_inflight)").
    """

    __slots__ = ("_calls", "_pool")

    def __init__(self, pool: str) -> None:
        self._pool = pool
        self._calls: dict[ClientWait, tuple[str, float, Token]] = {}

    def __len__(self) -> int:
        return len(self._calls)

    def add(self, wait: ClientWait, name: str, weight: float, token: Token) -> None:
        """A call of tenant `name` holds a slot; `token` is what the pool's
        `give_back` takes to let it go."""
        self._calls[wait] = (name, weight, token)

    def discard(self, wait: ClientWait) -> None:
        """The call ended, or gave its slot back."""
        self._calls.pop(wait, None)

    def reclaim(
        self,
        shares: FairShares,
        claimant: str | None,
        give_back: Callable[[Token], None],
        *,
        operator: bool = False,
        weight: float = 1.0,
    ) -> bool:
        """Take back the slot of the call that has waited longest on its client,
        of a tenant over its share now (any tenant's for an `operator`).

        Call it after the caller was marked as wanting the pool (`FairShares.wants`),
        so that the shares count it.

        Args:
            shares: the pool's fair shares.
            claimant: the tenant that wants a slot (None: an operator or no tenant).
            give_back: the pool's own release of a holder's slot, given its token.
            operator: the claimant is an operator (admin): any tenant's still
                call gives way.
            weight: the claimant's weight: a claimant at its own share would be
                refused the slot, and takes none back.

        Returns:
            Whether a slot was given back (the caller may now take it).
        """
        if not self._calls or (claimant is None and not operator):
            return False
        if claimant is not None and shares.held(claimant) >= shares.share(claimant, weight):
            return False  # its own share refuses it: a slot taken back would go to no one
        now = asyncio.get_running_loop().time()
        over: dict[str, bool] = {}  # each tenant's standing, reckoned once
        found: tuple[tuple[bool, float], ClientWait, str] | None = None
        for wait, (name, holder_weight, _token) in self._calls.items():
            waited = wait.waited(now)
            if waited < STILL_AFTER_S or name == claimant or wait.cut:
                continue
            past = over.get(name)
            if past is None:
                past = over[name] = shares.held(name) > shares.share(name, holder_weight)
            if claimant is not None and not past:
                continue
            rank = (past, waited)  # over its share first, then the longest wait
            if found is None or rank > found[0]:
                found = (rank, wait, name)
        if found is None:
            return False
        (past, waited), wait, name = found
        _name, _weight, token = self._calls.pop(wait)
        give_back(token)
        why = (
            f"tenant {name!r} held more than its share of {self._pool} while another caller "
            "wanted one"
            if past
            else f"an administrator's call wanted one of {self._pool}, all taken"
        )
        wait.cut_short(
            f"slot taken back after this call waited {waited:.1f} s on its client: {why}; "
            "send and read the call's messages as they come, or retry later"
        )
        return True
