"""Shutdown building blocks on their own: health state changes, drain waits, the hard stop."""

from __future__ import annotations

import asyncio
import functools
import shutil
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from grpc_health.v1 import health_pb2

from vllm_servicer import drain
from vllm_servicer.drain import GracefulShutdown
from vllm_servicer.health import LIVENESS_SERVICE, EngineHealthServicer
from vllm_servicer.interceptors import Call, InflightInterceptor

SRC = Path(__file__).resolve().parent.parent / "src" / "vllm_servicer"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class _StuckContext:
    """A Watch caller whose first write never completes (no flow-control window)."""

    def __init__(self) -> None:
        self.written: list[int] = []

    async def write(self, message: Any) -> None:
        self.written.append(message.status)
        await asyncio.Event().wait()  # never set: the write blocks like a zero window


class _Context:
    def __init__(self) -> None:
        self.written: list[int] = []
        self.wrote = asyncio.Event()

    async def write(self, message: Any) -> None:
        self.written.append(message.status)
        self.wrote.set()


def _health() -> EngineHealthServicer:
    return EngineHealthServicer(SimpleNamespace(errored=False), services=("", "x.Y"))


async def test_health_state_changes_never_wait_for_a_watch_write() -> None:
    health = _health()
    stuck = asyncio.ensure_future(health.Watch(health_pb2.HealthCheckRequest(), _StuckContext()))
    await asyncio.sleep(0.05)
    # A well-behaved watcher of the same service still gets its updates (each
    # wait a guard against a hang, generous for a busy machine: the steps take ms).
    context = _Context()
    watcher = asyncio.ensure_future(health.Watch(health_pb2.HealthCheckRequest(), context))
    await asyncio.wait_for(context.wrote.wait(), 10)
    context.wrote.clear()

    await asyncio.wait_for(health.start_draining(), 10)
    await asyncio.wait_for(health.set("x.Y", SERVING), 10)  # ignored once draining
    await asyncio.wait_for(context.wrote.wait(), 10)
    assert context.written == [SERVING, NOT_SERVING]

    # close() ends the watchers that can end; the stuck one is the server's to cancel.
    await asyncio.wait_for(health.close(), 10)
    await asyncio.wait_for(watcher, 10)
    assert not stuck.done()
    stuck.cancel()


async def test_check_reports_draining_and_unknown_services() -> None:
    health = _health()
    context = SimpleNamespace(abort=None)
    assert (await health.Check(health_pb2.HealthCheckRequest(service="x.Y"), context)).status == (
        SERVING
    )
    await health.enter_graceful_shutdown()
    assert (await health.Check(health_pb2.HealthCheckRequest(), context)).status == NOT_SERVING


async def test_liveness_stays_serving_through_a_drain_and_ends_with_the_engine() -> None:
    engine = SimpleNamespace(errored=False)
    health = EngineHealthServicer(engine, services=("", "x.Y"))  # type: ignore[arg-type]
    context = SimpleNamespace(abort=None)

    async def status(service: str) -> int:
        request = health_pb2.HealthCheckRequest(service=service)
        return (await health.Check(request, context)).status  # type: ignore[arg-type]

    assert [await status(s) for s in ("", "x.Y", LIVENESS_SERVICE)] == [SERVING] * 3
    await health.start_draining()
    # Not ready (take no new calls), still alive (do not restart mid-drain).
    assert [await status(s) for s in ("", "x.Y", LIVENESS_SERVICE)] == [
        NOT_SERVING,
        NOT_SERVING,
        SERVING,
    ]
    engine.errored = True
    assert await status(LIVENESS_SERVICE) == NOT_SERVING


async def _shutdown(active: int = 0) -> GracefulShutdown:
    """A drain over a real in-flight count holding `active` engine calls that never end."""
    inflight = InflightInterceptor()
    for _ in range(active):
        await inflight.on_start(
            Call("/vllm.grpc.engine.VllmEngine/Generate", "unary_stream", (), None)
        )
    mounted = SimpleNamespace(
        servicer=SimpleNamespace(active_requests=active), health=None, inflight=inflight
    )
    return GracefulShutdown(None, mounted)  # type: ignore[arg-type]


async def test_drain_waits_time_out_quietly_and_end_early_on_a_second_request() -> None:
    shutdown = await _shutdown(active=1)
    started = time.monotonic()
    await shutdown._wait(0.1)  # returns at the timeout, whatever TimeoutError is
    assert not await shutdown._wait_idle(0.1)
    # Returned at the timeouts: 0.2 s, and far from forever however busy the machine.
    assert 0.2 <= time.monotonic() - started < 5

    shutdown.request_stop()
    shutdown.request_stop()  # the second request cuts every wait short
    started = time.monotonic()
    await shutdown._wait(30)
    assert not await shutdown._wait_idle(30)
    assert time.monotonic() - started < 5  # not the 60 s the two waits would take


def test_hard_stop_fires_at_the_deadline_and_a_later_arm_only_shortens_it() -> None:
    fired = threading.Event()
    hard = drain.HardStop(fired.set)
    hard.arm(30)
    hard.arm(60)  # later deadlines do not extend the first
    hard.arm(0.2)
    started = time.monotonic()
    assert fired.wait(5)  # long before the 30 s of the first arm
    assert 0.15 <= time.monotonic() - started
    quiet = threading.Event()
    disarmed = drain.HardStop(quiet.set)
    disarmed.arm(0.1)
    disarmed.disarm()
    assert not quiet.wait(0.4)


@functools.cache
def _python310() -> str | None:
    """A Python 3.10 interpreter that runs (a pyenv shim on PATH may not)."""
    candidates = [str(p) for p in sorted(Path.home().glob(".pyenv/versions/3.10*/bin/python3.10"))]
    candidates.append(shutil.which("python3.10") or "")
    for python in filter(None, candidates):
        if subprocess.run([python, "-c", ""], capture_output=True).returncode == 0:
            return python
    return None


@pytest.mark.skipif(_python310() is None, reason="no Python 3.10 here")
def test_drain_waits_on_python_3_10() -> None:
    """On 3.10 asyncio's TimeoutError is its own class: the waits must still time out quietly."""
    script = (
        "import asyncio, importlib.util, sys, time, types\n"
        "spec = importlib.util.spec_from_file_location('drain', sys.argv[1])\n"
        "drain = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(drain)\n"
        "servicer = types.SimpleNamespace(active_requests=1)\n"
        "busy = types.SimpleNamespace(limited_total=1, wait_idle=lambda: asyncio.Event().wait())\n"
        "mounted = types.SimpleNamespace(servicer=servicer, health=None, inflight=busy)\n"
        "shutdown = drain.GracefulShutdown(None, mounted)\n"
        "asyncio.run(shutdown._wait(0.05))\n"
        "assert asyncio.run(shutdown._wait_idle(0.05)) is False\n"
        "print('ok')\n"
    )
    python = _python310()
    assert python is not None
    done = subprocess.run(
        [python, "-I", "-B", "-c", script, str(SRC / "drain.py")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
