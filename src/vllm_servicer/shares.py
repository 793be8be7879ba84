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

Where the counts live is a `ShareBook`: this process's dictionaries
(`LocalBook`), or the shared memory of the frontend processes of
`--api-server-count` (`ShareRecords`, in `frontends.FrontendGroup`), so that a
share holds across the processes. The rule reads the book; the book only counts.

No grpc and no vLLM here; the pools' interceptors and the HTTP API's guard
ask one `FairShares` each.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import time
from collections.abc import Callable, Hashable, Iterable
from typing import Any, Protocol

from .errors import TableFullError

__all__ = [
    "DEFAULT_WANT_WINDOW",
    "FairShares",
    "LocalBook",
    "ShareBook",
    "ShareRecord",
    "ShareRecords",
    "WANTING_ONLY_RECORDS",
    "fair_share",
    "find_record",
    "record_key",
    "share_message",
]

WANTING_ONLY_RECORDS = 256
"""Records for identities that hold none of a shared pool but were refused
within the want window, beyond the one per holder (`ShareRecords`)."""

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


class ShareBook(Protocol):
    """Where one pool's per-identity counts live: what each identity holds, its
    weight, and until when one refused a slot counts as wanting the pool.

    The book counts and forgets; the rule (`FairShares`) is not its concern.
    A book shared by processes is read and written under their lock, which the
    pool's owner holds around each check and the count that follows it.
    """

    def key(self, name: str) -> Hashable:
        """How the book tells `name` apart in `wanting`'s answer."""
        ...

    def held(self, name: str) -> int:
        """Slots `name` holds now."""
        ...

    def wanting(self, now: float) -> dict[Hashable, float]:
        """Every identity that holds slots or wants them until after `now`, by
        `key`, with its weight; those that do neither any more are forgotten."""
        ...

    def add(self, name: str, weight: float, delta: int, now: float) -> None:
        """`name` took (`delta` 1) or let go of (-1) a slot."""
        ...

    def want(self, name: str, weight: float, until: float, now: float) -> None:
        """`name` wants the pool until `until` (monotonic seconds; `now` is now)."""
        ...


class LocalBook:
    """A `ShareBook` in this process's memory: one entry per identity that
    holds or wants the pool, forgotten once it does neither."""

    def __init__(self) -> None:
        self._held: dict[str, int] = {}
        self._weights: dict[str, float] = {}
        self._wanting_until: dict[str, float] = {}

    def key(self, name: str) -> Hashable:
        return name

    def held(self, name: str) -> int:
        return self._held.get(name, 0)

    def wanting(self, now: float) -> dict[Hashable, float]:
        weights = self._weights
        if not self._wanting_until:  # only holders: the usual case, kept cheap
            return {name: weights[name] for name in self._held}
        for name, until in list(self._wanting_until.items()):
            if until <= now:
                del self._wanting_until[name]
                if name not in self._held:
                    weights.pop(name, None)
        return {name: weights[name] for name in self._held.keys() | self._wanting_until}

    def add(self, name: str, weight: float, delta: int, now: float) -> None:
        left = self._held.get(name, 0) + delta
        if left > 0:
            self._held[name] = left
            if delta > 0:  # a slot given back says nothing of the weight
                self._weights[name] = weight
            return
        self._held.pop(name, None)
        if name not in self._wanting_until:
            self._weights.pop(name, None)

    def want(self, name: str, weight: float, until: float, now: float) -> None:
        self._wanting_until[name] = until
        self._weights[name] = weight


class ShareRecord(ctypes.Structure):
    """One identity's part of a pool in shared memory (`ShareRecords`)."""

    _fields_ = [
        ("key", ctypes.c_uint64),  # the identity's name, hashed (`_share_key`)
        ("held", ctypes.c_int64),  # engine slots it holds, in every process
        ("until", ctypes.c_double),  # monotonic time it wants the pool until
        ("weight", ctypes.c_double),
    ]


@functools.lru_cache(maxsize=4096)
def record_key(name: str, space: bytes) -> int:
    """`name`'s nonzero 64-bit key in a shared book's `space` (a BLAKE2b
    personalization; Python's own `hash` differs per process)."""
    digest = hashlib.blake2b(name.encode(), digest_size=8, person=space).digest()
    return int.from_bytes(digest, "little") or 1  # 0 marks a free record


def find_record(records: Any, used: Any, key: int) -> Any:
    """The record of `key` among the first `used.value` of `records`, or None."""
    for i in range(used.value):
        if records[i].key == key:
            return records[i]
    return None


def _share_key(name: str) -> int:
    return record_key(name, b"share-holders")


