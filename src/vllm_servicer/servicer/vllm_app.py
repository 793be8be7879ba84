"""vLLM's own HTTP handlers on the mount's engine, for the Pooling and Render services.

Classify, Score, Rerank and rendering are what vLLM's HTTP server answers at
/classify, /score, /rerank and /v1/.../render. Rather than a second copy of
that logic, the services call vLLM's own handler objects, built once per
mount by vLLM's own `init_app_state` with its frontend defaults: the same
renderer (one tokenizer and chat template, the engine's), the same
tokenization of pairs, the same activation, so the numbers and tokens are
vLLM's on every release.

The handlers get `ClaimingEngine` instead of the engine: each engine request
they start (one per text of a batch) is claimed for the gRPC caller by the
one claim path (`RunningRequests.claim`, a `tenancy.Claim`), as every other
protocol's requests are, and released however it ends. The call itself took
its in-flight slot in the interceptors.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar, cast

from ..context import kept_usage
from ..engine import EngineClient, served_model_name
from ..errors import InvalidRequestError, NotFoundError, UnsupportedError
from ..wire.pooling import ModelLimits
from ..wire.usage import RequestSummary
from .lora import BASE_MODEL, AdapterHold, LoraRegistry
from .tenancy import Claim
from .tenant_engine import TenantEngine

if TYPE_CHECKING:
    import pydantic
    from starlette.datastructures import State
    from vllm.engine.protocol import EngineClient as VllmEngineClient
    from vllm.entrypoints.pooling.base.serving import PoolingServing
    from vllm.entrypoints.pooling.classify.protocol import ClassificationCompletionRequest
    from vllm.entrypoints.pooling.scoring.protocol import RerankRequest, ScoreTextRequest
    from vllm.entrypoints.pooling.typing import AnyPoolingRequest, PoolingServeContext
    from vllm.lora.request import LoRARequest
    from vllm.outputs import PoolingRequestOutput
    from vllm.tasks import SupportedTask
    from vllm.tokenizers import TokenizerLike

_Request = TypeVar("_Request", bound="AnyPoolingRequest")

__all__ = [
    "ClaimingEngine",
    "VllmHandlers",
    "answer_body",
    "classify_answer",
    "note_prompt_tokens",
    "note_request",
    "rendered",
    "rerank_answer",
    "score_answer",
    "trace_headers",
    "vllm_request",
]

logger = logging.getLogger(__name__)


_call_claims: contextvars.ContextVar[list[Claim] | None] = contextvars.ContextVar(
    "vllm_servicer_handler_claims", default=None
)

_call_adapter: contextvars.ContextVar[LoRARequest | None] = contextvars.ContextVar(
    "vllm_servicer_handler_adapter", default=None
)

trace_headers: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "vllm_servicer_handler_trace_headers", default=None
)
"""The W3C trace headers of the call being served, handed to the engine with
each request vLLM's handlers start (they read none from a gRPC call)."""


