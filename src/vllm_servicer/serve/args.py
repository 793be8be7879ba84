"""The launcher's command line: its parser, and `ServeArgs`, what it parses into.

`parse_args(argv)` is the one way in: the launcher's own flags become typed
fields of a frozen `ServeArgs`, which refuses contradictory ones; vLLM's engine
flags travel beside them, as parsed, until the engine is built from them
(`ServeArgs.engine_args()`), as `vllm serve` builds its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from ..budgets import RequestBudgets, flag_name
from ..interceptors.keyless import KeylessLimits
from ..options import DEFAULT_MAX_KV_SUBSCRIBERS, DEFAULT_MAX_MESSAGE_BYTES
from ..proto import CONTROL_SERVICE, INFERENCE_SERVICE, SERVICE_NAME

if TYPE_CHECKING:
    from vllm.engine.arg_utils import AsyncEngineArgs

__all__ = ["ADMIN_KEY_ENV", "API_KEY_ENV", "ServeArgs", "build_parser", "parse_args"]

logger = logging.getLogger("vllm_servicer.serve")

# Keys from the environment stay out of the process list. The first is vLLM's own.
API_KEY_ENV = "VLLM_API_KEY"
ADMIN_KEY_ENV = "VLLM_SERVICER_ADMIN_API_KEY"

# The protocols by launcher name: what `mount(services=...)` takes.
_SERVICE_CHOICES = {
    "vllm-engine": SERVICE_NAME,
    "inference": INFERENCE_SERVICE,
    "control": CONTROL_SERVICE,
}
# Without a key or client certificates anyone who reaches the port could call
# vllm.Control (shut down, sleep, load adapters): served only when named then.
UNAUTHENTICATED_SERVICES = (SERVICE_NAME, INFERENCE_SERVICE)
_KEYLESS_DEFAULTS = KeylessLimits()

_DESCRIPTION = "Standalone launcher: `python -m vllm_servicer serve [vLLM engine flags]`."


@dataclass(frozen=True)
class ServeArgs:
    """What the launcher serves, and how: its options, and vLLM's engine flags.

    Each field is the launcher flag of the same name (`--max-inflight` is
    `max_inflight`); see `vllm-servicer serve --help` for what each does.
    vLLM's spellings of the TLS flags are folded in: `--ssl-certfile` and
    `--ssl-keyfile` are `tls_cert` and `tls_key`, `--ssl-ca-certs` with
    `--ssl-cert-reqs 2` is `tls_client_ca`. An engine flag reads by its name
    too, as on vLLM's own parsed arguments: `args.max_model_len` is
    `args.engine["max_model_len"]`.

    Raises:
        ValueError: options that contradict each other; the message names the flags.
    """

    engine: Mapping[str, Any]
    """vLLM's engine flags by `AsyncEngineArgs` field name, as parsed (defaults included)."""
    host: str
    port: int
    api_server_count: int
    max_message_bytes: int
    max_inflight: int
    max_concurrent_rpcs: int
    max_kv_subscribers: int
    max_connection_age: float | None
    allow_request_compression: bool
    no_reflection: bool
    warm_up: bool
    enable_media_refs: bool
    enable_shm_tensors: bool
    services: tuple[str, ...]
    lora_modules: Mapping[str, str]
    http_port: int | None
    http_host: str | None
    chat_template: str | None
    drain_grace: float
    metrics_port: int | None
    metrics_host: str | None
    api_key: tuple[str, ...]
    api_key_file: str | None
    admin_api_key: tuple[str, ...]
    admin_api_key_file: str | None
    tls_cert: str | None
    tls_key: str | None
    health_port: int | None
    tls_client_ca: str | None
    admin_tls_subject: tuple[str, ...]
    budgets: RequestBudgets = RequestBudgets()
    """What one request may cost (`--max-n`, `--max-request-media-pixels`...): `mount(budgets=)`."""
    max_keyless_streams: int = _KEYLESS_DEFAULTS.max_keyless_streams
    max_keyless_checks: int = _KEYLESS_DEFAULTS.max_keyless_checks
    max_keyless_per_connection: int = _KEYLESS_DEFAULTS.max_keyless_per_connection
    services_named: bool = False
    """Whether `--services` was given (else `services` is the default for the credentials)."""

    def __post_init__(self) -> None:
        if self.api_server_count < 1:
            raise ValueError(f"--api-server-count must be at least 1, got {self.api_server_count}")
        if self.api_key and self.api_key_file:
            raise ValueError("give --api-key or --api-key-file, not both")
        if self.admin_api_key and self.admin_api_key_file:
            raise ValueError("give --admin-api-key or --admin-api-key-file, not both")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        if self.health_port is not None and not self.tls_cert:
            raise ValueError("--health-port is for a TLS server (without TLS, probes use --port)")
        if self.admin_tls_subject and not self.tls_client_ca:
            raise ValueError("--admin-tls-subject needs --tls-client-ca")
        if self.admin_tls_subject and self.has_keys():
            raise ValueError(
                "--admin-tls-subject is for client certificates without API keys; "
                "with keys, give admins an admin key"
            )
        if self.lora_modules and not {INFERENCE_SERVICE, CONTROL_SERVICE} & set(self.services):
            raise ValueError(
                "--lora-modules are served through vllm.Inference (lora_name) and "
                "vllm.Control: add one of them to --services"
            )
        if self.http_port is None and (self.http_host or self.chat_template):
            raise ValueError("--http-host and --chat-template need --http-port")
        if self.http_port and self.http_port == self.port and self.http_address == self.host:
            raise ValueError("--http-port must differ from --port")
        for name in ("max_keyless_streams", "max_keyless_checks", "max_keyless_per_connection"):
            if getattr(self, name) < 1:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be at least 1, got {getattr(self, name)}")

    def __reduce__(self) -> tuple[Any, ...]:
        # Handed to each frontend process (--api-server-count): read-only
        # mappings do not pickle, so they travel as dicts.
        fields = {
            f.name: dict(value) if isinstance(value, MappingProxyType) else value
            for f in dataclasses.fields(self)
            for value in (getattr(self, f.name),)
        }
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
        args = cls(
            engine=_engine_flags(flags),
            host=flags.host,
            port=flags.port,
            api_server_count=flags.api_server_count,
            max_message_bytes=flags.max_message_bytes,
            max_inflight=flags.max_inflight,
            max_concurrent_rpcs=flags.max_concurrent_rpcs,
            max_kv_subscribers=flags.max_kv_subscribers,
            max_connection_age=flags.max_connection_age,
            allow_request_compression=flags.allow_request_compression,
            no_reflection=flags.no_reflection,
            warm_up=flags.warm_up,
            enable_media_refs=flags.enable_media_refs,
            enable_shm_tensors=flags.enable_shm_tensors,
            services=tuple(_SERVICE_CHOICES[name] for name in flags.services or _SERVICE_CHOICES),
            lora_modules=_lora_modules(flags.lora_modules),
            http_port=flags.http_port,
            http_host=flags.http_host,
            chat_template=flags.chat_template,
            drain_grace=flags.drain_grace,
            metrics_port=flags.metrics_port,
            metrics_host=flags.metrics_host,
            api_key=tuple(flags.api_key),
            api_key_file=flags.api_key_file,
            admin_api_key=tuple(flags.admin_api_key),
            admin_api_key_file=flags.admin_api_key_file,
            tls_cert=flags.tls_cert,
            tls_key=flags.tls_key,
            health_port=flags.health_port,
            tls_client_ca=_client_ca(flags),
            admin_tls_subject=tuple(flags.admin_tls_subject),
            budgets=_budgets_of(flags),
            max_keyless_streams=flags.max_keyless_streams,
            max_keyless_checks=flags.max_keyless_checks,
            max_keyless_per_connection=flags.max_keyless_per_connection,
            services_named=flags.services is not None,
        )
        if args.services_named or args.authenticates():
            return args
        return dataclasses.replace(args, services=UNAUTHENTICATED_SERVICES)

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
            or os.environ.get(API_KEY_ENV, "").strip()
            or os.environ.get(ADMIN_KEY_ENV, "").strip()
        )

    def authenticates(self) -> bool:
        """Whether calls need credentials: a key from any source, or client certificates."""
        return self.has_keys() or bool(self.tls_client_ca)

    @property
    def keyless_limits(self) -> KeylessLimits:
        """The caps on calls that need no key (health, reflection), per process."""
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
    for name in ("engine", "lora_modules"):
        fields[name] = MappingProxyType(fields[name])
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
    from ..testing.tiny_model import TINY_ENGINE_KWARGS

    parser = build_parser()
    flags = parser.parse_args(argv)
    tiny = flags.model_tag is None and flags.model is None
    if tiny:
        # Parsed again with the tiny model's settings as defaults, so that
        # flags the user gave still win over them.
        flags = build_parser(TINY_ENGINE_KWARGS).parse_args(argv)
    try:
        args = ServeArgs.from_flags(flags)
    except ValueError as refused:
        parser.error(str(refused))
    return _with_tiny_model(args) if tiny else args


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
    return MappingProxyType(engine)


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
    for add_flags in (
        _model,
        _serving,
        _http_api,
        _shutdown,
        _observability,
        _security,
        _budgets,
    ):
        add_flags(serve)
    AsyncEngineArgs.add_cli_args(serve)
    # Our drain waits this long for in-flight calls (vLLM's default 0 would cut them).
    serve.set_defaults(model=None, shutdown_timeout=30, **(engine_defaults or {}))
    return parser


