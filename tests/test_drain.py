"""Graceful drain of the standalone launcher, observed from outside its process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.exceptions
import h2.settings
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from support import request
from support.launcher import (
    Launched,
    children,
    exit_code,
    gone,
    is_alive,
    launch,
    stop_and_reap,
)

from vllm_servicer.health import LIVENESS_SERVICE
from vllm_servicer.proto import vllm_engine_pb2_grpc


async def _launch(env: dict[str, str], *flags: str, session: bool = False) -> Launched:
    # A long context lets "long" streams outlast any drain timeout here.
    # `session`: its own session and process group, as a shell job or a service has.
    return await launch("--max-model-len", "65536", *flags, env=env, new_session=session)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {
        **os.environ,
        "VLLM_SERVICER_CACHE": str(tmp_path_factory.mktemp("cache")),
        "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1",
    }


async def _told(served: Launched, seconds: float = 60) -> str:
    """What the launcher said, once it exited (or `seconds` later): a failure's explanation."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(exit_code(served.proc), seconds)
    if served.reader is not None:
        # Engine processes may hold the pipe a moment longer.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(served.reader), 5)
    return f"launcher exit {served.proc.returncode}, its output:\n" + "".join(served.output)


async def _stream(stub: Any, max_tokens: int, started: asyncio.Event | None = None) -> Any:
    call = stub.Generate(request(stream=True, max_tokens=max_tokens, ignore_eos=True))
    tokens = 0
    finish = None
    async for message in call:
        if message.HasField("chunk"):
            tokens += len(message.chunk.token_ids)
            if started is not None:
                started.set()
        else:
            finish = message.complete.finish_reason
    return await call.code(), tokens, finish


async def test_sigterm_drains_then_aborts_stragglers(env: dict[str, str]) -> None:
    served = await _launch(env, "--shutdown-timeout", "4", "--drain-grace", "0.5")
    proc, address, output = served.proc, served.address, served.reader
    engine_processes = children(proc.pid)
    assert engine_processes, "the engine runs in child processes"
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            alive = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service=LIVENESS_SERVICE)
            )
            assert (await alive.read()).status == health_pb2.HealthCheckResponse.SERVING

            started = [asyncio.Event() for _ in range(34)]
            short = [asyncio.ensure_future(_stream(stub, 24, e)) for e in started[:32]]
            # Two streams that cannot finish inside the drain timeout.
            long = [asyncio.ensure_future(_stream(stub, 60_000, e)) for e in started[32:]]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)

            proc.send_signal(signal.SIGTERM)
            sent = time.perf_counter()
            # NOT_SERVING comes first, then, a grace later, the Watch stream ends
            # as the drain stops taking calls; the listener closes just after.
            # (How soon the signal is handled is the machine's; not timed here.)
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            flipped = time.perf_counter()
            assert await asyncio.wait_for(watch.read(), 60) == grpc.aio.EOF
            ended = time.perf_counter()
            # Liveness never left SERVING: its Watch just ends with the others.
            assert await asyncio.wait_for(alive.read(), 60) == grpc.aio.EOF
            print(
                f"NOT_SERVING {flipped - sent:.3f} s after SIGTERM, "
                f"Watch ended {ended - flipped:.3f} s later"
            )
            assert ended - flipped >= 0.4, "the Watch ended before the grace was over"
            await asyncio.sleep(0.5)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _stream(vllm_engine_pb2_grpc.VllmEngineStub(channel), 4)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE

            for code, tokens, finish in await asyncio.gather(*short):
                assert (code, tokens, finish) == (grpc.StatusCode.OK, 24, "length")
            for code, tokens, finish in await asyncio.gather(*long):
                assert code == grpc.StatusCode.OK and finish == "abort" and tokens > 0
        assert await asyncio.wait_for(proc.wait(), 60) == 0
        await asyncio.sleep(0.5)
        assert not [p for p in engine_processes if is_alive(p)], "engine processes left behind"
    finally:
        output.cancel()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_second_signal_exits_promptly(env: dict[str, str]) -> None:
    served = await _launch(env, "--shutdown-timeout", "120", "--drain-grace", "30")
    proc, address, output = served.proc, served.address, served.reader
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            started = asyncio.Event()
            running = asyncio.ensure_future(_stream(stub, 60_000, started))
            await asyncio.wait_for(started.wait(), 60)
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            sent = time.perf_counter()
            assert await asyncio.wait_for(proc.wait(), 30) == 0
            assert time.perf_counter() - sent < 20
            code, _, finish = await running
            assert code == grpc.StatusCode.OK and finish == "abort"
    finally:
        output.cancel()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_signal_to_the_whole_process_group_still_drains(
    env: dict[str, str], sig: signal.Signals
) -> None:
    """systemd's stop and Ctrl-C signal every process of the group, the engine's too."""
    served = await _launch(env, "--drain-grace", "0.5", session=True)
    proc, address, output = served.proc, served.address, served.reader
    engine_processes = children(proc.pid)
    try:
        for pid in engine_processes:
            # A process group apart (a group signal misses them), in the launcher's
            # session: Linux's autogroup scheduler shares the CPU between sessions,
            # and an engine in a session of its own starved the launcher's streams.
            assert os.getpgid(pid) != os.getpgid(proc.pid)
            assert os.getsid(pid) == os.getsid(proc.pid)
        async with grpc.aio.insecure_channel(address) as channel:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            started = [asyncio.Event() for _ in range(16)]
            streams = [asyncio.ensure_future(_stream(stub, 200, e)) for e in started]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            os.killpg(proc.pid, sig)
            sent = time.perf_counter()
            results = await asyncio.wait_for(asyncio.gather(*streams, return_exceptions=True), 90)
            completed = [r for r in results if r == (grpc.StatusCode.OK, 200, "length")]
            if len(completed) != 16:
                ended = time.perf_counter() - sent
                pytest.fail(
                    f"{len(completed)} of 16 completed, {ended:.1f} s after the signal: "
                    f"{results}\n{await _told(served)}"
                )
        code = await asyncio.wait_for(proc.wait(), 60)
        assert code == 0, await _told(served)
        assert not await gone(engine_processes, 10), "engine processes left behind"
    finally:
        await stop_and_reap(proc, output, engine_processes)


