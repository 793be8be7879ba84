"""Standalone launcher: `python -m vllm_servicer serve [vLLM engine flags]`.

Builds an `AsyncLLM` from vLLM's own engine arguments (every vLLM engine flag
passes through), mounts the servicer on a new grpc.aio server with the
recommended options, optional metrics, authentication, TLS and tracing, and
serves until SIGTERM/SIGINT, then drains gracefully. With `--http-port` the
same engine also serves vLLM's own OpenAI-compatible HTTP API (`http_api.py`).
With no `--model`, it serves the built-in tiny model (random weights, no
download).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

logger = logging.getLogger("vllm_servicer.serve")

# Keys from the environment stay out of the process list. The first is vLLM's own.
API_KEY_ENV = "VLLM_API_KEY"
ADMIN_KEY_ENV = "VLLM_SERVICER_ADMIN_API_KEY"


def build_parser() -> Any:
    """The launcher's argument parser: its own flags plus every vLLM engine flag."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from ..options import DEFAULT_MAX_KV_SUBSCRIBERS, DEFAULT_MAX_MESSAGE_BYTES

    parser_class: Any = FlexibleArgumentParser  # untyped in vLLM
    parser = parser_class(prog="vllm-servicer", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model over vLLM's gRPC protocol")
    # vLLM's parser rewrites `serve --model X` into `serve X` (its positional form).
    serve.add_argument("model_tag", nargs="?", default=None, help="the model (same as --model)")

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
        help="most calls of any kind (streams included, refused ones too) the server runs at "
        "once; past it grpc answers RESOURCE_EXHAUSTED before any handler or key check runs "
        "(default 2048, above --max-inflight so that engine calls meet that limit and its "
        "retry hint first; 0: no cap)",
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
        "--enable-shm-tensors",
        action="store_true",
        help="take preprocessed image tensors (mm_inputs) through this host's shared memory "
        "too, not only inline: only where every caller may read this host's shared memory",
    )

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

    drain = serve.add_argument_group("vllm-servicer: shutdown")
    drain.add_argument(
        "--drain-grace",
        type=float,
        default=2.0,
        help="seconds the server keeps answering after health turns NOT_SERVING on SIGTERM",
    )

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
    # vLLM's names for the same settings: a CA file is used for client
    # certificates only when they are required (--ssl-cert-reqs 2, ssl.CERT_REQUIRED).
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

    AsyncEngineArgs.add_cli_args(serve)
    # Our drain waits this long for in-flight calls (vLLM's default 0 would cut them).
    serve.set_defaults(model=None, shutdown_timeout=30)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse launcher arguments; without --model, the tiny model's engine settings apply."""
    from ..testing.tiny_model import TINY_ENGINE_KWARGS, apply_cpu_env_defaults, ensure_tiny_model

    parser = build_parser()
    args: argparse.Namespace = parser.parse_args(argv)
    if args.model_tag is not None:
        args.model = args.model_tag
    if args.api_key and args.api_key_file:
        parser.error("give --api-key or --api-key-file, not both")
    if args.admin_api_key and args.admin_api_key_file:
        parser.error("give --admin-api-key or --admin-api-key-file, not both")
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    if args.ssl_cert_reqs == 2:
        if not args.ssl_ca_certs or args.tls_client_ca:
            parser.error("--ssl-cert-reqs 2 needs --ssl-ca-certs (and no --tls-client-ca)")
        args.tls_client_ca = args.ssl_ca_certs
    elif args.ssl_ca_certs:
        parser.error("--ssl-ca-certs is for client certificates: add --ssl-cert-reqs 2")
    if args.tls_client_ca and not args.tls_cert:
        parser.error("--tls-client-ca needs --tls-cert and --tls-key")
    if args.health_port is not None and not args.tls_cert:
        parser.error("--health-port is for a TLS server (without TLS, probes use --port)")
    if args.admin_tls_subject and not args.tls_client_ca:
        parser.error("--admin-tls-subject needs --tls-client-ca")
    if args.admin_tls_subject and _has_keys(args):
        parser.error(
            "--admin-tls-subject is for client certificates without API keys; "
            "with keys, give admins an admin key"
        )
    if args.http_port is None and (args.http_host or args.chat_template):
        parser.error("--http-host and --chat-template need --http-port")
    if (
        args.http_port
        and args.http_port == args.port
        and (args.http_host or args.host) == args.host
    ):
        parser.error("--http-port must differ from --port")
    if args.model is None:
        # Re-parse with the tiny model's settings as defaults, so flags the
        # user gave still win over them.
        serve = parser._subparsers._group_actions[0].choices["serve"]  # noqa: SLF001
        serve.set_defaults(**TINY_ENGINE_KWARGS)
        args = parser.parse_args(argv)
        apply_cpu_env_defaults()
        logger.warning(
            "no --model given: serving the built-in tiny demo model (random weights, its "
            "text is noise); pass --model to serve a real one"
        )
        args.model = str(ensure_tiny_model())
        if args.tokenizer is None:
            args.tokenizer = args.model
    if args.enable_chunked_prefill is None and _on_cpu():
        # Whole prompts only, unless asked: a split prompt's seeded draw kills a
        # CPU engine (vllm_releases.seeded_sampling_hazard). vLLM then raises
        # the step's token budget to at least the context length.
        args.enable_chunked_prefill = False
    return args


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def build_interceptors(args: argparse.Namespace, verifier: Any = None) -> tuple[list[Any], Any]:
    """The launcher's interceptor stack, outermost first, and its metrics interceptor.

    `verifier` is the key verifier to use (default: the one the flags describe).
    Without keys but with client certificates required, the certificate names
    the caller, and only the `--admin-tls-subject` ones have the admin role.
    Metrics are on with a metrics port or the HTTP API (whose `/metrics` shows them).
    Tracing outermost (its span covers everything), then metrics (rejected calls
    are counted too), then authentication, then the in-flight limit (only
    authenticated calls take a slot), when there is one; `mount` counts the
    calls in flight either way. The stack is given to `mount`, which runs it
    from one wrapper per call.
    """
    from vllm.config.model import get_served_model_name

    from ..interceptors import InflightInterceptor, MetricsInterceptor

    # vLLM's own rule, so spans and our series name the model as its `vllm:*` series do.
    served = str(get_served_model_name(args.model, args.served_model_name))
    stack: list[Any] = []
    tracer_provider = _tracing_from_env()
    if tracer_provider is not None:
        from ..interceptors.tracing import TracingInterceptor

        stack.append(TracingInterceptor(tracer_provider=tracer_provider, model=served))
    metrics = None
    if args.metrics_port is not None or args.http_port is not None:
        metrics = MetricsInterceptor(model_name=served)
        stack.append(metrics)
    if verifier is None:
        verifier = _key_verifier(args)
    if verifier is None and args.tls_client_ca:
        verifier = _certificate_verifier(args)
    if verifier is not None:
        from ..interceptors.auth import AuthInterceptor, role_permissions

        stack.append(AuthInterceptor(verifier, permissions=role_permissions))
    if args.max_inflight:
        stack.append(InflightInterceptor(args.max_inflight))
    return stack, metrics