class ShareRecords:
    """`shares.ShareBook` in the group's shared memory: what each identity holds
    of the engine slots of all the processes, and until when it wants them.

    One record per identity that holds a slot or wants one, kept at the front
    of a fixed array (a record let go is filled with the last one), so reading
    the identities that want the pool walks those records only. The array has
    a record for every holder (at most the pool's size: each holds a slot)
    and `WANTING_ONLY_RECORDS` more; past those, the identity that only wants
    whose window ends first is forgotten first. Callers hold the group's lock
    around every method (`FrontendGroup.locked`).
    """

    def __init__(self, records: Any, used: Any) -> None:
        self._records = records
        self._used = used

    @property
    def capacity(self) -> int:
        """Identities the records can hold at once."""
        return len(self._records)

    def key(self, name: str) -> Hashable:
        return _share_key(name)

    def _find(self, key: int) -> Any:
        return find_record(self._records, self._used, key)

    def held(self, name: str) -> int:
        record = self._find(_share_key(name))
        return 0 if record is None else int(record.held)

    def wanting(self, now: float) -> dict[Hashable, float]:
        self._forget(now)
        records = self._records
        return {records[i].key: records[i].weight for i in range(self._used.value)}

    def add(self, name: str, weight: float, delta: int, now: float) -> None:
        key = _share_key(name)
        record = self._find(key)
        if record is None:
            if delta <= 0:
                return
            record = self._new(key, now)
        record.held += delta
        if delta > 0:  # a slot given back says nothing of the weight
            record.weight = weight
        if record.held <= 0 and record.until <= now:
            self._forget(now)

    def want(self, name: str, weight: float, until: float, now: float) -> None:
        key = _share_key(name)
        record = self._find(key)
        if record is None:
            record = self._new(key, now, holder=False)
            if record is None:
                return  # every record holds slots: the pool is full of holders
        record.until = until
        record.weight = weight

    def _forget(self, now: float) -> None:
        """Let go of the records of identities that neither hold nor want any more."""
        records, used = self._records, self._used
        i = 0
        while i < used.value:
            if records[i].held <= 0 and records[i].until <= now:
                used.value -= 1
                records[i] = records[used.value]
                records[used.value] = ShareRecord()
            else:
                i += 1

    def _new(self, key: int, now: float, *, holder: bool = True) -> Any:
        """A fresh record for `key`: a free one, else an identity's that only wants."""
        records, used = self._records, self._used
        if used.value == len(records):
            self._forget(now)
        if used.value == len(records):
            wanting_only = [i for i in range(used.value) if records[i].held <= 0]
            if not wanting_only:
                if holder:
                    raise TableFullError("every fair-share record holds engine slots")
                return None
            oldest = min(wanting_only, key=lambda i: records[i].until)
            used.value -= 1
            records[oldest] = records[used.value]
        record = records[used.value]
        record.key, record.held, record.until, record.weight = key, 0, 0.0, 1.0
        used.value += 1
        return record


class FairShares:
    """Per-identity counts of one pool's slots, and the fair share of each.

    The pool's total is its owner's to check (`InflightInterceptor`, the call
    cap): this class only says whether an identity is past its share, counts
    what each holds, and remembers who was refused a slot recently.

    Args:
        limit: the pool's size.
        book: where the counts live (default: this process's, `LocalBook`).
        window: seconds an identity refused for want of a slot counts as wanting.
        clock: the time source (monotonic seconds; the same in every process
            sharing a book).
    """

    def __init__(
        self,
        limit: int,
        *,
        book: ShareBook | None = None,
        window: float = DEFAULT_WANT_WINDOW,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if limit < 1:
            raise ValueError(f"a pool needs at least one slot, got {limit}")
        self.limit = limit
        self.book: ShareBook = LocalBook() if book is None else book
        self._window = window
        self._clock = clock

    def held(self, name: str) -> int:
        """Slots `name` holds now."""
        return self.book.held(name)

    def wanting(self) -> dict[Hashable, float]:
        """Every identity that wants the pool now (by the book's `key`), with its weight."""
        return self.book.wanting(self._clock())

    def share(self, name: str, weight: float = 1.0) -> int:
        """The share `name` is held to now, were it to ask for a slot."""
        wanting = self.wanting()
        wanting[self.book.key(name)] = weight
        return fair_share(self.limit, weight, wanting.values())

    def refusal(
        self, name: str | None, weight: float = 1.0, pool: str = "the slots", amount: int = 1
    ) -> str | None:
        """None when `name` may take `amount` more (slots, or tokens of a pool
        counted in tokens) under its share; else the refusal's text.

        Counts nothing (`take` does). None for a caller held to the total only.
        """
        if name is None:
            return None
        held = self.held(name)
        if held == 0:
            return None  # a share is one request at least
        wanting = self.wanting()
        wanting[self.book.key(name)] = weight
        share = fair_share(self.limit, weight, wanting.values())
        if held + amount <= share:
            return None
        return share_message(name, held, share, len(wanting), pool)

    def take(self, name: str | None, weight: float = 1.0, amount: int = 1) -> None:
        """`name` took `amount` (after `refusal` said it may)."""
        if name is not None:
            self.book.add(name, weight, amount, self._clock())

    def give_back(self, name: str | None, weight: float = 1.0, amount: int = 1) -> None:
        """`name` let `amount` go."""
        if name is not None:
            self.book.add(name, weight, -amount, self._clock())

    def wants(self, name: str | None, weight: float = 1.0) -> None:
        """`name` was refused for want of a free slot: it counts as wanting for `window` s."""
        if name is not None:
            now = self._clock()
            self.book.want(name, weight, now + self._window, now)
