"""API keys: `ApiKeyVerifier`, from a list, a key file or an environment variable.

Clients send `authorization: Bearer <key>`. Several keys are in force at once
so that keys can rotate; a key file is re-read when it changes (no restart to
rotate or revoke) and gives each key its label, roles, weight and priority
floor. Keys are compared as digests and named by their label: never logged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import math
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from ..budgets import check_priority_floor
from ..context import ADMIN_ROLE, ROUTER_ROLE, Identity
from ..errors import Unauthenticated
from .verifiers import AuthContext, Metadata

__all__ = ["DEFAULT_MAX_TOKEN_LENGTH", "ApiKeyVerifier", "key_label"]

# Authentication's logger: a key file's reloads are logged beside the rejections.
logger = logging.getLogger("vllm_servicer.interceptors.auth")

# Far above any real API key, far below grpc's own metadata limit (8 KiB by
# default): a bound that keeps hashing and logging cheap for hostile input.
DEFAULT_MAX_TOKEN_LENGTH = 1024

# RFC 6750 b64token: no whitespace, no commas, no quotes.
_TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")
_SCHEME = "Bearer "


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
