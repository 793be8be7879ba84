"""vllm_servicer.v1's Pooling and Render messages as vLLM's HTTP bodies, and back.

Each request becomes the JSON body vLLM's HTTP server would take for the same
call (/classify, /score, /rerank, /v1/chat/completions/render,
/v1/completions/render), and each answer is read from the body vLLM would
send: the numbers and tokens are vLLM's own, and only this mapping is ours.
Every field of the request messages is read here (`wire/fields.py` lists
them), the checks vLLM would report without naming the wire's field made first.

Pure data: no grpc, no vLLM.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from google.protobuf.json_format import MessageToDict

from ..budgets import check_request_id
from ..errors import InvalidRequestError
from ..proto import pooling_pb2 as pool_pb
from ..proto import render_pb2 as render_pb

__all__ = [
    "ModelLimits",
    "chat_size",
    "classify_body",
    "classify_response",
    "render_chat_body",
    "render_completion_body",
    "rendered_prompt",
    "rerank_body",
    "rerank_response",
    "score_body",
    "score_response",
]


# The request fields that carry one text (the others are repeated).
_SINGLE_TEXTS = frozenset({"text_1", "query"})


@dataclasses.dataclass(frozen=True)
class ModelLimits:
    """What the served model takes, for the checks made before vLLM sees a request.

    Attributes:
        served_model: the served model's name ("" in a request means it).
        max_model_len: the model's context in tokens; None: unknown.
        max_text_chars: the longest text that can fit that context (the context
            times the longest token's characters: a text longer than this
            cannot be that few tokens); None: unknown.
        truncation_side: the side the tokenizer truncates a text from ("left"
            keeps the last tokens, "right" the first).
    """

    served_model: str
    max_model_len: int | None = None
    max_text_chars: int | None = None
    truncation_side: str = "right"

    def fitted(self, field: str, texts: Sequence[str], truncating: bool) -> list[str]:
        """`texts` bounded by the context, before anything tokenizes them.

        vLLM tokenizes a text whole before it truncates, and a Score's query
        once per pair: a text past `max_text_chars` is refused at once, or,
        with truncation, cut to that many characters on the tokenizer's
        truncation side (what vLLM itself does when a request names the side).
        What is cut lies past the tokens truncation keeps: `max_text_chars`
        characters are at least the context's count of tokens, unless the
        tokenizer drops characters (a WordPiece one drops runs of spaces), in
        which case a text made mostly of them keeps fewer: only its own
        result changes.

        Raises:
            InvalidRequestError: a text cannot fit and nothing truncates it.
        """
        bound = self.max_text_chars
        if bound is None:
            return list(texts)
        if truncating:
            left = self.truncation_side == "left"
            return [text[-bound:] if left else text[:bound] for text in texts]
        for index, text in enumerate(texts):
            if len(text) > bound:
                name = field if field in _SINGLE_TEXTS else f"{field}[{index}]"
                raise InvalidRequestError(
                    name,
                    f"{len(text)} characters cannot fit the model's context of "
                    f"{self.max_model_len} tokens; shorten it or set truncate_prompt_tokens",
                )
        return list(texts)

    def check_chat_fits(self, field: str, size: int) -> None:
        """Refuse a chat that cannot fit the context, truncated or not.

        A chat is rendered whole before its tokens are truncated, and the
        rendered prompt holds at least the chat's own characters; `size` is
        its bytes (at least its characters), counted before anything parses it.

        Raises:
            InvalidRequestError: `size` past `max_text_chars`.
        """
        if self.max_text_chars is not None and size > self.max_text_chars:
            raise InvalidRequestError(
                field,
                f"{size} bytes of messages, tools and template variables cannot fit the "
                f"model's context of {self.max_model_len} tokens; shorten the chat",
            )


def _non_empty(field: str, texts: Sequence[str], what: str) -> list[str]:
    if not texts:
        raise InvalidRequestError(field, f"at least one {what} is required")
    return list(texts)


def _truncation(field: str, value: int, max_model_len: int | None) -> int:
    if value < -1:
        raise InvalidRequestError(field, f"{value}; -1 (the model's context) or a count of tokens")
    if value == 0:
        raise InvalidRequestError(
            field, "0 tokens would leave nothing; unset it to refuse longer prompts"
        )
    if max_model_len is not None and value > max_model_len:
        raise InvalidRequestError(
            field, f"{value} tokens, more than the model's context of {max_model_len}"
        )
    return value


def _pooling_options(options: pool_pb.PoolingOptions, limits: ModelLimits) -> dict[str, Any]:
    body: dict[str, Any] = {
        # The served model's name: an adapter named goes to the engine by itself.
        "model": limits.served_model,
        "priority": options.priority,
    }
    if options.HasField("truncate_prompt_tokens"):
        body["truncate_prompt_tokens"] = _truncation(
            "options.truncate_prompt_tokens", options.truncate_prompt_tokens, limits.max_model_len
        )
    return body


def _texts(
    request: Any, field: str, limits: ModelLimits, what: str | None = None
) -> dict[str, Any]:
    """The body's `field`, its texts bounded by the context (`ModelLimits.fitted`);
    a repeated field must hold one (`what`) at least."""
    truncating = request.options.HasField("truncate_prompt_tokens")
    if what is None:
        return {field: limits.fitted(field, [getattr(request, field)], truncating)[0]}
    texts = _non_empty(field, getattr(request, field), what)
    return {field: limits.fitted(field, texts, truncating)}


def _request_id(given: str) -> dict[str, str]:
    # vLLM's engine ids are "<route>-<request_id>-<index>"; "": vLLM makes one up.
    if given:
        check_request_id("request_id", given)
    return {"request_id": given} if given else {}


def classify_body(request: pool_pb.ClassifyRequest, limits: ModelLimits) -> dict[str, Any]:
    """The /classify body for `request`.

    Raises:
        InvalidRequestError: no input, a text that cannot fit the context, a
            truncation out of range, a bad request id (named by field).
    """
    return {
        **_texts(request, "input", limits, "text"),
        **_pooling_options(request.options, limits),
        **_request_id(request.request_id),
    }


def score_body(request: pool_pb.ScoreRequest, limits: ModelLimits) -> dict[str, Any]:
    """The /score body for `request`: text_1 against each of text_2."""
    return {
        **_texts(request, "text_1", limits),
        **_texts(request, "text_2", limits, "text"),
        **_pooling_options(request.options, limits),
        **_request_id(request.request_id),
    }


def rerank_body(request: pool_pb.RerankRequest, limits: ModelLimits) -> dict[str, Any]:
    """The /rerank body for `request`."""
    return {
        **_texts(request, "query", limits),
        **_texts(request, "documents", limits, "document"),
        "top_n": request.top_n,
        **_pooling_options(request.options, limits),
        **_request_id(request.request_id),
    }


def _usage_tokens(body: Mapping[str, Any]) -> int:
    return int((body.get("usage") or {}).get("prompt_tokens") or 0)


def classify_response(body: Mapping[str, Any], request_id: str) -> pool_pb.ClassifyResponse:
    """ClassifyResponse from vLLM's /classify answer."""
    return pool_pb.ClassifyResponse(
        request_id=request_id,
        model=body.get("model", ""),
        results=[
            pool_pb.ClassifyResult(
                index=item["index"], label=item.get("label") or "", probs=item["probs"]
            )
            for item in body["data"]
        ],
        prompt_tokens=_usage_tokens(body),
    )


