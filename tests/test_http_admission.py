"""vLLM's HTTP API keeps tenants apart as the gRPC side does, at the launcher
as shipped: bodies and headers within their deadlines, connections capped,
the constraint and render budgets, `/metrics` behind a key.

One launcher, two tenants' keys, `--http-port`, `--max-concurrent-rpcs 8` and
short deadlines (`--request-read-timeout 3`, `--http-header-timeout 3`).
Before, tenant A's eight POSTs that sent 10 of their 100 declared body bytes
held every call slot for as long as A liked (B refused for good); a
connection that stalled in its headers, or sent nothing, stayed open for
ever, and there was no cap on connections; a JSON schema of any size reached
the engine over HTTP (gRPC refused it), `/tokenize` and `/detokenize` took a
32 MiB body to the tokenizer, and `/metrics` answered without a key. Raw
sockets (asyncio streams) drive what no HTTP client sends; httpx the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import grpc
import httpx
import pytest
from support import bearer
from support.launcher import START_TIMEOUT, Launched, launched, launcher_env

from vllm_servicer.interceptors._reclaim import STILL_AFTER_S
from vllm_servicer.prefix_cache import keyed_body_uuids, tenant_media_uuid
from vllm_servicer.proto import vllm_engine_pb2, vllm_engine_pb2_grpc
from vllm_servicer.shares import DEFAULT_WANT_WINDOW

pytestmark = pytest.mark.timeout(START_TIMEOUT + 180)

TENANT_A = "admission-tenant-a-0123456789abcdef"
TENANT_B = "admission-tenant-b-0123456789abcdef"
MAX_CONCURRENT_RPCS = 8
READ_TIMEOUT = 3.0
WRITE_TIMEOUT = 3.0
HEADER_TIMEOUT = 3.0
MAX_CONNECTIONS = 24
MAX_CONSTRAINT_BYTES = 4096
MAX_RENDER_CHARS = 20_000
MAX_RENDER_ITEMS = 64
MAX_DERENDER_TOKENS = 1000
MAX_ABORT_IDS = 16
SLACK = 10.0  # seconds past a deadline for the answer: the machine may be busy


@pytest.fixture(scope="module")
async def launcher(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Launched]:
    flags = ["--http-port", "0", "--api-key", TENANT_A, "--api-key", TENANT_B]
    flags += ["--max-concurrent-rpcs", str(MAX_CONCURRENT_RPCS)]
    flags += ["--request-read-timeout", str(READ_TIMEOUT)]
    flags += ["--response-write-timeout", str(WRITE_TIMEOUT)]
    flags += ["--http-header-timeout", str(HEADER_TIMEOUT)]
    flags += ["--max-http-connections", str(MAX_CONNECTIONS)]
    flags += ["--max-constraint-bytes", str(MAX_CONSTRAINT_BYTES)]
    flags += ["--max-render-chars", str(MAX_RENDER_CHARS)]
    flags += ["--max-render-items", str(MAX_RENDER_ITEMS)]
    flags += ["--max-derender-tokens", str(MAX_DERENDER_TOKENS)]
    flags += ["--enable-scale-out", "--max-abort-ids", str(MAX_ABORT_IDS)]
    async with launched(*flags, env=launcher_env(tmp_path_factory.mktemp("cache"))) as served:
        yield served


@pytest.fixture(scope="module")
async def model(launcher: Launched) -> str:
    async with client(launcher, TENANT_A) as http:
        reply = await http.get("/v1/models")
    return str(reply.json()["data"][0]["id"])


def client(launcher: Launched, key: str | None) -> httpx.AsyncClient:
    headers = dict(bearer(key)) if key else {}
    return httpx.AsyncClient(base_url=launcher.http_url, headers=headers, timeout=60)


class Raw:
    """One connection to the HTTP port, written and read byte by byte."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.opened = time.monotonic()

    @classmethod
    async def open(cls, launcher: Launched) -> Raw:
        url = urlsplit(launcher.http_url)
        reader, writer = await asyncio.open_connection(url.hostname, url.port)
        return cls(reader, writer)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def until_closed(self, timeout: float) -> bytes:
        """Everything the server sends until it closes the connection (fails
        when it is still open after `timeout` s)."""
        return await asyncio.wait_for(self.reader.read(), timeout)

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