async def test_engine_processes_end_when_the_launcher_dies_hard(env: dict[str, str]) -> None:
    served = await _launch(env)
    proc, output = served.proc, served.reader
    engine_processes = children(proc.pid)
    try:
        assert engine_processes
        proc.kill()  # SIGKILL to the launcher alone: no drain, no engine shutdown
        assert not await gone(engine_processes, 30), "engine processes outlived the launcher"
    finally:
        await stop_and_reap(proc, output, engine_processes)


class _StuckWatch:
    """A raw HTTP/2 client that opens health Watch, grants no flow-control window and
    never reads a message: the server's first write on that stream can never complete."""

    def __init__(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        self._sock = socket.create_connection((host, int(port)))
        self._conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self._conn.initiate_connection()
        self._conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
        headers = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", "/grpc.health.v1.Health/Watch"),
            (":authority", address),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ]
        self._conn.send_headers(1, headers)
        # An empty HealthCheckRequest: uncompressed flag and a zero length.
        self._conn.send_data(1, b"\x00\x00\x00\x00\x00", end_stream=True)
        self._sock.sendall(self._conn.data_to_send())
        # Frames are still read so SETTINGS and PINGs are acknowledged (a silent
        # peer would be dropped by keepalive); WINDOW_UPDATE is never sent.
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            while data := self._sock.recv(65536):
                self._conn.receive_data(data)
                self._sock.sendall(self._conn.data_to_send())
        except (OSError, h2.exceptions.ProtocolError):
            pass

    def close(self) -> None:
        self._sock.close()


async def test_streams_that_never_end_do_not_hold_the_stop(env: dict[str, str]) -> None:
    """Open health Watch and reflection streams, and a Watch client that never reads (its
    SERVING can never be written), hold no call the drain waits for: the stop ends them
    all instead of waiting out the 30 s shutdown timeout."""
    served = await _launch(env, "--shutdown-timeout", "30", "--drain-grace", "0.5")
    proc, address, output = served.proc, served.address, served.reader
    engine_processes = children(proc.pid)
    stuck = _StuckWatch(address)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            asks: asyncio.Queue[Any] = asyncio.Queue()

            async def questions() -> Any:
                while (ask := await asks.get()) is not None:
                    yield ask

            reflection = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                questions()
            )
            await asks.put(reflection_pb2.ServerReflectionRequest(list_services=""))
            assert (await reflection.read()).list_services_response.service
            await asyncio.sleep(1.0)  # the server's write of SERVING to `stuck` is now blocked

            proc.send_signal(signal.SIGTERM)
            sent = time.perf_counter()
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert await asyncio.wait_for(proc.wait(), 60) == 0
            elapsed = time.perf_counter() - sent
            # Grace, the answers' flush (5 s at most, all of it for `stuck`) and the
            # engine's own stop (seconds on a loaded machine): well under the 30 s.
            assert elapsed < 20, f"stopped after {elapsed:.1f} s"
            assert await watch.read() == grpc.aio.EOF
        assert not await gone(engine_processes, 10), "engine processes left behind"
    finally:
        stuck.close()
        await stop_and_reap(proc, output, engine_processes)


def _engine_core(pid: int) -> int:
    """The launcher's EngineCore process."""
    for child in children(pid):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{child}/cmdline").read_bytes().startswith(b"VLLM::EngineCore"):
                return child
    raise AssertionError("no EngineCore process under the launcher")


@pytest.mark.parametrize("keep_alive", [False, True], ids=["exits", "keep-alive"])
async def test_a_dead_engine_ends_the_launcher(env: dict[str, str], keep_alive: bool) -> None:
    """As vLLM's HTTP server: once the engine died the process ends (non-zero), so a
    restart policy brings the server back; VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1 keeps it."""
    launch_env = {**env, "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH": "1" if keep_alive else "0"}
    served = await _launch(launch_env, "--drain-grace", "0.5")
    proc, address, output, tail = served.proc, served.address, served.reader, served.output
    engine_processes = children(proc.pid)
    try:
        os.kill(_engine_core(proc.pid), signal.SIGKILL)
        if not keep_alive:
            code = await asyncio.wait_for(proc.wait(), 60)
            lines = list(tail)
            assert code == 1, "".join(lines[-30:])
            assert any("engine died" in line for line in lines), "".join(lines[-30:])
            return
        async with grpc.aio.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for _ in range(100):
                reply = await health.Check(health_pb2.HealthCheckRequest(service=LIVENESS_SERVICE))
                if reply.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
                await asyncio.sleep(0.1)
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
            await asyncio.sleep(2.0)  # longer than the launcher's watch takes to act
            assert proc.returncode is None, "".join(list(tail)[-30:])
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 60) == 0
    finally:
        await stop_and_reap(proc, output, engine_processes)