def score_response(body: Mapping[str, Any], request_id: str) -> pool_pb.ScoreResponse:
    """ScoreResponse from vLLM's /score answer."""
    return pool_pb.ScoreResponse(
        request_id=request_id,
        model=body.get("model", ""),
        results=[
            pool_pb.ScoreResult(index=item["index"], score=item["score"]) for item in body["data"]
        ],
        prompt_tokens=_usage_tokens(body),
    )


def rerank_response(
    body: Mapping[str, Any], request_id: str, return_documents: bool
) -> pool_pb.RerankResponse:
    """RerankResponse from vLLM's /rerank answer (documents echoed when asked)."""
    results = []
    for item in body["results"]:
        document = ((item.get("document") or {}).get("text") or "") if return_documents else ""
        results.append(
            pool_pb.RerankResult(
                index=item["index"], relevance_score=item["relevance_score"], document=document
            )
        )
    return pool_pb.RerankResponse(
        request_id=request_id,
        model=body.get("model", ""),
        results=results,
        prompt_tokens=_usage_tokens(body),
    )


# ----- render ---------------------------------------------------------------

# What the template call takes beside the template's own variables (HF's
# apply_chat_template and vLLM's): the server's or a field's of its own, never
# a client's template variable (padding or truncation would change the tokens,
# `tools` would bypass the checks of the `tools` field).
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "chat_template",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "tools",
        "documents",
        "messages",
        "conversation",
        "add_generation_prompt",
        "continue_final_message",
    }
)


