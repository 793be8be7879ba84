"""`PoolingServicer`: vllm_servicer.v1.Pooling (Classify, Score, Rerank).

Each call is the request vLLM's /classify, /score or /rerank would take
(`wire/pooling.py`), run by vLLM's own handler on the mount's engine
(`vllm_app.py`) up to its outputs (`vllm_releases.pooling_outputs`), which
become the reply without the JSON answer vLLM would write. One engine request per
text (vLLM's batching), each claimed for the caller; the texts a call may
carry are bounded by `--max-pooling-inputs`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from ..context import engine_trace_headers, priority_floor
from ..proto import pooling_pb2 as pb
from ..proto import pooling_pb2_grpc
from ..vllm_releases import pooling_outputs
from ..wire import pooling as wire
from .state import MountState
from .vllm_app import (
    VllmHandlers,
    answer_body,
    classify_answer,
    note_prompt_tokens,
    note_request,
    rerank_answer,
    score_answer,
    trace_headers,
    vllm_request,
)

if TYPE_CHECKING:
    import grpc.aio
    from vllm.entrypoints.pooling.base.serving import PoolingServing
    from vllm.entrypoints.pooling.typing import PoolingServeContext

    Context = grpc.aio.ServicerContext[Any, Any]

_PoolingRequest = pb.ClassifyRequest | pb.ScoreRequest | pb.RerankRequest


class PoolingServicer(pooling_pb2_grpc.PoolingServicer):
    """Serves vllm_servicer.v1.Pooling with vLLM's own pooling handlers.

    Args:
        state: the mount's shared state (its engine, running ids and vLLM's handlers).
    """

    def __init__(self, state: MountState) -> None:
        self._handlers: VllmHandlers = state.handlers
        self._budgets = state.options.budgets

    async def Classify(self, request: pb.ClassifyRequest, context: Context) -> pb.ClassifyResponse:
        body = await self._answer(_CLASSIFY, request, context)
        return _noted(wire.classify_response(body, request.request_id), request)

    async def Score(self, request: pb.ScoreRequest, context: Context) -> pb.ScoreResponse:
        body = await self._answer(_SCORE, request, context)
        return _noted(wire.score_response(body, request.request_id), request)

    async def Rerank(self, request: pb.RerankRequest, context: Context) -> pb.RerankResponse:
        body = await self._answer(_RERANK, request, context)
        reply = wire.rerank_response(body, request.request_id, request.return_documents)
        return _noted(reply, request)

    async def _answer(
        self, route: _Route, request: _PoolingRequest, context: Context
    ) -> Mapping[str, Any]:
        """vLLM's answer to `request` on `route`, its engine requests claimed for the caller."""
        note_request(route.operation, request.request_id)
        budgets = self._budgets
        budgets.check_pooling_inputs(route.texts, len(getattr(request, route.texts)))
        floor = priority_floor(budgets.min_tenant_priority)
        budgets.check_priority("options.priority", request.options.priority, floor)
        handlers = self._handlers
        handlers.check_model("options.model", request.options.model)
        handler = await handlers.handler(route.handler, "classify", route.what)
        body = route.body(request, handlers.limits())
        self._budgets.check_pooling_chars(route.texts, _tokenized_chars(route, body))
        token = trace_headers.set(engine_trace_headers(context))
        try:
            # Held until the engine requests end: no unload drops it from under them.
            with handlers.adapter("options.model", request.options.model) as adapter:
                async with handlers.claiming.claims_of_call(adapter):
                    vllm_call = vllm_request(route.operation, body)
                    outputs = await pooling_outputs(handler, vllm_call)
                    if outputs is None:  # a path of its own: its JSON answer
                        result: Mapping[str, Any] = answer_body(await handler(vllm_call, None))
                        return result
                    return route.answer(handler, outputs)
        finally:
            trace_headers.reset(token)


class _Route(NamedTuple):
    """One RPC as vLLM's HTTP route it maps to."""

    operation: str  # the call record's operation, and vLLM's request model
    texts: str  # the repeated field whose texts are each an engine request
    pair: str | None  # the text paired with each of them (a query), if any
    handler: str  # vLLM's handler object (its app state's attribute)
    what: str  # what the call asks for, in a refusal
    body: Callable[[Any, wire.ModelLimits], dict[str, object]]
    # vLLM's answer body from its outputs
    answer: Callable[[PoolingServing, PoolingServeContext[Any]], dict[str, object]]


_CLASSIFY = _Route(
    "classify",
    "input",
    None,
    "serving_classification",
    "classify texts",
    wire.classify_body,
    classify_answer,
)
_SCORE = _Route(
    "score", "text_2", "text_1", "serving_scores", "score text pairs", wire.score_body, score_answer
)
_RERANK = _Route(
    "rerank",
    "documents",
    "query",
    "serving_scores",
    "rerank documents",
    wire.rerank_body,
    rerank_answer,
)


def _tokenized_chars(route: _Route, body: Mapping[str, Any]) -> int:
    """What vLLM tokenizes for the body: each text, and the query once per text."""
    texts = body[route.texts]
    paired = len(body[route.pair]) * len(texts) if route.pair else 0
    return paired + sum(len(text) for text in texts)


_Reply = TypeVar("_Reply", pb.ClassifyResponse, pb.ScoreResponse, pb.RerankResponse)


def _noted(reply: _Reply, request: _PoolingRequest) -> _Reply:
    """`reply`, its tokens in the call record and the model named as the request named it
    (vLLM's handler ran the served model's name; an adapter went to the engine apart)."""
    note_prompt_tokens(reply.prompt_tokens)
    if request.options.model:
        reply.model = request.options.model
    return reply
