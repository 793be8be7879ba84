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

Verifiers are small async callables `(metadata, auth_context) -> Identity`
that raise `Unauthenticated` or `PermissionDenied` to reject:

- `ApiKeyVerifier`: `authorization: Bearer <key>`, several keys at once so
  keys can rotate, from a list, a file (re-read when it changes) or an
  environment variable;
- `MtlsVerifier`: the client certificate the TLS handshake verified;
- `CallableVerifier`: any async function (JWT, a host's identity system);
- `AllOf`: every verifier must accept (e.g. mTLS plus a key);
- `AnyOf`: the first verifier that accepts (e.g. admin keys, then inference keys).

The accepted identity is in `current_identity` (a context variable) while the
handler runs, for the servicer, the engine calls it makes and interceptors
further in; `AuthInterceptor` keeps it in its own `call.state` too.
Secrets are never logged: keys are named by a label.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import inspect
import logging
import math
import os
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import grpc

from ..budgets import check_priority_floor
from ..context import ADMIN_ROLE, ROUTER_ROLE, Identity, current_identity
from ..errors import ROUTER_ROLE_HINT, AuthError, PermissionDenied, Unauthenticated
from ..proto import ADMIN_METHODS, ORCA_SERVICE, ROUTING_METHODS
from ._base import CallInterceptor, MethodFilter
from ._call import Call, Refusal

__all__ = [
    "DEFAULT_MAX_TOKEN_LENGTH",
    "ADMIN_METHODS",
    "ADMIN_ROLE",
    "ROUTER_ROLE",
    "ROUTING_METHODS",
    "AllOf",
    "AnyOf",
    "ApiKeyVerifier",
    "AuthError",
    "AuthInterceptor",
    "CallableVerifier",
    "Identity",
    "MtlsVerifier",
    "PermissionDenied",
    "Unauthenticated",
    "Verifier",
    "current_identity",
    "key_label",
    "requires_auth_by_default",
    "role_permissions",
    "routing_for_every_key",
]

logger = logging.getLogger(__name__)

Metadata = Sequence[tuple[str, str | bytes]]
AuthContext = Mapping[str, Sequence[bytes]]

# Far above any real API key, far below grpc's own metadata limit (8 KiB by
# default): a bound that keeps hashing and logging cheap for hostile input.
DEFAULT_MAX_TOKEN_LENGTH = 1024

# RFC 6750 b64token: no whitespace, no commas, no quotes.
_TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")
_SCHEME = "Bearer "
_EXEMPT_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.", f"/{ORCA_SERVICE}/")


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

    async def on_admit(self, method: str, metadata: Any, context: Any) -> None:
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


def _log_rejection(method: str, context: Any, rejection: AuthError) -> None:
    logger.info(
        "rejected %s from %s: %s (%s)", method, _peer(context), rejection, rejection.status_code
    )


def _auth_context(context: Any) -> AuthContext:
    try:
        return context.auth_context() or {}
    except Exception:  # pragma: no cover - a context without transport security
        return {}


def _peer(context: Any) -> str:
    try:
        return str(context.peer())
    except Exception:  # pragma: no cover
        return "?"


# ----- API keys ---------------------------------------------------------------


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("ascii")).digest()


def key_label(key: str) -> str:
    """The default non-secret name of a key: `key-` and 8 hex digits of its SHA-256."""
    return "key-" + hashlib.sha256(key.encode("ascii")).hexdigest()[:8]


def _check_key(key: str, max_length: int, where: str) -> str:
    if not key or len(key) > max_length or not _TOKEN.fullmatch(key):
        raise ValueError(
            f"{where}: an API key must be 1-{max_length} characters of "
            "A-Z a-z 0-9 - . _ ~ + / (optionally ending in '=')"
        )
    return key


_KEY_ROLES = frozenset({ROUTER_ROLE, ADMIN_ROLE})


@dataclasses.dataclass(frozen=True)
class _KeyEntry:
    """What one key establishes: its identity's label, the roles its line adds, its
    weight, its priority floor (None: the server's)."""

    label: str
    roles: frozenset[str] = frozenset()
    weight: float = 1.0
    min_priority: int | None = None


