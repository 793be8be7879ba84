"""vllm_servicer.v1's Render messages as vLLM's HTTP bodies, and back.

Each request becomes the JSON body vLLM's HTTP server would take for the same
call (/v1/chat/completions/render, /v1/completions/render, and their
/derender twins), and each answer is
read from the body vLLM would send: the tokens are vLLM's own, and only this
mapping is ours. Every field of the request messages is read here
(`wire/fields.py` lists them); the model's limits are Pooling's
(`wire/pooling.ModelLimits`).

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
    "chat_delta",
    "chat_size",
    "completion_delta",
    "derender_chat_chunk_body",
    "derender_chat_start",
    "derender_chunk_tokens",
    "derender_chat_body",
    "derender_completion_body",
    "derender_completion_chunk_body",
    "derender_completion_start",
    "derender_token_count",
    "derendered_chat",
    "derendered_completion",
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
        body["truncate_prompt_tokens"] = truncation(
            "truncate_prompt_tokens", request.truncate_prompt_tokens, limits.max_model_len
        )
    return body


def render_completion_body(
    request: render_pb.RenderCompletionRequest, limits: ModelLimits
) -> dict[str, Any]:
    """The /v1/completions/render body for `request`."""
    truncating = request.HasField("truncate_prompt_tokens")
    prompts = non_empty("prompt", request.prompt, "prompt")
    body: dict[str, Any] = {
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


_TOOL_CHOICE_MODES = frozenset({"auto", "none", "required"})


def _tool_choice(chat: render_pb.RenderChatRequest, choice: str) -> str | dict[str, Any]:
    """OpenAI's tool_choice for `choice` ("": auto), checked against the chat's tools."""
    choice = choice or "auto"
    if choice in _TOOL_CHOICE_MODES:
        return choice
    names = [tool.name for tool in chat.tools]
    if choice not in names:
        raise InvalidRequestError(
            "tool_choice",
            f"{choice!r} is neither auto, none, required nor one of the chat's tools "
            f"({', '.join(repr(name) for name in names) or 'it has none'})",
        )
    return {"type": "function", "function": {"name": choice}}


def _check_ids(field: str, token_ids: Any, vocabulary: int) -> None:
    """Refuse a token id the tokenizer has no token for, naming where it is."""
    for index, token_id in enumerate(token_ids):
        if token_id >= vocabulary:
            raise InvalidRequestError(
                f"{field}[{index}]",
                f"token id {token_id} is not in the model's vocabulary of {vocabulary}",
            )


def _generated(
    sequences: Any, field: str, request_id: str, vocabulary: int, eos_ids: frozenset[int]
) -> dict[str, Any]:
    """vLLM's token-id generate response (`GenerateTokensResponse`) for `sequences`."""
    if not sequences:
        raise InvalidRequestError(field, "at least one generated sequence is required")
    choices = []
    for number, sequence in enumerate(sequences):
        at = f"{field}[{number}]"
        if not sequence.token_ids:
            raise InvalidRequestError(f"{at}.token_ids", "at least one generated token id")
        # A whole sequence without a finish reason stopped, as vLLM takes it.
        choices.append(_choice(sequence, at, vocabulary, "stop", eos_ids, keep_one=True))
    return {"request_id": request_id, "output_mode": "tokens", "choices": choices}


def _text_ids(
    sequence: render_pb.GeneratedSequence,
    finish_reason: str | None,
    eos_ids: frozenset[int],
    *,
    keep_one: bool,
) -> list[int]:
    """The ids of `sequence` whose text the answer carries: all but the stop
    token a sequence ends with when it stopped on one (an EOS, or its
    `stop_token_id`). The engine never puts that token's text in a chat or
    completion answer, but vLLM's derender decodes every id it is given, and
    keeps special tokens when a parser reads them: `</s>` or `<|im_end|>`
    would end the content. `keep_one`: never leave a sequence without ids
    (vLLM's derender refuses one; a chunk carrying the finish may be empty)."""
    token_ids = list(sequence.token_ids)
    if finish_reason != "stop" or not token_ids or (keep_one and len(token_ids) == 1):
        return token_ids
    which = sequence.WhichOneof("stop_reason")
    last = token_ids[-1]
    if (which == "stop_token_id" and last == sequence.stop_token_id) or (
        which is None and last in eos_ids
    ):
        return token_ids[:-1]
    return token_ids


