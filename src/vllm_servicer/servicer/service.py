"""`VllmEngineServicer`: the `vllm.grpc.engine.VllmEngine` service over a vLLM engine."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

# Before vLLM is imported below: an untested vLLM release fails here, naming both versions.
from .. import _vllm_version  # noqa: F401

# isort: split
import grpc
from vllm.exceptions import VLLMClientError
from vllm.pooling_params import PoolingParams

from .. import vllm_releases
from ..context import current_request_id, engine_trace_headers, kept_usage
from ..engine import EngineClient, missing_members, served_model_name
from ..errors import (
    InvalidRequestError,
    NotEnabledError,
    UnimplementedFieldError,
    UnsupportedError,
)
from ..multimodal import tensors as mm_tensors
from ..multimodal.media import MediaRefOptions, MediaResolver
from ..options import DEFAULT_MAX_KV_SUBSCRIBERS
from ..proto import common_pb2, vllm_engine_pb2_grpc
from ..proto import vllm_engine_pb2 as pb
from ..wire import convert, fields
from . import admin, kv_events, loads
from .tenancy import RunningRequests, SubscriberLimit
from .tokenizer_bundle import TokenizerBundle, chunks, tokenizer_dir

if TYPE_CHECKING:
    import grpc.aio

    Context = grpc.aio.ServicerContext[Any, Any]

logger = logging.getLogger("vllm_servicer")

SERVER_TYPE = "vllm-grpc"
# The generation-config defaults GetModelInfo advertises for the router to apply.
_ADVERTISED_SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _request_id(given: str, prefix: str) -> str:
    # vLLM needs an id; a client that sent none cannot Abort by id anyway.
    return given or f"{prefix}-{uuid.uuid4().hex}"


# The grammar's start on a prompt that ends inside the model's thought, as
# routers read GetServerInfo.constrained_decoding_start.
_AFTER_REASONING, _FROM_FIRST_TOKEN = "after_reasoning", "first_token"


def _engine_facts(config: Any) -> dict[str, Any]:
    """GetServerInfo's fields read off the engine's configuration beyond the basics.

    The attention backend is the one asked for (`--attention-backend`); on
    the automatic choice the worker picks it, and it is left empty (unknown).
    """
    model = getattr(config, "model_config", None)
    dtype = str(getattr(model, "dtype", "") or "").removeprefix("torch.")
    multimodal = getattr(model, "multimodal_config", None)
    backend = getattr(getattr(config, "attention_config", None), "backend", None)
    structured = getattr(config, "structured_outputs_config", None)
    parser = str(getattr(structured, "reasoning_parser", "") or "")
    # vLLM holds a grammar back until the thought ends, unless told to run it inside.
    held_back = parser and not getattr(structured, "enable_in_reasoning", False)
    return {
        "multimodal_encoder_dtype": dtype if dtype in ("float32", "float16", "bfloat16") else "",
        # Such an engine takes raw pixels and would normalise others twice.
        "mm_device_do_normalize": bool(getattr(multimodal, "mm_device_do_normalize", False)),
        "attention_backend": "" if backend is None else str(getattr(backend, "name", backend)),
        "engine_reasoning_parser": parser,
        "constrained_decoding_start": ""
        if structured is None
        else (_AFTER_REASONING if held_back else _FROM_FIRST_TOKEN),
    }


class VllmEngineServicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    """Serves vLLM's gRPC engine protocol from an `AsyncLLM` (or anything shaped like it).

    Args:
        engine: the host's engine client, usually `vllm.v1.engine.async_llm.AsyncLLM`.
        max_kv_subscribers: SubscribeKvEvents streams allowed at once.
        media_refs: resolve images named by URL in `media_refs` by these
            rules; None (the default) refuses them.
        active_calls: what `active_requests` reports: the count of calls in
            flight (`mount()` passes the one its interceptors keep); None: the
            requests this servicer runs.
        shm_tensors: take preprocessed tensors (`mm_inputs`) through this
            host's shared memory; off, they must come inline.
    """

    def __init__(
        self,
        engine: EngineClient,
        *,
        max_kv_subscribers: int = DEFAULT_MAX_KV_SUBSCRIBERS,
        media_refs: MediaRefOptions | None = None,
        active_calls: Callable[[], int] | None = None,
        shm_tensors: bool = False,
    ) -> None:
        missing = missing_members(engine)
        if missing:
            # Here, not as an AttributeError in the middle of some later request.
            raise TypeError(
                f"the engine must be a vLLM AsyncLLM or shaped like one (EngineClient); "
                f"{type(engine).__name__} has no {', '.join(missing)}"
            )
        self._engine = engine
        self._active_calls = active_calls
        self._media = (
            MediaResolver(media_refs, engine.model_config) if media_refs is not None else None
        )
        # What preprocessed tensors (mm_inputs) this model takes.
        self._model_media = mm_tensors.ModelMedia.of(engine, shm=shm_tensors)
        self._kv_subscribers = SubscriberLimit(max_kv_subscribers)
        # A token prompt past the model's context is refused by its length alone.
        max_len = getattr(engine.model_config, "max_model_len", None)
        self._max_prompt_tokens: int | None = int(max_len) if max_len else None
        self._started_monotonic = time.monotonic()
        self._running = RunningRequests()
        self._last_receive_timestamp = 0.0
        self._model_info: pb.GetModelInfoResponse | None = None
        self._supported_tasks: tuple[str, ...] | None = None
        # Prefill/decode hand-off needs a KV connector in the engine (--kv-transfer-config).
        config = engine.vllm_config
        self._kv_connector = getattr(config, "kv_transfer_config", None)
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
        # Reads the engine's own per-step scheduler stats for GetLoads.
        self._stats_tap = loads.attach(engine)
        self._tokenizer_bundle: TokenizerBundle | None = None
        self._reported_missing: frozenset[int] = frozenset()

    @property
    def engine(self) -> EngineClient:
        """The engine this servicer drives."""
        return self._engine

    @property
    def kv_subscribers(self) -> SubscriberLimit:
        """The SubscribeKvEvents streams open now, and their limit."""
        return self._kv_subscribers

    @property
    def active_requests(self) -> int:
        """Generate and Embed calls currently being served."""
        if self._active_calls is not None:
            return self._active_calls()
        return len(self._running)

    @property
    def running_request_ids(self) -> list[str]:
        """Ids of the Generate and Embed calls being served now."""
        return self._running.ids

    async def abort_running(self) -> None:
        """Abort every request in flight in the engine (their streams end with "abort")."""
        ids = self.running_request_ids
        if ids:
            await self._engine.abort(ids)

    def _received(self, request_id: str, method: str) -> None:
        """Count `request_id` as running for the caller (RequestIdInUseError if it may not)."""
        self._last_receive_timestamp = time.time()
        current_request_id.set(request_id)
        self._running.claim(request_id, method)

    def _done(self, request_id: str) -> None:
        self._running.release(request_id)

    # ----- generation -------------------------------------------------------

    async def Generate(
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.GenerateResponse]:
        request_id = _request_id(request.request_id, "generate")
        self._received(request_id, "Generate")
        kv_transfer: dict[str, Any] | None = None
        started = False
        try:
            fields.refuse_unserved("Generate", request)
            kv_transfer = convert.kv_transfer_params(request)
            if kv_transfer is not None and self._kv_connector is None:
                json_set = request.HasField("kv_transfer_params_json")
                name = "kv_transfer_params_json" if json_set else "kv_transfer_params"
                raise UnsupportedError(fields.KV_CONNECTOR_HINT, field=name)
            params = request.sampling_params
            stream = request.stream
            sampling = convert.sampling_params_from_proto(
                params, stream=stream, kv_transfer=kv_transfer
            )
            if self._seed_hazard and vllm_releases.draws_from_own_generator(sampling):
                raise UnsupportedError(
                    f"seeded sampling would stop this CPU engine ({self._seed_hazard}); "
                    "send no seed, a temperature of 0, or serve with "
                    "--no-enable-chunked-prefill",
                    field="sampling_params.seed",
                )
            tokenization = convert.tokenization_kwargs(params)
            # With truncation asked for, a longer prompt is the engine's to cut.
            limit = None if tokenization is not None else self._max_prompt_tokens
            prompt = convert.prompt_from_request(request, limit)
            images = request.HasField("media_refs")
            tensors = mm_tensors.sent(request)
            if tensors:
                # The router's own processor output: the engine input as it stands.
                prompt = await mm_tensors.engine_input(request, prompt, self._model_media)
            elif images:
                # vLLM's processor expands each image placeholder, off the event loop.
                prompt = await self._with_images(request, prompt)
            kwargs: dict[str, Any] = {}
            if tokenization is not None:
                kwargs["tokenization_kwargs"] = tokenization
            elif not isinstance(prompt, str) and not images and not tensors:
                # Token ids need no tokenizer: render them here, which spares
                # the engine's hop through a worker thread for raw prompts.
                # The engine still validates the rendered input.
                prompt = self._render(prompt, time.time())
            if request.HasField("data_parallel_rank"):
                kwargs["data_parallel_rank"] = request.data_parallel_rank
            trace = engine_trace_headers(context)
            if trace is not None:
                kwargs["trace_headers"] = trace
            if convert.grammar_from_first_token(params):
                kwargs["reasoning_ended"] = True
            build = convert.ResponseBuilder(params)
            chunk, complete = build.chunk, build.complete
            # What the metrics and tracing read, kept from the numbers at hand.
            usage = kept_usage()
            async for output in self._engine.generate(prompt, sampling, request_id, **kwargs):
                if usage is not None and not started:
                    usage.prompt_tokens = len(output.prompt_token_ids or ())
                started = True
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
                                usage.choice_finished(completion.index, completion.finish_reason, 0)
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
        except Exception as exc:
            # The error layer around every method turns what is raised into a status.
            if kv_transfer is not None and not started:
                await self._kv_transfer_rejected(request, request_id, kv_transfer)
            if isinstance(exc, (ValueError, VLLMClientError)):
                named = convert.constraint_error(exc, request.sampling_params)
                if named is not exc:
                    raise named from exc
            raise
        finally:
            self._done(request_id)

    async def Embed(self, request: pb.EmbedRequest, context: Context) -> pb.EmbedResponse:
        request_id = _request_id(request.request_id, "embed")
        self._received(request_id, "Embed")
        try:
            if "embed" not in await self._tasks():
                raise UnsupportedError(
                    "this server's engine does not serve embeddings; start it as a pooling "
                    "model (vLLM: --runner pooling --convert embed)"
                )
            final = None
            async for output in self._engine.encode(
                convert.prompt_from_request(request, self._max_prompt_tokens),
                PoolingParams(task="embed"),
                request_id,
                trace_headers=engine_trace_headers(context),
            ):
                final = output
            if final is None:  # pragma: no cover - the engine always yields once
                raise RuntimeError("engine returned no embedding")
            vector = final.outputs.data.tolist()
            return pb.EmbedResponse(
                embedding=vector,
                prompt_tokens=len(final.prompt_token_ids),
                embedding_dim=len(vector),
            )
        finally:
            self._done(request_id)

    async def Abort(self, request: pb.AbortRequest, context: Context) -> pb.AbortResponse:
        # Idempotent: vLLM ignores ids it does not know (finished or never seen).
        ids = self._running.abortable(request.request_ids)
        if ids:
            current_request_id.set(",".join(ids))
            await self._engine.abort(ids)
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
            self._model_info = await self._build_model_info()
        return self._model_info

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: Context
    ) -> pb.GetServerInfoResponse:
        config = self._engine.vllm_config
        parallel = getattr(config, "parallel_config", None)
        cache = getattr(config, "cache_config", None)
        scheduler = getattr(config, "scheduler_config", None)
        kv_transfer = getattr(config, "kv_transfer_config", None)
        is_paused = await self._engine.is_paused()
        media = self._model_media
        # Worked out once, from the model's largest item: off the event loop.
        budget = (
            media.encoder_budget(config)
            if media.encoder_budget_known
            else await asyncio.to_thread(media.encoder_budget, config)
        )
        return pb.GetServerInfoResponse(
            active_requests=self.active_requests,
            is_paused=is_paused,
            last_receive_timestamp=self._last_receive_timestamp,
            uptime_seconds=time.monotonic() - self._started_monotonic,
            server_type=SERVER_TYPE,
            kv_connector=getattr(kv_transfer, "kv_connector", None) or "",
            kv_role=getattr(kv_transfer, "kv_role", None) or "",
            kv_engine_id=getattr(kv_transfer, "engine_id", None) or "",
            data_parallel_size=getattr(parallel, "data_parallel_size", 1) or 1,
            kv_cache_dtype=str(getattr(cache, "cache_dtype", "") or ""),
            block_size=getattr(cache, "block_size", 0) or 0,
            model_dtype=str(getattr(self._engine.model_config, "dtype", "") or ""),
            max_num_seqs=getattr(scheduler, "max_num_seqs", 0) or 0,
            # What a router reads to send media_refs here rather than tensors.
            mm_processor="inprocess" if self._takes_images else "",
            mm_media_ref_schemes=",".join(self._media.schemes)
            if self._media is not None and self._takes_images
            else "",
            # What a router reads to send tensors, and through shared memory.
            mm_item_limits=media.item_limits,
            shm_namespace_id=mm_tensors.shm_namespace() if media.shm and media.limits else "",
            mm_encoder_budget=budget,
            **_engine_facts(config),
        )

    async def GetLoads(self, request: pb.GetLoadsRequest, context: Context) -> pb.GetLoadsResponse:
        fields.load_sections(list(request.include))
        dp_rank = request.dp_rank if request.HasField("dp_rank") else None
        report = loads.load_report(self._engine, self._stats_tap, dp_rank)
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

    async def _with_images(self, request: pb.GenerateRequest, prompt: Any) -> Any:
        """`prompt` with the images of `request.media_refs` as its multimodal data."""
        if self._media is None or not self._media.takes_images:
            raise UnimplementedFieldError("media_refs", fields.MEDIA_REFS_HINT)
        if isinstance(prompt, str):
            # As the reference server: the router tokenizes, placeholders included.
            raise InvalidRequestError(
                "media_refs", "needs tokenized input (token ids with one placeholder per image)"
            )
        images = await self._media.images(request.media_refs)
        prompt["multi_modal_data"] = {"image": images[0] if len(images) == 1 else images}
        render = self._engine.renderer.process_for_engine_async
        if convert.tokenization_kwargs(request.sampling_params) is not None:
            return prompt  # the engine processes it (truncating it first)
        try:
            # As the engine would; rendered here, a mismatch is named as the
            # request's fault (vLLM asserts it, which would read as internal).
            return await render(prompt, time.time())
        except (AssertionError, RuntimeError, ValueError) as exc:
            raise InvalidRequestError(
                "media_refs", f"the images do not fit the prompt's placeholders: {exc}"
            ) from exc

    async def _kv_transfer_rejected(
        self, request: pb.GenerateRequest, request_id: str, kv_transfer: dict[str, Any]
    ) -> None:
        """Tell the KV connector a remote-prefill request failed before the engine ran it.

        The prefill side holds the request's blocks until the decode side takes
        them; without this they stay pinned until the connector's lease expires.
        A cancelled call is not reported: once the engine holds the request, its
        abort runs the connector's hook itself.
        """
        if self._kv_connector is None or not kv_transfer.get("do_remote_prefill"):
            return
        notify = self._engine.notify_kv_transfer_request_rejected
        rank = request.data_parallel_rank if request.HasField("data_parallel_rank") else None
        try:
            await notify(request_id, kv_transfer, data_parallel_rank=rank)
        except Exception:
            logger.warning(
                "could not tell the KV connector that request %r was rejected",
                request_id,
                exc_info=True,
            )

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

    async def _build_model_info(self) -> pb.GetModelInfoResponse:
        mc = self._engine.model_config
        hf = getattr(mc, "hf_config", None)
        max_len = int(getattr(mc, "max_model_len", 0) or 0)
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = [eos] if isinstance(eos, int) else list(eos or ())
        return pb.GetModelInfoResponse(
            model_path=str(getattr(mc, "model", "")),
            is_generation=getattr(mc, "runner_type", "generate") == "generate",
            max_context_length=max_len,
            vocab_size=int(mc.get_vocab_size()),
            # Only when a request can carry an image that reaches the model:
            # preprocessed tensors (mm_inputs), or media_refs when turned on.
            supports_vision=self._model_media.takes_images or self._takes_images,
            served_model_name=served_model_name(self._engine),
            tokenizer_path=str(getattr(mc, "tokenizer", "") or ""),
            model_type=str(getattr(hf, "model_type", "") or ""),
            architectures=list(getattr(hf, "architectures", None) or ()),
            eos_token_ids=eos_ids,
            pad_token_id=int(getattr(hf, "pad_token_id", None) or 0),
            bos_token_id=int(getattr(hf, "bos_token_id", None) or 0),
            max_req_input_len=max_len,
            default_sampling_params_json=_default_sampling_json(mc),
        )


def _default_sampling_json(model_config: Any) -> str:
    """The model's generation-config sampling defaults as compact JSON ("" if none)."""
    get_diff = getattr(model_config, "get_diff_sampling_param", None)
    if get_diff is None:
        return ""
    try:
        diff = get_diff() or {}
    except Exception:  # a malformed generation config must not break GetModelInfo
        logger.warning("could not read the model's generation config", exc_info=True)
        return ""
    chosen = {k: diff[k] for k in _ADVERTISED_SAMPLING_DEFAULTS if diff.get(k) is not None}
    return json.dumps(chosen, separators=(",", ":")) if chosen else ""
