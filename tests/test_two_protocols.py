"""One engine, both protocols: `serve --http-port` from outside the launcher's process.

vLLM's own OpenAI client over HTTP and the generated stubs over gRPC talk to
one launcher at once; the answers, the engine's counters, the keys and the
drain are checked on both sides.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import ssl
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import bearer, free_port, request
from support.launcher import ROOT, Launched, launch, launched

from vllm_servicer.proto import vllm_engine_pb2 as pb
from vllm_servicer.proto import vllm_engine_pb2_grpc
from vllm_servicer.serve.args import parse_args
from vllm_servicer.serve.http_api import frontend_args, uvicorn_config
from vllm_servicer.serve.http_front import Front
from vllm_servicer.serve.stack import key_verifier as _key_verifier

KEY = "two-protocols-0123456789abcdefABCDEF"
PROMPTS = [[5, 17, 42, 99, 7, 63, 21, 88], [11, 12, 13], [200, 3, 150, 77, 9]]
# Enough for /v1/chat/completions on the tiny model, whose tokenizer has none.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    return {**environ, "VLLM_SERVICER_CACHE": str(tmp_path_factory.mktemp("cache"))}


@pytest.fixture(scope="module")
async def launcher(env: dict[str, str]) -> AsyncIterator[Launched]:
    flags = ("--http-port", "0", "--metrics-port", "0", "--api-key", KEY)
    async with launched(*flags, "--chat-template", CHAT_TEMPLATE, env=env) as served:
        yield served


@pytest.fixture(scope="module")
async def stub(launcher: Launched) -> AsyncIterator[vllm_engine_pb2_grpc.VllmEngineStub]:
    async with grpc.aio.insecure_channel(launcher.address) as channel:
        yield vllm_engine_pb2_grpc.VllmEngineStub(channel)


@pytest.fixture(scope="module")
async def client(launcher: Launched) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=f"{launcher.http_url}/v1", api_key=KEY, max_retries=0, timeout=120
    ) as client:
        yield client


@pytest.fixture(scope="module")
async def model(client: openai.AsyncOpenAI) -> str:
    models = await client.models.list()
    return models.data[0].id


AUTH = bearer(KEY)


async def _grpc_tokens(stub: Any, prompt: list[int], max_tokens: int) -> list[int]:
    call = stub.Generate(
        request(prompt, stream=True, max_tokens=max_tokens, ignore_eos=True), metadata=AUTH
    )
    tokens: list[int] = []
    async for message in call:
        if message.HasField("chunk"):
            tokens.extend(message.chunk.token_ids)
        else:
            assert message.complete.finish_reason == "length"
    return tokens


async def _http_tokens(
    client: openai.AsyncOpenAI, model: str, prompt: list[int], max_tokens: int, stream: bool
) -> list[int]:
    extra = {"return_token_ids": True, "ignore_eos": True}
    if not stream:
        reply = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=extra
        )
        assert reply.choices[0].finish_reason == "length"
        return list(reply.choices[0].token_ids)  # type: ignore[attr-defined]
    tokens: list[int] = []
    chunks = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body=extra,
    )
    async for chunk in chunks:
        tokens.extend(getattr(chunk.choices[0], "token_ids", None) or [])
    return tokens


async def test_greedy_answers_are_the_same_over_both_protocols_at_once(
    stub: Any, client: openai.AsyncOpenAI, model: str
) -> None:
    """Each prompt asked over gRPC and over HTTP (plain and streamed), all at once."""
    calls = []
    for prompt in PROMPTS:
        calls.append(_grpc_tokens(stub, prompt, 24))
        calls.append(_http_tokens(client, model, prompt, 24, stream=False))
        calls.append(_http_tokens(client, model, prompt, 24, stream=True))
    answers = await asyncio.gather(*calls)
    for i, prompt in enumerate(PROMPTS):
        over_grpc, over_http, over_http_stream = answers[3 * i : 3 * i + 3]
        assert len(over_grpc) == 24, prompt
        assert over_http == over_grpc, prompt
        assert over_http_stream == over_grpc, prompt
    assert len({tuple(a) for a in answers}) == len(PROMPTS)


async def test_chat_completions_and_tokenize_are_served(
    launcher: Launched, client: openai.AsyncOpenAI, model: str
) -> None:
    reply = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 5
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {KEY}"}) as http:
        tokens = await http.post(
            f"{launcher.http_url}/tokenize", json={"model": model, "prompt": "Hello"}
        )
    assert tokens.status_code == 200 and tokens.json()["tokens"]


def _samples(text: str, name: str) -> list[tuple[str, float]]:
    """(labels, value) of every sample of a metric in Prometheus text format."""
    found = []
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(\{{.*\}})? (\S+)$", line)
        if match:
            found.append((match.group(1) or "", float(match.group(2))))
    return found


def _total(text: str, name: str, label: str = "") -> float:
    return sum(value for labels, value in _samples(text, name) if label in labels)


async def _scrape(url: str) -> str:
    # The HTTP API's /metrics needs a key when keys are set; the metrics port none.
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {KEY}"}) as http:
        reply = await http.get(url)
    assert reply.status_code == 200
    return reply.text


async def test_one_scrape_counts_both_protocols(
    launcher: Launched, stub: Any, client: openai.AsyncOpenAI, model: str
) -> None:
    """The engine's success counter grows by the calls of both protocols together."""
    generate = 'grpc_method="Generate"'
    before = await _scrape(f"{launcher.http_url}/metrics")
    await asyncio.gather(
        *(_grpc_tokens(stub, PROMPTS[0], 4) for _ in range(3)),
        *(_http_tokens(client, model, PROMPTS[1], 4, stream=False) for _ in range(2)),
    )
    for url in (f"{launcher.http_url}/metrics", launcher.metrics_url):
        after = await _scrape(url)
        # Both families in one scrape, wherever it is taken.
        assert _samples(after, "vllm:num_requests_running"), url
        assert _total(after, "grpc_server_handled_total", generate) >= 3, url
    # Cancelled requests count there too, as finished_reason="abort".
    success, length = "vllm:request_success_total", 'finished_reason="length"'
    assert _total(after, success, length) - _total(before, success, length) == 5
    handled = "grpc_server_handled_total"
    assert _total(after, handled, generate) - _total(before, handled, generate) == 3