def _choice(
    sequence: render_pb.GeneratedSequence,
    at: str,
    vocabulary: int,
    unfinished: str | None,
    eos_ids: frozenset[int],
    *,
    keep_one: bool,
) -> dict[str, Any]:
    """vLLM's token-id choice for one sequence (or one chunk of it), checked;
    `unfinished` is its finish reason when the sequence gives none. A stop
    token it ends with is left out of the ids to decode (`_text_ids`), not
    out of its logprobs: vLLM resolves each position's on its own, and a
    chat completion's logprobs have the stop token's."""
    _check_ids(f"{at}.token_ids", sequence.token_ids, vocabulary)
    for position, entry in enumerate(sequence.logprobs):
        _check_ids(f"{at}.logprobs[{position}].token_id", [entry.token_id], vocabulary)
        _check_ids(
            f"{at}.logprobs[{position}].top_logprobs",
            [top.token_id for top in entry.top_logprobs],
            vocabulary,
        )
    finish_reason = sequence.finish_reason or unfinished
    choice: dict[str, Any] = {
        "index": sequence.index,
        "token_ids": _text_ids(sequence, finish_reason, eos_ids, keep_one=keep_one),
        "finish_reason": finish_reason,
    }
    which = sequence.WhichOneof("stop_reason")
    if which is not None:
        choice["stop_reason"] = getattr(sequence, which)
    if sequence.logprobs:
        if len(sequence.logprobs) != len(sequence.token_ids):
            raise InvalidRequestError(
                f"{at}.logprobs",
                f"{len(sequence.logprobs)} positions for {len(sequence.token_ids)} "
                "token ids; one per generated token",
            )
        choice["logprobs"] = {
            "content": [
                {
                    "token_id": entry.token_id,
                    "logprob": entry.logprob,
                    "top_logprobs": [
                        {"token_id": top.token_id, "logprob": top.logprob}
                        for top in entry.top_logprobs
                    ],
                }
                for entry in sequence.logprobs
            ]
        }
    return choice


def _sequence_tokens(sequence: Any) -> int:
    return len(sequence.token_ids) + sum(1 + len(entry.top_logprobs) for entry in sequence.logprobs)


def derender_token_count(
    request: render_pb.DerenderChatRequest | render_pb.DerenderCompletionRequest,
) -> int:
    """The token ids a derender decodes: generated, prompt and logprob candidates."""
    if isinstance(request, render_pb.DerenderChatRequest):
        generations: list[tuple[Any, Any]] = [(request.prompt_token_ids, request.choices)]
    else:
        generations = [(prompt.prompt_token_ids, prompt.choices) for prompt in request.prompts]
    return sum(
        len(prompt_ids) + sum(_sequence_tokens(sequence) for sequence in sequences)
        for prompt_ids, sequences in generations
    )


def _chat_request(
    chat: render_pb.RenderChatRequest, tool_choice: str, limits: ModelLimits, field: str
) -> dict[str, Any]:
    """The chat as vLLM's ChatCompletionRequest body (the parsers' context);
    `field` names the chat in refusals."""
    try:
        body = render_chat_body(chat, limits)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"{field}.{exc.field}", exc.reason) from None
    if chat.tools:
        body["tool_choice"] = _tool_choice(chat, tool_choice)
    elif tool_choice and tool_choice != "none":
        raise InvalidRequestError("tool_choice", "the chat has no tools to choose from")
    return body


