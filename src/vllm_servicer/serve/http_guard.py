"""vLLM's HTTP API behind its engine guard (`guard.py`): its engine client, wrapped.

vLLM's OpenAI app runs every generation and embedding through the engine
client it is handed (`generate`, `encode`) and asks `check_admission` before
it answers a stream's headers. The app gets `GuardedEngine` instead of the
launcher's `AsyncLLM`: each request's id (`cmpl-<X-Request-Id>-0` and the
like) is claimed for the HTTP caller in the registry the gRPC protocols use,
and counted against `--max-inflight`, from the engine call to its end.

With keys, it also keeps what is a router's or an administrator's there, for
every route that reaches the engine: `kv_transfer_params` (vLLM puts a body's
into the sampling parameters' `extra_args`, whichever route took it) only
from a router or admin key, else 403, and the connector is not told of a
tenant's refused request; an adapter vLLM's runtime LoRA resolvers would load
for a request naming an unknown model (`add_lora`) only for an admin key.

Each request's prompt is salted for its tenant's part of the prefix cache
(`prefix_cache.py`), joined with the body's own `cache_salt`. Each
generation's sampling parameters meet the per-request budgets the gRPC
protocols check on their own messages (the stop strings, vLLM having parsed
`stop` of completions and chat alike; `n` against `--max-n`; the
structured-output constraint against `--max-constraint-bytes`, whichever
field of the body vLLM built it from: `structured_outputs`, `response_format`,
a required tool's schema), before the engine sees them. A rank pinned by
`X-data-parallel-rank` is a global rank, as the gRPC protocols' pins are
(`ranks.py`): translated for the engine, and a 400 naming the ranks served
when this server does not serve it.

Refusals take vLLM's own error mapping: an id another caller runs is a
`GracefulHTTPError` with 409 Conflict (gRPC's ALREADY_EXISTS), the in-flight
limit or the caller's fair share of it a 503, as vLLM answers its own queue
limit (`QueueOverflowError`, whose fixed message cannot name the limit), a
request past a budget a 400 naming the field (`stop: ...`) and the flag.
Asked before a stream starts they are the status line; a request that loses
a race between the check and the claim ends its stream with vLLM's error event.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator, Callable, Iterable, Iterator, Mapping
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, TypeVar

from vllm.exceptions import GracefulHTTPError

from ..budgets import RequestBudgets, encoded_size
from ..context import Identity, current_identity, priority_floor
from ..errors import (
    ROUTER_ROLE_HINT,
    InvalidRequestError,
    RequestIdInUseError,
    TableFullError,
    TokenShareError,
)
from ..guard import EngineGuard, ServerBusyError
from ..ranks import engine_index, engine_index_if_served

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest
    from vllm.outputs import PoolingRequestOutput, RequestOutput
    from vllm.pooling_params import PoolingParams
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

Output = TypeVar("Output")

__all__ = ["HTTP_CALLER", "GuardedEngine"]

HTTP_CALLER = Identity(name="http-api", kind="http")
"""Who an HTTP request runs for when the HTTP API checks no keys: one caller,
apart from every gRPC one (its ids are not theirs to share or abort)."""


class RequestIdConflictError(GracefulHTTPError):
    """The request's id runs for another caller: 409, as gRPC's ALREADY_EXISTS."""

    def __init__(self, message: str) -> None:
        super().__init__(message, HTTPStatus.CONFLICT)


# The header vLLM's routes read a pinned data-parallel rank from.
RANK_HEADER = "X-data-parallel-rank"

# What vLLM's routes hand the engine for its connectors (KV, encoder cache).
_ROUTING_FIELDS = ("kv_transfer_params", "ec_transfer_params")

# The constraint kinds of vLLM's StructuredOutputsParams that compile to a
# grammar; `choice` is a list, `json_object` a flag without a size.
_CONSTRAINT_TEXTS = ("json", "regex", "grammar", "structural_tag")


class RoutingDataForbiddenError(GracefulHTTPError):
    """`kv_transfer_params` or `ec_transfer_params` from a caller who is no router:
    403, as gRPC's PERMISSION_DENIED."""

    def __init__(self, message: str) -> None:
        super().__init__(message, HTTPStatus.FORBIDDEN)


class InflightLimitError(GracefulHTTPError):
    """`--max-inflight` requests run already, or the caller holds its share of
    them: 503, as vLLM's own queue limit."""

    def __init__(self, message: str) -> None:
        super().__init__(message, HTTPStatus.SERVICE_UNAVAILABLE)


class BudgetRefusalError(GracefulHTTPError):
    """The request passes a per-request budget: 400, as gRPC's INVALID_ARGUMENT."""

    def __init__(self, message: str) -> None:
        super().__init__(message, HTTPStatus.BAD_REQUEST)


