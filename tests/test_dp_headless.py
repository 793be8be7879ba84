"""A head launcher and a headless node (`serve --headless`), two nodes on one machine.

The head serves two data-parallel ranks (`--data-parallel-size 2
--data-parallel-size-local 1`): rank 0 its own engine, rank 1 the headless
node's, which registers with the head at `--data-parallel-address`:
`--data-parallel-rpc-port`. Calls pinned to either rank run there (GetLoads
shows them); the headless node binds no port. When its engine dies, the node
exits 1 (a supervisor restarts it), and the head, whose question the engine
no longer answers, ends the call pinned to it UNAVAILABLE and exits 1. The
layout is started once for the module; the engine's death is its last test.
A headless node alone shows the stop: SIGTERM ends it and its engines with 0.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc  # type: ignore[import-untyped]
from support import collect, free_port
from support.launcher import (
    START_TIMEOUT,
    Launched,
    children,
    drain_output,
    exit_code,
    gone,
    launch,
    launcher_env,
    named,
    spawn,
    stop_launched,
    wait_for_line,
)
from support.ranks import pinned, running, until_running

from vllm_servicer.health import SERVING
from vllm_servicer.proto import inference_pb2, inference_pb2_grpc, vllm_engine_pb2_grpc
from vllm_servicer.proto import vllm_engine_pb2 as pb

# Several engine cores per layout: run apart from the suite's other worker
# (make test-dp), where they have the machine's cores to themselves.
pytestmark = [
    pytest.mark.engine,
    pytest.mark.data_parallel,
    pytest.mark.timeout(2 * START_TIMEOUT + 300),
]


class TwoNodes:
    """The head launcher and the headless node's process (its output kept)."""

    def __init__(self, head: Launched, node: asyncio.subprocess.Process) -> None:
        self.head = head
        self.node = node
        self.node_output: list[str] = []
        self.reader: asyncio.Future[None] | None = None


def _dp_flags(rpc_port: int) -> list[str]:
    return [
        "--data-parallel-size",
        "2",
        "--data-parallel-size-local",
        "1",
        "--data-parallel-address",
        "127.0.0.1",
        "--data-parallel-rpc-port",
        str(rpc_port),
    ]


@contextlib.asynccontextmanager
async def _two_nodes(cache: Path, **env_extra: str) -> AsyncIterator[TwoNodes]:
    """A headless node serving rank 1, then a head serving both ranks (rank 0 its own)."""
    env = launcher_env(
        cache, VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_CPU_KVCACHE_SPACE="1", **env_extra
    )
    port = free_port()
    node = await spawn(
        "-m",
        "vllm_servicer",
        "serve",
        "--headless",
        "--data-parallel-start-rank",
        "1",
        *_dp_flags(port),
        env=env,
    )
    head: Launched | None = None
    try:
        await wait_for_line(node, r"vllm-servicer headless: rank 1 started for the head at")
        both = TwoNodes(await launch(*_dp_flags(port), env=env), node)
        head = both.head
        tail: Any = both.node_output
        both.reader = asyncio.ensure_future(_keep(node, tail))
        yield both
    finally:
        if head is not None:
            with contextlib.suppress(TimeoutError):
                await stop_launched(head, expect=None)
        if node.returncode is None:
            node.kill()
            await node.wait()