async def _idle(launcher: Launched, stub: Any) -> tuple[float, int]:
    """Wait for the engine and the servicer to hold no request; return what is left."""
    for _ in range(100):
        text = await _scrape(f"{launcher.http_url}/metrics")
        running = _total(text, "vllm:num_requests_running")
        running += _total(text, "vllm:num_requests_waiting")
        info = await stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=AUTH)
        if running == 0 and info.active_requests == 0:
            break
        await asyncio.sleep(0.1)
    return running, info.active_requests


@pytest.mark.parametrize("side", ["http", "grpc"])
async def test_a_cancel_on_either_side_leaves_the_engine_idle(
    launcher: Launched, stub: Any, client: openai.AsyncOpenAI, model: str, side: str
) -> None:
    long = request(PROMPTS[0], stream=True, max_tokens=400, ignore_eos=True)
    other = stub.Generate(long, metadata=AUTH)
    assert (await other.read()).HasField("chunk")
    if side == "grpc":
        call = stub.Generate(
            request(PROMPTS[1], stream=True, max_tokens=400, ignore_eos=True), metadata=AUTH
        )
        assert (await call.read()).HasField("chunk")
        call.cancel()
    else:
        chunks = await client.completions.create(
            model=model,
            prompt=PROMPTS[1],
            max_tokens=400,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        seen = 0
        async for _ in chunks:
            seen += 1
            if seen == 3:
                break
        await chunks.close()
    # The other protocol's request runs on, then is cancelled too.
    assert (await other.read()).HasField("chunk")
    other.cancel()
    assert await _idle(launcher, stub) == (0, 0)


async def test_keys_guard_both_protocols(launcher: Launched, stub: Any) -> None:
    url = launcher.http_url
    async with httpx.AsyncClient() as http:
        for headers in ({}, {"authorization": "Bearer wrong-key"}):
            reply = await http.get(f"{url}/v1/models", headers=headers)
            assert reply.status_code == 401, headers
        accepted = await http.get(f"{url}/v1/models", headers={"authorization": f"Bearer {KEY}"})
        assert accepted.status_code == 200
        # Probes need no key, metrics any key; paths that administer need an admin key.
        assert (await http.get(f"{url}/health")).status_code == 200
        assert (await http.get(f"{url}/metrics")).status_code == 401
        keyed = await http.get(f"{url}/metrics", headers={"authorization": f"Bearer {KEY}"})
        assert keyed.status_code == 200
        pause = await http.post(f"{url}/pause", headers={"authorization": f"Bearer {KEY}"})
        assert pause.status_code == 403
    for metadata in ((), bearer("wrong-key")):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert (await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=AUTH)).model_path