def derender_chat_body(
    request: render_pb.DerenderChatRequest,
    limits: ModelLimits,
    vocabulary: int,
    request_id: str,
    eos_ids: frozenset[int] = frozenset(),
) -> dict[str, Any]:
    """The /v1/chat/completions/derender body for `request`: the chat as its
    ChatCompletionRequest (the parsers' context), the sequences as a token-id
    generate response; `vocabulary` is the tokenizer's size, `eos_ids` the
    ids the engine stops on as EOS."""
    if not request.HasField("chat"):
        raise InvalidRequestError("chat", "required: the chat as it was rendered")
    chat = _chat_request(request.chat, request.tool_choice, limits, "chat")
    body: dict[str, Any] = {
        "model": limits.served_model,
        "generate_response": _generated(
            request.choices, "choices", request_id, vocabulary, eos_ids
        ),
        "chat_request": chat,
    }
    _check_ids("prompt_token_ids", request.prompt_token_ids, vocabulary)
    if request.prompt_token_ids:
        body["prompt_token_ids"] = list(request.prompt_token_ids)
    return body


def derender_chat_start(
    start: render_pb.DerenderChatStart, limits: ModelLimits, vocabulary: int
) -> tuple[dict[str, Any], list[int] | None]:
    """A streamed chat derender's context: the chat's ChatCompletionRequest
    body and the prompt's token ids (None when not given)."""
    if not start.HasField("chat"):
        raise InvalidRequestError("start.chat", "required: the chat as it was rendered")
    chat = _chat_request(start.chat, start.tool_choice, limits, "start.chat")
    _check_ids("start.prompt_token_ids", start.prompt_token_ids, vocabulary)
    return chat, list(start.prompt_token_ids) or None


def _stream_chunk(
    chunk: render_pb.GeneratedSequence, vocabulary: int, request_id: str, eos_ids: frozenset[int]
) -> dict[str, Any]:
    """vLLM's token-id stream chunk (`GenerateTokensStreamResponse`) for one
    chunk of a sequence, checked."""
    if not chunk.token_ids and not chunk.finish_reason:
        raise InvalidRequestError(
            "chunk.token_ids", "empty; a chunk carries token ids, or the finish reason"
        )
    choice = _choice(chunk, "chunk", vocabulary, None, eos_ids, keep_one=False)
    return {"request_id": request_id, "output_mode": "tokens", "choices": [choice]}


def derender_chat_chunk_body(
    chunk: render_pb.GeneratedSequence,
    vocabulary: int,
    request_id: str,
    *,
    context: tuple[str, Any, list[int] | None, Any],
    eos_ids: frozenset[int] = frozenset(),
) -> dict[str, Any]:
    """The streaming /v1/chat/completions/derender body for one chunk of a
    sequence: its token-id stream chunk (`GenerateTokensStreamResponse`) in
    the stream's `context` (the served model's name, vLLM's validated
    ChatCompletionRequest, the prompt's token ids, and the stream state
    vLLM's previous answer handed back, None at first)."""
    model, chat_request, prompt_token_ids, state = context
    return {
        "stream": True,
        "model": model,
        "generate_chunk": _stream_chunk(chunk, vocabulary, request_id, eos_ids),
        "stream_state": state,
        "chat_request": chat_request,
        "prompt_token_ids": prompt_token_ids,
    }


def derender_completion_start(
    start: render_pb.DerenderCompletionStart, vocabulary: int
) -> list[int] | None:
    """A streamed completion derender's prompt token ids (None when not given), checked."""
    _check_ids("start.prompt_token_ids", start.prompt_token_ids, vocabulary)
    return list(start.prompt_token_ids) or None


