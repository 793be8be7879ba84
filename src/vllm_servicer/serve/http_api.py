"""vLLM's own OpenAI-compatible HTTP API, served beside the gRPC protocol.

The launcher's `--http-port` builds vLLM's FastAPI app with vLLM's own
builders (`build_app`, `init_app_state`) on the launcher's `AsyncLLM`, and
serves it with uvicorn on the running event loop: one engine, one process, both
protocols. Nothing of the OpenAI API is re-implemented here; this module only
binds the app, checks keys and drains it.

Keys: the gRPC side's verifier (the very same object, so key files re-read on
change apply to both) checks `Authorization: Bearer <key>` on every path but
the probes (`/health`, `/ping`). Any valid key reaches the inference paths
(`/v1/...`, `/tokenize`, ...) and `/metrics`; every other path (vLLM's
`/pause`, `/abort_requests`, `/start_profile`, ...) and the runtime LoRA routes
(`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`) need an admin key, as the
gRPC admin methods do. With vLLM's Responses store on
(`VLLM_ENABLE_RESPONSES_API_STORE=1`), the Responses API (`/v1/responses...`)
needs an admin key too: the store keeps each response under its id (which
the client may choose) for whoever asks, to read, cancel or continue. vLLM's
own `--api-key` middleware is not used: it takes a fixed key list and guards
`/v1` alone. What each request asks of the engine is checked by the engine
client the app is handed (`http_guard.py`): KV transfer parameters a router's,
runtime adapter loads an administrator's.

Call slots: every request but the probes and the GETs of fixed facts holds
one of the gRPC side's call slots (`--max-concurrent-rpcs`, each tenant its
fair share, the same pool) from its key check until its handler ends, so
parsing, templating and tokenizing count as a gRPC call's do; refused 503 with
`Retry-After`. Bodies are bounded by `--max-message-bytes` (413) and must
arrive within `--request-read-timeout` (408), as a gRPC call's message must;
`/tokenize` and `/detokenize` meet Render's budgets (`http_budgets.py`).

Connections: a request's headers must come within `--http-header-timeout`,
and a process holds at most `--max-http-connections` (`http_timeouts.py`).

Request ids: the `X-Request-Id` header and a JSON body's `request_id` are
checked as gRPC's are (`http_request_ids.py`) before vLLM's handlers copy them.

Media: vLLM's chat API fetches http(s) image, audio and video URLs only from
the domains of `--allowed-media-domains`, and follows no redirect
(`gate_media_fetching`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import socket
import ssl
from collections.abc import Iterator
from typing import Any

import uvicorn

from ..budgets import RequestBudgets
from ..context import Identity, current_identity
from ..guard import EngineGuard
from ..interceptors._call import ClientWait, WaitWatch, client_wait
from ..interceptors.auth import AuthError, Unauthenticated
from ..interceptors.call_slots import CallSlotsInterceptor, CallSlotsRefused
from ..prefix_cache import keyed_tenant
from ..servicer.vllm_app import with_engine_parsers
from . import http_request_ids as request_ids
from .args import ServeArgs
from .http_guard import HTTP_CALLER, GuardedEngine
from .http_timeouts import guarded_protocol

__all__ = ["HTTP_APP_FLAGS", "HttpApi", "frontend_args", "uvicorn_config"]

logger = logging.getLogger(__name__)

# Probes carry no keys (the gRPC health service is exempt too).
_PUBLIC_PATHS = frozenset({"/health", "/ping"})
# vLLM's Prometheus page (and what is mounted under it): with keys, any key's;
# without keys, everyone's as before. It needs a key because the page is built on the serving
# event loop, one registry walk per scrape, and tells the load and the served
# adapters to whoever asks; any role will do because it names no tenant's
# prompts or ids, and a keyed caller is told the load anyway (GetLoads, the ORCA
# reports), so a scraper needs no admin powers. Scrapers without a key have the
# gRPC side's --metrics-port, the same series on a port of its own.
_METRICS = "/metrics"
# vLLM's own guarded prefixes plus its other per-request endpoints.
_INFERENCE_PREFIXES = ("/v1/", "/v2/", "/inference/", "/cohere/")
_INFERENCE_PATHS = frozenset(
    {
        "/tokenize",
        "/detokenize",
        "/tokenizer_info",
        "/pooling",
        "/classify",
        "/score",
        "/rerank",
        "/invocations",
        "/load",
        "/version",
    }
)

# GETs that answer fixed facts, at no cost: outside the call slots, as the
# probes are. Every other request (tokenizing, rendering, generating, pooling)
# holds one from its key check to its handler's end. The metrics page too is
# outside them: a scrape reads no body and runs to its end in one step of the
# loop, so a slot would bound nothing, and a scraper refused 503 while the
# slots are full would lose sight of the server when it matters most.
_FREE_GETS = frozenset({"/v1/models", "/version"})
_RETRY_AFTER_S = 1  # gRPC's refusal sends a 1 s retry pushback too

# vLLM's runtime LoRA routes (VLLM_ALLOW_RUNTIME_LORA_UPDATING=1) sit under
# /v1/ but change the engine for every tenant, as vllm.Control's LoadLora does:
# admin keys only.
_ADMIN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
# vLLM's Responses store (VLLM_ENABLE_RESPONSES_API_STORE=1) keeps every
# response for whoever names its id (GET, cancel, previous_response_id), with
# no owner: admin keys only while it is on.
_RESPONSES_PREFIX = "/v1/responses"


# The mount options (`MountOptions`, flags of the launcher) that vLLM's app
# reads. The app's host and port are the HTTP API's; the launcher's keys, TLS,
# limits and other ports stay its own.
HTTP_APP_FLAGS = ("chat_template", "tool_call_parser", "enable_auto_tool_choice")


def frontend_args(args: ServeArgs, host: str, port: int) -> argparse.Namespace:
    """vLLM's serve arguments: its frontend defaults, the launcher's engine settings.

    The HTTP side takes vLLM's defaults for every frontend option (CORS...) but
    `HTTP_APP_FLAGS` (`--chat-template`, the tool-call parser) and
    `--enable-scale-out` (vLLM's render, derender and token-id routes); every
    engine flag, model names and the reasoning parser included, comes from the
    launcher. vLLM's own key middleware
    and TLS options stay off: this module does both.

    Args:
        args: the launcher's arguments.
        host: the address the HTTP API binds.
        port: the port it binds.
    """
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from ..vllm_releases import make_arg_parser

    parser_class: Any = FlexibleArgumentParser  # untyped in vLLM
    served: argparse.Namespace = make_arg_parser(parser_class()).parse_args([])
    vars(served).update(args.engine)
    for name in HTTP_APP_FLAGS:
        setattr(served, name, getattr(args.options, name))
    served.enable_scale_out = args.enable_scale_out
    served.host, served.port, served.api_key = host, port, None
    return served


@contextlib.contextmanager
def _root_logging_kept() -> Iterator[None]:
    """Undo what importing vLLM's app does to the root logger.

    A module it imports (model_hosting_container_standards, for SageMaker)
    sets the root logger and its handlers to ERROR at import time, which
    would silence the launcher's own log lines (the drain's among them).
    """
    root = logging.getLogger()
    levels = (root.level, [(handler, handler.level) for handler in root.handlers])
    try:
        yield
    finally:
        root.setLevel(levels[0])
        for handler, level in levels[1]:
            handler.setLevel(level)


async def _build_app(engine: Any, served: argparse.Namespace) -> Any:
    with _root_logging_kept():
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.app import build_app

        tasks = await engine.get_supported_tasks()
        with_engine_parsers(served, engine)
        app = build_app(served, tasks, engine.model_config)
        await init_app_state(engine, app.state, served, tasks)
    return app


def _json(
    status: int,
    body: dict[str, Any],
    *,
    headers: list[tuple[bytes, bytes]] | None = None,
    close: bool = False,
) -> tuple[dict[str, Any], dict[str, Any]]:
    payload = json.dumps(body).encode()
    start = {
        "type": "http.response.start",
        "status": status,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(payload)),
            *(headers or ()),
            # A body left unread: the connection cannot carry another request.
            *([(b"connection", b"close")] if close else ()),
        ],
    }
    return start, {"type": "http.response.body", "body": payload}


class _Front:
    """Pure ASGI wrapper in front of vLLM's app: drain state of /health, keys,
    a call slot, then the body (its size, its read deadline, its ids, and the
    render budgets of `/tokenize` and `/detokenize`).

    Args:
        app: vLLM's app.
        verifier: the key verifier, or None for no keys.
        slots: the gRPC side's call slots (`--max-concurrent-rpcs`), one pool
            for both protocols, and their read deadline (`--request-read-timeout`),
            which a request's body meets too; None: no slots taken, no deadline.
        max_body_bytes: the largest request body (`--max-message-bytes`); None: any.
        budgets: the per-request budgets `/tokenize` and `/detokenize` meet;
            None: not checked here.
    """

    def __init__(
        self,
        app: Any,
        verifier: Any,
        slots: CallSlotsInterceptor | None = None,
        max_body_bytes: int | None = None,
        budgets: RequestBudgets | None = None,
    ) -> None:
        from vllm import envs

        self.app = app
        self.verifier = verifier
        self.slots = slots
        self.max_body_bytes = max_body_bytes
        self.budgets = budgets
        # One watch for every request's answer: one deadline, so one timer.
        self._writes = None if slots is None else WaitWatch(slots.write_deadline(""))
        self.draining = False
        self.responses_stored = bool(envs.VLLM_ENABLE_RESPONSES_API_STORE)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if self.draining and path == "/health":
            # Balancers probing HTTP stop sending, as gRPC probes see NOT_SERVING.
            await self._refuse(scope, send, 503, "draining")
            return
        caller: Identity | None = HTTP_CALLER
        if self.verifier is not None and not _public(path):
            refusal, caller = await self._check(scope, path)
            if refusal is not None:
                await self._refuse(scope, send, *refusal)
                return
        # Whom the call slot and the engine guard count this request for
        # (http_guard.py); without keys, no tenant (gRPC's keyless rule).
        token = current_identity.set(caller if self.verifier is not None else None)
        try:
            slots, held = self.slots, None
            # Every answer is taken within the write deadline, a probe's too: a
            # connection whose client stops reading is not held for ever.
            wait = client_wait() if self._writes is not None else None
            if slots is not None and not _costless(scope, path):
                # Before the body is read: a body sent slowly holds this slot,
                # one of its tenant's share, not one of everyone's, and loses
                # it to another tenant wanting the full pool once it stalls.
                wait = wait or client_wait()
                try:
                    held = slots.hold(wait)
                except CallSlotsRefused as exc:
                    await self._busy(scope, send, str(exc))
                    return
            current_identity.set(caller)
            try:
                if wait is not None and self._writes is not None:
                    send = _taken_in_time(send, self._writes, wait)
                await self._serve(scope, path, receive, send, wait)
            except asyncio.CancelledError:
                # Its client took no part of the answer in time (or its slot went
                # to another tenant meanwhile): nothing more can be sent to it.
                if wait is None or not wait.expired or wait.task is None or wait.task.uncancel():
                    raise
                logger.info("HTTP %s ended: %s", path, wait.reason or "response not taken in time")
            finally:
                if held is not None:
                    held.release()
        finally:
            current_identity.reset(token)

    async def _serve(
        self, scope: Any, path: str, receive: Any, send: Any, wait: ClientWait | None = None
    ) -> None:
        if not _public(path):
            # After the key (nothing is read for a caller refused), before
            # vLLM's handler copies the id into each engine request's. The
            # body is read here, under the slot just taken: within the gRPC
            # calls' read deadline, or 408 and the slot back (a body that
            # stalls would hold it for ever, its connection too).
            deadline = None if self.slots is None else self.slots.read_deadline(path)
            refused, receive = await request_ids.checked(
                scope,
                receive,
                self.max_body_bytes,
                read_deadline=deadline,
                wait=wait,
                budgets=self.budgets,
                media_tenant=keyed_tenant(),
                path=path,
            )
            if refused is not None:
                status, body = refused
                if scope["type"] == "websocket":
                    await self._refuse(scope, send, status, body["error"]["message"])
                else:
                    # A body left unread (413, 408) ends its connection.
                    close = status in request_ids.UNREAD_BODY
                    for event in _json(status, body, close=close):
                        await send(event)
                return
        await self.app(scope, receive, send)

    async def _busy(self, scope: Any, send: Any, message: str) -> None:
        if scope["type"] == "websocket":
            await self._refuse(scope, send, 503, message)
            return
        body = request_ids.error_body(None, message, 503, "ServiceUnavailableError")
        headers = [(b"retry-after", b"%d" % _RETRY_AFTER_S)]
        for event in _json(503, body, headers=headers):
            await send(event)

    async def _check(self, scope: Any, path: str) -> tuple[tuple[int, str] | None, Identity | None]:
        metadata = [
            ("authorization", value.decode("latin-1"))
            for name, value in scope["headers"]
            if name == b"authorization"
        ]
        try:
            identity = await self.verifier(metadata, {})
        except Unauthenticated:
            return (401, "Unauthorized"), None
        except AuthError:
            return (403, "Forbidden"), None
        if identity.is_admin:
            return None, identity
        if not _inference(path):
            return (403, "Forbidden: this path needs an admin key"), None
        if self.responses_stored and path.startswith(_RESPONSES_PREFIX):
            return (
                403,
                "Forbidden: with VLLM_ENABLE_RESPONSES_API_STORE on, the Responses API needs "
                "an admin key (stored responses are anyone's who names their id)",
            ), None
        return None, identity

    @staticmethod
    async def _refuse(scope: Any, send: Any, status: int, message: str) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation
            return
        for event in _json(status, {"error": message}):
            await send(event)


def _taken_in_time(send: Any, watch: WaitWatch, wait: ClientWait) -> Any:
    """`send` with each part of the response body taken by the client within
    `watch`'s deadline (`--response-write-timeout`), its wait marked meanwhile.

    uvicorn's send waits while the connection's buffers are full: a client
    that stops reading (or a slow one, past the deadline) leaves it waiting,
    the request's slots with it. Past the deadline the request's task is
    cancelled, and its handler closed (the engine aborts its requests).
    """

    async def send_in_time(message: dict[str, Any]) -> None:
        if message["type"] != "http.response.body":
            await send(message)
            return
        watch.begin(wait)
        try:
            await send(message)
        finally:
            watch.end(wait)

    return send_in_time


def _costless(scope: Any, path: str) -> bool:
    """A request that takes no call slot: the probes, the GETs of fixed facts
    and the metrics page."""
    if _public(path):
        return True
    if scope["type"] != "http" or scope.get("method") != "GET":
        return False
    return path in _FREE_GETS or _metrics(path)


def _public(path: str) -> bool:
    return path in _PUBLIC_PATHS


def _metrics(path: str) -> bool:
    return path == _METRICS or path.startswith(_METRICS + "/")


def _inference(path: str) -> bool:
    """A path any key reaches (the rest need an admin key)."""
    if path.rstrip("/") in _ADMIN_PATHS:
        return False
    return path.startswith(_INFERENCE_PREFIXES) or path in _INFERENCE_PATHS or _metrics(path)


def uvicorn_config(
    app: Any,
    host: str,
    port: int,
    tls: tuple[str, str, str | None] | None = None,
    *,
    header_timeout: float | None = None,
    max_connections: int | None = None,
) -> uvicorn.Config:
    """uvicorn's settings for the HTTP API: HTTPS with the gRPC side's certificate
    when given, connections bounded as uvicorn does not bound them.

    Args:
        app: the ASGI app.
        host: address to bind.
        port: port to bind.
        tls: (certificate, key, client CA or None); with a CA, clients must
            present a certificate it signed, as on the gRPC side.
        header_timeout: seconds a connection has for a request's headers
            (`--http-header-timeout`, `http_timeouts.py`); None: uvicorn's own
            protocol, without one.
        max_connections: most connections open at once (`--max-http-connections`);
            None: any. Only with `header_timeout`.
    """
    protocol: dict[str, Any] = {}
    if header_timeout is not None:
        protocol = {"http": guarded_protocol(header_timeout, max_connections)}
    ssl_options: dict[str, Any] = {}
    if tls is not None:
        cert, key, client_ca = tls
        ssl_options = {"ssl_certfile": cert, "ssl_keyfile": key}
        if client_ca:
            ssl_options |= {"ssl_ca_certs": client_ca, "ssl_cert_reqs": ssl.CERT_REQUIRED}
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        lifespan="on",
        # Per-request log lines cost the serving process CPU that the gRPC
        # side does not spend either.
        access_log=False,
        # uvicorn's own logging config would replace the process's handlers.
        log_config=None,
        **protocol,
        **ssl_options,
    )


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the launcher owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpApi:
    """vLLM's HTTP API on one address, drained by the launcher's `GracefulShutdown`.

    Build it with `await HttpApi.build(...)`, then `await start()`; pass it to
    `GracefulShutdown(companions=[...])`.
    """

    def __init__(self, server: _Server, front: _Front) -> None:
        self._server = server
        self._front = front
        self._task: asyncio.Task[None] | None = None
        self._hurried = False
        self.port = 0

    @classmethod
    async def build(
        cls,
        engine: Any,
        args: ServeArgs,
        *,
        host: str,
        port: int,
        verifier: Any = None,
        tls: tuple[str, str, str | None] | None = None,
        guard: EngineGuard | None = None,
        slots: CallSlotsInterceptor | None = None,
    ) -> HttpApi:
        """Build vLLM's app on `engine` and a uvicorn server for it (nothing bound yet).

        Args:
            engine: the launcher's `AsyncLLM`.
            args: the launcher's arguments (engine flags, model names, `HTTP_APP_FLAGS`).
            host: address to bind.
            port: port to bind; 0 picks a free one (read `port` after `start()`).
            verifier: the gRPC side's key verifier, or None for no keys.
            tls: (certificate, key, client CA or None): serve HTTPS, requiring
                client certificates when a CA is given.
            guard: the mount's engine guard: every HTTP generation and
                embedding claims its id and an in-flight slot there, as the
                gRPC protocols' requests do.
        """
        gate_media_fetching()
        client = (
            engine
            if guard is None
            else GuardedEngine(
                engine, guard, args.options.budgets, authenticated=verifier is not None
            )
        )
        app = await _build_app(client, frontend_args(args, host, port))
        front = _Front(app, verifier, slots, args.max_message_bytes, args.options.budgets)
        config = uvicorn_config(
            front,
            host,
            port,
            tls,
            header_timeout=args.http_header_timeout,
            max_connections=args.max_http_connections or None,
        )
        return cls(_Server(config), front)

    @property
    def scheme(self) -> str:
        return "https" if self._server.config.is_ssl else "http"

    async def start(self, *, reuse_port: bool = False) -> None:
        """Bind and serve; returns once the app's start-up ran and the port is open.

        Args:
            reuse_port: share the port with the other frontend processes
                (SO_REUSEPORT: the kernel spreads connections among them).

        Raises:
            RuntimeError: the server could not start (the port is taken, say).
        """
        config = self._server.config
        sock = _shared_socket(config) if reuse_port else config.bind_socket()
        self.port = sock.getsockname()[1]
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                sock.close()
                raise RuntimeError("the HTTP API did not start") from _failure(self._task)
            await asyncio.sleep(0.05)

    def start_draining(self) -> None:
        """`/health` answers 503 from now on; requests are still served."""
        self._front.draining = True

    async def stop(self, timeout: float) -> None:
        """Stop accepting, let requests in flight finish for `timeout` s, then cancel them.

        A cancelled request is aborted in the engine by vLLM's own handler.
        """
        if self._task is None or self._task.done():
            return
        self._front.draining = True
        self._server.config.timeout_graceful_shutdown = 0 if self._hurried else math.ceil(timeout)
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        logger.info("HTTP API stopped")

    def hurry(self) -> None:
        """A second stop request: cancel what is still running now."""
        self._hurried = True
        self._server.config.timeout_graceful_shutdown = 0
        self._server.force_exit = True
        for task in list(self._server.server_state.tasks):
            task.cancel()


def _shared_socket(config: uvicorn.Config) -> socket.socket:
    """A listening socket on the config's address that other processes may bind too."""
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((config.host, config.port))
    sock.listen(config.backlog)
    sock.set_inheritable(True)
    return sock


