"""vLLM's runtime LoRA routes beside vllm.Control, on the launcher as shipped.

With `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1` and `--http-port`, vLLM's HTTP API
loads adapters at `/v1/load_lora_adapter`: a change to the engine every
tenant shares, so an admin key's alone, as Control's LoadLora is. The HTTP
API and the gRPC registry number their adapters apart: an adapter loaded
over HTTP never takes the id of one loaded over gRPC, which would make the
engine run one adapter's weights for the other's requests.

Render takes a gRPC adapter's name and renders as vLLM does for the same
adapter loaded over HTTP.

vLLM switches that reach past those routes: with a LoRA resolver plugin
(`VLLM_LORA_RESOLVER_CACHE_DIR`), a request naming an unknown model makes
vLLM load the adapter of that name for everyone, so only an admin key's
request does; with the Responses store (`VLLM_ENABLE_RESPONSES_API_STORE`),
stored responses are anyone's who names their id, so the Responses API is
an admin key's.

One launcher: the tiny Llama with real weights (an adapter changes its
tokens), LoRA on, both protocols, a tenant key and an admin key, vLLM's
filesystem LoRA resolver and its Responses store on.
"""

from __future__ import annotations

import collections
import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from support import bearer, settle
from support.launcher import START_TIMEOUT, launched
from support.vllm_protocol import reference_modules, shipped_modules

from vllm_servicer.testing.tiny_lora import (
    TINY_LORA_ENGINE_KWARGS,
    write_tiny_lora_adapter,
    write_tiny_weighted_model,
)
from vllm_servicer.testing.tiny_model import apply_cpu_env_defaults, tiny_engine_flags

pytestmark = pytest.mark.timeout(START_TIMEOUT + 180)

ctl, ctl_grpc = reference_modules("control")
inf, inf_grpc = reference_modules("inference")
render_pb, render_grpc = shipped_modules("render")

TENANT = "lora-tenant-0123456789abcdefABCDEF"
ADMIN = "lora-admin-0123456789abcdefABCDEF"
PROMPT = [5, 17, 42, 99, 7, 63, 21, 88]
ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
RESOLVABLE = "resolvable-c"  # an adapter vLLM's filesystem resolver finds by name


@dataclass
class Launcher:
    grpc_address: str
    http_url: str
    adapters: dict[str, Path]
    output: collections.deque[str]