class ClaimingEngine:
    """The engine as vLLM's handlers see it: every `encode` claimed for the caller.

    Everything else is the engine's own.

    Args:
        tenant: the mount's engine, with tenancy's promises (`TenantEngine`).
        method: what the log names as running the request.
    """

    def __init__(self, tenant: TenantEngine, method: str) -> None:
        self.tenant = tenant
        self._engine = tenant.engine
        self._method = method

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def encode(self, *args: Any, **kwargs: Any) -> AsyncGenerator[PoolingRequestOutput, None]:
        # vLLM's handlers pass every argument by name; the id is the third positionally.
        request_id = kwargs["request_id"] if "request_id" in kwargs else args[2]
        if kwargs.get("trace_headers") is None:
            kwargs["trace_headers"] = trace_headers.get()
        adapter = _call_adapter.get()
        if adapter is not None:
            # vLLM's handlers know only the adapters of their own registry.
            kwargs["lora_request"] = adapter
        # Each text the caller's tenant's own in the prefix cache.
        if "prompt" in kwargs:
            kwargs["prompt"] = self.tenant.keyed(kwargs["prompt"])
        elif args:
            args = (self.tenant.keyed(args[0]), *args[1:])
        return self._claimed(request_id, lambda: self.tenant.encode(*args, **kwargs))

    async def _claimed(
        self, request_id: str, start: Callable[[], AsyncGenerator[PoolingRequestOutput, None]]
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        # Claimed from the first read to the end, an error or a close (a
        # cancelled call closes it; the engine aborts the request then).
        # (A cancel once released aborts nothing: the call ended, aborting its
        # claims, and the id may be another caller's now; vLLM's merge cancels
        # its reads late.)
        claim = self.tenant.claim(request_id, self._method)
        held = _call_claims.get()
        if held is not None:
            held.append(claim)
        async for output in self.tenant.run(claim, start):
            yield output

    @contextlib.asynccontextmanager
    async def claims_of_call(self, adapter: LoRARequest | None = None) -> AsyncIterator[None]:
        """Every engine request the block starts ends with it, released and aborted,
        and runs on `adapter` (a LoRA adapter of the mount's registry) when given.

        vLLM's handler leaves the other texts' requests running when one of a
        batch fails (its merged iterator is never closed, only collected):
        their ids and engine work would outlive the call and its in-flight slot.
        """
        held: list[Claim] = []
        token = _call_claims.set(held)
        adapter_token = _call_adapter.set(adapter)
        try:
            yield
        finally:
            _call_adapter.reset(adapter_token)
            _call_claims.reset(token)
            left = [claim for claim in held if not claim.released]
            try:
                if left:  # out of the engine before their ids are free to reuse
                    await self._engine.abort([claim.request_id for claim in left])
            finally:
                for claim in left:
                    claim.release()


class VllmHandlers:
    """vLLM's HTTP handler objects on one engine, built at first use.

    Args:
        tenant: the mount's engine, with tenancy's promises (`TenantEngine`):
            each engine request the handlers start is claimed and keyed there.
        loras: the mount's LoRA adapters, which a request names as its model.
        chat_template: a chat template (a file or the template itself) to use
            instead of the model's, as vLLM's `--chat-template`.
        tool_call_parser: vLLM's tool-call parser by name, as its `--tool-call-parser`
            (the reasoning parser is the engine's own, `--reasoning-parser`).
        enable_auto_tool_choice: as vLLM's `--enable-auto-tool-choice`.
    """

    def __init__(
        self,
        tenant: TenantEngine,
        loras: LoraRegistry,
        chat_template: str | None = None,
        *,
        tool_call_parser: str | None = None,
        enable_auto_tool_choice: bool = False,
    ) -> None:
        engine: EngineClient = tenant.engine
        self._engine = engine
        self._loras = loras
        self._chat_template = chat_template
        self._tool_call_parser = tool_call_parser
        self._enable_auto_tool_choice = enable_auto_tool_choice
        self._state: State | None = None
        self._tasks: tuple[SupportedTask, ...] = ()
        self._lock = asyncio.Lock()
        self.claiming = ClaimingEngine(tenant, "pooling")
        self.served_model = served_model_name(engine)
        self._limits: ModelLimits | None = None
        self._vocabulary: int | None = None
        self._eos_ids: frozenset[int] | None = None

    def limits(self) -> ModelLimits:
        """The served model's limits, read once (the longest token from its vocabulary)."""
        if self._limits is None:
            config = getattr(self._engine, "model_config", None)
            max_len = int(getattr(config, "max_model_len", 0) or 0) or None
            tokenizer = self.tokenizer()
            max_chars = None
            if max_len is not None:
                vocabulary = tokenizer.get_vocab()
                longest = max((len(token) for token in vocabulary), default=0)
                max_chars = max_len * longest if longest else None
            side = str(getattr(tokenizer, "truncation_side", "right"))
            self._limits = ModelLimits(self.served_model, max_len, max_chars, side)
        return self._limits

    async def handler(self, name: str, needs: str, what: str) -> Any:
        """vLLM's handler `name` (`serving_scores`, ...), or refuse the call.

        Args:
            name: the attribute of vLLM's app state.
            needs: the engine task it needs ("classify", "generate", ...), for the refusal.
            what: what the call asked for, for the refusal.

        Raises:
            UnsupportedError: the engine's model does not do it (FAILED_PRECONDITION).
        """
        state = await self._built()
        found = getattr(state, name, None)
        if found is None:
            raise UnsupportedError(
                f"this server's model does not {what} (its tasks: {', '.join(self._tasks)}); "
                f"serve a model with the {needs!r} task"
                + (" (vLLM: --runner pooling)" if needs != "generate" else "")
            )
        return found

    def check_model(self, field: str, model: str) -> None:
        """Refuse a model name that is neither the served model's ("" is) nor an adapter's.

        An adapter is one of the mount's registry (`--lora-modules`, or loaded
        through vllm.Control), as Generate's `lora_name` takes. vLLM's handlers
        run the base model for a name they do not know; a name this server
        does not serve is refused instead, never ignored.

        Raises:
            NotFoundError: `model` is neither the served model nor an adapter.
        """
        if model and model != self.served_model and model not in self._loras:
            adapters = ", ".join(repr(adapter.name) for adapter in self._loras.list())
            raise NotFoundError(
                field,
                f"{model!r} is not served here; this server serves {self.served_model!r}"
                + (f" and the LoRA adapters {adapters}" if adapters else ""),
            )

    def adapter(self, field: str, model: str) -> AdapterHold:
        """The LoRA adapter a request's model name names, held until released
        (`with handlers.adapter(...) as lora_request:`); `BASE_MODEL` for the served model.

        Raises:
            NotFoundError: `model` is neither the served model nor an adapter.
        """
        self.check_model(field, model)
        if not model or model == self.served_model:
            return BASE_MODEL
        return self._loras.hold(model)

    def text_of(self, token_ids: list[int]) -> str:
        """`token_ids` as text, special tokens included.

        Through the fast tokenizer's own decoder when there is one: the same
        text as transformers' `decode` with no clean-up of spaces, which first
        walks the ids in Python (most of a render's decoding time).
        """
        tokenizer = self.tokenizer()
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
            return str(backend.decode(token_ids, skip_special_tokens=False))
        return str(tokenizer.decode(token_ids, skip_special_tokens=False))

    def vocabulary(self) -> int:
        """How many tokens the engine's tokenizer has (its added ones included), read once."""
        if self._vocabulary is None:
            self._vocabulary = len(self.tokenizer())
        return self._vocabulary

    def eos_ids(self) -> frozenset[int]:
        """The ids that end a generation as its EOS (no stop reason): the
        tokenizer's EOS and the generation config's, as the engine stops on
        them; read once."""
        if self._eos_ids is None:
            ids: set[int] = set()
            eos = getattr(self.tokenizer(), "eos_token_id", None)
            if isinstance(eos, int):
                ids.add(eos)
            config = getattr(self._engine, "model_config", None)
            read = getattr(config, "try_get_generation_config", None)
            generation = read() if callable(read) else None
            configured = (generation or {}).get("eos_token_id")
            if isinstance(configured, int):
                ids.add(configured)
            elif isinstance(configured, list):
                ids.update(i for i in configured if isinstance(i, int))
            self._eos_ids = frozenset(ids)
        return self._eos_ids

    def tokenizer(self) -> TokenizerLike:
        """The engine's tokenizer (the renderer's own)."""
        return self._engine.renderer.get_tokenizer()

    async def _built(self) -> State:
        if self._state is not None:
            return self._state
        async with self._lock:
            if self._state is None:
                self._state = await self._build()
        return self._state

    async def _build(self) -> State:
        from starlette.datastructures import State
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state

        from ..vllm_releases import serve_defaults

        args = serve_defaults()
        config = self._engine.model_config
        args.model = config.model
        args.served_model_name = [self.served_model]
        args.chat_template = self._chat_template
        args.tool_call_parser = self._tool_call_parser
        args.enable_auto_tool_choice = self._enable_auto_tool_choice
        with_engine_parsers(args, self._engine)
        self._tasks = tuple(await self._engine.get_supported_tasks())
        state = State()
        # The claiming engine passes for vLLM's client: what it does not
        # define itself is the engine's own (`ClaimingEngine.__getattr__`).
        await init_app_state(cast("VllmEngineClient", self.claiming), state, args, self._tasks)
        logger.info(
            "vLLM's handlers for Pooling and Render built (tasks: %s)", ", ".join(self._tasks)
        )
        return state


def with_engine_parsers(args: argparse.Namespace, engine: object) -> None:
    """Give vLLM's parsed serve arguments the engine's own structured-output
    settings (its `--reasoning-parser` among them), which vLLM's handlers read
    from the arguments rather than from the engine."""
    config = getattr(getattr(engine, "vllm_config", None), "structured_outputs_config", None)
    if config is not None:
        args.structured_outputs_config = config


def _request_model(kind: str) -> type[pydantic.BaseModel]:
    """vLLM's request model for each call, by its HTTP route's body (the same
    module paths in every supported release; imported where the checks of the
    next release can see them)."""
    if kind == "classify":
        from vllm.entrypoints.pooling.classify.protocol import ClassificationCompletionRequest

        return ClassificationCompletionRequest
    if kind == "score":
        from vllm.entrypoints.pooling.scoring.protocol import ScoreTextRequest

        return ScoreTextRequest
    if kind == "rerank":
        from vllm.entrypoints.pooling.scoring.protocol import RerankRequest

        return RerankRequest
    if kind == "render_chat":
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        return ChatCompletionRequest
    if kind == "render_completion":
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        return CompletionRequest
    if kind == "derender_chat":
        from vllm.entrypoints.scale_out.token_in_token_out.protocol import DerenderChatRequest

        return DerenderChatRequest
    if kind == "derender_completion":
        from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
            DerenderCompletionRequest,
        )

        return DerenderCompletionRequest
    if kind == "derender_chat_stream":
        from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
            DerenderChatStreamRequest,
        )

        return DerenderChatStreamRequest
    if kind == "derender_completion_stream":
        from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
            DerenderCompletionStreamRequest,
        )

        return DerenderCompletionStreamRequest
    raise ValueError(f"no vLLM request model for {kind!r}")


