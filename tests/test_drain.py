"""Graceful drain of the standalone launcher, observed from outside its process."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import request
from test_examples import _drain_output, _spawn, _wait_for_line

from vllm_servicer.proto import vllm_engine_pb2_grpc


def _children(pid: int) -> set[int]:
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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


async def _launch(env: dict[str, str], *flags: str) -> tuple[Any, str]:
    # A long context lets "long" streams outlast any drain timeout here.
    proc = await _spawn(
        "-m", "vllm_servicer", "serve", "--port", "0", "--max-model-len", "65536", *flags, env=env
    )
    match = await _wait_for_line(proc, r"listening on (\S+:\d+)")
    return proc, match.group(1)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {
        **os.environ,
        "VLLM_SERVICER_CACHE": str(tmp_path_factory.mktemp("cache")),
        "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1",
    }


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
    proc, address = await _launch(env, "--shutdown-timeout", "4", "--drain-grace", "0.5")
    output = asyncio.ensure_future(_drain_output(proc))
    engine_processes = _children(proc.pid)
    assert engine_processes, "the engine runs in child processes"
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING

            started = [asyncio.Event() for _ in range(34)]
            short = [asyncio.ensure_future(_stream(stub, 24, e)) for e in started[:32]]
            # Two streams that cannot finish inside the drain timeout.
            long = [asyncio.ensure_future(_stream(stub, 60_000, e)) for e in started[32:]]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)

            proc.send_signal(signal.SIGTERM)
            sent = time.perf_counter()
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            flip = time.perf_counter() - sent
            assert flip < 0.1, f"health took {flip:.3f} s to turn NOT_SERVING"

            await asyncio.sleep(1.0)  # past the grace period: new calls are refused
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _stream(vllm_engine_pb2_grpc.VllmEngineStub(channel), 4)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE

            for code, tokens, finish in await asyncio.gather(*short):
                assert (code, tokens, finish) == (grpc.StatusCode.OK, 24, "length")
            for code, tokens, finish in await asyncio.gather(*long):
                assert code == grpc.StatusCode.OK and finish == "abort" and tokens > 0
        assert await asyncio.wait_for(proc.wait(), 60) == 0
        await asyncio.sleep(0.5)
        assert not [p for p in engine_processes if _alive(p)], "engine processes left behind"
    finally:
        output.cancel()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_second_signal_exits_promptly(env: dict[str, str]) -> None:
    proc, address = await _launch(env, "--shutdown-timeout", "120", "--drain-grace", "30")
    output = asyncio.ensure_future(_drain_output(proc))
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
