"""GetLoads, GetTokenizer, FlushCache, profiling and trace headers.

Each RPC goes through this project's stubs and the reference stubs
(smg-grpc-proto), against the session's real engine; a small stand-in engine
covers what a real one cannot be made to show on demand (stats switched off,
no local tokenizer, the trace headers the engine receives).
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import types
import zipfile
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc
import pytest
import vllm
from smg_grpc_proto.generated import common_pb2 as ref_common
from smg_grpc_proto.generated import vllm_engine_pb2 as ref
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as ref_grpc
from support import request, serving, wait_until_idle
from tokenizers import Tokenizer

from vllm_servicer.proto import common_pb2, vllm_engine_pb2_grpc
from vllm_servicer.proto import vllm_engine_pb2 as pb
from vllm_servicer.servicer.loads import MISSING_RANKS_KEY
from vllm_servicer.servicer.tokenizer_bundle import CHUNK_SIZE
from vllm_servicer.testing.stand_in import StandInEngine

STUB_KINDS = ["own", "reference"]


def _stubs(channel: grpc.aio.Channel, kind: str) -> tuple[Any, Any, Any]:
    """(stub, engine messages, common messages) for one set of generated code."""
    if kind == "own":
        return vllm_engine_pb2_grpc.VllmEngineStub(channel), pb, common_pb2
    return ref_grpc.VllmEngineStub(channel), ref, ref_common


async def _long_stream(stub: Any, rid: str) -> Any:
    """A streaming Generate over the rest of the context, started (first chunk read)."""
    call = stub.Generate(request(stream=True, request_id=rid, max_tokens=5000, ignore_eos=True))
    await call.read()
    return call


async def _loads_until(stub: Any, messages: Any, check: Any, timeout: float = 10.0) -> Any:
    # Stats arrive with the engine's step outputs: poll until they show `check`.
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        reply = await stub.GetLoads(messages.GetLoadsRequest())
        if (reply.loads and check(reply.loads[0])) or loop.time() > deadline:
            return reply
        await asyncio.sleep(0.05)


# ----- GetLoads ---------------------------------------------------------------


@pytest.mark.parametrize("kind", STUB_KINDS)
async def test_get_loads_during_and_after_a_stream(
    channel: grpc.aio.Channel, engine: Any, kind: str
) -> None:
    stub, messages, _ = _stubs(channel, kind)
    own = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    call = await _long_stream(own, f"loads-{kind}")
    try:
        busy = await _loads_until(stub, messages, lambda load: load.num_running_reqs >= 1)
    finally:
        call.cancel()
    assert busy.dp_rank_count == 1 and len(busy.loads) == 1
    load = busy.loads[0]
    assert load.dp_rank == 0
    assert load.num_running_reqs >= 1
    assert load.num_total_reqs == load.num_running_reqs + load.num_waiting_reqs
    assert 0.0 < load.token_usage <= 1.0 and load.utilization == load.token_usage
    cache = engine.vllm_config.cache_config
    assert load.max_total_num_tokens == cache.num_gpu_blocks * cache.block_size > 0
    assert 0 < load.num_used_tokens <= load.max_total_num_tokens
    assert load.max_running_requests == engine.vllm_config.scheduler_config.max_num_seqs
    assert load.gen_throughput > 0
    assert busy.version == vllm.__version__
    assert datetime.fromisoformat(busy.timestamp).tzinfo is not None

    assert await wait_until_idle(engine) == 0
    idle = await _loads_until(stub, messages, lambda load: load.num_running_reqs == 0)
    assert idle.loads[0].num_running_reqs == 0 == idle.loads[0].num_total_reqs
    assert idle.loads[0].token_usage == 0.0


@pytest.mark.parametrize("kind", STUB_KINDS)
async def test_get_loads_filters_by_rank(channel: grpc.aio.Channel, kind: str) -> None:
    stub, messages, _ = _stubs(channel, kind)
    await stub.Generate(request(max_tokens=2)).read()  # at least one snapshot exists
    one = await stub.GetLoads(messages.GetLoadsRequest(dp_rank=0))
    assert [load.dp_rank for load in one.loads] == [0] and one.dp_rank_count == 1
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.GetLoads(messages.GetLoadsRequest(dp_rank=3))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "dp_rank" in (err.value.details() or "")


# ----- GetTokenizer -----------------------------------------------------------


async def _tokenizer_zip(stub: Any, messages: Any) -> tuple[bytes, list[Any]]:
    parts = [chunk async for chunk in stub.GetTokenizer(messages.GetTokenizerRequest())]
    return b"".join(part.data for part in parts), parts


@pytest.mark.parametrize("kind", STUB_KINDS)
async def test_get_tokenizer_zip_loads_and_matches_its_sha256(
    channel: grpc.aio.Channel, tiny_model_dir: Path, tmp_path: Path, kind: str
) -> None:
    stub, _, common = _stubs(channel, kind)
    data, parts = await _tokenizer_zip(stub, common)
    assert parts and all(0 < len(p.data) <= CHUNK_SIZE for p in parts)
    assert all(p.sha256 == "" for p in parts[:-1])
    assert parts[-1].sha256 == hashlib.sha256(data).hexdigest()

    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        assert archive.testzip() is None
        assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= set(archive.namelist())
        archive.extractall(tmp_path)
    text = "Hello tokenizer, 123!"
    shipped = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    original = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    assert shipped.encode(text).ids == original.encode(text).ids

    again, _ = await _tokenizer_zip(stub, common)
    assert again == data  # built once, served from memory


async def test_get_tokenizer_chunks_are_bounded() -> None:
    from vllm_servicer.servicer.tokenizer_bundle import chunks

    data = bytes(range(256)) * (CHUNK_SIZE // 128 + 3)  # a bit over 2 chunks
    parts = list(chunks(data, "digest"))
    assert [len(p.data) for p in parts] == [CHUNK_SIZE, CHUNK_SIZE, len(data) - 2 * CHUNK_SIZE]
    assert [p.sha256 for p in parts] == ["", "", "digest"]
    assert b"".join(p.data for p in parts) == data


# ----- FlushCache -------------------------------------------------------------


@pytest.mark.parametrize("kind", STUB_KINDS)
async def test_flush_cache_when_idle_and_when_busy(
    channel: grpc.aio.Channel, engine: Any, kind: str
) -> None:
    stub, _, common = _stubs(channel, kind)
    assert await wait_until_idle(engine) == 0
    idle = await stub.FlushCache(common.FlushCacheRequest())
    assert idle.success and idle.message

    own = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    call = await _long_stream(own, f"flush-{kind}")
    try:
        refused = await stub.FlushCache(common.FlushCacheRequest(timeout_s=0))
        assert not refused.success and "running" in refused.message
        # timeout_s waits for the engine to go idle: the stream ends meanwhile.
        waiting = asyncio.ensure_future(stub.FlushCache(common.FlushCacheRequest(timeout_s=20)))
        await asyncio.sleep(0.5)
        assert not waiting.done()
        call.cancel()
        flushed = await waiting
        assert flushed.success
    finally:
        call.cancel()
    assert await wait_until_idle(engine) == 0


async def test_flush_cache_gives_up_after_timeout_s_and_at_the_deadline(
    stub: Any, engine: Any
) -> None:
    call = await _long_stream(stub, "flush-timeout")
    # Frozen, the request holds its blocks for as long as the test needs (the
    # tiny model would otherwise finish its 512-token context within a second).
    await engine.pause_generation(mode="keep", clear_cache=False)
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        reply = await stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=0.5))
        assert not reply.success and "0.5s" in reply.message
        assert 0.4 < loop.time() - started < 5

        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=60), timeout=0.5)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        await engine.resume_generation()
        call.cancel()
    assert await wait_until_idle(engine) == 0


async def test_flush_cache_rejects_a_negative_timeout(stub: Any) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=-1))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "timeout_s" in (err.value.details() or "")


# ----- profiling and KV events without the engine features ----------------------


@pytest.mark.parametrize("kind", STUB_KINDS)
async def test_profiling_needs_a_configured_profiler(channel: grpc.aio.Channel, kind: str) -> None:
    stub, _, common = _stubs(channel, kind)
    for call in (
        stub.StartProfile(common.StartProfileRequest()),
        stub.StopProfile(common.StopProfileRequest()),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "--profiler-config" in (err.value.details() or "")


@pytest.mark.parametrize("kind", STUB_KINDS)
async def test_kv_events_say_how_to_enable_them(channel: grpc.aio.Channel, kind: str) -> None:
    stub, _, common = _stubs(channel, kind)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in stub.SubscribeKvEvents(common.SubscribeKvEventsRequest()):
            pass
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "--kv-events-config" in (err.value.details() or "")


# ----- a stand-in engine: stats off, no local tokenizer, trace headers ----------


class _RecordingEngine(StandInEngine):
    """An engine that records what the servicer passes it (stats off, no local tokenizer)."""

    def __init__(self) -> None:
        super().__init__(
            model_config=types.SimpleNamespace(tokenizer="some-org/some-hub-model"),
            vllm_config=types.SimpleNamespace(
                parallel_config=types.SimpleNamespace(data_parallel_rank=0)
            ),
        )
        self.calls: list[dict[str, Any]] = []

    async def generate(self, prompt: Any, params: Any, request_id: str, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        return
        yield  # pragma: no cover - an async generator that yields nothing

    async def encode(self, prompt: Any, params: Any, request_id: str, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        return
        yield  # pragma: no cover

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate", "embed")

    async def abort(self, request_id: Any) -> None:
        return None


@pytest.fixture(scope="module")
async def stand_in() -> AsyncIterator[tuple[_RecordingEngine, Any]]:
    engine = _RecordingEngine()
    async with serving(engine, health=False, reflection_service=False) as served:
        yield engine, vllm_engine_pb2_grpc.VllmEngineStub(served.channel)


async def test_get_loads_leaves_out_ranks_without_stats(stand_in: Any) -> None:
    _, stub = stand_in
    call = stub.GetLoads(pb.GetLoadsRequest())
    reply = await call
    assert reply.dp_rank_count == 1 and not reply.loads  # never zeros that read as idle
    assert (MISSING_RANKS_KEY, "0") in tuple(await call.trailing_metadata())


async def test_get_tokenizer_without_a_local_directory(stand_in: Any) -> None:
    _, stub = stand_in
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in stub.GetTokenizer(common_pb2.GetTokenizerRequest()):
            pass
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "some-org/some-hub-model" in (err.value.details() or "")
    assert "local" in (err.value.details() or "")


async def test_trace_headers_reach_the_engine(stand_in: Any) -> None:
    engine, stub = stand_in
    engine.calls.clear()
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    metadata = (("traceparent", traceparent), ("tracestate", "k=v"), ("x-other", "1"))
    async for _ in stub.Generate(request(), metadata=metadata):
        pass
    async for _ in stub.Generate(request()):
        pass
    embed = pb.EmbedRequest(request_id="e", tokenized=pb.TokenizedInput(input_ids=[1, 2]))
    with pytest.raises(grpc.aio.AioRpcError):  # the stand-in yields no embedding
        await stub.Embed(embed, metadata=metadata[:1])
    with_trace, without, embedded = engine.calls
    assert with_trace["trace_headers"] == {"traceparent": traceparent, "tracestate": "k=v"}
    assert "trace_headers" not in without
    assert embedded["trace_headers"] == {"traceparent": traceparent}
