"""`PoolingServicer`: vllm_servicer.v1.Pooling (Classify, Score, Rerank).

Each call is the HTTP body vLLM's /classify, /score or /rerank would take
(`wire/pooling.py`), answered by vLLM's own handler on the mount's engine
(`vllm_app.py`), its answer read back into the reply. One engine request per
text (vLLM's batching), each claimed for the caller; the texts a call may
carry are bounded by `--max-pooling-inputs`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..context import engine_trace_headers, kept_usage
from ..proto import pooling_pb2 as pb
from ..proto import pooling_pb2_grpc
from ..wire import pooling as wire
from ..wire.usage import RequestSummary
from .state import MountState
from .vllm_app import VllmHandlers, answer_body, trace_headers, vllm_request

if TYPE_CHECKING:
    import grpc.aio

    from ..options import MountOptions

    Context = grpc.aio.ServicerContext[Any, Any]


class PoolingServicer(pooling_pb2_grpc.PoolingServicer):
    """Serves vllm_servicer.v1.Pooling with vLLM's own pooling handlers.

    Args:
        state: the mount's shared state (its engine, running ids and vLLM's handlers).
        options: the mount's options (the budgets).
    """

    def __init__(self, state: MountState, options: MountOptions) -> None:
        self._handlers: VllmHandlers = state.handlers
        self._budgets = options.budgets

    async def Classify(self, request: pb.ClassifyRequest, context: Context) -> pb.ClassifyResponse:
        self._budgets.check_pooling_inputs("input", len(request.input))
        body = await self._answer(
            "classify",
            request.request_id,
            request.options.model,
            lambda limits: wire.classify_body(request, limits),
            "serving_classification",
            "classify texts",
            context,
        )
        reply = wire.classify_response(body, request.request_id)
        _record(reply.prompt_tokens)
        return reply

    async def Score(self, request: pb.ScoreRequest, context: Context) -> pb.ScoreResponse:
        self._budgets.check_pooling_inputs("text_2", len(request.text_2))
        body = await self._answer(
            "score",
            request.request_id,
            request.options.model,
            lambda limits: wire.score_body(request, limits),
            "serving_scores",
            "score text pairs",
            context,
        )
        reply = wire.score_response(body, request.request_id)
        _record(reply.prompt_tokens)
        return reply

    async def Rerank(self, request: pb.RerankRequest, context: Context) -> pb.RerankResponse:
        self._budgets.check_pooling_inputs("documents", len(request.documents))
        body = await self._answer(
            "rerank",
            request.request_id,
            request.options.model,
            lambda limits: wire.rerank_body(request, limits),
            "serving_scores",
            "rerank documents",
            context,
        )
        reply = wire.rerank_response(body, request.request_id, request.return_documents)
        _record(reply.prompt_tokens)
        return reply

    async def _answer(
        self,
        operation: str,
        request_id: str,
        model: str,
        build: Callable[[wire.ModelLimits], dict[str, Any]],
        handler_name: str,
        what: str,
        context: Context,
    ) -> Mapping[str, Any]:
        usage = kept_usage()
        if usage is not None:
            usage.request = RequestSummary(operation, request_id)
        handlers = self._handlers
        handlers.check_model("options.model", model)
        handler = await handlers.handler(handler_name, "classify", what)
        body = build(handlers.limits())
        token = trace_headers.set(engine_trace_headers(context))
        try:
            async with handlers.claiming.claims_of_call():
                answer = await handler(vllm_request(operation, body), None)
        finally:
            trace_headers.reset(token)
        result: Mapping[str, Any] = answer_body(answer)
        return result


def _record(prompt_tokens: int) -> None:
    usage = kept_usage()
    if usage is not None:
        usage.prompt_tokens = prompt_tokens
