"""The launcher's callers: inference and admin keys, from flags, files and the environment,
and client certificates.

The interceptor stack is the one `python -m vllm_servicer serve` builds, on a
real server with the real engine: an inference key serves (loads, Abort of its
own requests), only a router or admin key reads KV events, only the admin key
flushes the cache, profiles, and aborts anyone's requests. A running request's id is its
caller's: another caller cannot start a request under it. With client
certificates and no keys, only the subjects named admin administer.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from support import bearer, collect, request
from support.certs import CertificateAuthority, Pem

from vllm_servicer import mount
from vllm_servicer.interceptors.auth import ADMIN_ROLE
from vllm_servicer.proto import common_pb2, vllm_engine_pb2_grpc
from vllm_servicer.proto import vllm_engine_pb2 as pb
from vllm_servicer.serve.args import parse_args
from vllm_servicer.serve.stack import build_interceptors
from vllm_servicer.serve.stack import http_verifier as _http_verifier
from vllm_servicer.tls import server_credentials, warn_if_exposed

TENANT_A = "tenant-a-0123456789abcdefABCDEF"
TENANT_B = "tenant-b-0123456789abcdefABCDEF"
ADMIN = "admin-0123456789abcdefABCDEF"
ROUTER = "router-0123456789abcdefABCDEF"


@pytest.fixture(autouse=True)
def _no_key_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_SERVICER_ADMIN_API_KEY", raising=False)


async def _serve(engine: Any, argv: list[str]) -> tuple[grpc.aio.Server, Any, str]:
    stack, _ = build_interceptors(parse_args(["serve", "--model", "m", *argv]))
    server = grpc.aio.server(interceptors=stack)
    mounted = mount(server, engine)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, mounted, f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
async def stub(
    engine: Any, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[vllm_engine_pb2_grpc.VllmEngineStub]:
    admin_file = tmp_path_factory.mktemp("admin") / "admin-keys"
    admin_file.write_text(f"ops: {ADMIN}\n")
    argv = ["--api-key", TENANT_A, "--api-key", TENANT_B, "--admin-api-key-file", str(admin_file)]
    server, mounted, address = await _serve(engine, [*argv, "--router-api-key", ROUTER])
    async with grpc.aio.insecure_channel(address) as channel:
        yield vllm_engine_pb2_grpc.VllmEngineStub(channel)
    await mounted.health.close()
    await server.stop(None)


async def _code(call: Any) -> grpc.StatusCode:
    """The status a unary call or the first read of a stream ends with."""
    try:
        if hasattr(call, "read"):
            await call.read()
            call.cancel()
        else:
            await call
    except grpc.aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def _admin_calls(stub: Any, metadata: Any) -> dict[str, Any]:
    return {
        "FlushCache": lambda: stub.FlushCache(common_pb2.FlushCacheRequest(), metadata=metadata),
        "StartProfile": lambda: stub.StartProfile(
            common_pb2.StartProfileRequest(), metadata=metadata
        ),
        "StopProfile": lambda: stub.StopProfile(common_pb2.StopProfileRequest(), metadata=metadata),
    }


async def test_inference_key_serves_but_neither_routes_nor_administers(
    stub: vllm_engine_pb2_grpc.VllmEngineStub,
) -> None:
    tenant = bearer(TENANT_A)
    assert (await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=tenant)).model_path
    assert await _code(stub.GetLoads(pb.GetLoadsRequest(), metadata=tenant)) == grpc.StatusCode.OK
    # KV events carry every tenant's token ids: a router's (and an admin's), not a tenant's.
    with pytest.raises(grpc.aio.AioRpcError) as denied:
        await stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), metadata=tenant).read()
    assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
    details = denied.value.details() or ""
    assert "router role" in details and "--router-api-key" in details, details
    assert "--routing-data-for-every-key" in details, details
    for key in (ROUTER, ADMIN):
        kv = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), metadata=bearer(key))
        # Allowed (this engine publishes no events: UNIMPLEMENTED).
        assert await _code(kv) == grpc.StatusCode.UNIMPLEMENTED, key
        assert (await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=bearer(key))).model_path
    for name, call in _admin_calls(stub, bearer(ROUTER)).items():
        assert await _code(call()) == grpc.StatusCode.PERMISSION_DENIED, name
    for name, call in _admin_calls(stub, tenant).items():
        assert await _code(call()) == grpc.StatusCode.PERMISSION_DENIED, name
    for name, call in _admin_calls(stub, bearer(ADMIN)).items():
        # Allowed (whether the engine can profile here is another matter).
        assert await _code(call()) not in (
            grpc.StatusCode.PERMISSION_DENIED,
            grpc.StatusCode.UNAUTHENTICATED,
        ), name
    # The admin key does everything an inference key does.
    assert (await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=bearer(ADMIN))).model_path


async def _finish_reasons(call: Any) -> list[str]:
    """The finish reasons of the rest of a stream already read from."""
    reasons = []
    while (message := await call.read()) is not grpc.aio.EOF:
        if message.HasField("complete"):
            reasons.append(message.complete.finish_reason)
    return reasons


async def _finish_reason_after_abort(
    stub: vllm_engine_pb2_grpc.VllmEngineStub, request_id: str, aborter: str
) -> str:
    """Start a long stream as tenant A, Abort its id with `aborter`'s key, read it to the end."""
    call = stub.Generate(
        request(max_tokens=400, ignore_eos=True, stream=True, request_id=request_id),
        metadata=bearer(TENANT_A),
    )
    assert (await call.read()).HasField("chunk")
    await stub.Abort(pb.AbortRequest(request_ids=[request_id]), metadata=bearer(aborter))
    if aborter == TENANT_B:
        # Long after an abort would have landed the stream still runs; then its owner stops it.
        for _ in range(30):
            assert (await call.read()).HasField("chunk")
        await stub.Abort(pb.AbortRequest(request_ids=[request_id]), metadata=bearer(TENANT_A))
    return (await _finish_reasons(call))[-1]


