"""One engine call, whichever gRPC protocol asks for it: its preparation's
shared steps, its shape and its frame.

VllmEngine's Generate and Embed and vllm.Inference's Generate and
GenerateStream read different messages but make the same engine call, and
the engine asks the same of each: an id claimed for its caller, no seeded
sampling an engine set up so cannot survive, a token prompt within the
model's context, KV transfer parameters from a router only and for a KV
connector, token prompts rendered here and images that fit their
placeholders, the prompt salted for its tenant's part of the prefix cache.
`EngineCallSteps` takes each step once; `EngineCall` is what a protocol's
preparation makes of its request; `CallFrame` is what every handler opens
with and closes with (the summary, the claim, the images' account, a
cancel's abort, the KV connector told of a failure, the protocol's failure
mapping, every release). A protocol's own code only turns its messages into
vLLM's objects and back, naming its own fields in the refusals.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from .. import vllm_releases
from ..budgets import RequestBudgets, check_request_id
from ..context import current_request_id, engine_trace_headers, kept_usage
from ..engine import EngineClient, require_engine
from ..errors import InvalidRequestError, UnsupportedError
from ..multimodal.decoded import DecodedMedia, RequestMedia
from ..ranks import engine_index, engine_index_if_served
from ..wire import fields
from ..wire.usage import GenerationUsage, RequestSummary
from .lora import AdapterHold
from .tenancy import Claim
from .tenant_engine import TenantEngine

# isort: split
from vllm.exceptions import VLLMClientError
from vllm.sampling_params import RequestOutputKind

if TYPE_CHECKING:
    from vllm.sampling_params import SamplingParams

logger = logging.getLogger("vllm_servicer")

Builder = TypeVar("Builder")
Built = TypeVar("Built", covariant=True)


@dataclasses.dataclass(slots=True)
class EngineCall(Generic[Builder]):
    """One request as the `engine.generate` call it asks for, whichever protocol sent it.

    Attributes:
        prompt: the engine's prompt (salted; rendered here where it can be).
        sampling: its sampling parameters.
        kwargs: `engine.generate`'s other keyword arguments.
        builder: the protocol's response builder for the request.
        adapter: the LoRA adapter held for the request, released by its frame.
    """

    prompt: Any
    sampling: SamplingParams
    kwargs: dict[str, Any]
    builder: Builder
    adapter: AdapterHold | None = None


class GenerationReader(Protocol[Built]):
    """One protocol's generation request, as the one preparation reads it
    (`EngineCallSteps.prepare`).

    Each protocol reads its own message and names its own fields in its
    refusals; the order of the steps is the preparation's, the same for
    every protocol. A new generation protocol is one reader and one wire module.
    """

    seed_field: str
    """The field a refusal of seeded sampling names."""

    def refuse_unserved(self) -> None:
        """Refuse the fields this server does not serve (UnimplementedFieldError)."""
        ...

    def check_budgets(self) -> None:
        """Refuse what passes a budget or names what is not served (stop strings,
        sequences, the constraint's size, the model, client ids, the priority floor)."""
        ...

    def pinned_rank(self) -> tuple[int | None, str]:
        """The global data-parallel rank the request pins (None: any), and the
        field or header that names it."""
        ...

    def routing_data(self) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """The connectors' parameters for the engine's `extra_args`, each checked
        against the caller's role and the engine's connectors, and the KV ones alone."""
        ...

    def sampling(self, extra_args: dict[str, Any]) -> SamplingParams:
        """vLLM's sampling parameters for the request."""
        ...

    def engine_kwargs(self, sampling: SamplingParams) -> dict[str, Any]:
        """The protocol's own `engine.generate` arguments (a release's fields, the
        client's priority, its session), completing `sampling` where they need it."""
        ...

    def tokenization(self) -> dict[str, Any] | None:
        """The tokenizer's arguments when the engine is to tokenize (truncation)."""
        ...

    def prompt(self, limit: int | None) -> Any:
        """The request's prompt: a text, or its token ids within `limit`."""
        ...

    async def with_media(self, prompt: Any, media: RequestMedia | None) -> tuple[Any, str | None]:
        """`prompt` with the request's images, not yet rendered, and the field
        that names them (None: no images); "" for an engine input the client
        rendered itself (a router's processor output)."""
        ...

    def builder(self) -> Built:
        """The protocol's response builder for the request."""
        ...

    def adapter(self) -> AdapterHold | None:
        """The LoRA adapter held for the request (None: the base model)."""
        ...


class EngineCallSteps:
    """The engine call's preparation common to every protocol, over one engine.

    One per mount, shared by its protocols' servicers: the seed hazard is
    warned about once, and an id is claimed in the one registry whichever
    protocol runs it.

    Args:
        tenant: the engine served, with tenancy's promises (`TenantEngine`):
            ids claimed, caches keyed and routing data checked there, as on
            every other way in (a gRPC call's in-flight slot is taken by the
            in-flight interceptor, so the claim is all a frame takes).
        stream_interval: the tokens a streamed generation's message gathers
            (`MountOptions.streaming.stream_interval`), from `min_inflight` engine calls
            in flight on, as `in_flight` counts them.
        decoded_media: the decoded images the process holds for running
            requests, and their budget (a frame opens each request's account).

    Raises:
        TypeError: `engine` lacks a member of `EngineClient` (the message names it).
        ValueError: a stream interval above 1 on a vLLM release that takes none per request.
    """

    def __init__(
        self,
        tenant: TenantEngine,
        *,
        stream_interval: int = 1,
        min_inflight: int = 0,
        in_flight: Callable[[], int] | None = None,
        decoded_media: DecodedMedia | None = None,
    ) -> None:
        engine: EngineClient = tenant.engine
        require_engine(engine)  # a TypeError naming what it lacks, not an AttributeError
        self.tenant = tenant
        self.engine = engine
        self.running = running = tenant.running
        self.decoded_media = (
            decoded_media if decoded_media is not None else DecodedMedia(RequestBudgets())
        )
        if stream_interval > 1 and not vllm_releases.PER_REQUEST_STREAM_INTERVAL:
            raise ValueError(
                "stream_interval needs a vLLM whose SamplingParams takes one per request "
                "(0.32 does); on this release use the engine's own --stream-interval"
            )
        self._stream_interval = stream_interval
        self._min_inflight = min_inflight
        self._in_flight = in_flight if in_flight is not None else running.__len__
        # A token prompt past the model's context is refused by its length alone.
        self.max_prompt_tokens = tenant.max_prompt_tokens
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

    # ----- the request id and the frame -------------------------------------

    def claim(self, given: str, prefix: str, method: str) -> Claim:
        """The request's engine id (one made up when empty), claimed for the caller.

        Release the claim however the request ends (a `CallFrame` does).

        Raises:
            InvalidRequestError: the id has a control character.
            RequestIdInUseError: the id runs for another caller.
        """
        # vLLM needs an id; a client that sent none cannot abort it by id anyway.
        request_id = given or f"{prefix}-{uuid.uuid4().hex}"
        check_request_id("request_id", request_id)
        current_request_id.set(request_id)
        return self.tenant.claim(request_id, method)

    def frame(
        self,
        summary: RequestSummary,
        given: str,
        prefix: str,
        method: str,
        *,
        failure: Callable[[Exception], Exception] | None = None,
        images: bool = True,
    ) -> CallFrame:
        """The frame of one engine call (`CallFrame`), to enter with `async with`.

        Args:
            summary: what the request asks for, in no protocol's terms.
            given: the request's id as sent ("" for one made up).
            prefix: what a made-up id starts with.
            method: the RPC, for the log.
            failure: the protocol's mapping of an engine's `ValueError` to the
                request field at fault (its structured output), if any.
            images: whether the request may hold decoded images.
        """
        return CallFrame(self, summary, given, prefix, method, failure, images)

    # ----- the one preparation ---------------------------------------------

    async def prepare(
        self, reader: GenerationReader[Built], frame: CallFrame, context: Any
    ) -> EngineCall[Built]:
        """The `engine.generate` call a request asks for, each step once and in
        one order for every protocol.

        Refused fields, budgets, the pinned rank and the routing data first;
        from there on the KV connector is told of a failure. Then sampling,
        its seed and pace, the prompt within its limit, its images, the
        tenant's salt (before vLLM renders it: its processor reads the media
        uuids then), the render, the trace, and the adapter last, with nothing
        after it to fail.

        Raises:
            UnimplementedFieldError, InvalidRequestError, NotFoundError,
                UnsupportedError: the request asks for what this server or
                engine cannot do, is malformed, or passes a budget.
            RoutingDataError: routing data from a caller who is no router.
            BudgetFullError: the process's decoded-media budget is full.
        """
        reader.refuse_unserved()
        reader.check_budgets()
        rank, rank_field = reader.pinned_rank()
        extra_args, kv_transfer = reader.routing_data()
        # The KV connector is told of a failure from here on, on every protocol.
        frame.kv_transfer, frame.rank = kv_transfer, engine_index_if_served(self.engine, rank)
        kwargs: dict[str, Any] = {}
        if rank is not None:  # a global rank; the engine takes its own index
            kwargs["data_parallel_rank"] = engine_index(self.engine, rank, rank_field)
        sampling = reader.sampling(extra_args)
        kwargs.update(reader.engine_kwargs(sampling))
        self.check_seed(sampling, reader.seed_field)
        self.pace(sampling)
        tokenization = reader.tokenization()
        if tokenization is not None:  # the engine renders it, truncating it first
            kwargs["tokenization_kwargs"] = tokenization
        prompt = reader.prompt(self.prompt_limit(tokenization is not None))
        prompt, images = await reader.with_media(prompt, frame.media)
        prompt = self.salted(prompt)
        if tokenization is None and images != "":
            if images is not None:
                prompt = await self.render_with_images(prompt, images)
            elif not isinstance(prompt, str) and "prompt_token_ids" in prompt:
                prompt = self.render_tokens(prompt)
        trace = engine_trace_headers(context)
        if trace is not None:
            kwargs["trace_headers"] = trace
        builder = reader.builder()
        adapter = reader.adapter()
        if adapter is not None and adapter.request is not None:
            kwargs["lora_request"] = adapter.request
        return EngineCall(prompt, sampling, kwargs, builder, adapter)

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

    def check_routing(self, field: str, reason: str = "") -> None:
        """Refuse routing data (in `field`: KV or encoder-cache transfer
        parameters, KV hints) from a caller who is no router, unless the mount
        opens them to every key.

        Args:
            field: the request field.
            reason: what the refusal says (`RoutingDataError`'s default: the
                connectors' parameters, and the role they need).

        Raises:
            RoutingDataError: the caller has neither the router nor the admin role.
        """
        self.tenant.check_routing(field, reason)

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
        return self.tenant.keyed(prompt)

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
            return await self.engine.renderer.process_for_engine_async(prompt, time.time())
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
        if not self.tenant.may_route():
            return
        try:
            await self.engine.notify_kv_transfer_request_rejected(
                request_id, kv_transfer, data_parallel_rank=rank
            )
        except Exception:
            logger.warning(
                "could not tell the KV connector that request %r was rejected",
                request_id,
                exc_info=True,
            )


class CallFrame:
    """What every protocol's engine call opens with and closes with: an async context manager.

    Entered: the request's neutral summary into the call record (what tracing
    and metrics read), its id claimed for the caller (`EngineCallSteps.claim`),
    an account of its decoded images opened. Left however the call ends: a
    cancelled call's request taken out of the engine (vLLM aborts nothing when
    the cancel lands while it hands the request to its engine core); a failure
    before the engine's first output told to the KV connector, then restated
    by the protocol's mapping; then every release (the adapter, the images'
    bytes, the id). A client gone closes the handler's generator: only the
    releases run.

    The handler sets `call` once prepared and `started` at the engine's first
    output; its preparation sets `kv_transfer` (and `rank`) from when the
    connector is to be told of a failure.
    """

    __slots__ = (
        "_claim",
        "_failure",
        "_given",
        "_images",
        "_method",
        "_prefix",
        "_steps",
        "_summary",
        "call",
        "kv_transfer",
        "media",
        "rank",
        "request_id",
        "started",
        "usage",
    )

    def __init__(
        self,
        steps: EngineCallSteps,
        summary: RequestSummary,
        given: str,
        prefix: str,
        method: str,
        failure: Callable[[Exception], Exception] | None,
        images: bool,
    ) -> None:
        self._steps = steps
        self._summary = summary
        self._given = given
        self._prefix = prefix
        self._method = method
        self._failure = failure
        self._images = images
        self.call: EngineCall[Any] | None = None
        self.started = False
        self.kv_transfer: dict[str, Any] | None = None
        self.rank: int | None = None
        self.media: RequestMedia | None = None
        self.usage: GenerationUsage | None = None
        self.request_id = ""

    async def __aenter__(self) -> CallFrame:
        # What the metrics and tracing read: the request stated first (a
        # refused id included), then what is sent.
        usage = self.usage = kept_usage()
        if usage is not None:
            usage.request = self._summary
        self._claim = self._steps.claim(self._given, self._prefix, self._method)
        self.request_id = self._claim.request_id
        if self._images:
            # Its decoded images' bytes are the process's until the request ends.
            self.media = self._steps.decoded_media.request()
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            if isinstance(exc, asyncio.CancelledError):
                await self._claim.cancelled(self._steps.engine)
            elif isinstance(exc, Exception):
                # The error layer around every method turns what is raised into a status.
                failure = await self._failed(exc)
                if failure is not exc:
                    raise failure from exc
        finally:
            call = self.call
            if call is not None and call.adapter is not None:
                call.adapter.release()
            if self.media is not None:
                self.media.release()
            self._claim.release()

    async def _failed(self, exc: Exception) -> Exception:
        """What to raise for `exc`: the protocol's field named when it is at fault.

        A remote-prefill request that failed before the engine produced
        anything is reported to the KV connector, which would otherwise hold
        the prefill side's blocks until its lease ran out.
        """
        if self.kv_transfer is not None and not self.started:
            await self._steps.kv_transfer_rejected(self.request_id, self.kv_transfer, self.rank)
        if self._failure is not None and isinstance(exc, (ValueError, VLLMClientError)):
            return self._failure(exc)
        return exc
