"""The launcher's command line: its parser, and `ServeArgs`, what it parses into.

`parse_args(argv)` is the one way in: the launcher's own flags become typed
fields of a frozen `ServeArgs`, which refuses contradictory ones; vLLM's engine
flags travel beside them, as parsed, until the engine is built from them
(`ServeArgs.engine_args()`), as `vllm serve` builds its own.

Each launcher flag is declared once: as a `ServeArgs` field carrying its help
and group (`flags.flag`), or, for what `mount()` takes, as a `MountOptions` or
`RequestBudgets` field carrying its help; the parser's groups and
`ServeArgs.from_flags` are built from those fields.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from operator import not_
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from ..budgets import RequestBudgets
from ..interceptors.call_slots import DEFAULT_REQUEST_READ_TIMEOUT, DEFAULT_RESPONSE_WRITE_TIMEOUT
from ..interceptors.keyless import KeylessLimits
from ..options import DEFAULT_MAX_MESSAGE_BYTES, MountOptions, option_flag
from ..proto import (
    CONTROL_SERVICE,
    INFERENCE_SERVICE,
    POOLING_SERVICE,
    RENDER_SERVICE,
    SERVICE_NAME,
)
from .flags import Flag, add_flags, declared_flags, flag, flag_values, not_a_flag
from .http_timeouts import DEFAULT_HTTP_HEADER_TIMEOUT, DEFAULT_MAX_HTTP_CONNECTIONS

if TYPE_CHECKING:
    from vllm.engine.arg_utils import AsyncEngineArgs

    from ..multimodal.media import MediaRefOptions

__all__ = [
    "ADMIN_KEY_ENV",
    "API_KEY_ENV",
    "ROUTER_KEY_ENV",
    "ServeArgs",
    "build_parser",
    "parse_args",
]

logger = logging.getLogger("vllm_servicer.serve")

# Keys from the environment stay out of the process list. The first is vLLM's own.
API_KEY_ENV = "VLLM_API_KEY"
ADMIN_KEY_ENV = "VLLM_SERVICER_ADMIN_API_KEY"
ROUTER_KEY_ENV = "VLLM_SERVICER_ROUTER_API_KEY"
_KEY_ENVS = (API_KEY_ENV, ADMIN_KEY_ENV, ROUTER_KEY_ENV)

# The protocols by launcher name: what `MountOptions.services` takes.
_SERVICE_CHOICES = {
    "vllm-engine": SERVICE_NAME,
    "inference": INFERENCE_SERVICE,
    "control": CONTROL_SERVICE,
    "pooling": POOLING_SERVICE,
    "render": RENDER_SERVICE,
}
# Without a key or client certificates anyone who reaches the port could call
# vllm.Control (shut down, sleep, load adapters): served only when named then.
UNAUTHENTICATED_SERVICES = (SERVICE_NAME, INFERENCE_SERVICE, POOLING_SERVICE, RENDER_SERVICE)
_KEYLESS_DEFAULTS = KeylessLimits()

_DESCRIPTION = "Standalone launcher: `python -m vllm_servicer serve [vLLM engine flags]`."


# The launcher's argparse groups, shown in this order.
_SERVING = "vllm-servicer: serving"
_HTTP_API = "vllm-servicer: vLLM's HTTP API on the same engine"
_SHUTDOWN = "vllm-servicer: shutdown"
_OBSERVABILITY = "vllm-servicer: observability"
_SECURITY = "vllm-servicer: security"
_BUDGETS = "vllm-servicer: per-request budgets (refused before any engine work)"

# Flags of vLLM's own server that are no field here: its spelling of
# --tls-client-ca (read by _client_ca), and one accepted as it is.
_VLLM_TLS_FLAGS = {
    "ssl_ca_certs": Flag(_SECURITY, "with --ssl-cert-reqs 2: --tls-client-ca", default=None),
    "ssl_cert_reqs": Flag(
        _SECURITY,
        "2: clients must present a certificate from --ssl-ca-certs (vLLM's flag)",
        type=int,
        choices=(0, 2),
        default=0,
    ),
    "enable_ssl_refresh": Flag(
        _SECURITY,
        "accepted as vLLM's server does: certificate files are always re-read here "
        "when they change",
        action="store_true",
        default=False,
    ),
}


# One flag per `RequestBudgets` field, declared there once (name, default, help).
_BUDGET_FLAGS = {
    field.name: Flag(
        _BUDGETS,
        f"{field.metadata['help']} (default {field.default})",
        type=int,
        default=field.default,
    )
    for field in dataclasses.fields(RequestBudgets)
}


def _media_refs(enabled: bool) -> MediaRefOptions | None:
    """`--enable-media-refs` as `MountOptions.media_refs`: the launcher's rules, or None."""
    from ..multimodal.media import MediaRefOptions

    return MediaRefOptions() if enabled else None


