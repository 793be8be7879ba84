"""One guard for every way in: vLLM's HTTP API and the gRPC protocols share
the engine's request ids and the in-flight limit.

`serve --http-port` serves vLLM's OpenAI API from the launcher's engine. vLLM
runs an HTTP request sent with `X-Request-Id: X` under the engine id
`cmpl-X-0`; that id belongs to the HTTP caller as a gRPC caller's ids belong
to it, and HTTP generations count toward `--max-inflight` with gRPC calls.
One launcher as shipped, real clients on both sides.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import pytest
from support import bearer, collect, request
from support.launcher import START_TIMEOUT, Launched, launched, launcher_env

from vllm_servicer.frontends import FrontendGroup
from vllm_servicer.proto import vllm_engine_pb2 as pb
from vllm_servicer.proto import vllm_engine_pb2_grpc

pytestmark = pytest.mark.timeout(START_TIMEOUT + 300)

TENANT_A = "guard-tenant-a-0123456789abcdefABCDEF"
TENANT_B = "guard-tenant-b-0123456789abcdefABCDEF"
MAX_INFLIGHT = 2
LONG = 500  # tokens: still running when the test acts on it (the model's context is 512)


@pytest.fixture(scope="module")
async def launcher(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Launched]:
    flags = ["--http-port", "0", "--api-key", TENANT_A, "--api-key", TENANT_B]
    # vLLM's own cap on an HTTP request's stop strings (4, OpenAI's) raised
    # past this server's budget, as an operator may: the budget still holds.
    env = launcher_env(tmp_path_factory.mktemp("cache"), VLLM_MAX_STOP_STRINGS="1000")
    async with launched(*flags, "--max-inflight", str(MAX_INFLIGHT), env=env) as served:
        yield served


@pytest.fixture(scope="module")
async def stub(launcher: Launched) -> AsyncIterator[vllm_engine_pb2_grpc.VllmEngineStub]:
    async with grpc.aio.insecure_channel(launcher.address) as channel:
        yield vllm_engine_pb2_grpc.VllmEngineStub(channel)


@pytest.fixture(scope="module")
async def http(launcher: Launched) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(
        base_url=launcher.http_url, headers=dict(bearer(TENANT_A)), timeout=120
    ) as client:
        yield client


@pytest.fixture(scope="module")
async def model(http: httpx.AsyncClient) -> str:
    reply = await http.get("/v1/models")
    return str(reply.json()["data"][0]["id"])


class HttpStream:
    """A streamed /v1/completions, read an event at a time."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self._lines = response.aiter_lines()

    async def next_event(self) -> dict[str, Any] | None:
        """The next data event; None after `[DONE]`."""
        async for line in self._lines:
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                return None if data == "[DONE]" else dict(json.loads(data))
        raise AssertionError("the stream ended without [DONE]")

    async def finish_reason(self) -> str | None:
        """How the stream ended: the last finish_reason it sent."""
        reason = None
        while (event := await self.next_event()) is not None:
            assert "error" not in event, event
            reason = event["choices"][0].get("finish_reason") or reason
        return reason


@contextlib.asynccontextmanager
async def http_stream(
    http: httpx.AsyncClient, model: str, *, max_tokens: int, request_id: str | None = None
) -> AsyncIterator[HttpStream]:
    """A completion streamed over HTTP, its first event read (it runs in the
    engine); leaving the block drops the connection (vLLM aborts it)."""
    body = {
        "model": model,
        "prompt": [5, 17, 42, 99],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"X-Request-Id": request_id} if request_id else {}
    async with http.stream("POST", "/v1/completions", json=body, headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        stream = HttpStream(response)
        assert await stream.next_event() is not None
        yield stream


async def _active(stub: Any) -> int:
    info = await stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=bearer(TENANT_A))
    return int(info.active_requests)


