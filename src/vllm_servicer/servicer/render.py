"""`RenderServicer`: vllm_servicer.v1.Render (RenderChat, RenderCompletion,
DerenderChat, DerenderCompletion, DerenderChatStream, DerenderCompletionStream).

A prompt as the engine would run it, from vLLM's own render handler (the one
behind /v1/chat/completions/render and /v1/completions/render) on the mount's
engine: the engine's renderer, tokenizer and chat template, no engine step.
And the way back: generated token ids as an OpenAI client's answer, from
vLLM's own derender handler (/v1/chat/completions/derender,
/v1/completions/derender) with the parsers the server was started with.
Images come inline only (`data:` URLs), counted against the media budgets
from their headers before vLLM decodes them: this service fetches nothing.
"""

from __future__ import annotations

import base64
import binascii
import functools
import io
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from google.protobuf.message import Message

from ..budgets import RequestBudgets
from ..errors import InvalidRequestError
from ..multimodal.decoded import DecodedMedia, RequestMedia
from ..proto import RENDER_SERVICE, render_pb2_grpc
from ..proto import render_pb2 as pb
from ..vllm_releases import render_prompts
from ..wire import derender as derender_wire
from ..wire import render as wire
from ..wire.fields import REFUSED
from .state import MountState
from .vllm_app import (
    VllmHandlers,
    answer_body,
    note_prompt_tokens,
    note_request,
    rendered,
    vllm_request,
)

if TYPE_CHECKING:
    import grpc.aio

    Context = grpc.aio.ServicerContext[Any, Any]

_StreamRequest = pb.DerenderChatStreamRequest | pb.DerenderCompletionStreamRequest
_First = TypeVar("_First", bound=Message)


