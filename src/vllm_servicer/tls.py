"""TLS and mTLS server credentials with certificate hot reload; exposure checks.

    creds = server_credentials("server.pem", "server.key", client_ca_file="clients-ca.pem")
    server.add_secure_port("0.0.0.0:50051", creds)

The credentials re-read the certificate files when they change (checked at
each new connection; established connections keep the certificate they
started with), so renewed certificates take effect without a restart.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import ssl
import threading
from pathlib import Path

import grpc

__all__ = ["is_loopback", "server_credentials", "warn_if_exposed"]

logger = logging.getLogger(__name__)

_Signature = tuple[tuple[int, int, int], ...]


def server_credentials(
    cert_file: str | os.PathLike[str],
    key_file: str | os.PathLike[str],
    client_ca_file: str | os.PathLike[str] | None = None,
    *,
    reload: bool = True,
) -> grpc.ServerCredentials:
    """Server credentials for `server.add_secure_port(address, credentials)`.

    Args:
        cert_file: the server's PEM certificate chain (leaf first).
        key_file: its PEM private key.
        client_ca_file: PEM CA certificates for client certificates. When
            given, every client must present a certificate signed by one of
            them (mTLS); `interceptors.verifiers.MtlsVerifier` then reads who it is.
        reload: re-read the files when their modification time, size or inode
            changes. A changed set that does not load (a key that does not
            match the certificate, a half-written file) is ignored with an
            error logged, and tried again at the next connection.

    Returns:
        grpc server credentials (dynamic when `reload`, else static).

    Raises:
        OSError: a file cannot be read.
        ssl.SSLError: the key does not match the certificate or a file is not PEM.
    """
    source = _CertificateFiles(Path(cert_file), Path(key_file), client_ca_file)
    config = source.load()
    require_client_auth = client_ca_file is not None
    if not reload:
        return grpc.ssl_server_credentials(
            [(config.key, config.chain)],
            root_certificates=config.client_ca,
            require_client_auth=require_client_auth,
        )
    return grpc.dynamic_ssl_server_credentials(
        source.configuration(config),
        source.fetch,  # type: ignore[arg-type]  # grpc documents None as "no change"
        require_client_authentication=require_client_auth,
    )


class _Loaded:
    __slots__ = ("chain", "client_ca", "key", "signature")

    def __init__(
        self, chain: bytes, key: bytes, client_ca: bytes | None, signature: _Signature
    ) -> None:
        self.chain = chain
        self.key = key
        self.client_ca = client_ca
        self.signature = signature


class _CertificateFiles:
    """The files behind dynamic credentials; grpc calls `fetch` per new connection."""

    def __init__(self, cert: Path, key: Path, client_ca: str | os.PathLike[str] | None) -> None:
        self._cert = cert
        self._key = key
        self._ca = None if client_ca is None else Path(client_ca)
        self._signature: _Signature | None = None
        self._failed: _Signature | None = None
        # grpc calls the fetcher from its own threads.
        self._lock = threading.Lock()

    def _paths(self) -> tuple[Path, ...]:
        return (self._cert, self._key) if self._ca is None else (self._cert, self._key, self._ca)

    def _stat(self) -> _Signature:
        out = []
        for path in self._paths():
            st = path.stat()
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(out)

    def load(self) -> _Loaded:
        signature = self._stat()
        # Checks the key against the certificate: grpc would accept the pair
        # and fail every handshake instead.
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(self._cert, self._key)
        if self._ca is not None:
            ssl.create_default_context(cafile=str(self._ca))
        loaded = _Loaded(
            self._cert.read_bytes(),
            self._key.read_bytes(),
            None if self._ca is None else self._ca.read_bytes(),
            signature,
        )
        if self._stat() != signature:
            raise OSError("certificate files changed while being read")
        self._signature = signature
        return loaded

    def configuration(self, loaded: _Loaded) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration(
            [(loaded.key, loaded.chain)], root_certificates=loaded.client_ca
        )

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """None keeps the current configuration (grpc's contract)."""
        with self._lock:
            signature = None
            try:
                signature = self._stat()
                if signature == self._signature:
                    return None
                loaded = self.load()
            except (OSError, ssl.SSLError, ValueError) as exc:
                if signature != self._failed:  # log each bad state once, not per connection
                    self._failed = signature
                    logger.error("TLS certificates not reloaded, keeping the current ones: %s", exc)
                return None
            logger.info("TLS certificates reloaded from %s", self._cert)
            return self.configuration(loaded)


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only.

    True for loopback addresses (127.0.0.0/8, ::1, bracketed or not),
    `localhost` and `unix:` socket addresses. False for everything else,
    including wildcard binds (0.0.0.0, ::) and names, which are not resolved.
    """
    host = host.strip()
    if host.startswith(("unix:", "unix-abstract:")):
        return True
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def warn_if_exposed(host: str, tls: bool, auth: bool) -> bool:
    """Log a WARNING when serving beyond this machine with neither TLS nor auth.

    Server-only TLS does not silence it: it encrypts, but lets any client in.

    Args:
        host: the host part of the address bound.
        tls: the port uses TLS credentials.
        auth: calls need credentials (API keys, or client certificates).

    Returns:
        True when it warned.
    """
    if is_loopback(host) or auth:
        return False
    logger.warning(
        "serving on %s without authentication%s: anyone who can reach this address "
        "can run and abort requests on the engine. Add --api-key-file (or $VLLM_API_KEY) "
        "or --tls-client-ca, or bind 127.0.0.1.",
        host,
        " (TLS encrypts but does not check clients)" if tls else " or TLS",
    )
    return True
