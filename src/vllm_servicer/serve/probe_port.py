"""A plaintext port that answers `grpc.health.v1` alone, beside a TLS server.

Kubernetes' built-in gRPC probes dial without TLS, so a server that requires
TLS (or a client certificate) fails every probe. This second listener serves
the same health servicer as the main port (the same readiness and liveness)
and nothing else: no engine call, no reflection, no other service reaches it.

Its calls need no key, so `Watch` streams from anyone who reaches the port
could hold every slot; they get a share of their own (`KeylessLimits`), and
`Check`, what Kubernetes' probes send, keeps the rest: a full `Watch` share
does not fail a liveness probe.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2_grpc  # type: ignore[import-untyped]

from ..health import EngineHealthServicer
from ..interceptors.keyless import KeylessLimitInterceptor, KeylessLimits
from ..options import server_options, shared_port

_MAX_MESSAGE_BYTES = 64 * 1024
# Probes send one Check per connection: most of the 64 calls are theirs.
PROBE_PORT_LIMITS = KeylessLimits(
    max_keyless_streams=16, max_keyless_checks=48, max_keyless_per_connection=4
)


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
        options=shared_port(options) if shared else options,
        # Every call here is keyless: grpc's cap is the caps' sum, a ceiling
        # only a refusal in progress reaches.
        maximum_concurrent_rpcs=PROBE_PORT_LIMITS.slots,
        interceptors=[KeylessLimitInterceptor(PROBE_PORT_LIMITS)],
    )
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind the probe port {host}:{port}")
    await server.start()
    return server, bound