class RenderServicer(render_pb2_grpc.RenderServicer):
    """Serves vllm_servicer.v1.Render with vLLM's own render handler.

    Args:
        state: the mount's shared state (its engine, vLLM's handlers, decoded media).
    """

    def __init__(self, state: MountState) -> None:
        self._handlers: VllmHandlers = state.handlers
        self._decoded_media: DecodedMedia = state.decoded_media
        self._budgets = state.options.budgets

    async def RenderChat(
        self, request: pb.RenderChatRequest, context: Context
    ) -> pb.RenderedPrompt:
        handlers, render = self._handlers, await self._head(_RENDER_CHAT, request)
        body = wire.render_chat_body(request, handlers.limits())
        account = self._decoded_media.request()
        try:
            _admit_images(request, account)
            chat = vllm_request("render_chat", {**body, "request_id": _RENDER_ID})
            (answer,) = rendered(await render_prompts(render, chat, chat=True))
        finally:
            account.release()
        reply = self._rendered(answer)
        note_prompt_tokens(len(reply.token_ids))
        return reply

    async def RenderCompletion(
        self, request: pb.RenderCompletionRequest, context: Context
    ) -> pb.RenderCompletionResponse:
        handlers, render = self._handlers, await self._head(_RENDER_COMPLETION, request)
        body = wire.render_completion_body(request, handlers.limits())
        completion = vllm_request("render_completion", {**body, "request_id": _RENDER_ID})
        answers = rendered(await render_prompts(render, completion, chat=False))
        reply = pb.RenderCompletionResponse(prompts=[self._rendered(item) for item in answers])
        note_prompt_tokens(sum(len(prompt.token_ids) for prompt in reply.prompts))
        return reply

    async def DerenderChat(
        self, request: pb.DerenderChatRequest, context: Context
    ) -> pb.DerenderChatResponse:
        handlers, derender = self._handlers, await self._head(_DERENDER_CHAT, request)
        body = derender_wire.derender_chat_body(
            request, handlers.limits(), handlers.vocabulary(), _request_id(), handlers.eos_ids()
        )
        answer = await derender.derender_chat_response(vllm_request("derender_chat", body))
        reply = derender_wire.derendered_chat(
            _derendered(answer), request.tool_choice if request.chat.tools else "none"
        )
        # Every generated id, a stop token left out of the text included.
        reply.completion_tokens = sum(len(choice.token_ids) for choice in request.choices)
        note_prompt_tokens(len(request.prompt_token_ids))
        return reply

    async def DerenderCompletion(
        self, request: pb.DerenderCompletionRequest, context: Context
    ) -> pb.DerenderCompletionResponse:
        handlers, derender = self._handlers, await self._head(_DERENDER_COMPLETION, request)
        body = derender_wire.derender_completion_body(
            request, handlers.limits(), handlers.vocabulary(), _request_id(), handlers.eos_ids()
        )
        answer = await derender.derender_completion_response(
            vllm_request("derender_completion", body)
        )
        reply = derender_wire.derendered_completion(_derendered(answer))
        reply.completion_tokens = sum(
            len(choice.token_ids) for prompt in request.prompts for choice in prompt.choices
        )
        note_prompt_tokens(sum(len(prompt.prompt_token_ids) for prompt in request.prompts))
        return reply

    async def DerenderChatStream(
        self, requests: AsyncIterator[pb.DerenderChatStreamRequest], context: Context
    ) -> AsyncIterator[pb.DerenderChatDelta]:
        stream = aiter(requests)
        first = await _first(stream, "the chat")
        start, tokens = first.start, len(first.start.prompt_token_ids)
        handlers, derender = self._handlers, await self._head(_DERENDER_CHAT_STREAM, first)
        vocabulary = handlers.vocabulary()
        chat, prompt_token_ids = derender_wire.derender_chat_start(
            start, handlers.limits(), vocabulary
        )
        # Validated once: each chunk's request takes the same objects.
        chat_request = vllm_request("render_chat", chat)
        note_prompt_tokens(tokens)
        request_id, state = _request_id(), None
        chunks = self._chunks(first, stream, tokens, replays=_replays(derender))
        async for chunk in chunks:
            body = derender_wire.derender_chat_chunk_body(
                chunk,
                vocabulary,
                request_id,
                context=(handlers.served_model, chat_request, prompt_token_ids, state),
                eos_ids=handlers.eos_ids(),
            )
            answer = await derender.derender_chat_stream_response(
                vllm_request("derender_chat_stream", body)
            )
            if getattr(answer, "error", None) is not None:
                answer_body(answer)
            delta, state = answer
            yield derender_wire.chat_delta(delta.model_dump(mode="json"))

    async def DerenderCompletionStream(
        self, requests: AsyncIterator[pb.DerenderCompletionStreamRequest], context: Context
    ) -> AsyncIterator[pb.DerenderCompletionDelta]:
        stream = aiter(requests)
        first = await _first(stream, "the prompt")
        start, tokens = first.start, len(first.start.prompt_token_ids)
        handlers, derender = self._handlers, await self._head(_DERENDER_COMPLETION_STREAM, first)
        vocabulary = handlers.vocabulary()
        prompt_token_ids = derender_wire.derender_completion_start(start, vocabulary)
        note_prompt_tokens(tokens)
        request_id, state = _request_id(), None
        async for chunk in self._chunks(first, stream, tokens):
            body = derender_wire.derender_completion_chunk_body(
                chunk,
                vocabulary,
                request_id,
                context=(handlers.served_model, prompt_token_ids, state),
                eos_ids=handlers.eos_ids(),
            )
            answer = await derender.derender_completion_stream_response(
                vllm_request("derender_completion_stream", body)
            )
            if getattr(answer, "error", None) is not None:
                answer_body(answer)
            delta, state = answer
            yield derender_wire.completion_delta(delta.model_dump(mode="json"))

    async def _head(self, route: _Route, request: Any) -> Any:
        """What every Render method opens with: the call noted, the model
        checked (an adapter renders as the served model: vLLM's renderer is the
        engine's one), the route's budgets (counted before anything is
        tokenized), and vLLM's handler."""
        note_request(route.operation)
        self._handlers.check_model(route.model_field, _field(request, route.model_field))
        route.budgets(self._budgets, request)
        return await self._handlers.handler(route.handler, "generate", route.what)

    async def _chunks(
        self,
        first: _StreamRequest,
        stream: AsyncIterator[_StreamRequest],
        tokens: int,
        *,
        replays: bool = False,
    ) -> AsyncIterator[pb.GeneratedSequence]:
        """A derender stream's chunks, from its first message on, each counted
        against the budgets before it is decoded; `tokens` are the ids its
        start carries. A message after the first carries a chunk, and none
        comes after the one that carried the finish.

        With `replays` (a chat stream on a server with a parser) each chunk
        is charged the tokens vLLM replays for it, the sequence so far with
        its own, against `max_derender_work`: the stream's cost grows with the
        square of its chunks, which the token and chunk budgets do not bound.
        """
        chunks, finished = 0, False
        sequence = work = 0
        message: _StreamRequest | None = first
        while message is not None:
            if message is not first:
                if message.HasField("start"):
                    raise InvalidRequestError("start", "only the first message carries it")
                if not message.HasField("chunk"):
                    raise InvalidRequestError("chunk", "required on every message after the first")
            if message.HasField("chunk"):
                if finished:
                    raise InvalidRequestError(
                        "chunk", "the sequence finished with an earlier chunk (its finish_reason)"
                    )
                chunk = message.chunk
                chunks += 1
                self._budgets.check_derender_chunks("chunk", chunks)
                # With a parser vLLM replays the whole sequence on every chunk:
                # the ids of the whole stream count against the budget.
                tokens += derender_wire.derender_chunk_tokens(chunk)
                self._budgets.check_derender_tokens("chunk.token_ids", tokens)
                if replays:
                    sequence += len(chunk.token_ids)
                    work += sequence
                    self._budgets.check_derender_work("chunk", work)
                finished = bool(chunk.finish_reason)
                yield chunk
            message = await anext(stream, None)

    def _rendered(self, answer: Mapping[str, Any]) -> pb.RenderedPrompt:
        return wire.rendered_prompt(answer, self._handlers.text_of(answer["token_ids"]))


