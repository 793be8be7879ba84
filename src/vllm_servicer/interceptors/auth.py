"""Authentication and authorization for the served methods.

`AuthInterceptor` asks a *verifier* who is calling, then whether that identity
may call the method, before the handler runs:

- missing or malformed credentials, or credentials nobody issued:
  UNAUTHENTICATED;
- a known identity without permission for the method: PERMISSION_DENIED.

The decision is made as the call starts (`on_admit`), from its metadata and,
for a verifier that reads it, the TLS auth context, before the request
message is read: the wrapper reads a unary request itself, after admission,
so a refused call's bytes are never received, inflated nor parsed, and a
client without credentials costs the server no deserialization and no engine
work. Which methods are an administrator's is the protos' method table
(`proto.ADMIN_METHODS`), not a list here.
Health (`grpc.health.v1.Health`), reflection (`grpc.reflection.*`) and
ORCA's load reports (`xds.service.orca.v3.OpenRcaService`) are exempt by
default: probes carry no credentials, nor do a balancer's out-of-band streams
(gRPC opens them on the connection, without a call's credentials).

The verifiers that say who is calling are `verifiers.py`'s (the `Verifier`
protocol, mTLS, custom and composed ones) and `api_keys.py`'s
(`ApiKeyVerifier`).

The accepted identity is in `current_identity` (a context variable) while the
handler runs, for the servicer, the engine calls it makes and interceptors
further in; `AuthInterceptor` keeps it in its own `call.state` too.
Secrets are never logged: keys are named by a label.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import cast

import grpc

from ..context import ADMIN_ROLE, ROUTER_ROLE, Identity, current_identity
from ..errors import ROUTER_ROLE_HINT, AuthError, PermissionDenied, Unauthenticated
from ..proto import ADMIN_METHODS, ORCA_SERVICE, ROUTING_METHODS
from ._base import CallInterceptor, MethodFilter
from ._call import Call, Context, Refusal
from .verifiers import AuthContext, Metadata, Verifier, _reads_auth_context

__all__ = [
    "ADMIN_METHODS",
    "ADMIN_ROLE",
    "ROUTER_ROLE",
    "ROUTING_METHODS",
    "AuthError",
    "AuthInterceptor",
    "Identity",
    "PermissionDenied",
    "Unauthenticated",
    "current_identity",
    "requires_auth_by_default",
    "role_permissions",
    "routing_for_every_key",
]

logger = logging.getLogger(__name__)

_EXEMPT_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.", f"/{ORCA_SERVICE}/")


def role_permissions(identity: Identity, method: str) -> bool:
    """Permissions by role: `ADMIN_METHODS` need `ADMIN_ROLE`, `ROUTING_METHODS`
    (KV events, which carry every tenant's token ids) `ROUTER_ROLE` or
    `ADMIN_ROLE`, the rest any identity.

    Pass as `AuthInterceptor(..., permissions=role_permissions)`; the launcher does.
    """
    if method in ADMIN_METHODS:
        return identity.is_admin
    return method not in ROUTING_METHODS or identity.is_router


def routing_for_every_key(identity: Identity, method: str) -> bool:
    """`role_permissions` with the routing methods open to every identity: for a
    server whose keys are all trusted with each other's traffic (the launcher's
    `--routing-data-for-every-key`)."""
    return method not in ADMIN_METHODS or identity.is_admin


def _denial(identity: Identity, method: str) -> str:
    """The refusal's message: the method, and the role it needs when the caller lacks it."""
    message = f"{identity.name!r} may not call {method}"
    if method in ADMIN_METHODS and not identity.is_admin:
        return f"{message}: it needs the admin role (an admin key, or role=admin in a key file)"
    if method in ROUTING_METHODS and not identity.is_router:
        return f"{message}: KV events carry every tenant's token ids; {ROUTER_ROLE_HINT}"
    return message


