"""What every layer knows of the call being served: who calls, its request id,
its record (what the request asks for, what it sent) and its trace.

The interceptors set these and the servicer and the HTTP API read them, so
neither imports the other. grpc.aio runs each call in a task of its own, whose
context holds the call's values. No grpc and no vLLM here.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
from asyncio import current_task
from collections.abc import Callable, Mapping
from typing import Any

from .wire.usage import GenerationUsage

ADMIN_ROLE = "admin"
"""The role of identities that administer the server (any request may be aborted)."""

ROUTER_ROLE = "router"
"""The role of a router's identity: it reads what routing needs and no tenant may
see (KV events carry every tenant's token ids) and sets KV transfer parameters."""


@dataclasses.dataclass(frozen=True)
class Identity:
    """Who is calling, as a verifier established it.

    Attributes:
        name: a stable, non-secret name (a key's label, a certificate subject,
            a JWT subject); permissions and logs use it.
        kind: how it was established: "api_key", "mtls", "custom" or "all_of".
        attributes: extra non-secret facts (certificate SANs, JWT claims).
        parts: for `AllOf`, the identity each verifier returned.
        roles: roles granted to the identity (`ADMIN_ROLE`: may abort any
            request, not only its own; `ROUTER_ROLE`: routing data); permissions
            may use them too.
        weight: its weight in the fair shares of pooled slots (`shares.py`):
            an identity of weight 2 is due twice the share of one of weight 1.
        min_priority: the lowest request `priority` it may ask for, its own
            (a key file's `min_priority=`); None: the server's
            (`--min-tenant-priority`). A router's and an admin's are never bounded.
    """

    name: str
    kind: str = "custom"
    attributes: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    parts: tuple[Identity, ...] = ()
    roles: frozenset[str] = frozenset()
    weight: float = 1.0
    min_priority: int | None = None

    @property
    def is_admin(self) -> bool:
        """Whether the identity administers the server."""
        return ADMIN_ROLE in self.roles

    @property
    def is_router(self) -> bool:
        """Whether the identity may read routing data (a router's or an admin's)."""
        return ROUTER_ROLE in self.roles or ADMIN_ROLE in self.roles


current_identity: contextvars.ContextVar[Identity | None] = contextvars.ContextVar(
    "vllm_servicer_identity", default=None
)
"""The identity of the call being served (None outside an authenticated call)."""


def tenant() -> str | None:
    """The name whose requests and shares the current call counts against.

    None for a call without credentials and for an administrator: neither is
    held to one tenant's share (an administrator may touch every request).
    """
    return tenant_of(current_identity.get())


def tenant_of(identity: Identity | None) -> str | None:
    """`tenant()` for `identity`: for a count that outlives the call's context."""
    return None if identity is None or identity.is_admin else identity.name


def may_route(open_to_every_key: bool = False) -> bool:
    """Whether the current caller may send or read routing data (KV transfer
    parameters, KV events): a router or an administrator, any caller when
    `open_to_every_key` (the operator's opt-in), and a call without
    credentials (a server without authentication has no tenants to keep apart).
    """
    identity = current_identity.get()
    return open_to_every_key or identity is None or identity.is_router


def priority_floor(server_floor: int) -> int | None:
    """The lowest request `priority` the current caller may ask for (vLLM runs
    lower first): None for a router, an administrator and a call without
    credentials (no tenants to keep apart), else the identity's own floor or
    `server_floor` (`--min-tenant-priority`)."""
    identity = current_identity.get()
    if identity is None or identity.is_router:  # admins are routers too
        return None
    return server_floor if identity.min_priority is None else identity.min_priority


def caller_name() -> str | None:
    """The current caller's identity name; None for a call without credentials."""
    identity = current_identity.get()
    return None if identity is None else identity.name


_caller_at_fault: contextvars.ContextVar[object] = contextvars.ContextVar(
    "vllm_servicer_caller_at_fault", default=None
)


def blame_caller() -> None:
    """Mark the current call as refused for its caller's own doing (past its own
    share, a request never sent): not a failure of the server's, so load reports
    leave it out of their error rate (a tenant's refusals must not steer
    balancers away from a healthy replica)."""
    # The call's task, not a flag: a context copied from this one (a task a
    # handler starts, a server started here) holds no mark of its own.
    _caller_at_fault.set(_running_task())


def caller_at_fault() -> bool:
    """Whether `blame_caller` marked the current call (its task)."""
    marked = _caller_at_fault.get()
    return marked is not None and marked is _running_task()


def _running_task() -> object:
    """The task running now; None outside an event loop (a host's sync code)."""
    try:
        return current_task()
    except RuntimeError:
        return None


current_request_id: contextvars.ContextVar[str] = contextvars.ContextVar(
    "vllm_servicer_request_id", default=""
)
"""The engine request id of the call being served ("" before it has one)."""


_usage: contextvars.ContextVar[GenerationUsage | None] = contextvars.ContextVar(
    "vllm_servicer_generation_usage", default=None
)


def shared_usage() -> GenerationUsage:
    """For an interceptor: the usage record of the current call, created on first use.

    Every interceptor of the call (and of every pipeline around it) gets the
    same record, as does the handler. A record of another task (one the
    context was copied from) is not this call's.
    """
    task = current_task()
    usage = _usage.get()
    if usage is None or usage.owner is not task:
        usage = GenerationUsage(task)
        _usage.set(usage)
    return usage


def kept_usage() -> GenerationUsage | None:
    """For the handler: the record to keep for this call; None when nothing reads one.

    The handler states its request there (`request`, a `RequestSummary`) and
    what it sends: the interceptors read those, never the protocol's messages.
    """
    usage = _usage.get()
    if usage is None or usage.owner is not current_task():
        return None
    usage.kept = True
    return usage


@functools.cache
def _w3c_injector() -> Callable[[], dict[str, str] | None] | None:
    try:
        from opentelemetry.trace import get_current_span
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError:
        return None
    # W3C trace context whatever OTEL_PROPAGATORS says: it is what vLLM reads.
    propagator = TraceContextTextMapPropagator()

    def inject() -> dict[str, str] | None:
        if not get_current_span().get_span_context().is_valid:
            return None
        carrier: dict[str, str] = {}
        propagator.inject(carrier)
        return carrier

    return inject


def engine_trace_headers(call_context: Any) -> dict[str, str] | None:
    """The W3C trace headers to pass the engine as `trace_headers` for this call.

    Inside a traced call they carry the current span, the server's, so vLLM's
    `llm_request` span is its child. Without a current span they are the
    caller's `traceparent`/`tracestate` from the call's metadata, so the
    engine's span still joins the caller's trace.

    Args:
        call_context: the call's ServicerContext (its `invocation_metadata()`).

    Returns:
        The headers, or None when there is no trace to continue.
    """
    inject = _w3c_injector()
    if inject is not None:
        current = inject()
        if current is not None:
            return current
    found: dict[str, str] | None = None
    for key, value in call_context.invocation_metadata() or ():
        # grpc lower-cases metadata keys on the wire.
        if key == "traceparent" or key == "tracestate":
            if found is None:
                found = {}
            found[key] = value
    return found
