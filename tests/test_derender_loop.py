"""A router's whole loop over gRPC against vLLM's own chat completions.

A client renders a chat (Render's RenderChat), generates by token ids over
vllm.Inference (Generate with the rendered ids, the output's token ids
asked for) and derenders the ids (Render's DerenderChat); vLLM's own
`/v1/chat/completions` on the same engine (the launcher's `--http-port`) is
asked the same chat. Both run greedy (temperature 0) with the same
max_tokens, so they generate the same ids, and the content, reasoning, tool
calls and finish reason must be the same, one test per case: plain text, a
SentencePiece-style leading space, a tool call in the model's format, a
reasoning section.

Two launchers, one after the other, each a tiny model written here whose
tokenizer and chat template fit parsers vLLM ships (`support/tool_models.py`):
the byte-level tiny model with vLLM's `pythonic` tool-call parser, and a
SentencePiece-style tokenizer (Metaspace, byte fallback) with a Hermes chat
template and `<tool_call>` tokens, with vLLM's `hermes` parser; both with
`--reasoning-parser deepseek_v3` (its `thinking` template variable switches
reasoning on, else the answer is all content).

The tiny models' weights are seeded random numbers: on their own they write
gibberish, never a tool call or a closed reasoning section. Those cases are
forced on both paths alike with a regular expression (vLLM's structured
outputs, the engine started with `enable_in_reasoning` so that it holds from
the first token, reasoning included) and a logit bias on the markers'
tokens (`<think>`, `<tool_call>`...), so that the grammar writes each as
its own token, as a trained model does, not in pieces; the markers are
added tokens that are not special, as DeepSeek-R1's `<think>` and Qwen
2.5's `<tool_call>` (xgrammar allows no special token but the EOS). The ids
each path generated are compared too, so that both answers are of the same
generation. The render
stubs are compiled from the shipped render.proto; the Inference stubs from
vLLM's released inference.proto, which the shipped copy must equal field for
field (`test_vllm_protos.py`): one schema of that name fits in protobuf's
default pool.

Streamed derendering of the same ids, split a token at a time and in chunks
of several (inside the tool call, inside multi-byte characters), must end as
the batch.
"""

from __future__ import annotations

import json
import re
import types
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import pytest
from support import bearer
from support.launcher import Launched, launched, launcher_env
from support.tool_models import THINK, TOOL_CALL, hermes_model, thinking_model
from support.vllm_http import post_json
from support.vllm_protocol import reference_modules, shipped_modules

from vllm_servicer.testing.tiny_model import TINY_ENGINE_KWARGS, tiny_engine_flags

KEY = "derender-loop-0123456789abcdef0123456"
AUTH = bearer(KEY)
MAX_TOKENS = 96
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "description": "a city"}},
    "required": ["city"],
}
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the weather in Zürich?"},
]


def _literal(text: str) -> str:
    """A regular expression matching `text` alone (for vLLM's structured outputs)."""
    escaped = re.sub(r"([\\.^$*+?()\[\]{}|])", r"\\\1", text)
    return escaped.replace("\n", "\\n")


# Each launcher: how its model is written, vLLM's tool-call parser, the
# tool call forced in the model's format, and the reasoning forced (the
# Hermes template opens `<think>` in the prompt when thinking is on).
LAUNCHERS: dict[str, tuple[Any, str, str, str]] = {
    "pythonic": (
        thinking_model,
        "pythonic",
        _literal('[get_weather(city="Zürich ☕")]'),
        _literal("<think>Café ☕ first.</think>It is sunny."),
    ),
    "hermes": (
        hermes_model,
        "hermes",
        _literal(
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich ☕"}}\n</tool_call>'
        ),
        _literal("Café ☕ first.</think>It is sunny."),
    ),
}
CASES = ("plain text", "a leading space", "a tool call", "a reasoning section")


@pytest.fixture(scope="module")
def render_pb() -> tuple[types.ModuleType, types.ModuleType]:
    return shipped_modules("render")


@pytest.fixture(scope="module")
def inference_pb() -> tuple[types.ModuleType, types.ModuleType]:
    return reference_modules("inference")


