"""`serving()`: an engine mounted on a grpc.aio server of its own on loopback, for a test.

Typical use in a test suite (pytest-asyncio, or any running event loop)::

    from vllm_servicer.proto import vllm_engine_pb2 as pb
    from vllm_servicer.proto import vllm_engine_pb2_grpc
    from vllm_servicer.testing.serving import serving

    async def test_the_engine_is_healthy(engine) -> None:
        async with serving(engine) as served:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(served.channel)
            assert (await stub.HealthCheck(pb.HealthCheckRequest())).healthy

`engine` is vLLM's ``AsyncLLM`` (see :mod:`vllm_servicer.testing.tiny_model` for one
that starts on a CPU in seconds) or a stand-in (:mod:`vllm_servicer.testing.stand_in`).
The server listens on ``127.0.0.1`` on a port the system picks, so tests may run
side by side; leaving the block closes the channel and stops the server, and
leaves the engine running.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from ..engine import EngineClient
from ..frontends import FrontendGroup
from ..mounting import MountedServices, mount
from ..options import MountOptions

__all__ = ["Serving", "serving"]


@dataclasses.dataclass
class Serving:
    """A started server with the engine mounted, as `serving()` yields it.

    Attributes:
        server: the grpc.aio server, started.
        mounted: what `mount()` added to it (the servicer, health, the count in flight).
        port: the loopback port it listens on.
        tls: whether that port takes TLS (`serving(..., credentials=...)`).
    """

    server: grpc.aio.Server
    mounted: MountedServices
    port: int
    tls: bool = False
    _channel: grpc.aio.Channel | None = dataclasses.field(default=None, repr=False)

    @property
    def address(self) -> str:
        """``127.0.0.1:<port>``, for a client of the test's own making."""
        return f"127.0.0.1:{self.port}"

    @property
    def channel(self) -> grpc.aio.Channel:
        """A `grpc.aio` insecure channel to the server, opened on first use.

        Closed when the `serving()` block ends. A TLS port takes no insecure
        channel: open a secure one to `port` instead.
        """
        if self.tls:
            raise RuntimeError("the server takes TLS: open a secure channel to its port")
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(self.address)
        return self._channel


@contextlib.asynccontextmanager
async def serving(
    engine: EngineClient,
    options: MountOptions | None = None,
    *,
    server: grpc.aio.Server | None = None,
    credentials: grpc.ServerCredentials | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    frontends: FrontendGroup | None = None,
    **option_fields: Any,
) -> AsyncIterator[Serving]:
    """Mount `engine` on a server, start it on loopback, yield it; stop it on exit.

    Args:
        engine: the engine to serve (vLLM's ``AsyncLLM`` or any `EngineClient`).
        server: a grpc.aio server of the caller's, not yet started, with its
            own interceptors, options and services; default a plain
            ``grpc.aio.server()``.
        credentials: serve TLS with these (``grpc.ssl_server_credentials`` or
            `vllm_servicer.tls.server_credentials`); default plaintext.
        options: what `mount()` serves and how (`MountOptions`).
        interceptors: passed to `mount()`.
        frontends: passed to `mount()`.
        option_fields: a shorthand for ``options``: `MountOptions`' fields by
            name (``health=False``, ``media_refs=...``).

    Yields:
        The running server: its port, a channel to it and what `mount()` added.
        On exit the channel is closed, the health service stopped (its engine
        check and any Watch stream) and the server stopped at once; the
        engine is left running.
    """
    server = server if server is not None else grpc.aio.server()
    if option_fields:
        if options is not None:
            raise TypeError("serving() takes options or MountOptions' fields, not both")
        options = MountOptions.of(**option_fields)
    mounted = mount(server, engine, options, interceptors=interceptors, frontends=frontends)
    address = "127.0.0.1:0"
    if credentials is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, credentials)
    await server.start()
    served = Serving(server, mounted, port, tls=credentials is not None)
    try:
        yield served
    finally:
        if served._channel is not None:
            await served._channel.close()
        if mounted.health is not None:
            await mounted.health.close()  # its engine poller, and Watch streams left open
        await server.stop(None)
