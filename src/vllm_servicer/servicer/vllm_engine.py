"""`VllmEngineServicer`: the `vllm.grpc.engine.VllmEngine` service over a vLLM engine.

Generate and Embed run in the engine call's frame (`engine_call.CallFrame`),
as vllm.Inference's handlers do. Generate is prepared by the one preparation
of every generation protocol (`EngineCallSteps.prepare`), which reads its
message through `_GenerateReader` (converted by `wire/vllm_engine.py`); its
stream loop stays in Generate itself: a generator between it and grpc would
cost a hop per message sent.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

# Before vLLM is imported below: an untested vLLM release fails here, naming both versions.
from .. import _vllm_version  # noqa: F401

# isort: split
import grpc
from vllm.pooling_params import PoolingParams

from ..context import current_request_id, engine_trace_headers
from ..engine import EngineClient, require_engine
from ..errors import (
    InvalidRequestError,
    NotEnabledError,
    UnimplementedFieldError,
    UnsupportedError,
)
from ..load_reports import stats_tap
from ..multimodal import model_media as mm_model_media
from ..multimodal import tensors as mm_tensors
from ..proto import VLLM_ENGINE_SERVICE, common_pb2, vllm_engine_pb2_grpc
from ..proto import vllm_engine_pb2 as pb
from ..wire import fields
from ..wire import vllm_engine as wire
from ..wire.usage import RequestSummary
from . import admin, info, kv_events, loads
from .engine_call import GenerationReader
from .state import MountState
from .tenancy import SubscriberLimit
from .tokenizer_bundle import TokenizerBundle, chunks, tokenizer_dir

if TYPE_CHECKING:
    import grpc.aio
    from vllm.sampling_params import SamplingParams

    from ..multimodal.decoded import DecodedMedia, RequestMedia

    Context = grpc.aio.ServicerContext[Any, Any]

logger = logging.getLogger("vllm_servicer")


class VllmEngineServicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    """Serves vLLM's gRPC engine protocol from an `AsyncLLM` (or anything shaped like it).

    Args:
        state: what the mount's servicers share: the engine (usually
            `vllm.v1.engine.async_llm.AsyncLLM`), its running requests, the
            count in flight, the mount's options (`MountState.build(engine,
            options)` makes one for a servicer alone).
    """

    def __init__(self, state: MountState) -> None:
        options = state.options
        engine = state.engine
        require_engine(engine)
        self._engine = engine
        self._state = state
        self._budgets = options.budgets
        self._decoded_media = state.decoded_media
        self._media = state.media
        # What preprocessed tensors (mm_inputs) this model takes.
        self._model_media = mm_model_media.ModelMedia.of(engine, shm=options.media.shm_tensors)
        self._kv_subscribers = SubscriberLimit(
            options.streaming.max_kv_subscribers, state.frontends
        )
        self._group = state.frontends
        self._started_monotonic = time.monotonic()
        self._steps = state.steps
        self._running = state.running
        # The start until the first Generate or Embed arrives: clients read it as a
        # liveness clock, and 0 would read as a server silent since 1970.
        self._last_receive_timestamp = time.time()
        self._model_info: pb.GetModelInfoResponse | None = None
        self._supported_tasks: tuple[str, ...] | None = None
        # Reads the engine's own per-step scheduler stats for GetLoads.
        self._stats_tap = stats_tap.attach(engine)
        self._tokenizer_bundle: TokenizerBundle | None = None
        self._reported_missing: frozenset[int] = frozenset()

    @property
    def engine(self) -> EngineClient:
        """The engine this servicer drives."""
        return self._engine

    @property
    def decoded_media(self) -> DecodedMedia:
        """The decoded images this process holds for running requests, and their budget."""
        return self._decoded_media

    @property
    def kv_subscribers(self) -> SubscriberLimit:
        """The SubscribeKvEvents streams open now, and their limit."""
        return self._kv_subscribers

    @property
    def active_requests(self) -> int:
        """Engine calls (every protocol's) being served now (`MountState.active_requests`)."""
        return self._state.active_requests

    @property
    def running_request_ids(self) -> list[str]:
        """Ids of the engine requests (every protocol's) being served now."""
        return self._running.ids

    # ----- generation -------------------------------------------------------

    async def Generate(
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.GenerateResponse]:
        self._last_receive_timestamp = time.time()
        params = request.sampling_params
        async with self._steps.frame(
            _generate_summary(request),
            request.request_id,
            "generate",
            "Generate",
            failure=lambda exc: wire.constraint_error(exc, params),
        ) as frame:
            reader = _GenerateReader(self, request)
            call = frame.call = await self._steps.prepare(reader, frame, context)
            usage, stream, started = frame.usage, request.stream, False
            chunk, complete = call.builder.chunk, call.builder.complete
            outputs = self._steps.tenant.generate(
                call.prompt, call.sampling, frame.request_id, **call.kwargs
            )
            # Closed here when the client goes (at our yield), not when collected:
            # the engine aborts the request before its id is let go.
            async with contextlib.aclosing(outputs):
                async for output in outputs:
                    if not started:
                        if usage is not None:
                            usage.prompt_tokens = len(output.prompt_token_ids or ())
                        started = frame.started = True
                    # Recorded once built: the time a message leaves includes building it.
                    if stream:
                        for completion in output.outputs:
                            message = chunk(output, completion)
                            if usage is not None:
                                usage.chunk_sent(len(completion.token_ids))
                            yield message
                            if completion.finish_reason is not None:
                                message = complete(output, completion)
                                if usage is not None:
                                    usage.choice_finished(
                                        completion.index, completion.finish_reason, 0
                                    )
                                yield message
                    elif output.finished:
                        for completion in output.outputs:
                            message = complete(output, completion)
                            if usage is not None:
                                usage.choice_finished(
                                    completion.index,
                                    completion.finish_reason or "stop",
                                    len(completion.token_ids),
                                )
                            yield message

    async def Embed(self, request: pb.EmbedRequest, context: Context) -> pb.EmbedResponse:
        self._last_receive_timestamp = time.time()
        summary = RequestSummary("embeddings", request.request_id)
        async with self._steps.frame(
            summary, request.request_id, "embed", "Embed", images=False
        ) as frame:
            if "embed" not in await self._tasks():
                raise UnsupportedError(
                    "this server's engine does not serve embeddings; start it as a pooling "
                    "model (vLLM: --runner pooling --convert embed)"
                )
            final = None
            async for output in self._steps.tenant.encode(
                self._steps.salted(
                    wire.prompt_from_request(request, self._steps.max_prompt_tokens)
                ),
                PoolingParams(task="embed"),
                frame.request_id,
                trace_headers=engine_trace_headers(context),
            ):
                final = output
            if final is None:  # pragma: no cover - the engine always yields once
                raise RuntimeError("engine returned no embedding")
            vector = final.outputs.data.tolist()
            prompt_tokens = len(final.prompt_token_ids)
            if frame.usage is not None:
                frame.usage.prompt_tokens = prompt_tokens
                frame.usage.embedding_dim = len(vector)
            return pb.EmbedResponse(
                embedding=vector, prompt_tokens=prompt_tokens, embedding_dim=len(vector)
            )

    # ----- preparation ------------------------------------------------------

    async def Abort(self, request: pb.AbortRequest, context: Context) -> pb.AbortResponse:
        # Idempotent: vLLM ignores ids it does not know (finished or never seen).
        # In this process or (N frontends) another; the ids aborted here label the call.
        self._budgets.check_abort_ids("request_ids", request.request_ids)
        ids = await self._running.abort(self._engine, request.request_ids)
        if ids:
            current_request_id.set(",".join(ids))
        return pb.AbortResponse()

    # ----- state ------------------------------------------------------------

    async def HealthCheck(
        self, request: pb.HealthCheckRequest, context: Context
    ) -> pb.HealthCheckResponse:
        if self._engine.errored:
            return pb.HealthCheckResponse(healthy=False, message="Engine is not alive")
        return pb.HealthCheckResponse(healthy=True, message="Health")

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: Context
    ) -> pb.GetModelInfoResponse:
        if self._model_info is None:
            supports_vision = self._model_media.takes_images or self._takes_images
            self._model_info = info.model_info(self._engine, supports_vision=supports_vision)
        return self._model_info

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: Context
    ) -> pb.GetServerInfoResponse:
        return await info.server_info(
            self._engine,
            active_requests=self.active_requests,
            last_receive_timestamp=self._last_receive_timestamp,
            uptime_seconds=time.monotonic() - self._started_monotonic,
            model_media=self._model_media,
            media=self._media,
        )

    async def GetLoads(self, request: pb.GetLoadsRequest, context: Context) -> pb.GetLoadsResponse:
        fields.load_sections(list(request.include))
        dp_rank = request.dp_rank if request.HasField("dp_rank") else None
        group = self._group
        # Several frontends on the engine: each saw part of its steps.
        elsewhere = await group.loads_elsewhere() if group and group.loads_elsewhere else []
        report = loads.load_report(
            self._engine,
            self._stats_tap,
            dp_rank,
            elsewhere,
            self._steps.tenant.queued.total,
        )
        if report.missing_ranks:
            # Left out rather than zero-filled: zeros would read as idle ranks.
            context.set_trailing_metadata(
                ((loads.MISSING_RANKS_KEY, ",".join(map(str, report.missing_ranks))),)
            )
            self._log_missing(report.missing_ranks)
        return report.response

    async def GetTokenizer(
        self, request: common_pb2.GetTokenizerRequest, context: Context
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        if self._tokenizer_bundle is None:
            config = self._engine.model_config
            directory = tokenizer_dir(
                getattr(config, "tokenizer", None), getattr(config, "tokenizer_revision", None)
            )
            self._tokenizer_bundle = TokenizerBundle(directory)
        data, sha256 = await self._tokenizer_bundle.archive()
        for chunk in chunks(data, sha256):
            yield chunk

    async def SubscribeKvEvents(
        self, request: common_pb2.SubscribeKvEventsRequest, context: Context
    ) -> AsyncIterator[common_pb2.KvEventBatch]:
        config = kv_events.publisher_config(self._engine)
        if config is None:
            raise NotEnabledError(kv_events.ENABLE_HINT)
        ranks = kv_events.sources(self._engine, config)
        start = request.start_sequence_number
        if start:
            kv_events.check_resumable(ranks, start)
        with self._kv_subscribers.slot():
            stream = kv_events.relay(
                ranks,
                topic=config.topic or "",
                engine_dead=lambda: bool(self._engine.errored),
                # Headers out once subscribed: the client's first read means "live".
                on_subscribed=lambda: context.send_initial_metadata(()),
                start=start,
            )
            try:
                async for batch in stream:
                    yield batch
            finally:
                # Closed here, not at garbage collection: the slot and socket go now.
                await stream.aclose()

    async def FlushCache(
        self, request: common_pb2.FlushCacheRequest, context: Context
    ) -> common_pb2.FlushCacheResponse:
        return await admin.flush_cache(self._engine, request.timeout_s, context.time_remaining)

    async def StartProfile(
        self, request: common_pb2.StartProfileRequest, context: Context
    ) -> common_pb2.ProfileResponse:
        return await admin.start_profile(self._engine, request, context.time_remaining)

    async def StopProfile(
        self, request: common_pb2.StopProfileRequest, context: Context
    ) -> common_pb2.ProfileResponse:
        return await admin.stop_profile(self._engine, context.time_remaining)

    # ----- helpers ----------------------------------------------------------

    @property
    def _takes_images(self) -> bool:
        return self._media is not None and self._media.takes_images

    def _log_missing(self, ranks: list[int]) -> None:
        # Once per change, not per poll: routers poll GetLoads several times a second.
        missing = frozenset(ranks)
        if missing - self._reported_missing:
            why = (
                "the engine collects no stats (started with --disable-log-stats)"
                if self._stats_tap is None
                else "no scheduler stats from the engine yet (no step since mounting)"
            )
            logger.info("GetLoads leaves out dp ranks %s: %s", sorted(missing), why)
        self._reported_missing = missing

    async def _tasks(self) -> tuple[str, ...]:
        if self._supported_tasks is None:
            tasks = await self._engine.get_supported_tasks()
            self._supported_tasks = tuple(tasks)
        return self._supported_tasks


def _generate_summary(request: pb.GenerateRequest) -> RequestSummary:
    """What a Generate request asks for, in no protocol's terms (proto3 zeros are unset)."""
    params = request.sampling_params
    return RequestSummary(
        "text_completion",
        request.request_id,
        max_tokens=params.max_tokens if params.HasField("max_tokens") else None,
        temperature=params.temperature if params.HasField("temperature") else None,
        top_p=params.top_p if params.top_p != 0.0 else None,  # 0: unset (top_p 1)
        n=params.n,
    )


class _GenerateReader(GenerationReader[wire.ResponseBuilder]):
    """A VllmEngine GenerateRequest as the one preparation reads it (`EngineCallSteps.prepare`)."""

    seed_field = "sampling_params.seed"

    def __init__(self, servicer: VllmEngineServicer, request: pb.GenerateRequest) -> None:
        self._servicer = servicer
        self._request = request
        self._params = request.sampling_params
        self._kv_transfer: dict[str, Any] | None = None

    def refuse_unserved(self) -> None:
        fields.refuse_unserved(VLLM_ENGINE_SERVICE, "Generate", self._request)

    def check_budgets(self) -> None:
        budgets, params = self._servicer._budgets, self._params
        budgets.check_n("sampling_params.n", params.n)
        budgets.check_stop("sampling_params.stop", params.stop)
        constraint = wire.constraint_size(params)
        if constraint is not None:
            budgets.check_constraint(*constraint)

    def pinned_rank(self) -> tuple[int | None, str]:
        request = self._request
        rank = request.data_parallel_rank if request.HasField("data_parallel_rank") else None
        return rank, "data_parallel_rank"

    def routing_data(self) -> tuple[dict[str, Any], dict[str, Any] | None]:
        request = self._request
        kv_transfer = self._kv_transfer = wire.kv_transfer_params(request)
        if kv_transfer is not None:
            json_set = request.HasField("kv_transfer_params_json")
            self._servicer._steps.check_kv_transfer(
                "kv_transfer_params_json" if json_set else "kv_transfer_params"
            )
        return {}, kv_transfer

    def sampling(self, extra_args: dict[str, Any]) -> SamplingParams:
        return wire.sampling_params_from_proto(
            self._params, stream=self._request.stream, kv_transfer=self._kv_transfer
        )

    def engine_kwargs(self, sampling: SamplingParams) -> dict[str, Any]:
        if wire.grammar_from_first_token(self._params):
            return {"reasoning_ended": True}
        return {}

    def tokenization(self) -> dict[str, Any] | None:
        return wire.tokenization_kwargs(self._params)

    def prompt(self, limit: int | None) -> Any:
        return wire.prompt_from_request(self._request, limit)

    async def with_media(self, prompt: Any, media: RequestMedia | None) -> tuple[Any, str | None]:
        request, servicer = self._request, self._servicer
        if mm_tensors.sent(request):
            # The router's own processor output: the engine input as it stands.
            rendered = await mm_tensors.engine_input(
                request,
                prompt,
                servicer._model_media,
                max_shm_bytes=servicer._budgets.max_request_shm_bytes,
            )
            return rendered, ""
        if not request.HasField("media_refs"):
            return prompt, None
        if servicer._media is None or not servicer._media.takes_images or media is None:
            raise UnimplementedFieldError("media_refs", fields.MEDIA_REFS_HINT)
        if isinstance(prompt, str):
            # As the reference server: the router tokenizes, placeholders included.
            raise InvalidRequestError(
                "media_refs", "needs tokenized input (token ids with one placeholder per image)"
            )
        images = await servicer._media.images(request.media_refs, media)
        prompt["multi_modal_data"] = {"image": images[0] if len(images) == 1 else images}
        return prompt, "media_refs"

    def builder(self) -> wire.ResponseBuilder:
        return wire.ResponseBuilder(self._params)

    def adapter(self) -> None:
        return None