async def test_an_http_requests_engine_id_is_its_callers_alone(
    stub: Any, http: httpx.AsyncClient, model: str
) -> None:
    b = bearer(TENANT_B)
    async with http_stream(http, model, max_tokens=120, request_id="trace-42") as stream:
        # Tenant B over gRPC: the id vLLM runs the HTTP request under is not free.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await collect(stub.Generate(request(request_id="cmpl-trace-42-0"), metadata=b))
        assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "already in use" in (refused.value.details() or "")
        # Its Abort of "its own" id touches nothing of tenant A's.
        await stub.Abort(pb.AbortRequest(request_ids=["cmpl-trace-42-0"]), metadata=b)
        assert await asyncio.wait_for(stream.finish_reason(), 120) == "length"

    # The other way round: an id a gRPC caller runs is refused to HTTP, with 409.
    call = stub.Generate(
        request(request_id="cmpl-grpc-7-0", max_tokens=LONG, ignore_eos=True, stream=True),
        metadata=b,
    )
    try:
        assert await call.read() is not grpc.aio.EOF
        body = {"model": model, "prompt": [5, 17], "max_tokens": 4, "stream": True}
        reply = await http.post("/v1/completions", json=body, headers={"X-Request-Id": "grpc-7"})
        assert reply.status_code == 409, reply.text
        assert "already in use" in reply.json()["error"]["message"]
    finally:
        call.cancel()


async def test_http_streams_count_against_the_in_flight_limit(
    stub: Any, http: httpx.AsyncClient, model: str
) -> None:
    a = bearer(TENANT_A)
    async with contextlib.AsyncExitStack() as running:
        for _ in range(MAX_INFLIGHT):
            await running.enter_async_context(http_stream(http, model, max_tokens=LONG))
        with pytest.raises(grpc.aio.AioRpcError) as busy:
            await collect(stub.Generate(request(), metadata=a))
        assert busy.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"limit (max_inflight) is {MAX_INFLIGHT}" in (busy.value.details() or "")
        assert await _active(stub) == MAX_INFLIGHT
        # A third over HTTP: 503, as vLLM answers its own queue limit.
        body = {"model": model, "prompt": [5, 17], "max_tokens": 4, "stream": True}
        reply = await http.post("/v1/completions", json=body)
        assert reply.status_code == 503, reply.text
        assert f"limit (max_inflight) is {MAX_INFLIGHT}" in reply.json()["error"]["message"]
    # The dropped streams are released with their connections.
    for _ in range(100):
        if await _active(stub) == 0:
            break
        await asyncio.sleep(0.1)
    assert await _active(stub) == 0
    assert len(await collect(stub.Generate(request(), metadata=a)))


def test_no_request_id_reaches_a_callers_stream_counter() -> None:
    """`--api-server-count`'s shared table holds running ids and each caller's
    KV-event stream count; an id spelled like a counter's key is an id only."""
    group = FrontendGroup(2, capacity=64)
    try:
        group.join(0)
        # A running id spelled as alice's counter does not count as her streams...
        assert group.claim("kv-subscriber\0alice", "mallory")
        assert group.streams_held_by("alice") == 0
        group.release("kv-subscriber\0alice")
        # ...and, alice holding a stream, claiming it tells nothing of her label.
        with group.locked():
            group.add_stream("alice", 1)
        assert group.streams_held_by("alice") == 1
        assert group.claim("kv-subscriber\0alice", "mallory")
        assert group.streams_held_by("alice") == 1
    finally:
        group.remove_directory()


# ----- per-request budgets on the HTTP API ------------------------------------------------------

# The defaults (vllm_servicer.budgets): the HTTP API keeps the gRPC protocols' budgets.
MAX_STOP_STRINGS = 64
MAX_STOP_BYTES = 16 * 1024
MAX_REQUEST_ID_CHARS = 1024

GENERATIONS = {
    "/v1/completions": {"prompt": [5, 17, 42, 99]},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
}