def _failure(task: asyncio.Task[None]) -> BaseException | None:
    if task.cancelled():
        return None
    return task.exception()


# ----- media the HTTP API fetches ---------------------------------------------
# vLLM's chat API fetches every http(s) `image_url` (audio, video) a request
# names when `--allowed-media-domains` is not given, and follows redirects
# (VLLM_MEDIA_URL_ALLOW_REDIRECTS defaults to 1): a client could make the
# server fetch from its own network (127.0.0.1, 169.254.169.254), which the
# gRPC side allows only with --enable-media-refs and a domain list.

MEDIA_FETCHING_OFF = (
    "this server fetches no media over http(s): send the image inline (a data: URL), "
    "or ask the operator to allow its domain with --allowed-media-domains"
)


def gate_media_fetching() -> None:
    """Make vLLM's media connector fetch http(s) URLs only from the domains of
    `--allowed-media-domains`, and follow no redirect.

    vLLM builds its connector by name from a registry (`VLLM_MEDIA_CONNECTOR`,
    "http" by default; the same in 0.31-0.33): the class registered as "http"
    is replaced by a subclass that refuses http(s) URLs while the domain list
    is empty, and fetches without redirects unless `VLLM_MEDIA_URL_ALLOW_REDIRECTS`
    is set in the environment (a redirect could leave the listed domains).
    data: URLs are untouched; file: URLs stay behind vLLM's own
    `--allowed-local-media-path`. Idempotent; the launcher's process only.
    """
    from vllm.multimodal.media import MEDIA_CONNECTOR_REGISTRY

    registered: Any = MEDIA_CONNECTOR_REGISTRY.name2class.get("http")
    if registered is None or getattr(registered, "_servicer_gated", False):
        return
    MEDIA_CONNECTOR_REGISTRY.register("http")(_gated_connector(registered))


