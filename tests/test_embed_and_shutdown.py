"""Embed on a real pooling engine, then health across a pooling engine's shutdown.

Embed runs on the session's embedding engine. The shutdown test builds a
pooling engine of its own and shuts it down, so its server shows what clients
see of a dead engine; no other test could share that engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import hold_hand_over, note_releases, serving, settle, wait_until_idle
from support.vllm_protocol import shipped_modules

from vllm_servicer import SERVICE_NAME
from vllm_servicer.proto import vllm_engine_pb2 as pb
from vllm_servicer.proto import vllm_engine_pb2_grpc
from vllm_servicer.testing.tiny_model import TINY_EMBED_ENGINE_KWARGS, build_tiny_engine


@pytest.fixture(scope="module")
async def pooling(embedding_engine: Any) -> AsyncIterator[Any]:
    async with serving(embedding_engine) as served:
        yield embedding_engine, served.channel, served.mounted.state


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
    engine, channel, _ = pooling
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
    _, channel, _ = pooling
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


@pytest.mark.parametrize("method", ["embed", "score"])
async def test_a_call_cancelled_while_its_requests_enter_the_engine_leaves_them(
    pooling: Any, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    """A cancel landing while vLLM hands a pooling call's requests to its engine
    core (its `encode` has no output stream yet, so it aborts nothing) still takes
    each out of the engine before its id is let go (another call may take the
    id then): VllmEngine's Embed, and the Pooling service's Score, whose texts
    vLLM's handler encodes side by side."""
    engine, channel, state = pooling
    rid = f"entering-{method}"
    handed = hold_hand_over(engine, rid, monkeypatch)
    # With the engine's own count of unfinished requests under each id.
    released = note_releases(state.running, partial(_unfinished_under, engine), monkeypatch)
    texts = 1
    if method == "embed":
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        tokens = pb.TokenizedInput(input_ids=[5, 6, 7, 8])
        call = stub.Embed(pb.EmbedRequest(request_id=rid, tokenized=tokens), timeout=60)
    else:
        pooling_pb, pooling_grpc = shipped_modules("pooling")
        texts = 4  # the query and three documents, each its own engine request
        message = pooling_pb.ScoreRequest(request_id=rid, text_1="a query", text_2=["x", "y", "z"])
        call = pooling_grpc.PoolingStub(channel).Score(message, timeout=60)
    # Paused ("keep"), the engine queues the requests: a pooling step would
    # otherwise end them before the cancel could tell.
    await engine.pause_generation(mode="keep")
    try:
        task = asyncio.ensure_future(call)
        assert await settle(lambda: len(handed) == texts, timeout=30), handed
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await settle(lambda: len([1 for i, _ in released if rid in i]) == texts)
    finally:
        await engine.resume_generation()
    assert [left for request_id, left in released if rid in request_id] == [0] * texts
    assert await wait_until_idle(engine) == 0


def _unfinished_under(engine: Any, request_id: str) -> int:
    return sum(
        1
        for state in engine.output_processor.request_states.values()
        if request_id in (state.request_id, getattr(state, "external_req_id", None))
    )


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