@pytest.mark.parametrize("path", list(GENERATIONS))
async def test_http_stop_strings_past_a_budget_are_refused_400_naming_stop(
    http: httpx.AsyncClient, model: str, path: str, stub: Any
) -> None:
    body = {"model": model, **GENERATIONS[path], "max_tokens": 2, "temperature": 0}
    too_many = [f"<stop-{i}>" for i in range(MAX_STOP_STRINGS + 1)]
    too_long = ["a" * (MAX_STOP_BYTES // 2), "b" * (MAX_STOP_BYTES // 2 + 1)]
    for stop, flag in ((too_many, "--max-stop-strings"), (too_long, "--max-stop-bytes")):
        reply = await http.post(path, json={**body, "stop": stop})
        assert reply.status_code == 400, reply.text
        message = reply.json()["error"]["message"]
        assert message.startswith("stop: ") and flag in message, message
    # At both budgets: served.
    each = MAX_STOP_BYTES // MAX_STOP_STRINGS
    at_budget = [f"{i:04d}".ljust(each, "~") for i in range(MAX_STOP_STRINGS)]
    reply = await http.post(path, json={**body, "stop": at_budget})
    assert reply.status_code == 200, reply.text
    assert await _active(stub) == 0


@pytest.mark.parametrize(
    ("path", "where", "request_id"),
    [
        ("/v1/completions", "body", "r" * (MAX_REQUEST_ID_CHARS + 1)),
        ("/v1/completions", "body", "line\nbreak"),
        ("/v1/chat/completions", "body", "nul\0byte"),
        ("/pooling", "body", "r" * (MAX_REQUEST_ID_CHARS + 1)),
        ("/v1/completions", "header", "r" * (MAX_REQUEST_ID_CHARS + 1)),
        ("/v1/chat/completions", "header", "tab\there"),
        # JSON in UTF-16, which vLLM's parser reads as well: the field's name is other bytes.
        ("/v1/completions", "body-utf16", "r" * (MAX_REQUEST_ID_CHARS + 1)),
    ],
    ids=["long", "newline", "nul", "pooling-long", "header-long", "header-tab", "utf16"],
)
async def test_an_http_request_id_past_the_checks_is_refused_400_naming_it(
    http: httpx.AsyncClient, model: str, path: str, where: str, request_id: str
) -> None:
    body: dict[str, Any] = {"model": model, "max_tokens": 2}
    body |= GENERATIONS.get(path, {"input": "hi"})
    headers = {}
    if where.startswith("body"):
        body["request_id"] = request_id
        field = "request_id"
    else:
        headers["X-Request-Id"] = request_id
        field = "X-Request-Id"
    if where == "body-utf16":
        headers["Content-Type"] = "application/json"
        reply = await http.post(path, content=json.dumps(body).encode("utf-16"), headers=headers)
    else:
        reply = await http.post(path, json=body, headers=headers)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == field
    assert error["message"].startswith(f"{field}: "), error
    # At the bound, printable: served.
    if path == "/v1/completions" and where in ("body", "header"):
        fine = "r" * MAX_REQUEST_ID_CHARS
        ok = {**body, "request_id": fine} if where == "body" else body
        reply = await http.post(path, json=ok, headers={"X-Request-Id": fine} if headers else {})
        assert reply.status_code == 200, reply.text


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


async def test_a_long_http_request_id_over_many_prompts_costs_the_launcher_nothing(
    launcher: Launched, http: httpx.AsyncClient, model: str, stub: Any
) -> None:
    """The issue's body: a 512 KiB `request_id` with 1,024 prompts (0.53 MB),
    which vLLM would copy into each prompt's engine id (1.18 GB once)."""
    body = {
        "model": model,
        "prompt": [[5, 17]] * 1024,
        "max_tokens": 1,
        "request_id": "r" * (512 * 1024),
    }
    before = _rss_mb(launcher.proc.pid)
    reply = await http.post("/v1/completions", json=body)
    grown = _rss_mb(launcher.proc.pid) - before
    assert reply.status_code == 400, reply.text[:500]
    assert reply.json()["error"]["message"].startswith("request_id: 524288 characters")
    assert grown < 100, f"the launcher grew by {grown:.0f} MB"
    # The other tenant is served.
    done = await collect(stub.Generate(request(max_tokens=2), metadata=bearer(TENANT_B)))
    assert len(done) == 1
