"""vLLM's HTTP API fetches no media over http(s) unless the operator lists domains.

The launcher's HTTP API (`HttpApi`, as `--http-port` builds it) on the
session's tiny vision model, called over HTTP with an `image_url` on a web
server of this test's on 127.0.0.1, a stand-in for the server's own network
(a metadata service, an admin page). The web server records every request,
so "not fetched" is seen at the source. With `--allowed-media-domains`
(vLLM's own option, read from the engine's model config) the listed domain
is fetched, and a redirect out of it is not followed.

A chat image part's `uuid` is vLLM's cache key for the image: with two
tenants' keys, a tenant must not run on the image another sent under the
same uuid. vLLM renders the chat, its multimodal processor reading the
uuids, before the engine guard sees the prompt (`GuardedEngine.generate`),
so the HTTP front keys them in the body (`prefix_cache.keyed_body_uuids`);
the gRPC protocols key them before rendering too (test_images.py).
"""

from __future__ import annotations

import base64
import http.server
import io
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from vllm_servicer.interceptors.api_keys import ApiKeyVerifier
from vllm_servicer.serve.args import parse_args
from vllm_servicer.serve.http_api import HttpApi

# vLLM puts the image's placeholder into the text of a "string" chat template.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


def _png() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (40, 50), (255, 0, 0)).save(out, format="PNG")
    return out.getvalue()


@dataclass
class Web:
    url: str
    requested: list[str] = field(default_factory=list)


@pytest.fixture
def web() -> Iterator[Web]:
    """A web server on 127.0.0.1: /red.png, and /elsewhere redirecting to it."""
    png = _png()
    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            seen.append(self.path)
            if self.path == "/elsewhere":
                self.send_response(302)
                self.send_header("Location", "/red.png")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(png)))
            self.end_headers()
            self.wfile.write(png)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield Web(f"http://127.0.0.1:{httpd.server_address[1]}", seen)
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="module")
async def http_url(vlm_engine: Any, vlm_dir: Path) -> AsyncIterator[str]:
    args = parse_args(
        ["serve", "--model", str(vlm_dir), "--http-port", "0", "--chat-template", CHAT_TEMPLATE]
    )
    api = await HttpApi.build(vlm_engine, args, host="127.0.0.1", port=0)
    await api.start()
    try:
        yield f"http://127.0.0.1:{api.port}"
    finally:
        await api.stop(0)


async def _chat(http_url: str, image_url: str) -> httpx.Response:
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": image_url}},
                    {"type": "text", "text": "What is in this picture?"},
                ],
            }
        ],
        "max_completion_tokens": 2,
        "temperature": 0,
    }
    async with httpx.AsyncClient(timeout=120) as client:
        return await client.post(f"{http_url}/v1/chat/completions", json=body)


@pytest.fixture
def domains(vlm_engine: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Set the engine's `--allowed-media-domains` for one test."""

    def allow(*names: str) -> None:
        monkeypatch.setattr(vlm_engine.model_config, "allowed_media_domains", list(names))

    return allow


async def test_an_image_url_is_not_fetched_without_allowed_domains(http_url: str, web: Web) -> None:
    reply = await _chat(http_url, f"{web.url}/red.png")
    assert reply.status_code == 400, reply.text
    assert "--allowed-media-domains" in reply.text
    assert web.requested == []


async def test_an_inline_image_is_served_without_allowed_domains(http_url: str) -> None:
    inline = "data:image/png;base64," + base64.b64encode(_png()).decode()
    reply = await _chat(http_url, inline)
    assert reply.status_code == 200, reply.text


async def test_an_allowed_domain_is_fetched_and_a_redirect_is_not_followed(
    http_url: str, web: Web, domains: Any
) -> None:
    domains("127.0.0.1")
    reply = await _chat(http_url, f"{web.url}/red.png")
    assert reply.status_code == 200, reply.text
    assert web.requested == ["/red.png"]
    reply = await _chat(http_url, f"{web.url}/elsewhere")
    assert reply.status_code != 200, reply.text
    assert web.requested == ["/red.png", "/elsewhere"]


async def test_another_domain_is_refused_by_vllms_own_list(
    http_url: str, web: Web, domains: Any
) -> None:
    domains("media.example.com")
    reply = await _chat(http_url, f"{web.url}/red.png")
    assert reply.status_code == 400, reply.text
    assert web.requested == []


# ----- media uuids -------------------------------------------------------------------------

TENANT_A = "http-media-tenant-a-0123456789abcdefABCDEF"
TENANT_B = "http-media-tenant-b-0123456789abcdefABCDEF"


@pytest.fixture(scope="module")
async def tenants_url(vlm_engine: Any, vlm_dir: Path) -> AsyncIterator[str]:
    args = parse_args(
        ["serve", "--model", str(vlm_dir), "--http-port", "0", "--chat-template", CHAT_TEMPLATE]
    )
    keys = ApiKeyVerifier({"tenant-a": TENANT_A, "tenant-b": TENANT_B})
    api = await HttpApi.build(vlm_engine, args, host="127.0.0.1", port=0, verifier=keys)
    await api.start()
    try:
        yield f"http://127.0.0.1:{api.port}"
    finally:
        await api.stop(0)


def _inline(color: tuple[int, int, int]) -> str:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (40, 50), color).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


async def _chat_tokens(url: str, key: str, image: str, name: str = "") -> list[int]:
    part: dict[str, Any] = {"type": "image_url", "image_url": {"url": image}}
    if name:
        part["uuid"] = name
    body = {
        "messages": [{"role": "user", "content": [part, {"type": "text", "text": "What?"}]}],
        "max_completion_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    async with httpx.AsyncClient(timeout=120) as client:
        reply = await client.post(
            f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        )
    assert reply.status_code == 200, reply.text
    return list(reply.json()["choices"][0]["token_ids"])


async def test_another_tenants_uuid_runs_the_senders_own_image(tenants_url: str) -> None:
    name = f"photo-{uuid.uuid4()}"  # the session engine's caches outlive this test
    red, blue = _inline((255, 0, 0)), _inline((0, 0, 255))
    a_red = await _chat_tokens(tenants_url, TENANT_A, red)
    b_blue = await _chat_tokens(tenants_url, TENANT_B, blue)
    assert a_red != b_blue
    assert await _chat_tokens(tenants_url, TENANT_A, red, name) == a_red
    # Before: B's blue image under A's uuid gave A's red image's tokens.
    assert await _chat_tokens(tenants_url, TENANT_B, blue, name) == b_blue
