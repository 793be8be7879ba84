"""How the frontend processes on one engine reach each other: an abort for a
request another process runs, and each one's GetLoads figures.

vLLM's `AsyncLLM.abort` drops ids its own process did not start, so an Abort
that arrives at one process for a request another runs is handed over: each
process answers its peers on a Unix socket in the group's private directory.
The process the Abort arrived at has already authenticated the caller and
kept only the ids it may abort (`RunningRequests.abort`); its peer aborts
them. GetLoads merges every process's figures (`stats_tap.SchedulerStatsTap.window`).

What crosses the socket is data, one JSON line each way per connection (a
request, then its answer), never pickle: a reply is read as numbers and
strings whoever wrote it. Both ends check who is at the other end before
reading a byte (`SO_PEERCRED`): the same user, and a process the launcher
started (its parent is the launcher's). The directory's permissions (0700)
keep other users out first; the check also keeps out this user's other
processes, and a socket planted in the peer's place. Never on a public port.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import struct
from typing import Any, NamedTuple

from ..frontends import FrontendGroup
from ..load_reports import stats_tap

logger = logging.getLogger("vllm_servicer.serve")

__all__ = ["Peers", "peer_refusal", "start_peers"]

_TIMEOUT = 5.0  # seconds: a peer that does not answer is stopping or gone
# One line's bytes at most: an Abort's ids (the gRPC message limit is 32 MiB
# by default) with room for JSON's quoting.
_MAX_LINE = 80 * 1024 * 1024
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid
# The SchedulerStats fields GetLoads reads (servicer/loads.load_report); nothing else crosses.
_STATS_FIELDS = ("num_running_reqs", "num_waiting_reqs", "num_skipped_waiting_reqs")


class _PeerStats(NamedTuple):
    """The part of a peer's SchedulerStats that GetLoads reads."""

    num_running_reqs: int
    num_waiting_reqs: int
    num_skipped_waiting_reqs: int
    kv_cache_usage: float