class _Route(NamedTuple):
    """One Render method as vLLM's route it maps to."""

    operation: str  # the call record's operation
    model_field: str  # the field that names the model (a stream's: under its first message)
    handler: str  # vLLM's handler object (its app state's attribute)
    what: str  # what the call asks for, in a refusal
    budgets: Callable[[RequestBudgets, Any], None]  # the budgets, checked before any work


def _chat_budgets(budgets: RequestBudgets, chat: pb.RenderChatRequest, prefix: str = "") -> None:
    budgets.check_render_items(f"{prefix}messages", _chat_items(chat))
    # Every field's bytes but the images' (counted as images), at least the
    # chat's characters.
    budgets.check_render_chars(f"{prefix}messages", wire.chat_size(chat))


def _completion_budgets(budgets: RequestBudgets, request: pb.RenderCompletionRequest) -> None:
    budgets.check_render_items("prompt", len(request.prompt))
    budgets.check_render_chars("prompt", sum(len(text) for text in request.prompt))


def _derender_chat_budgets(budgets: RequestBudgets, request: pb.DerenderChatRequest) -> None:
    budgets.check_n("choices", len(request.choices))
    budgets.check_derender_tokens("choices", derender_wire.derender_token_count(request))
    _chat_budgets(budgets, request.chat, "chat.")


def _derender_completion_budgets(
    budgets: RequestBudgets, request: pb.DerenderCompletionRequest
) -> None:
    budgets.check_render_items("prompts", len(request.prompts))
    budgets.check_n("prompts.choices", sum(len(p.choices) for p in request.prompts))
    budgets.check_derender_tokens("prompts", derender_wire.derender_token_count(request))


def _stream_budgets(budgets: RequestBudgets, first: Any, chat: bool) -> None:
    start = first.start
    if chat:
        _chat_budgets(budgets, start.chat, "start.chat.")
    budgets.check_derender_tokens("start.prompt_token_ids", len(start.prompt_token_ids))


