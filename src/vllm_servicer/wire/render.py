"""vllm_servicer.v1's Render requests as vLLM's HTTP bodies, and back.

Each request becomes the JSON body vLLM's HTTP server would take for the same
call (/v1/chat/completions/render, /v1/completions/render), and each rendered
prompt is read from the body vLLM would send: the tokens are vLLM's own, and
only this mapping is ours. Every field of the render requests is read here
(`wire/fields.py` lists them; the derenders' are `wire/derender.py`'s); the
model's limits are Pooling's (`wire/pooling.ModelLimits`).

Pure data: no grpc, no vLLM.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from google.protobuf.json_format import MessageToDict

from ..errors import InvalidRequestError
from ..proto import render_pb2 as render_pb
from .pooling import ModelLimits, non_empty, truncation

__all__ = [
    "chat_size",
    "render_chat_body",
    "render_completion_body",
    "rendered_prompt",
]


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


def _content(message: render_pb.ChatMessage, field: str) -> str | list[dict[str, object]] | None:
    if message.content and message.parts:
        raise InvalidRequestError(field, "content and parts are exclusive; send one")
    if not message.parts:
        return message.content if message.content or not message.tool_calls else None
    parts: list[dict[str, object]] = []
    for index, part in enumerate(message.parts):
        which = part.WhichOneof("part")
        if which == "text":
            parts.append({"type": "text", "text": part.text})
        elif which == "image_url":
            parts.append({"type": "image_url", "image_url": {"url": part.image_url}})
        else:
            raise InvalidRequestError(f"{field}.parts[{index}]", "empty; set text or image_url")
    return parts


def _message(message: render_pb.ChatMessage, field: str) -> dict[str, object]:
    if not message.role:
        raise InvalidRequestError(f"{field}.role", "required (system, user, assistant, tool, ...)")
    out: dict[str, object] = {"role": message.role, "content": _content(message, field)}
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


def _tool_call(call: render_pb.ToolCall, field: str) -> dict[str, object]:
    # vLLM parses the arguments for the template: checked here, named by field.
    if call.arguments:
        _json_object(f"{field}.arguments", call.arguments, "the arguments by name")
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def _tool(tool: render_pb.Tool, field: str) -> dict[str, object]:
    if not tool.name:
        raise InvalidRequestError(f"{field}.name", "required")
    function: dict[str, object] = {"name": tool.name}
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


def _json_object(field: str, text: str, what: str) -> dict[str, object]:
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


def _depth(value: object) -> int:
    """How deep objects and lists nest in a parsed JSON value (a scalar: 0)."""
    depth, level = 0, [value]
    while level:
        depth += 1
        children: list[object] = []
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


def render_chat_body(
    request: render_pb.RenderChatRequest, limits: ModelLimits
) -> dict[str, object]:
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
    body: dict[str, object] = {
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
        body["truncate_prompt_tokens"] = truncation(
            "truncate_prompt_tokens", request.truncate_prompt_tokens, limits.max_model_len
        )
    return body


def render_completion_body(
    request: render_pb.RenderCompletionRequest, limits: ModelLimits
) -> dict[str, object]:
    """The /v1/completions/render body for `request`."""
    truncating = request.HasField("truncate_prompt_tokens")
    prompts = non_empty("prompt", request.prompt, "prompt")
    body: dict[str, object] = {
        "model": limits.served_model,
        "prompt": limits.fitted("prompt", prompts, truncating),
        "add_special_tokens": (
            request.add_special_tokens if request.HasField("add_special_tokens") else True
        ),
    }
    if truncating:
        body["truncate_prompt_tokens"] = truncation(
            "truncate_prompt_tokens", request.truncate_prompt_tokens, limits.max_model_len
        )
    return body


def rendered_prompt(rendered: Mapping[str, Any], text: str) -> render_pb.RenderedPrompt:
    """RenderedPrompt from one prompt vLLM's render handler rendered (its token ids,
    and its features' hashes and placeholders as a GenerateRequest body states them)."""
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