def peer_refusal(sock: Any, group: FrontendGroup) -> str | None:
    """Why the process at the other end of `sock` is not a peer, or None if it is.

    A peer runs as this process's user and is a child of the launcher that
    started the group (`group.parent_pid`).
    """
    pid, uid, _ = _CREDENTIALS.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
    )
    if uid != os.geteuid():
        return f"pid {pid} runs as uid {uid}, not {os.geteuid()}"
    if _parent_of(pid) != group.parent_pid:
        return f"pid {pid} is not one of this launcher's frontends"
    return None


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as stat:
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
            return int(stat.read().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _windows_to_json(windows: dict[int, stats_tap.RankWindow]) -> dict[str, Any]:
    encoded: dict[str, Any] = {}
    for rank, window in windows.items():
        stats = window.stats
        encoded[str(rank)] = {
            "stats": None
            if stats is None
            else {
                **{name: int(getattr(stats, name, 0) or 0) for name in _STATS_FIELDS},
                "kv_cache_usage": float(stats.kv_cache_usage),
            },
            "stats_at": window.stats_at,
            "generated_tokens": window.generated_tokens,
            "prefix_queries": window.prefix_queries,
            "prefix_hits": window.prefix_hits,
        }
    return encoded


def _windows_from_json(encoded: dict[str, Any]) -> dict[int, stats_tap.RankWindow]:
    """A peer's windows, each figure converted to its type (ValueError, TypeError, KeyError)."""
    windows = {}
    for rank, window in encoded.items():
        stats = window["stats"]
        windows[int(rank)] = stats_tap.RankWindow(
            None
            if stats is None
            else _PeerStats(
                int(stats["num_running_reqs"]),
                int(stats["num_waiting_reqs"]),
                int(stats["num_skipped_waiting_reqs"]),
                float(stats["kv_cache_usage"]),
            ),
            float(window["stats_at"]),
            int(window["generated_tokens"]),
            int(window["prefix_queries"]),
            int(window["prefix_hits"]),
        )
    return windows


class Peers:
    """This process's side of the peers socket: its server, and calls to the others."""

    def __init__(self, group: FrontendGroup, engine: Any) -> None:
        self._group = group
        self._engine = engine
        self._tap = stats_tap.attach(engine)
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        """Listen on this process's socket; set `group.abort_elsewhere` and
        `group.loads_elsewhere` to reach the others."""
        path = self._path(self._group.index)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # left by a process of this index that ended
        self._server = await asyncio.start_unix_server(self._serve, path=path, limit=_MAX_LINE)
        self._group.abort_elsewhere = self.abort_elsewhere
        self._group.loads_elsewhere = self.loads_elsewhere

    async def stop(self, grace: float | None = None) -> None:
        """Stop answering peers (`grace` is accepted as grpc's `stop` takes it)."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def _path(self, index: int) -> str:
        return self._group.peer_address(index).removeprefix("unix:")

    # ----- answering ---------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            refusal = peer_refusal(writer.get_extra_info("socket"), self._group)
            if refusal is not None:
                logger.warning("peers socket: refused a connection: %s", refusal)
                return
            request = json.loads(await asyncio.wait_for(reader.readline(), _TIMEOUT))
            reply = await self._answer(request)
            writer.write(json.dumps(reply).encode() + b"\n")
            await writer.drain()
        except (TimeoutError, ValueError, TypeError, KeyError, OSError) as exc:
            # A peer that went away mid-call, or bytes that are not a request.
            logger.warning("peers socket: a request not answered: %r", exc)
        finally:
            writer.close()

    async def _answer(self, request: dict[str, Any]) -> dict[str, Any]:
        operation = request["op"]
        if operation == "abort":
            ids = request["ids"]
            if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
                raise TypeError("abort takes a list of request ids")
            await self._engine.abort(ids)
            return {}
        if operation == "loads":
            return {"windows": _windows_to_json(self._tap.window() if self._tap else {})}
        raise ValueError(f"unknown operation {operation!r}")

    # ----- asking ------------------------------------------------------------

    async def _ask(self, index: int, request: dict[str, Any]) -> dict[str, Any]:
        """Peer `index`'s answer to `request` (OSError, ValueError: none to be had)."""
        reader, writer = await asyncio.open_unix_connection(self._path(index), limit=_MAX_LINE)
        try:
            refusal = peer_refusal(writer.get_extra_info("socket"), self._group)
            if refusal is not None:
                # Its reply is not read: a planted socket's word is not a peer's.
                logger.warning("peers socket: frontend %d's socket refused: %s", index, refusal)
                raise PermissionError(refusal)
            writer.write(json.dumps(request).encode() + b"\n")
            await writer.drain()
            reply = json.loads(await reader.readline())
            if not isinstance(reply, dict):
                raise ValueError("the reply is not a JSON object")
            return reply
        finally:
            writer.close()

    async def abort_elsewhere(self, index: int, request_ids: list[str]) -> None:
        try:
            await asyncio.wait_for(self._ask(index, {"op": "abort", "ids": request_ids}), _TIMEOUT)
        except (TimeoutError, OSError, ValueError) as failed:
            # Abort is idempotent: a peer that is gone has no request left to stop.
            logger.warning("frontend %d did not take an abort: %r", index, failed)

    async def loads_elsewhere(self) -> list[dict[int, stats_tap.RankWindow]]:
        others = [i for i in range(self._group.count) if i != self._group.index]
        replies = await asyncio.gather(
            *(asyncio.wait_for(self._ask(i, {"op": "loads"}), _TIMEOUT) for i in others),
            return_exceptions=True,
        )
        windows = []
        for index, reply in zip(others, replies, strict=True):
            try:
                if isinstance(reply, BaseException):
                    raise reply
                windows.append(_windows_from_json(reply["windows"]))
            except (OSError, ValueError, TypeError, KeyError, AttributeError, TimeoutError) as exc:
                # A peer that does not answer is stopping: its figures are left out.
                logger.debug("frontend %d gave no loads: %r", index, exc)
        return windows


async def start_peers(group: FrontendGroup, engine: Any) -> Peers:
    """Answer this process's peers, and set `group.abort_elsewhere` to reach them."""
    peers = Peers(group, engine)
    await peers.start()
    return peers