def _model(serve: argparse.ArgumentParser) -> None:
    # vLLM's parser rewrites `serve --model X` into `serve X` (its positional form).
    serve.add_argument("model_tag", nargs="?", default=None, help="the model (same as --model)")


def _serving(serve: argparse.ArgumentParser) -> None:
    net = serve.add_argument_group("vllm-servicer: serving")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    net.add_argument("--port", type=int, default=50051, help="port to bind (0: any free port)")
    net.add_argument(
        "--max-message-bytes",
        type=int,
        default=DEFAULT_MAX_MESSAGE_BYTES,
        help="largest request or response message accepted, in bytes",
    )
    net.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        help="serving processes, each a client of the one engine, all on --port (the kernel "
        "spreads connections among them, SO_REUSEPORT); above 1 when one core cannot keep up "
        "with the engine's tokens (default 1)",
    )
    net.add_argument(
        "--max-inflight",
        type=int,
        default=1024,
        help="most Generate/Embed calls in flight (default 1024); beyond it calls get "
        "RESOURCE_EXHAUSTED with a retry hint (0: no limit)",
    )
    net.add_argument(
        "--max-concurrent-rpcs",
        type=int,
        default=2048,
        help="most calls (streams included, refused ones too) the server runs at once besides "
        "health and reflection, whose --max-keyless-* slots come on top; past it grpc answers "
        "RESOURCE_EXHAUSTED before any handler or key check runs (default 2048, above "
        "--max-inflight so that engine calls meet that limit and its retry hint first; "
        "0: no cap)",
    )
    # The caps of calls that need no key: their slots come on top of
    # --max-concurrent-rpcs, so keyless calls never take one a keyed call needs.
    net.add_argument(
        "--max-keyless-streams",
        type=int,
        default=_KEYLESS_DEFAULTS.max_keyless_streams,
        help="most health Watch and reflection streams (no key needed) open at once; past it "
        "RESOURCE_EXHAUSTED. Slots of their own, on top of --max-concurrent-rpcs "
        f"(default {_KEYLESS_DEFAULTS.max_keyless_streams})",
    )
    net.add_argument(
        "--max-keyless-checks",
        type=int,
        default=_KEYLESS_DEFAULTS.max_keyless_checks,
        help="most health Check calls at once, apart from the streams so that probes are "
        "answered while those are full; on top of --max-concurrent-rpcs "
        f"(default {_KEYLESS_DEFAULTS.max_keyless_checks})",
    )
    net.add_argument(
        "--max-keyless-per-connection",
        type=int,
        default=_KEYLESS_DEFAULTS.max_keyless_per_connection,
        help="most health and reflection calls at once on one connection "
        f"(default {_KEYLESS_DEFAULTS.max_keyless_per_connection})",
    )
    net.add_argument(
        "--max-kv-subscribers",
        type=int,
        default=DEFAULT_MAX_KV_SUBSCRIBERS,
        help="most SubscribeKvEvents streams open at once",
    )
    net.add_argument(
        "--max-connection-age",
        type=float,
        default=None,
        help="seconds after which clients are asked to reconnect (re-spreads load)",
    )
    net.add_argument(
        "--allow-request-compression",
        action="store_true",
        help="accept gzip/deflate-compressed requests (off: UNIMPLEMENTED before any "
        "handler, so no client, with a key or without, can make the server inflate a request)",
    )
    net.add_argument("--no-reflection", action="store_true", help="do not serve reflection")
    net.add_argument(
        "--warm-up",
        action="store_true",
        help="run one short generation before the port opens, so that the first client "
        "does not pay for what the engine initialises on its first request",
    )
    net.add_argument(
        "--enable-media-refs",
        action="store_true",
        help="resolve images that Generate names by URL (media_refs): data: URLs, file: under "
        "--allowed-local-media-path, http(s): only to --allowed-media-domains",
    )
    net.add_argument(
        "--services",
        nargs="+",
        choices=tuple(_SERVICE_CHOICES),
        default=None,
        help="the protocols to serve: vllm-engine (vllm.grpc.engine.VllmEngine), "
        "inference (vLLM's vllm.Inference) and control (vLLM's vllm.Control: adapters, "
        "pause, sleep, weight updates, shutdown; administrators only when keys are set); "
        "default: all three with API keys or --tls-client-ca, else vllm-engine and inference "
        "(naming control then serves it to anyone who reaches the port, with a warning)",
    )
    net.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters to serve by name from the start (needs --enable-lora); "
        "more can be loaded through vllm.Control's LoadLora",
    )
    net.add_argument(
        "--enable-shm-tensors",
        action="store_true",
        help="take preprocessed image tensors (mm_inputs) through this host's shared memory "
        "too, not only inline: only where every caller may read this host's shared memory",
    )