def _parse_settings(settings: list[str], where: str) -> tuple[frozenset[str], float, int | None]:
    """A key's `name=value` settings: `role=` (repeatable, or a comma list),
    `weight=` and `min_priority=` (the lowest request priority it may ask for)."""
    roles: set[str] = set()
    weight: float | None = None
    min_priority: int | None = None
    for setting in settings:
        name, sep, value = setting.partition("=")
        if not sep or not value:
            raise ValueError(f"{where}: {setting!r} after the key is no name=value setting")
        if name == "role":
            for role in value.split(","):
                if role not in _KEY_ROLES:
                    known = ", ".join(sorted(_KEY_ROLES))
                    raise ValueError(f"{where}: unknown role {role!r} (known: {known})")
                roles.add(role)
        elif name == "weight":
            if weight is not None:
                raise ValueError(f"{where}: weight given twice")
            try:
                weight = float(value)
            except ValueError:
                weight = math.nan
            if not (math.isfinite(weight) and weight > 0):
                raise ValueError(f"{where}: weight must be a positive number, got {value!r}")
        elif name == "min_priority":
            if min_priority is not None:
                raise ValueError(f"{where}: min_priority given twice")
            try:
                floor: object = int(value)
            except ValueError:
                floor = value
            min_priority = check_priority_floor(f"{where}: min_priority", floor)
        else:
            raise ValueError(
                f"{where}: unknown setting {name!r} (known: role, weight, min_priority)"
            )
    return frozenset(roles), 1.0 if weight is None else weight, min_priority


def _parse_keys(text: str, where: str, max_length: int) -> dict[str, _KeyEntry]:
    """Keys of a key file: one per line, `label: key` or `key`, then optional
    `name=value` settings (`role=router`, `weight=2`); '#' comments.

    Keys are RFC 6750 tokens, never whitespace, so what follows the key on its
    line is its settings. Two keys under one label are one identity: their
    settings must agree.
    """
    keys: dict[str, _KeyEntry] = {}
    first_line: dict[str, tuple[int, _KeyEntry]] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        label, sep, rest = line.partition(":")
        if sep:
            label = label.strip()
            if not label:
                raise ValueError(f"{where}:{number}: empty label before ':'")
        else:
            label, rest = "", line
        key, *settings = rest.split() or [""]
        key = _check_key(key, max_length, f"{where}:{number}")
        roles, weight, min_priority = _parse_settings(settings, f"{where}:{number}")
        entry = _KeyEntry(label or key_label(key), roles, weight, min_priority)
        seen = first_line.setdefault(entry.label, (number, entry))
        if (seen[1].roles, seen[1].weight, seen[1].min_priority) != (roles, weight, min_priority):
            raise ValueError(
                f"{where}:{number}: label {entry.label!r} has other settings (roles, weight, "
                f"min_priority) than on line {seen[0]}: the keys of one identity must agree"
            )
        keys[key] = entry
    return keys


