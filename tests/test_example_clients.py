"""A client nobody here wrote the stack of: Node.js @grpc/grpc-js with this project's protos."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from support import bearer
from support.node import NODE_DIR, node_examples


@pytest.fixture(scope="module")
def node_client() -> Path:
    return node_examples() / "client.js"


async def test_node_client_streams_tokens(node_client: Path, server: Any) -> None:
    proc = await asyncio.create_subprocess_exec(
        shutil.which("node") or "node",
        str(node_client),
        server.address,
        "6",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    text = out.decode()
    assert proc.returncode == 0, text
    streamed = [t for line in re.findall(r"^tokens: (.*)$", text, re.M) for t in json.loads(line)]
    assert len(streamed) == 6 and all(isinstance(t, int) for t in streamed)
    assert "finish_reason: length" in text
    assert "total tokens: 6" in text


async def test_node_client_streams_text_from_vllms_own_protocol(
    node_client: Path, server: Any
) -> None:
    """examples/node/inference.js: vllm.Inference/GenerateStream, served by default."""
    proc = await asyncio.create_subprocess_exec(
        shutil.which("node") or "node",
        str(node_client.parent / "inference.js"),
        server.address,
        "5",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    text = out.decode()
    assert proc.returncode == 0, text
    assert "prompt tokens: 4" in text
    streamed = [t for line in re.findall(r"^tokens: (.*)$", text, re.M) for t in json.loads(line)]
    assert len(streamed) == 5 and all(isinstance(t, int) for t in streamed)
    assert "finish_reason: LENGTH" in text and "output tokens: 5" in text
    assert "total tokens: 5" in text
    assert re.search(r'^text: ".+"$', text, re.M), text


async def test_python_client_tour(server: Any) -> None:
    tour = NODE_DIR.parent / "client_tour.py"
    import sys

    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(tour),
        server.address,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 180)
    text = out.decode()
    assert proc.returncode == 0, text
    assert "health: SERVING" in text
    assert re.search(r"^stream: \[(\d+, ){7}\d+\] length$", text, re.M), text
    assert "choice 0:" in text and "choice 1:" in text
    assert "aborted stream: abort" in text
    assert "embed: FAILED_PRECONDITION" in text
    assert "server: vllm-grpc" in text


async def test_host_server_example(engine: Any) -> None:
    """examples/host_server.py: own service + own interceptor + mounted, metered, authenticated."""
    import importlib.util

    import grpc
    from prometheus_client import CollectorRegistry

    from vllm_servicer.proto import vllm_engine_pb2 as pb
    from vllm_servicer.proto import vllm_engine_pb2_grpc

    spec = importlib.util.spec_from_file_location("host_server", NODE_DIR.parent / "host_server.py")
    assert spec is not None and spec.loader is not None
    host = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host)

    registry = CollectorRegistry()
    server, mounted, access_log = host.build_server(engine, ["k1"], registry)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert await channel.unary_unary("/host.Echo/Say")(b"hi") == b"echo:hi"
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.GetModelInfo(pb.GetModelInfoRequest())
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            info = await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=bearer("k1"))
            assert info.max_context_length > 0
        handled = registry.get_sample_value(
            "grpc_server_handled_total",
            {
                "grpc_type": "unary",
                "grpc_service": "vllm.grpc.engine.VllmEngine",
                "grpc_method": "GetModelInfo",
                "grpc_code": "UNAUTHENTICATED",
            },
        )
        assert handled == 1
        assert "/host.Echo/Say" in access_log.methods
        assert "/vllm.grpc.engine.VllmEngine/GetModelInfo" in access_log.methods
    finally:
        if mounted.health is not None:
            await mounted.health.close()
        await server.stop(None)
