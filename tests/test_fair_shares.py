"""Fair shares of `--max-inflight` per tenant, on the launcher as shipped.

Two tenants' keys from a key file, a small `--max-inflight`, `--http-port`:
tenant A fills every engine slot with long streams; tenant B, refused for
want of a free slot, now counts as wanting them, so A is held to its share
(half) on every way in (VllmEngine, vllm.Inference, vLLM's HTTP API) and the
slots A gives back go to B. With `--api-server-count 2` the counts are the
frontend processes' together: A's share is of the engine's slots, not of
each process's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from support import bearer, collect, request
from support.launcher import START_TIMEOUT, Launched, launched, launcher_env
from test_one_guard import http_stream

from vllm_servicer.proto import inference_pb2, inference_pb2_grpc, vllm_engine_pb2_grpc
from vllm_servicer.proto import vllm_engine_pb2 as pb

pytestmark = pytest.mark.timeout(START_TIMEOUT + 300)

TENANT_A = "shares-tenant-a-0123456789abcdefABCDEF"
TENANT_B = "shares-tenant-b-0123456789abcdefABCDEF"
MAX_INFLIGHT = 4
# Streams that outlast the test's steps however busy the machine: the tiny
# model writes hundreds of tokens a second, so its context is widened for them
# (its positions past 512 are nonsense, which the test does not read).
MAX_MODEL_LEN = 16384
LONG = 16000
SHARE = "'tenant-a' holds 3 of the 4 engine slots (max_inflight), its share while 2 tenants"


def _key_file(directory: Path, a: str = TENANT_A, b: str = TENANT_B) -> str:
    path = directory / "keys.txt"
    path.write_text(f"tenant-a: {a}\ntenant-b: {b}\n")
    return str(path)


@pytest.fixture(scope="module")
async def launcher(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Launched]:
    keys = _key_file(tmp_path_factory.mktemp("keys"))
    flags = ["--api-key-file", keys, "--http-port", "0", "--max-inflight", str(MAX_INFLIGHT)]
    async with launched(*flags, *LONG_CONTEXT, env=_env(tmp_path_factory)) as served:
        yield served


LONG_CONTEXT = ("--max-model-len", str(MAX_MODEL_LEN))


def _env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    env = launcher_env(tmp_path_factory.mktemp("cache"))
    return {**env, "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}


async def _open(stub: Any, key: str) -> Any:
    """A long VllmEngine stream of `key`'s, running in the engine."""
    call = stub.Generate(
        request(max_tokens=LONG, ignore_eos=True, stream=True), metadata=bearer(key)
    )
    assert await call.read() is not grpc.aio.EOF
    return call


async def _refused(call: Any) -> str:
    """RESOURCE_EXHAUSTED with the retry pushback: the refusal's text."""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await (collect(call) if isinstance(call, grpc.aio.UnaryStreamCall) else call)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
    assert dict(err.value.trailing_metadata())["grpc-retry-pushback-ms"] == "1000"
    return str(err.value.details())


def _inference_request() -> inference_pb2.GenerateRequest:
    message = inference_pb2.GenerateRequest()
    message.token_ids.ids.extend([5, 17, 42, 99])
    message.stopping.max_new_tokens = 4
    return message


async def _active(stub: Any, key: str) -> int:
    info = await stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=bearer(key))
    return int(info.active_requests)


async def _until_active(stub: Any, count: int, key: str = TENANT_B) -> None:
    """Wait (20 s at most) until `count` engine calls are in flight (GetServerInfo)."""
    for _ in range(200):
        if await _active(stub, key) == count:
            return
        await asyncio.sleep(0.1)
    assert await _active(stub, key) == count


