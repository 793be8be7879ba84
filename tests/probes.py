"""Probes for the reliability tests: polling a condition, and this process's memory."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def settle(predicate: Callable[[], object], timeout: float = 10.0) -> bool:
    """Poll `predicate` until it holds or `timeout` passes; return whether it holds.

    The engine's and servicer's counters expose no event to wait on, so poll.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate() and loop.time() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    return bool(predicate())


def rss_kb() -> int:
    """Resident memory of this process (server, servicer and engine frontend), in KiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS in /proc/self/status")  # pragma: no cover