@pytest.fixture(scope="module", params=list(LAUNCHERS))
async def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[str, Launched, dict[int, float]]]:
    name = request.param
    write, parser, _, _ = LAUNCHERS[name]
    model = write(tmp_path_factory.mktemp("models") / f"{name}-llama", special=False)
    positions = json.loads((model / "config.json").read_text())["max_position_embeddings"]
    settings = {**TINY_ENGINE_KWARGS, "max_model_len": positions}
    flags = ("--model", str(model), *tiny_engine_flags(settings))
    flags += ("--http-port", "0", "--enable-scale-out", "--api-key", KEY)
    flags += ("--reasoning-parser", "deepseek_v3")
    flags += ("--tool-call-parser", parser, "--enable-auto-tool-choice")
    flags += ("--structured-outputs-config", json.dumps({"enable_in_reasoning": True}))
    env = launcher_env(tmp_path_factory.mktemp(f"{name}-cache"))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    markers = [m for m in (*THINK, *TOOL_CALL) if m in tokenizer.get_vocab()]
    bias = dict.fromkeys(tokenizer.convert_tokens_to_ids(markers), 100.0)
    async with launched(*flags, env=env) as launcher:
        yield name, launcher, bias


@pytest.fixture(scope="module")
async def clients(
    served: tuple[str, Launched, dict[int, float]], render_pb: Any, inference_pb: Any
) -> AsyncIterator[tuple[str, Any, Any, httpx.AsyncClient, dict[int, float]]]:
    name, launcher, bias = served
    headers = {"Authorization": f"Bearer {KEY}"}
    async with (
        grpc.aio.insecure_channel(launcher.address) as channel,
        httpx.AsyncClient(base_url=launcher.http_url, headers=headers, timeout=300) as http,
    ):
        render = render_pb[1].RenderStub(channel)
        yield name, render, inference_pb[1].InferenceStub(channel), http, bias


def _case(name: str, case: str) -> tuple[str | None, bool, dict[str, Any]]:
    """The case's forced output (a regular expression, None: none), whether the
    chat has the tool, and its template variables."""
    _, _, tool_call, reasoning = LAUNCHERS[name]
    if case == "plain text":
        return None, False, {}
    if case == "a leading space":
        # The first generated token carries the space (`▁Paris`, `ĠParis`);
        # decoded alone, a SentencePiece tokenizer drops it.
        return _literal(" Paris is sunny."), False, {}
    if case == "a tool call":
        return tool_call, True, {}
    return reasoning, False, {"thinking": True}


def _chat(pb: Any, with_tool: bool, kwargs: dict[str, Any]) -> Any:
    chat = pb.RenderChatRequest(
        messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in MESSAGES]
    )
    if with_tool:
        chat.tools.append(
            pb.Tool(name="get_weather", description="the weather", parameters=json.dumps(WEATHER))
        )
    if kwargs:
        chat.chat_template_kwargs.update(kwargs)
    return chat


def _sequence(pb: Any, inference: Any, output: Any) -> Any:
    """What vllm.Inference generated, as Render's GeneratedSequence."""
    finish = output.finish_info
    reason = inference.FinishInfo.FinishReason.Name(finish.finish_reason)
    sequence = pb.GeneratedSequence(
        index=output.index,
        token_ids=output.token_ids,
        finish_reason={"STOP": "stop", "LENGTH": "length", "ABORTED": "abort"}[reason],
    )
    which = finish.WhichOneof("stop_reason")
    # An EOS token stops without a stop reason, as vLLM's OpenAI answers.
    if which == "stop_token_id":
        sequence.stop_token_id = finish.stop_token_id
    elif which == "stop_string":
        sequence.stop_string = finish.stop_string
    return sequence


async def _loop(
    clients: tuple[str, Any, Any, httpx.AsyncClient, dict[int, float]],
    render_pb: Any,
    inference_pb: Any,
    case: str,
) -> tuple[Any, list[int], Any, dict[str, Any]]:
    """The router's loop for `case` and vLLM's chat completion of the same chat:
    (the chat, the prompt's ids, the generated sequence, vLLM's answer)."""
    name, render, inference, http, bias = clients
    pb, ipb = render_pb[0], inference_pb[0]
    forced, with_tool, kwargs = _case(name, case)
    chat = _chat(pb, with_tool, kwargs)
    prompt = list((await render.RenderChat(chat, metadata=AUTH)).token_ids)
    request = ipb.GenerateRequest(
        token_ids=ipb.TokenIds(ids=prompt),
        temperature=0.0,
        stopping=ipb.StoppingCriteria(max_new_tokens=MAX_TOKENS),
        response=ipb.ResponseOptions(output_token_ids=True),
    )
    if forced is not None:
        request.decoding.regex = forced
        request.decoding.logit_bias.update(bias)
    generated = await inference.Generate(request, metadata=AUTH, timeout=300)
    sequence = _sequence(pb, ipb, generated.outputs)

    body: dict[str, Any] = {
        "messages": MESSAGES,
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "return_token_ids": True,
    }
    if forced is not None:
        body["structured_outputs"] = {"regex": forced}
        body["logit_bias"] = {str(token_id): value for token_id, value in bias.items()}
    if with_tool:
        body |= {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "description": "the weather",
                        "parameters": WEATHER,
                    },
                }
            ],
            "tool_choice": "auto",
        }
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    expected = await post_json(http, "/v1/chat/completions", body)
    # The same prompt, and the same generation on both paths.
    assert expected["prompt_token_ids"] == prompt
    assert expected["choices"][0]["token_ids"] == list(sequence.token_ids)
    return chat, prompt, sequence, expected