def _constraint_size(sampling_params: SamplingParams) -> tuple[str, int] | None:
    """The sampling parameters' structured-output constraint, named as vLLM's
    field (`structured_outputs.json`), and its size in bytes, if it has one.

    The gRPC protocols measure theirs so (`wire/structured_outputs.py`): a
    text's UTF-8 bytes, all choices together. A JSON schema vLLM holds as an
    object (from `response_format`) counts as compact JSON text.
    """
    prefix = "structured_outputs"  # every release supported (0.31 on)
    params = getattr(sampling_params, prefix, None)
    if params is None:
        return None
    choice = getattr(params, "choice", None)
    if choice is not None:
        return f"{prefix}.choice", encoded_size(*(str(item) for item in choice))
    for kind in _CONSTRAINT_TEXTS:
        value = getattr(params, kind, None)
        if value is None:
            continue
        text = (
            value
            if isinstance(value, str)
            else json.dumps(value, separators=(",", ":"), default=str)
        )
        return f"{prefix}.{kind}", encoded_size(text)
    return None


@contextlib.contextmanager
def _as_http_errors() -> Iterator[None]:
    try:
        yield
    except InvalidRequestError as exc:
        raise BudgetRefusalError(str(exc)) from exc
    except RequestIdInUseError as exc:
        raise RequestIdConflictError(str(exc)) from exc
    except (ServerBusyError, TableFullError, TokenShareError) as exc:
        raise InflightLimitError(str(exc)) from exc


