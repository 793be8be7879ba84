"""The HTTP API's way onto the engine: its in-flight slot and its request id.

vLLM's own HTTP API (`serve --http-port`) runs requests on the engine the
gRPC protocols serve, but passes none of their interceptors: `EngineGuard`
keeps for it the two promises a gRPC call's way in keeps. `--max-inflight`
bounds every protocol's requests together: a gRPC call is counted by the
in-flight interceptor before its message is read, an HTTP request here,
against the same count and the caller's fair share of it. And an id running
for one caller must not start for another (either could abort the other's
request): the guard claims it as every protocol does, by the one claim path
(`RunningRequests.claim` and its `Claim`; the gRPC protocols take it in
`servicer/engine_call.CallFrame`, Pooling's handlers in
`servicer/vllm_app.ClaimingEngine`), in the mount's one registry.

The mount builds it (`MountedServices.guard`), over the registry and count it
owns; the launcher hands it to the HTTP API (`serve/http_guard.py`).

No grpc and no vLLM here: each protocol turns the guard's refusals into its
own answers (gRPC ALREADY_EXISTS and RESOURCE_EXHAUSTED, HTTP 409 and 503).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

from .context import Identity, current_identity
from .servicer.tenancy import Claim
from .servicer.tenant_engine import TenantEngine

__all__ = ["EngineGuard", "InflightCount", "ServerBusyError"]


class ServerBusyError(RuntimeError):
    """`--max-inflight` requests run already, or the caller holds its fair share
    of them while others want some; the message names the limit or the share."""


class InflightCount(Protocol):
    """The count of engine requests in flight, its limit and each tenant's
    share of it (`InflightInterceptor`)."""

    def refusal(self, caller: Identity | None = None, n: int = 1) -> str | None:
        """None when `n` more of `caller`'s fit now; else the refusal's text."""
        ...

    def enter(self, caller: Identity | None = None) -> str | None:
        """Count one more for `caller`; the refusal's text instead, counting nothing."""
        ...

    def leave(self, caller: Identity | None = None) -> None:
        """One counted by `enter(caller)` ended."""
        ...


class EngineGuard:
    """Claims each engine request's id for its caller and counts it in flight.

    Callers are told apart by `context.current_identity`, which each protocol
    sets for the request it serves (the gRPC interceptors, the HTTP API's key
    check).

    Args:
        tenant: the mount's engine with tenancy's promises (`TenantEngine`),
            over its registry of running request ids (shared by the frontend
            processes of `--api-server-count` through its group).
        inflight: the in-flight count and `--max-inflight` (shared the same way).
    """

    def __init__(self, tenant: TenantEngine, inflight: InflightCount) -> None:
        self.tenant = tenant
        self.running = tenant.running
        self.inflight = inflight

    def check(self, request_id: str, method: str) -> None:
        """Refuse now what `hold` would refuse, holding nothing.

        For a protocol that answers before the request starts (the HTTP API
        sends a stream's status line first); `hold` checks again, atomically.

        Raises:
            RequestIdInUseError: the id runs for another caller.
            ServerBusyError: the in-flight limit or the caller's share is reached.
        """
        self.check_room()
        self.running.check(request_id, method)

    def check_room(self, n: int = 1) -> None:
        """Raises ServerBusyError when `n` more of the caller's requests would pass
        the limit or its share."""
        refusal = self.inflight.refusal(current_identity.get(), n)
        if refusal is not None:
            raise ServerBusyError(refusal)

    @contextlib.contextmanager
    def hold(self, request_id: str, method: str) -> Iterator[Claim]:
        """The request's in-flight slot and id, held while the block runs.

        Released on every way out of the block: its end, an error, a
        cancellation (a client gone, an abort).

        Args:
            request_id: the engine request id.
            method: what runs it, for the log ("HTTP generate").

        Yields:
            The id's claim (`Claim.cancelled` takes a cancelled request out of the engine).

        Raises:
            ServerBusyError: the in-flight limit or the caller's share is reached.
            RequestIdInUseError: the id runs for another caller.
        """
        caller = current_identity.get()
        refusal = self.inflight.enter(caller)
        if refusal is not None:
            raise ServerBusyError(refusal)
        try:
            claim = self.tenant.claim(request_id, method)
        except BaseException:
            self.inflight.leave(caller)
            raise
        try:
            yield claim
        finally:
            claim.release()
            self.inflight.leave(caller)