def _option_flag(field: dataclasses.Field[Any]) -> Flag:
    """The flag of a `MountOptions` field, from its help and default.

    A field on by default is turned off by its flag (`--no-reflection`); a
    field that is no plain number, text or switch is read as `_OPTION_READERS` says.
    """
    group = _SECURITY if field.name in _SECURITY_OPTIONS else _SERVING
    help_text: str = field.metadata["help"]
    metavar = field.metadata.get("metavar")
    reader = _OPTION_READERS.get(field.name)
    if reader is not None:
        return Flag(group, help_text, metavar=metavar, **reader)
    if field.default is True:
        return Flag(group, f"do not {help_text}", action="store_true", default=False, convert=not_)
    if field.default is False:
        return Flag(group, help_text, action="store_true", default=False)
    kind = int if isinstance(field.default, int) else None
    return Flag(group, help_text, type=kind, metavar=metavar, default=field.default)


def _services(names: list[str] | None) -> tuple[str, ...]:
    """`--services` as `MountOptions.services` takes them; not named, those safe
    without credentials."""
    if names is None:
        return UNAUTHENTICATED_SERVICES
    return tuple(_SERVICE_CHOICES[name] for name in names)


def _lora_modules(given: list[str]) -> Mapping[str, str]:
    """`name=path` pairs (vLLM's `--lora-modules` form) as a mapping."""
    modules: dict[str, str] = {}
    for item in given:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes name=path, got {item!r}")
        if name in modules:
            raise ValueError(f"--lora-modules names {name!r} twice")
        modules[name] = path
    return MappingProxyType(modules)


# How the launcher reads the `MountOptions` fields whose flag is no plain
# number, text or switch; the rest follow from the field (`_option_flag`).
_OPTION_READERS: dict[str, dict[str, Any]] = {
    "media_refs": {"action": "store_true", "default": False, "convert": _media_refs},
    "lora_modules": {"nargs": "+", "default": [], "convert": _lora_modules},
}
_SECURITY_OPTIONS = frozenset({"routing_data_for_every_key", "shared_prefix_cache"})

# One flag per `MountOptions` field that has one, declared there once (help,
# spelling, default), by the flag's argparse name; and the field each sets.
_OPTION_FIELDS = {
    spelled[2:].replace("-", "_"): field
    for field in dataclasses.fields(MountOptions)
    if (spelled := option_flag(field)) is not None
}
_OPTION_FLAGS = {dest: _option_flag(field) for dest, field in _OPTION_FIELDS.items()}

# The protocols are the launcher's to name (short names; the default follows
# the credentials, `ServeArgs.from_flags`): `MountOptions.services` has no flag.
_SERVICES_FLAG = {
    "services": Flag(
        _SERVING,
        "the protocols to serve: vllm-engine (vllm.grpc.engine.VllmEngine), "
        "inference (vLLM's vllm.Inference), pooling (vllm_servicer.v1.Pooling: classify, "
        "score, rerank), render (vllm_servicer.v1.Render: prompts as the engine runs them) "
        "and control (vLLM's vllm.Control: adapters, pause, sleep, weight updates, shutdown; "
        "administrators only when keys are set); default: all of them with API keys or "
        "--tls-client-ca, else all but control (naming control then serves it to anyone "
        "who reaches the port, with a warning)",
        nargs="+",
        choices=tuple(_SERVICE_CHOICES),
        default=None,
    )
}


