"""Servers for the tests: an engine served on loopback, where interceptors go, keys, ports.

`serving` is the package's own (`vllm_servicer.testing.serving`): tests use it
as users' tests would. A test file that covers both placements of its
interceptors takes the `placement` fixture (conftest.py offers it) and builds
its server with `placed()`.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Sequence
from typing import Any

import grpc
import pytest

from vllm_servicer.testing.serving import Serving, serving

__all__ = [
    "KV_TOPIC",
    "PLACEMENTS",
    "Serving",
    "bearer",
    "free_port",
    "loopback_kv_events",
    "placed",
    "placement",
    "serving",
]

PLACEMENTS = ("server_wide", "mounted")
"""Where interceptors go: `grpc.aio.server(interceptors=...)`, or `mount(..., interceptors=...)`."""


@pytest.fixture(scope="module", params=PLACEMENTS)
def placement(request: pytest.FixtureRequest) -> str:
    """Each placement in turn, for a module's fixtures that build a server per placement."""
    return str(request.param)


def placed(
    placement: str,
    interceptors: Sequence[grpc.aio.ServerInterceptor],
    *,
    options: Sequence[tuple[str, Any]] | None = None,
) -> dict[str, Any]:
    """`serving()` arguments that put `interceptors` at `placement`, on a server with `options`.

    Server-wide, they see every call to the server; mounted, only the
    mounted services' calls.
    """
    if placement == "server_wide":
        return {"server": grpc.aio.server(interceptors=list(interceptors), options=options)}
    if placement == "mounted":
        return {"server": grpc.aio.server(options=options), "interceptors": list(interceptors)}
    raise ValueError(f"no placement {placement!r}: one of {PLACEMENTS}")


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    """Call metadata that presents `key` as a bearer token."""
    return (("authorization", f"Bearer {key}"),)


ENGINE_STOP_SECONDS = 1.0
"""How long a test's engine processes get to exit at its end before vLLM kills
them (`AsyncLLM.shutdown`'s timeout). Idle by then, they spend the 5 s vLLM
allows by default in their interpreters' teardown and are killed at its end
all the same."""


def free_port() -> int:
    """A loopback port nothing listens on (free when asked: bind it soon)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


KV_TOPIC = "kv-events"
"""The topic the tests' KV-event publishers send under."""


def loopback_kv_events(port: int) -> str:
    """`--kv-events-config` for a publisher that listens on loopback alone at
    `port` (rank N's at `port` + N), the private form docs/routers.md advises."""
    endpoint = f"tcp://[::ffff:127.0.0.1]:{port}"
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": endpoint,
            "topic": KV_TOPIC,
        }
    )
