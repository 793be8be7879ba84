"""Processes for the tests that run the launcher or an example as users run them.

Each is this venv's Python with the repository as its working directory, its
output (stdout and stderr together) on a pipe the test reads: `wait_for_line`
for a start-up line, `drain_output` for the rest, so it never blocks on a full
pipe. The engine a launcher starts runs in child processes of its own
(`children`).

`launched` is a launcher as users start it, from start-up to a clean stop:
`async with launched("--http-port", "0", env=launcher_env(tmp)) as served:`
gives every address it announced (`served.address`, `served.http_url`, ...).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import re
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
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
    return (await wait_for_lines(proc, {"line": pattern}))["line"]


async def wait_for_lines(
    proc: asyncio.subprocess.Process, patterns: dict[str, str]
) -> dict[str, re.Match[str]]:
    """The first line each of `patterns` finds, in whatever order they come;
    fail if the process exits or stalls before all are found."""
    assert proc.stdout is not None
    seen: list[str] = []

    async def scan() -> dict[str, re.Match[str]]:
        found: dict[str, re.Match[str]] = {}
        while line := (await proc.stdout.readline()).decode(errors="replace"):  # type: ignore[union-attr]
            seen.append(line)
            for name, pattern in patterns.items():
                if name not in found and (match := re.search(pattern, line)):
                    found[name] = match
            if len(found) == len(patterns):
                return found
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


ANNOUNCED = {
    "address": ("--port", r"listening on (\S+:\d+)"),
    "http_url": ("--http-port", r"http on (http://\S+:\d+)"),
    "metrics_url": ("--metrics-port", r"metrics on (http://\S+/metrics)"),
    "probe_address": ("--health-port", r"health \(plaintext\) on (\S+:\d+)"),
    "pids": ("--api-server-count", r"frontends: \d+ processes, pids ([\d ]+)"),
}
"""What the launcher announces at start-up, and the flag that makes it announce it."""


@dataclass
class Launched:
    """A launcher serving: its process, what it announced, the other start-up lines
    waited for (`said`, by name), its output's tail."""

    proc: asyncio.subprocess.Process
    address: str
    http_url: str = ""
    metrics_url: str = ""
    probe_address: str = ""
    pids: tuple[int, ...] = ()
    said: dict[str, re.Match[str]] = field(default_factory=dict)
    output: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=400))
    reader: asyncio.Future[None] | None = field(default=None, repr=False)

    @property
    def port(self) -> int:
        """The gRPC port (`address`'s)."""
        return int(self.address.rsplit(":", 1)[1])


def launcher_env(
    cache: Path, *, drop: Iterable[str] = ("OTEL_", "VLLM_API_KEY"), **extra: str
) -> dict[str, str]:
    """This process's environment for a launcher: its own cache directory, without
    the variables in `drop` (prefixes) that would change what it serves."""
    prefixes = tuple(drop)
    env = {k: v for k, v in os.environ.items() if not (prefixes and k.startswith(prefixes))}
    return {**env, "VLLM_SERVICER_CACHE": str(cache), **extra}


async def launch(
    *flags: str,
    env: dict[str, str],
    new_session: bool = False,
    lines: dict[str, str] | None = None,
    keep: int | None = 400,
) -> Launched:
    """`python -m vllm_servicer serve --port 0 *flags`, once it serves (its output
    then read into `output`, the last `keep` lines, every one with None;
    `stop_launched` ends it). `lines`: start-up lines to wait for besides what it
    announces, each pattern by name; their matches are in `said`.

    Without `--drain-grace` in `flags` the launcher gets `--drain-grace 0`: its
    stop then skips the readiness grace (2 s by default), which only a balancer's
    probes could see; the tests that watch a drain name the grace they watch."""
    grace = () if "--drain-grace" in flags else ("--drain-grace", "0")
    proc = await spawn(
        "-m", "vllm_servicer", "serve", "--port", "0", *grace, *flags,
        env=env, new_session=new_session,
    )  # fmt: skip
    given = list(flags)
    # One process (--api-server-count 1) announces no frontends.
    if "--api-server-count" in given and given[given.index("--api-server-count") + 1] == "1":
        given.remove("--api-server-count")
    wanted = {
        name: pattern
        for name, (flag, pattern) in ANNOUNCED.items()
        if name == "address" or flag in given
    }
    extra = {f"said:{name}": pattern for name, pattern in (lines or {}).items()}
    try:
        found = await wait_for_lines(proc, {**wanted, **extra})
    except BaseException:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        raise
    announced = {name: found[name].group(1) for name in wanted}
    pids = tuple(int(p) for p in announced.pop("pids", "").split())
    said = {name: found[f"said:{name}"] for name in lines or {}}
    served = Launched(proc, pids=pids, said=said, **announced)
    served.output = collections.deque(maxlen=keep)
    served.reader = asyncio.ensure_future(drain_output(proc, served.output))
    return served


async def stop_launched(served: Launched, *, expect: int | None = 0) -> int:
    """SIGTERM, the exit status (asserted `expect` unless None), the output read to its end."""
    try:
        code = await stop(served.proc)
    finally:
        if served.proc.returncode is None:
            served.proc.kill()
            await served.proc.wait()
    if served.reader is not None:
        # Engine processes may hold the pipe a moment longer: read what they said.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(served.reader), 5)
        served.reader.cancel()
    if expect is not None:
        assert code == expect, "".join(served.output)
    return code


@contextlib.asynccontextmanager
async def launched(
    *flags: str,
    env: dict[str, str],
    new_session: bool = False,
    expect: int | None = 0,
    lines: dict[str, str] | None = None,
) -> AsyncIterator[Launched]:
    """A launcher from start-up to its stop, whose exit status must be `expect`
    (`lines` as `launch` takes them)."""
    served = await launch(*flags, env=env, new_session=new_session, lines=lines)
    try:
        yield served
    finally:
        await stop_launched(served, expect=expect)


@contextlib.contextmanager
def taken_port() -> Iterator[int]:
    """A loopback port something listens on, for as long as the block runs."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


async def serve_to_end(*flags: str, timeout: float = 120) -> tuple[int, str]:
    """`python -m vllm_servicer serve *flags` run until it exits by itself (a
    launcher that refuses to start): its exit status and its output."""
    proc = await spawn("-m", "vllm_servicer", "serve", *flags, env=dict(os.environ))
    try:
        output, _ = await asyncio.wait_for(proc.communicate(), timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    assert proc.returncode is not None
    return proc.returncode, output.decode(errors="replace")


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


def named(pids: set[int]) -> dict[int, str]:
    """Each of `pids` with its command line, to say which process a test found alive."""
    names = {}
    for pid in pids:
        try:
            names[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            names[pid] = "(gone)"
    return names


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