@pytest.mark.parametrize("case", CASES)
async def test_render_generate_by_ids_and_derender_is_vllms_chat_completion(
    clients: Any, render_pb: Any, inference_pb: Any, case: str
) -> None:
    render = clients[1]
    pb = render_pb[0]
    chat, prompt, sequence, expected = await _loop(clients, render_pb, inference_pb, case)
    answer = await render.DerenderChat(
        pb.DerenderChatRequest(chat=chat, prompt_token_ids=prompt, choices=[sequence]),
        metadata=AUTH,
    )
    (got,) = answer.choices
    (want,) = expected["choices"]
    message = want["message"]
    content = got.content if got.HasField("content") else None
    reasoning = got.reasoning if got.HasField("reasoning") else None
    assert content == message["content"]
    assert reasoning == message.get("reasoning")
    assert [(c.name, c.arguments) for c in got.tool_calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or ()
    ]
    assert got.finish_reason == want["finish_reason"]
    assert answer.completion_tokens == expected["usage"]["completion_tokens"]
    # What the case is about, so that equal answers are not equally empty.
    if case == "plain text":
        assert content and reasoning is None and not got.tool_calls
        assert got.finish_reason == "length"
    if case == "a leading space":
        assert content == " Paris is sunny."
    if case == "a tool call":
        assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == [
            ("get_weather", {"city": "Zürich ☕"})
        ]
    if case == "a reasoning section":
        assert (reasoning, content) == ("Café ☕ first.", "It is sunny.")


def _split(token_ids: list[int], sizes: tuple[int, ...]) -> list[list[int]]:
    """`token_ids` in chunks of `sizes` (cycled), the last one what is left."""
    chunks, at, turn = [], 0, 0
    while at < len(token_ids):
        size = sizes[turn % len(sizes)]
        chunks.append(token_ids[at : at + size])
        at, turn = at + size, turn + 1
    return chunks


# The first token alone in its chunk, as an engine streaming every step sends
# it: vLLM's deepseek_r1 parser keeps `<think>` in the streamed reasoning when
# it arrives with other tokens (over HTTP alike; docs/protocol.md).
@pytest.mark.parametrize("sizes", [(1,), (1, 3, 2)], ids=["a token a chunk", "1-3-2"])
@pytest.mark.parametrize("case", ["a tool call", "a reasoning section"])
async def test_streamed_derender_ends_as_the_batch(
    clients: Any, render_pb: Any, inference_pb: Any, case: str, sizes: tuple[int, ...]
) -> None:
    render = clients[1]
    pb = render_pb[0]
    chat, prompt, sequence, _ = await _loop(clients, render_pb, inference_pb, case)
    chunks = _split(list(sequence.token_ids), sizes)

    async def messages() -> AsyncIterator[Any]:
        yield pb.DerenderChatStreamRequest(
            start=pb.DerenderChatStart(chat=chat, prompt_token_ids=prompt)
        )
        for number, ids in enumerate(chunks):
            last = number == len(chunks) - 1
            yield pb.DerenderChatStreamRequest(
                chunk=pb.GeneratedSequence(
                    token_ids=ids, finish_reason=sequence.finish_reason if last else ""
                )
            )

    deltas = [d async for d in render.DerenderChatStream(messages(), metadata=AUTH)]
    assert len(deltas) == len(chunks)
    batch = await render.DerenderChat(
        pb.DerenderChatRequest(chat=chat, prompt_token_ids=prompt, choices=[sequence]),
        metadata=AUTH,
    )
    (whole,) = batch.choices
    content = "".join(d.content for d in deltas if d.HasField("content"))
    reasoning = "".join(d.reasoning for d in deltas if d.HasField("reasoning"))
    assert content == (whole.content if whole.HasField("content") else "")
    assert reasoning == (whole.reasoning if whole.HasField("reasoning") else "")
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        for call in delta.tool_calls:
            calls.setdefault(call.index, ["", ""])
            calls[call.index][0] += call.name
            calls[call.index][1] += call.arguments
    assert [(n, json.loads(a)) for n, a in calls.values()] == [
        (c.name, json.loads(c.arguments)) for c in whole.tool_calls
    ]
    if case == "a tool call":
        assert [c.name for c in whole.tool_calls] == ["get_weather"]
    else:
        assert (reasoning, content) == ("Café ☕ first.", "It is sunny.")
