"""The prefix cache kept per tenant, on the launcher as shipped with two tenants' keys.

Every response tells its caller how many prompt tokens the engine found in
its prefix cache. Shared by every tenant, that count tells tenant B whether
tenant A sent a prompt starting as B guesses. Each tenant's requests are
salted by its key, on every way in (VllmEngine, vllm.Inference, the HTTP
API); `--shared-prefix-cache` shares the cache again.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import pytest
from support import bearer, collect, completes, request
from support.launcher import START_TIMEOUT, Launched, launched, launcher_env

from vllm_servicer.proto import inference_pb2, inference_pb2_grpc, vllm_engine_pb2_grpc

pytestmark = pytest.mark.timeout(2 * START_TIMEOUT + 300)

TENANT_A = "salt-tenant-a-0123456789abcdefABCDEF"
TENANT_B = "salt-tenant-b-0123456789abcdefABCDEF"
ADMIN = "salt-admin-0123456789abcdefABCDEF"

_prompts = itertools.count(1)


def _long_prompt() -> list[int]:
    """Two whole KV blocks (128 tokens each on CPU) and a part, tokens no other
    test of this module sends."""
    start = next(_prompts)
    return [(11 * i + 37 * start) % 300 + 3 for i in range(300)]


@pytest.fixture(scope="module", params=[False, True], ids=["salted", "shared"])
async def launcher(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[Launched, bool]]:
    shared: bool = request.param
    key_file = tmp_path_factory.mktemp("keys") / "keys"
    key_file.write_text(f"tenant-a: {TENANT_A}\ntenant-b: {TENANT_B}\n")
    flags = ["--http-port", "0", "--api-key-file", str(key_file), "--admin-api-key", ADMIN]
    if shared:
        flags.append("--shared-prefix-cache")
    env = launcher_env(tmp_path_factory.mktemp("cache"))
    async with launched(*flags, env=env) as served:
        yield served, shared


@pytest.fixture(scope="module")
async def channel(launcher: tuple[Launched, bool]) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(launcher[0].address) as channel:
        yield channel


async def _engine_cached(channel: grpc.aio.Channel, key: str, prompt: list[int]) -> int:
    """VllmEngine Generate's `cached_tokens` for `prompt`, sent with `key`."""
    stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    call = stub.Generate(request(prompt, max_tokens=2), metadata=bearer(key), timeout=120)
    return int(completes(await collect(call))[0].cached_tokens)


async def _inference_cached(
    channel: grpc.aio.Channel, key: str, prompt: list[int], salt: str = ""
) -> int:
    """vllm.Inference Generate's `num_cached_tokens` for `prompt`, sent with `key`."""
    stub = inference_pb2_grpc.InferenceStub(channel)
    message = inference_pb2.GenerateRequest(token_ids=inference_pb2.TokenIds(ids=prompt))
    message.stopping.max_new_tokens = 2
    message.stopping.ignore_eos = True
    if salt:
        message.kv.cache_salt = salt
    reply = await stub.Generate(message, metadata=bearer(key), timeout=120)
    return int(reply.outputs.finish_info.num_cached_tokens)


async def _inference_stream_cached(channel: grpc.aio.Channel, key: str, prompt: list[int]) -> int:
    """vllm.Inference GenerateStream's `num_cached_tokens` for `prompt`, sent with `key`."""
    stub = inference_pb2_grpc.InferenceStub(channel)
    message = inference_pb2.GenerateRequest(token_ids=inference_pb2.TokenIds(ids=prompt))
    message.stopping.max_new_tokens = 2
    message.stopping.ignore_eos = True
    replies = [m async for m in stub.GenerateStream(message, metadata=bearer(key), timeout=120)]
    return int(replies[-1].outputs.finish_info.num_cached_tokens)


READERS = {
    "VllmEngine.Generate": _engine_cached,
    "Inference.Generate": _inference_cached,
    "Inference.GenerateStream": _inference_stream_cached,
}


@pytest.mark.parametrize("way", list(READERS))
async def test_a_tenant_finds_its_own_prompt_in_the_cache_and_no_other_does(
    way: str, launcher: tuple[Launched, bool], channel: grpc.aio.Channel
) -> None:
    shared = launcher[1]
    cached = READERS[way]
    prompt = _long_prompt()
    assert await cached(channel, TENANT_A, prompt) == 0
    # Its own cache still serves the tenant.
    assert await cached(channel, TENANT_A, prompt) > 0
    # The other tenant's same prompt finds nothing of A's, unless the operator shares the cache.
    found = await cached(channel, TENANT_B, prompt)
    assert (found > 0) if shared else (found == 0), found


async def test_a_tenants_own_salt_still_parts_its_requests_and_never_reaches_another(
    launcher: tuple[Launched, bool], channel: grpc.aio.Channel
) -> None:
    shared = launcher[1]
    prompt = _long_prompt()
    assert await _inference_cached(channel, TENANT_A, prompt, salt="conversation-1") == 0
    assert await _inference_cached(channel, TENANT_A, prompt, salt="conversation-1") > 0
    # The client's own salt keeps its meaning: another salt finds none of it.
    assert await _inference_cached(channel, TENANT_A, prompt, salt="conversation-2") == 0
    # The same client salt from the other tenant is not A's salt.
    found = await _inference_cached(channel, TENANT_B, prompt, salt="conversation-1")
    assert (found > 0) if shared else (found == 0), found


async def test_an_http_prompt_is_kept_to_its_tenant(
    launcher: tuple[Launched, bool], channel: grpc.aio.Channel
) -> None:
    served, shared = launcher
    prompt = _long_prompt()
    async with httpx.AsyncClient(base_url=served.http_url, timeout=120) as http:
        model = (await http.get("/v1/models", headers=dict(bearer(TENANT_A)))).json()["data"][0]
        body: dict[str, Any] = {"model": model["id"], "prompt": prompt, "max_tokens": 2}
        reply = await http.post("/v1/completions", json=body, headers=dict(bearer(TENANT_A)))
        assert reply.status_code == 200, reply.text
    # One key is one tenant over both protocols: A finds its HTTP prompt over gRPC.
    assert await _inference_cached(channel, TENANT_A, prompt) > 0
    found = await _inference_cached(channel, TENANT_B, prompt)
    assert (found > 0) if shared else (found == 0), found