async def _stream_grpc(stub: Any, max_tokens: int, started: asyncio.Event) -> tuple[str, int]:
    call = stub.Generate(request(stream=True, max_tokens=max_tokens, ignore_eos=True))
    finish, tokens = "", 0
    async for message in call:
        if message.HasField("chunk"):
            tokens += len(message.chunk.token_ids)
            started.set()
        else:
            finish = message.complete.finish_reason
    return finish, tokens


async def _stream_http(
    client: openai.AsyncOpenAI, max_tokens: int, started: asyncio.Event
) -> tuple[str, int]:
    model = (await client.models.list()).data[0].id
    chunks = await client.completions.create(
        model=model,
        prompt=PROMPTS[0],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    finish, tokens = "", 0
    async for chunk in chunks:
        tokens += len(getattr(chunk.choices[0], "token_ids", None) or [])
        finish = chunk.choices[0].finish_reason or finish
        if tokens:
            started.set()
    return finish, tokens


async def test_sigterm_drains_both_protocols_and_exits_zero(env: dict[str, str]) -> None:
    """Streams on both sides in flight when both stop accepting finish; exit 0."""
    tokens = 600  # seconds of streaming here: past the grace period
    flags = ("--http-port", "0", "--max-model-len", "1024", "--drain-grace", "0.5")
    served = await launch(
        *flags,
        "--shutdown-timeout",
        "60",
        env={**env, "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"},
        keep=None,  # all of it: the drain's lines
    )
    proc, url, tail = served.proc, served.http_url, served.output
    try:
        async with (
            grpc.aio.insecure_channel(served.address) as channel,
            openai.AsyncOpenAI(
                base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120
            ) as client,
            httpx.AsyncClient() as http,
        ):
            started = [asyncio.Event(), asyncio.Event()]
            streams = [
                asyncio.ensure_future(
                    _stream_grpc(vllm_engine_pb2_grpc.VllmEngineStub(channel), tokens, started[0])
                ),
                asyncio.ensure_future(_stream_http(client, tokens, started[1])),
            ]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.2)
            # Inside the grace period: HTTP health says draining, as gRPC health does.
            assert (await http.get(f"{url}/health")).status_code == 503
            results = await asyncio.gather(*streams)
            assert results == [("length", tokens), ("length", tokens)], "".join(tail)
            with pytest.raises(httpx.TransportError):
                await http.get(f"{url}/health")
        assert await asyncio.wait_for(proc.wait(), 60) == 0, "".join(tail)
        await asyncio.sleep(0.5)
        assert served.reader is not None
        served.reader.cancel()
        log = "".join(tail)
        # Both were still streaming when both stopped accepting (one count for both).
        assert re.search(r"refusing new calls; waiting up to [\d.]+ s for 2 in flight", log), log
        assert "Waiting for connections to close" in log, log
        assert log.index("HTTP API stopped") < log.index("shutting down the engine"), log
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_grpc_beside_an_http_app_starts_and_stops_with_its_lifespan() -> None:
    """The example's `add_grpc()` on a bare FastAPI app (a stand-in engine: wiring only)."""
    sys.path.insert(0, str(ROOT / "examples"))
    from fastapi import FastAPI
    from grpc_beside_http import add_grpc

    from vllm_servicer.testing.stand_in import FaultEngine

    app = FastAPI()
    address = f"127.0.0.1:{free_port()}"
    add_grpc(app, FaultEngine(), address)
    async with app.router.lifespan_context(app):
        async with grpc.aio.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            reply = await health.Check(health_pb2.HealthCheckRequest())
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            assert await _tokens_of(stub.Generate(request(max_tokens=3)))
    async with grpc.aio.insecure_channel(address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=2
            )
        assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


