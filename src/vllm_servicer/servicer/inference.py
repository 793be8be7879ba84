"""`InferenceServicer`: vLLM's own `vllm.Inference` service (Generate, GenerateStream).

The same engine calls as VllmEngine's Generate, with vLLM's Rust server's
behaviour for this schema (wire/inference.py has the defaults). Request ids
are claimed in the mount's one `RunningRequests`, so an id belongs to its
caller whichever protocol started it, and a drain or Control.Abort reaches
these requests too. A dropped stream cancels the handler inside
`engine.generate`, which aborts the request in the engine.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

# Before vLLM is imported below: an untested vLLM release fails here, naming both versions.
from .. import _vllm_version  # noqa: F401

# isort: split
from .. import vllm_releases
from ..context import priority_floor
from ..engine import require_engine, served_model_name
from ..errors import (
    ROUTER_ROLE_HINT,
    InvalidRequestError,
    NotFoundError,
    UnimplementedFieldError,
    UnsupportedError,
)
from ..multimodal import inference_media
from ..multimodal.decoded import RequestMedia
from ..proto import INFERENCE_SERVICE, inference_pb2_grpc
from ..proto import inference_pb2 as pb
from ..wire import fields
from ..wire import inference as wire
from ..wire.inference_responses import ResponseBuilder
from ..wire.usage import RequestSummary
from .engine_call import CallFrame, EngineCall, GenerationReader
from .lora import AdapterHold, LoraRegistry
from .state import MountState

if TYPE_CHECKING:
    import grpc.aio
    from vllm.sampling_params import SamplingParams

    Context = grpc.aio.ServicerContext[Any, Any]

logger = logging.getLogger("vllm_servicer")

RELEASE_HINT = "the installed vLLM does not take it (docs/protocol.md lists the releases that do)"

DATA_PARALLEL_RANK_HEADER = "x-data-parallel-rank"
"""The call metadata that pins a request to one data-parallel rank (u32), as vLLM reads it."""
_U32 = re.compile(r"\+?\d{1,10}")
_U32_MAX = 2**32 - 1


def data_parallel_rank(context: Context) -> int | None:
    """The rank named by the call's `x-data-parallel-rank` metadata, if any.

    Raises:
        InvalidRequestError: the value is not an unsigned 32-bit integer.
    """
    for key, value in context.invocation_metadata() or ():
        if key == DATA_PARALLEL_RANK_HEADER:
            text = value.strip() if isinstance(value, str) else ""
            if not _U32.fullmatch(text) or int(text) > _U32_MAX:
                raise InvalidRequestError(
                    DATA_PARALLEL_RANK_HEADER, "metadata must be an unsigned 32-bit integer"
                )
            return int(text)
    return None


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    """Serves `vllm.Inference` from an `AsyncLLM` (or anything shaped like it).

    Args:
        state: what the mount's servicers share: the engine, its running
            requests (an id is its caller's whichever protocol started it),
            the LoRA adapters `lora_name` names (vllm.Control loads them).
    """

    def __init__(self, state: MountState) -> None:
        engine = state.engine
        require_engine(engine)
        self._engine = engine
        self._budgets = state.options.budgets
        self._steps = state.steps
        self.loras: LoraRegistry = state.loras
        self._media = state.media
        config = engine.model_config
        self._model_name = served_model_name(engine)
        self._defaults = _model_defaults(config)
        self._config = config
        self._reasoning = _runs_reasoning_parser(engine)

    # ----- the RPCs ---------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, context: Context) -> pb.GenerateResponse:
        """The whole generation in one message: `prompt_info`, then the finished sequence."""
        async with self._frame(request, "Generate") as frame:
            reader = _GenerateReader(self, request, context, stream=False)
            call: EngineCall[ResponseBuilder] = await self._steps.prepare(reader, frame, context)
            frame.call = call
            final = None
            async for output in self._steps.tenant.generate(
                call.prompt, call.sampling, frame.request_id, **call.kwargs
            ):
                final = output
            if final is None:  # pragma: no cover - the engine always yields once
                raise RuntimeError("engine returned no output")
            response = call.builder.whole(final)
            usage = frame.usage
            if usage is not None:
                completion = final.outputs[0]
                usage.prompt_tokens = len(final.prompt_token_ids or ())
                reason = completion.finish_reason or "stop"
                usage.choice_finished(0, reason, len(completion.token_ids))
            return response

    async def GenerateStream(
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.GenerateResponse]:
        """`prompt_info` alone, then one message per engine step; the last has `finish_info`."""
        async with self._frame(request, "GenerateStream") as frame:
            reader = _GenerateReader(self, request, context, stream=True)
            call = frame.call = await self._steps.prepare(reader, frame, context)
            usage, delta, started = frame.usage, call.builder.delta, False
            outputs = self._steps.tenant.generate(
                call.prompt, call.sampling, frame.request_id, **call.kwargs
            )
            # Closed here when the client goes (at our yield), not when collected:
            # the engine aborts the request before its id and adapter are let go.
            async with contextlib.aclosing(outputs):
                async for output in outputs:
                    if not started:
                        started = frame.started = True
                        if call.adapter is not None:
                            call.adapter.in_engine()
                        if usage is not None:
                            usage.prompt_tokens = len(output.prompt_token_ids or ())
                        yield call.builder.first(output)
                    completion = output.outputs[0]  # one sequence: num_sequences > 1 is refused
                    message = delta(output, completion)
                    if usage is not None:
                        usage.chunk_sent(len(completion.token_ids))
                        if completion.finish_reason is not None:
                            # Finished in this very message: no separate one to count.
                            usage.finish_reasons[0] = completion.finish_reason
                    yield message

    def _frame(self, request: pb.GenerateRequest, method: str) -> CallFrame:
        """The call's frame (`CallFrame`): the structured-output field named when at fault."""
        decoding = request.decoding
        return self._steps.frame(
            _summary(request),
            request.request_id,
            "inference",
            method,
            failure=lambda exc: wire.constraint_error(exc, decoding),
        )

    # ----- preparation ------------------------------------------------------

    def _released_fields(
        self, request: pb.GenerateRequest, sampling: SamplingParams, kwargs: dict[str, Any]
    ) -> None:
        """The fields vLLM 0.33's and 0.34's schema added: onto the call, or refused.

        Raises:
            InvalidRequestError: malformed bad words.
            UnsupportedError: a thinking budget without the engine's reasoning parser.
            UnimplementedFieldError: a field the installed vLLM cannot take.
        """
        words = None
        if request.decoding.bad_words_token_ids:
            # Read per use: a stand-in engine's configuration may not say (only bad words ask).
            words = wire.bad_words(request.decoding, self._config.get_vocab_size())
        if words is not None:
            # vLLM's own form once `bad_words` are tokenized: the sampler reads these.
            sampling._bad_words_token_ids = words
        if sampling.thinking_token_budget is not None and not self._reasoning:
            raise UnsupportedError(
                fields.THINKING_BUDGET_HINT, field="stopping.thinking_token_budget"
            )
        gate = wire.reasoning_gate(request)
        if gate:
            if not vllm_releases.GENERATE_TAKES_REASONING_GATE:
                raise UnimplementedFieldError("engine_reasoning_gate", RELEASE_HINT)
            kwargs.update(gate)
        hints = wire.kv_hints(request) if vllm_releases.GENERATE_TAKES_KV_HINTS else None
        if hints is not None:
            kwargs["kv_hints"] = hints
        elif request.HasField("kv_hints"):
            raise UnimplementedFieldError("kv_hints", RELEASE_HINT)

    def _check_model(self, model: str) -> None:
        if model and model != self._model_name:
            raise NotFoundError(
                "model",
                f"model {model!r} is not served here (this server serves "
                f"{self._model_name!r}; empty means the served model)",
            )

    def _routing_data(
        self, request: pb.GenerateRequest
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """The connectors' params for the engine's `extra_args`, and the KV ones
        alone; the request's KV hints refused from a caller who is no router.

        Raises:
            UnsupportedError: params for a connector the engine does not run.
            RoutingDataError: KV or EC transfer params, or KV hints, from a
                caller who is no router.
        """
        if request.HasField("kv_hints"):
            # An orchestrator's hints to the engine's KV cache (what to
            # prefetch, keep or drop), for every tenant's blocks: a router's.
            self._steps.check_routing(
                "kv_hints", f"KV hints steer the engine's KV cache, a router's; {ROUTER_ROLE_HINT}"
            )
        kv = request.kv
        extra: dict[str, Any] = {}
        kv_transfer = None
        if kv.HasField("kv_transfer_params"):
            self._steps.check_kv_transfer("kv.kv_transfer_params")
            kv_transfer = extra["kv_transfer_params"] = wire.struct_to_dict(kv.kv_transfer_params)
        if kv.HasField("ec_transfer_params"):
            # A connector's parameters, as KV transfer's: a router's to set.
            self._steps.check_routing("kv.ec_transfer_params")
            if not self._steps.ec_connector:
                raise UnsupportedError(fields.EC_CONNECTOR_HINT, field="kv.ec_transfer_params")
            extra["ec_transfer_params"] = wire.struct_to_dict(kv.ec_transfer_params)
        return extra, kv_transfer

    async def _with_media(
        self, request: pb.GenerateRequest, prompt: Any, media: RequestMedia | None
    ) -> Any:
        """`prompt` with the images of `request.media` as its multimodal data and
        their uuids, not yet rendered (the uuids are to be keyed first)."""
        items = request.media
        # The items' own faults first: they hold whatever the engine.
        inference_media.checked_items(items)
        if self._media is None or not self._media.takes_images or media is None:
            source = items[0].WhichOneof("source")
            raise UnimplementedFieldError(f"media[0].{source}", inference_media.MEDIA_HINT)
        if "prompt_token_ids" not in prompt:
            # As vLLM's server: the client tokenizes, one placeholder per image.
            raise InvalidRequestError(
                "media", "needs token_ids input (with one placeholder per image)"
            )
        images = await inference_media.images(self._media, items, media)
        prompt["multi_modal_data"] = {"image": images[0] if len(images) == 1 else images}
        uuids = inference_media.uuids(items)
        if uuids is not None:
            prompt["multi_modal_uuids"] = {"image": uuids}
        return prompt


class _GenerateReader(GenerationReader[ResponseBuilder]):
    """A vllm.Inference GenerateRequest as the one preparation reads it
    (`EngineCallSteps.prepare`), for Generate or GenerateStream."""

    seed_field = "sampling.seed"

    def __init__(
        self,
        servicer: InferenceServicer,
        request: pb.GenerateRequest,
        context: Context,
        *,
        stream: bool,
    ) -> None:
        self._servicer = servicer
        self._request = request
        self._context = context
        self._stream = stream

    def refuse_unserved(self) -> None:
        method = "GenerateStream" if self._stream else "Generate"
        fields.refuse_unserved(INFERENCE_SERVICE, method, self._request)

    def check_budgets(self) -> None:
        request, budgets = self._request, self._servicer._budgets
        budgets.check_stop("stopping.stop_strings", request.stopping.stop_strings)
        constraint = wire.constraint_size(request.decoding)
        if constraint is not None:
            budgets.check_constraint(*constraint)
        self._servicer._check_model(request.model)
        wire.check_client_ids(request)
        if request.priority:  # an int32 on this wire
            floor = priority_floor(budgets.min_tenant_priority)
            budgets.check_priority("priority", request.priority, floor)

    def pinned_rank(self) -> tuple[int | None, str]:
        return data_parallel_rank(self._context), DATA_PARALLEL_RANK_HEADER

    def routing_data(self) -> tuple[dict[str, Any], dict[str, Any] | None]:
        return self._servicer._routing_data(self._request)

    def sampling(self, extra_args: dict[str, Any]) -> SamplingParams:
        return wire.sampling_params_from_request(
            self._request,
            stream=self._stream,
            defaults=self._servicer._defaults,
            extra_args=extra_args,
        )

    def engine_kwargs(self, sampling: SamplingParams) -> dict[str, Any]:
        request = self._request
        kwargs: dict[str, Any] = {}
        self._servicer._released_fields(request, sampling, kwargs)
        if request.priority:
            # Lower runs first: a class across tenants (fair_work.py), checked
            # against the caller's floor with the budgets.
            kwargs["priority"] = request.priority
        if request.HasField("session_id") and request.session_id:
            kwargs["session_id"] = request.session_id
        return kwargs

    def tokenization(self) -> dict[str, Any] | None:
        return wire.tokenization_kwargs(self._request)

    def prompt(self, limit: int | None) -> Any:
        return wire.prompt_from_request(self._request, limit)

    async def with_media(self, prompt: Any, media: RequestMedia | None) -> tuple[Any, str | None]:
        if not self._request.media:
            return prompt, None
        return await self._servicer._with_media(self._request, prompt, media), "media"

    def builder(self) -> ResponseBuilder:
        return ResponseBuilder(self._request.response)

    def adapter(self) -> AdapterHold:
        return self._servicer.loras.hold(self._request.lora_name)


def _summary(request: pb.GenerateRequest) -> RequestSummary:
    """What a request asks for, in no protocol's terms (proto3 zeros are unset).

    One sequence: `num_sequences` above 1 is refused.
    """
    max_new_tokens = request.stopping.max_new_tokens
    sampling = request.sampling
    return RequestSummary(
        "text_completion",
        request.request_id,
        max_tokens=max_new_tokens or None,
        temperature=request.temperature if request.HasField("temperature") else None,
        top_p=sampling.top_p if sampling.HasField("top_p") else None,
    )


def _runs_reasoning_parser(engine: Any) -> bool:
    """Whether the engine runs a reasoning parser (`--reasoning-parser`), which vLLM's
    thinking budget needs to tell thinking tokens from the answer."""
    reasoning = getattr(engine.vllm_config, "reasoning_config", None)
    return bool(getattr(reasoning, "enabled", False))


def _model_defaults(model_config: Any) -> wire.ModelDefaults:
    """The model's generation-config defaults (none when it has no readable config)."""
    get_diff = getattr(model_config, "get_diff_sampling_param", None)
    if get_diff is None:
        return wire.ModelDefaults()
    try:
        return wire.ModelDefaults.of(get_diff() or {})
    except Exception:  # a malformed generation config must not stop the server
        logger.warning("the model's generation config is unreadable; neutral defaults used")
        return wire.ModelDefaults()