def head(launcher: Launched, method: str, path: str, key: str | None, **headers: str) -> bytes:
    """An HTTP/1.1 request's line and headers, the blank line after them included."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {urlsplit(launcher.http_url).netloc}"]
    if key:
        lines.append(f"Authorization: Bearer {key}")
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def answer(data: bytes) -> tuple[int, Any]:
    """The status and JSON body of the one response in `data`."""
    status_line, _, rest = data.partition(b"\r\n")
    _, _, body = rest.partition(b"\r\n\r\n")
    return int(status_line.split()[1]), json.loads(body) if body else None


async def complete(http: httpx.AsyncClient, model: str, **fields: Any) -> httpx.Response:
    body = {"model": model, "prompt": "Hello", "max_tokens": 2, **fields}
    return await http.post("/v1/completions", json=body)


async def test_stalled_bodies_get_408_at_the_read_deadline_and_the_other_tenant_is_served(
    launcher: Launched, model: str
) -> None:
    stalled = [await Raw.open(launcher) for _ in range(MAX_CONCURRENT_RPCS)]
    try:
        for raw in stalled:
            request = head(
                launcher,
                "POST",
                "/v1/completions",
                TENANT_A,
                Content_Type="application/json",
                Content_Length="100",
            )
            await raw.send(request + b'{"prompt":')  # 10 of the 100 bytes, then nothing
        await asyncio.sleep(0.5)  # the server reads their headers and takes their slots
        async with client(launcher, TENANT_B) as b:
            refused = await complete(b, model)
            assert refused.status_code == 503, refused.text  # A holds every slot
            started = time.monotonic()
            answers = await asyncio.gather(
                *(raw.until_closed(READ_TIMEOUT + SLACK) for raw in stalled)
            )
            waited = time.monotonic() - started
            for data in answers:
                status, body = answer(data)
                assert status == 408, data
                assert "--request-read-timeout" in body["error"]["message"], body
            # The slots came back with the 408s: B is served.
            served = await complete(b, model)
            assert served.status_code == 200, served.text
        assert waited <= READ_TIMEOUT + SLACK
    finally:
        for raw in stalled:
            await raw.close()


async def test_a_stalled_body_gives_its_slot_to_another_tenant_at_once(
    launcher: Launched, model: str
) -> None:
    # A refusal in another test counts its tenant as wanting the slots for a
    # while, which would hold A to half of them: A must be alone to fill them.
    await asyncio.sleep(DEFAULT_WANT_WINDOW)
    stalled = [await Raw.open(launcher) for _ in range(MAX_CONCURRENT_RPCS)]
    try:
        for raw in stalled:
            request = head(
                launcher,
                "POST",
                "/v1/completions",
                TENANT_A,
                Content_Type="application/json",
                Content_Length="100",
            )
            await raw.send(request + b'{"prompt":')
        # Still past STILL_AFTER_S, well within the read deadline: A holds every
        # slot and moves none of them, while B wants one.
        await asyncio.sleep(STILL_AFTER_S + 0.3)
        async with client(launcher, TENANT_B) as b:
            served = await complete(b, model)
            assert served.status_code == 200, served.text
        answers = await asyncio.gather(*(raw.until_closed(READ_TIMEOUT + SLACK) for raw in stalled))
        taken = [answer(data) for data in answers if b"slot taken back" in data]
        assert len(taken) == 1, answers
        status, body = taken[0]
        assert status == 408
        assert "tenant" in body["error"]["message"] and "call slots" in body["error"]["message"]
    finally:
        for raw in stalled:
            await raw.close()
        await asyncio.sleep(DEFAULT_WANT_WINDOW)  # B wanted the slots: let it pass


async def test_a_connection_stalled_in_its_headers_is_closed(launcher: Launched) -> None:
    partial, silent, kept, slow = [await Raw.open(launcher) for _ in range(4)]
    try:
        # Part of a request line and headers, then nothing.
        await partial.send(head(launcher, "POST", "/v1/completions", TENANT_A)[:-2])
        # A kept-alive connection's next request stalls after its first bytes:
        # uvicorn's keep-alive timer stops at the first byte.
        await kept.send(head(launcher, "GET", "/health", None))
        first = await asyncio.wait_for(kept.reader.readuntil(b"\r\n\r\n"), SLACK)
        assert first.startswith(b"HTTP/1.1 200"), first
        kept.opened = time.monotonic()
        await kept.send(b"GET /heal")

        async def headers_in_two_parts() -> bytes:
            request = head(launcher, "GET", "/health", None)
            await slow.send(request[:10])
            await asyncio.sleep(HEADER_TIMEOUT / 3)
            await slow.send(request[10:])
            return await asyncio.wait_for(slow.reader.readuntil(b"\r\n\r\n"), SLACK)

        in_time = await headers_in_two_parts()
        assert in_time.startswith(b"HTTP/1.1 200"), in_time
        for raw, closing in ((partial, True), (kept, True), (silent, False)):
            data = await raw.until_closed(HEADER_TIMEOUT + SLACK)
            assert time.monotonic() - raw.opened >= HEADER_TIMEOUT * 0.9
            if closing:  # part of a request came: told why
                status, body = answer(data)
                assert status == 408, data
                assert "--http-header-timeout" in body["error"]["message"], body
            else:  # nothing came: closed without a word
                assert data == b"", data
    finally:
        for raw in (partial, silent, kept, slow):
            await raw.close()


async def test_connections_past_the_cap_are_refused_at_once(launcher: Launched) -> None:
    extra = 4
    opened = [await Raw.open(launcher) for _ in range(MAX_CONNECTIONS + extra)]
    try:

        async def first_bytes(raw: Raw) -> bytes:
            with contextlib.suppress(asyncio.TimeoutError):
                return await asyncio.wait_for(raw.reader.read(), 1.0)
            return b""  # still open: accepted, waiting for a request

        sent = await asyncio.gather(*(first_bytes(raw) for raw in opened))
        refused = [data for data in sent if data.startswith(b"HTTP/1.1 503")]
        assert len(refused) >= extra, sent
        status, body = answer(refused[0])
        assert status == 503 and "--max-http-connections" in body["error"]["message"], body
    finally:
        for raw in opened:
            await raw.close()
    # Connections closed are connections free.
    async with client(launcher, TENANT_A) as a:
        assert (await a.get("/v1/models")).status_code == 200


async def test_a_constraint_past_the_budget_is_refused_at_once_naming_the_flag(
    launcher: Launched, model: str
) -> None:
    schema = {
        "type": "object",
        "properties": {f"property_{i}": {"type": "string"} for i in range(200)},
    }
    assert len(json.dumps(schema)) > MAX_CONSTRAINT_BYTES
    async with client(launcher, TENANT_A) as a:
        for fields, field in (
            ({"structured_outputs": {"json": schema}}, "structured_outputs.json"),
            (
                {
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "big", "schema": schema},
                    }
                },
                "structured_outputs.json",
            ),
            (
                {"structured_outputs": {"choice": ["x" * 100] * 50}},
                "structured_outputs.choice",
            ),
        ):
            started = time.monotonic()
            refused = await complete(a, model, **fields)
            assert time.monotonic() - started < SLACK
            assert refused.status_code == 400, refused.text
            message = refused.json()["error"]["message"]
            assert message.startswith(f"{field}:"), message
            assert "--max-constraint-bytes" in message, message
        served = await complete(a, model, structured_outputs={"choice": ["yes", "no"]})
        assert served.status_code == 200, served.text


async def test_tokenize_and_detokenize_past_the_render_budgets_are_refused_naming_the_flag(
    launcher: Launched, model: str
) -> None:
    chat = [{"role": "user", "content": "hello"}]
    cases: list[tuple[str, dict[str, Any], str, str]] = [
        (
            "/tokenize",
            {"prompt": "x " * (MAX_RENDER_CHARS // 2 + 1)},
            "prompt",
            "--max-render-chars",
        ),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "y" * (MAX_RENDER_CHARS + 1)}]},
            "messages",
            "--max-render-chars",
        ),
        (
            "/tokenize",
            {"messages": chat * (MAX_RENDER_ITEMS + 1)},
            "messages",
            "--max-render-items",
        ),
        (
            "/detokenize",
            {"tokens": [1] * (MAX_DERENDER_TOKENS + 1)},
            "tokens",
            "--max-derender-tokens",
        ),
    ]
    async with client(launcher, TENANT_A) as a:
        for path, body, field, flag in cases:
            refused = await a.post(path, json={"model": model, **body})
            assert refused.status_code == 400, (path, refused.text)
            error = refused.json()["error"]
            assert error["message"].startswith(f"{field}:") and flag in error["message"], error
            assert error["param"] == field, error
        tokens = await a.post("/tokenize", json={"model": model, "prompt": "x " * 100})
        assert tokens.status_code == 200, tokens.text
        text = await a.post("/detokenize", json={"model": model, "tokens": tokens.json()["tokens"]})
        assert text.status_code == 200, text.text


async def test_metrics_need_a_key_when_keys_are_set(launcher: Launched) -> None:
    async with client(launcher, None) as anyone:
        assert (await anyone.get("/metrics")).status_code == 401
        wrong = await anyone.get("/metrics", headers=dict(bearer("wrong-key-0123456789")))
        assert wrong.status_code == 401
        assert (await anyone.get("/health")).status_code == 200  # probes stay keyless
    async with client(launcher, TENANT_B) as b:
        page = await b.get("/metrics")
        assert page.status_code == 200, page.text
        assert "vllm:" in page.text


async def test_the_scale_out_abort_stops_only_the_callers_own_requests(
    launcher: Launched, model: str
) -> None:
    body = {"model": model, "prompt": "Hello", "max_tokens": 400, "ignore_eos": True}
    body["stream"] = True
    async with client(launcher, TENANT_A) as a, client(launcher, TENANT_B) as b:
        running = {"abort-kept": asyncio.Event(), "abort-stopped": asyncio.Event()}

        async def finish_reason(request_id: str) -> str | None:
            headers = {"X-Request-Id": request_id}
            reason = None
            async with a.stream("POST", "/v1/completions", json=body, headers=headers) as reply:
                assert reply.status_code == 200
                async for line in reply.aiter_lines():
                    if line.startswith("data: {"):
                        running[request_id].set()
                        choice = json.loads(line[6:])["choices"][0]
                        reason = choice.get("finish_reason") or reason
            return reason

        kept = asyncio.ensure_future(finish_reason("abort-kept"))
        stopped = asyncio.ensure_future(finish_reason("abort-stopped"))
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in running.values())), 60)
        # B names A's running request: left alone, as an unknown id is.
        refused = await b.post(
            "/inference/v1/abort_requests", json={"request_ids": ["cmpl-abort-kept-0"]}
        )
        assert refused.status_code == 200
        # A stops its own.
        own = await a.post(
            "/inference/v1/abort_requests", json={"request_ids": ["cmpl-abort-stopped-0"]}
        )
        assert own.status_code == 200
        assert await asyncio.wait_for(kept, 120) == "length"
        assert await asyncio.wait_for(stopped, 120) != "length"
        # More ids than --max-abort-ids are refused before any is looked up.
        many = {"request_ids": [f"id-{i}" for i in range(MAX_ABORT_IDS + 1)]}
        past = await b.post("/inference/v1/abort_requests", json=many)
        assert past.status_code == 400, past.text
        assert "--max-abort-ids" in past.json()["error"]["message"]


async def test_an_answer_its_client_does_not_read_ends_and_gives_its_slots_back(
    launcher: Launched, model: str
) -> None:
    # A client that reads nothing: a small receive buffer, never read, and an
    # answer of megabytes (32 sequences with their logprobs), past what the
    # connection's buffers hold.
    url = urlsplit(launcher.http_url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (url.hostname, url.port))
    body = json.dumps(
        {"model": model, "prompt": "Hello", "max_tokens": 400, "ignore_eos": True,
         "n": 32, "logprobs": 20, "stream": True}
    ).encode()  # fmt: skip
    request = head(
        launcher, "POST", "/v1/completions", TENANT_A,
        Content_Type="application/json", Content_Length=str(len(body)),
    )  # fmt: skip
    try:
        await asyncio.get_running_loop().sock_sendall(sock, request + body)
        async with grpc.aio.insecure_channel(launcher.address) as channel:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)

            async def active() -> int:
                info = await stub.GetServerInfo(
                    vllm_engine_pb2.GetServerInfoRequest(), metadata=bearer(TENANT_B)
                )
                return int(info.active_requests)

            assert await _eventually(lambda: active(), lambda n: n > 0, 30)
            # Its answer fills the buffers, uvicorn's send waits, and at the write
            # deadline the request ends: its engine requests and slots are let go.
            assert await _eventually(lambda: active(), lambda n: n == 0, WRITE_TIMEOUT + 60)
    finally:
        sock.close()


async def _eventually(read: Any, good: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if good(await read()):
            return True
        await asyncio.sleep(0.25)
    return False


def test_every_content_parts_media_uuid_is_keyed_and_nothing_else() -> None:
    """A part without a `type` and a uuid that is no string are vLLM's media
    uuids all the same; a tool schema's `uuid` property is not one."""
    body = {
        "messages": [
            {"role": "user", "content": [{"image_url": None, "uuid": "img-1"}, {"uuid": 7}]},
            {"role": "user", "content": [{"type": "image_url", "uuid": "img-2"}]},
        ],
        "tools": [{"function": {"parameters": {"properties": {"uuid": {"type": "string"}}}}}],
        "content_parts": [{"type": "image_url", "url": "data:,", "uuid": "img-3"}],
    }
    assert keyed_body_uuids(body, "tenant-a")
    parts = [*body["messages"][0]["content"], *body["messages"][1]["content"]]
    parts += body["content_parts"]
    expected = ["img-1", "7", "img-2", "img-3"]
    assert [p["uuid"] for p in parts] == [tenant_media_uuid("tenant-a", u) for u in expected]
    schema = body["tools"][0]["function"]["parameters"]["properties"]
    assert schema == {"uuid": {"type": "string"}}


async def test_precomputed_multimodal_features_are_a_routers(launcher: Launched) -> None:
    body = {"token_ids": [1, 2, 3], "features": {"mm_hashes": {"image": ["another-tenants"]}}}
    async with client(launcher, TENANT_B) as b:
        refused = await b.post("/inference/v1/generate", json=body)
    assert refused.status_code == 403, refused.text
    assert refused.json()["error"]["message"].startswith("features: ")