def vllm_request(kind: str, body: Mapping[str, object]) -> Any:
    """vLLM's request model of `kind` for the HTTP body `body`.

    Raises:
        InvalidRequestError: vLLM's validation refused it, named by the field
            (the body's keys are the wire's field names).
    """
    import pydantic

    try:
        return _request_model(kind).model_validate(body)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first.get("loc", ())) or "request"
        raise InvalidRequestError(field, str(first.get("msg", exc))) from None


def rendered(answer: Any) -> list[dict[str, Any]]:
    """The prompts of a render (`vllm_releases.render_prompts`) as a reply reads
    them: each its token ids and its multimodal features' hashes and
    placeholders (None for text); vLLM's error as `answer_body` raises it."""
    if not isinstance(answer, list):
        answer_body(answer)
        raise RuntimeError(f"vLLM's render handler answered {type(answer).__name__}")
    return [
        {
            "token_ids": prompt["token_ids"],
            "features": prompt["features"].model_dump(include={"mm_hashes", "mm_placeholders"})
            if prompt["features"] is not None
            else None,
        }
        for prompt in answer
    ]


def classify_answer(
    handler: PoolingServing, ctx: PoolingServeContext[ClassificationCompletionRequest]
) -> dict[str, object]:
    """The body of vLLM's /classify answer from its handler's outputs
    (`vllm_releases.pooling_outputs`), as `ServingClassification._build_response`
    writes it (alike in 0.31 to 0.34): per text its probabilities, the label of
    the likeliest class, and the prompt tokens of every text."""
    import numpy as np
    from vllm.outputs import ClassificationOutput

    id2label = getattr(handler.model_config.hf_config, "id2label", None) or {}
    data = []
    tokens = 0
    for index, output in enumerate(ctx.final_res_batch):
        probs = ClassificationOutput.from_base(output.outputs).probs
        label = id2label.get(int(np.argmax(probs)))
        data.append({"index": index, "label": label, "probs": probs})
        tokens += len(output.prompt_token_ids)
    return {"model": ctx.model_name, "data": data, "usage": {"prompt_tokens": tokens}}


