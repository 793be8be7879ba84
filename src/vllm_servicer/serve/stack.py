"""The launcher's interceptor stack and its callers' verifiers, built from `ServeArgs`.

Callers are known by an admin, router or inference key (from flags, key files
or the environment), else, with client certificates required, by their
certificate.
"""

from __future__ import annotations

import os

from ..frontends import FrontendGroup
from ..interceptors import (
    AuthInterceptor,
    CallInterceptor,
    InflightInterceptor,
    MetricsInterceptor,
    TracingInterceptor,
    configure_tracing_from_env,
)
from ..interceptors.api_keys import ApiKeyVerifier
from ..interceptors.auth import (
    ADMIN_ROLE,
    ROUTER_ROLE,
    Identity,
    role_permissions,
    routing_for_every_key,
)
from ..interceptors.call_slots import CallSlotsInterceptor
from ..interceptors.verifiers import AnyOf, CallableVerifier, MtlsVerifier, Verifier
from .args import ADMIN_KEY_ENV, API_KEY_ENV, ROUTER_KEY_ENV, ServeArgs

__all__ = ["build_interceptors", "http_verifier", "key_verifier"]


def build_interceptors(
    args: ServeArgs,
    verifier: Verifier | None = None,
    *,
    group: FrontendGroup | None = None,
    model: str = "",
) -> tuple[list[CallInterceptor], MetricsInterceptor | None]:
    """The launcher's interceptor stack, outermost first, and its metrics interceptor.

    Tracing outermost (its span covers everything), then metrics (rejected calls
    are counted too), then authentication, then the keyed calls' slots (only
    authenticated calls take one; each tenant its fair share of
    `--max-concurrent-rpcs`, and the read deadline), then the in-flight limit
    (each tenant its fair share of it too),
    each when there is one; `mount` counts
    the calls in flight either way, and runs the stack from one wrapper per call.
    Tracing is on when the OTEL_* variables ask for it; metrics are on with a
    metrics port or the HTTP API (whose `/metrics` shows them).

    Args:
        args: the launcher's arguments.
        verifier: the key verifier to use (default: `key_verifier(args)`). Without
            keys but with client certificates required, the certificate names the
            caller, and only the `--admin-tls-subject` ones have the admin role
            (the `--router-tls-subject` ones the router role).
        group: with `--api-server-count` above 1, the frontends' shared state:
            the in-flight count and its limit are theirs together.
        model: the name the engine serves (`vllm_servicer.engine.served_model_name`),
            which spans and series carry as vLLM's own `vllm:*` series do.
    """
    stack: list[CallInterceptor] = []
    tracer_provider = configure_tracing_from_env()
    if tracer_provider is not None:
        stack.append(TracingInterceptor(tracer_provider=tracer_provider, model=model))
    metrics = None
    if args.observability.metrics_port is not None or args.http.http_port is not None:
        metrics = MetricsInterceptor(model_name=model)
        stack.append(metrics)
    if verifier is None:
        verifier = key_verifier(args)
    if verifier is None and args.security.client_ca:
        verifier = _certificate_verifier(args)
    if verifier is not None:
        # KV events are a router's unless the operator opens them to every key.
        every_key = args.options.tenancy.routing_data_for_every_key
        permissions = routing_for_every_key if every_key else role_permissions
        stack.append(AuthInterceptor(verifier, permissions=permissions))
    stack.append(
        CallSlotsInterceptor(
            args.slots.max_concurrent_rpcs or None,
            read_timeout=args.slots.request_read_timeout,
            write_timeout=args.slots.response_write_timeout,
        )
    )
    if args.slots.max_inflight or group is not None:
        stack.append(
            InflightInterceptor(
                args.slots.max_inflight or None,
                group=group,
                fair_shares=not args.slots.no_fair_shares,
            )
        )
    return stack, metrics


def key_verifier(args: ServeArgs) -> Verifier | None:
    """Admin keys, then router keys, then inference keys (flags, else the
    environment); None: no keys. A key file's lines may add roles of their own."""

    def keys(
        flag: tuple[str, ...], file: str | None, env: str, roles: tuple[str, ...]
    ) -> ApiKeyVerifier | None:
        if file:
            return ApiKeyVerifier.from_file(file, roles=roles)
        if flag:
            return ApiKeyVerifier(flag, roles=roles)
        if os.environ.get(env, "").strip():
            return ApiKeyVerifier.from_env(env, roles=roles)
        return None

    security = args.security
    found = [
        keys(security.admin_api_key, security.admin_api_key_file, ADMIN_KEY_ENV, (ADMIN_ROLE,)),
        keys(security.router_api_key, security.router_api_key_file, ROUTER_KEY_ENV, (ROUTER_ROLE,)),
        keys(security.api_key, security.api_key_file, API_KEY_ENV, ()),
    ]
    verifiers: list[Verifier] = [v for v in found if v is not None]
    if not verifiers:
        return None
    return verifiers[0] if len(verifiers) == 1 else AnyOf(*verifiers)


def _certificate_verifier(args: ServeArgs) -> Verifier:
    """Client certificates as identities: the admin subjects first, then the router
    subjects, then any certificate.

    The handshake already verified the certificate against --tls-client-ca;
    without an admin (router) subject no certificate has the admin (router) role.
    """
    verifiers: list[Verifier] = [
        MtlsVerifier(allowed_subjects=subjects, roles=(role,))
        for subjects, role in (
            (args.security.admin_tls_subject, ADMIN_ROLE),
            (args.security.router_tls_subject, ROUTER_ROLE),
        )
        if subjects
    ]
    return AnyOf(*verifiers, MtlsVerifier()) if verifiers else MtlsVerifier()


def http_verifier(args: ServeArgs, keys: Verifier | None) -> Verifier | None:
    """The HTTP API's verifier: the keys, else, with client certificates, no admin role.

    The HTTP side cannot see which certificate a client presented (uvicorn
    verified it in the handshake), so without keys every client there is an
    inference caller and vLLM's admin paths are refused to all.

    Args:
        args: the launcher's arguments.
        keys: the gRPC side's key verifier (`key_verifier(args)`), or None.
    """
    if keys is not None or not args.security.client_ca:
        return keys
    holder = Identity(name="client-certificate", kind="mtls")
    return CallableVerifier(lambda metadata, auth_context: holder, reads_auth_context=False)