@pytest.fixture(scope="module")
async def launcher(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Launcher]:
    root = tmp_path_factory.mktemp("runtime-lora")
    model = write_tiny_weighted_model(root / "model")
    adapters = {name: write_tiny_lora_adapter(root / name, seed=seed) for name, seed in
                (("a", 0), ("b", 1))}  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_API_KEY")}
    env.update(apply_cpu_env_defaults())
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    resolvable = write_tiny_lora_adapter(root / "resolver" / RESOLVABLE, seed=2)
    config = json.loads((resolvable / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(model)  # the resolver matches the base model
    (resolvable / "adapter_config.json").write_text(json.dumps(config))
    env["VLLM_LORA_RESOLVER_CACHE_DIR"] = str(root / "resolver")
    env["VLLM_ENABLE_RESPONSES_API_STORE"] = "1"
    env["VLLM_SERVICER_CACHE"] = str(root / "cache")
    flags = (
        "--model", str(model), *tiny_engine_flags(TINY_LORA_ENGINE_KWARGS), "--http-port", "0",
        "--services", "vllm-engine", "inference", "control", "render",
        "--api-key", TENANT, "--admin-api-key", ADMIN,
    )  # fmt: skip
    async with launched(*flags, env=env) as served:
        yield Launcher(served.address, served.http_url, adapters, served.output)


async def _post(launcher: Launcher, path: str, key: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=launcher.http_url, timeout=120) as client:
        return await client.post(path, json=body, headers={"authorization": f"Bearer {key}"})


@pytest.mark.parametrize("route", ROUTES)
async def test_an_inference_key_may_not_change_the_adapters_over_http(
    launcher: Launcher, route: str
) -> None:
    body = {"lora_name": "tenant-adapter", "lora_path": str(launcher.adapters["a"])}
    reply = await _post(launcher, route, TENANT, body)
    assert reply.status_code == 403, reply.text
    assert "admin key" in reply.json()["error"]


async def _grpc_greedy(channel: grpc.aio.Channel, lora_name: str) -> list[int]:
    message = inf.GenerateRequest(lora_name=lora_name)
    message.token_ids.ids.extend(PROMPT)
    message.stopping.max_new_tokens = 8
    message.stopping.ignore_eos = True
    message.response.output_token_ids = True
    reply = await inf_grpc.InferenceStub(channel).Generate(
        message, metadata=bearer(TENANT), timeout=120
    )
    return list(reply.outputs.token_ids)


async def test_adapters_loaded_over_http_and_grpc_never_share_an_id(launcher: Launcher) -> None:
    """Adapter a loads over HTTP first (vLLM numbers it 1), then adapter b over
    gRPC: b's requests run b's weights, the same tokens as b loaded again under
    another name, not a's."""
    body = {"lora_name": "http-a", "lora_path": str(launcher.adapters["a"])}
    reply = await _post(launcher, "/v1/load_lora_adapter", ADMIN, body)
    assert reply.status_code == 200, reply.text
    async with grpc.aio.insecure_channel(launcher.grpc_address) as channel:
        control = ctl_grpc.ControlStub(channel)
        loaded = []
        for name in ("grpc-b", "grpc-b-again"):
            request = ctl.LoadLoraRequest(lora_name=name, source_path=str(launcher.adapters["b"]))
            loaded.append(await control.LoadLora(request, metadata=bearer(ADMIN), timeout=120))
        assert loaded[0].adapter.lora_id != loaded[1].adapter.lora_id
        tokens_b = await _grpc_greedy(channel, "grpc-b")
        assert tokens_b == await _grpc_greedy(channel, "grpc-b-again")
        base = await _grpc_greedy(channel, "")
    assert tokens_b != base, "the adapter changes nothing: the test cannot tell adapters apart"
    completion = await _post(
        launcher,
        "/v1/completions",
        TENANT,
        {"model": "http-a", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
         "ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    assert completion.status_code == 200, completion.text
    tokens_a = completion.json()["choices"][0]["token_ids"]
    assert len(tokens_a) == 8 and tokens_a != tokens_b


async def test_render_takes_an_adapters_name_and_renders_as_vllm_does_for_it(
    launcher: Launcher,
) -> None:
    """An adapter shares the engine's tokenizer and chat template: a render
    naming one gives the ids vLLM's /tokenize and chat path give for the same
    adapter loaded over HTTP."""
    body = {"lora_name": "render-http", "lora_path": str(launcher.adapters["a"])}
    assert (await _post(launcher, "/v1/load_lora_adapter", ADMIN, body)).status_code == 200
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    async with grpc.aio.insecure_channel(launcher.grpc_address) as channel:
        load = ctl.LoadLoraRequest(lora_name="render-grpc", source_path=str(body["lora_path"]))
        await ctl_grpc.ControlStub(channel).LoadLora(load, metadata=bearer(ADMIN), timeout=120)
        render = render_grpc.RenderStub(channel)
        rendered = {}
        for model in ("render-grpc", ""):
            request = render_pb.RenderChatRequest(model=model)
            request.messages.add(role="user", content=messages[0]["content"])
            rendered[model] = await render.RenderChat(request, metadata=bearer(TENANT))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            request = render_pb.RenderCompletionRequest(model="render-http", prompt=["Hello"])
            await render.RenderCompletion(request, metadata=bearer(TENANT))
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND  # HTTP's adapter is HTTP's
    ids = list(rendered["render-grpc"].token_ids)
    assert ids == list(rendered[""].token_ids)
    tokenized = await _post(
        launcher, "/tokenize", TENANT, {"model": "render-http", "messages": messages}
    )
    assert tokenized.status_code == 200, tokenized.text
    assert ids == tokenized.json()["tokens"]
    chat = await _post(
        launcher,
        "/v1/chat/completions",
        TENANT,
        {"model": "render-http", "messages": messages, "max_tokens": 1, "return_token_ids": True},
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["prompt_token_ids"] == ids


async def _model_ids(launcher: Launcher) -> set[str]:
    async with httpx.AsyncClient(base_url=launcher.http_url, timeout=120) as client:
        reply = await client.get("/v1/models", headers=dict(bearer(ADMIN)))
    return {model["id"] for model in reply.json()["data"]}


async def test_a_tenant_naming_an_unknown_model_makes_vllm_load_no_adapter(
    launcher: Launcher,
) -> None:
    """vLLM's resolver would load the adapter the name finds, for every tenant; only
    an administrator's request may."""
    body = {"model": RESOLVABLE, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    for path in ("/v1/completions", "/v1/chat/completions"):
        if path.endswith("chat/completions"):
            body = {**body, "messages": [{"role": "user", "content": "Hi"}]}
            del body["prompt"]
        reply = await _post(launcher, path, TENANT, body)
        assert reply.status_code in (400, 404), reply.text
        assert RESOLVABLE not in await _model_ids(launcher)
    # vLLM logs why the adapter its resolver found did not load.
    assert await settle(
        lambda: any("only an admin key loads adapters" in line for line in launcher.output), 30
    )
    reply = await _post(launcher, "/v1/chat/completions", ADMIN, body)
    assert reply.status_code == 200, reply.text
    assert RESOLVABLE in await _model_ids(launcher)


async def test_the_responses_store_is_an_admin_keys(launcher: Launcher) -> None:
    """Stored responses are read, cancelled and continued by id, whoever stored them."""
    async with httpx.AsyncClient(base_url=launcher.http_url, timeout=120) as client:
        for key, expected in ((TENANT, 403), (ADMIN, 404)):
            headers = dict(bearer(key))
            for reply in (
                await client.get("/v1/responses/resp_someone-elses", headers=headers),
                await client.post("/v1/responses/resp_someone-elses/cancel", headers=headers),
            ):
                assert reply.status_code == expected, (key, reply.text)
            body = {"input": "Hi", "previous_response_id": "resp_someone-elses"}
            reply = await client.post("/v1/responses", json=body, headers=headers)
            if key == TENANT:
                assert reply.status_code == 403, reply.text
                assert "VLLM_ENABLE_RESPONSES_API_STORE" in reply.text
            else:
                assert reply.status_code != 403, reply.text
