"""TLS and mTLS with certificates made by the test; hot reload; exposure checks."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import grpc
import pytest
from support import Serving, bearer, collect, completes, request, serving
from support.certs import CertificateAuthority, Pem

from vllm_servicer.interceptors.api_keys import ApiKeyVerifier
from vllm_servicer.interceptors.auth import AuthInterceptor, Identity, current_identity
from vllm_servicer.interceptors.verifiers import AllOf, MtlsVerifier
from vllm_servicer.proto import vllm_engine_pb2 as pb
from vllm_servicer.proto import vllm_engine_pb2_grpc
from vllm_servicer.tls import is_loopback, server_credentials, warn_if_exposed

KEY = "router-key-0123456789abcdef"


@pytest.fixture(scope="module")
def ca() -> CertificateAuthority:
    return CertificateAuthority("test-ca")


@pytest.fixture(scope="module")
def other_ca() -> CertificateAuthority:
    return CertificateAuthority("other-ca")


class Seen:
    """Identities the servicer's handlers ran with."""

    def __init__(self) -> None:
        self.identities: list[Identity | None] = []


class RecordingEngine:
    def __init__(self, engine: Any, seen: Seen) -> None:
        self._engine = engine
        self._seen = seen

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        self._seen.identities.append(current_identity.get())
        return self._engine.generate(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def _serve(
    engine: Any, credentials: grpc.ServerCredentials, interceptors: Any = ()
) -> AbstractAsyncContextManager[Serving]:
    """`engine` over TLS with `credentials`, without health or reflection."""
    return serving(
        engine,
        credentials=credentials,
        health=False,
        reflection_service=False,
        interceptors=interceptors,
    )


async def _health(
    port: int, root: bytes, client: Pem | None = None, metadata: Any = None
) -> grpc.StatusCode:
    credentials = grpc.ssl_channel_credentials(
        root, client.key if client else None, client.cert if client else None
    )
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        try:
            await stub.HealthCheck(pb.HealthCheckRequest(), metadata=metadata, timeout=10)
        except grpc.aio.AioRpcError as err:
            return err.code()
        return grpc.StatusCode.OK


def _write_ca(path: Path, *cas: CertificateAuthority) -> Path:
    path.write_bytes(b"".join(ca.pem for ca in cas))
    return path


async def test_tls_serves_generate(engine: Any, ca: CertificateAuthority, tmp_path: Path) -> None:
    cert, key = ca.server().write(tmp_path, "server")
    async with _serve(engine, server_credentials(cert, key)) as served:
        port = served.port
        credentials = grpc.ssl_channel_credentials(ca.pem)
        async with grpc.aio.secure_channel(f"localhost:{port}", credentials) as channel:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            messages = await collect(stub.Generate(request(max_tokens=2, ignore_eos=True)))
            assert len(completes(messages)[0].output_ids) == 2
        # A client that does not trust the server's CA does not connect.
        assert await _health(port, CertificateAuthority("stranger").pem) == (
            grpc.StatusCode.UNAVAILABLE
        )


@pytest.mark.parametrize("reload", [True, False], ids=["dynamic", "static"])
async def test_mtls_requires_a_client_certificate_from_the_ca(
    engine: Any,
    ca: CertificateAuthority,
    other_ca: CertificateAuthority,
    tmp_path: Path,
    reload: bool,
) -> None:
    cert, key = ca.server().write(tmp_path, "server")
    client_ca = _write_ca(tmp_path / "clients.pem", ca)
    async with _serve(engine, server_credentials(cert, key, client_ca, reload=reload)) as served:
        port = served.port
        assert await _health(port, ca.pem, ca.client("router")) == grpc.StatusCode.OK
        assert await _health(port, ca.pem) == grpc.StatusCode.UNAVAILABLE
        assert await _health(port, ca.pem, other_ca.client("router")) == (
            grpc.StatusCode.UNAVAILABLE
        )


async def test_mtls_and_token_together(
    engine: Any, ca: CertificateAuthority, tmp_path: Path
) -> None:
    cert, key = ca.server().write(tmp_path, "server")
    client_ca = _write_ca(tmp_path / "clients.pem", ca)
    seen = Seen()
    auth = AuthInterceptor(
        AllOf(
            MtlsVerifier(allowed_subjects={"router"}, allowed_sans={"spiffe://test/router"}),
            ApiKeyVerifier([KEY]),
        )
    )
    router = ca.client("router", uris=("spiffe://test/router",))
    token = bearer(KEY)
    async with _serve(
        RecordingEngine(engine, seen), server_credentials(cert, key, client_ca), [auth]
    ) as served:
        port = served.port
        credentials = grpc.ssl_channel_credentials(ca.pem, router.key, router.cert)
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            await collect(stub.Generate(request(max_tokens=2), metadata=token))
        identity = seen.identities[-1]
        assert identity is not None
        assert (identity.name, identity.kind) == ("router", "all_of")
        assert [p.kind for p in identity.parts] == ["mtls", "api_key"]
        assert "spiffe://test/router" in identity.attributes["sans"]

        # Certificate without the token; token with a certificate not allowed.
        assert await _health(port, ca.pem, router) == grpc.StatusCode.UNAUTHENTICATED
        intruder = ca.client("intruder", uris=("spiffe://test/intruder",))
        assert await _health(port, ca.pem, intruder, token) == grpc.StatusCode.PERMISSION_DENIED
        wrong_san = ca.client("router", uris=("spiffe://test/other",))
        assert await _health(port, ca.pem, wrong_san, token) == grpc.StatusCode.PERMISSION_DENIED
        assert len(seen.identities) == 1


async def test_mtls_verifier_without_client_certificates_is_unauthenticated(
    engine: Any, ca: CertificateAuthority, tmp_path: Path
) -> None:
    cert, key = ca.server().write(tmp_path, "server")
    auth = AuthInterceptor(MtlsVerifier())
    async with _serve(engine, server_credentials(cert, key), [auth]) as served:
        assert await _health(served.port, ca.pem) == grpc.StatusCode.UNAUTHENTICATED
    async with serving(
        engine, health=False, reflection_service=False, interceptors=[auth]
    ) as insecure:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await vllm_engine_pb2_grpc.VllmEngineStub(insecure.channel).HealthCheck(
                pb.HealthCheckRequest()
            )
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.fixture
async def reloading(
    engine: Any, ca: CertificateAuthority, tmp_path: Path
) -> AsyncIterator[tuple[int, Path]]:
    ca.server().write(tmp_path, "server")
    client_ca = _write_ca(tmp_path / "clients.pem", ca)
    credentials = server_credentials(tmp_path / "server.pem", tmp_path / "server.key", client_ca)
    async with _serve(engine, credentials) as served:
        yield served.port, tmp_path


async def test_hot_reload_serves_new_certificates_to_new_connections(
    reloading: tuple[int, Path],
    ca: CertificateAuthority,
    other_ca: CertificateAuthority,
    caplog: pytest.LogCaptureFixture,
) -> None:
    port, directory = reloading
    client = ca.client("router")
    old_credentials = grpc.ssl_channel_credentials(ca.pem, client.key, client.cert)
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", old_credentials) as kept:
        kept_stub = vllm_engine_pb2_grpc.VllmEngineStub(kept)
        await kept_stub.HealthCheck(pb.HealthCheckRequest())

        # Renewal: a server certificate from another CA, and that CA's clients allowed too.
        other_ca.server().write(directory, "server")
        _write_ca(directory / "clients.pem", ca, other_ca)
        with caplog.at_level(logging.INFO, logger="vllm_servicer.tls"):
            assert await _health(port, other_ca.pem, client) == grpc.StatusCode.OK
        assert "TLS certificates reloaded" in caplog.text
        assert await _health(port, ca.pem, client) == grpc.StatusCode.UNAVAILABLE
        assert await _health(port, other_ca.pem, other_ca.client("b")) == grpc.StatusCode.OK
        # The connection made before the renewal keeps working.
        assert (await kept_stub.HealthCheck(pb.HealthCheckRequest())).healthy


async def test_hot_reload_ignores_a_mismatched_key(
    reloading: tuple[int, Path],
    ca: CertificateAuthority,
    other_ca: CertificateAuthority,
    caplog: pytest.LogCaptureFixture,
) -> None:
    port, directory = reloading
    client = ca.client("router")
    # Only the certificate is renewed so far; its key has not been written yet.
    (directory / "server.pem").write_bytes(other_ca.server().cert)
    with caplog.at_level(logging.ERROR, logger="vllm_servicer.tls"):
        assert await _health(port, ca.pem, client) == grpc.StatusCode.OK
        assert await _health(port, ca.pem, client) == grpc.StatusCode.OK
    assert caplog.text.count("not reloaded") == 1  # logged once, not per connection
    renewed = other_ca.server()
    renewed.write(directory, "server")
    assert await _health(port, other_ca.pem, client) == grpc.StatusCode.OK


def test_server_credentials_reject_a_mismatched_pair(
    ca: CertificateAuthority, tmp_path: Path
) -> None:
    cert, _ = ca.server().write(tmp_path, "a")
    _, key = ca.server().write(tmp_path, "b")
    with pytest.raises(Exception, match="(?i)key"):
        server_credentials(cert, key)
    with pytest.raises(OSError):
        server_credentials(tmp_path / "missing.pem", key)


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("unix:/tmp/vllm.sock", True),
        ("0.0.0.0", False),
        ("::", False),
        ("[::]", False),
        ("10.0.0.5", False),
        ("example.com", False),
        ("", False),
    ],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_warn_if_exposed(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="vllm_servicer.tls"):
        assert warn_if_exposed("0.0.0.0", tls=False, auth=False)
        assert not warn_if_exposed("127.0.0.1", tls=False, auth=False)
        # Server-only TLS encrypts but lets anyone in: still a warning.
        assert warn_if_exposed("0.0.0.0", tls=True, auth=False)
        assert not warn_if_exposed("0.0.0.0", tls=False, auth=True)
        assert not warn_if_exposed("0.0.0.0", tls=True, auth=True)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("0.0.0.0" in w.getMessage() for w in warnings)
