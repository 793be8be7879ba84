"""vllm_servicer.v1's Derender messages as vLLM's HTTP bodies, and back.

Generated token ids become the JSON body vLLM's HTTP server would take for the
same call (/v1/chat/completions/derender, /v1/completions/derender, whole or
one streamed chunk at a time), and each answer is read from the body vLLM
would send: the text, reasoning and tool calls are vLLM's own, and only this
mapping is ours. Every field of the derender messages is read here
(`wire/fields.py` lists them); the chat a derender parses in is the body
`wire/render.py` renders it as, and the model's limits are Pooling's
(`wire/pooling.ModelLimits`).

Pure data: no grpc, no vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..errors import InvalidRequestError
from ..proto import render_pb2 as render_pb
from .pooling import ModelLimits
from .render import render_chat_body

__all__ = [
    "chat_delta",
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
]


_TOOL_CHOICE_MODES = frozenset({"auto", "none", "required"})
_Sequences = Sequence[render_pb.GeneratedSequence]


def _tool_choice(chat: render_pb.RenderChatRequest, choice: str) -> str | dict[str, object]:
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


def _check_ids(field: str, token_ids: Iterable[int], vocabulary: int) -> None:
    """Refuse a token id the tokenizer has no token for, naming where it is."""
    for index, token_id in enumerate(token_ids):
        if token_id >= vocabulary:
            raise InvalidRequestError(
                f"{field}[{index}]",
                f"token id {token_id} is not in the model's vocabulary of {vocabulary}",
            )


def _generated(
    sequences: _Sequences, field: str, request_id: str, vocabulary: int, eos_ids: frozenset[int]
) -> dict[str, object]:
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
) -> dict[str, object]:
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
    choice: dict[str, object] = {
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


def _sequence_tokens(sequence: render_pb.GeneratedSequence) -> int:
    return len(sequence.token_ids) + sum(1 + len(entry.top_logprobs) for entry in sequence.logprobs)


def derender_token_count(
    request: render_pb.DerenderChatRequest | render_pb.DerenderCompletionRequest,
) -> int:
    """The token ids a derender decodes: generated, prompt and logprob candidates."""
    if isinstance(request, render_pb.DerenderChatRequest):
        generations = [(request.prompt_token_ids, request.choices)]
    else:
        generations = [(prompt.prompt_token_ids, prompt.choices) for prompt in request.prompts]
    return sum(
        len(prompt_ids) + sum(_sequence_tokens(sequence) for sequence in sequences)
        for prompt_ids, sequences in generations
    )


def _chat_request(
    chat: render_pb.RenderChatRequest, tool_choice: str, limits: ModelLimits, field: str
) -> dict[str, object]:
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
) -> dict[str, object]:
    """The /v1/chat/completions/derender body for `request`: the chat as its
    ChatCompletionRequest (the parsers' context), the sequences as a token-id
    generate response; `vocabulary` is the tokenizer's size, `eos_ids` the
    ids the engine stops on as EOS."""
    if not request.HasField("chat"):
        raise InvalidRequestError("chat", "required: the chat as it was rendered")
    chat = _chat_request(request.chat, request.tool_choice, limits, "chat")
    body: dict[str, object] = {
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
) -> tuple[dict[str, object], list[int] | None]:
    """A streamed chat derender's context: the chat's ChatCompletionRequest
    body and the prompt's token ids (None when not given)."""
    if not start.HasField("chat"):
        raise InvalidRequestError("start.chat", "required: the chat as it was rendered")
    chat = _chat_request(start.chat, start.tool_choice, limits, "start.chat")
    _check_ids("start.prompt_token_ids", start.prompt_token_ids, vocabulary)
    return chat, list(start.prompt_token_ids) or None


def _stream_chunk(
    chunk: render_pb.GeneratedSequence, vocabulary: int, request_id: str, eos_ids: frozenset[int]
) -> dict[str, object]:
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
    context: tuple[str, object, list[int] | None, object],
    eos_ids: frozenset[int] = frozenset(),
) -> dict[str, object]:
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
    context: tuple[str, list[int] | None, object],
    eos_ids: frozenset[int] = frozenset(),
) -> dict[str, object]:
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
) -> dict[str, object]:
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


def _text(text: Iterable[int] | None) -> bytes:
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
