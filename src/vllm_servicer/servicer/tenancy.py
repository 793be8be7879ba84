"""Who owns what is running: request ids and per-caller shares.

vLLM aborts by the client's request id, every request under it at once, so a
running id belongs to the caller that started it: no other caller may run a
request under it, and Abort touches only the caller's own (an administrator's
touches any). KV-event streams are shared out the same way: no one caller can
take every slot. Callers are told apart by identity name (`context.tenant`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from typing import Any

from ..context import caller_name, tenant
from ..errors import RequestIdInUseError, TooManySubscribersError
from ..frontends import FrontendGroup
from ..options import DEFAULT_MAX_KV_SUBSCRIBERS

logger = logging.getLogger("vllm_servicer")

# Enough of an id to recognise it; a status message travels in the trailers.
_SHOWN_ID_CHARS = 128


def _take_one(counts: dict[str, int], key: str) -> None:
    """One `key` out of a multiset, dropping it at zero."""
    left = counts[key] - 1
    if left > 0:
        counts[key] = left
    else:
        del counts[key]


class RunningRequests:
    """The Generate and Embed requests running now, by request id, and whose each is.

    A multiset: a caller may reuse its own running id, as vLLM allows. Its
    size is what GetServerInfo reports without an in-flight count, its ids what
    a drain aborts.

    Args:
        group: with several frontend processes on one engine, their shared
            table: an id belongs to its caller in every process, and Abort
            reaches a request another process runs.
    """

    def __init__(self, group: FrontendGroup | None = None) -> None:
        self._counts: dict[str, int] = {}
        # The identity name (None: no credentials) each running id belongs to.
        self._owners: dict[str, str | None] = {}
        self._group = group

    def __len__(self) -> int:
        return sum(self._counts.values())

    @property
    def ids(self) -> list[str]:
        """The running request ids, each once."""
        return list(self._counts)

    def check(self, request_id: str, method: str) -> None:
        """Refuse `request_id` now if it runs for another caller; claims nothing.

        For a protocol that must answer before the request starts (the HTTP
        API's status line); `claim` checks again.

        Raises:
            RequestIdInUseError: the id runs for another caller.
        """
        owner = caller_name()
        if request_id in self._counts:
            taken = self._owners[request_id] != owner
        else:
            taken = self._group is not None and not self._group.free_for(request_id, owner)
        if taken:
            self._refuse(request_id, method)

    def claim(self, request_id: str, method: str) -> Claim:
        """Count `request_id` as running for the current caller: the one way any
        protocol (or the HTTP API) claims an id.

        Returns:
            The claim, to release however the request ends (`Claim.release`).

        Raises:
            RequestIdInUseError: the id runs for another caller, whatever the
                caller's roles: sharing it, either could abort the other's request.
        """
        owner = caller_name()
        running_here = request_id in self._counts
        if (running_here and self._owners[request_id] != owner) or (
            not running_here
            and self._group is not None
            and not self._group.claim(request_id, owner)
        ):
            self._refuse(request_id, method)
        self._counts[request_id] = self._counts.get(request_id, 0) + 1
        self._owners[request_id] = owner
        return Claim(self, request_id)

    @staticmethod
    def _refuse(request_id: str, method: str) -> None:
        shown = request_id[:_SHOWN_ID_CHARS] + ("..." if len(request_id) > _SHOWN_ID_CHARS else "")
        logger.info("%s request %r refused: its id is running for another caller", method, shown)
        raise RequestIdInUseError(
            f"request_id {shown!r} is already in use by a running request; choose another id"
        )

    def release(self, request_id: str) -> None:
        """One run of `request_id` ended."""
        _take_one(self._counts, request_id)
        if request_id not in self._counts:
            del self._owners[request_id]
            if self._group is not None:
                self._group.release(request_id)

    async def abort_cancelled(self, engine: Any, request_id: str) -> None:
        """Take a cancelled call's request out of `engine`; before its `release`.

        vLLM's `generate` and `encode` abort on a cancel only once the request
        is handed to the engine core: a cancel landing during the hand-over
        would leave it running to its end for no one, past the call's in-flight
        slot and adapter hold. vLLM aborts every request under an id, so an id
        the same caller also runs in another call is not aborted: that call's
        request would go too (its own request may then run on to its end).
        """
        if self._counts.get(request_id) == 1:
            try:
                await engine.abort([request_id])
            except Exception:  # a cancel stays a cancel (the engine died, say)
                logger.debug("abort of cancelled request %r failed", request_id, exc_info=True)

    def abortable(self, request_ids: Iterable[str]) -> list[str]:
        """Of `request_ids`, those the current caller may abort.

        A tenant stops only what it started: another's id is left out like an
        unknown one (no engine call, no error that would confirm it runs).
        """
        ids = [i for i in request_ids if i]
        owner = tenant()
        if owner is None:  # no credentials, or an administrator: any id
            return ids
        return [i for i in ids if self._owners.get(i) == owner]

    async def abort(self, engine: Any, request_ids: Iterable[str]) -> list[str]:
        """Abort those of `request_ids` the current caller may, wherever they run;
        the ids aborted in this process (unknown and others' ids: no error).
        """
        ids = list(dict.fromkeys(self.abortable(request_ids)))
        if ids:
            await engine.abort(ids)
        group = self._group
        if group is not None and group.abort_elsewhere is not None:
            owner = tenant()
            by_process: dict[int, list[str]] = {}
            for request_id in dict.fromkeys(request_ids):
                if request_id:
                    for index in group.running_elsewhere(request_id, owner):
                        by_process.setdefault(index, []).append(request_id)
            for index, elsewhere in by_process.items():
                await group.abort_elsewhere(index, elsewhere)
        return ids


class Claim:
    """One run of a request id, claimed for its caller by `RunningRequests.claim`.

    Every way in holds its engine requests' ids through one of these: the gRPC
    protocols' call frame (`engine_call.CallFrame`), Pooling's handlers
    (`vllm_app.ClaimingEngine`, one per text) and the HTTP API
    (`guard.EngineGuard`). Released once, whichever of its holders lets go first.
    """

    __slots__ = ("_running", "released", "request_id")

    def __init__(self, running: RunningRequests, request_id: str) -> None:
        self._running = running
        self.request_id = request_id
        self.released = False

    def release(self) -> None:
        """The run ended: its id is free for others once no run of it is left."""
        if not self.released:
            self.released = True
            self._running.release(self.request_id)

    async def cancelled(self, engine: Any) -> None:
        """The call running it was cancelled: its request leaves `engine`, wherever
        vLLM was in starting it (`RunningRequests.abort_cancelled`); nothing once
        released (the id may be another call's by then)."""
        if not self.released:
            await self._running.abort_cancelled(engine, self.request_id)


class SubscriberLimit:
    """Caps the SubscribeKvEvents streams open at once, in total and per caller.

    Without authentication every stream counts against `maximum` only. With it
    (an identity in `current_identity`), one identity may also hold at most
    `per_caller` of them, half of `maximum` rounded up: one key cannot take
    every slot and lock out another (a router that needs the events), however
    many streams it opens. Identities are told apart by name, as Abort tells
    them apart. Identities with `ADMIN_ROLE` are held to the total only: the
    operator may already change the server for everyone.

    Args:
        maximum: streams allowed at once; the next one gets RESOURCE_EXHAUSTED.
        group: with several frontend processes on one engine, their shared
            counts: the limits hold across the processes.
    """

    def __init__(
        self, maximum: int = DEFAULT_MAX_KV_SUBSCRIBERS, group: FrontendGroup | None = None
    ) -> None:
        if maximum < 1:
            raise ValueError(f"the subscriber limit must be at least 1, got {maximum}")
        self.maximum = maximum
        self.per_caller = (maximum + 1) // 2
        self._active = 0
        self._held: dict[str, int] = {}
        self._group = group

    @property
    def active(self) -> int:
        """Streams open now (in every frontend process)."""
        return self._active if self._group is None else self._group.streams

    def held_by(self, name: str) -> int:
        """Streams the identity called `name` holds now."""
        if self._group is not None:
            return self._group.streams_held_by(name)
        return self._held.get(name, 0)

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        """Holds one stream's place, for the calling identity, while the block runs.

        Raises:
            TooManySubscribersError: the caller holds `per_caller` streams
                already, or `maximum` streams are open in all.
        """
        name = tenant()
        with self._counting():
            self._admit(name)
            self._add(name, 1)
        try:
            yield
        finally:
            with self._counting():
                self._add(name, -1)

    def _counting(self) -> contextlib.AbstractContextManager[None]:
        """The group's lock (a check and its update as one step), or nothing."""
        return self._group.locked() if self._group is not None else contextlib.nullcontext()

    def _admit(self, name: str | None) -> None:
        # The caller's own share first: freeing others' streams would not admit it.
        if name is not None and self.held_by(name) >= self.per_caller:
            raise TooManySubscribersError(
                f"this caller holds {self.held_by(name)} KV-event subscriptions, the "
                f"per-caller limit is {self.per_caller} (half the server's {self.maximum}); "
                "close one of its streams"
            )
        if self.active >= self.maximum:
            raise TooManySubscribersError(
                f"{self.active} KV-event subscribers are connected, the total limit is "
                f"{self.maximum}; close one or raise the server's subscriber limit"
            )

    def _add(self, name: str | None, delta: int) -> None:
        if self._group is not None:
            self._group.add_stream(name, delta)
            return
        self._active += delta
        if name is not None:
            if delta > 0:
                self._held[name] = self.held_by(name) + delta
            else:
                _take_one(self._held, name)  # no entry outlives its identity's streams