@pytest.mark.parametrize("aborter", [TENANT_A, TENANT_B, ADMIN], ids=["own", "other", "admin"])
async def test_abort_reaches_own_requests_only_unless_admin(
    stub: vllm_engine_pb2_grpc.VllmEngineStub, aborter: str
) -> None:
    rid = f"shared-id-{aborter[:8]}"
    assert await _finish_reason_after_abort(stub, rid, aborter) == "abort"


async def test_another_key_cannot_take_a_running_request_id(
    stub: vllm_engine_pb2_grpc.VllmEngineStub,
) -> None:
    """Aborting its own request under a running id of tenant A's must not stop A's."""
    rid = "taken-id"
    running = stub.Generate(
        request(max_tokens=200, ignore_eos=True, stream=True, request_id=rid),
        metadata=bearer(TENANT_A),
    )
    assert (await running.read()).HasField("chunk")
    intruder = stub.Generate(
        request(max_tokens=200, ignore_eos=True, stream=True, request_id=rid),
        metadata=bearer(TENANT_B),
    )
    try:
        await intruder.read()
    except grpc.aio.AioRpcError as err:
        refusal: tuple[grpc.StatusCode, str] = (err.code(), err.details() or "")
    else:
        refusal = (grpc.StatusCode.OK, "")
    # B aborts "its" request while it would still be running (its stream is left open).
    await stub.Abort(pb.AbortRequest(request_ids=[rid]), metadata=bearer(TENANT_B))
    reasons = await _finish_reasons(running)
    intruder.cancel()
    assert reasons == ["length"]
    assert refusal[0] == grpc.StatusCode.ALREADY_EXISTS
    assert rid in refusal[1]
    # Finished, the id is free for anyone.
    await collect(stub.Generate(request(max_tokens=2, request_id=rid), metadata=bearer(TENANT_B)))