def _key_verifier(args: argparse.Namespace) -> Any:
    """Admin keys, then inference keys (flags, else the environment); None: no keys."""
    from ..interceptors.auth import ADMIN_ROLE, AnyOf, ApiKeyVerifier

    def keys(flag: list[str], file: str | None, env: str, roles: tuple[str, ...]) -> Any:
        if file:
            return ApiKeyVerifier.from_file(file, roles=roles)
        if flag:
            return ApiKeyVerifier(flag, roles=roles)
        if os.environ.get(env, "").strip():
            return ApiKeyVerifier.from_env(env, roles=roles)
        return None

    found = [
        keys(args.admin_api_key, args.admin_api_key_file, ADMIN_KEY_ENV, (ADMIN_ROLE,)),
        keys(args.api_key, args.api_key_file, API_KEY_ENV, ()),
    ]
    verifiers = [v for v in found if v is not None]
    if not verifiers:
        return None
    return verifiers[0] if len(verifiers) == 1 else AnyOf(*verifiers)


def _certificate_verifier(args: argparse.Namespace) -> Any:
    """Client certificates as identities: the admin subjects first, then any certificate.

    The handshake already verified the certificate against --tls-client-ca;
    without an admin subject no certificate has the admin role.
    """
    from ..interceptors.auth import ADMIN_ROLE, AnyOf, MtlsVerifier

    if not args.admin_tls_subject:
        return MtlsVerifier()
    admins = MtlsVerifier(allowed_subjects=args.admin_tls_subject, roles=(ADMIN_ROLE,))
    return AnyOf(admins, MtlsVerifier())


def _http_verifier(args: argparse.Namespace, key_verifier: Any) -> Any:
    """The HTTP API's verifier: the keys, else, with client certificates, no admin role.

    The HTTP side cannot see which certificate a client presented (uvicorn
    verified it in the handshake), so without keys every client there is an
    inference caller and vLLM's admin paths are refused to all.
    """
    if key_verifier is not None or not args.tls_client_ca:
        return key_verifier
    from ..interceptors.auth import CallableVerifier, Identity

    holder = Identity(name="client-certificate", kind="mtls")
    return CallableVerifier(lambda metadata, auth_context: holder, reads_auth_context=False)