def _budgets(serve: argparse.ArgumentParser) -> None:
    # One flag per RequestBudgets field, declared there once (name, default, help).
    group = serve.add_argument_group(
        "vllm-servicer: per-request budgets (refused before any engine work)"
    )
    for field in dataclasses.fields(RequestBudgets):
        group.add_argument(
            flag_name(field.name),
            type=int,
            default=field.default,
            help=f"{field.metadata['help']} (default {field.default})",
        )


def _budgets_of(flags: argparse.Namespace) -> RequestBudgets:
    """The budgets the flags give.

    Raises:
        ValueError: a budget below 1, or per-request media bytes above the process's.
    """
    return RequestBudgets(
        **{field.name: getattr(flags, field.name) for field in dataclasses.fields(RequestBudgets)}
    )


def _http_api(serve: argparse.ArgumentParser) -> None:
    http = serve.add_argument_group("vllm-servicer: vLLM's HTTP API on the same engine")
    http.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="also serve vLLM's OpenAI-compatible HTTP API on this port (0: any free port; "
        "off by default); same keys and TLS as gRPC",
    )
    http.add_argument(
        "--http-host", default=None, help="address of the HTTP API (default: the same as --host)"
    )
    http.add_argument(
        "--chat-template",
        default=None,
        help="chat template (file or inline Jinja) for /v1/chat/completions, as vLLM's own",
    )


