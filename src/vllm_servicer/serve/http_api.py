"""vLLM's own OpenAI-compatible HTTP API, served beside the gRPC protocol.

The launcher's `--http-port` builds vLLM's FastAPI app with vLLM's own
builders (`build_app`, `init_app_state`) on the launcher's `AsyncLLM`, and
serves it with uvicorn on the running event loop: one engine, one process, both
protocols. Nothing of the OpenAI API is re-implemented here; this module only
binds the app, behind its front, and drains it.

Keys, call slots, bodies and request ids: every request passes the front
(`http_front.py`) before vLLM's app. What each request asks of the engine is
checked by the engine client the app is handed (`http_guard.py`): KV transfer
parameters a router's, runtime adapter loads an administrator's.

Connections: a request's headers must come within `--http-header-timeout`,
and a process holds at most `--max-http-connections` (`http_timeouts.py`).

Media: vLLM's chat API fetches http(s) image, audio and video URLs only from
the domains of `--allowed-media-domains`, and follows no redirect
(`http_media.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import math
import socket
import ssl
from collections.abc import Iterator
from typing import TYPE_CHECKING, TypedDict, cast

import uvicorn

from ..guard import EngineGuard
from ..interceptors.call_slots import CallSlotsInterceptor
from ..servicer.vllm_app import with_engine_parsers
from .args import ServeArgs
from .http_asgi import App
from .http_front import Front
from .http_guard import GuardedEngine
from .http_media import gate_media_fetching
from .http_timeouts import guarded_protocol

if TYPE_CHECKING:
    from fastapi import FastAPI
    from vllm.engine.protocol import EngineClient as VllmEngineClient
    from vllm.v1.engine.async_llm import AsyncLLM

    from ..interceptors.verifiers import Verifier

__all__ = ["HttpApi", "frontend_args", "uvicorn_config"]

logger = logging.getLogger(__name__)


class _Protocol(TypedDict, total=False):
    """uvicorn's `http` protocol class, when it is not its own."""

    http: type[asyncio.Protocol]


class _Tls(TypedDict, total=False):
    """uvicorn's TLS settings."""

    ssl_certfile: str
    ssl_keyfile: str
    ssl_ca_certs: str
    ssl_cert_reqs: int


def frontend_args(args: ServeArgs, host: str, port: int) -> argparse.Namespace:
    """vLLM's serve arguments: its frontend defaults, the launcher's engine settings.

    The HTTP side takes vLLM's defaults for every frontend option (CORS...) but
    the chat group's (`--chat-template`, the tool-call parser: `ChatOptions`) and
    `--enable-scale-out` (vLLM's render, derender and token-id routes); every
    engine flag, model names and the reasoning parser included, comes from the
    launcher. vLLM's own key middleware
    and TLS options stay off: this module and its front (`http_front.py`) do both.

    Args:
        args: the launcher's arguments.
        host: the address the HTTP API binds.
        port: the port it binds.
    """
    from ..vllm_releases import serve_defaults

    served = serve_defaults()
    vars(served).update(args.engine)
    vars(served).update(dataclasses.asdict(args.options.chat))
    served.enable_scale_out = args.http.enable_scale_out
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


async def _build_app(engine: AsyncLLM | GuardedEngine, served: argparse.Namespace) -> FastAPI:
    with _root_logging_kept():
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.app import build_app

        tasks = await engine.get_supported_tasks()
        with_engine_parsers(served, engine)
        app = build_app(served, tasks, engine.model_config)
        # The guarded engine passes for vLLM's client: what it does not
        # define itself is the engine's own (`GuardedEngine.__getattr__`).
        await init_app_state(cast("VllmEngineClient", engine), app.state, served, tasks)
    return app


def uvicorn_config(
    app: App,
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
    protocol: _Protocol = {}
    if header_timeout is not None:
        protocol = {"http": guarded_protocol(header_timeout, max_connections)}
    ssl_options: _Tls = {}
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

    def __init__(self, server: _Server, front: Front) -> None:
        self._server = server
        self._front = front
        self._task: asyncio.Task[None] | None = None
        self._hurried = False
        self.port = 0

    @classmethod
    async def build(
        cls,
        engine: AsyncLLM,
        args: ServeArgs,
        *,
        host: str,
        port: int,
        verifier: Verifier | None = None,
        tls: tuple[str, str, str | None] | None = None,
        guard: EngineGuard | None = None,
        slots: CallSlotsInterceptor | None = None,
    ) -> HttpApi:
        """Build vLLM's app on `engine` and a uvicorn server for it (nothing bound yet).

        Args:
            engine: the launcher's `AsyncLLM`.
            args: the launcher's arguments (engine flags, model names, its chat group).
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
        front = Front(app, verifier, slots, args.server.max_message_bytes, args.options.budgets)
        config = uvicorn_config(
            front,
            host,
            port,
            tls,
            header_timeout=args.http.http_header_timeout,
            max_connections=args.http.max_http_connections or None,
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