async def test_the_same_key_may_reuse_its_running_request_id(
    stub: vllm_engine_pb2_grpc.VllmEngineStub,
) -> None:
    """As vLLM allows (it tells the two apart inside); an Abort of the id stops both."""
    rid = "reused-id"
    first = stub.Generate(
        request(max_tokens=200, ignore_eos=True, stream=True, request_id=rid),
        metadata=bearer(TENANT_A),
    )
    assert (await first.read()).HasField("chunk")
    messages = await collect(
        stub.Generate(request(max_tokens=2, request_id=rid), metadata=bearer(TENANT_A))
    )
    assert messages[-1].complete.finish_reason == "length"
    await stub.Abort(pb.AbortRequest(request_ids=[rid]), metadata=bearer(TENANT_A))
    assert await _finish_reasons(first) == ["abort"]


async def test_abort_of_unknown_ids_is_quietly_ok(
    stub: vllm_engine_pb2_grpc.VllmEngineStub,
) -> None:
    await stub.Abort(pb.AbortRequest(request_ids=["never-seen", ""]), metadata=bearer(TENANT_B))


async def test_api_key_from_the_environment(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_API_KEY", TENANT_A)
    args = parse_args(["serve", "--model", "m"])
    assert args.security.authenticates()
    server, mounted, address = await _serve(engine, [])
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            assert (
                await stub.HealthCheck(pb.HealthCheckRequest(), metadata=bearer(TENANT_A))
            ).healthy
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.HealthCheck(pb.HealthCheckRequest())
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await mounted.health.close()
        await server.stop(None)


def test_server_only_tls_does_not_silence_the_exposure_warning(
    caplog: pytest.LogCaptureFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tls_only = parse_args(["serve", "--model", "m", "--tls-cert", "c.pem", "--tls-key", "k.pem"])
    assert not tls_only.security.authenticates()
    with caplog.at_level(logging.WARNING, logger="vllm_servicer.tls"):
        assert warn_if_exposed("0.0.0.0", tls=True, auth=tls_only.security.authenticates())
    assert "authentication" in caplog.text
    mtls = ["--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-client-ca", "ca.pem"]
    assert parse_args(["serve", "--model", "m", *mtls]).security.authenticates()
    assert parse_args(["serve", "--model", "m", "--admin-api-key", ADMIN]).security.authenticates()
    key_file = tmp_path / "keys"
    key_file.write_text(TENANT_A)
    assert parse_args(
        ["serve", "--model", "m", "--api-key-file", str(key_file)]
    ).security.authenticates()


@pytest.mark.parametrize(
    "argv",
    [
        ["--api-key", "a", "--api-key-file", "f"],
        ["--admin-api-key", "a", "--admin-api-key-file", "f"],
        ["--router-api-key", "a", "--router-api-key-file", "f"],
    ],
)
def test_one_source_per_role(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["serve", "--model", "m", *argv])


# ----- client certificates without keys ---------------------------------------


@pytest.fixture(scope="module")
def ca() -> CertificateAuthority:
    return CertificateAuthority("launcher-test-ca")


async def _serve_mtls(
    engine: Any, ca: CertificateAuthority, directory: Path, argv: list[str]
) -> tuple[grpc.aio.Server, Any, str]:
    """A launcher stack and port that require client certificates from `ca`, and no key."""
    cert, key = ca.server().write(directory, "server")
    client_ca = directory / "clients.pem"
    client_ca.write_bytes(ca.pem)
    tls = ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-client-ca", str(client_ca)]
    args = parse_args(["serve", "--model", "m", *tls, *argv])
    stack, _ = build_interceptors(args)
    server = grpc.aio.server(interceptors=stack)
    mounted = mount(server, engine)
    port = server.add_secure_port("127.0.0.1:0", server_credentials(cert, key, client_ca))
    await server.start()
    return server, mounted, f"127.0.0.1:{port}"


async def _as_client(
    address: str, ca: CertificateAuthority, client: Pem
) -> tuple[grpc.StatusCode, grpc.StatusCode]:
    """(Generate, FlushCache) statuses for a client presenting `client`'s certificate."""
    credentials = grpc.ssl_channel_credentials(ca.pem, client.key, client.cert)
    async with grpc.aio.secure_channel(address, credentials) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        try:
            await collect(stub.Generate(request(max_tokens=2), timeout=60))
            generate = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as err:
            generate = err.code()
        flush = await _code(stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=60))
    return generate, flush


@pytest.mark.parametrize("admins", [[], ["ops"]], ids=["no-admin-subject", "admin-subject"])
async def test_client_certificates_alone_administer_only_as_named_subjects(
    engine: Any, ca: CertificateAuthority, tmp_path: Path, admins: list[str]
) -> None:
    argv = [a for subject in admins for a in ("--admin-tls-subject", subject)]
    server, mounted, address = await _serve_mtls(engine, ca, tmp_path, argv)
    refused = (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)
    try:
        generate, flush = await _as_client(address, ca, ca.client("router"))
        assert (generate, flush) == (grpc.StatusCode.OK, grpc.StatusCode.PERMISSION_DENIED)
        generate, flush = await _as_client(address, ca, ca.client("ops"))
        assert generate == grpc.StatusCode.OK
        if admins:
            assert flush not in refused
        else:
            assert flush == grpc.StatusCode.PERMISSION_DENIED
    finally:
        await mounted.health.close()
        await server.stop(None)


@pytest.mark.parametrize(
    "argv",
    [
        ["--admin-tls-subject", "ops"],
        [
            *("--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-client-ca", "ca.pem"),
            *("--api-key", TENANT_A, "--admin-tls-subject", "ops"),
        ],
        ["--router-tls-subject", "router"],
        [
            *("--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-client-ca", "ca.pem"),
            *("--router-api-key", ROUTER, "--router-tls-subject", "router"),
        ],
    ],
    ids=["without-client-ca", "with-keys", "router-without-client-ca", "router-with-keys"],
)
def test_admin_tls_subject_is_for_certificates_alone(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["serve", "--model", "m", *argv])


async def test_client_certificates_read_kv_events_only_as_router_or_admin_subjects(
    engine: Any, ca: CertificateAuthority, tmp_path: Path
) -> None:
    argv = ["--router-tls-subject", "router", "--admin-tls-subject", "ops"]
    server, mounted, address = await _serve_mtls(engine, ca, tmp_path, argv)
    try:
        for name, expected in (
            ("router", grpc.StatusCode.UNIMPLEMENTED),  # allowed: this engine publishes none
            ("ops", grpc.StatusCode.UNIMPLEMENTED),
            ("tenant", grpc.StatusCode.PERMISSION_DENIED),
        ):
            client = ca.client(name)
            credentials = grpc.ssl_channel_credentials(ca.pem, client.key, client.cert)
            async with grpc.aio.secure_channel(address, credentials) as channel:
                stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
                call = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=60)
                assert await _code(call) == expected, name
                flush = await _code(stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=60))
                assert (flush == grpc.StatusCode.PERMISSION_DENIED) == (name != "ops"), name
    finally:
        await mounted.health.close()
        await server.stop(None)


async def test_http_api_gives_client_certificates_alone_no_admin_role() -> None:
    """The HTTP side cannot tell certificates apart: vLLM's admin paths are refused to all."""
    tls = ["--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-client-ca", "ca.pem"]
    args = parse_args(["serve", "--model", "m", *tls, "--admin-tls-subject", "ops"])
    verifier = _http_verifier(args, None)
    assert verifier is not None
    assert ADMIN_ROLE not in (await verifier([], {})).roles
