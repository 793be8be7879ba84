"""What N serving processes on one engine share: who runs which request id,
the calls in flight and each tenant's part of them, the KV-event streams
open, the engine calls ended.

`serve --api-server-count N` starts N frontend processes, each an `AsyncLLM`
client of one engine core. A router's Abort often arrives on another
connection, so at another process, than the request it stops; a limit of M
calls in flight means M across the processes, not M in each. The parent
builds one `FrontendGroup` before it starts them and each process receives
it (multiprocessing hands the shared memory and the lock over at spawn).

The state lives in shared memory under one lock, not in a server process:
every Generate claims its id and every call counts in flight, so a round
trip to another process on each would cost more than the call's own work.
Written here because the standard library offers no shared dictionary
without such a server (`multiprocessing.Manager`). A table of fixed size
with open addressing holds 64-bit hashes of the keys (request ids, caller
names), never the strings: a collision between two live ids has odds of
about n²/2⁶⁵.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import multiprocessing
import os
import shutil
import signal
import tempfile
from collections.abc import Awaitable, Callable
from typing import Any

from .errors import TableFullError
from .fair_work import TagRecord, TagRecords
from .shares import WANTING_ONLY_RECORDS, ShareRecord, ShareRecords

__all__ = [
    "DEFAULT_CAPACITY",
    "REQUEST_IDS",
    "STREAM_COUNTERS",
    "FrontendGroup",
    "SharedTable",
    "TableFullError",
    "id_room",
    "key_hash",
    "owner_hash",
    "table_capacity",
]

# Slots of a table built without sizes (tests, a host's own group). The
# launcher sizes its table from the budgets instead (`table_capacity`).
DEFAULT_CAPACITY = 1 << 16
# The most of its slots the table fills: linear probing's chains stay short
# (a few slots on average) below it, under the lock every claim takes.
_FILL_NUMERATOR, _FILL_DENOMINATOR = 3, 4
# What a table is sized for when the in-flight limit is off (0).
_UNLIMITED_INFLIGHT_SIZED_AS = 1024
_WORDS = 3  # key hash, owner hash, value (a bit per process, or a count)
_EMPTY = 0
_NO_OWNER = 1  # a call without credentials


# The table's key spaces: a key is hashed with its space's name as BLAKE2b's
# personalization, so no string in one space (a request id, whatever its
# characters) hashes to a key of another (a caller's stream counter) but by a
# 64-bit accident.
REQUEST_IDS = b"request-id"
STREAM_COUNTERS = b"kv-subscribers"
# How many running ids each owner holds, keyed by the owner's hash.
CLAIM_COUNTERS = b"id-claims"

DEFAULT_SHARE_RECORDS = 1024 + WANTING_ONLY_RECORDS
"""Enough for the launcher's default `--max-inflight` (1024)."""


def key_hash(text: str, space: bytes = REQUEST_IDS) -> int:
    """A stable, nonzero 64-bit hash of `text` in key space `space` (Python's
    own `hash` differs per process)."""
    digest = hashlib.blake2b(text.encode(), digest_size=8, person=space).digest()
    value = int.from_bytes(digest, "little")
    return value if value > _NO_OWNER else value + 2


def owner_hash(name: str | None) -> int:
    return _NO_OWNER if name is None else key_hash(name)


def _claims_key(owner: int) -> int:
    return key_hash(f"{owner:x}", CLAIM_COUNTERS)


def id_room(max_inflight: int, ids_per_call: int) -> int:
    """The running ids the budgets allow at once: each call in flight with the
    most ids one call claims (a pooling call's texts, `max_pooling_inputs`)."""
    return (max_inflight or _UNLIMITED_INFLIGHT_SIZED_AS) * max(ids_per_call, 1)