def _content(message: render_pb.ChatMessage, field: str) -> str | list[dict[str, Any]] | None:
    if message.content and message.parts:
        raise InvalidRequestError(field, "content and parts are exclusive; send one")
    if not message.parts:
        return message.content if message.content or not message.tool_calls else None
    parts: list[dict[str, Any]] = []
    for index, part in enumerate(message.parts):
        which = part.WhichOneof("part")
        if which == "text":
            parts.append({"type": "text", "text": part.text})
        elif which == "image_url":
            parts.append({"type": "image_url", "image_url": {"url": part.image_url}})
        else:
            raise InvalidRequestError(f"{field}.parts[{index}]", "empty; set text or image_url")
    return parts


def _message(message: render_pb.ChatMessage, field: str) -> dict[str, Any]:
    if not message.role:
        raise InvalidRequestError(f"{field}.role", "required (system, user, assistant, tool, ...)")
    out: dict[str, Any] = {"role": message.role, "content": _content(message, field)}
    if message.name:
        out["name"] = message.name
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["tool_calls"] = [
            _tool_call(call, f"{field}.tool_calls[{index}]")
            for index, call in enumerate(message.tool_calls)
        ]
    return out


def _tool_call(call: render_pb.ToolCall, field: str) -> dict[str, Any]:
    # vLLM parses the arguments for the template: checked here, named by field.
    if call.arguments:
        _json_object(f"{field}.arguments", call.arguments, "the arguments by name")
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def _tool(tool: render_pb.Tool, field: str) -> dict[str, Any]:
    if not tool.name:
        raise InvalidRequestError(f"{field}.name", "required")
    function: dict[str, Any] = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    if tool.parameters:
        # Key order kept: the template writes the schema as it was given.
        schema = _json_object(f"{field}.parameters", tool.parameters, "a schema")
        function["parameters"] = schema
    return {"type": "function", "function": function}


# JSON schemas and arguments nest a few levels; a template that writes them
# indented (`tojson(indent=4)`) turns each level of a deep one into a line
# indented by it: quadratic in the depth.
MAX_JSON_DEPTH = 64


def _json_object(field: str, text: str, what: str) -> dict[str, Any]:
    """`text` parsed as a JSON object, or refused naming `field`."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise InvalidRequestError(field, f"not JSON: {reason}") from None
    if not isinstance(value, dict):
        raise InvalidRequestError(field, f"must be a JSON object ({what})")
    if _depth(value) > MAX_JSON_DEPTH:
        raise InvalidRequestError(field, f"nested more than {MAX_JSON_DEPTH} levels deep")
    return value


def _depth(value: Any) -> int:
    """How deep objects and lists nest in a parsed JSON value (a scalar: 0)."""
    depth, level = 0, [value]
    while level:
        depth += 1
        children: list[Any] = []
        for item in level:
            if isinstance(item, dict):
                children.extend(item.values())
            elif isinstance(item, list):
                children.extend(item)
        level = [child for child in children if isinstance(child, (dict, list))]
    return depth


def chat_size(request: render_pb.RenderChatRequest) -> int:
    """What a chat gives the template, in bytes (at least its characters):
    every field of the request, so a field added later counts too, but its
    images' URLs (counted as images)."""
    images = sum(
        len(part.image_url)
        for message in request.messages
        for part in message.parts
        if part.WhichOneof("part") == "image_url"
    )
    return request.ByteSize() - images


