"""Routing data is a router's: KV events and KV transfer parameters, on the launcher as shipped.

KV events carry the token ids of every block the engine stores (prompt and
output, every tenant's); KV transfer parameters make a prefill engine hold
blocks or a decode engine connect where the caller says. With keys, both are
for a router key (here `role=router` on its line of the key file) and the
admin key; a tenant's key gets PERMISSION_DENIED (403 over HTTP), and
`--routing-data-for-every-key` opens both to every key.

Each launcher: two tenants' keys and a router's in one key file, an admin
key, `--http-port`, KV events on (vLLM's ZMQ publisher on an ipc path) and the
echoing KV connector (support/kv_echo_connector.py), so that what a caller's
parameters reached shows in the reply and in the connector's log.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from google.protobuf import json_format
from support import bearer, collect, completes, next_kv_event, request, settle
from support.kv_echo_connector import FINISHED_LOG, EchoConnector
from support.launcher import START_TIMEOUT, Launched, launched, launcher_env

from vllm_servicer.proto import (
    common_pb2,
    control_pb2,
    control_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    vllm_engine_pb2_grpc,
)

pytestmark = pytest.mark.timeout(2 * START_TIMEOUT + 300)

TENANT_A = "route-tenant-a-0123456789abcdefABCDEF"
TENANT_B = "route-tenant-b-0123456789abcdefABCDEF"
ROUTER = "route-router-0123456789abcdefABCDEF"
ADMIN = "route-admin-0123456789abcdefABCDEF"
TESTS = Path(__file__).resolve().parent
# Enough for /v1/chat/completions on the tiny model, whose tokenizer has none.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
_numbers = itertools.count(1)


@dataclass
class Server:
    """A launcher serving, and whether it opens routing data to every key."""

    launched: Launched
    every_key: bool
    connector_log: Path
    model: str = ""


@pytest.fixture(scope="module", params=[False, True], ids=["routers-only", "every-key"])
async def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Server]:
    every_key: bool = request.param
    work = tmp_path_factory.mktemp("routing")
    keys = work / "keys"
    keys.write_text(f"tenant-a: {TENANT_A}\ntenant-b: {TENANT_B}\nrouter: {ROUTER} role=router\n")
    storage = work / "kv"
    storage.mkdir()
    transfer = {
        "kv_connector": EchoConnector.__name__,
        "kv_connector_module_path": "support.kv_echo_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{work}/ev"}
    # The engine process loads the connector from the tests' support package.
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    env = launcher_env(work / "cache", PYTHONPATH=path)
    flags = [
        *("--api-key-file", str(keys), "--admin-api-key", ADMIN, "--http-port", "0"),
        *("--services", "vllm-engine", "inference", "control", "--chat-template", CHAT_TEMPLATE),
        *("--kv-events-config", json.dumps(events), "--kv-transfer-config", json.dumps(transfer)),
    ]
    if every_key:
        flags.append("--routing-data-for-every-key")
    async with launched(*flags, env=env) as served:
        yield Server(served, every_key, storage / FINISHED_LOG)


@pytest.fixture(scope="module")
async def channel(server: Server) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(server.launched.address) as channel:
        yield channel


async def _http(server: Server, key: str, path: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=server.launched.http_url, timeout=120) as client:
        if not server.model:
            models = await client.get("/v1/models", headers=dict(bearer(ADMIN)))
            server.model = str(models.json()["data"][0]["id"])
        return await client.post(
            path, json={"model": server.model, **body}, headers=dict(bearer(key))
        )


# ----- KV events -----------------------------------------------------------------


async def test_a_tenant_reads_no_kv_events_a_router_reads_every_tenants_tokens(
    server: Server, channel: grpc.aio.Channel
) -> None:
    """Tenant A's prompt (its "password" tokens) reaches the router's subscription
    in A's BlockStored event; tenant B's subscription is refused unless the
    operator opened KV events to every key."""
    stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    control = control_pb2_grpc.ControlStub(channel)
    tenant_b = bearer(TENANT_B)
    if not server.every_key:
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await stub.SubscribeKvEvents(
                common_pb2.SubscribeKvEventsRequest(), metadata=tenant_b, timeout=30
            ).read()
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        details = denied.value.details() or ""
        assert "router role" in details and "--routing-data-for-every-key" in details, details
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await control.GetKvEventSources(
                control_pb2.GetKvEventSourcesRequest(), metadata=tenant_b, timeout=30
            )
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # Who may: the router (and B when every key may), the admin.
    readers = [ROUTER, ADMIN] + ([TENANT_B] if server.every_key else [])
    for key in readers:
        sources = await control.GetKvEventSources(
            control_pb2.GetKvEventSourcesRequest(), metadata=bearer(key), timeout=30
        )
        assert sources.sources, key
    calls = [
        stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), metadata=bearer(key))
        for key in readers
    ]
    try:
        for call in calls:
            await asyncio.wait_for(call.initial_metadata(), 30)  # subscribed
        await asyncio.sleep(0.5)  # ZMQ subscriptions reach the publisher asynchronously
        # A prompt new to the prefix cache, a little over one 128-token block.
        start = next(_numbers) * 1000 + (500 if server.every_key else 0)
        secret = [(start + 13 * i) % 250 + 3 for i in range(133)]
        await collect(
            stub.Generate(request(secret, max_tokens=2), metadata=bearer(TENANT_A), timeout=120)
        )
        for key, call in zip(readers, calls, strict=True):
            _, event = await next_kv_event(call, "stored", timeout=60)
            tokens = list(event.stored.blocks[0].token_ids)
            assert tokens and tokens == secret[: len(tokens)], key
    finally:
        for call in calls:
            call.cancel()


# ----- KV transfer parameters ------------------------------------------------------


def _engine_request(marker: str, **params: Any) -> Any:
    req = request([5, 6, 7, 8], max_tokens=2, request_id=f"{marker}-{next(_numbers)}")
    req.kv_transfer_params_json = json.dumps({"marker": marker, **params})
    return req


def _inference_request(marker: str, **params: Any) -> Any:
    message = inference_pb2.GenerateRequest(request_id=f"{marker}-{next(_numbers)}")
    message.token_ids.ids.extend([5, 6, 7, 8])
    message.stopping.max_new_tokens = 2
    message.kv.kv_transfer_params.update({"marker": marker, **params})
    return message


async def _vllm_engine(channel: grpc.aio.Channel, key: str, marker: str, **params: Any) -> Any:
    stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    req = _engine_request(marker, **params)
    done = completes(await collect(stub.Generate(req, metadata=bearer(key), timeout=120)))[0]
    return json.loads(done.kv_transfer_params_json or "{}")


async def _inference(channel: grpc.aio.Channel, key: str, marker: str, **params: Any) -> Any:
    stub = inference_pb2_grpc.InferenceStub(channel)
    message = _inference_request(marker, **params)
    reply = await stub.Generate(message, metadata=bearer(key), timeout=120)
    return json_format.MessageToDict(reply.outputs.finish_info.kv_transfer_params)


def _told(server: Server, marker: str) -> list[Any]:
    """The params the connector was given (finished or told of a rejection) carrying `marker`."""
    log = server.connector_log
    lines = log.read_text().splitlines() if log.exists() else []
    return [
        e["params"] for e in map(json.loads, lines) if (e["params"] or {}).get("marker") == marker
    ]


@pytest.mark.parametrize("way", ["vllm-engine", "inference", "completions", "chat"])
async def test_kv_transfer_params_are_a_routers(
    server: Server, channel: grpc.aio.Channel, way: str
) -> None:
    """A tenant's parameters are refused naming the field (gRPC) or 403 (HTTP), and
    the connector never sees them, not even as a rejected remote prefill; the
    router's reach the connector and come back."""
    # A remote prefill: refused, vLLM's and the servicer's clean-up would tell the
    # connector of the request, and it would act on what the tenant wrote.
    hostile = {"do_remote_prefill": True, "remote_host": "10.9.9.9", "remote_port": 9}
    tenant_marker = f"tenant-{way}-{server.every_key}"
    router_marker = f"router-{way}-{server.every_key}"
    fields = {"vllm-engine": "kv_transfer_params_json", "inference": "kv.kv_transfer_params"}
    if way in fields:
        send = _vllm_engine if way == "vllm-engine" else _inference
        if server.every_key:
            echoed = await send(channel, TENANT_B, tenant_marker, do_remote_decode=True)
            assert echoed["marker"] == tenant_marker and echoed["echoed_by"] == "EchoConnector"
        else:
            with pytest.raises(grpc.aio.AioRpcError) as denied:
                await send(channel, TENANT_B, tenant_marker, **hostile)
            assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
            details = denied.value.details() or ""
            assert details.startswith(f"{fields[way]}: ") and "router role" in details, details
            assert "--routing-data-for-every-key" in details, details
        echoed = await send(channel, ROUTER, router_marker, do_remote_decode=True)
    else:
        path = "/v1/completions" if way == "completions" else "/v1/chat/completions"
        body: dict[str, Any] = (
            {"prompt": [5, 6, 7, 8]}
            if way == "completions"
            else {"messages": [{"role": "user", "content": "Hi"}]}
        )
        body["max_tokens"] = 2
        params = {
            "marker": tenant_marker,
            **({"do_remote_decode": True} if server.every_key else hostile),
        }
        reply = await _http(server, TENANT_B, path, {**body, "kv_transfer_params": params})
        if server.every_key:
            assert reply.status_code == 200, reply.text
        else:
            assert reply.status_code == 403, reply.text
            assert "kv_transfer_params" in reply.text and "router role" in reply.text, reply.text
        params = {"marker": router_marker, "do_remote_decode": True}
        reply = await _http(server, ROUTER, path, {**body, "kv_transfer_params": params})
        assert reply.status_code == 200, reply.text
        echoed = reply.json()["kv_transfer_params"]
    assert echoed["marker"] == router_marker and echoed["echoed_by"] == "EchoConnector"
    # The router's request was told to the connector after the tenant's: had the
    # tenant's reached it (a rejection notice included), it would be in the log.
    assert await settle(lambda: bool(_told(server, router_marker)), 30)
    assert bool(_told(server, tenant_marker)) == server.every_key