class ApiKeyVerifier:
    """Accepts `authorization: Bearer <key>` for any of a set of keys.

    The accepted form is strict on purpose, so exactly one spelling works:
    the metadata key `authorization` (present once), the scheme `Bearer`
    exactly as written (HTTP treats schemes case-insensitively, but every
    gRPC client, grpc's own `access_token_call_credentials` included, sends
    `Bearer`), one space, and an RFC 6750 token with no surrounding
    whitespace, at most `max_token_length` characters. Keys in any other
    header, `-bin` metadata or another scheme are not looked at.

    The presented key is compared with every configured key in constant time
    (SHA-256 digests, so the comparison is also independent of key length).
    Several keys at once let clients move to a new key before the old one is
    removed. The identity names the key by its label, never the key.

    Args:
        keys: the accepted keys: strings (labelled `key-<sha256 prefix>`) or
            a mapping `label -> key`.
        max_token_length: longer tokens are rejected unread.
        roles: roles of the identities these keys establish (e.g. `ADMIN_ROLE`).
    """

    # Keys travel in the metadata: the decision is made before the request is read.
    reads_auth_context = False

    def __init__(
        self,
        keys: Iterable[str] | Mapping[str, str],
        *,
        max_token_length: int = DEFAULT_MAX_TOKEN_LENGTH,
        roles: Iterable[str] = (),
    ) -> None:
        self._max = max_token_length
        self._roles = frozenset(roles)
        if isinstance(keys, Mapping):
            pairs = {
                _check_key(k, self._max, f"key {label!r}"): _KeyEntry(label)
                for label, k in keys.items()
            }
        else:
            pairs = {_check_key(k, self._max, "key"): _KeyEntry(key_label(k)) for k in keys}
        self._set_keys(pairs, "keys")
        self._path: Path | None = None
        self._signature: tuple[int, ...] | None = None

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike[str],
        *,
        max_token_length: int = DEFAULT_MAX_TOKEN_LENGTH,
        roles: Iterable[str] = (),
    ) -> ApiKeyVerifier:
        """Keys from a file, re-read whenever it changes (no restart to rotate).

        One key per line, optionally labelled `label: key`, then optionally
        whitespace-separated settings: `role=router` (repeatable, or a comma
        list; `router` and `admin`), added to `roles`, `weight=2` (the
        identity's weight in fair shares, 1 by default) and `min_priority=-5`
        (the lowest request priority it may ask for, the server's
        `--min-tenant-priority` by default). Keys under one label
        are one identity and must carry the same settings. Blank lines and
        `#` comments are ignored. The file fails closed: once it is removed,
        unreadable, empty, comments only or holds a malformed line, no key is
        valid (every call UNAUTHENTICATED) until a good file is back, so
        emptying the file revokes every key. Each change of state is logged
        once. Replace the file atomically (write elsewhere, rename over it) so
        that a half-written file never shows.

        Raises:
            OSError: the file cannot be read at start.
            ValueError: it holds a malformed key or setting, keys of one label
                that disagree, or no key at all at start (the line is named).
        """
        file = Path(path)
        verifier = cls.__new__(cls)
        verifier._max = max_token_length
        verifier._roles = frozenset(roles)
        verifier._path = file
        # Taken before reading: a change in between is picked up on the next call.
        verifier._signature = _signature(file)
        verifier._set_keys(_parse_keys(file.read_text("utf-8"), str(file), max_token_length), file)
        return verifier

    @classmethod
    def from_env(
        cls,
        var: str,
        *,
        max_token_length: int = DEFAULT_MAX_TOKEN_LENGTH,
        roles: Iterable[str] = (),
    ) -> ApiKeyVerifier:
        """Keys from an environment variable, comma-separated (read once).

        Raises:
            ValueError: the variable is unset, empty or malformed.
        """
        value = os.environ.get(var, "")
        keys = [k.strip() for k in value.split(",") if k.strip()]
        if not keys:
            raise ValueError(f"environment variable {var} holds no API key")
        return cls(keys, max_token_length=max_token_length, roles=roles)

    @property
    def labels(self) -> tuple[str, ...]:
        """The labels of the keys in force."""
        self._maybe_reload()
        return tuple(entry.label for _, entry in self._keys)

    def _set_keys(self, pairs: Mapping[str, _KeyEntry], where: object) -> None:
        if not pairs:
            raise ValueError(f"{where}: no API key given")
        self._keys = [(_digest(key), entry) for key, entry in pairs.items()]

    def _maybe_reload(self) -> None:
        if self._path is None:
            return
        signature = _signature(self._path)
        if signature == self._signature:
            return  # the same file state as last time, good or bad: nothing to log
        self._signature = signature
        try:
            pairs = _parse_keys(self._path.read_text("utf-8"), str(self._path), self._max)
            self._set_keys(pairs, self._path)
        except (OSError, ValueError, UnicodeError) as exc:
            # Fail closed: an operator who empties or removes the file to lock
            # a leaked key out must not leave it working.
            self._keys = []
            logger.error(
                "API key file %s unusable, no key is valid until it is fixed: %s", self._path, exc
            )
            return
        logger.info("API key file %s reloaded: %d key(s)", self._path, len(self._keys))

    async def __call__(self, metadata: Metadata, auth_context: AuthContext) -> Identity:
        self._maybe_reload()
        token = self._token(metadata)
        presented = _digest(token)
        found = None
        for digest, entry in self._keys:
            # No early exit: every key is compared whichever one matches.
            if hmac.compare_digest(presented, digest):
                found = entry
        if found is None:
            raise Unauthenticated("invalid API key")
        return Identity(
            name=found.label,
            kind="api_key",
            roles=self._roles | found.roles,
            weight=found.weight,
            min_priority=found.min_priority,
        )

    def _token(self, metadata: Metadata) -> str:
        values = [value for key, value in metadata if key == "authorization"]
        if not values:
            raise Unauthenticated("missing credentials: send 'authorization: Bearer <key>'")
        if len(values) > 1:
            raise Unauthenticated("more than one authorization header")
        value = values[0]
        if not isinstance(value, str):
            raise Unauthenticated("malformed authorization header")
        if not value.startswith(_SCHEME):
            raise Unauthenticated("authorization scheme must be 'Bearer'")
        token = value[len(_SCHEME) :]
        if len(token) > self._max:
            raise Unauthenticated("bearer token too long")
        if not _TOKEN.fullmatch(token):
            raise Unauthenticated("malformed bearer token")
        return token


def _signature(path: Path) -> tuple[int, ...]:
    # Inode too: an atomic rename over the file may keep size and mtime; the
    # change time and mode: a chmod changes neither. () when it cannot be seen.
    try:
        st = path.stat()
    except OSError:
        return ()
    return (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino, st.st_mode)


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
        result: Any = self._fn(metadata, auth_context)
        if inspect.isawaitable(result):
            result = await result
        if result is None:
            raise Unauthenticated("invalid credentials")
        if isinstance(result, str):
            return Identity(name=result, kind="custom")
        return result  # type: ignore[no-any-return]


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
