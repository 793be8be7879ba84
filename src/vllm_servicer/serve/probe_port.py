"""A plaintext port that answers `grpc.health.v1` alone, beside a TLS server.

Kubernetes' built-in gRPC probes dial without TLS, so a server that requires
TLS (or a client certificate) fails every probe. This second listener serves
the same health servicer as the main port (the same readiness and liveness)
and nothing else: no engine call, no reflection, no other service reaches it.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2_grpc  # type: ignore[import-untyped]

from ..health import EngineHealthServicer
from ..options import server_options, shared_port

_MAX_MESSAGE_BYTES = 64 * 1024
_MAX_CALLS = 64


async def start_probe_port(
    health: EngineHealthServicer, host: str, port: int, *, shared: bool = False
) -> tuple[grpc.aio.Server, int]:
    """Serve `health` in plaintext on host:port (0: any free port); `shared`:
    other frontend processes bind it too.

    Returns:
        The started server (stop it after the main one) and the bound port.

    Raises:
        OSError: the address could not be bound.
    """
    # Probes send a service name: small messages and few calls at once are plenty.
    options = server_options(_MAX_MESSAGE_BYTES)
    server = grpc.aio.server(
        options=shared_port(options) if shared else options, maximum_concurrent_rpcs=_MAX_CALLS
    )
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind the probe port {host}:{port}")
    await server.start()
    return server, bound