async def test_encoder_cache_transfer_params_are_a_routers_too(
    server: Server, channel: grpc.aio.Channel
) -> None:
    """`kv.ec_transfer_params` steers a connector as KV transfer's do: a tenant's are
    refused for its role before anything else; a router's reach the connector check
    (this engine runs no encoder-cache connector: FAILED_PRECONDITION naming it)."""
    stub = inference_pb2_grpc.InferenceStub(channel)

    async def send(key: str) -> grpc.aio.AioRpcError:
        message = inference_pb2.GenerateRequest(request_id=f"ec-{next(_numbers)}")
        message.token_ids.ids.extend([5, 6, 7, 8])
        message.stopping.max_new_tokens = 2
        message.kv.ec_transfer_params.update({"remote_host": "10.9.9.9"})
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Generate(message, metadata=bearer(key), timeout=120)
        return refused.value

    tenant = await send(TENANT_B)
    if server.every_key:
        assert tenant.code() == grpc.StatusCode.FAILED_PRECONDITION, tenant.details()
    else:
        assert tenant.code() == grpc.StatusCode.PERMISSION_DENIED, tenant.details()
        assert (tenant.details() or "").startswith("kv.ec_transfer_params: ")
    router = await send(ROUTER)
    assert router.code() == grpc.StatusCode.FAILED_PRECONDITION, router.details()
    assert (router.details() or "").startswith("kv.ec_transfer_params: ")