def _scores(ctx: PoolingServeContext[_Request]) -> list[float]:
    from vllm.outputs import ScoringRequestOutput

    return [ScoringRequestOutput.from_base(output).outputs.score for output in ctx.final_res_batch]


def _scored_tokens(handler: PoolingServing, ctx: PoolingServeContext[_Request]) -> dict[str, int]:
    # vLLM counts the prompts it built (each pair's), not the outputs'.
    assert ctx.engine_inputs is not None  # vLLM's preprocessing set them, as its own answer reads
    tokens = sum(handler._extract_prompt_len(item["prompts"]) for item in ctx.engine_inputs)
    return {"prompt_tokens": tokens}


def score_answer(
    handler: PoolingServing, ctx: PoolingServeContext[ScoreTextRequest]
) -> dict[str, object]:
    """The body of vLLM's /score answer from its handler's outputs, as
    `ServingScores._request_output_to_score_response` writes it (alike in 0.31 to 0.34)."""
    data = [{"index": index, "score": score} for index, score in enumerate(_scores(ctx))]
    return {"model": ctx.model_name, "data": data, "usage": _scored_tokens(handler, ctx)}


def rerank_answer(
    handler: PoolingServing, ctx: PoolingServeContext[RerankRequest]
) -> dict[str, object]:
    """The body of vLLM's /rerank answer from its handler's outputs, as
    `ServingScores._request_output_to_rerank_response` writes it (alike in 0.31
    to 0.34): the documents by relevance, highest first (equal ones in their
    order), the first `top_n` of them when it is set."""
    documents = ctx.request.documents
    if not isinstance(documents, list):
        documents = [documents]
    results: list[_Ranked] = [
        {
            "index": index,
            "document": {"text": document if isinstance(document, str) else None},
            "relevance_score": score,
        }
        for index, (document, score) in enumerate(zip(documents, _scores(ctx), strict=False))
    ]
    results.sort(key=lambda item: float(item["relevance_score"]), reverse=True)
    top_n = ctx.request.top_n if ctx.request.top_n > 0 else len(ctx.final_res_batch)
    if top_n < len(documents):
        results = results[:top_n]
    return {"model": ctx.model_name, "results": results, "usage": _scored_tokens(handler, ctx)}