def requires_auth_by_default(method: str) -> bool:
    """The default method filter: everything except health, reflection and ORCA's load reports."""
    return not method.startswith(_EXEMPT_PREFIXES)


Permissions = Callable[[Identity, str], bool] | Mapping[str, MethodFilter]


class AuthInterceptor(CallInterceptor):
    """Rejects calls whose credentials a verifier does not accept.

    Works server-wide (`grpc.aio.server(interceptors=[auth, ...])`) and for the
    mounted services only (`mount(server, engine, interceptors=[auth])`). Put
    it first so that no other interceptor does work for a rejected call.

    Args:
        verifier: establishes the caller's identity (see `Verifier`).
        methods: which methods need credentials; default: all but health
            and reflection.
        permissions: which identity may call which method: a function
            `(identity, method) -> bool`, or a mapping from identity name to a
            method filter (names not in it may call nothing). None: every
            authenticated identity may call every method.
    """

    def __init__(
        self,
        verifier: Verifier,
        *,
        methods: MethodFilter = requires_auth_by_default,
        permissions: Permissions | None = None,
    ) -> None:
        super().__init__(methods=methods)
        self._verifier = verifier
        if permissions is None or callable(permissions):
            self._allowed: Callable[[Identity, str], bool] | None = permissions
        else:
            table = dict(permissions)

            def allowed(identity: Identity, method: str) -> bool:
                methods_filter = table.get(identity.name)
                return methods_filter is not None and methods_filter(method)

            self._allowed = allowed

    # grpc runs a sync handler in its thread pool, where no check can run first.
    fails_closed = True

    async def _identify(
        self, metadata: Metadata, auth_context: AuthContext, method: str
    ) -> Identity:
        identity = await self._verifier(metadata, auth_context)
        if not isinstance(identity, Identity):
            raise TypeError(f"verifier returned {type(identity).__name__}, not Identity")
        if self._allowed is not None and not self._allowed(identity, method):
            raise PermissionDenied(_denial(identity, method))
        return identity

    async def on_admit(self, method: str, metadata: Metadata, context: Context) -> None:
        # Before the request is read: a refused call must not cost a parse of
        # a message up to the size limit.
        # grpc builds the auth context afresh on each ask: only for a verifier that reads it.
        auth_context = _auth_context(context) if _reads_auth_context(self._verifier) else {}
        try:
            identity = await self._identify(metadata, auth_context, method)
        except AuthError as rejection:
            raise _refusal(method, rejection) from None
        except Exception:
            # A verifier bug or an identity provider outage: fail closed.
            logger.exception("verifier failed for %s", method)
            raise Refusal(grpc.StatusCode.INTERNAL, "authentication failed") from None
        # grpc serves each call in a task of its own: this value is the call's
        # own and ends with its task.
        current_identity.set(identity)

    async def on_start(self, call: Call) -> None:
        call.state = current_identity.get()

    def on_finish(self, call: Call) -> None:
        if call.state is not None:
            # Keeps the identity from outliving the call in its task's context.
            current_identity.set(None)


def _code(rejection: AuthError) -> grpc.StatusCode:
    return grpc.StatusCode[rejection.status_code]


def _refusal(method: str, rejection: AuthError) -> Refusal:
    return Refusal(
        _code(rejection),
        str(rejection) or "not authorized",
        log=lambda context: _log_rejection(method, context, rejection),
    )


def _log_rejection(method: str, context: Context, rejection: AuthError) -> None:
    logger.info(
        "rejected %s from %s: %s (%s)", method, _peer(context), rejection, rejection.status_code
    )


def _auth_context(context: Context) -> AuthContext:
    try:
        # grpc's server gives lists of bytes; its stubs say only iterables.
        return cast(AuthContext, context.auth_context() or {})
    except Exception:  # pragma: no cover - a context without transport security
        return {}


def _peer(context: Context) -> str:
    try:
        return str(context.peer())
    except Exception:  # pragma: no cover
        return "?"