def _has_keys(args: argparse.Namespace) -> bool:
    """Whether any key is given, from the flags or the environment."""
    return bool(
        args.api_key
        or args.api_key_file
        or args.admin_api_key
        or args.admin_api_key_file
        or os.environ.get(API_KEY_ENV, "").strip()
        or os.environ.get(ADMIN_KEY_ENV, "").strip()
    )


def authenticates(args: argparse.Namespace) -> bool:
    """Whether calls need credentials: a key from any source, or client certificates."""
    return _has_keys(args) or bool(args.tls_client_ca)


async def _warm_up(engine: Any) -> None:
    """One short greedy generation, logged with its time; the port is not open yet."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.monotonic()
    prompt_len = max(1, min(16, engine.model_config.max_model_len - 8))
    prompt = TokensPrompt(prompt_token_ids=[1] * prompt_len)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    async for _ in engine.generate(prompt, params, request_id=f"warm-up-{os.getpid()}"):
        pass
    logger.info("warm-up generation done in %.2f s", time.monotonic() - started)


def _tracing_from_env() -> Any:
    """A TracerProvider when OTEL_* variables ask for export; None costs nothing."""
    try:
        from ..interceptors.tracing import configure_tracing_from_env
    except ImportError:
        return None
    return configure_tracing_from_env()


def settle_process_for_serving() -> None:
    """Per-token savings that only the process's owner may opt into.

    vLLM reads its environment variables through a module `__getattr__` that
    re-parses `os.environ` on every access (several per engine step in the
    output path); its engine processes cache them once started, and this does
    the same for the serving process. The start-up heap is frozen out of the
    garbage collector's reach, as vLLM's HTTP server does, so the oldest
    generation's collections do not walk the model's static objects. `mount()`
    does neither: a host's process is the host's to configure.
    """
    from vllm.envs import enable_envs_cache
    from vllm.utils.gc_utils import freeze_gc_heap

    enable_envs_cache()
    freeze_gc_heap()


async def serve(args: argparse.Namespace) -> int:
    """Run the server until a signal, drain it; return the process exit code."""
    import grpc
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from ..drain import GracefulShutdown, HardStop
    from ..interceptors import start_metrics_server
    from ..mounting import mount
    from ..multimodal.media import MediaRefOptions
    from ..options import port_in_use, server_options
    from ..tls import server_credentials, warn_if_exposed
    from .engine_processes import apart_from_stop_signals, exit_now
    from .http_api import HttpApi
    from .probe_port import start_probe_port

    # One verifier for both protocols: a key file re-read for one is re-read for both.
    verifier = _key_verifier(args)
    interceptors, metrics = build_interceptors(args, verifier)
    credentials = (
        server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca)
        if args.tls_cert
        else None
    )
    http_host = args.http_host or args.host
    warn_if_exposed(args.host, tls=credentials is not None, auth=authenticates(args))
    if args.http_port is not None and http_host != args.host:
        warn_if_exposed(http_host, tls=credentials is not None, auth=authenticates(args))
    for host, port, flag in (
        (args.host, args.port, "--port"),
        (http_host, args.http_port, "--http-port"),
    ):
        if port is not None and port_in_use(host, port):
            logger.error(
                "%s:%d is already in use (another server?); choose another %s", host, port, flag
            )
            return 1

    started = time.monotonic()
    logger.info("starting the vLLM engine for %s (loading the model)...", args.model)
    # Its processes must leave stop signals to us: we drain, then stop them.
    with apart_from_stop_signals():
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs.from_cli_args(args))
    logger.info("engine ready in %.1f s", time.monotonic() - started)
    if args.warm_up:
        await _warm_up(engine)
    settle_process_for_serving()
    metrics_http = None
    http = None
    probes = None
    try:
        server = grpc.aio.server(
            maximum_concurrent_rpcs=args.max_concurrent_rpcs or None,
            options=server_options(
                args.max_message_bytes,
                max_connection_age=args.max_connection_age,
                request_compression=args.allow_request_compression,
            ),
        )
        mounted = mount(
            server,
            engine,
            interceptors=interceptors,
            reflection_service=not args.no_reflection,
            max_kv_subscribers=args.max_kv_subscribers,
            media_refs=MediaRefOptions() if args.enable_media_refs else None,
            shm_tensors=args.enable_shm_tensors,
        )
        address = f"{args.host}:{args.port}"
        if credentials is not None:
            port = server.add_secure_port(address, credentials)
        else:
            port = server.add_insecure_port(address)
        if port == 0:
            logger.error("could not bind %s", address)
            return 1
        if args.metrics_port is not None:
            metrics_http, _ = start_metrics_server(
                args.metrics_port, addr=args.metrics_host or args.host
            )
            print(
                f"vllm-servicer metrics on http://{args.metrics_host or args.host}:"
                f"{metrics_http.server_port}/metrics",
                flush=True,
            )
        if args.http_port is not None:
            tls = (args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
            http = await HttpApi.build(
                engine,
                args,
                host=http_host,
                port=args.http_port,
                verifier=_http_verifier(args, verifier),
                tls=tls,
            )
        shutdown = GracefulShutdown(
            server,
            mounted,
            grace_period=args.drain_grace,
            timeout=float(args.shutdown_timeout or 0),
            on_drain=[metrics.mark_shutdown] if metrics is not None else [],
            # Whatever hangs (a client, the engine), the process ends in time.
            hard_stop=HardStop(exit_now),
            companions=[http] if http is not None else [],
        )
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, shutdown.request_stop)
        # The port opens only now, with the engine ready: a probe never sees
        # SERVING before a request can succeed.
        if http is not None:
            await http.start()
        if args.health_port is not None and mounted.health is not None:
            probes, probe_port = await start_probe_port(mounted.health, args.host, args.health_port)
            print(f"vllm-servicer health (plaintext) on {args.host}:{probe_port}", flush=True)
        await server.start()
        # Printed (not only logged) so scripts and tests can read the bound ports.
        print(f"vllm-servicer listening on {args.host}:{port}", flush=True)
        if http is not None:
            print(f"vllm-servicer http on {http.scheme}://{http_host}:{http.port}", flush=True)
        watchdog = asyncio.ensure_future(stop_when_engine_dies(engine, shutdown.request_stop))
        await shutdown.wait_for_stop_request()
        # Died first, or stopped by a signal (that may reach the engine's processes too).
        died = watchdog.done() and not watchdog.cancelled() and watchdog.result()
        watchdog.cancel()
        await shutdown.run()
        return 1 if died else 0
    finally:
        if http is not None:
            await http.stop(0)  # a no-op after a drain; ends it on an error
        if probes is not None:
            await probes.stop(0)  # last: liveness answered through the drain
        logger.info("shutting down the engine")
        engine.shutdown()
        if metrics_http is not None:
            metrics_http.shutdown()
        logger.info("stopped")


async def stop_when_engine_dies(engine: Any, stop: Any, interval: float = 0.5) -> bool:
    """Call `stop` once the engine has died, as vLLM's HTTP server ends itself
    then; True when it did.

    A dead EngineCore never comes back: a server left running answers every
    call UNAVAILABLE, and only a liveness probe would restart it, not systemd
    or a container's restart policy. `VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1`
    (vLLM's own switch) keeps serving, health NOT_SERVING.
    """
    import vllm.envs

    if vllm.envs.VLLM_KEEP_ALIVE_ON_ENGINE_DEATH:
        return False
    while not engine.errored:  # noqa: ASYNC110 - vLLM offers no event; one attribute read
        await asyncio.sleep(interval)
    logger.error(
        "the vLLM engine died: draining and stopping with exit code 1 "
        "(VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1 keeps serving, health NOT_SERVING)"
    )
    stop()
    return True


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Console entry point of `vllm-servicer`."""
    args = parse_args(argv)
    _configure_logging(str(getattr(args, "log_level", None) or "info").upper())
    try:
        import uvloop  # optional: a faster event loop when installed
    except ImportError:
        code = asyncio.run(serve(args))
    else:
        code = uvloop.run(serve(args))
    _end_process(code)


def _configure_logging(level: str) -> None:
    """Lines in vLLM's format (process, level, time, source file), so that one log
    reads as one: vLLM's own lines go through its handler, the rest through the root."""
    logging.basicConfig(
        level=level,
        format="(%(processName)s pid=%(process)d) %(levelname)s %(asctime)s "
        "[%(filename)s:%(lineno)d] %(message)s",
        datefmt="%m-%d %H:%M:%S",
    )


def _end_process(code: int) -> NoReturn:
    """Exit once serving is over, without the interpreter's own teardown.

    The atexit handlers run (exporters flush their spans, multiprocessing reaps
    its children); the teardown after them does not: there a compiled module
    vLLM imports (triton's, built with nanobind) prints hundreds of lines of
    "leaked" objects, which read like a failed stop after a clean one.
    """
    atexit._run_exitfuncs()  # noqa: SLF001 - the handlers sys.exit would run
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