def table_capacity(max_inflight: int, ids_per_call: int, streams: int) -> int:
    """Slots for what the budgets allow at once, twice over, within the fill limit.

    One identity may hold `id_room` ids (the whole in-flight limit's worth);
    the table takes that twice (so others still find room while it does),
    a counter per owner holding ids (each has a call in flight), and a
    counter per KV-event stream.

    Args:
        max_inflight: `--max-inflight` (0: no limit, sized as 1024).
        ids_per_call: the most ids one call claims (`max_pooling_inputs`).
        streams: `--max-kv-subscribers`.
    """
    owners = max_inflight or _UNLIMITED_INFLIGHT_SIZED_AS
    entries = 2 * id_room(max_inflight, ids_per_call) + owners + streams
    needed = -(-entries * _FILL_DENOMINATOR // _FILL_NUMERATOR)
    return max(1 << (needed - 1).bit_length(), 64)


class SharedTable:
    """A map from key hash to (owner hash, value) in shared memory; linear
    probing, deletion by backward shift (no tombstones to fill it up).
    Callers hold the group's lock around every method.

    Args:
        words: the slots (three words each).
        capacity: the number of slots, a power of two.
        used: the shared count of slots taken; None: counted here alone.
    """

    def __init__(self, words: Any, capacity: int, used: Any = None) -> None:
        self._words = words
        self._mask = capacity - 1
        self._used = used if used is not None else ctypes.c_int64(0)
        self.limit = capacity * _FILL_NUMERATOR // _FILL_DENOMINATOR

    @property
    def used(self) -> int:
        """Slots taken."""
        return int(self._used.value)

    def _find(self, key: int) -> tuple[int, bool]:
        """The slot holding `key`, or the empty slot where it would go."""
        words, mask = self._words, self._mask
        slot = key & mask
        for _ in range(mask + 1):
            stored = words[slot * _WORDS]
            if stored == key:
                return slot, True
            if stored == _EMPTY:
                return slot, False
            slot = (slot + 1) & mask
        raise TableFullError("the frontends' shared table is full")

    def get(self, key: int) -> tuple[int, int] | None:
        """(owner, value) stored under `key`, or None."""
        slot, found = self._find(key)
        if not found:
            return None
        base = slot * _WORDS
        return self._words[base + 1], self._words[base + 2]

    def put(self, key: int, owner: int, value: int) -> None:
        """Store (owner, value) under `key`; a value of 0 removes it.

        Raises:
            TableFullError: a new key, and the table holds its limit.
        """
        slot, found = self._find(key)
        if value == 0:
            if found:
                self._remove(slot)
                self._used.value -= 1
            return
        if not found:
            if self._used.value >= self.limit:
                raise TableFullError(
                    f"the frontends' shared table of running ids is full ({self.limit} "
                    "entries); try again when requests end"
                )
            self._used.value += 1
        base = slot * _WORDS
        self._words[base] = key
        self._words[base + 1] = owner
        self._words[base + 2] = value

    def _remove(self, slot: int) -> None:
        words, mask = self._words, self._mask
        hole = slot
        probe = (slot + 1) & mask
        while words[probe * _WORDS] != _EMPTY:
            home = words[probe * _WORDS] & mask
            # Move the entry back into the hole unless its home lies between
            # the hole and it (cyclically): then it is already reachable.
            if (probe - home) & mask >= (probe - hole) & mask:
                words[hole * _WORDS : hole * _WORDS + _WORDS] = words[
                    probe * _WORDS : probe * _WORDS + _WORDS
                ]
                hole = probe
            probe = (probe + 1) & mask
        words[hole * _WORDS : hole * _WORDS + _WORDS] = [0] * _WORDS


class FrontendGroup:
    """The N frontend processes' shared state, and which of them this one is.

    Built once by the parent before the processes start; each receives a
    copy (pickled at spawn) and calls `join(index)` first.

    Args:
        count: the number of frontend processes.
        capacity: slots in the shared table (a power of two; `table_capacity`).
        claims_per_owner: the most running ids one owner (an identity, or the
            callers without credentials together) holds at once; None: a
            quarter of the table's limit, so that no one owner fills it.
        share_records: identities the fair shares of the engine slots can
            count at once (`ShareRecords`): the pool's size (`--max-inflight`)
            and `WANTING_ONLY_RECORDS` more.
    """

    def __init__(
        self,
        count: int,
        capacity: int = DEFAULT_CAPACITY,
        claims_per_owner: int | None = None,
        share_records: int = DEFAULT_SHARE_RECORDS,
    ) -> None:
        if count < 1:
            raise ValueError(f"a frontend group needs at least one process, got {count}")
        if capacity & (capacity - 1):
            raise ValueError(f"the table's capacity must be a power of two, got {capacity}")
        ctx = multiprocessing.get_context("spawn")
        self.count = count
        self.index = -1
        self.parent_pid = os.getpid()
        self._capacity = capacity
        self._lock = ctx.Lock()
        self._words = ctx.RawArray(ctypes.c_uint64, _WORDS * capacity)
        self._used = ctx.RawValue(ctypes.c_int64, 0)
        # Per process, so a process that is gone can be zeroed: limited calls
        # in flight, KV-event streams open.
        self._inflight = ctx.RawArray(ctypes.c_int64, count)
        self._streams = ctx.RawArray(ctypes.c_int64, count)
        # Each identity's part of the engine slots (shares.py's rule reads it).
        self._share_records = ctx.RawArray(ShareRecord, max(1, share_records))
        self._share_used = ctx.RawValue(ctypes.c_int64, 0)
        # The engine's work by what each tenant brings (fair_work.py): the fair
        # order's counters and frontier, the prompt tokens waiting for prefill
        # and each tenant's part of them.
        self._tag_records = ctx.RawArray(TagRecord, max(1, share_records))
        self._tag_used = ctx.RawValue(ctypes.c_int64, 0)
        self._frontier = ctx.RawValue(ctypes.c_double, 0.0)
        self._token_records = ctx.RawArray(ShareRecord, max(1, share_records))
        self._token_used = ctx.RawValue(ctypes.c_int64, 0)
        self.queued_prompt_tokens = ctx.RawValue(ctypes.c_int64, 0)
        # Engine calls ended in each process, and how many failed: the rates
        # a load report gives for the engine as a whole (load_reports.report.CallRates).
        # Each process adds to its own slot only, so no lock is taken.
        self._ended = ctx.RawArray(ctypes.c_int64, count)
        self._failed = ctx.RawArray(ctypes.c_int64, count)
        # Set by the parent when the engine core's process ends: a client of
        # an engine it did not start cannot see that process.
        self._engine_dead = ctx.RawValue(ctypes.c_bool, False)
        # Where each process listens for its peers (private, 0700).
        self.directory = tempfile.mkdtemp(prefix="vllm-servicer-frontends-")
        self._table = SharedTable(self._words, capacity, self._used)
        if claims_per_owner is None:
            claims_per_owner = max(self._table.limit // 4, 1)
        if claims_per_owner < 1:
            raise ValueError(f"an owner's claims must be at least 1, got {claims_per_owner}")
        self.claims_per_owner = claims_per_owner
        self._books()
        # Set in each process by the launcher (serve/peers.py): send an abort
        # to a peer; fetch the others' GetLoads figures.
        self.abort_elsewhere: Callable[[int, list[str]], Awaitable[None]] | None = None
        self.loads_elsewhere: Callable[[], Awaitable[list[Any]]] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_table"], state["_shares"], state["tag_book"], state["token_book"]
        del state["abort_elsewhere"], state["loads_elsewhere"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._table = SharedTable(self._words, self._capacity, self._used)
        self._books()
        self.abort_elsewhere = None
        self.loads_elsewhere = None

    def _books(self) -> None:
        self._shares = ShareRecords(self._share_records, self._share_used)
        # The fair order's counters (`fair_work.FairOrder`), under `locked()`.
        self.tag_book = TagRecords(self._tag_records, self._tag_used, self._frontier)
        # Each tenant's prompt tokens waiting for prefill (`fair_work.QueuedPrompts`).
        self.token_book = ShareRecords(self._token_records, self._token_used)

    def join(self, index: int) -> None:
        """Become process `index` of the group."""
        if not 0 <= index < self.count:
            raise ValueError(f"frontend index {index} is outside 0..{self.count - 1}")
        self.index = index

    def peer_address(self, index: int) -> str:
        """The gRPC address process `index` answers its peers on."""
        return f"unix:{os.path.join(self.directory, f'frontend-{index}.sock')}"

    @property
    def engine_dead(self) -> bool:
        """Whether the parent saw the engine core's process end."""
        return bool(self._engine_dead.value)

    def engine_died(self) -> None:
        """The parent's notice to every frontend that the engine core is gone."""
        self._engine_dead.value = True

    def stop_all(self) -> None:
        """Ask the parent to drain every process and stop the engine (as SIGTERM does)."""
        os.kill(self.parent_pid, signal.SIGTERM)

    def remove_directory(self) -> None:
        """The parent's cleanup once every process has ended."""
        shutil.rmtree(self.directory, ignore_errors=True)

    # ----- running request ids -----------------------------------------------

    def claim(self, request_id: str, owner: str | None) -> bool:
        """Mark `request_id` running here for `owner`; False if another owner runs it.

        Raises:
            TableFullError: the id is new and `owner` holds `claims_per_owner`
                ids already, or the table is full.
        """
        key, who, bit = key_hash(request_id), owner_hash(owner), 1 << self.index
        with self._lock:
            table = self._table
            stored = table.get(key)
            if stored is None:
                counter = _claims_key(who)
                held = table.get(counter)
                count = 0 if held is None else held[1]
                if count >= self.claims_per_owner:
                    raise TableFullError(
                        f"this caller runs {count} request ids across the frontend processes, "
                        f"its most ({self.claims_per_owner}: the shared table is sized from "
                        "--max-inflight and --max-pooling-inputs); try again when some end"
                    )
                table.put(counter, who, count + 1)
                try:
                    table.put(key, who, bit)
                except TableFullError:
                    table.put(counter, who, count)
                    raise
                return True
            if stored[0] != who:
                return False
            table.put(key, who, stored[1] | bit)
            return True

    def claims_held_by(self, owner: str | None) -> int:
        """The running ids `owner` holds across the processes."""
        with self._lock:
            stored = self._table.get(_claims_key(owner_hash(owner)))
        return 0 if stored is None else stored[1]

    @property
    def entries(self) -> int:
        """The table's slots taken (ids, owners' and streams' counters)."""
        return self._table.used

    def free_for(self, request_id: str, owner: str | None) -> bool:
        """Whether `owner` may run `request_id` now (no one else runs it anywhere)."""
        with self._lock:
            stored = self._table.get(key_hash(request_id))
        return stored is None or stored[0] == owner_hash(owner)

    def release(self, request_id: str) -> None:
        """`request_id` no longer runs in this process."""
        key, bit = key_hash(request_id), 1 << self.index
        with self._lock:
            table = self._table
            stored = table.get(key)
            if stored is None:
                return
            left = stored[1] & ~bit
            table.put(key, stored[0], left)
            if left == 0:
                # The id is gone from every process: one fewer for its owner.
                counter = _claims_key(stored[0])
                held = table.get(counter)
                if held is not None:
                    table.put(counter, held[0], held[1] - 1)

    def running_elsewhere(self, request_id: str, owner: str | None) -> list[int]:
        """The other processes running `request_id` for `owner` (None: for anyone)."""
        with self._lock:
            stored = self._table.get(key_hash(request_id))
        if stored is None or (owner is not None and stored[0] != owner_hash(owner)):
            return []
        return [i for i in range(self.count) if i != self.index and stored[1] >> i & 1]

    # ----- counts ------------------------------------------------------------

    def locked(self) -> contextlib.AbstractContextManager[Any]:
        """The group's lock, to hold for a check and an update that must be one step."""
        return self._lock

    @property
    def inflight(self) -> int:
        """Limited calls in flight in all the processes."""
        return sum(self._inflight)

    def add_inflight(self, delta: int) -> None:
        """Call under `locked()` when it follows a check; alone otherwise."""
        self._inflight[self.index] += delta

    def share_book(self) -> ShareRecords:
        """Each identity's part of the engine slots, for `shares.FairShares`;
        read and written under `locked()`."""
        return self._shares

    def count_ended(self, failed: bool) -> None:
        """One engine call ended in this process (`failed`: with an error status)."""
        self._ended[self.index] += 1
        if failed:
            self._failed[self.index] += 1

    @property
    def ended(self) -> tuple[int, int]:
        """Engine calls ended in all the processes so far, and how many failed."""
        return sum(self._ended), sum(self._failed)

    @property
    def streams(self) -> int:
        """KV-event streams open in all the processes."""
        return sum(self._streams)

    def streams_held_by(self, name: str) -> int:
        stored = self._table.get(key_hash(name, STREAM_COUNTERS))
        return 0 if stored is None else stored[1]

    def add_stream(self, name: str | None, delta: int) -> None:
        """Count a stream opened (+1) or closed (-1); call under `locked()`."""
        self._streams[self.index] += delta
        if name is not None:
            key = key_hash(name, STREAM_COUNTERS)
            self._table.put(key, _NO_OWNER, self.streams_held_by(name) + delta)
