"""Launcher replicas behind nginx (examples/nginx/nginx.conf), seen from outside.

Replicas A and B (B with --max-connection-age 2) and one nginx over both are
shared by the module and stay up for its whole run, so the tests pass in any
order. The drain test stops a replica of its own behind an nginx of its own
with A; the dead-replica test puts nginx over B and an address nobody listens
on.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import os
import re
import shutil
import signal
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import free_port, request
from support.launcher import EXAMPLES, START_TIMEOUT, children, launch

from vllm_servicer.proto import vllm_engine_pb2_grpc

TEMPLATE = EXAMPLES / "nginx" / "nginx.conf"
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"

pytestmark = [
    pytest.mark.skipif(not Path(NGINX).exists(), reason="nginx is not installed"),
    pytest.mark.timeout(START_TIMEOUT + 300),
]

GENERATE_OK = {"grpc_method": "Generate", "grpc_code": "OK"}


@dataclasses.dataclass
class Replica:
    proc: asyncio.subprocess.Process
    address: str
    metrics_url: str
    output: asyncio.Future[None]
    log: collections.deque[str]

    def log_tail(self) -> str:
        return "".join(self.log)


@dataclasses.dataclass
class Cluster:
    a: Replica
    b: Replica
    nginx: asyncio.subprocess.Process
    address: str
    prefix: Path


async def _launch(env: dict[str, str], *flags: str) -> Replica:
    """Start a launcher serving its metrics too; its output's last 2,000 lines kept."""
    served = await launch("--metrics-port", "0", *flags, env=env, keep=2000)
    assert served.reader is not None
    return Replica(served.proc, served.address, served.metrics_url, served.reader, served.output)


def _render(prefix: Path, listen: str, upstreams: list[str]) -> Path:
    servers = "\n        ".join(f"server {u} max_fails=1 fail_timeout=10s;" for u in upstreams)
    text = TEMPLATE.read_text().replace("@LISTEN@", listen).replace("@UPSTREAMS@", servers)
    conf = prefix / "nginx.conf"
    conf.write_text(text)
    return conf


async def _start_nginx(prefix: Path, upstreams: list[str]) -> tuple[Any, str]:
    port = free_port()
    conf = _render(prefix, f"127.0.0.1:{port}", upstreams)
    directives = f"daemon off; pid {prefix}/nginx.pid;"
    if os.geteuid() == 0:  # as root, workers would otherwise run as nobody
        directives += " user root;"
    proc = await asyncio.create_subprocess_exec(
        NGINX, "-p", str(prefix), "-c", str(conf), "-e", str(prefix / "error.log"), "-g", directives
    )
    deadline = time.monotonic() + 30
    while True:
        with contextlib.suppress(OSError):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return proc, f"127.0.0.1:{port}"
        if proc.returncode is not None or time.monotonic() > deadline:
            await _stop(proc, 10)
            raise AssertionError("nginx did not start:\n" + (prefix / "error.log").read_text())
        await asyncio.sleep(0.1)


async def _stop(proc: asyncio.subprocess.Process | None, timeout: float) -> None:
    """SIGTERM, then SIGKILL to the process and its descendants after `timeout` s."""
    if proc is None or proc.returncode is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), timeout)
    except TimeoutError:
        for pid in children(proc.pid) | {proc.pid}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        await asyncio.wait_for(proc.wait(), 30)


# Beyond the tiny model's 512 positions: streams that run until cancelled.
LONG_CONTEXT = ("--max-model-len", "65536")
LONG_CONTEXT_ENV = {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}


@pytest.fixture(scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Cluster]:
    env = {
        **os.environ,
        "VLLM_SERVICER_CACHE": str(tmp_path_factory.mktemp("cache")),
        **LONG_CONTEXT_ENV,
    }
    started = await asyncio.gather(
        _launch(env, *LONG_CONTEXT),
        _launch(env, *LONG_CONTEXT, "--max-connection-age", "2"),
        return_exceptions=True,
    )
    replicas = [r for r in started if isinstance(r, Replica)]
    nginx = None
    try:
        for r in started:
            if isinstance(r, BaseException):
                raise r
        a, b = replicas
        prefix = tmp_path_factory.mktemp("nginx")
        nginx, address = await _start_nginx(prefix, [a.address, b.address])
        yield Cluster(a, b, nginx, address, prefix)
    finally:
        await _stop(nginx, 10)
        # Their output is read until they exit: their engines share the pipe.
        await asyncio.gather(*(_stop(r.proc, 90) for r in replicas), return_exceptions=True)
        for r in replicas:
            r.output.cancel()