@pytest.fixture(scope="module")
async def nodes(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[TwoNodes]:
    async with _two_nodes(tmp_path_factory.mktemp("cache")) as both:
        yield both


async def _keep(proc: asyncio.subprocess.Process, lines: list[str]) -> None:
    tail: collections.deque[str] = collections.deque(maxlen=400)
    try:
        await drain_output(proc, tail)
    finally:
        lines.extend(tail)


async def test_a_headless_node_stops_with_0_on_sigterm(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """No head needed: its engines wait for one, and a stop signal ends them and the node."""
    env = launcher_env(tmp_path_factory.mktemp("alone"), VLLM_CPU_KVCACHE_SPACE="1")
    node = await spawn(
        "-m",
        "vllm_servicer",
        "serve",
        "--headless",
        "--data-parallel-start-rank",
        "1",
        *_dp_flags(free_port()),
        env=env,
    )
    try:
        await wait_for_line(node, r"vllm-servicer headless: rank 1 started")
        reader = asyncio.ensure_future(drain_output(node))
        started = children(node.pid)
        assert started, "no engine process under the headless node"
        node.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(exit_code(node), 90) == 0
        reader.cancel()
        # Its engines went with it.
        assert not await gone(started, 30)
    finally:
        if node.returncode is None:
            node.kill()
            await node.wait()


@pytest.mark.parametrize("rank", [1, 0])
async def test_a_call_pinned_to_a_rank_runs_on_its_node(nodes: TwoNodes, rank: int) -> None:
    async with grpc.aio.insecure_channel(nodes.head.address) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        loads = await stub.GetLoads(pb.GetLoadsRequest())
        assert loads.dp_rank_count == 2
        done = await collect(stub.Generate(pinned(rank, max_tokens=4), timeout=60))
        assert done[-1].complete.completion_tokens == 4
        stream = stub.Generate(
            pinned(rank, max_tokens=400, ignore_eos=True, stream=True), timeout=120
        )
        try:
            assert (await stream.read()).WhichOneof("response") == "chunk"
            assert await until_running(stub, rank, 1) == 1
            assert await running(stub, 1 - rank) in (-1, 0)
        finally:
            stream.cancel()
        assert await until_running(stub, rank, 0) == 0


async def test_the_remote_rank_is_pinned_and_aborted_on_both_protocols(nodes: TwoNodes) -> None:
    async with grpc.aio.insecure_channel(nodes.head.address) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        inference = inference_pb2_grpc.InferenceStub(channel)
        # vllm.Inference pins by the same number, in its metadata.
        call = inference.GenerateStream(
            inference_pb2.GenerateRequest(
                token_ids=inference_pb2.TokenIds(ids=[5, 17, 42, 99]),
                stopping=inference_pb2.StoppingCriteria(max_new_tokens=400, ignore_eos=True),
            ),
            metadata=(("x-data-parallel-rank", "1"),),
            timeout=120,
        )
        try:
            await call.read()
            assert await until_running(stub, 1, 1) == 1
        finally:
            call.cancel()
        assert await until_running(stub, 1, 0) == 0
        # Abort reaches the engine on the other node.
        message = pinned(1, max_tokens=400, ignore_eos=True, stream=True, request_id="remote")
        stream = stub.Generate(message, timeout=120)
        assert (await stream.read()).WhichOneof("response") == "chunk"
        await stub.Abort(pb.AbortRequest(request_ids=["remote"]), timeout=30)
        rest = []
        while (reply := await stream.read()) is not grpc.aio.EOF:
            rest.append(reply)
        assert rest[-1].complete.finish_reason == "abort"
        assert await until_running(stub, 1, 0) == 0
        # A rank past the engine's is refused, naming those served.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await collect(stub.Generate(pinned(2), timeout=60))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "this server serves ranks 0-1" in (refused.value.details() or "")


async def test_the_headless_node_binds_no_port(nodes: TwoNodes) -> None:
    assert not _listening(nodes.node.pid)


def _listening(pid: int) -> set[int]:
    """The inodes of the sockets process `pid` listens on (TCP)."""
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                listening.add(int(fields[9]))
    sockets = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                sockets.add(int(target[8:-1]))
    return sockets & listening


async def test_a_remote_engine_that_stops_answering_is_not_ready_until_it_answers(
    nodes: TwoNodes,
) -> None:
    engines = [pid for pid, line in named(children(nodes.node.pid)).items() if "EngineCore" in line]
    assert engines, "no engine process under the headless node"
    async with grpc.aio.insecure_channel(nodes.head.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)

        async def status(service: str) -> int:
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            return int(reply.status)

        assert await status("data_parallel_rank/1") == SERVING
        # A hung engine (stopped, not dead): its rank misses the head's next
        # question and is not ready, while the server and rank 0 still are.
        for pid in engines:
            os.kill(pid, signal.SIGSTOP)
        try:
            deadline = asyncio.get_running_loop().time() + 20
            while await status("data_parallel_rank/1") == SERVING:
                assert asyncio.get_running_loop().time() < deadline, "rank 1 stayed SERVING"
                await asyncio.sleep(0.2)
            assert await status("data_parallel_rank/0") == SERVING
            assert await status("") == SERVING
        finally:
            for pid in engines:
                os.kill(pid, signal.SIGCONT)
        # Answering again, it is ready again (before misses enough to count it dead).
        deadline = asyncio.get_running_loop().time() + 20
        while await status("data_parallel_rank/1") != SERVING:
            assert asyncio.get_running_loop().time() < deadline, "rank 1 stayed NOT_SERVING"
            await asyncio.sleep(0.2)
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        done = await collect(stub.Generate(pinned(1, max_tokens=4), timeout=60))
        assert done[-1].complete.completion_tokens == 4


async def test_a_dead_remote_engine_ends_the_node_and_the_head(nodes: TwoNodes) -> None:
    engines = [pid for pid, line in named(children(nodes.node.pid)).items() if "EngineCore" in line]
    assert engines, "no engine process under the headless node"
    async with grpc.aio.insecure_channel(nodes.head.address) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        stream = stub.Generate(pinned(1, max_tokens=400, ignore_eos=True, stream=True), timeout=120)
        assert (await stream.read()).WhichOneof("response") == "chunk"
        killed = asyncio.get_running_loop().time()
        for pid in engines:
            os.kill(pid, signal.SIGKILL)
        # The headless node exits non-zero, for its supervisor to restart it.
        code = await asyncio.wait_for(exit_code(nodes.node), 60)
        assert code == 1, "".join(nodes.node_output)
        # The head counts the silent engine dead: the pinned stream ends
        # UNAVAILABLE, long before its deadline, and the head stops with 1.
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            while await stream.read() is not grpc.aio.EOF:
                pass
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
        assert asyncio.get_running_loop().time() - killed < 60
    assert await asyncio.wait_for(exit_code(nodes.head.proc), 90) == 1
    assert any("did not answer" in line for line in nodes.head.output)


async def test_kept_alive_the_head_marks_a_dead_remote_engine_and_keeps_running(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """`VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1` on the head: it serves on, NOT_SERVING."""
    cache = tmp_path_factory.mktemp("kept")
    async with _two_nodes(cache, VLLM_KEEP_ALIVE_ON_ENGINE_DEATH="1") as pair:
        engines = [
            pid for pid, line in named(children(pair.node.pid)).items() if "EngineCore" in line
        ]
        assert engines, "no engine process under the headless node"
        async with grpc.aio.insecure_channel(pair.head.address) as channel:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            stream = stub.Generate(
                pinned(1, max_tokens=400, ignore_eos=True, stream=True), timeout=120
            )
            assert (await stream.read()).WhichOneof("response") == "chunk"
            for pid in engines:
                os.kill(pid, signal.SIGKILL)
            assert await asyncio.wait_for(exit_code(pair.node), 60) == 1
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                while await stream.read() is not grpc.aio.EOF:
                    pass
            assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", "liveness", "data_parallel_rank/0", "data_parallel_rank/1"):
                reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
                assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING, service
            # Still running and answering: a new call is refused, not left waiting.
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await collect(stub.Generate(pinned(0, max_tokens=4), timeout=30))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert pair.head.proc.returncode is None
        assert any("did not answer" in line for line in pair.head.output)