def _mount_options(flags: argparse.Namespace) -> MountOptions:
    """`MountOptions` from the parsed flags: each option's, `--services`, the budgets'.

    Raises:
        ValueError: a value an option's flag or `MountOptions` refuses.
    """
    values = {}
    for dest, declared in _OPTION_FLAGS.items():
        parsed = getattr(flags, dest)
        values[_OPTION_FIELDS[dest].name] = declared.convert(parsed) if declared.convert else parsed
    return MountOptions(
        services=_services(flags.services),
        budgets=RequestBudgets(**{name: getattr(flags, name) for name in _BUDGET_FLAGS}),
        **values,
    )


@dataclass(frozen=True)
class ServeArgs:
    """What the launcher serves, and how: its options, and vLLM's engine flags.

    Each field declared with `flag()` is the launcher flag of the same name
    (`--max-inflight` is `max_inflight`), with its help and group beside it:
    adding a field that way adds the flag. vLLM's spellings of the TLS flags
    are folded in: `--ssl-certfile` and `--ssl-keyfile` are `tls_cert` and
    `tls_key`, `--ssl-ca-certs` with `--ssl-cert-reqs 2` is `tls_client_ca`.
    An engine flag reads by its name too, as on vLLM's own parsed arguments:
    `args.max_model_len` is `args.engine["max_model_len"]`.

    What `mount()` takes is one field, `options` (`MountOptions`, whose
    fields declare their flags). Its `services` default to what is safe without
    credentials (no vllm.Control); `from_flags` widens them to every protocol
    when keys or client certificates are set, so a `ServeArgs` built by hand
    with keys names its services itself.

    Raises:
        ValueError: options that contradict each other; the message names the flags.
    """

    engine: Mapping[str, Any] = not_a_flag()
    """vLLM's engine flags by `AsyncEngineArgs` field name, as parsed (defaults included)."""

    host: str = flag("127.0.0.1", group=_SERVING, help="address to bind (default: loopback)")
    port: int = flag(50051, group=_SERVING, help="port to bind (0: any free port)")
    max_message_bytes: int = flag(
        DEFAULT_MAX_MESSAGE_BYTES,
        group=_SERVING,
        help="largest request or response message accepted, in bytes; the HTTP API's "
        "request bodies too (past it 413)",
    )
    api_server_count: int = flag(
        1,
        group=_SERVING,
        help="serving processes, each a client of the one engine, all on --port (the kernel "
        "spreads connections among them, SO_REUSEPORT); above 1 when one core cannot keep up "
        "with the engine's tokens (default 1)",
    )
    max_inflight: int = flag(
        1024,
        group=_SERVING,
        help="most engine calls in flight, every protocol's and the HTTP API's (default 1024); "
        "beyond it calls get "
        "RESOURCE_EXHAUSTED with a retry hint (0: no limit); each key is held to its fair "
        "share of them while other keys want some (see --no-fair-shares)",
    )
    no_fair_shares: bool = flag(
        False,
        group=_SERVING,
        help="let any key take all of --max-inflight, first come first served; by default "
        "each key (an identity without the admin role) is held to its fair share of it while "
        "other keys want slots (hold some, or were refused one in the last 10 s): past it "
        "RESOURCE_EXHAUSTED (HTTP 503) naming the share; a key alone takes them all",
    )
    max_concurrent_rpcs: int = flag(
        2048,
        group=_SERVING,
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
        group=_SERVING,
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
        group=_SERVING,
        help="seconds each message of a keyed call's streamed answer may wait for its client "
        "to take it (a client that stops reading, or grants no HTTP/2 flow-control window); "
        "past it the call ends, its engine request is aborted and its slots come back "
        f"(default {DEFAULT_RESPONSE_WRITE_TIMEOUT:g})",
        metavar="SECONDS",
    )
    # The caps of calls that need no key: their slots come on top of
    # --max-concurrent-rpcs, so keyless calls never take one a keyed call needs.
    max_keyless_streams: int = flag(
        _KEYLESS_DEFAULTS.max_keyless_streams,
        group=_SERVING,
        help="most health Watch, reflection and ORCA load-report streams (no key needed) open "
        "at once; past it "
        "RESOURCE_EXHAUSTED. Slots of their own, on top of --max-concurrent-rpcs "
        f"(default {_KEYLESS_DEFAULTS.max_keyless_streams})",
    )
    max_keyless_checks: int = flag(
        _KEYLESS_DEFAULTS.max_keyless_checks,
        group=_SERVING,
        help="most health Check calls at once, apart from the streams so that probes are "
        "answered while those are full; on top of --max-concurrent-rpcs "
        f"(default {_KEYLESS_DEFAULTS.max_keyless_checks})",
    )
    max_keyless_per_connection: int = flag(
        _KEYLESS_DEFAULTS.max_keyless_per_connection,
        group=_SERVING,
        help="most health, reflection and load-report calls at once on one connection "
        f"(default {_KEYLESS_DEFAULTS.max_keyless_per_connection})",
    )
    max_connection_age: float | None = flag(
        None,
        group=_SERVING,
        help="seconds after which clients are asked to reconnect (re-spreads load)",
    )
    allow_request_compression: bool = flag(
        False,
        group=_SERVING,
        help="accept gzip/deflate-compressed requests (off: UNIMPLEMENTED before any "
        "handler, so no client, with a key or without, can make the server inflate a request)",
    )
    headless: bool = flag(
        False,
        group=_SERVING,
        help="start this node's data-parallel engines for a head launcher elsewhere, as "
        "vLLM's `serve --headless` does, and serve nothing here (no port is bound): with "
        "--data-parallel-size N --data-parallel-size-local L --data-parallel-start-rank S "
        "--data-parallel-address HEAD --data-parallel-rpc-port P; exits 1 when an engine ends "
        "without being asked to (see docs/scale-out.md)",
    )
    event_loop: str = flag(
        "auto",
        group=_SERVING,
        choices=("auto", "uvloop", "asyncio"),
        help="the serving processes' event loop: uvloop, asyncio's own, or auto (uvloop "
        "when installed, as vLLM's HTTP server runs)",
    )
    warm_up: bool = flag(
        False,
        group=_SERVING,
        help="run one short generation before the port opens, so that the first client "
        "does not pay for what the engine initialises on its first request",
    )

    http_port: int | None = flag(
        None,
        group=_HTTP_API,
        help="also serve vLLM's OpenAI-compatible HTTP API on this port (0: any free port; "
        "off by default); same keys and TLS as gRPC",
    )
    http_host: str | None = flag(
        None, group=_HTTP_API, help="address of the HTTP API (default: the same as --host)"
    )
    http_header_timeout: float = flag(
        DEFAULT_HTTP_HEADER_TIMEOUT,
        group=_HTTP_API,
        help="seconds an HTTP API connection has to send a request's headers, from its "
        "opening and from the end of each response; past it the connection is closed (408 "
        "when part of a request came). Its body then has --request-read-timeout "
        f"(default {DEFAULT_HTTP_HEADER_TIMEOUT:g})",
        metavar="SECONDS",
    )
    max_http_connections: int = flag(
        DEFAULT_MAX_HTTP_CONNECTIONS,
        group=_HTTP_API,
        help="most connections the HTTP API holds open at once, per process; past it a new "
        "connection is answered 503 and closed before it is read "
        f"(default {DEFAULT_MAX_HTTP_CONNECTIONS}; 0: no cap)",
    )
    enable_scale_out: bool = flag(
        False,
        group=_HTTP_API,
        help="serve vLLM's scale-out routes on the HTTP API too (/v1/.../render, "
        "/v1/.../derender, /inference/v1/generate), as vLLM's own --enable-scale-out; "
        "gRPC's Render serves rendering and derendering without it",
    )

    drain_grace: float = flag(
        2.0,
        group=_SHUTDOWN,
        help="seconds the server keeps answering after health turns NOT_SERVING on SIGTERM",
    )

    metrics_port: int | None = flag(
        None, group=_OBSERVABILITY, help="serve Prometheus metrics on this port (off by default)"
    )
    metrics_host: str | None = flag(
        None,
        group=_OBSERVABILITY,
        help="address of the metrics endpoint (default: the same as --host)",
    )

    api_key: tuple[str, ...] = flag(
        (),
        group=_SECURITY,
        help="inference key: accept `authorization: Bearer <key>`; repeat for several keys "
        "(rotation). Visible in the process list: prefer --api-key-file or $VLLM_API_KEY",
        action="append",
        parsed_default=[],
        convert=tuple,
    )
    api_key_file: str | None = flag(
        None,
        group=_SECURITY,
        help="file of inference keys, one per line (re-read when it changes; "
        "empty or unreadable: no key is valid)",
    )
    admin_api_key: tuple[str, ...] = flag(
        (),
        group=_SECURITY,
        help="admin key: also FlushCache, StartProfile/StopProfile and Abort of any request "
        f"(default ${ADMIN_KEY_ENV}); prefer --admin-api-key-file",
        action="append",
        parsed_default=[],
        convert=tuple,
    )
    admin_api_key_file: str | None = flag(
        None,
        group=_SECURITY,
        help="file of admin keys, one per line (re-read when it changes)",
    )
    router_api_key: tuple[str, ...] = flag(
        (),
        group=_SECURITY,
        help="router key: an inference key that also reads KV events (SubscribeKvEvents, "
        "GetKvEventSources: every tenant's token ids) and sends kv_transfer_params "
        f"(default ${ROUTER_KEY_ENV}); repeat for several; prefer --router-api-key-file, "
        "or role=router on a key's line in --api-key-file",
        action="append",
        parsed_default=[],
        convert=tuple,
    )
    router_api_key_file: str | None = flag(
        None,
        group=_SECURITY,
        help="file of router keys, one per line (re-read when it changes)",
    )
    # vLLM's own server names the same two files --ssl-certfile/--ssl-keyfile.
    tls_cert: str | None = flag(
        None,
        group=_SECURITY,
        help="server certificate chain (PEM)",
        aliases=("--ssl-certfile",),
    )
    tls_key: str | None = flag(
        None, group=_SECURITY, help="server private key (PEM)", aliases=("--ssl-keyfile",)
    )
    health_port: int | None = flag(
        None,
        group=_SECURITY,
        help="with --tls-cert: also serve grpc.health.v1 alone, in plaintext, on this port "
        "(0: any free port), for probes that cannot speak TLS (Kubernetes' gRPC probes)",
    )
    tls_client_ca: str | None = flag(
        None,
        group=_SECURITY,
        help="CA bundle (PEM) for client certificates; when given, clients must present one. "
        "Without API keys, the certificate names the caller (its common name): any "
        "certificate may generate and abort its own requests, only --admin-tls-subject "
        "ones may administer",
    )
    admin_tls_subject: tuple[str, ...] = flag(
        (),
        group=_SECURITY,
        help="with --tls-client-ca and no API keys: a client certificate subject with the "
        "admin role (FlushCache, StartProfile/StopProfile, Abort of any request), a common "
        "name ('ops') or a whole subject ('CN=ops,O=Acme'); repeat for several. Without it, "
        "no certificate may call the admin methods (vLLM's HTTP admin paths: none may)",
        action="append",
        metavar="SUBJECT",
        parsed_default=[],
        convert=tuple,
    )

    router_tls_subject: tuple[str, ...] = flag(
        (),
        group=_SECURITY,
        help="with --tls-client-ca and no API keys: a client certificate subject with the "
        "router role (KV events, kv_transfer_params), as --admin-tls-subject; repeat for "
        "several",
        action="append",
        metavar="SUBJECT",
        parsed_default=[],
        convert=tuple,
    )

    options: MountOptions = not_a_flag(default_factory=MountOptions)
    """What `mount()` serves and how: a flag per `MountOptions` field that has
    one, declared there (`_OPTION_FLAGS`), `--services`, and a flag per
    `RequestBudgets` field (`_BUDGET_FLAGS`)."""
    services_named: bool = not_a_flag(False)
    """Whether `--services` was given (else `services` follows the credentials)."""

    def __post_init__(self) -> None:
        if self.api_server_count < 1:
            raise ValueError(f"--api-server-count must be at least 1, got {self.api_server_count}")
        if self.headless:
            for given, option in (
                (self.api_server_count > 1, "--api-server-count"),
                (self.http_port is not None, "--http-port"),
                (self.health_port is not None, "--health-port"),
                (self.metrics_port is not None, "--metrics-port"),
                (self.warm_up, "--warm-up"),
            ):
                if given:
                    raise ValueError(f"--headless serves nothing here: {option} has no use")
        if self.api_key and self.api_key_file:
            raise ValueError("give --api-key or --api-key-file, not both")
        if self.admin_api_key and self.admin_api_key_file:
            raise ValueError("give --admin-api-key or --admin-api-key-file, not both")
        if self.router_api_key and self.router_api_key_file:
            raise ValueError("give --router-api-key or --router-api-key-file, not both")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        if self.health_port is not None and not self.tls_cert:
            raise ValueError("--health-port is for a TLS server (without TLS, probes use --port)")
        for option, subjects, role in (
            ("--admin-tls-subject", self.admin_tls_subject, "admins an admin key"),
            ("--router-tls-subject", self.router_tls_subject, "routers a router key"),
        ):
            if subjects and not self.tls_client_ca:
                raise ValueError(f"{option} needs --tls-client-ca")
            if subjects and self.has_keys():
                raise ValueError(
                    f"{option} is for client certificates without API keys; with keys, give {role}"
                )
        if self.options.lora_modules and set(self.options.services) <= {SERVICE_NAME}:
            raise ValueError(
                "--lora-modules are served through vllm.Inference (lora_name), vllm.Control "
                "and Pooling and Render (model), not VllmEngine: add one of them to --services"
            )
        if self.http_port is None and self.http_host:
            raise ValueError("--http-host needs --http-port")
        if self.http_port is None and self.enable_scale_out:
            raise ValueError("--enable-scale-out needs --http-port (gRPC's Render needs no flag)")
        if self.http_port and self.http_port == self.port and self.http_address == self.host:
            raise ValueError("--http-port must differ from --port")
        if self.http_header_timeout <= 0:
            raise ValueError(
                f"--http-header-timeout must be above 0, got {self.http_header_timeout}"
            )
        if self.max_http_connections < 0:
            raise ValueError(
                "--max-http-connections must be 0 (no cap) or more, "
                f"got {self.max_http_connections}"
            )
        if self.request_read_timeout <= 0:
            raise ValueError(
                f"--request-read-timeout must be above 0, got {self.request_read_timeout}"
            )
        if self.response_write_timeout <= 0:
            raise ValueError(
                f"--response-write-timeout must be above 0, got {self.response_write_timeout}"
            )
        for name in ("max_keyless_streams", "max_keyless_checks", "max_keyless_per_connection"):
            if getattr(self, name) < 1:
                option = "--" + name.replace("_", "-")
                raise ValueError(f"{option} must be at least 1, got {getattr(self, name)}")

    def __reduce__(self) -> tuple[Any, ...]:
        # Handed to each frontend process (--api-server-count): read-only
        # mappings do not pickle, so they travel as dicts.
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["engine"] = dict(self.engine)
        return (_unpickle_serve_args, (fields,))

    def __getattr__(self, name: str) -> Any:
        # Only names that are not fields get here: the engine flags.
        engine = object.__getattribute__(self, "engine")
        if name not in engine:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return engine[name]

    @classmethod
    def from_flags(cls, flags: argparse.Namespace) -> ServeArgs:
        """`ServeArgs` from what `build_parser()` parsed.

        Raises:
            ValueError: flags that contradict each other; the message names them.
        """
        values = flag_values(cls, flags)
        values.update(
            engine=_engine_flags(flags),
            tls_client_ca=_client_ca(flags),
            options=_mount_options(flags),
            services_named=flags.services is not None,
        )
        args = cls(**values)
        if args.services_named or not args.authenticates():
            return args
        # Not named: with credentials, every protocol (vllm.Control for administrators).
        every = dataclasses.replace(args.options, services=tuple(_SERVICE_CHOICES.values()))
        return dataclasses.replace(args, options=every)

    @property
    def http_address(self) -> str:
        """The HTTP API's host: `--http-host`, else `--host`."""
        return self.http_host or self.host

    @property
    def metrics_address(self) -> str:
        """The metrics endpoint's host: `--metrics-host`, else `--host`."""
        return self.metrics_host or self.host

    @property
    def tls(self) -> tuple[str, str, str | None] | None:
        """(certificate, key, client CA or None) when serving TLS, else None."""
        if self.tls_cert and self.tls_key:
            return self.tls_cert, self.tls_key, self.tls_client_ca
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
        return self.has_keys() or bool(self.tls_client_ca)

    @property
    def keyless_limits(self) -> KeylessLimits:
        """The caps on calls that need no key (health, reflection, load reports), per process."""
        return KeylessLimits(
            max_keyless_streams=self.max_keyless_streams,
            max_keyless_checks=self.max_keyless_checks,
            max_keyless_per_connection=self.max_keyless_per_connection,
        )

    def engine_args(self) -> AsyncEngineArgs:
        """vLLM's `AsyncEngineArgs` from the engine flags, as `from_cli_args` builds them."""
        from vllm.engine.arg_utils import AsyncEngineArgs

        return AsyncEngineArgs(**self.engine)