class _Ranked(TypedDict):
    """One document of vLLM's /rerank answer."""

    index: int
    document: dict[str, str | None]
    relevance_score: float


def answer_body(answer: Any) -> Any:
    """The JSON body of a vLLM handler's answer; its error as this package's exception.

    vLLM's handlers answer with a `JSONResponse` or an `ErrorResponse` (whose
    HTTP code picks the exception: 400 a request fault, 404 an unknown model,
    501 a feature the model lacks).

    Raises:
        ValueError: vLLM refused the request (INVALID_ARGUMENT).
        NotFoundError: the model named is not served.
        UnsupportedError: the model cannot do it.
        RuntimeError: any other failure (INTERNAL).
    """
    error = getattr(answer, "error", None)
    if error is not None and hasattr(error, "code"):
        _raise(int(error.code), str(error.message))
    data = json.loads(answer.body)
    status = int(getattr(answer, "status_code", 200))
    if status >= 400:
        failure = data.get("error") if isinstance(data, dict) else None
        message = failure.get("message") if isinstance(failure, dict) else str(data)
        _raise(status, str(message))
    return data


def note_request(operation: str, request_id: str = "") -> None:
    """State the call's request in its record, for tracing and metrics."""
    usage = kept_usage()
    if usage is not None:
        usage.request = RequestSummary(operation, request_id)


def note_prompt_tokens(prompt_tokens: int) -> None:
    """State the call's prompt tokens (all its texts') in its record."""
    usage = kept_usage()
    if usage is not None:
        usage.prompt_tokens = prompt_tokens


def _raise(code: int, message: str) -> None:
    if code == 404:
        raise NotFoundError("model", message)
    if code == 501:
        raise UnsupportedError(message)
    if 400 <= code < 500:
        raise ValueError(message)
    raise RuntimeError(f"vLLM's handler failed ({code}): {message}")
