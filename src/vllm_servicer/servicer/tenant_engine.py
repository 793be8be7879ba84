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
  (`run`).

One `TenantEngine` per mount (`MountState.tenant`), built from the mount's
options once; the three ways hold it, so a new way in keeps the promises by
running its requests through it. No grpc and no vLLM here: each way turns the
refusals into its own answers (gRPC PERMISSION_DENIED and ALREADY_EXISTS, HTTP
403 and 409).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable
from typing import Any

from ..context import may_route
from ..errors import RoutingDataError
from ..prefix_cache import salted
from .tenancy import Claim, RunningRequests

__all__ = ["TenantEngine"]


class TenantEngine:
    """The mount's engine, with what each tenant's request must keep.

    Args:
        engine: the engine served.
        running: the mount's registry of running request ids (shared by the
            frontend processes of `--api-server-count` through its group).
        routing_for_every_key: take routing data from every caller, not only
            routers and administrators (`MountOptions.routing_data_for_every_key`).
        shared_prefix_cache: one prefix cache for every tenant, their prompts
            unsalted (`MountOptions.shared_prefix_cache`); media uuids are
            keyed all the same.
    """

    def __init__(
        self,
        engine: Any,
        running: RunningRequests,
        *,
        routing_for_every_key: bool = False,
        shared_prefix_cache: bool = False,
    ) -> None:
        self.engine = engine
        self.running = running
        self._routing_for_every_key = routing_for_every_key
        self._shared_prefix_cache = shared_prefix_cache

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
        self, claim: Claim, start: Callable[[], AsyncGenerator[Any, None]]
    ) -> AsyncGenerator[Any, None]:
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
