"""Probes: polling a condition, the requests an engine still holds, this process's memory."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


async def settle(predicate: Callable[[], object], timeout: float = 10.0) -> bool:
    """Poll `predicate` until it holds or `timeout` passes; return whether it holds.

    The engine's and servicer's counters expose no event to wait on, so poll.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate() and loop.time() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    return bool(predicate())


def note_releases(
    running: Any, seen: Callable[[str], int], monkeypatch: Any
) -> list[tuple[str, int]]:
    """Each id `running` (a `RunningRequests`) releases from now on, with what
    `seen(id)` read at that moment (the engine's unfinished requests, say)."""
    released: list[tuple[str, int]] = []
    release = running.release

    def noting(request_id: str) -> None:
        released.append((request_id, seen(request_id)))
        release(request_id)

    monkeypatch.setattr(running, "release", noting)
    return released


def hold_hand_over(engine: Any, marker: str, monkeypatch: Any) -> list[str]:
    """Each request whose engine id holds `marker` is handed to the engine core,
    then its hand-over is held open (30 s): the one await where a cancel finds
    vLLM's `generate` and `encode` with nothing to abort. The ids handed so far."""
    core = engine.engine_core
    hand_over = core.add_request_async
    handed: list[str] = []

    async def held(engine_request: Any) -> None:
        await hand_over(engine_request)
        if marker in engine_request.request_id:
            handed.append(engine_request.request_id)
            await asyncio.sleep(30)  # a cancel lands here

    monkeypatch.setattr(core, "add_request_async", held)
    return handed


def unfinished(engine: Any) -> int:
    """Requests the engine still holds (vLLM 0.32: the output processor's count)."""
    return int(engine.output_processor.get_num_unfinished_requests())


async def wait_until_idle(engine: Any, timeout: float = 10.0) -> int:
    """Poll until the engine holds no request; return what is left at the timeout."""
    await settle(lambda: not unfinished(engine), timeout)
    return unfinished(engine)


def rss_kb() -> int:
    """Resident memory of this process (server, servicer and engine frontend), in KiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS in /proc/self/status")  # pragma: no cover
