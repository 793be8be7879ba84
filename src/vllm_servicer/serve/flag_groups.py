"""The launcher's own option groups: server, call slots, HTTP API, observability, security.

Each is a frozen dataclass whose fields are its flags (`flags.flag`) and which
refuses its own contradictory values once, in `__post_init__`; `ServeArgs`
(`args.py`) holds them beside `mount()`'s groups (`MountOptions`) and checks
only what spans two of them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

from ..fair_work import SHARED_STEP_TOKENS
from ..flags import flag
from ..interceptors.call_slots import DEFAULT_REQUEST_READ_TIMEOUT, DEFAULT_RESPONSE_WRITE_TIMEOUT
from ..options import DEFAULT_MAX_MESSAGE_BYTES
from .http_timeouts import DEFAULT_HTTP_HEADER_TIMEOUT, DEFAULT_MAX_HTTP_CONNECTIONS

__all__ = [
    "ADMIN_KEY_ENV",
    "API_KEY_ENV",
    "ROUTER_KEY_ENV",
    "CallSlotFlags",
    "HttpApiFlags",
    "ObservabilityFlags",
    "SecurityFlags",
    "ServerFlags",
]

# Keys from the environment stay out of the process list. The first is vLLM's own.
API_KEY_ENV = "VLLM_API_KEY"
ADMIN_KEY_ENV = "VLLM_SERVICER_ADMIN_API_KEY"
ROUTER_KEY_ENV = "VLLM_SERVICER_ROUTER_API_KEY"
_KEY_ENVS = (API_KEY_ENV, ADMIN_KEY_ENV, ROUTER_KEY_ENV)


def _positive(value: float, option: str) -> None:
    if value <= 0:
        raise ValueError(f"{option} must be above 0, got {value}")


@dataclass(frozen=True)
class ServerFlags:
    """Where and how the gRPC server runs: its address, processes, messages and shutdown.

    Raises:
        ValueError: fewer than one serving process.
    """

    FLAG_TITLE: ClassVar[str] = "vllm-servicer: serving"

    host: str = flag("127.0.0.1", help="address to bind (default: loopback)")
    port: int = flag(50051, help="port to bind (0: any free port)")
    max_message_bytes: int = flag(
        DEFAULT_MAX_MESSAGE_BYTES,
        help="largest request or response message accepted, in bytes; the HTTP API's "
        "request bodies too (past it 413)",
    )
    api_server_count: int = flag(
        1,
        help="serving processes, each a client of the one engine, all on --port (the kernel "
        "spreads connections among them, SO_REUSEPORT); above 1 when one core cannot keep up "
        "with the engine's tokens (default 1)",
    )
    max_connection_age: float | None = flag(
        None,
        help="seconds after which clients are asked to reconnect (re-spreads load)",
    )
    allow_request_compression: bool = flag(
        False,
        help="accept gzip/deflate-compressed requests (off: UNIMPLEMENTED before any "
        "handler, so no client, with a key or without, can make the server inflate a request)",
    )
    headless: bool = flag(
        False,
        help="start this node's data-parallel engines for a head launcher elsewhere, as "
        "vLLM's `serve --headless` does, and serve nothing here (no port is bound): with "
        "--data-parallel-size N --data-parallel-size-local L --data-parallel-start-rank S "
        "--data-parallel-address HEAD --data-parallel-rpc-port P; exits 1 when an engine ends "
        "without being asked to (see docs/scale-out.md)",
    )
    event_loop: str = flag(
        "auto",
        choices=("auto", "uvloop", "asyncio"),
        help="the serving processes' event loop: uvloop, asyncio's own, or auto (uvloop "
        "when installed, as vLLM's HTTP server runs)",
    )
    warm_up: bool = flag(
        False,
        help="run one short generation before the port opens, so that the first client "
        "does not pay for what the engine initialises on its first request",
    )
    drain_grace: float = flag(
        2.0,
        help="seconds the server keeps answering after health turns NOT_SERVING on SIGTERM",
    )

    def __post_init__(self) -> None:
        if self.api_server_count < 1:
            raise ValueError(f"--api-server-count must be at least 1, got {self.api_server_count}")
        if self.max_connection_age is not None:
            _positive(self.max_connection_age, "--max-connection-age")


@dataclass(frozen=True)
class CallSlotFlags:
    """How many calls run at once, each tenant's share, and how long a call may stall.

    Raises:
        ValueError: a timeout that is not above 0.
    """

    FLAG_TITLE: ClassVar[str] = "vllm-servicer: call slots"

    max_inflight: int = flag(
        1024,
        help="most engine calls in flight, every protocol's and the HTTP API's (default 1024); "
        "beyond it calls get "
        "RESOURCE_EXHAUSTED with a retry hint (0: no limit); each key is held to its fair "
        "share of them while other keys want some (see --no-fair-shares)",
    )
    no_fair_shares: bool = flag(
        False,
        help="let any key take all of --max-inflight, first come first served; by default "
        "each key (an identity without the admin role) is held to its fair share of it while "
        "other keys want slots (hold some, or were refused one in the last 10 s): past it "
        "RESOURCE_EXHAUSTED (HTTP 503) naming the share; a key alone takes them all",
    )
    max_concurrent_rpcs: int = flag(
        2048,
        help="most keyed calls (every call but health, reflection and load reports; streams "
        "included; HTTP API requests but its probes, /v1/models and /version) running at once "
        "per process, each tenant held to its fair share while "
        "others want them; past it RESOURCE_EXHAUSTED naming the limit or the share. The "
        "--max-keyless-* slots come on top, in grpc's own cap (default 2048, above "
        "--max-inflight so that engine calls meet that limit and its retry hint first; 0: no "
        "cap)",
    )
    request_read_timeout: float = flag(
        DEFAULT_REQUEST_READ_TIMEOUT,
        help="seconds a keyed call may wait for each request message once it has started (its "
        "one message, each of a client stream; HTTP API requests: each part of the body); "
        "past it DEADLINE_EXCEEDED (HTTP 408) and its slots come back (calls that need no key "
        "wait 2 s) "
        f"(default {DEFAULT_REQUEST_READ_TIMEOUT:g}: the largest message over a slow link, "
        "while a tenant holding slots for nothing holds them no longer)",
        metavar="SECONDS",
    )
    response_write_timeout: float = flag(
        DEFAULT_RESPONSE_WRITE_TIMEOUT,
        help="seconds each message of a keyed call's streamed answer may wait for its client "
        "to take it (a client that stops reading, or grants no HTTP/2 flow-control window); "
        "past it the call ends, its engine request is aborted and its slots come back "
        f"(default {DEFAULT_RESPONSE_WRITE_TIMEOUT:g})",
        metavar="SECONDS",
    )

    shared_step_tokens: int = flag(
        SHARED_STEP_TOKENS,
        help="with --scheduling-policy priority and chunked prefill: while a light tenant's "
        "request (a prompt of at most this many tokens, its tenant's none in prefill) is "
        "first in the fair order, it joins the next step before other tenants' running "
        "prompt chunks, and steps hold at most this many tokens until a quarter second "
        "after the last such request, so that its first token does not wait for a long step "
        f"(default {SHARED_STEP_TOKENS}; 0: vLLM's own scheduler; an operator's "
        "--scheduler-cls replaces it)",
    )

    def __post_init__(self) -> None:
        if self.shared_step_tokens < 0:
            raise ValueError(
                f"--shared-step-tokens must be 0 (off) or more, got {self.shared_step_tokens}"
            )
        _positive(self.request_read_timeout, "--request-read-timeout")
        _positive(self.response_write_timeout, "--response-write-timeout")


@dataclass(frozen=True)
class HttpApiFlags:
    """vLLM's OpenAI-compatible HTTP API on the same engine, with the same keys and TLS.

    Raises:
        ValueError: HTTP settings without `--http-port`, or out of range.
    """

    FLAG_TITLE: ClassVar[str] = "vllm-servicer: vLLM's HTTP API on the same engine"

    http_port: int | None = flag(
        None,
        help="also serve vLLM's OpenAI-compatible HTTP API on this port (0: any free port; "
        "off by default); same keys and TLS as gRPC",
    )
    http_host: str | None = flag(None, help="address of the HTTP API (default: the same as --host)")
    http_header_timeout: float = flag(
        DEFAULT_HTTP_HEADER_TIMEOUT,
        help="seconds an HTTP API connection has to send a request's headers, from its "
        "opening and from the end of each response; past it the connection is closed (408 "
        "when part of a request came). Its body then has --request-read-timeout "
        f"(default {DEFAULT_HTTP_HEADER_TIMEOUT:g})",
        metavar="SECONDS",
    )
    max_http_connections: int = flag(
        DEFAULT_MAX_HTTP_CONNECTIONS,
        help="most connections the HTTP API holds open at once, per process; past it a new "
        "connection is answered 503 and closed before it is read "
        f"(default {DEFAULT_MAX_HTTP_CONNECTIONS}; 0: no cap)",
    )
    enable_scale_out: bool = flag(
        False,
        help="serve vLLM's scale-out routes on the HTTP API too (/v1/.../render, "
        "/v1/.../derender, /inference/v1/generate), as vLLM's own --enable-scale-out; "
        "gRPC's Render serves rendering and derendering without it",
    )

    def __post_init__(self) -> None:
        if self.http_port is None and self.http_host:
            raise ValueError("--http-host needs --http-port")
        if self.http_port is None and self.enable_scale_out:
            raise ValueError("--enable-scale-out needs --http-port (gRPC's Render needs no flag)")
        _positive(self.http_header_timeout, "--http-header-timeout")
        if self.max_http_connections < 0:
            raise ValueError(
                "--max-http-connections must be 0 (no cap) or more, "
                f"got {self.max_http_connections}"
            )


@dataclass(frozen=True)
class ObservabilityFlags:
    """Prometheus metrics on a port of their own."""

    FLAG_TITLE: ClassVar[str] = "vllm-servicer: observability"

    metrics_port: int | None = flag(
        None, help="serve Prometheus metrics on this port (off by default)"
    )
    metrics_host: str | None = flag(
        None, help="address of the metrics endpoint (default: the same as --host)"
    )


def _key_flag(help_text: str) -> tuple[str, ...]:
    """A key flag: repeat it for several keys."""
    keys: tuple[str, ...] = flag(
        (), help=help_text, action="append", parsed_default=[], convert=tuple
    )
    return keys


def _subject_flag(help_text: str) -> tuple[str, ...]:
    """A client certificate subject flag: repeat it for several."""
    subjects: tuple[str, ...] = flag(
        (),
        help=help_text,
        action="append",
        metavar="SUBJECT",
        parsed_default=[],
        convert=tuple,
    )
    return subjects


@dataclass(frozen=True)
class SecurityFlags:
    """Who may call: API keys and their roles, TLS and client certificates.

    vLLM's spellings of the TLS flags are folded in: `--ssl-certfile` and
    `--ssl-keyfile` are `tls_cert` and `tls_key`, `--ssl-ca-certs` with
    `--ssl-cert-reqs 2` is the client CA (`client_ca`).

    Raises:
        ValueError: flags that contradict each other; the message names them.
    """

    FLAG_TITLE: ClassVar[str] = "vllm-servicer: security"

    api_key: tuple[str, ...] = _key_flag(
        "inference key: accept `authorization: Bearer <key>`; repeat for several keys "
        "(rotation). Visible in the process list: prefer --api-key-file or $VLLM_API_KEY"
    )
    api_key_file: str | None = flag(
        None,
        help="file of inference keys, one per line (re-read when it changes; "
        "empty or unreadable: no key is valid)",
    )
    admin_api_key: tuple[str, ...] = _key_flag(
        "admin key: also FlushCache, StartProfile/StopProfile and Abort of any request "
        f"(default ${ADMIN_KEY_ENV}); prefer --admin-api-key-file"
    )
    admin_api_key_file: str | None = flag(
        None, help="file of admin keys, one per line (re-read when it changes)"
    )
    router_api_key: tuple[str, ...] = _key_flag(
        "router key: an inference key that also reads KV events (SubscribeKvEvents, "
        "GetKvEventSources: every tenant's token ids) and sends kv_transfer_params "
        f"(default ${ROUTER_KEY_ENV}); repeat for several; prefer --router-api-key-file, "
        "or role=router on a key's line in --api-key-file"
    )
    router_api_key_file: str | None = flag(
        None, help="file of router keys, one per line (re-read when it changes)"
    )
    tls_cert: str | None = flag(
        None, help="server certificate chain (PEM)", aliases=("--ssl-certfile",)
    )
    tls_key: str | None = flag(None, help="server private key (PEM)", aliases=("--ssl-keyfile",))
    health_port: int | None = flag(
        None,
        help="with --tls-cert: also serve grpc.health.v1 alone, in plaintext, on this port "
        "(0: any free port), for probes that cannot speak TLS (Kubernetes' gRPC probes)",
    )
    # As given; the CA in force, vLLM's spelling included, is `client_ca`.
    tls_client_ca: str | None = flag(
        None,
        help="CA bundle (PEM) for client certificates; when given, clients must present one. "
        "Without API keys, the certificate names the caller (its common name): any "
        "certificate may generate and abort its own requests, only --admin-tls-subject "
        "ones may administer",
    )
    admin_tls_subject: tuple[str, ...] = _subject_flag(
        "with --tls-client-ca and no API keys: a client certificate subject with the "
        "admin role (FlushCache, StartProfile/StopProfile, Abort of any request), a common "
        "name ('ops') or a whole subject ('CN=ops,O=Acme'); repeat for several. Without it, "
        "no certificate may call the admin methods (vLLM's HTTP admin paths: none may)"
    )
    router_tls_subject: tuple[str, ...] = _subject_flag(
        "with --tls-client-ca and no API keys: a client certificate subject with the "
        "router role (KV events, kv_transfer_params), as --admin-tls-subject; repeat for "
        "several"
    )
    # vLLM's own server's spelling of --tls-client-ca, and a flag accepted as it is.
    ssl_ca_certs: str | None = flag(None, help="with --ssl-cert-reqs 2: --tls-client-ca")
    ssl_cert_reqs: int = flag(
        0,
        help="2: clients must present a certificate from --ssl-ca-certs (vLLM's flag)",
        type=int,
        choices=(0, 2),
    )
    enable_ssl_refresh: bool = flag(
        False,
        help="accepted as vLLM's server does: certificate files are always re-read here "
        "when they change",
    )

    def __post_init__(self) -> None:
        for keys, key_file, option in (
            (self.api_key, self.api_key_file, "--api-key"),
            (self.admin_api_key, self.admin_api_key_file, "--admin-api-key"),
            (self.router_api_key, self.router_api_key_file, "--router-api-key"),
        ):
            if keys and key_file:
                raise ValueError(f"give {option} or {option}-file, not both")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        self._check_vllm_client_ca()
        if self.client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        if self.health_port is not None and not self.tls_cert:
            raise ValueError("--health-port is for a TLS server (without TLS, probes use --port)")
        for option, subjects, role in (
            ("--admin-tls-subject", self.admin_tls_subject, "admins an admin key"),
            ("--router-tls-subject", self.router_tls_subject, "routers a router key"),
        ):
            if subjects and not self.client_ca:
                raise ValueError(f"{option} needs --tls-client-ca")
            if subjects and self.has_keys():
                raise ValueError(
                    f"{option} is for client certificates without API keys; with keys, give {role}"
                )

    def _check_vllm_client_ca(self) -> None:
        # vLLM uses a CA file for client certificates only when they are
        # required (--ssl-cert-reqs 2, ssl.CERT_REQUIRED).
        if self.ssl_cert_reqs == 2 and (not self.ssl_ca_certs or self.tls_client_ca):
            raise ValueError("--ssl-cert-reqs 2 needs --ssl-ca-certs (and no --tls-client-ca)")
        if self.ssl_cert_reqs != 2 and self.ssl_ca_certs:
            raise ValueError("--ssl-ca-certs is for client certificates: add --ssl-cert-reqs 2")

    @property
    def client_ca(self) -> str | None:
        """The CA bundle client certificates must come from: `--tls-client-ca`,
        or vLLM's `--ssl-ca-certs` with `--ssl-cert-reqs 2`; None: none asked."""
        return self.ssl_ca_certs if self.ssl_cert_reqs == 2 else self.tls_client_ca

    @property
    def tls(self) -> tuple[str, str, str | None] | None:
        """(certificate, key, client CA or None) when serving TLS, else None."""
        if self.tls_cert and self.tls_key:
            return self.tls_cert, self.tls_key, self.client_ca
        return None

    def has_keys(self) -> bool:
        """Whether any key is given, from the flags or the environment."""
        return bool(
            self.api_key
            or self.api_key_file
            or self.admin_api_key
            or self.admin_api_key_file
            or self.router_api_key
            or self.router_api_key_file
            or any(os.environ.get(env, "").strip() for env in _KEY_ENVS)
        )

    def authenticates(self) -> bool:
        """Whether calls need credentials: a key from any source, or client certificates."""
        return self.has_keys() or bool(self.client_ca)
