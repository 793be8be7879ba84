"""The front of vLLM's HTTP API: keys, a call slot, the body's bounds and ids,
checked on every request before vLLM's app sees it.

vLLM's app serves each route in a handler of its own; a pure ASGI wrapper in
front of it (`Front`) is the one point every request passes, whichever route
it names.

Keys: the gRPC side's verifier (the very same object, so key files re-read on
change apply to both) checks `Authorization: Bearer <key>` on every path but
the probes (`/health`, `/ping`). Any valid key reaches the inference paths
(`/v1/...`, `/tokenize`, ...) and `/metrics`; every other path (vLLM's
`/pause`, `/abort_requests`, `/start_profile`, ...) and the runtime LoRA routes
(`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`) need an admin key, as the
gRPC admin methods do. With vLLM's Responses store on
(`VLLM_ENABLE_RESPONSES_API_STORE=1`), the Responses API (`/v1/responses...`)
needs an admin key too: the store keeps each response under its id (which
the client may choose) for whoever asks, to read, cancel or continue. vLLM's
own `--api-key` middleware is not used: it takes a fixed key list and guards
`/v1` alone.

Call slots: every request but the probes and the GETs of fixed facts holds
one of the gRPC side's call slots (`--max-concurrent-rpcs`, each tenant its
fair share, the same pool) from its key check until its handler ends, so
parsing, templating and tokenizing count as a gRPC call's do; refused 503 with
`Retry-After`. Bodies are bounded by `--max-message-bytes` (413) and must
arrive within `--request-read-timeout` (408), as a gRPC call's message must;
`/tokenize` and `/detokenize` meet Render's budgets (`http_budgets.py`).

Request ids: the `X-Request-Id` header and a JSON body's `request_id` are
checked as gRPC's are (`http_request_ids.py`) before vLLM's handlers copy them.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..budgets import RequestBudgets
from ..context import Identity, current_identity
from ..interceptors._call import ClientWait, WaitWatch, client_wait
from ..interceptors.auth import AuthError, Unauthenticated
from ..interceptors.call_slots import CallSlotsInterceptor, CallSlotsRefused
from ..prefix_cache import keyed_tenant
from . import http_request_ids as request_ids
from .http_asgi import App, Message, Receive, Scope, Send, headers_of
from .http_guard import HTTP_CALLER

if TYPE_CHECKING:
    from ..interceptors.verifiers import Verifier

__all__ = ["Front"]

# The HTTP API's logger name, which operators' log filters already select.
logger = logging.getLogger("vllm_servicer.serve.http_api")

# Probes carry no keys (the gRPC health service is exempt too).
_PUBLIC_PATHS = frozenset({"/health", "/ping"})
# vLLM's Prometheus page (and what is mounted under it): with keys, any key's;
# without keys, everyone's as before. It needs a key because the page is built on the serving
# event loop, one registry walk per scrape, and tells the load and the served
# adapters to whoever asks; any role will do because it names no tenant's
# prompts or ids, and a keyed caller is told the load anyway (GetLoads, the ORCA
# reports), so a scraper needs no admin powers. Scrapers without a key have the
# gRPC side's --metrics-port, the same series on a port of its own.
_METRICS = "/metrics"
# vLLM's own guarded prefixes plus its other per-request endpoints.
_INFERENCE_PREFIXES = ("/v1/", "/v2/", "/inference/", "/cohere/")
_INFERENCE_PATHS = frozenset(
    {
        "/tokenize",
        "/detokenize",
        "/tokenizer_info",
        "/pooling",
        "/classify",
        "/score",
        "/rerank",
        "/invocations",
        "/load",
        "/version",
    }
)

# GETs that answer fixed facts, at no cost: outside the call slots, as the
# probes are. Every other request (tokenizing, rendering, generating, pooling)
# holds one from its key check to its handler's end. The metrics page too is
# outside them: a scrape reads no body and runs to its end in one step of the
# loop, so a slot would bound nothing, and a scraper refused 503 while the
# slots are full would lose sight of the server when it matters most.
_FREE_GETS = frozenset({"/v1/models", "/version"})
_RETRY_AFTER_S = 1  # gRPC's refusal sends a 1 s retry pushback too

# vLLM's runtime LoRA routes (VLLM_ALLOW_RUNTIME_LORA_UPDATING=1) sit under
# /v1/ but change the engine for every tenant, as vllm.Control's LoadLora does:
# admin keys only.
_ADMIN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
# vLLM's Responses store (VLLM_ENABLE_RESPONSES_API_STORE=1) keeps every
# response for whoever names its id (GET, cancel, previous_response_id), with
# no owner: admin keys only while it is on.
_RESPONSES_PREFIX = "/v1/responses"


def _json(
    status: int,
    body: Mapping[str, object],
    *,
    headers: list[tuple[bytes, bytes]] | None = None,
    close: bool = False,
) -> tuple[Message, Message]:
    payload = json.dumps(body).encode()
    start: Message = {
        "type": "http.response.start",
        "status": status,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(payload)),
            *(headers or ()),
            # A body left unread: the connection cannot carry another request.
            *([(b"connection", b"close")] if close else ()),
        ],
    }
    return start, {"type": "http.response.body", "body": payload}


class Front:
    """Pure ASGI wrapper in front of vLLM's app: drain state of /health, keys,
    a call slot, then the body (its size, its read deadline, its ids, and the
    render budgets of `/tokenize` and `/detokenize`).

    Args:
        app: vLLM's app.
        verifier: the key verifier, or None for no keys.
        slots: the gRPC side's call slots (`--max-concurrent-rpcs`), one pool
            for both protocols, and their read deadline (`--request-read-timeout`),
            which a request's body meets too; None: no slots taken, no deadline.
        max_body_bytes: the largest request body (`--max-message-bytes`); None: any.
        budgets: the per-request budgets `/tokenize` and `/detokenize` meet;
            None: not checked here.
    """

    def __init__(
        self,
        app: App,
        verifier: Verifier | None,
        slots: CallSlotsInterceptor | None = None,
        max_body_bytes: int | None = None,
        budgets: RequestBudgets | None = None,
    ) -> None:
        from vllm import envs

        self.app = app
        self.verifier = verifier
        self.slots = slots
        self.max_body_bytes = max_body_bytes
        self.budgets = budgets
        # One watch for every request's answer: one deadline, so one timer.
        self._writes = None if slots is None else WaitWatch(slots.write_deadline(""))
        self.draining = False
        self.responses_stored = bool(envs.VLLM_ENABLE_RESPONSES_API_STORE)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path = str(scope["path"]).removeprefix(str(scope.get("root_path", "")))
        if self.draining and path == "/health":
            # Balancers probing HTTP stop sending, as gRPC probes see NOT_SERVING.
            await self._refuse(scope, send, 503, "draining")
            return
        caller: Identity | None = HTTP_CALLER
        if self.verifier is not None and not _public(path):
            refusal, caller = await self._check(self.verifier, scope, path)
            if refusal is not None:
                await self._refuse(scope, send, *refusal)
                return
        # Whom the call slot and the engine guard count this request for
        # (http_guard.py); without keys, no tenant (gRPC's keyless rule).
        token = current_identity.set(caller if self.verifier is not None else None)
        try:
            slots, held = self.slots, None
            # Every answer is taken within the write deadline, a probe's too: a
            # connection whose client stops reading is not held for ever.
            wait = client_wait() if self._writes is not None else None
            if slots is not None and not _costless(scope, path):
                # Before the body is read: a body sent slowly holds this slot,
                # one of its tenant's share, not one of everyone's, and loses
                # it to another tenant wanting the full pool once it stalls.
                wait = wait or client_wait()
                try:
                    held = slots.hold(wait)
                except CallSlotsRefused as exc:
                    await self._busy(scope, send, str(exc))
                    return
            current_identity.set(caller)
            try:
                if wait is not None and self._writes is not None:
                    send = _taken_in_time(send, self._writes, wait)
                await self._serve(scope, path, receive, send, wait)
            except asyncio.CancelledError:
                # Its client took no part of the answer in time (or its slot went
                # to another tenant meanwhile): nothing more can be sent to it.
                if wait is None or not wait.expired or wait.task is None or wait.task.uncancel():
                    raise
                logger.info("HTTP %s ended: %s", path, wait.reason or "response not taken in time")
            finally:
                if held is not None:
                    held.release()
        finally:
            current_identity.reset(token)

    async def _serve(
        self, scope: Scope, path: str, receive: Receive, send: Send, wait: ClientWait | None = None
    ) -> None:
        if not _public(path):
            # After the key (nothing is read for a caller refused), before
            # vLLM's handler copies the id into each engine request's. The
            # body is read here, under the slot just taken: within the gRPC
            # calls' read deadline, or 408 and the slot back (a body that
            # stalls would hold it for ever, its connection too).
            deadline = None if self.slots is None else self.slots.read_deadline(path)
            refused, receive = await request_ids.checked(
                scope,
                receive,
                self.max_body_bytes,
                read_deadline=deadline,
                wait=wait,
                budgets=self.budgets,
                media_tenant=keyed_tenant(),
                path=path,
            )
            if refused is not None:
                status, body = refused
                if scope["type"] == "websocket":
                    await self._refuse(scope, send, status, body["error"]["message"])
                else:
                    # A body left unread (413, 408) ends its connection.
                    close = status in request_ids.UNREAD_BODY
                    for event in _json(status, body, close=close):
                        await send(event)
                return
        await self.app(scope, receive, send)

    async def _busy(self, scope: Scope, send: Send, message: str) -> None:
        if scope["type"] == "websocket":
            await self._refuse(scope, send, 503, message)
            return
        body = request_ids.error_body(None, message, 503, "ServiceUnavailableError")
        headers = [(b"retry-after", b"%d" % _RETRY_AFTER_S)]
        for event in _json(503, body, headers=headers):
            await send(event)

    async def _check(
        self, verifier: Verifier, scope: Scope, path: str
    ) -> tuple[tuple[int, str] | None, Identity | None]:
        metadata = [
            ("authorization", value.decode("latin-1"))
            for name, value in headers_of(scope)
            if name == b"authorization"
        ]
        try:
            identity = await verifier(metadata, {})
        except Unauthenticated:
            return (401, "Unauthorized"), None
        except AuthError:
            return (403, "Forbidden"), None
        if identity.is_admin:
            return None, identity
        if not _inference(path):
            return (403, "Forbidden: this path needs an admin key"), None
        if self.responses_stored and path.startswith(_RESPONSES_PREFIX):
            return (
                403,
                "Forbidden: with VLLM_ENABLE_RESPONSES_API_STORE on, the Responses API needs "
                "an admin key (stored responses are anyone's who names their id)",
            ), None
        return None, identity

    @staticmethod
    async def _refuse(scope: Scope, send: Send, status: int, message: str) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation
            return
        for event in _json(status, {"error": message}):
            await send(event)


def _taken_in_time(send: Send, watch: WaitWatch, wait: ClientWait) -> Send:
    """`send` with each part of the response body taken by the client within
    `watch`'s deadline (`--response-write-timeout`), its wait marked meanwhile.

    uvicorn's send waits while the connection's buffers are full: a client
    that stops reading (or a slow one, past the deadline) leaves it waiting,
    the request's slots with it. Past the deadline the request's task is
    cancelled, and its handler closed (the engine aborts its requests).
    """

    async def send_in_time(message: Message) -> None:
        if message["type"] != "http.response.body":
            await send(message)
            return
        watch.begin(wait)
        try:
            await send(message)
        finally:
            watch.end(wait)

    return send_in_time


def _costless(scope: Scope, path: str) -> bool:
    """A request that takes no call slot: the probes, the GETs of fixed facts
    and the metrics page."""
    if _public(path):
        return True
    if scope["type"] != "http" or scope.get("method") != "GET":
        return False
    return path in _FREE_GETS or _metrics(path)


def _public(path: str) -> bool:
    return path in _PUBLIC_PATHS


def _metrics(path: str) -> bool:
    return path == _METRICS or path.startswith(_METRICS + "/")


def _inference(path: str) -> bool:
    """A path any key reaches (the rest need an admin key)."""
    if path.rstrip("/") in _ADMIN_PATHS:
        return False
    return path.startswith(_INFERENCE_PREFIXES) or path in _INFERENCE_PATHS or _metrics(path)
