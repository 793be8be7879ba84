"""Verifiers: who is calling, from a call's metadata and its TLS auth context.

Verifiers are small async callables `(metadata, auth_context) -> Identity`
that raise `Unauthenticated` or `PermissionDenied` to reject. `AuthInterceptor`
(`auth.py`) asks one for every call that needs credentials; they read plain
metadata and a plain auth context, so the launcher's HTTP API asks the same
verifier for its requests.

- `MtlsVerifier`: the client certificate the TLS handshake verified;
- `CallableVerifier`: any async function (JWT, a host's identity system);
- `AllOf`: every verifier must accept (e.g. mTLS plus a key);
- `AnyOf`: the first verifier that accepts (e.g. admin keys, then inference keys).

API keys, from a list, a file or an environment variable, are `api_keys.py`'s.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Protocol

from ..context import Identity
from ..errors import AuthError, PermissionDenied, Unauthenticated

__all__ = [
    "AllOf",
    "AnyOf",
    "CallableVerifier",
    "MtlsVerifier",
    "Verifier",
]

Metadata = Sequence[tuple[str, str | bytes]]
AuthContext = Mapping[str, Sequence[bytes]]


class Verifier(Protocol):
    """Establishes who is calling, or rejects the call.

    Must be async (or return quickly): it runs on the server's event loop.

    A verifier that decides from the metadata alone sets the attribute
    `reads_auth_context = False`: `AuthInterceptor` then passes an empty auth
    context and spares grpc building one per call. Either way it decides
    before the request is read.
    """

    async def __call__(self, metadata: Metadata, auth_context: AuthContext) -> Identity:
        """Return the caller's identity; raise `Unauthenticated` or `PermissionDenied`."""
        ...


# ----- custom and composed ----------------------------------------------------


class CallableVerifier:
    """A verifier from a function (JWT validation, a host's identity system).

    `fn(metadata, auth_context)` may be async or a fast plain function. It
    returns an `Identity`, a name (str, made into an `Identity` of kind
    "custom") or None (rejected as UNAUTHENTICATED), or raises
    `Unauthenticated` / `PermissionDenied` with a message for the client.

    Pass `reads_auth_context=False` when `fn` decides from the metadata alone
    (a bearer token): the call is then refused before its request is read, and
    `fn` gets an empty auth context.
    """

    def __init__(
        self,
        fn: Callable[[Metadata, AuthContext], Identity | str | None]
        | Callable[[Metadata, AuthContext], Awaitable[Identity | str | None]],
        *,
        reads_auth_context: bool = True,
    ) -> None:
        self._fn = fn
        self.reads_auth_context = reads_auth_context

    async def __call__(self, metadata: Metadata, auth_context: AuthContext) -> Identity:
        outcome = self._fn(metadata, auth_context)
        result = await outcome if inspect.isawaitable(outcome) else outcome
        if result is None:
            raise Unauthenticated("invalid credentials")
        if isinstance(result, str):
            return Identity(name=result, kind="custom")
        return result


class AllOf:
    """Every verifier must accept, in order (the first rejection wins).

    The identity is the first verifier's (so `AllOf(MtlsVerifier(), keys)`
    is named by the certificate), with each verifier's identity in `parts`.
    """

    def __init__(self, *verifiers: Verifier) -> None:
        if not verifiers:
            raise ValueError("AllOf needs at least one verifier")
        self._verifiers = verifiers
        self.reads_auth_context = any(_reads_auth_context(v) for v in verifiers)

    async def __call__(self, metadata: Metadata, auth_context: AuthContext) -> Identity:
        parts = [await verifier(metadata, auth_context) for verifier in self._verifiers]
        first = parts[0]
        return Identity(
            name=first.name,
            kind="all_of",
            attributes=first.attributes,
            parts=tuple(parts),
            roles=first.roles,
            weight=first.weight,
            min_priority=first.min_priority,
        )


class AnyOf:
    """The first verifier that accepts, in order (e.g. admin keys, then inference keys).

    When none accepts, the first verifier's rejection is raised.
    """

    def __init__(self, *verifiers: Verifier) -> None:
        if not verifiers:
            raise ValueError("AnyOf needs at least one verifier")
        self._verifiers = verifiers
        self.reads_auth_context = any(_reads_auth_context(v) for v in verifiers)

    async def __call__(self, metadata: Metadata, auth_context: AuthContext) -> Identity:
        first: AuthError | None = None
        for verifier in self._verifiers:
            try:
                return await verifier(metadata, auth_context)
            except AuthError as rejection:
                first = first or rejection
        assert first is not None
        raise first


def _reads_auth_context(verifier: Verifier) -> bool:
    return bool(getattr(verifier, "reads_auth_context", True))


# ----- mTLS -------------------------------------------------------------------


class MtlsVerifier:
    """The identity of the client certificate the TLS handshake verified.

    Use it with a server that requires and verifies client certificates
    (`vllm_servicer.tls.server_credentials(..., client_ca_file=...)`): the
    certificate's chain is checked there, this verifier reads the result from
    the call's auth context. The identity is named by the certificate's
    common name (or its first SAN when it has none).

    Args:
        allowed_subjects: subjects allowed to call, each a common name
            ("router") or a whole subject as grpc writes it ("CN=router,O=Acme");
            None: any.
        allowed_sans: subject alternative names (DNS, URI, e-mail, IP as
            grpc reports them) of which the certificate must carry at least
            one; None: any.
        roles: roles of the identities these certificates establish (e.g.
            `ADMIN_ROLE`, with `allowed_subjects` naming the administrators).

    A call without a verified certificate is UNAUTHENTICATED; a verified
    certificate outside the allowed names is PERMISSION_DENIED. Certificates
    with the same name are one identity.
    """

    def __init__(
        self,
        allowed_subjects: Iterable[str] | None = None,
        allowed_sans: Iterable[str] | None = None,
        *,
        roles: Iterable[str] = (),
    ) -> None:
        self._subjects = None if allowed_subjects is None else frozenset(allowed_subjects)
        self._sans = None if allowed_sans is None else frozenset(allowed_sans)
        self._roles = frozenset(roles)

    async def __call__(self, metadata: Metadata, auth_context: AuthContext) -> Identity:
        if b"ssl" not in auth_context.get("transport_security_type", ()):
            raise Unauthenticated("a client certificate is required (TLS)")
        if not auth_context.get("x509_pem_cert"):
            raise Unauthenticated("a client certificate is required")
        common = [v.decode("utf-8", "replace") for v in auth_context.get("x509_common_name", ())]
        sans = [
            v.decode("utf-8", "replace")
            for v in auth_context.get("x509_subject_alternative_name", ())
        ]
        name = common[0] if common else (sans[0] if sans else "")
        if not name:
            raise Unauthenticated("the client certificate names no subject")
        subjects = common + [
            v.decode("utf-8", "replace") for v in auth_context.get("x509_subject", ())
        ]
        if self._subjects is not None and not self._subjects.intersection(subjects):
            raise PermissionDenied(f"certificate subject {name!r} is not allowed")
        if self._sans is not None and not self._sans.intersection(sans):
            raise PermissionDenied(f"certificate {name!r} carries no allowed name")
        return Identity(
            name=name,
            kind="mtls",
            attributes={"common_name": common, "sans": sans},
            roles=self._roles,
        )
