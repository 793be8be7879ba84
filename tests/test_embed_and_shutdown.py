"""Embed on a real pooling engine, then health across a pooling engine's shutdown.

Embed runs on the session's embedding engine. The shutdown test builds a
pooling engine of its own and shuts it down, so its server shows what clients
see of a dead engine; no other test could share that engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import serving

from vllm_servicer import SERVICE_NAME
from vllm_servicer.proto import vllm_engine_pb2 as pb
from vllm_servicer.proto import vllm_engine_pb2_grpc
from vllm_servicer.testing.tiny_model import TINY_EMBED_ENGINE_KWARGS, build_tiny_engine


@pytest.fixture(scope="module")
async def pooling(embedding_engine: Any) -> AsyncIterator[Any]:
    async with serving(embedding_engine) as served:
        yield embedding_engine, served.channel


@pytest.fixture
async def dying(embedding_model_dir: Path) -> AsyncIterator[Any]:
    """A pooling engine of the test's own, served: the test shuts the engine down."""
    engine = build_tiny_engine(embedding_model_dir, **TINY_EMBED_ENGINE_KWARGS)
    try:
        async with serving(engine) as served:
            yield engine, served.channel
    finally:
        engine.shutdown()


async def test_embed_returns_a_hidden_size_vector(pooling: Any) -> None:
    engine, channel = pooling
    stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    reply = await stub.Embed(
        pb.EmbedRequest(request_id="e1", tokenized=pb.TokenizedInput(input_ids=[5, 6, 7, 8]))
    )
    hidden = engine.model_config.hf_config.hidden_size
    assert reply.embedding_dim == hidden == len(reply.embedding)
    assert reply.prompt_tokens == 4
    again = await stub.Embed(
        pb.EmbedRequest(request_id="e2", tokenized=pb.TokenizedInput(input_ids=[5, 6, 7, 8]))
    )
    assert list(again.embedding) == pytest.approx(list(reply.embedding))


async def test_embed_rejects_an_empty_prompt(pooling: Any) -> None:
    _, channel = pooling
    stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Embed(pb.EmbedRequest(request_id="e3"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "input_ids" in err.value.details()


async def test_embed_on_a_generation_engine_is_failed_precondition(stub: Any) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Embed(pb.EmbedRequest(tokenized=pb.TokenizedInput(input_ids=[1, 2])))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "pooling" in err.value.details()


async def test_health_after_engine_shutdown(dying: Any) -> None:
    engine, channel = dying
    health = health_pb2_grpc.HealthStub(channel)
    watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
    assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING

    engine.shutdown()

    # Watch streams the change, Check agrees, and the protocol's own HealthCheck too.
    changed = await asyncio.wait_for(watch.read(), timeout=5)
    assert changed.status == health_pb2.HealthCheckResponse.NOT_SERVING
    watch.cancel()
    for service in ("", SERVICE_NAME):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
    stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    state = await stub.HealthCheck(pb.HealthCheckRequest())
    assert not state.healthy and state.message == "Engine is not alive"
    # New work is refused as UNAVAILABLE (retry elsewhere), not INTERNAL.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Embed(pb.EmbedRequest(tokenized=pb.TokenizedInput(input_ids=[1, 2])))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