def _shutdown(serve: argparse.ArgumentParser) -> None:
    drain = serve.add_argument_group("vllm-servicer: shutdown")
    drain.add_argument(
        "--drain-grace",
        type=float,
        default=2.0,
        help="seconds the server keeps answering after health turns NOT_SERVING on SIGTERM",
    )


def _observability(serve: argparse.ArgumentParser) -> None:
    obs = serve.add_argument_group("vllm-servicer: observability")
    obs.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on this port (off by default)",
    )
    obs.add_argument(
        "--metrics-host",
        default=None,
        help="address of the metrics endpoint (default: the same as --host)",
    )


def _security(serve: argparse.ArgumentParser) -> None:
    sec = serve.add_argument_group("vllm-servicer: security")
    sec.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="inference key: accept `authorization: Bearer <key>`; repeat for several keys "
        "(rotation). Visible in the process list: prefer --api-key-file or $VLLM_API_KEY",
    )
    sec.add_argument(
        "--api-key-file",
        default=None,
        help="file of inference keys, one per line (re-read when it changes; "
        "empty or unreadable: no key is valid)",
    )
    sec.add_argument(
        "--admin-api-key",
        action="append",
        default=[],
        help="admin key: also FlushCache, StartProfile/StopProfile and Abort of any request "
        f"(default ${ADMIN_KEY_ENV}); prefer --admin-api-key-file",
    )
    sec.add_argument(
        "--admin-api-key-file",
        default=None,
        help="file of admin keys, one per line (re-read when it changes)",
    )
    # vLLM's own server names the same two files --ssl-certfile/--ssl-keyfile.
    sec.add_argument(
        "--tls-cert", "--ssl-certfile", default=None, help="server certificate chain (PEM)"
    )
    sec.add_argument("--tls-key", "--ssl-keyfile", default=None, help="server private key (PEM)")
    sec.add_argument(
        "--health-port",
        type=int,
        default=None,
        help="with --tls-cert: also serve grpc.health.v1 alone, in plaintext, on this port "
        "(0: any free port), for probes that cannot speak TLS (Kubernetes' gRPC probes)",
    )
    sec.add_argument(
        "--tls-client-ca",
        default=None,
        help="CA bundle (PEM) for client certificates; when given, clients must present one. "
        "Without API keys, the certificate names the caller (its common name): any "
        "certificate may generate and abort its own requests, only --admin-tls-subject "
        "ones may administer",
    )
    # vLLM's names for --tls-client-ca (see _client_ca).
    sec.add_argument("--ssl-ca-certs", default=None, help="with --ssl-cert-reqs 2: --tls-client-ca")
    sec.add_argument(
        "--ssl-cert-reqs",
        type=int,
        choices=(0, 2),
        default=0,
        help="2: clients must present a certificate from --ssl-ca-certs (vLLM's flag)",
    )
    sec.add_argument(
        "--enable-ssl-refresh",
        action="store_true",
        help="accepted as vLLM's server does: certificate files are always re-read here "
        "when they change",
    )
    sec.add_argument(
        "--admin-tls-subject",
        action="append",
        default=[],
        metavar="SUBJECT",
        help="with --tls-client-ca and no API keys: a client certificate subject with the "
        "admin role (FlushCache, StartProfile/StopProfile, Abort of any request), a common "
        "name ('ops') or a whole subject ('CN=ops,O=Acme'); repeat for several. Without it, "
        "no certificate may call the admin methods (vLLM's HTTP admin paths: none may)",
    )