def _gated_connector(base: Any) -> type:
    class GatedMediaConnector(base):  # type: ignore[misc]
        """vLLM's connector, fetching http(s) only from listed domains, without redirects."""

        _servicer_gated = True
        connection: Any
        allowed_media_domains: list[str]

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if "VLLM_MEDIA_URL_ALLOW_REDIRECTS" not in os.environ:
                self.connection = _WithoutRedirects(self.connection)

        def load_from_url(self, url: str, *args: Any, **kwargs: Any) -> Any:
            self._refuse_unlisted(url)
            return super().load_from_url(url, *args, **kwargs)

        async def load_from_url_async(self, url: str, *args: Any, **kwargs: Any) -> Any:
            self._refuse_unlisted(url)
            return await super().load_from_url_async(url, *args, **kwargs)

        def _refuse_unlisted(self, url: str) -> None:
            # Every scheme but data: and file: is one vLLM fetches over the
            # network (or refuses): decided on the text's first bytes, so no
            # URL parser can read it differently.
            if not self.allowed_media_domains and url[:5].lower() not in ("data:", "file:"):
                raise ValueError(MEDIA_FETCHING_OFF)

    return GatedMediaConnector


class _WithoutRedirects:
    """vLLM's HTTP connection, with `allow_redirects` always off."""

    def __init__(self, connection: Any) -> None:
        self._connection = connection

    def get_bytes(self, url: str, **kwargs: Any) -> bytes:
        return bytes(self._connection.get_bytes(url, **{**kwargs, "allow_redirects": False}))

    async def async_get_bytes(self, url: str, **kwargs: Any) -> bytes:
        kwargs["allow_redirects"] = False
        return bytes(await self._connection.async_get_bytes(url, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._connection, name)