async def test_a_tenant_past_its_share_is_refused_on_every_way_in_and_the_other_is_served(
    launcher: Launched,
) -> None:
    short = {"model": "", "prompt": [5, 17], "max_tokens": 4}
    async with (
        grpc.aio.insecure_channel(launcher.address) as channel,
        httpx.AsyncClient(base_url=launcher.http_url, timeout=120) as http,
        contextlib.AsyncExitStack() as held,
    ):
        engine = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        inference = inference_pb2_grpc.InferenceStub(channel)
        short["model"] = model = str(
            (await http.get("/v1/models", headers=dict(bearer(TENANT_A)))).json()["data"][0]["id"]
        )
        # A alone: every slot, over both protocols (one key, one identity).
        http.headers.update(dict(bearer(TENANT_A)))
        await held.enter_async_context(http_stream(http, model, max_tokens=LONG))
        streams = [await _open(engine, TENANT_A) for _ in range(MAX_INFLIGHT - 1)]
        held.callback(lambda: [call.cancel() for call in streams])
        # B is refused for want of a free slot, and so counts as wanting them.
        busy = await _refused(engine.Generate(request(max_tokens=4), metadata=bearer(TENANT_B)))
        assert f"limit (max_inflight) is {MAX_INFLIGHT}" in busy
        # A gives one back; its new calls are refused naming its share, on every way in...
        streams.pop().cancel()
        await _until_active(engine, MAX_INFLIGHT - 1)
        a = bearer(TENANT_A)
        for call in (
            engine.Generate(request(max_tokens=4), metadata=a),
            engine.Generate(request(max_tokens=4, stream=True), metadata=a),
            inference.Generate(_inference_request(), metadata=a),
            inference.GenerateStream(_inference_request(), metadata=a),
        ):
            message = await _refused(call)
            assert SHARE in message and message.endswith("is 2; retry later"), message
        reply = await http.post("/v1/completions", json=short)
        assert reply.status_code == 503, reply.text
        assert SHARE in reply.json()["error"]["message"], reply.text
        reply = await http.post("/v1/completions", json={**short, "stream": True})
        assert reply.status_code == 503 and SHARE in reply.text, reply.text
        # ...and the slot it gave back is B's, over either protocol.
        b = bearer(TENANT_B)
        assert len(await collect(engine.Generate(request(max_tokens=4), metadata=b)))
        served = await inference.Generate(_inference_request(), metadata=b)
        assert served.outputs.num_tokens == 4
        reply = await http.post("/v1/completions", json=short, headers=dict(b))
        assert reply.status_code == 200, reply.text
    # Every slot comes back with the calls' ends.
    async with grpc.aio.insecure_channel(launcher.address) as channel:
        engine = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        await _until_active(engine, 0)
        assert len(await collect(engine.Generate(request(max_tokens=4), metadata=bearer(TENANT_A))))


async def test_a_tenants_share_is_of_the_engines_slots_across_frontend_processes(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """`--api-server-count 2`: A's streams run in both processes, B is refused
    in one; A is then held to its share in each, by what it holds in both."""
    # Its helper holding one connection to each process, and the keys it opens them with.
    from test_api_servers import TENANT_A as A
    from test_api_servers import TENANT_B as B
    from test_api_servers import Connections

    keys = _key_file(tmp_path_factory.mktemp("keys"), A, B)
    argv = ["--api-server-count", "2", "--api-key-file", keys, *LONG_CONTEXT]
    async with launched(
        *argv, "--max-inflight", str(MAX_INFLIGHT), env=_env(tmp_path_factory)
    ) as group:
        connections = await Connections(group).open()
        streams: list[Any] = []
        try:
            first, second = connections.engine(0), connections.engine(1)
            for stub in (first, first, second, second):
                streams.append(await _open(stub, A))
            busy = await _refused(first.Generate(request(max_tokens=4), metadata=bearer(B)))
            assert f"limit (max_inflight) is {MAX_INFLIGHT}" in busy
            # A lets one of the first process's go: it holds 1 there, 2 in the other, 3 in all.
            streams.pop(0).cancel()
            await _until_active(first, MAX_INFLIGHT - 1, B)
            for stub in (first, second):
                message = await _refused(stub.Generate(request(max_tokens=4), metadata=bearer(A)))
                assert SHARE in message and message.endswith("is 2; retry later"), message
            # B, refused in the first process, is served in the second.
            assert len(await collect(second.Generate(request(max_tokens=4), metadata=bearer(B))))
            for stream in streams:
                stream.cancel()
            for stub in (first, second):
                await _until_active(stub, 0, B)
        finally:
            for stream in streams:
                stream.cancel()
            await connections.close()