def render_chat_body(request: render_pb.RenderChatRequest, limits: ModelLimits) -> dict[str, Any]:
    """The /v1/chat/completions/render body for `request`.

    Tools are rendered into the prompt as the template lays them out; no tool
    is chosen ("tool_choice": "none" keeps them in the prompt: rendering
    parses no output, so it needs no tool parser).
    """
    if not request.messages:
        raise InvalidRequestError("messages", "at least one message is required")
    limits.check_chat_fits("messages", chat_size(request))
    messages = [
        _message(message, f"messages[{index}]") for index, message in enumerate(request.messages)
    ]
    body: dict[str, Any] = {
        "model": limits.served_model,
        "messages": messages,
        "add_generation_prompt": (
            request.add_generation_prompt if request.HasField("add_generation_prompt") else True
        ),
        "continue_final_message": request.continue_final_message,
    }
    if request.continue_final_message and body["add_generation_prompt"]:
        raise InvalidRequestError(
            "continue_final_message",
            "continues the last message, so add_generation_prompt must be false",
        )
    if request.tools:
        body["tools"] = [_tool(tool, f"tools[{index}]") for index, tool in enumerate(request.tools)]
        body["tool_choice"] = "none"
    if request.HasField("chat_template_kwargs"):
        kwargs = MessageToDict(request.chat_template_kwargs)
        for name in kwargs:
            if name in _RESERVED_TEMPLATE_KWARGS:
                raise InvalidRequestError(
                    f"chat_template_kwargs.{name}",
                    "not a template variable: set by the server or by a field of its own",
                )
        body["chat_template_kwargs"] = kwargs
    if request.HasField("truncate_prompt_tokens"):
        body["truncate_prompt_tokens"] = _truncation(
            "truncate_prompt_tokens", request.truncate_prompt_tokens, limits.max_model_len
        )
    return body


def render_completion_body(
    request: render_pb.RenderCompletionRequest, limits: ModelLimits
) -> dict[str, Any]:
    """The /v1/completions/render body for `request`."""
    truncating = request.HasField("truncate_prompt_tokens")
    prompts = _non_empty("prompt", request.prompt, "prompt")
    body: dict[str, Any] = {
        "model": limits.served_model,
        "prompt": limits.fitted("prompt", prompts, truncating),
        "add_special_tokens": (
            request.add_special_tokens if request.HasField("add_special_tokens") else True
        ),
    }
    if truncating:
        body["truncate_prompt_tokens"] = _truncation(
            "truncate_prompt_tokens", request.truncate_prompt_tokens, limits.max_model_len
        )
    return body


def rendered_prompt(rendered: Mapping[str, Any], text: str) -> render_pb.RenderedPrompt:
    """RenderedPrompt from one of vLLM's render answers (its GenerateRequest body)."""
    placeholders = []
    features = rendered.get("features") or {}
    hashes = features.get("mm_hashes") or {}
    for modality, ranges in (features.get("mm_placeholders") or {}).items():
        for index, placed in enumerate(ranges):
            item_hashes = hashes.get(modality) or []
            placeholders.append(
                render_pb.Placeholder(
                    modality=modality,
                    offset=placed["offset"],
                    length=placed["length"],
                    hash=item_hashes[index] if index < len(item_hashes) else "",
                )
            )
    return render_pb.RenderedPrompt(
        token_ids=rendered["token_ids"], text=text, placeholders=placeholders
    )