def _scrape(replica: Replica) -> list[Any]:
    with urllib.request.urlopen(replica.metrics_url, timeout=10) as reply:
        return list(text_string_to_metric_families(reply.read().decode()))


async def _metric(replica: Replica, sample: str, **labels: str) -> float:
    """Sum of the samples named `sample` whose labels include `labels`."""
    families = await asyncio.to_thread(_scrape, replica)
    return sum(
        s.value
        for f in families
        for s in f.samples
        if s.name == sample and labels.items() <= s.labels.items()
    )


async def _handled(replica: Replica) -> float:
    return await _metric(replica, "grpc_server_handled_total", **GENERATE_OK)


async def _settle(replicas: list[Replica], sample: str, expect: float, **labels: str) -> float:
    """Poll until the summed metric reaches `expect` (metrics land just after replies)."""
    deadline = time.monotonic() + 15
    while True:
        total = sum([await _metric(r, sample, **labels) for r in replicas])
        if total >= expect or time.monotonic() > deadline:
            return total
        await asyncio.sleep(0.1)


async def _unary(stub: Any, max_tokens: int = 4) -> grpc.StatusCode:
    call = stub.Generate(request(max_tokens=max_tokens), timeout=120)
    async for _ in call:
        pass
    return await call.code()


@dataclasses.dataclass
class _Progress:
    """A stream's tokens so far, seen while it runs."""

    tokens: int = 0
    started: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


async def _stream(stub: Any, max_tokens: int, progress: _Progress | None = None) -> Any:
    call = stub.Generate(request(stream=True, max_tokens=max_tokens, ignore_eos=True))
    tokens, chunks, finish = 0, 0, None
    async for message in call:
        if message.HasField("chunk"):
            tokens += len(message.chunk.token_ids)
            chunks += 1
            if progress is not None:
                progress.tokens = tokens
                progress.started.set()
        else:
            finish = message.complete.finish_reason
    return await call.code(), tokens, chunks, finish


async def test_calls_spread_over_both_replicas(cluster: Cluster) -> None:
    before = [await _handled(cluster.a), await _handled(cluster.b)]
    async with grpc.aio.insecure_channel(cluster.address) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        limit = asyncio.Semaphore(4)

        async def one() -> grpc.StatusCode:
            async with limit:
                return await _unary(stub)

        codes = await asyncio.gather(*(one() for _ in range(20)))
    assert codes == [grpc.StatusCode.OK] * 20
    await _settle(
        [cluster.a, cluster.b], "grpc_server_handled_total", sum(before) + 20, **GENERATE_OK
    )
    served = [await _handled(cluster.a) - before[0], await _handled(cluster.b) - before[1]]
    print(f"20 calls through nginx: replica A served {served[0]:.0f}, B {served[1]:.0f}")
    assert sum(served) == 20 and min(served) > 0, served


async def test_streaming_and_cancellation_pass_through(cluster: Cluster) -> None:
    both = [cluster.a, cluster.b]
    cancelled = sum(
        [
            await _metric(r, "vllm_servicer_request_cancelled_total", cause="client_cancel")
            for r in both
        ]
    )
    async with grpc.aio.insecure_channel(cluster.address) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        code, tokens, chunks, finish = await _stream(stub, 32)
        assert (code, tokens, finish) == (grpc.StatusCode.OK, 32, "length")
        assert chunks > 1, "the stream came through nginx in one piece"

        call = stub.Generate(request(stream=True, max_tokens=60_000, ignore_eos=True))
        received = 0
        async for message in call:
            received += message.HasField("chunk")
            if received == 3:
                break
        assert sum([await _metric(r, "vllm_servicer_requests_in_flight") for r in both]) == 1
        call.cancel()
    total = await _settle(
        both, "vllm_servicer_request_cancelled_total", cancelled + 1, cause="client_cancel"
    )
    assert total == cancelled + 1, "the client's cancel did not reach the replica"
    deadline = time.monotonic() + 15
    while sum([await _metric(r, "vllm_servicer_requests_in_flight") for r in both]) > 0:
        assert time.monotonic() < deadline, "the cancelled call stayed in flight"
        await asyncio.sleep(0.1)