def _unpickle_serve_args(fields: dict[str, Any]) -> ServeArgs:
    fields["engine"] = MappingProxyType(fields["engine"])
    return ServeArgs(**fields)


def parse_args(argv: Sequence[str] | None = None) -> ServeArgs:
    """The launcher's command line as `ServeArgs`.

    Without `--model`, the built-in tiny model is written if missing and
    served, with its engine settings as defaults (flags given still win) and
    the CPU backend's environment defaults applied. Flags that do not parse
    or contradict each other end the process as argparse does: the message
    on stderr, exit code 2.

    Args:
        argv: the arguments after the program name (default: `sys.argv[1:]`).
    """
    from ..testing.tiny_model import TINY_ENGINE_KWARGS, default_model_dir

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        flags = parser.parse_args(argv)
        tiny = flags.model_tag is None and flags.model is None
    except ValueError as refused:
        # vLLM's parser refuses --served-model-name before a model is named. With
        # no model at all, the name is the tiny model's; anything else (a model
        # named later, a config file) stays the operator's to fix.
        if not _names_only_the_tiny_model(argv):
            parser.error(str(refused))
        argv = [*argv[:1], str(default_model_dir()), *argv[1:]]
        tiny = True
    if tiny:
        # Parsed again with the tiny model's settings as defaults, so that
        # flags the user gave still win over them.
        flags = build_parser(TINY_ENGINE_KWARGS).parse_args(argv)
    try:
        args = ServeArgs.from_flags(flags)
    except ValueError as refused:
        parser.error(str(refused))
    return _with_tiny_model(args) if tiny else args