_RENDER_CHAT = _Route(
    "render_chat", "model", "serving_render", "render chat prompts", _chat_budgets
)
_RENDER_COMPLETION = _Route(
    "render_completion", "model", "serving_render", "render prompts", _completion_budgets
)
_DERENDER_CHAT = _Route(
    "derender_chat", "chat.model", "serving_derender", "derender outputs", _derender_chat_budgets
)
_DERENDER_COMPLETION = _Route(
    "derender_completion",
    "model",
    "serving_derender",
    "derender outputs",
    _derender_completion_budgets,
)
_DERENDER_CHAT_STREAM = _Route(
    "derender_chat_stream",
    "start.chat.model",
    "serving_derender",
    "derender outputs",
    functools.partial(_stream_budgets, chat=True),
)
_DERENDER_COMPLETION_STREAM = _Route(
    "derender_completion_stream",
    "start.model",
    "serving_derender",
    "derender outputs",
    functools.partial(_stream_budgets, chat=False),
)


def _field(message: Any, path: str) -> Any:
    """`message`'s field at a dotted `path`."""
    for name in path.split("."):
        message = getattr(message, name)
    return message


async def _first(stream: AsyncIterator[_First], carries: str) -> _First:
    """A derender stream's first message, which must carry its start."""
    first = await anext(stream, None)
    if first is None or not first.HasField("start"):
        raise InvalidRequestError("start", f"the first message carries {carries} (start)")
    return first


# A render starts no engine request and states no id: named, vLLM's request
# model makes up none (a uuid4 a call, read from the kernel's random source).
_RENDER_ID = "render"


def _request_id() -> str:
    # The id of vLLM's answer, which the reply does not carry: no engine request has it.
    return f"derender-{uuid.uuid4().hex}"


def _replays(derender: object) -> bool:
    """Whether vLLM's derender handler replays a chat stream's sequence on each
    chunk: it does with a tool-call or reasoning parser (a parser's state cannot
    be carried between chunks). Assumed so when the handler does not say."""
    derenderer = getattr(derender, "online_derenderer", None)
    return getattr(derenderer, "parser", True) is not None


def _derendered(answer: Any) -> Any:
    """The JSON body of vLLM's derender answer (a response model); its error
    (an `ErrorResponse`) raised as `answer_body` raises it."""
    if getattr(answer, "error", None) is not None:
        return answer_body(answer)
    return answer.model_dump(mode="json")


def _chat_items(request: pb.RenderChatRequest) -> int:
    """What a chat asks the template to lay out: messages, parts, tool calls, tools."""
    parts = sum(len(m.parts) + len(m.tool_calls) for m in request.messages)
    return len(request.messages) + parts + len(request.tools)


def _admit_images(request: pb.RenderChatRequest, account: RequestMedia) -> None:
    """Count the request's inline images against the budgets from their headers.

    Raises:
        UnimplementedFieldError: an image named by a URL other than `data:`.
        InvalidRequestError: an image that is not one, or past a budget.
        BudgetFullError: the process holds as many decoded images as it may.
    """
    from PIL import Image

    for m, message in enumerate(request.messages):
        for p, part in enumerate(message.parts):
            if part.WhichOneof("part") != "image_url":
                continue
            field = f"messages[{m}].parts[{p}].image_url"
            url = part.image_url
            if not url.startswith("data:"):
                refusal = REFUSED[RENDER_SERVICE]["RenderChat"]["messages.parts.image_url"]
                raise refusal.error(field=field, reason=refusal.reason)
            header, _, payload = url.partition(",")
            if not header.endswith(";base64"):
                raise InvalidRequestError(field, "a data: URL of an image must be base64")
            try:
                data = base64.b64decode(payload, validate=True)
                image = Image.open(io.BytesIO(data))
            except (binascii.Error, OSError, ValueError, Image.DecompressionBombError) as exc:
                raise InvalidRequestError(field, f"not a decodable image: {exc}") from None
            account.admit(field, image)
