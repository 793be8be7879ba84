"""The engine as every way in runs a tenant's requests on it: tenancy's promises, kept once.

Three ways reach the engine: the gRPC protocols' call frame
(`servicer/engine_call.py`), vLLM's own handlers behind Pooling and Render
(`servicer/vllm_app.ClaimingEngine`) and vLLM's HTTP API
(`serve/http_guard.GuardedEngine`). Each keeps the same promises to the
tenants sharing the engine, and before they were kept here, each kept its own
copy, handed the tenancy options as loose switches:

- an engine request's id is its caller's (`claim`, the one registry);
- every cache a client names is keyed by its tenant (`keyed`: the prefix
  cache's salt, media uuids), routers' requests left as sent;
- routing data (KV and encoder-cache transfer parameters, KV hints) is a
  router's (`check_routing`);
- a request whose caller went is taken out of the engine, and its id let go
  (`run`);
- the engine's work is shared by what each tenant brings, in tokens
  (`generate`, `encode`): its requests tagged in the fair order
  (`fair_work.FairOrder`, vLLM's priority), its prompt tokens held to its
  share of those waiting for prefill (`fair_work.QueuedPrompts`), what it was
  served counted (`work`).

One `TenantEngine` per mount (`MountState.tenant`), built from the mount's
options once; the three ways hold it, so a new way in keeps the promises by
running its requests through it. No grpc and no vLLM here: each way turns the
refusals into its own answers (gRPC PERMISSION_DENIED and ALREADY_EXISTS, HTTP
403 and 409).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from ..context import current_identity, may_route, tenant_of
from ..engine import EngineClient
from ..errors import RoutingDataError, TokenShareError
from ..fair_work import TENANT_ARG, FairOrder, QueuedPrompts, WorkTicket, WorkTotals
from ..prefix_cache import salted
from .tenancy import Claim, RunningRequests

if TYPE_CHECKING:
    from vllm.outputs import PoolingRequestOutput, RequestOutput

Output = TypeVar("Output")
logger = logging.getLogger("vllm_servicer")

# vLLM's RequestOutputKind.DELTA: each output holds the new tokens only.
_DELTA = 1
# Output tokens a request's tenant is charged at once in the fair order.
_CHARGE_EVERY = 16

__all__ = ["TenantEngine"]


class TenantEngine:
    """The mount's engine, with what each tenant's request must keep.

    Args:
        engine: the engine served.
        running: the mount's registry of running request ids (shared by the
            frontend processes of `--api-server-count` through its group).
        routing_for_every_key: take routing data from every caller, not only
            routers and administrators (`MountOptions.tenancy.routing_data_for_every_key`).
        shared_prefix_cache: one prefix cache for every tenant, their prompts
            unsalted (`MountOptions.tenancy.shared_prefix_cache`); media uuids are
            keyed all the same.
        order: the fair order's counters (shared by the frontend processes
            of `--api-server-count`); default: this process's.
        queued: the prompt tokens waiting for prefill and each tenant's share
            of their limit; default: counted, never refused.
    """

    def __init__(
        self,
        engine: EngineClient,
        running: RunningRequests,
        *,
        routing_for_every_key: bool = False,
        shared_prefix_cache: bool = False,
        order: FairOrder | None = None,
        queued: QueuedPrompts | None = None,
    ) -> None:
        self.engine = engine
        self.running = running
        self._routing_for_every_key = routing_for_every_key
        self._shared_prefix_cache = shared_prefix_cache
        self.order = order if order is not None else FairOrder()
        self.queued = queued if queued is not None else QueuedPrompts(None)
        self.work = WorkTotals()
        # A token prompt past the model's context is refused by its length alone.
        max_len = getattr(getattr(engine, "model_config", None), "max_model_len", None)
        self.max_prompt_tokens: int | None = int(max_len) if max_len else None
        # vLLM orders its queue by priority only when told to; an engine in
        # arrival order (fcfs) ignores the tags, and gets them not.
        policy = scheduling_policy(engine)
        self.ordered = policy == "priority"
        if not self.ordered:
            logger.info(
                "the engine runs requests in arrival order (--scheduling-policy %s): tenants' "
                "requests are not ordered by the work each brings; start it with "
                "--scheduling-policy priority for that",
                policy,
            )

    # ----- ids ----------------------------------------------------------------

    def claim(self, request_id: str, method: str) -> Claim:
        """`request_id` claimed for the current caller, until the claim's release.

        Raises:
            RequestIdInUseError: the id runs for another caller.
        """
        return self.running.claim(request_id, method)

    # ----- caches a client names --------------------------------------------

    def keyed(self, prompt: Any, *, media: bool = True) -> Any:
        """`prompt` keyed for the current caller's tenant (`prefix_cache.salted`):
        its prefix-cache blocks and, with `media`, its media uuids its own.

        Once per request, before vLLM renders the prompt (its multimodal
        processor reads the uuids there). Without `media` the uuids are left as
        they are: a way in that keys them before vLLM renders (the HTTP API,
        in the body).
        """
        return salted(prompt, self._shared_prefix_cache, media=media)

    # ----- routing data ------------------------------------------------------

    def may_route(self) -> bool:
        """Whether the current caller may send routing data."""
        return may_route(self._routing_for_every_key)

    def check_routing(self, field: str, reason: str = "") -> None:
        """Refuse routing data (in `field`) from a caller who is no router,
        unless the mount opens it to every key.

        Raises:
            RoutingDataError: the caller has neither the router nor the admin role.
        """
        if not self.may_route():
            raise RoutingDataError(field, reason)

    # ----- a request's run ---------------------------------------------------

    async def run(
        self, claim: Claim, start: Callable[[], AsyncGenerator[Output, None]]
    ) -> AsyncGenerator[Output, None]:
        """The outputs of the engine stream `start` opens, under `claim`.

        A cancel (the caller gone, its call cancelled) takes the request out of
        the engine before the id is let go; the claim is released however the
        stream ends, an error or a close included. The engine's stream is
        closed here, not when collected, so that the engine aborts a request
        left unfinished before its id is let go.
        """
        try:
            async with contextlib.aclosing(start()) as outputs:
                async for output in outputs:
                    yield output
        except asyncio.CancelledError:
            await claim.cancelled(self.engine)
            raise
        finally:
            claim.release()

    # ----- the engine's work, shared by what each tenant brings ---------------

    def generate(self, *args: Any, **kwargs: Any) -> AsyncGenerator[RequestOutput, None]:
        """`engine.generate(prompt, sampling_params, request_id, ...)` for the current
        caller's tenant, in the fair order (arguments as the engine takes them).

        Raises:
            TokenShareError: the prompt is past the tokens waiting for prefill
                that the tenant's share (or the pool) allows.
        """
        sampling = _argument(args, kwargs, 1, "sampling_params")
        _name_tenant(sampling, tenant_of(current_identity.get()))
        return self._in_order(
            _argument(args, kwargs, 0, "prompt"),
            getattr(sampling, "output_kind", None),
            kwargs,
            lambda kw: self.engine.generate(*args, **kw),
        )

    def encode(self, *args: Any, **kwargs: Any) -> AsyncGenerator[PoolingRequestOutput, None]:
        """`engine.encode(prompt, pooling_params, request_id, ...)` for the current
        caller's tenant, in the fair order (as `generate`)."""
        return self._in_order(
            _argument(args, kwargs, 0, "prompt"),
            None,
            kwargs,
            lambda kw: self.engine.encode(*args, **kw),
        )

    def _in_order(
        self,
        prompt: object,
        kind: object,
        kwargs: dict[str, Any],
        start: Callable[[dict[str, Any]], AsyncGenerator[Output, None]],
    ) -> AsyncGenerator[Output, None]:
        identity = current_identity.get()
        name = tenant_of(identity)
        weight = identity.weight if identity is not None else 1.0
        # At most the context: a longer prompt is refused by the engine anyway.
        tokens = min(prompt_tokens(prompt), self.max_prompt_tokens or 2**31)
        # Refused here, before a stream's first message (HTTP: its status line).
        refusal = self.queued.refusal(name, weight, tokens)
        if refusal is not None:
            self._refused(name, tokens)
            raise TokenShareError(refusal)
        return self._metered(name, weight, tokens, kind, kwargs, start)

    def _refused(self, name: str | None, tokens: int) -> None:
        self.work.add(name or "", "refused_requests", 1)
        self.work.add(name or "", "refused_prompt_tokens", tokens)

    async def _metered(
        self,
        name: str | None,
        weight: float,
        tokens: int,
        kind: object,
        kwargs: dict[str, Any],
        start: Callable[[dict[str, Any]], AsyncGenerator[Output, None]],
    ) -> AsyncGenerator[Output, None]:
        # Taken at the first read: a stream never read holds nothing.
        refusal = self.queued.take(name, weight, tokens)
        if refusal is not None:
            self._refused(name, tokens)
            raise TokenShareError(refusal)
        queued, ticket, generated, charged = True, None, 0, 0
        # vLLM's RequestOutputKind by value: DELTA outputs hold new tokens only.
        delta = getattr(kind, "value", kind) == _DELTA
        try:
            ticket = self.order.admit(name, weight, tokens, kwargs.get("priority") or 0)
            if self.ordered:
                kwargs["priority"] = ticket.priority
            # Closed here, not when collected: the engine aborts an unfinished request.
            async with contextlib.aclosing(start(kwargs)) as outputs:
                async for output in outputs:
                    if queued:  # the prefill ran
                        queued = False
                        self.queued.give_back(name, weight, tokens)
                        self.order.started(ticket)
                        self._prompt_ran(ticket, output, tokens)
                    # On the path of every token: a sum, and a charge each
                    # `_CHARGE_EVERY` tokens (the counter need not move by one).
                    new = _output_tokens(output)
                    generated = generated + new if delta else new
                    if generated - charged >= _CHARGE_EVERY:
                        self.order.served(ticket, generated - charged)
                        charged = generated
                    yield output
        finally:
            if queued:
                self.queued.give_back(name, weight, tokens)
                if ticket is not None:  # no prefill ran: its prompt costs nothing
                    self.order.served(ticket, 0, -tokens)
            elif ticket is not None and generated > charged:
                self.order.served(ticket, generated - charged)
            self.work.add(name or "", "output_tokens", generated)

    def _prompt_ran(self, ticket: WorkTicket, output: object, charged: int) -> None:
        """The first output: the prompt's real cost in place of what was charged
        (a text's estimate; the prefix cache's tokens, which ran no prefill)."""
        real = len(getattr(output, "prompt_token_ids", None) or ()) or charged
        cached = min(getattr(output, "num_cached_tokens", None) or 0, real)
        self.work.add(ticket.name, "prompt_tokens", real)
        self.work.add(ticket.name, "cached_prompt_tokens", cached)
        if real - cached != charged:
            self.order.served(ticket, 0, real - cached - charged)


