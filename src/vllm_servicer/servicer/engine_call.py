"""The steps every gRPC protocol takes to prepare one `engine.generate` call.

VllmEngine's Generate and vllm.Inference's Generate and GenerateStream read
different messages but make the same engine call, and the engine asks the
same of each: an id claimed for its caller, no seeded sampling an engine set
up so cannot survive, a token prompt within the model's context, KV transfer
parameters from a router only and for a KV connector, token prompts rendered here and images
that fit their placeholders, the prompt salted for its tenant's part of the prefix cache.
`EngineCallSteps` takes each step once; a protocol's own code only turns
its messages into vLLM's objects and back, naming its own fields in the
refusals.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import vllm_releases
from ..budgets import check_request_id
from ..context import current_request_id, may_route
from ..engine import EngineClient, require_engine
from ..errors import InvalidRequestError, RoutingDataError, UnsupportedError
from ..prefix_cache import salted
from ..wire import fields
from .tenancy import RunningRequests

# isort: split
from vllm.sampling_params import RequestOutputKind

if TYPE_CHECKING:
    from vllm.sampling_params import SamplingParams

logger = logging.getLogger("vllm_servicer")


class EngineCallSteps:
    """The engine call's preparation common to every protocol, over one engine.

    One per mount, shared by its protocols' servicers: the seed hazard is
    warned about once, and an id is claimed in the one registry whichever
    protocol runs it.

    Args:
        engine: the engine served.
        running: the mount's registry of running request ids (the one its
            `EngineGuard` holds; a gRPC call's in-flight slot is taken by the
            in-flight interceptor, so the claim is all the guard adds here).
        stream_interval: the tokens a streamed generation's message gathers
            (`MountOptions.stream_interval`), from `min_inflight` engine calls
            in flight on, as `in_flight` counts them.
        routing_for_every_key: take KV transfer parameters from every caller,
            not only routers and administrators
            (`MountOptions.routing_data_for_every_key`).
        shared_prefix_cache: leave tenants' prompts unsalted, one prefix cache
            for all (`MountOptions.shared_prefix_cache`).

    Raises:
        TypeError: `engine` lacks a member of `EngineClient` (the message names it).
        ValueError: a stream interval above 1 on a vLLM release that takes none per request.
    """

    def __init__(
        self,
        engine: EngineClient,
        running: RunningRequests,
        *,
        stream_interval: int = 1,
        min_inflight: int = 0,
        in_flight: Callable[[], int] | None = None,
        routing_for_every_key: bool = False,
        shared_prefix_cache: bool = False,
    ) -> None:
        require_engine(engine)  # a TypeError naming what it lacks, not an AttributeError
        self._engine = engine
        self.running = running
        if stream_interval > 1 and not vllm_releases.PER_REQUEST_STREAM_INTERVAL:
            raise ValueError(
                "stream_interval needs a vLLM whose SamplingParams takes one per request "
                "(0.32 does); on this release use the engine's own --stream-interval"
            )
        self._stream_interval = stream_interval
        self._min_inflight = min_inflight
        self._in_flight = in_flight if in_flight is not None else running.__len__
        self._routing_for_every_key = routing_for_every_key
        self._shared_prefix_cache = shared_prefix_cache
        # A token prompt past the model's context is refused by its length alone.
        max_len = getattr(engine.model_config, "max_model_len", None)
        self.max_prompt_tokens: int | None = int(max_len) if max_len else None
        config = engine.vllm_config
        # Prefill/decode hand-off needs a KV connector in the engine (--kv-transfer-config);
        # encoder-cache hand-off an EC one (--ec-transfer-config).
        self.kv_connector = getattr(config, "kv_transfer_config", None) is not None
        self.ec_connector = getattr(config, "ec_transfer_config", None) is not None
        # A seeded sampling request would kill an engine set up so (a vLLM CPU fault).
        self._seed_hazard = vllm_releases.seeded_sampling_hazard(config)
        if self._seed_hazard is not None:
            logger.warning(
                "seeded sampling requests will be refused: on this CPU engine %s, and vLLM's "
                "CPU generator cannot rewind a split prompt's draw (the engine would die); "
                "start it with enable_chunked_prefill=False (--no-enable-chunked-prefill)",
                self._seed_hazard,
            )
        # vLLM's renderer turns a token prompt into engine input synchronously.
        self._render = engine.renderer.process_for_engine

    # ----- the request id ---------------------------------------------------

    def claim(self, given: str, prefix: str, method: str) -> str:
        """The request's engine id (one made up when empty), claimed for the caller.

        Release it with `release` however the request ends.

        Raises:
            InvalidRequestError: the id has a control character.
            RequestIdInUseError: the id runs for another caller.
        """
        # vLLM needs an id; a client that sent none cannot abort it by id anyway.
        request_id = given or f"{prefix}-{uuid.uuid4().hex}"
        check_request_id("request_id", request_id)
        current_request_id.set(request_id)
        self.running.claim(request_id, method)
        return request_id

    def release(self, request_id: str) -> None:
        """One run of `request_id`, claimed by `claim`, ended."""
        self.running.release(request_id)

    async def cancelled(self, request_id: str) -> None:
        """The call running `request_id` was cancelled: its request leaves the
        engine, wherever vLLM was in starting it (before `release`)."""
        await self.running.abort_cancelled(self._engine, request_id)

    # ----- the checks -------------------------------------------------------

    def check_kv_transfer(self, field: str) -> None:
        """Refuse KV transfer parameters (in `field`) from a caller who is no router,
        or that the engine has no connector for.

        The role comes first: a tenant's parameters would make a prefill engine
        hold blocks, or a decode engine connect to a host the tenant names.

        Raises:
            RoutingDataError: the caller has neither the router nor the admin role
                (PERMISSION_DENIED), and the mount does not open them to every key.
            UnsupportedError: the engine runs no KV connector.
        """
        self.check_routing(field)
        if not self.kv_connector:
            raise UnsupportedError(fields.KV_CONNECTOR_HINT, field=field)

    def check_routing(self, field: str) -> None:
        """Refuse connector parameters (in `field`: KV or encoder-cache transfer)
        from a caller who is no router, unless the mount opens them to every key.

        Raises:
            RoutingDataError: the caller has neither the router nor the admin role.
        """
        if not may_route(self._routing_for_every_key):
            raise RoutingDataError(field)

    def check_seed(self, sampling: SamplingParams, field: str) -> None:
        """Refuse sampling (its seed in `field`) that would stop this engine."""
        if self._seed_hazard and vllm_releases.draws_from_own_generator(sampling):
            raise UnsupportedError(
                f"seeded sampling would stop this CPU engine ({self._seed_hazard}); "
                "send no seed, a temperature of 0, or serve with --no-enable-chunked-prefill",
                field=field,
            )

    def pace(self, sampling: SamplingParams) -> None:
        """Let a streamed generation's messages gather the mount's stream interval
        of tokens, when the engine calls in flight reach its threshold.

        vLLM holds the request's outputs until that many new tokens are ready
        (its own per-request `stream_interval`, never below the engine's), so
        the serving process builds, wakes for and sends fewer messages.
        """
        if (
            self._stream_interval > 1
            and sampling.output_kind == RequestOutputKind.DELTA
            and self._in_flight() >= self._min_inflight
        ):
            sampling.stream_interval = max(self._stream_interval, sampling.stream_interval or 1)

    def prompt_limit(self, truncating: bool) -> int | None:
        """The longest token prompt to accept: none when the engine truncates it."""
        # With truncation asked for, a longer prompt is the engine's to cut.
        return None if truncating else self.max_prompt_tokens

    # ----- the prefix cache ------------------------------------------------

    def salted(self, prompt: Any) -> Any:
        """The engine's prompt salted for the caller's tenant (`prefix_cache.salted`):
        its prefix cache blocks are then found by its own requests only."""
        return salted(prompt, self._shared_prefix_cache)

    # ----- rendering --------------------------------------------------------

    def render_tokens(self, prompt: Any) -> Any:
        """A token prompt (no images, no truncation) as engine input.

        Token ids need no tokenizer: rendered here, which spares the engine's
        hop through a worker thread. The engine still validates the result.
        """
        return self._render(prompt, time.time())

    async def render_with_images(self, prompt: Any, field: str) -> Any:
        """A token prompt with images (`field`) as engine input, off the event loop.

        Raises:
            InvalidRequestError: the images do not fit the prompt's placeholders.
        """
        try:
            # As the engine would; rendered here, a mismatch is named as the
            # request's fault (vLLM asserts it, which would read as internal).
            return await self._engine.renderer.process_for_engine_async(prompt, time.time())
        except (AssertionError, RuntimeError, ValueError) as exc:
            raise InvalidRequestError(
                field, f"the images do not fit the prompt's placeholders: {exc}"
            ) from exc

    # ----- failure ----------------------------------------------------------

    async def kv_transfer_rejected(
        self, request_id: str, kv_transfer: dict[str, Any], rank: int | None
    ) -> None:
        """Tell the KV connector a remote-prefill request failed before the engine ran it.

        The prefill side holds the request's blocks until the decode side takes
        them; without this they stay pinned until the connector's lease expires.
        A cancelled call is not reported: once the engine holds the request, its
        abort runs the connector's hook itself. A request without
        `do_remote_prefill` holds nothing; a failure to tell is logged. Nor
        are the parameters of a caller who may not send them (refused as
        such): the connector would act on what that caller wrote.
        """
        if not self.kv_connector or not kv_transfer.get("do_remote_prefill"):
            return
        if not may_route(self._routing_for_every_key):
            return
        try:
            await self._engine.notify_kv_transfer_request_rejected(
                request_id, kv_transfer, data_parallel_rank=rank
            )
        except Exception:
            logger.warning(
                "could not tell the KV connector that request %r was rejected",
                request_id,
                exc_info=True,
            )
