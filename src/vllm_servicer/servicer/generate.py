"""Generate's preparation: a GenerateRequest as the engine call it asks for.

The stream loop stays in the servicer's Generate itself: a generator between
it and grpc would cost a hop per message sent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..budgets import RequestBudgets
from ..context import engine_trace_headers
from ..engine import EngineClient
from ..errors import InvalidRequestError, UnimplementedFieldError
from ..multimodal import tensors as mm_tensors
from ..multimodal.decoded import RequestMedia
from ..multimodal.media import MediaResolver
from ..proto import vllm_engine_pb2 as pb
from ..ranks import engine_index, engine_index_if_served
from ..wire import convert, fields
from .engine_call import EngineCallSteps

if TYPE_CHECKING:
    import grpc.aio

    Context = grpc.aio.ServicerContext[Any, Any]


class Generation:
    """How one engine turns GenerateRequests into `engine.generate` calls.

    Args:
        engine: the engine served.
        media: the resolver of images named by URL; None when they are off.
        model_media: the preprocessed tensors (mm_inputs) the model takes.
        steps: the engine call's steps every protocol takes (engine_call.py).
        budgets: what one request may cost (`n`, constraints, shared memory).
    """

    def __init__(
        self,
        engine: EngineClient,
        *,
        media: MediaResolver | None,
        model_media: mm_tensors.ModelMedia,
        steps: EngineCallSteps,
        budgets: RequestBudgets | None = None,
    ) -> None:
        self._engine = engine
        self._budgets = budgets if budgets is not None else RequestBudgets()
        self._media = media
        self._model_media = model_media
        self._steps = steps

    async def engine_call(
        self,
        request: pb.GenerateRequest,
        context: Context,
        kv_transfer: dict[str, Any] | None,
        media: RequestMedia,
    ) -> tuple[Any, Any, dict[str, Any]]:
        """The prompt, sampling parameters and keyword arguments of `engine.generate`.

        Args:
            request: the request; its unserved fields were refused already.
            context: the call's context (its trace headers go to the engine).
            kv_transfer: the request's KV transfer parameters, if any.
            media: the request's account of decoded images (released by the caller).

        Raises:
            UnsupportedError, InvalidRequestError, UnimplementedFieldError: the
                request asks for what this engine cannot do, is malformed, or
                passes a budget.
            RoutingDataError: KV transfer parameters from a caller who is no router.
            BudgetFullError: the process's decoded-media budget is full.
        """
        steps = self._steps
        self._check_budgets(request.sampling_params)
        if kv_transfer is not None:
            json_set = request.HasField("kv_transfer_params_json")
            field = "kv_transfer_params_json" if json_set else "kv_transfer_params"
            steps.check_kv_transfer(field)
        params = request.sampling_params
        sampling = convert.sampling_params_from_proto(
            params, stream=request.stream, kv_transfer=kv_transfer
        )
        steps.check_seed(sampling, "sampling_params.seed")
        steps.pace(sampling)
        tokenization = convert.tokenization_kwargs(params)
        prompt = convert.prompt_from_request(request, steps.prompt_limit(tokenization is not None))
        images = request.HasField("media_refs")
        tensors = mm_tensors.sent(request)
        if tensors:
            # The router's own processor output: the engine input as it stands.
            prompt = await mm_tensors.engine_input(
                request,
                prompt,
                self._model_media,
                max_shm_bytes=self._budgets.max_request_shm_bytes,
            )
        elif images:
            # vLLM's processor expands each image placeholder, off the event loop.
            prompt = await self._with_images(request, prompt, media)
        kwargs: dict[str, Any] = {}
        if tokenization is not None:
            kwargs["tokenization_kwargs"] = tokenization
        elif not isinstance(prompt, str) and not images and not tensors:
            prompt = steps.render_tokens(prompt)
        if request.HasField("data_parallel_rank"):
            kwargs["data_parallel_rank"] = engine_index(self._engine, request.data_parallel_rank)
        trace = engine_trace_headers(context)
        if trace is not None:
            kwargs["trace_headers"] = trace
        if convert.grammar_from_first_token(params):
            kwargs["reasoning_ended"] = True
        return steps.salted(prompt), sampling, kwargs

    def _check_budgets(self, params: pb.SamplingParams) -> None:
        """Refuse sampling parameters past a budget, before anything is built from them."""
        self._budgets.check_n("sampling_params.n", params.n)
        self._budgets.check_stop("sampling_params.stop", params.stop)
        constraint = convert.constraint_size(params)
        if constraint is not None:
            self._budgets.check_constraint(*constraint)

    async def _with_images(
        self, request: pb.GenerateRequest, prompt: Any, media: RequestMedia
    ) -> Any:
        """`prompt` with the images of `request.media_refs` as its multimodal data."""
        if self._media is None or not self._media.takes_images:
            raise UnimplementedFieldError("media_refs", fields.MEDIA_REFS_HINT)
        if isinstance(prompt, str):
            # As the reference server: the router tokenizes, placeholders included.
            raise InvalidRequestError(
                "media_refs", "needs tokenized input (token ids with one placeholder per image)"
            )
        images = await self._media.images(request.media_refs, media)
        prompt["multi_modal_data"] = {"image": images[0] if len(images) == 1 else images}
        if convert.tokenization_kwargs(request.sampling_params) is not None:
            return prompt  # the engine processes it (truncating it first)
        return await self._steps.render_with_images(prompt, "media_refs")

    async def kv_transfer_rejected(
        self, request: pb.GenerateRequest, request_id: str, kv_transfer: dict[str, Any]
    ) -> None:
        """Tell the KV connector a remote-prefill request failed before the engine ran it
        (`EngineCallSteps.kv_transfer_rejected`)."""
        rank = request.data_parallel_rank if request.HasField("data_parallel_rank") else None
        rank = engine_index_if_served(self._engine, rank)
        await self._steps.kv_transfer_rejected(request_id, kv_transfer, rank)
