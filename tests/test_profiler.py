"""StartProfile and StopProfile on a launcher started with vLLM's torch profiler.

The profiler runs, and writes its traces, in the launcher's own processes (the
launcher and its engine core), never in the test process: torch's trace export
crashing shows here as a failed test with the launcher's output, not as the end
of the test run. One launcher serves the whole module, started with an admin key
and an inference key from the environment (keys on the command line would be in
the process list).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2 as ref_common
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as ref_grpc
from support import bearer, collect, request
from support.launcher import (
    START_TIMEOUT,
    children,
    exit_code,
    gone,
    launch,
    launcher_env,
    stop_and_reap,
)

from vllm_servicer.proto import common_pb2, vllm_engine_pb2_grpc
from vllm_servicer.serve.args import ADMIN_KEY_ENV, API_KEY_ENV

ADMIN = "admin-0123456789abcdefABCDEF"
TENANT = "tenant-0123456789abcdefABCDEF"

pytestmark = [
    # A test here may wait START_TIMEOUT for the launcher; the suite's default would cut it short.
    pytest.mark.timeout(START_TIMEOUT + 180),
    # The last test stops the module's launcher, so the order in the file is kept.
    pytest.mark.random_order(disabled=True),
]


@dataclasses.dataclass
class Launcher:
    proc: asyncio.subprocess.Process
    address: str
    traces: Path
    engine_processes: set[int]
    tail: collections.deque[str]
    channel: grpc.aio.Channel

    def output(self) -> str:
        return "launcher output (last lines):\n" + "".join(self.tail)

    @contextlib.contextmanager
    def explained(self) -> Iterator[None]:
        """Fail with the launcher's output when a call or an assertion does."""
        try:
            yield
        except (AssertionError, pytest.fail.Exception, grpc.aio.AioRpcError) as err:
            raise AssertionError(f"{err}\n{self.output()}") from err

    def trace_files(self) -> set[Path]:
        return {p for p in self.traces.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
async def launcher(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Launcher]:
    traces = tmp_path_factory.mktemp("profiler") / "traces"
    keys = {ADMIN_KEY_ENV: ADMIN, API_KEY_ENV: TENANT}
    env = launcher_env(tmp_path_factory.mktemp("cache"), **keys)
    config = json.dumps({"profiler": "torch", "torch_profiler_dir": str(traces)})
    served = await launch("--profiler-config", config, env=env)
    engine_processes = children(served.proc.pid)
    try:
        async with grpc.aio.insecure_channel(served.address) as channel:
            yield Launcher(
                served.proc, served.address, traces, engine_processes, served.output, channel
            )
    finally:
        await stop_and_reap(
            served.proc, served.reader, engine_processes | children(served.proc.pid)
        )


def _stub(channel: grpc.aio.Channel, kind: str) -> tuple[Any, Any]:
    if kind == "own":
        return vllm_engine_pb2_grpc.VllmEngineStub(channel), common_pb2
    return ref_grpc.VllmEngineStub(channel), ref_common


async def _generate(launcher: Launcher) -> None:
    stub = vllm_engine_pb2_grpc.VllmEngineStub(launcher.channel)
    messages = await collect(stub.Generate(request(max_tokens=2), metadata=bearer(TENANT)))
    assert messages[-1].HasField("complete"), messages


async def test_an_inference_key_may_not_profile(launcher: Launcher) -> None:
    stub = vllm_engine_pb2_grpc.VllmEngineStub(launcher.channel)
    with launcher.explained(), pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.StartProfile(common_pb2.StartProfileRequest(), metadata=bearer(TENANT))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.parametrize("kind", ["own", "reference"])
async def test_profiler_start_and_stop(launcher: Launcher, kind: str) -> None:
    stub, common = _stub(launcher.channel, kind)
    admin = bearer(ADMIN)
    before = launcher.trace_files()
    with launcher.explained():
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.StartProfile(
                common.StartProfileRequest(output_dir="/tmp/elsewhere"), metadata=admin
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "output_dir" in (err.value.details() or "")

        started = await stub.StartProfile(common.StartProfileRequest(), metadata=admin)
        assert started.success
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.StartProfile(common.StartProfileRequest(), metadata=admin)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION

        await _generate(launcher)
        stopped = await stub.StopProfile(common.StopProfileRequest(), metadata=admin, timeout=300)
        assert stopped.success
        assert launcher.trace_files() - before, "no trace written"
        # The trace export left the launcher and its engine serving.
        await _generate(launcher)


async def test_the_launcher_serves_and_stops_cleanly_after_profiling(launcher: Launcher) -> None:
    with launcher.explained():
        assert launcher.trace_files(), "runs after the profiling tests"
        await _generate(launcher)
    launcher.proc.send_signal(signal.SIGTERM)
    try:
        code = await asyncio.wait_for(exit_code(launcher.proc), 90)
    except TimeoutError:
        raise AssertionError(f"no exit 90 s after SIGTERM\n{launcher.output()}") from None
    assert code == 0, launcher.output()
    assert not await gone(launcher.engine_processes, 10), "engine processes left behind"
    # Shown on a failure, or with -rP: what the launcher printed while it profiled.
    print(launcher.output())
    for fatal in ("Fatal Python error", "Segmentation fault"):
        assert fatal not in launcher.output(), launcher.output()