_SERVED_NAME = re.compile(r"^--served[-_]model[-_]name(=.+)?$")


def _names_only_the_tiny_model(argv: Sequence[str]) -> bool:
    """Whether `argv` gives the served model one name and names no model: no
    config file, and the name followed by a flag or nothing (a second word
    after it would be read as a second name, though meant as the model)."""
    if any(re.match(r"^--config(=.+|$)", arg) for arg in argv):
        return False
    for index, arg in enumerate(argv):
        if named := _SERVED_NAME.match(arg):
            if named.group(1):
                return True
            name, *after = argv[index + 1 : index + 3] or ["-"]
            return not name.startswith("-") and (not after or after[0].startswith("-"))
    return False


def _with_tiny_model(args: ServeArgs) -> ServeArgs:
    """`args` serving the tiny model, written if missing, with the CPU environment it needs."""
    from ..testing.tiny_model import apply_cpu_env_defaults, ensure_tiny_model

    apply_cpu_env_defaults()
    logger.warning(
        "no --model given: serving the built-in tiny demo model (random weights, its "
        "text is noise); pass --model to serve a real one"
    )
    model = str(ensure_tiny_model())
    tokenizer = model if args.engine["tokenizer"] is None else args.engine["tokenizer"]
    engine = MappingProxyType({**args.engine, "model": model, "tokenizer": tokenizer})
    return dataclasses.replace(args, engine=engine)


