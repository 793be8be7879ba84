"""Generate's preparation: a GenerateRequest as the engine call it asks for.

The stream loop stays in the servicer's Generate itself: a generator between
it and grpc would cost a hop per message sent.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from .. import vllm_releases
from ..budgets import RequestBudgets
from ..context import engine_trace_headers
from ..engine import EngineClient
from ..errors import InvalidRequestError, UnimplementedFieldError, UnsupportedError
from ..multimodal import tensors as mm_tensors
from ..multimodal.decoded import RequestMedia
from ..multimodal.media import MediaResolver
from ..proto import vllm_engine_pb2 as pb
from ..wire import convert, fields

if TYPE_CHECKING:
    import grpc.aio

    Context = grpc.aio.ServicerContext[Any, Any]

logger = logging.getLogger("vllm_servicer")


class Generation:
    """How one engine turns GenerateRequests into `engine.generate` calls.

    Args:
        engine: the engine served.
        media: the resolver of images named by URL; None when they are off.
        model_media: the preprocessed tensors (mm_inputs) the model takes.
        budgets: what one request may cost (`n`, constraints, shared memory).
    """

    def __init__(
        self,
        engine: EngineClient,
        *,
        media: MediaResolver | None,
        model_media: mm_tensors.ModelMedia,
        budgets: RequestBudgets | None = None,
    ) -> None:
        self._engine = engine
        self._budgets = budgets if budgets is not None else RequestBudgets()
        self._media = media
        self._model_media = model_media
        # A token prompt past the model's context is refused by its length alone.
        max_len = getattr(engine.model_config, "max_model_len", None)
        self._max_prompt_tokens: int | None = int(max_len) if max_len else None
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

    @property
    def max_prompt_tokens(self) -> int | None:
        """The longest token prompt the model takes (its context), when known."""
        return self._max_prompt_tokens

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
            BudgetFullError: the process's decoded-media budget is full.
        """
        self._check_budgets(request.sampling_params)
        if kv_transfer is not None and self._kv_connector is None:
            json_set = request.HasField("kv_transfer_params_json")
            name = "kv_transfer_params_json" if json_set else "kv_transfer_params"
            raise UnsupportedError(fields.KV_CONNECTOR_HINT, field=name)
        params = request.sampling_params
        sampling = convert.sampling_params_from_proto(
            params, stream=request.stream, kv_transfer=kv_transfer
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
        return prompt, sampling, kwargs

    def _check_budgets(self, params: pb.SamplingParams) -> None:
        """Refuse sampling parameters past a budget, before anything is built from them."""
        self._budgets.check_n("sampling_params.n", params.n)
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

    async def kv_transfer_rejected(
        self, request: pb.GenerateRequest, request_id: str, kv_transfer: dict[str, Any]
    ) -> None:
        """Tell the KV connector a remote-prefill request failed before the engine ran it.

        The prefill side holds the request's blocks until the decode side takes
        them; without this they stay pinned until the connector's lease expires.
        A cancelled call is not reported: once the engine holds the request, its
        abort runs the connector's hook itself.
        """
        if self._kv_connector is None:
            return
        rank = request.data_parallel_rank if request.HasField("data_parallel_rank") else None
        await notify_kv_rejection(self._engine, request_id, kv_transfer, rank)


async def notify_kv_rejection(
    engine: Any, request_id: str, kv_transfer: dict[str, Any], rank: int | None
) -> None:
    """Tell the engine's KV connector that a remote-prefill request was rejected
    (a request without `do_remote_prefill` holds nothing); a failure is logged."""
    if not kv_transfer.get("do_remote_prefill"):
        return
    try:
        await engine.notify_kv_transfer_request_rejected(
            request_id, kv_transfer, data_parallel_rank=rank
        )
    except Exception:
        logger.warning(
            "could not tell the KV connector that request %r was rejected",
            request_id,
            exc_info=True,
        )