class _TcpBalancer:
    """A connection-level (L4) round-robin balancer, like a TCP load balancer or DNS.

    It chooses a replica once per TCP connection, so an HTTP/2 channel stays on
    the replica it was first given until that connection ends.
    """

    def __init__(self, backends: list[str]) -> None:
        self.backends = backends
        self.chosen: list[str] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        backend = self.backends[len(self.chosen) % len(self.backends)]
        self.chosen.append(backend)
        host, port = backend.rsplit(":", 1)
        up_reader, up_writer = await asyncio.open_connection(host, int(port))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()


async def test_max_connection_age_moves_a_long_lived_channel(cluster: Cluster) -> None:
    """One channel through a per-connection balancer: B (age 2 s) first, then A.

    Without an age limit the channel would stay on its first replica for its
    whole life; B's GOAWAY after 2 s makes it reconnect, and the balancer's
    next choice (A, which has no age limit) keeps every later call.
    """
    balancer = _TcpBalancer([cluster.b.address, cluster.a.address])
    address = await balancer.start()
    phases: dict[str, list[float]] = {}
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            await asyncio.wait_for(channel.channel_ready(), 30)
            opened = time.monotonic()

            async def phase(name: str, until: float) -> None:
                a0, b0 = await _handled(cluster.a), await _handled(cluster.b)
                calls = 0
                while time.monotonic() - opened < until or calls == 0:
                    assert await _unary(stub, max_tokens=2) == grpc.StatusCode.OK
                    calls += 1
                await _settle(
                    [cluster.a, cluster.b],
                    "grpc_server_handled_total",
                    a0 + b0 + calls,
                    **GENERATE_OK,
                )
                phases[name] = [
                    calls,
                    await _handled(cluster.a) - a0,
                    await _handled(cluster.b) - b0,
                ]

            await phase("before", 1.5)  # inside the age
            await asyncio.sleep(max(0.0, 4.0 - (time.monotonic() - opened)))  # age + jitter
            await phase("after", 7.0)
    finally:
        await balancer.close()
    for name, (calls, on_a, on_b) in phases.items():
        print(f"{name} the age: {calls:.0f} calls, {on_a:.0f} on A, {on_b:.0f} on B")
    print(
        "connections the balancer saw:",
        ["A" if c == cluster.a.address else "B" for c in balancer.chosen],
    )
    calls, on_a, on_b = phases["before"]
    assert (on_a, on_b) == (0, calls), phases
    calls, on_a, on_b = phases["after"]
    assert (on_a, on_b) == (calls, 0), phases
    assert balancer.chosen[:2] == [cluster.b.address, cluster.a.address]


# The draining replica's drain timeout: its streams outlive it and are then aborted.
DRAIN_TIMEOUT = 8


@pytest.fixture
async def draining(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Replica]:
    """A replica of the drain test's own: the test stops it, the others live on."""
    env = {
        **os.environ,
        "VLLM_SERVICER_CACHE": str(tmp_path_factory.mktemp("cache")),
        **LONG_CONTEXT_ENV,
    }
    replica = await _launch(
        env, *LONG_CONTEXT, "--drain-grace", "1", "--shutdown-timeout", str(DRAIN_TIMEOUT)
    )
    try:
        yield replica
    finally:
        await _stop(replica.proc, 30)
        replica.output.cancel()