def _engine_flags(flags: argparse.Namespace) -> Mapping[str, Any]:
    """The `AsyncEngineArgs` fields the command line set, with the launcher's CPU default."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform

    from .. import vllm_releases

    names = (field.name for field in dataclasses.fields(AsyncEngineArgs))
    engine = {name: getattr(flags, name) for name in names if hasattr(flags, name)}
    if flags.model_tag is not None:
        engine["model"] = flags.model_tag
    if (
        engine["enable_chunked_prefill"] is None
        and current_platform.is_cpu()
        and vllm_releases.SEEDED_DRAW_REWINDS
    ):
        # Whole prompts only, unless asked, where a split prompt's seeded draw
        # kills a CPU engine (vllm_releases.seeded_sampling_hazard: 0.31 to
        # 0.33). vLLM then raises the step's token budget to at least the
        # context length.
        engine["enable_chunked_prefill"] = False
    if engine.get("scheduling_policy", "") is None:
        # Tenants' requests run in the fair order of the work each brings
        # (fair_work.py), which vLLM applies through each request's priority; an
        # operator's --scheduling-policy fcfs keeps arrival order.
        engine["scheduling_policy"] = "priority"
    return MappingProxyType(engine)


def _client_ca(flags: argparse.Namespace) -> str | None:
    """`--tls-client-ca`, or vLLM's spelling of it: `--ssl-ca-certs` with `--ssl-cert-reqs 2`.

    Raises:
        ValueError: a CA file that would verify no client certificate, or two CA files.
    """
    given: str | None = flags.tls_client_ca
    vllm_ca: str | None = flags.ssl_ca_certs
    # vLLM uses a CA file for client certificates only when they are required
    # (--ssl-cert-reqs 2, ssl.CERT_REQUIRED).
    if flags.ssl_cert_reqs == 2:
        if not vllm_ca or given:
            raise ValueError("--ssl-cert-reqs 2 needs --ssl-ca-certs (and no --tls-client-ca)")
        return vllm_ca
    if vllm_ca:
        raise ValueError("--ssl-ca-certs is for client certificates: add --ssl-cert-reqs 2")
    return given


def build_parser(engine_defaults: Mapping[str, Any] | None = None) -> argparse.ArgumentParser:
    """The launcher's argument parser: its own flags plus every vLLM engine flag.

    Args:
        engine_defaults: engine settings that replace vLLM's defaults.
    """
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser_class: Any = FlexibleArgumentParser  # untyped in vLLM
    parser: argparse.ArgumentParser = parser_class(prog="vllm-servicer", description=_DESCRIPTION)
    # Typed as what argparse makes it anyway: a parser of the parser's own class.
    commands = parser.add_subparsers(
        dest="command", required=True, parser_class=FlexibleArgumentParser
    )
    serve = commands.add_parser("serve", help="serve a model over vLLM's gRPC protocol")
    _add_launcher_flags(serve)
    AsyncEngineArgs.add_cli_args(serve)
    # Our drain waits this long for in-flight calls (vLLM's default 0 would cut them).
    # None: the launcher's choice (`_engine_flags`), told apart from an operator's fcfs.
    defaults = {"model": None, "shutdown_timeout": 30, "scheduling_policy": None}
    serve.set_defaults(**{**defaults, **(engine_defaults or {})})
    return parser


def _add_launcher_flags(serve: argparse.ArgumentParser) -> None:
    # vLLM's parser rewrites `serve --model X` into `serve X` (its positional form).
    serve.add_argument("model_tag", nargs="?", default=None, help="the model (same as --model)")
    flags = {**declared_flags(ServeArgs), **_SERVICES_FLAG, **_OPTION_FLAGS}
    add_flags(serve, {**flags, **_VLLM_TLS_FLAGS, **_BUDGET_FLAGS})
