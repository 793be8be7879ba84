"""The one place every engine request passes, whichever protocol started it.

VllmEngine, vllm.Inference and vLLM's own HTTP API (`serve --http-port`) all
run requests on one engine, which knows a request by its id alone: an id
running for one caller must not start for another (either could abort the
other's request), and `--max-inflight` bounds the requests of every protocol
together. `EngineGuard` keeps both promises at one point: it claims a
request's id for its caller in the mount's one `RunningRequests`, counts it
against the limit and the caller's fair share of it, and releases both
however the request ends.

No grpc and no vLLM here: each protocol turns the guard's refusals into its
own answers (gRPC ALREADY_EXISTS and RESOURCE_EXHAUSTED, HTTP 409 and 503).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

from .context import Identity, current_identity
from .servicer.tenancy import RunningRequests

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
        running: the mount's registry of running request ids (shared by the
            frontend processes of `--api-server-count` through its group).
        inflight: the in-flight count and `--max-inflight` (shared the same way).
    """

    def __init__(self, running: RunningRequests, inflight: InflightCount) -> None:
        self.running = running
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
    def hold(self, request_id: str, method: str, *, counted: bool = False) -> Iterator[None]:
        """The request's id and in-flight slot, held while the block runs.

        Released on every way out of the block: its end, an error, a
        cancellation (a client gone, an abort).

        Args:
            request_id: the engine request id.
            method: what runs it, for the log ("Generate", "HTTP generate").
            counted: its slot was taken already (a gRPC call is counted by the
                in-flight interceptor before its message is read).

        Raises:
            ServerBusyError: the in-flight limit or the caller's share is reached.
            RequestIdInUseError: the id runs for another caller.
        """
        caller = current_identity.get()
        if not counted:
            refusal = self.inflight.enter(caller)
            if refusal is not None:
                raise ServerBusyError(refusal)
        try:
            self.running.claim(request_id, method)
        except BaseException:
            if not counted:
                self.inflight.leave(caller)
            raise
        try:
            yield
        finally:
            self.running.release(request_id)
            if not counted:
                self.inflight.leave(caller)
