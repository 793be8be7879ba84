"""Shared fixtures: one real vLLM engine per session, a real grpc.aio server on loopback.

The engine is vLLM's `AsyncLLM` on the built-in tiny model (random weights,
seeded, so greedy output is deterministic). Building an engine takes ~30 s on
these machines, so it is built once per session and shut down at the end.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from helpers import build_engine

from vllm_servicer import MountedServices, mount
from vllm_servicer.proto import vllm_engine_pb2_grpc
from vllm_servicer.testing.tiny_model import write_tiny_model
from vllm_servicer.testing.tiny_vlm import write_tiny_vlm


@dataclasses.dataclass
class RunningServer:
    address: str
    server: grpc.aio.Server
    mounted: MountedServices


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny LLaVA-shaped vision model (no download)."""
    return write_tiny_vlm(tmp_path_factory.mktemp("models") / "tiny-llava")


@pytest.fixture(scope="session")
def preprocess(vlm_dir: Path) -> Callable[[tuple[int, int, int]], Any]:
    """A router's image preprocessing for that model (see router_side.py)."""
    from router_side import router_preprocessor

    return router_preprocessor(vlm_dir)


@pytest.fixture(scope="session")
async def engine(tiny_model_dir: Path) -> AsyncIterator[Any]:
    llm = build_engine(tiny_model_dir)
    try:
        yield llm
    finally:
        llm.shutdown()


@pytest.fixture(scope="session")
async def server(engine: Any) -> AsyncIterator[RunningServer]:
    srv = grpc.aio.server()
    mounted = mount(srv, engine)
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    try:
        yield RunningServer(f"127.0.0.1:{port}", srv, mounted)
    finally:
        if mounted.health is not None:
            await mounted.health.close()
        await srv.stop(None)


@pytest.fixture(scope="session")
async def channel(server: RunningServer) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(server.address) as ch:
        yield ch


@pytest.fixture
def stub(channel: grpc.aio.Channel) -> vllm_engine_pb2_grpc.VllmEngineStub:
    return vllm_engine_pb2_grpc.VllmEngineStub(channel)