class GuardedEngine:
    """The engine client handed to vLLM's HTTP app: the engine, every request guarded.

    Everything but `generate`, `encode`, `abort`, `check_admission`,
    `notify_kv_transfer_request_rejected` and `add_lora` is the engine's own.

    The promises every way in keeps (ids, caches keyed by tenant, routing
    data a router's, a cancel's abort) are the mount's `TenantEngine`'s, which
    the guard holds; the rest is the HTTP API's own.

    Args:
        engine: the launcher's `AsyncLLM`.
        guard: the mount's `EngineGuard` (its `tenant`, the mount's `TenantEngine`).
        budgets: the per-request budgets the gRPC protocols keep too.
        authenticated: the HTTP API checks keys. Without keys its one caller
            is no tenant to keep apart: routing data and runtime adapter loads
            stay open, and prompts go to the engine as sent.
    """

    def __init__(
        self,
        engine: AsyncLLM,
        guard: EngineGuard,
        budgets: RequestBudgets | None = None,
        *,
        authenticated: bool = False,
    ) -> None:
        self._engine = engine
        self._guard = guard
        self.tenant = guard.tenant
        self._budgets = budgets if budgets is not None else RequestBudgets()
        self._authenticated = authenticated

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        """vLLM's admission check, the in-flight limit and the caller's share first
        (503 past any).

        `n` counts sequences (a request's `n`), the limit engine requests, as
        a gRPC Generate with `n` > 1 takes one slot: one free slot admits it.
        """
        with _as_http_errors():
            self._guard.check_room()
        self._engine.check_admission(n, request_id)

    def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams,
        request_id: str,
        *args: Any,
        **kwargs: Any,
    ) -> AsyncGenerator[RequestOutput, None]:
        # Every route that takes `kv_transfer_params` (completions, chat, responses,
        # Anthropic's messages, token generation) hands them on here.
        extra = getattr(sampling_params, "extra_args", None) or {}
        for field in _ROUTING_FIELDS:
            if extra.get(field) is not None and not self._may_route():
                raise RoutingDataForbiddenError(
                    f"{field}: connectors' transfer parameters are a router's; {ROUTER_ROLE_HINT}"
                )
        # Before the engine's output handler matches each stop string against
        # each new token, on this event loop.
        with _as_http_errors():
            self._budgets.check_stop("stop", getattr(sampling_params, "stop", None) or ())
            # vLLM takes up to 16,384 sequences in one request, one slot here.
            # (Beam search never comes here with its width: vLLM runs each
            # beam as a generation of its own, each taking its own slot.)
            self._budgets.check_n("n", getattr(sampling_params, "n", None) or 1)
            self._check_priority(kwargs)
            # The engine compiles the constraint (xgrammar), and vLLM's
            # frontend validates it first, on this event loop: a 1.7 MB schema
            # ran for 160 s and stalled every other request.
            constraint = _constraint_size(sampling_params)
            if constraint is not None:
                self._budgets.check_constraint(*constraint)
            # A pinned rank is a global one, as the gRPC protocols take it (`ranks.py`).
            rank = kwargs.get("data_parallel_rank")
            if rank is not None:
                kwargs["data_parallel_rank"] = engine_index(self._engine, rank, RANK_HEADER)
            # Its tenant's place in the fair order, its prompt within its share.
            outputs = self.tenant.generate(
                self._keyed(prompt), sampling_params, request_id, *args, **kwargs
            )
        return self._guarded("HTTP generate", request_id, lambda: outputs)

    def encode(
        self,
        prompt: Any,
        pooling_params: PoolingParams,
        request_id: str,
        *args: Any,
        **kwargs: Any,
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        with _as_http_errors():
            self._check_priority(kwargs)
            outputs = self.tenant.encode(
                self._keyed(prompt), pooling_params, request_id, *args, **kwargs
            )
        return self._guarded("HTTP encode", request_id, lambda: outputs)

    async def notify_kv_transfer_request_rejected(
        self, request_id: str, kv_transfer_params: dict[str, object], *args: Any, **kwargs: Any
    ) -> None:
        """vLLM tells the connector of a request refused before the engine ran it;
        a tenant's parameters were refused here, so there is nothing to tell (the
        connector would act on what the tenant wrote)."""
        if "data_parallel_rank" in kwargs:
            rank = kwargs["data_parallel_rank"]
            kwargs["data_parallel_rank"] = engine_index_if_served(self._engine, rank)
        if self._may_route():
            await self._engine.notify_kv_transfer_request_rejected(
                request_id, kv_transfer_params, *args, **kwargs
            )

    def _may_route(self) -> bool:
        return not self._authenticated or self.tenant.may_route()

    def _keyed(self, prompt: Any) -> Any:
        """The rendered prompt keyed for its tenant: vLLM hands it with the body's
        `cache_salt` in it, its media uuids keyed in the body before vLLM
        rendered it (`http_request_ids`)."""
        if not self._authenticated:
            return prompt
        return self.tenant.keyed(prompt, media=False)

    def _check_priority(self, kwargs: Mapping[str, Any]) -> None:
        """A tenant's `priority` (vLLM's routes hand the body's on) no lower than its
        floor (`--min-tenant-priority`, its key's `min_priority=`): 400 past it."""
        floor = priority_floor(self._budgets.min_tenant_priority)
        self._budgets.check_priority("priority", kwargs.get("priority") or 0, floor)

    async def abort(self, request_id: str | Iterable[str], *args: Any, **kwargs: Any) -> None:
        """vLLM's abort, for the caller's own requests only.

        vLLM's handlers abort the requests of a client gone, and with
        `--enable-scale-out` any key may name ids to `/inference/v1/abort_requests`:
        a tenant stops only what it started, in whichever process runs it, as
        with gRPC's Abort; another's id is left out like an unknown one.
        Without keys there is one caller, and every id is its own.
        """
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if not self._authenticated:
            await self._engine.abort(ids, *args, **kwargs)
            return
        await self._guard.running.abort(self._engine, ids)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """An adapter into the engine: with keys, for an administrator only.

        vLLM's admin route (`/v1/load_lora_adapter`, already an admin key's)
        and its runtime LoRA resolvers, which load an adapter for any request
        naming an unknown model (`VLLM_ALLOW_RUNTIME_LORA_UPDATING` with a
        resolver plugin), come here: an adapter is the engine's, every
        tenant's. vLLM answers the request 400 when no resolver's adapter loads.
        """
        identity = current_identity.get()
        if self._authenticated and identity is not None and not identity.is_admin:
            raise PermissionError(
                f"{identity.name!r} may not load adapter {lora_request.lora_name!r}: "
                "only an admin key loads adapters"
            )
        return await self._engine.add_lora(lora_request)

    def _guarded(
        self, method: str, request_id: str, start: Callable[[], AsyncGenerator[Output, None]]
    ) -> AsyncGenerator[Output, None]:
        # Checked at once: vLLM calls this before it answers a stream's
        # headers, so a refusal is the status line, not an event in a 200.
        with _as_http_errors():
            self._guard.check(request_id, method)
        return self._held(method, request_id, start)

    async def _held(
        self, method: str, request_id: str, start: Callable[[], AsyncGenerator[Output, None]]
    ) -> AsyncGenerator[Output, None]:
        # Held from the first read (a generator never read holds nothing)
        # until it ends, fails or is closed (vLLM's handler closes it when
        # the client goes). The engine's stream is closed here, so that the
        # engine aborts the request before the id and slot are let go.
        with contextlib.ExitStack() as held:
            with _as_http_errors():
                claim = held.enter_context(self._guard.hold(request_id, method))
            async for output in self.tenant.run(claim, start):
                yield output