async def test_kv_hints_are_a_routers(server: Server, channel: grpc.aio.Channel) -> None:
    """`kv_hints` steer the engine's KV cache (what to prefetch, keep or drop) for
    every tenant's blocks: a tenant's are refused for its role, naming the role
    and the flag; a router's and the admin's reach the engine."""
    stub = inference_pb2_grpc.InferenceStub(channel)

    def message() -> inference_pb2.GenerateRequest:
        hinted = inference_pb2.GenerateRequest(request_id=f"hints-{next(_numbers)}")
        hinted.token_ids.ids.extend([5, 6, 7, 8])
        hinted.stopping.max_new_tokens = 2
        hinted.kv_hints.protocol_version = "1"
        hinted.kv_hints.message_id = f"m-{next(_numbers)}"
        action = hinted.kv_hints.actions.add(
            action_id="a-1", action_type="prefetch", action_version="1"
        )
        action.payload.update({"blocks": 3})
        return hinted

    if not server.every_key:
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await stub.Generate(message(), metadata=bearer(TENANT_B), timeout=120)
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        details = denied.value.details() or ""
        assert details.startswith("kv_hints: ") and "router role" in details, details
        assert "--routing-data-for-every-key" in details, details
    senders = [ROUTER, ADMIN] + ([TENANT_B] if server.every_key else [])
    for key in senders:
        reply = await stub.Generate(message(), metadata=bearer(key), timeout=120)
        assert reply.outputs.num_tokens == 2, key
