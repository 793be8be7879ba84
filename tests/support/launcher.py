"""Processes for the tests that run the launcher or an example as users run them.

Each is this venv's Python with the repository as its working directory, its
output (stdout and stderr together) on a pipe the test reads: `wait_for_line`
for a start-up line, `drain_output` for the rest, so it never blocks on a full
pipe. The engine a launcher starts runs in child processes of its own
(`children`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
START_TIMEOUT = 420
"""Seconds a launcher may take to serve: an engine start on a busy 2-core machine."""


async def spawn(
    *args: str, env: dict[str, str], new_session: bool = False
) -> asyncio.subprocess.Process:
    """`python *args` in the repository; `new_session`: a session and process group of its own."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        *args,
        cwd=ROOT,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=new_session,
    )


async def wait_for_line(proc: asyncio.subprocess.Process, pattern: str) -> re.Match[str]:
    """The first line of the process's output `pattern` finds; fail if it exits or stalls first."""
    assert proc.stdout is not None
    seen: list[str] = []

    async def scan() -> re.Match[str]:
        while line := (await proc.stdout.readline()).decode(errors="replace"):  # type: ignore[union-attr]
            seen.append(line)
            if match := re.search(pattern, line):
                return match
        raise AssertionError("process ended before it served:\n" + "".join(seen[-40:]))

    # The process may die while a child it started (an engine) keeps the pipe
    # open; its exit ends the wait too. (On Python 3.11 `proc.wait()` returns
    # only once the pipes close, so the exit is read from `returncode`.)
    found = asyncio.ensure_future(scan())
    exited = asyncio.ensure_future(exit_code(proc))
    try:
        await asyncio.wait(
            {found, exited}, timeout=START_TIMEOUT, return_when=asyncio.FIRST_COMPLETED
        )
        if not found.done() and exited.done():
            await asyncio.wait({found}, timeout=2)  # its last lines may still be in the pipe
        if found.done():
            return found.result()
        if exited.done():
            raise AssertionError(
                f"process exited ({proc.returncode}) before it served:\n" + "".join(seen[-40:])
            )
        raise AssertionError("no start-up line in time:\n" + "".join(seen[-40:]))
    finally:
        found.cancel()
        exited.cancel()


async def exit_code(proc: asyncio.subprocess.Process) -> int:
    """The process's exit status, whoever else still holds its pipes."""
    while proc.returncode is None:  # noqa: ASYNC110 - asyncio sets it on exit, signals nothing
        await asyncio.sleep(0.1)
    return proc.returncode


async def drain_output(
    proc: asyncio.subprocess.Process, tail: collections.deque[str] | None = None
) -> None:
    """Read a process's output so that it never blocks on a full pipe; keep its tail."""
    assert proc.stdout is not None
    while line := await proc.stdout.readline():
        if tail is not None:
            tail.append(line.decode(errors="replace"))


async def stop(proc: asyncio.subprocess.Process) -> int:
    """SIGTERM, then the exit status; killed (and the wait fails) after 60 s."""
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return await asyncio.wait_for(proc.wait(), 60)
    except TimeoutError:
        proc.kill()
        raise


def children(pid: int) -> set[int]:
    """Every descendant of a process (the engine core and worker processes)."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                kids = {int(k) for k in (task / "children").read_text().split()}
            except OSError:
                continue
            todo.extend(kids - found)
            found |= kids
    return found


def is_alive(pid: int) -> bool:
    """Whether the process runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


async def gone(pids: set[int], timeout: float) -> set[int]:
    """The processes of `pids` still alive after up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while (left := {p for p in pids if is_alive(p)}) and time.monotonic() < deadline:  # noqa: ASYNC110 - no event for another process's exit
        await asyncio.sleep(0.2)
    return left


async def stop_and_reap(proc: Any, output: Any, engine_processes: set[int]) -> None:
    """Kill a launcher and its engine processes; stop reading its output."""
    output.cancel()
    # Engine processes left behind hold the launcher's stdout open, and with it
    # proc.wait(): end them too.
    for pid in {proc.pid} | engine_processes:
        if is_alive(pid):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(proc.wait(), 30)
