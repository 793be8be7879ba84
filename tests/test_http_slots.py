"""vLLM's HTTP API holds the call slots, the body size and `n` as gRPC does, at
the launcher as shipped.

Two tenants' keys, `--http-port`, `--max-concurrent-rpcs 8`. Before, an HTTP
request took no call slot at all (only an in-flight slot, once vLLM's handler
had parsed, templated and tokenized it and called the engine): tenant A could
hold any number of requests on the serving process, bodies had no size limit
(a `Content-Length` past any limit was awaited, a chunked body read to its
end), and `n` had no budget (vLLM takes up to 16,384 sequences in one request).
Here A's requests whose bodies arrive slowly hold A's share of the slots, and
A's next one, HTTP or gRPC, is refused while B is served.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import grpc
import httpx
import pytest
from support import bearer
from support.launcher import START_TIMEOUT, Launched, launched, launcher_env

from vllm_servicer.proto import vllm_engine_pb2, vllm_engine_pb2_grpc

pytestmark = pytest.mark.timeout(START_TIMEOUT + 300)

TENANT_A = "httpslots-tenant-a-0123456789abcdef"
TENANT_B = "httpslots-tenant-b-0123456789abcdef"
MAX_CONCURRENT_RPCS = 8
SHARE = MAX_CONCURRENT_RPCS // 2  # each of two tenants wanting slots
MAX_N = 2
MAX_MESSAGE_BYTES = 64 * 1024
ANSWER_WAIT = 30.0  # wide: the server answers at once, the machine may be busy


@pytest.fixture(scope="module")
async def launcher(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Launched]:
    flags = ["--http-port", "0", "--api-key", TENANT_A, "--api-key", TENANT_B]
    flags += ["--max-concurrent-rpcs", str(MAX_CONCURRENT_RPCS), "--max-n", str(MAX_N)]
    flags += ["--max-message-bytes", str(MAX_MESSAGE_BYTES)]
    async with launched(*flags, env=launcher_env(tmp_path_factory.mktemp("cache"))) as served:
        yield served


@pytest.fixture(scope="module")
async def model(launcher: Launched) -> str:
    async with client(launcher, TENANT_A) as http:
        reply = await http.get("/v1/models")
    return str(reply.json()["data"][0]["id"])


def client(launcher: Launched, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=launcher.http_url, headers=dict(bearer(key)), timeout=120)


class RawRequest:
    """An HTTP/1.1 request over a socket of its own, its body sent as the test likes."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(
        cls, launcher: Launched, key: str, path: str, headers: dict[str, str]
    ) -> RawRequest:
        url = urlsplit(launcher.http_url)
        reader, writer = await asyncio.open_connection(url.hostname, url.port)
        lines = [f"POST {path} HTTP/1.1", f"Host: {url.netloc}", f"Authorization: Bearer {key}"]
        lines += ["Content-Type: application/json", *(f"{k}: {v}" for k, v in headers.items())]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        await writer.drain()
        return cls(reader, writer)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def answer(self) -> tuple[int, dict[str, str], Any]:
        """The response's status, headers and JSON body, within `ANSWER_WAIT` s."""
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), ANSWER_WAIT)
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        headers = dict(
            (name.lower(), value.strip())
            for name, _, value in (line.partition(":") for line in header_lines if line)
        )
        length = int(headers.get("content-length", "0"))
        body = await asyncio.wait_for(self.reader.readexactly(length), ANSWER_WAIT)
        return int(status_line.split()[1]), headers, json.loads(body) if body else None

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


@contextlib.asynccontextmanager
async def slow_bodies(launcher: Launched, key: str, count: int) -> AsyncIterator[None]:
    """`count` completions whose bodies never arrive whole, closed at the end."""
    requests = []
    try:
        for _ in range(count):
            raw = await RawRequest.open(
                launcher, key, "/v1/completions", {"Content-Length": "1000"}
            )
            await raw.send(b'{"prompt": "')
            requests.append(raw)
        await asyncio.sleep(1)  # the server reads their headers and takes their slots
        yield
    finally:
        for raw in requests:
            await raw.close()


async def complete(http: httpx.AsyncClient, model: str, **fields: Any) -> httpx.Response:
    body = {"model": model, "prompt": "Hello", "max_tokens": 2, **fields}
    return await http.post("/v1/completions", json=body)


async def test_a_tenant_past_its_share_of_call_slots_is_refused_the_other_served(
    launcher: Launched, model: str
) -> None:
    async with client(launcher, TENANT_A) as a, client(launcher, TENANT_B) as b:
        async with slow_bodies(launcher, TENANT_B, 1), slow_bodies(launcher, TENANT_A, SHARE):
            refused = await complete(a, model)
            assert refused.status_code == 503, refused.text
            error = refused.json()["error"]
            assert error["code"] == 503 and "share" in error["message"], error
            assert "--max-concurrent-rpcs" in error["message"], error
            assert refused.headers["retry-after"] == "1"
            # One pool for both protocols: A's gRPC call meets the same share.
            async with grpc.aio.insecure_channel(launcher.address) as channel:
                stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as grpc_refused:
                    await stub.GetModelInfo(
                        vllm_engine_pb2.GetModelInfoRequest(), metadata=bearer(TENANT_A)
                    )
            assert grpc_refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "share" in (grpc_refused.value.details() or "")
            # What costs nothing stays outside the slots.
            assert (await a.get("/v1/models")).status_code == 200
            served = await complete(b, model)
            assert served.status_code == 200, served.text
        # The slots come back when A's requests end: A is served again.
        for _ in range(int(ANSWER_WAIT)):
            again = await complete(a, model)
            if again.status_code != 503:
                break
            await asyncio.sleep(1)
        assert again.status_code == 200, again.text


async def test_a_body_declared_past_the_message_limit_is_refused_before_it_is_read(
    launcher: Launched,
) -> None:
    raw = await RawRequest.open(
        launcher, TENANT_A, "/v1/completions", {"Content-Length": str(MAX_MESSAGE_BYTES + 1)}
    )
    try:
        status, _, body = await raw.answer()  # not a byte of the body sent
    finally:
        await raw.close()
    assert status == 413, body
    assert body["error"]["code"] == 413 and "--max-message-bytes" in body["error"]["message"]


async def test_a_chunked_body_past_the_message_limit_is_refused_as_it_streams(
    launcher: Launched,
) -> None:
    raw = await RawRequest.open(
        launcher, TENANT_A, "/v1/completions", {"Transfer-Encoding": "chunked"}
    )
    try:
        chunk = b" " * 16384
        for _ in range(MAX_MESSAGE_BYTES // len(chunk) + 1):  # never the last chunk
            await raw.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        status, _, body = await raw.answer()
    finally:
        await raw.close()
    assert status == 413, body
    assert "--max-message-bytes" in body["error"]["message"]


async def test_http_n_past_the_budget_is_refused_naming_n(launcher: Launched, model: str) -> None:
    async with client(launcher, TENANT_A) as a:
        refused = await complete(a, model, n=MAX_N + 1, max_tokens=1)
        assert refused.status_code == 400, refused.text
        message = refused.json()["error"]["message"]
        assert message.startswith("n:") and "--max-n" in message, message
        served = await complete(a, model, n=MAX_N, max_tokens=1)
        assert served.status_code == 200, served.text