async def test_draining_replica_takes_no_new_calls_and_serves_its_streams(
    cluster: Cluster, draining: Replica, tmp_path: Path
) -> None:
    """SIGTERM to a replica behind nginx while it streams.

    Nothing here depends on how fast the machine generates: the streams go
    straight to the draining replica (so they are surely on it), the signal
    follows their first tokens, and they are longer than any drain, so they are
    still running when it refuses new calls (its log says how many) and run on
    until its drain timeout aborts them, which ends them with status OK.
    """
    d, a = draining, cluster.a
    nginx, address = await _start_nginx(tmp_path, [d.address, a.address])
    try:
        async with (
            grpc.aio.insecure_channel(d.address) as direct,
            grpc.aio.insecure_channel(address) as balanced,
        ):
            on_d = vllm_engine_pb2_grpc.VllmEngineStub(direct)
            stub = vllm_engine_pb2_grpc.VllmEngineStub(balanced)
            progress = [_Progress() for _ in range(3)]
            streams = [asyncio.ensure_future(_stream(on_d, 60_000, p)) for p in progress]
            await asyncio.wait_for(asyncio.gather(*(p.started.wait() for p in progress)), 120)
            d.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()

            # New calls through nginx during the drain, a steady trickle (the
            # streams share these cores with A): every one succeeds, and those
            # made after the grace are all served by A.
            new_calls: list[grpc.StatusCode] = []
            after_grace = 0
            a_at_grace: float | None = None
            tokens_at_grace: list[int] = []
            refusing_seen: float | None = None
            while not all(s.done() for s in streams) or d.proc.returncode is None:
                # "After the grace" is when the replica says it refuses new calls
                # (its signal handling may lag on a loaded machine), plus a moment
                # for its listener to close.
                if refusing_seen is None and "refusing new calls" in d.log_tail():
                    refusing_seen = time.monotonic()
                if (
                    a_at_grace is None
                    and refusing_seen is not None
                    and time.monotonic() - refusing_seen > 0.5
                ):
                    a_at_grace = await _handled(a)
                    tokens_at_grace = [p.tokens for p in progress]
                new_calls.append(await _unary(stub))
                after_grace += a_at_grace is not None
                assert time.monotonic() - signalled < 120, (
                    "the replica did not finish draining:\n" + d.log_tail()
                )
                await asyncio.sleep(0.05)
            ended = [s.result() for s in streams]
            drained = time.monotonic() - signalled
            assert a_at_grace is not None
            a_served = (
                await _settle(
                    [a], "grpc_server_handled_total", a_at_grace + after_grace, **GENERATE_OK
                )
                - a_at_grace
            )
    finally:
        await _stop(nginx, 10)
    tokens_at_end = [p.tokens for p in progress]
    print(
        f"drain: the replica exited {drained:.1f} s after the signal; its 3 streams had "
        f"{tokens_at_grace} tokens after the grace, {tokens_at_end} when aborted; "
        f"{len(new_calls)} new calls during the drain, {after_grace} after the grace, "
        f"{a_served:.0f} of those served by A"
    )
    assert await d.proc.wait() == 0, d.log_tail()
    log = d.log_tail()
    # The streams were running when new calls were refused (with, at times, a
    # short call that arrived during the grace and was still finishing), ran on
    # through the drain (not cut when the listener closed), and ended with their
    # "abort".
    waiting = re.search(r"waiting up to [\d.]+ s for (\d+) in flight", log)
    assert waiting is not None and int(waiting.group(1)) >= 3, log
    assert "aborting 3 calls still running (drain timeout)" in log, log
    for code, tokens, _, finish in ended:
        assert (code, finish) == (grpc.StatusCode.OK, "abort") and tokens > 0
    assert new_calls and set(new_calls) == {grpc.StatusCode.OK}, new_calls
    assert after_grace > 0 and a_served == after_grace, "the draining replica took new calls"


async def test_calls_keep_succeeding_when_a_replica_is_gone(
    cluster: Cluster, tmp_path: Path
) -> None:
    """nginx over B and an address that refuses connections (a replica that exited)."""
    gone = f"127.0.0.1:{free_port()}"
    nginx, address = await _start_nginx(tmp_path, [gone, cluster.b.address])
    before = await _handled(cluster.b)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            codes = [await _unary(stub) for _ in range(10)]
            code, tokens, _, _ = await _stream(stub, 16)
    finally:
        await _stop(nginx, 10)
    assert codes == [grpc.StatusCode.OK] * 10 and (code, tokens) == (grpc.StatusCode.OK, 16)
    assert (
        await _settle([cluster.b], "grpc_server_handled_total", before + 11, **GENERATE_OK)
        == before + 11
    )