def derender_completion_chunk_body(
    chunk: render_pb.GeneratedSequence,
    vocabulary: int,
    request_id: str,
    *,
    context: tuple[str, list[int] | None, Any],
    eos_ids: frozenset[int] = frozenset(),
) -> dict[str, Any]:
    """The streaming /v1/completions/derender body for one chunk of a sequence
    in the stream's `context` (the served model's name, the prompt's token
    ids, the stream state vLLM's previous answer handed back, None at first)."""
    model, prompt_token_ids, state = context
    return {
        "stream": True,
        "model": model,
        "generate_chunk": _stream_chunk(chunk, vocabulary, request_id, eos_ids),
        "stream_state": state,
        "prompt_token_ids": prompt_token_ids,
    }


def derender_chunk_tokens(chunk: render_pb.GeneratedSequence) -> int:
    """The token ids one chunk asks to decode, its logprob candidates included."""
    return _sequence_tokens(chunk)


def chat_delta(answer: Mapping[str, Any]) -> render_pb.DerenderChatDelta:
    """DerenderChatDelta from vLLM's streamed derender answer (its ChatCompletionStreamResponse)."""
    delta = render_pb.DerenderChatDelta()
    for choice in answer.get("choices") or ():
        message = choice.get("delta") or {}
        delta.index = choice["index"]
        delta.finish_reason = choice.get("finish_reason") or ""
        for name, value in _stop_reason(choice).items():
            setattr(delta, name, value)
        if message.get("content") is not None:
            delta.content = message["content"]
        reasoning = message.get("reasoning", message.get("reasoning_content"))
        if reasoning is not None:
            delta.reasoning = reasoning
        for call in message.get("tool_calls") or ():
            function = call.get("function") or {}
            delta.tool_calls.append(
                render_pb.ToolCallDelta(
                    index=call.get("index") or 0,
                    id=call.get("id") or "",
                    name=function.get("name") or "",
                    arguments=function.get("arguments") or "",
                )
            )
        delta.logprobs.extend(_chat_logprobs(choice.get("logprobs")))
    return delta


def derender_completion_body(
    request: render_pb.DerenderCompletionRequest,
    limits: ModelLimits,
    vocabulary: int,
    request_id: str,
    eos_ids: frozenset[int] = frozenset(),
) -> dict[str, Any]:
    """The /v1/completions/derender body for `request`: one token-id generate
    response per prompt; `vocabulary` is the tokenizer's size."""
    if not request.prompts:
        raise InvalidRequestError("prompts", "at least one prompt's generation is required")
    for index, prompt in enumerate(request.prompts):
        _check_ids(f"prompts[{index}].prompt_token_ids", prompt.prompt_token_ids, vocabulary)
    return {
        "model": limits.served_model,
        "generate_responses": [
            _generated(
                prompt.choices,
                f"prompts[{index}].choices",
                f"{request_id}-{index}",
                vocabulary,
                eos_ids,
            )
            for index, prompt in enumerate(request.prompts)
        ],
        "prompt_token_ids": [list(prompt.prompt_token_ids) or None for prompt in request.prompts],
    }


def _stop_reason(choice: Mapping[str, Any]) -> dict[str, Any]:
    reason = choice.get("stop_reason")
    if reason is None:
        return {}
    if isinstance(reason, int):
        return {"stop_token_id": reason}
    return {"stop_string": str(reason)}


def _text(text: Any) -> bytes:
    return bytes(text) if text is not None else b""


def _chat_logprobs(logprobs: Mapping[str, Any] | None) -> list[render_pb.TokenLogprobText]:
    return [
        render_pb.TokenLogprobText(
            token=entry["token"],
            logprob=entry["logprob"],
            bytes=_text(entry.get("bytes")),
            top_logprobs=[
                render_pb.LogprobText(
                    token=top["token"], logprob=top["logprob"], bytes=_text(top.get("bytes"))
                )
                for top in entry.get("top_logprobs") or ()
            ],
        )
        for entry in (logprobs or {}).get("content") or ()
    ]