def _name_tenant(sampling: object, name: str | None) -> None:
    """Name the request's tenant where the engine's scheduler reads it
    (`fair_steps`: a light tenant's request joins the next step); a client's
    own value under that key is replaced."""
    if sampling is None:
        return
    extra = getattr(sampling, "extra_args", None)
    sampling.extra_args = {**(extra or {}), TENANT_ARG: name or ""}  # type: ignore[attr-defined]


def _argument(
    args: tuple[object, ...], kwargs: Mapping[str, object], index: int, name: str
) -> object:
    """An engine call's argument, by name or by place (vLLM's handlers pass names)."""
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else None


def _output_tokens(output: object) -> int:
    """Tokens in one engine output's completions (none for a pooling output)."""
    completions = getattr(output, "outputs", None)
    if not isinstance(completions, list):
        return 0
    if len(completions) == 1:
        return len(completions[0].token_ids)
    return sum(len(c.token_ids) for c in completions)


def prompt_tokens(prompt: object) -> int:
    """The tokens `prompt` brings to the prefill: its token ids' count, or for a
    text not yet tokenized an estimate (four bytes a token), at least 1."""
    if isinstance(prompt, Mapping):
        ids = prompt.get("prompt_token_ids")
        if ids is None and isinstance(prompt.get("encoder_prompt"), Mapping):
            ids = prompt["encoder_prompt"].get("prompt_token_ids")
        if ids is not None:
            return max(1, len(ids))
        text = prompt.get("prompt")
    else:
        ids = getattr(prompt, "prompt_token_ids", None)
        if ids is not None:
            return max(1, len(ids))
        text = prompt
    if isinstance(text, str):
        return max(1, len(text.encode()) // 4)
    return 1


def scheduling_policy(engine: object) -> str:
    """The engine's scheduling policy ("fcfs" or "priority"), as its config names it."""
    scheduler = getattr(getattr(engine, "vllm_config", None), "scheduler_config", None)
    policy = getattr(scheduler, "policy", "fcfs")
    return str(getattr(policy, "value", policy))