async def _tokens_of(call: Any) -> list[int]:
    return [t async for m in call if m.HasField("complete") for t in m.complete.output_ids]


# Without an engine: flags, keys and TLS settings of the HTTP side.


def test_http_api_is_off_by_default_and_its_flags_need_it() -> None:
    assert parse_args(["serve", "--model", "m"]).http.http_port is None
    for argv in (["--http-host", "0.0.0.0"], ["--http-port", "50051"]):
        with pytest.raises(SystemExit):
            parse_args(["serve", "--model", "m", *argv])
    # The chat template serves Render too: it needs no HTTP API.
    assert (
        parse_args(["serve", "--model", "m", "--chat-template", "x"]).options.chat.chat_template
        == "x"
    )


def test_vllm_frontend_args_carry_the_engine_settings_but_not_its_key_middleware() -> None:
    args = parse_args(["serve", "--model", "m", "--max-model-len", "256", "--api-key", KEY])
    served = frontend_args(args, "127.0.0.1", 8000)
    assert (served.model, served.max_model_len, served.port) == ("m", 256, 8000)
    assert served.api_key is None  # keys are checked by the launcher's verifier instead
    assert served.chat_template is None and served.disable_fastapi_docs is False


async def _echo(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


async def test_http_keys_are_the_grpc_verifier_with_admin_paths_for_admin_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_SERVICER_ADMIN_API_KEY", raising=False)
    keys = tmp_path / "keys"
    keys.write_text("old-key-0123456789abcdef\n")
    admin = "admin-key-0123456789abcdef"
    args = parse_args(
        ["serve", "--model", "m", "--api-key-file", str(keys), "--admin-api-key", admin]
    )
    front = Front(_echo, _key_verifier(args))
    transport = httpx.ASGITransport(app=front)
    async with httpx.AsyncClient(transport=transport, base_url="http://x") as http:

        async def status(method: str, path: str, key: str | None) -> int:
            headers = {"authorization": f"Bearer {key}"} if key else {}
            return (await http.request(method, path, headers=headers)).status_code

        assert await status("GET", "/health", None) == 200
        assert await status("GET", "/metrics", None) == 401
        assert await status("GET", "/metrics", "old-key-0123456789abcdef") == 200
        assert await status("GET", "/v1/models", None) == 401
        assert await status("POST", "/tokenize", "nope-0123456789") == 401
        assert await status("POST", "/v1/completions", "old-key-0123456789abcdef") == 200
        assert await status("POST", "/pause", "old-key-0123456789abcdef") == 403
        assert await status("POST", "/pause", admin) == 200
        assert await status("POST", "/v1/completions", admin) == 200
        # The key file is re-read on change: rotation applies to HTTP too.
        keys.write_text("new-key-0123456789abcdef\n")
        assert await status("GET", "/v1/models", "old-key-0123456789abcdef") == 401
        assert await status("GET", "/v1/models", "new-key-0123456789abcdef") == 200
        front.draining = True
        assert await status("GET", "/health", None) == 503


def test_https_uses_the_grpc_certificate_and_client_ca(tmp_path: Path) -> None:
    from support.certs import CertificateAuthority

    ca = CertificateAuthority("test-ca")
    cert, key = ca.server().write(tmp_path, "server")
    ca_file = tmp_path / "ca.pem"
    ca_file.write_bytes(ca.pem)
    plain = uvicorn_config(_echo, "127.0.0.1", 0)
    assert not plain.is_ssl
    config = uvicorn_config(_echo, "127.0.0.1", 0, (str(cert), str(key), str(ca_file)))
    config.load()
    assert config.is_ssl and config.ssl is not None
    assert config.ssl.verify_mode == ssl.CERT_REQUIRED


def test_the_docs_show_the_example_function_as_it_is() -> None:
    source = (ROOT / "examples" / "grpc_beside_http.py").read_text()
    function = source[source.index("def add_grpc") : source.index("\n\n\nasync def main")]
    assert function in (ROOT / "docs" / "two-protocols.md").read_text()