def _finish_reason(choice: Mapping[str, Any], tool_choice: str) -> str:
    """A derendered choice's finish reason as vLLM's chat completions give it:
    "tool_calls" after tool calls the model chose to make (tool_choice auto)
    or had to (required, when it stopped); vLLM's derender keeps the
    generation's."""
    reason = choice.get("finish_reason") or ""
    called = bool((choice.get("message") or {}).get("tool_calls"))
    if (called and tool_choice in ("", "auto")) or (tool_choice == "required" and reason == "stop"):
        return "tool_calls"
    return reason


def derendered_chat(
    answer: Mapping[str, Any], tool_choice: str = ""
) -> render_pb.DerenderChatResponse:
    """DerenderChatResponse from vLLM's derender answer (its ChatCompletionResponse
    body) for a request of `tool_choice` (DerenderChatRequest's)."""
    choices = []
    for choice in answer["choices"]:
        message = choice["message"]
        out = render_pb.DerenderedChatChoice(
            index=choice["index"],
            finish_reason=_finish_reason(choice, tool_choice),
            tool_calls=[
                render_pb.ToolCall(
                    id=call["id"],
                    name=call["function"]["name"],
                    arguments=call["function"].get("arguments") or "",
                )
                for call in message.get("tool_calls") or ()
            ],
            logprobs=_chat_logprobs(choice.get("logprobs")),
            **_stop_reason(choice),
        )
        if message.get("content") is not None:
            out.content = message["content"]
        reasoning = message.get("reasoning", message.get("reasoning_content"))
        if reasoning is not None:
            out.reasoning = reasoning
        choices.append(out)
    usage = answer.get("usage") or {}
    return render_pb.DerenderChatResponse(
        choices=choices, completion_tokens=usage.get("completion_tokens") or 0
    )


def _completion_logprobs(
    logprobs: Mapping[str, Any] | None,
) -> list[render_pb.TokenLogprobText]:
    """OpenAI's completion logprobs (parallel lists, candidates by text) as entries."""
    if not logprobs:
        return []
    tokens = logprobs.get("tokens") or []
    values = logprobs.get("token_logprobs") or [None] * len(tokens)
    offsets = logprobs.get("text_offset") or [0] * len(tokens)
    tops = logprobs.get("top_logprobs") or [None] * len(tokens)
    return [
        render_pb.TokenLogprobText(
            token=token,
            logprob=value if value is not None else 0.0,
            bytes=token.encode(),
            text_offset=offset,
            top_logprobs=[
                render_pb.LogprobText(token=text, logprob=candidate, bytes=text.encode())
                for text, candidate in (top or {}).items()
            ],
        )
        for token, value, offset, top in zip(tokens, values, offsets, tops, strict=True)
    ]


def completion_delta(answer: Mapping[str, Any]) -> render_pb.DerenderCompletionDelta:
    """DerenderCompletionDelta from vLLM's streamed derender answer (its
    CompletionStreamResponse)."""
    delta = render_pb.DerenderCompletionDelta()
    for choice in answer.get("choices") or ():
        delta.index = choice["index"]
        delta.text += choice.get("text") or ""
        delta.finish_reason = choice.get("finish_reason") or ""
        for name, value in _stop_reason(choice).items():
            setattr(delta, name, value)
        delta.logprobs.extend(_completion_logprobs(choice.get("logprobs")))
    return delta


def derendered_completion(answer: Mapping[str, Any]) -> render_pb.DerenderCompletionResponse:
    """DerenderCompletionResponse from vLLM's derender answer (its CompletionResponse body)."""
    usage = answer.get("usage") or {}
    return render_pb.DerenderCompletionResponse(
        choices=[
            render_pb.DerenderedCompletionChoice(
                index=choice["index"],
                text=choice["text"],
                finish_reason=choice.get("finish_reason") or "",
                logprobs=_completion_logprobs(choice.get("logprobs")),
                **_stop_reason(choice),
            )
            for choice in answer["choices"]
        ],
        completion_tokens=usage.get("completion_tokens") or 0,
    )
