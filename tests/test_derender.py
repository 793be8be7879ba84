"""vllm_servicer.v1.Render's derender against vLLM's own HTTP derender routes.

One launcher as users run it, on a copy of the tiny model whose tokenizer has
`<think>` and `</think>` as tokens, started with vLLM's parsers
(`--reasoning-parser deepseek_r1`, `--tool-call-parser pythonic
--enable-auto-tool-choice`) and vLLM's HTTP API with `--enable-scale-out` on
the same engine. Called over gRPC with stubs compiled from the shipped
render.proto and over HTTP (/v1/chat/completions/derender,
/v1/completions/derender): text, reasoning, tool calls, finish and stop
reasons and logprobs must be the same, a streamed derender the same as the
route's chunk for chunk (its stream state carried by the test) and, put
together, the batch's; bad input is refused naming the field. The token ids
come from the service's own RenderCompletion.
"""

from __future__ import annotations

import json
import types
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import pytest
from support import bearer
from support.launcher import Launched, launched, launcher_env
from support.tool_models import thinking_model
from support.vllm_http import post_json
from support.vllm_protocol import shipped_modules

from vllm_servicer.testing.tiny_model import tiny_engine_flags

KEY = "derender-tenant-0123456789abcdef0123"
AUTH = bearer(KEY)
MAX_DERENDER_TOKENS = 2048
MAX_DERENDER_CHUNKS = 256
# Above what the chunk budget's 256 one-token chunks replay (256 * 257 / 2).
MAX_DERENDER_WORK = 40_000
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "description": "a city"}},
    "required": ["city"],
}
HTTP_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "the weather", "parameters": WEATHER},
}
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the weather in Paris?"},
]


@pytest.fixture(scope="module")
def stubs() -> tuple[types.ModuleType, types.ModuleType]:
    return shipped_modules("render")


@pytest.fixture(scope="module")
async def launcher(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Launched]:
    cache = tmp_path_factory.mktemp("derender-cache")
    model = thinking_model(tmp_path_factory.mktemp("models") / "thinking-llama")
    flags = ("--model", str(model), *tiny_engine_flags())
    flags += ("--http-port", "0", "--enable-scale-out", "--api-key", KEY)
    flags += ("--reasoning-parser", "deepseek_r1")
    flags += ("--tool-call-parser", "pythonic", "--enable-auto-tool-choice")
    flags += ("--max-derender-tokens", str(MAX_DERENDER_TOKENS))
    flags += ("--max-derender-chunks", str(MAX_DERENDER_CHUNKS))
    flags += ("--max-derender-work", str(MAX_DERENDER_WORK))
    async with launched(*flags, env=launcher_env(cache)) as served:
        yield served


@pytest.fixture(scope="module")
async def render(launcher: Launched, stubs: Any) -> AsyncIterator[Any]:
    async with grpc.aio.insecure_channel(launcher.address) as channel:
        yield stubs[1].RenderStub(channel)


@pytest.fixture(scope="module")
async def http(launcher: Launched) -> AsyncIterator[httpx.AsyncClient]:
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=launcher.http_url, headers=headers, timeout=120) as c:
        yield c


async def _ids(render: Any, pb: Any, text: str) -> list[int]:
    """`text`'s token ids, from the service's own RenderCompletion (no BOS)."""
    answer = await render.RenderCompletion(
        pb.RenderCompletionRequest(prompt=[text], add_special_tokens=False), metadata=AUTH
    )
    return list(answer.prompts[0].token_ids)


def _logprobs(token_ids: list[int], vocabulary: int = 300) -> list[dict[str, Any]]:
    """Made-up logprobs for `token_ids`: the sampled token and two others at each."""
    return [
        {
            "token_id": token_id,
            "logprob": -0.25 * (i + 1),
            "top_logprobs": [
                {"token_id": token_id, "logprob": -0.25 * (i + 1)},
                {"token_id": (token_id + 7) % vocabulary, "logprob": -2.5},
                {"token_id": (token_id + 11) % vocabulary, "logprob": -3.75},
            ],
        }
        for i, token_id in enumerate(token_ids)
    ]


def _sequence(pb: Any, choice: dict[str, Any]) -> Any:
    """A GeneratedSequence from vLLM's token-id choice (its generate response's)."""
    sequence = pb.GeneratedSequence(
        index=choice["index"],
        token_ids=choice["token_ids"],
        finish_reason=choice.get("finish_reason", ""),
        logprobs=[
            pb.GeneratedLogprob(
                token_id=entry["token_id"],
                logprob=entry["logprob"],
                top_logprobs=[pb.TokenLogprob(**top) for top in entry["top_logprobs"]],
            )
            for entry in (choice.get("logprobs") or {}).get("content", ())
        ],
    )
    stop = choice.get("stop_reason")
    if isinstance(stop, int):
        sequence.stop_token_id = stop
    elif stop is not None:
        sequence.stop_string = stop
    return sequence


def _stop(choice: Any) -> Any:
    which = choice.WhichOneof("stop_reason")
    return None if which is None else getattr(choice, which)


def _chat_logprobs(choice: Any) -> Any:
    if not choice.logprobs:
        return None
    return {
        "content": [
            {
                "token": entry.token,
                "logprob": entry.logprob,
                "bytes": list(entry.bytes),
                "top_logprobs": [
                    {"token": top.token, "logprob": top.logprob, "bytes": list(top.bytes)}
                    for top in entry.top_logprobs
                ],
            }
            for entry in choice.logprobs
        ]
    }


def _http_chat_logprobs(logprobs: Any) -> Any:
    if not logprobs or not logprobs.get("content"):
        return None
    return {
        "content": [
            {
                "token": entry["token"],
                "logprob": entry["logprob"],
                "bytes": entry["bytes"],
                "top_logprobs": [
                    {"token": top["token"], "logprob": top["logprob"], "bytes": top["bytes"]}
                    for top in entry["top_logprobs"]
                ],
            }
            for entry in logprobs["content"]
        ]
    }


# Each case: the generated text, whether the chat has the tool, the choice's
# finish, and whether it carries logprobs.
CHAT_CASES: dict[str, tuple[str, bool, dict[str, Any], bool]] = {
    "reasoning then an answer": (
        "<think>Sunny, probably.</think>It is sunny in Paris.",
        False,
        {"finish_reason": "stop"},
        True,
    ),
    "a tool call after reasoning": (
        '<think>Ask the tool.</think>[get_weather(city="Paris")]',
        True,
        {"finish_reason": "stop", "stop_reason": 2},
        False,
    ),
    "reasoning cut short": (
        "<think>The weather in Paris is",
        False,
        {"finish_reason": "length"},
        True,
    ),
    "a stop string": (
        "<think>x</think>Paris, yes.",
        True,
        {"finish_reason": "stop", "stop_reason": "yes"},
        False,
    ),
}


@pytest.mark.parametrize("case", list(CHAT_CASES))
async def test_derender_chat_is_vllms_http_derender(
    render: Any, stubs: Any, http: httpx.AsyncClient, case: str
) -> None:
    pb = stubs[0]
    text, with_tool, finish, with_logprobs = CHAT_CASES[case]
    chat = pb.RenderChatRequest(
        messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in MESSAGES]
    )
    http_chat: dict[str, Any] = {"messages": MESSAGES}
    if with_tool:
        chat.tools.append(
            pb.Tool(name="get_weather", description="the weather", parameters=json.dumps(WEATHER))
        )
        http_chat |= {"tools": [HTTP_TOOL], "tool_choice": "auto"}
    prompt = list((await render.RenderChat(chat, metadata=AUTH)).token_ids)
    generated = await _ids(render, pb, text)
    choice: dict[str, Any] = {"index": 0, "token_ids": generated, **finish}
    if with_logprobs:
        choice["logprobs"] = {"content": _logprobs(generated)}

    answer = await render.DerenderChat(
        pb.DerenderChatRequest(chat=chat, prompt_token_ids=prompt, choices=[_sequence(pb, choice)]),
        metadata=AUTH,
    )
    expected = await post_json(
        http,
        "/v1/chat/completions/derender",
        {
            "generate_response": {"request_id": "r", "choices": [choice]},
            "chat_request": http_chat,
            "prompt_token_ids": prompt,
        },
    )

    assert answer.completion_tokens == expected["usage"]["completion_tokens"] == len(generated)
    (got,) = answer.choices
    (want,) = expected["choices"]
    message = want["message"]
    assert (got.content if got.HasField("content") else None) == message["content"]
    assert (got.reasoning if got.HasField("reasoning") else None) == message.get("reasoning")
    assert [(c.name, c.arguments) for c in got.tool_calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or ()
    ]
    assert all(c.id for c in got.tool_calls)
    # After tool calls the model chose to make, the finish is "tool_calls", as
    # vLLM's chat completions say it; vLLM's derender keeps the generation's.
    assert got.finish_reason == (
        "tool_calls" if message.get("tool_calls") else want["finish_reason"]
    )
    assert _stop(got) == want["stop_reason"]
    assert _chat_logprobs(got) == _http_chat_logprobs(want["logprobs"])
    # What the parsers made of it, so that equal answers are not equally empty.
    if case == "reasoning then an answer":
        assert (got.reasoning, got.content) == ("Sunny, probably.", "It is sunny in Paris.")
        assert len(got.logprobs) == len(generated) and len(got.logprobs[0].top_logprobs) == 3
    if case == "a tool call after reasoning":
        assert got.reasoning == "Ask the tool."
        assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == [
            ("get_weather", {"city": "Paris"})
        ]


async def test_derender_completion_is_vllms_http_derender(
    render: Any, stubs: Any, http: httpx.AsyncClient
) -> None:
    pb = stubs[0]
    prompts = ["The quick brown", "Café au lait, s'il vous plaît:"]
    rendered = await render.RenderCompletion(
        pb.RenderCompletionRequest(prompt=prompts), metadata=AUTH
    )
    prompt_ids = [list(p.token_ids) for p in rendered.prompts]
    # A leading space the first token carries after the prompt; a multi-byte
    # character (é, ☕) split across byte tokens; two choices of one prompt.
    first = await _ids(render, pb, " fox jumps over the lazy dog.")
    second = await _ids(render, pb, " déjà vu ☕ è")
    third = await _ids(render, pb, " yes")
    generations = [
        [
            {
                "index": 0,
                "token_ids": first,
                "finish_reason": "length",
                "logprobs": {"content": _logprobs(first)},
            },
        ],
        [
            {"index": 0, "token_ids": second, "finish_reason": "stop", "stop_reason": "!"},
            {"index": 1, "token_ids": third, "finish_reason": "stop", "stop_reason": 2},
        ],
    ]
    answer = await render.DerenderCompletion(
        pb.DerenderCompletionRequest(
            prompts=[
                pb.PromptGeneration(
                    prompt_token_ids=ids, choices=[_sequence(pb, c) for c in choices]
                )
                for ids, choices in zip(prompt_ids, generations, strict=True)
            ]
        ),
        metadata=AUTH,
    )
    expected = await post_json(
        http,
        "/v1/completions/derender",
        {
            "generate_responses": [
                {"request_id": f"r{i}", "choices": choices} for i, choices in enumerate(generations)
            ],
            "prompt_token_ids": prompt_ids,
        },
    )
    assert [c.text for c in answer.choices] == [
        " fox jumps over the lazy dog.",
        " déjà vu ☕ è",
        " yes",
    ]
    assert answer.completion_tokens == expected["usage"]["completion_tokens"]
    assert len(answer.choices) == len(expected["choices"]) == 3
    for got, want in zip(answer.choices, expected["choices"], strict=True):
        assert (got.index, got.text, got.finish_reason, _stop(got)) == (
            want["index"],
            want["text"],
            want["finish_reason"],
            want["stop_reason"],
        )
        logprobs = want["logprobs"]
        if logprobs is None:
            assert not got.logprobs
            continue
        assert [e.token for e in got.logprobs] == logprobs["tokens"]
        assert [e.logprob for e in got.logprobs] == logprobs["token_logprobs"]
        assert [e.text_offset for e in got.logprobs] == logprobs["text_offset"]
        assert [{t.token: t.logprob for t in e.top_logprobs} for e in got.logprobs] == (
            logprobs["top_logprobs"]
        )


def _chat(pb: Any, **fields: Any) -> Any:
    chat = pb.RenderChatRequest(messages=[pb.ChatMessage(role="user", content="Hi")])
    return pb.DerenderChatRequest(
        chat=chat, choices=[pb.GeneratedSequence(token_ids=[5, 6])], **fields
    )


@pytest.mark.parametrize(
    ("build", "code", "field"),
    [
        (
            lambda pb: pb.DerenderChatRequest(choices=[pb.GeneratedSequence(token_ids=[5])]),
            "INVALID_ARGUMENT",
            "chat",
        ),
        (lambda pb: pb.DerenderChatRequest(chat=_chat(pb).chat), "INVALID_ARGUMENT", "choices"),
        (
            lambda pb: pb.DerenderChatRequest(
                chat=_chat(pb).chat, choices=[pb.GeneratedSequence()]
            ),
            "INVALID_ARGUMENT",
            "choices[0].token_ids",
        ),
        (
            lambda pb: pb.DerenderChatRequest(
                chat=_chat(pb).chat, choices=[pb.GeneratedSequence(token_ids=[5, 10**6])]
            ),
            "INVALID_ARGUMENT",
            "choices[0].token_ids[1]",
        ),
        (
            lambda pb: _chat(pb, prompt_token_ids=[1, 10**6]),
            "INVALID_ARGUMENT",
            "prompt_token_ids[1]",
        ),
        (
            lambda pb: pb.DerenderChatRequest(
                chat=_chat(pb).chat,
                choices=[
                    pb.GeneratedSequence(
                        token_ids=[5, 6], logprobs=[pb.GeneratedLogprob(token_id=5)]
                    )
                ],
            ),
            "INVALID_ARGUMENT",
            "choices[0].logprobs",
        ),
        (lambda pb: _chat(pb, tool_choice="get_weather"), "INVALID_ARGUMENT", "tool_choice"),
        (
            lambda pb: pb.DerenderChatRequest(
                chat=pb.RenderChatRequest(), choices=[pb.GeneratedSequence(token_ids=[5])]
            ),
            "INVALID_ARGUMENT",
            "chat.messages",
        ),
        (
            lambda pb: pb.DerenderChatRequest(
                chat=pb.RenderChatRequest(
                    messages=[pb.ChatMessage(role="user", content="Hi")], model="elsewhere"
                ),
                choices=[pb.GeneratedSequence(token_ids=[5])],
            ),
            "NOT_FOUND",
            "chat.model",
        ),
        (
            lambda pb: _chat(pb, prompt_token_ids=[5] * MAX_DERENDER_TOKENS),
            "INVALID_ARGUMENT",
            "choices",
        ),
    ],
    ids=[
        "no chat",
        "no choices",
        "a choice without tokens",
        "a token id past the vocabulary",
        "a prompt id past the vocabulary",
        "logprobs not one per token",
        "a tool choice the chat lacks",
        "a chat without messages",
        "a model not served",
        "past the token budget",
    ],
)
async def test_bad_derender_chat_input_is_refused_naming_the_field(
    render: Any, stubs: Any, build: Any, code: str, field: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await render.DerenderChat(build(stubs[0]), metadata=AUTH)
    assert err.value.code() == grpc.StatusCode[code], err.value.details()
    assert (err.value.details() or "").startswith(f"{field}: "), err.value.details()


async def test_derender_completion_needs_a_key_and_its_prompts(render: Any, stubs: Any) -> None:
    pb = stubs[0]
    one = pb.DerenderCompletionRequest(
        prompts=[pb.PromptGeneration(choices=[pb.GeneratedSequence(token_ids=[5])])]
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await render.DerenderCompletion(one)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    for request, field in (
        (pb.DerenderCompletionRequest(), "prompts"),
        (
            pb.DerenderCompletionRequest(prompts=[pb.PromptGeneration()]),
            "prompts[0].choices",
        ),
        (
            pb.DerenderCompletionRequest(
                prompts=[
                    pb.PromptGeneration(
                        choices=[pb.GeneratedSequence(token_ids=[5] * MAX_DERENDER_TOKENS)]
                    )
                    for _ in range(2)
                ]
            ),
            "prompts",
        ),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await render.DerenderCompletion(request, metadata=AUTH)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (err.value.details() or "").startswith(f"{field}: "), err.value.details()
    assert (await render.DerenderCompletion(one, metadata=AUTH)).choices[0].text


def _split(token_ids: list[int], sizes: tuple[int, ...]) -> list[list[int]]:
    """`token_ids` in chunks of `sizes` (cycled), the last one what is left."""
    chunks, at, turn = [], 0, 0
    while at < len(token_ids):
        size = sizes[turn % len(sizes)]
        chunks.append(token_ids[at : at + size])
        at, turn = at + size, turn + 1
    return chunks


def _delta(pb: Any, delta: Any) -> dict[str, Any]:
    return {
        "content": delta.content if delta.HasField("content") else None,
        "reasoning": delta.reasoning if delta.HasField("reasoning") else None,
        "tool_calls": [(c.index, c.name, c.arguments) for c in delta.tool_calls],
        "finish_reason": delta.finish_reason or None,
    }


def _http_delta(chunk: dict[str, Any]) -> dict[str, Any]:
    (choice,) = chunk["choices"] or [{"delta": {}, "finish_reason": None}]
    message = choice["delta"]
    return {
        "content": message.get("content"),
        "reasoning": message.get("reasoning"),
        "tool_calls": [
            (
                c.get("index", 0),
                (c.get("function") or {}).get("name") or "",
                (c.get("function") or {}).get("arguments") or "",
            )
            for c in message.get("tool_calls") or ()
        ],
        "finish_reason": choice.get("finish_reason"),
    }


# Each case: the generated text, whether the chat has the tool, the chunk sizes.
STREAM_CASES: dict[str, tuple[str, bool, tuple[int, ...]]] = {
    # One token at a time: byte tokens split é, ☕ and ° between chunks.
    "reasoning and multi-byte characters, a token at a time": (
        "<think>Café ☕ first.</think>It is 21 °C in Paris.",
        False,
        (1,),
    ),
    # `<think>` alone in the first chunk, as an engine streaming every step
    # sends it: vLLM's deepseek_r1 parser keeps `<think>` in the streamed
    # reasoning when it arrives with other tokens (over HTTP alike).
    "a tool call split inside its name and arguments": (
        '<think>Ask the tool.</think>[get_weather(city="Paris")]',
        True,
        (1, 2, 3),
    ),
}


@pytest.mark.parametrize("case", list(STREAM_CASES))
async def test_streamed_derender_is_vllms_chunk_for_chunk_and_ends_as_the_batch(
    render: Any, stubs: Any, http: httpx.AsyncClient, case: str
) -> None:
    pb = stubs[0]
    text, with_tool, sizes = STREAM_CASES[case]
    chat = pb.RenderChatRequest(
        messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in MESSAGES]
    )
    http_chat: dict[str, Any] = {"messages": MESSAGES}
    if with_tool:
        chat.tools.append(
            pb.Tool(name="get_weather", description="the weather", parameters=json.dumps(WEATHER))
        )
        http_chat |= {"tools": [HTTP_TOOL], "tool_choice": "auto"}
    prompt = list((await render.RenderChat(chat, metadata=AUTH)).token_ids)
    generated = await _ids(render, pb, text)
    chunks = _split(generated, sizes)
    finishes = [None] * (len(chunks) - 1) + ["stop"]

    async def messages() -> AsyncIterator[Any]:
        start = pb.DerenderChatStart(chat=chat, prompt_token_ids=prompt)
        for number, (ids, finish) in enumerate(zip(chunks, finishes, strict=True)):
            chunk = pb.GeneratedSequence(token_ids=ids, finish_reason=finish or "")
            yield (
                pb.DerenderChatStreamRequest(start=start, chunk=chunk)
                if number == 0
                else (pb.DerenderChatStreamRequest(chunk=chunk))
            )

    deltas = [
        _delta(pb, delta) async for delta in render.DerenderChatStream(messages(), metadata=AUTH)
    ]
    expected, state = [], None
    for ids, finish in zip(chunks, finishes, strict=True):
        answer = await post_json(
            http,
            "/v1/chat/completions/derender",
            {
                "stream": True,
                "generate_chunk": {
                    "request_id": "r",
                    "choices": [{"index": 0, "token_ids": ids, "finish_reason": finish}],
                },
                "stream_state": state,
                "chat_request": http_chat,
                "prompt_token_ids": prompt,
            },
        )
        expected.append(_http_delta(answer["chunk"]))
        state = answer["stream_state"]
    assert deltas == expected

    # Put together, the deltas are the batch derender's answer.
    batch = await render.DerenderChat(
        pb.DerenderChatRequest(
            chat=chat,
            prompt_token_ids=prompt,
            choices=[pb.GeneratedSequence(token_ids=generated)],
        ),
        metadata=AUTH,
    )
    (whole,) = batch.choices
    content = "".join(d["content"] or "" for d in deltas)
    reasoning = "".join(d["reasoning"] or "" for d in deltas)
    assert content == (whole.content if whole.HasField("content") else "")
    assert reasoning == whole.reasoning
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        for index, name, arguments in delta["tool_calls"]:
            calls.setdefault(index, ["", ""])
            calls[index][0] += name
            calls[index][1] += arguments
    assert [(name, json.loads(arguments)) for name, arguments in calls.values()] == [
        (c.name, json.loads(c.arguments)) for c in whole.tool_calls
    ]
    if with_tool:
        assert [c.name for c in whole.tool_calls] == ["get_weather"]
    else:
        assert (reasoning, content) == ("Café ☕ first.", "It is 21 °C in Paris.")
    # A finish after tool calls is "tool_calls", as vLLM's chat completions
    # say it: streamed (vLLM's derender, over HTTP alike) and batch (where
    # vLLM's derender keeps the generation's "stop" and the service does not).
    assert deltas[-1]["finish_reason"] == ("tool_calls" if with_tool else "stop")
    assert whole.finish_reason == ("tool_calls" if with_tool else "stop")


async def test_a_stream_needs_a_key_opens_with_the_chat_and_sends_tokens(
    render: Any, stubs: Any
) -> None:
    pb = stubs[0]

    async def without_start() -> AsyncIterator[Any]:
        yield pb.DerenderChatStreamRequest(chunk=pb.GeneratedSequence(token_ids=[5]))

    # Refused before a message is read: nothing written, so that the client's
    # own write does not race the refusal.
    unauthenticated = render.DerenderChatStream()
    assert await unauthenticated.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in render.DerenderChatStream(without_start(), metadata=AUTH):
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("start: "), err.value.details()

    async def empty_chunk() -> AsyncIterator[Any]:
        chat = pb.RenderChatRequest(messages=[pb.ChatMessage(role="user", content="Hi")])
        start = pb.DerenderChatStart(chat=chat, prompt_token_ids=[1, 5])
        yield pb.DerenderChatStreamRequest(start=start, chunk=pb.GeneratedSequence(token_ids=[5]))
        yield pb.DerenderChatStreamRequest(chunk=pb.GeneratedSequence())

    answers = []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for answer in render.DerenderChatStream(empty_chunk(), metadata=AUTH):
            answers.append(answer)
    assert len(answers) == 1
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("chunk.token_ids: "), err.value.details()


async def test_streamed_completion_derender_is_vllms_chunk_for_chunk_and_ends_as_the_batch(
    render: Any, stubs: Any, http: httpx.AsyncClient
) -> None:
    pb = stubs[0]
    rendered = await render.RenderCompletion(
        pb.RenderCompletionRequest(prompt=["Café au lait, s'il vous plaît:"]), metadata=AUTH
    )
    prompt = list(rendered.prompts[0].token_ids)
    # A leading space after the prompt, then characters of two and three
    # bytes (é, à, ☕) that the tokenizer splits into byte tokens: one token a
    # chunk splits each between chunks.
    generated = await _ids(render, pb, " déjà vu ☕ è.")
    logprobs = _logprobs(generated)
    chunks = _split(list(range(len(generated))), (1,))
    finishes = [None] * (len(chunks) - 1) + ["length"]

    def chunk(positions: list[int], finish: str | None) -> dict[str, Any]:
        return {
            "index": 0,
            "token_ids": [generated[i] for i in positions],
            "finish_reason": finish,
            "logprobs": {"content": [logprobs[i] for i in positions]},
        }

    async def messages() -> AsyncIterator[Any]:
        start = pb.DerenderCompletionStart(prompt_token_ids=prompt)
        for number, (positions, finish) in enumerate(zip(chunks, finishes, strict=True)):
            sequence = _sequence(pb, chunk(positions, finish))
            yield (
                pb.DerenderCompletionStreamRequest(start=start, chunk=sequence)
                if number == 0
                else pb.DerenderCompletionStreamRequest(chunk=sequence)
            )

    deltas = [delta async for delta in render.DerenderCompletionStream(messages(), metadata=AUTH)]
    assert len(deltas) == len(chunks)
    expected, state = [], None
    for positions, finish in zip(chunks, finishes, strict=True):
        answer = await post_json(
            http,
            "/v1/completions/derender",
            {
                "stream": True,
                "generate_chunk": {"request_id": "r", "choices": [chunk(positions, finish)]},
                "stream_state": state,
                "prompt_token_ids": prompt,
            },
        )
        expected.append(answer["chunk"]["choices"][0])
        state = answer["stream_state"]
    for got, want in zip(deltas, expected, strict=True):
        assert (got.index, got.text, got.finish_reason or None) == (
            want["index"],
            want["text"],
            want["finish_reason"],
        )
        assert [e.token for e in got.logprobs] == want["logprobs"]["tokens"]
        assert [e.logprob for e in got.logprobs] == want["logprobs"]["token_logprobs"]
        assert [e.text_offset for e in got.logprobs] == want["logprobs"]["text_offset"]
    # A chunk that ends inside a character adds no text; the next one adds it whole.
    assert any(d.text == "" for d in deltas[:-1])

    batch = await render.DerenderCompletion(
        pb.DerenderCompletionRequest(
            prompts=[
                pb.PromptGeneration(
                    prompt_token_ids=prompt,
                    choices=[pb.GeneratedSequence(token_ids=generated, finish_reason="length")],
                )
            ]
        ),
        metadata=AUTH,
    )
    assert "".join(d.text for d in deltas) == batch.choices[0].text == " déjà vu ☕ è."
    assert deltas[-1].finish_reason == batch.choices[0].finish_reason == "length"


async def _stream_error(call: Any) -> tuple[list[Any], grpc.aio.AioRpcError]:
    """What a stream answered before it failed, and its failure."""
    answers = []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for answer in call:
            answers.append(answer)
    return answers, err.value


async def test_a_completion_stream_needs_a_key_and_keeps_to_its_budgets(
    render: Any, stubs: Any
) -> None:
    pb = stubs[0]
    start = pb.DerenderCompletionStart(prompt_token_ids=[1, 5])

    # Refused before a message is read.
    assert await render.DerenderCompletionStream().code() == grpc.StatusCode.UNAUTHENTICATED

    def stream(*messages: Any) -> Any:
        async def send() -> AsyncIterator[Any]:
            for message in messages:
                yield message

        return render.DerenderCompletionStream(send(), metadata=AUTH)

    one = pb.GeneratedSequence(token_ids=[5])
    cases = [
        # (the messages, the answers before the refusal, the field named)
        ([pb.DerenderCompletionStreamRequest(chunk=one)], 0, "start"),
        (
            [pb.DerenderCompletionStreamRequest(start=pb.DerenderCompletionStart(model="x"))],
            0,
            "start.model",
        ),
        (
            [
                pb.DerenderCompletionStreamRequest(
                    start=pb.DerenderCompletionStart(prompt_token_ids=[1, 10**6])
                )
            ],
            0,
            "start.prompt_token_ids[1]",
        ),
        (
            [
                pb.DerenderCompletionStreamRequest(start=start, chunk=one),
                pb.DerenderCompletionStreamRequest(start=start, chunk=one),
            ],
            1,
            "start",
        ),
        (
            [
                pb.DerenderCompletionStreamRequest(start=start, chunk=one),
                pb.DerenderCompletionStreamRequest(),
            ],
            1,
            "chunk",
        ),
        (
            [
                pb.DerenderCompletionStreamRequest(start=start),
                pb.DerenderCompletionStreamRequest(
                    chunk=pb.GeneratedSequence(token_ids=[5, 10**6])
                ),
            ],
            0,
            "chunk.token_ids[1]",
        ),
        # Nothing after the finish: a finish without tokens, sent again and
        # again, would have vLLM replay the sequence on each.
        (
            [
                pb.DerenderCompletionStreamRequest(start=start, chunk=one),
                pb.DerenderCompletionStreamRequest(
                    chunk=pb.GeneratedSequence(finish_reason="stop")
                ),
                pb.DerenderCompletionStreamRequest(
                    chunk=pb.GeneratedSequence(finish_reason="stop")
                ),
            ],
            2,
            "chunk",
        ),
        (
            [pb.DerenderCompletionStreamRequest(start=start)]
            + [pb.DerenderCompletionStreamRequest(chunk=one)] * (MAX_DERENDER_CHUNKS + 1),
            MAX_DERENDER_CHUNKS,
            "chunk",
        ),
        (
            [
                pb.DerenderCompletionStreamRequest(
                    start=start, chunk=pb.GeneratedSequence(token_ids=[5] * 1000)
                ),
                pb.DerenderCompletionStreamRequest(
                    chunk=pb.GeneratedSequence(token_ids=[5] * (MAX_DERENDER_TOKENS - 1000))
                ),
            ],
            1,
            "chunk.token_ids",
        ),
    ]
    for messages, answered, field in cases:
        answers, error = await _stream_error(stream(*messages))
        assert (
            error.code()
            == grpc.StatusCode["NOT_FOUND" if field == "start.model" else "INVALID_ARGUMENT"]
        ), (field, error.details())
        assert (error.details() or "").startswith(f"{field}: "), error.details()
        assert len(answers) == answered, field


async def test_a_chat_stream_ends_with_its_finish_and_keeps_to_its_chunk_budget(
    render: Any, stubs: Any
) -> None:
    pb = stubs[0]
    chat = pb.RenderChatRequest(messages=[pb.ChatMessage(role="user", content="Hi")])
    start = pb.DerenderChatStart(chat=chat, prompt_token_ids=[1, 5])
    one = pb.GeneratedSequence(token_ids=[5])

    def stream(*messages: Any) -> Any:
        async def send() -> AsyncIterator[Any]:
            for message in messages:
                yield message

        return render.DerenderChatStream(send(), metadata=AUTH)

    finish = pb.GeneratedSequence(finish_reason="stop")
    answers, error = await _stream_error(
        stream(
            pb.DerenderChatStreamRequest(start=start, chunk=one),
            pb.DerenderChatStreamRequest(chunk=finish),
            pb.DerenderChatStreamRequest(chunk=finish),
        )
    )
    assert len(answers) == 2 and answers[-1].finish_reason == "stop"
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (error.details() or "").startswith("chunk: "), error.details()
    answers, error = await _stream_error(
        stream(
            pb.DerenderChatStreamRequest(start=start),
            *[pb.DerenderChatStreamRequest(chunk=one)] * (MAX_DERENDER_CHUNKS + 1),
        )
    )
    assert len(answers) == MAX_DERENDER_CHUNKS
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--max-derender-chunks" in (error.details() or ""), error.details()


async def test_a_chat_stream_is_cut_past_the_tokens_its_chunks_replay(
    render: Any, stubs: Any
) -> None:
    """With a parser vLLM replays the sequence so far on every chunk: a stream
    is charged each chunk's running length (`--max-derender-work`). 400 tokens
    in chunks of 20 replay 20 * (1 + ... + 20) = 4,200 tokens and are served;
    in chunks of 2, within the chunk and token budgets, they would replay
    2 * (1 + ... + 200) = 40,200, and the stream is cut at chunk 200, the first
    past the budget. A completion stream replays nothing: its chunks of 2 pass."""
    pb = stubs[0]
    chat = pb.RenderChatRequest(messages=[pb.ChatMessage(role="user", content="Hi")])

    def chat_stream(size: int, count: int) -> Any:
        async def send() -> AsyncIterator[Any]:
            start = pb.DerenderChatStart(chat=chat, prompt_token_ids=[1, 5])
            yield pb.DerenderChatStreamRequest(start=start)
            for _ in range(count):
                yield pb.DerenderChatStreamRequest(chunk=pb.GeneratedSequence(token_ids=[5] * size))

        return render.DerenderChatStream(send(), metadata=AUTH)

    served = [delta async for delta in chat_stream(20, 20)]
    assert len(served) == 20
    answers, error = await _stream_error(chat_stream(2, 201))
    assert len(answers) == 199
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = error.details() or ""
    assert details.startswith(
        "chunk: this chunk takes the tokens the stream's chunks replay to 40200"
    ), details
    assert f"budget of {MAX_DERENDER_WORK} per stream (--max-derender-work)" in details, details

    async def completion() -> AsyncIterator[Any]:
        start = pb.DerenderCompletionStart(prompt_token_ids=[1, 5])
        yield pb.DerenderCompletionStreamRequest(start=start)
        for _ in range(201):
            yield pb.DerenderCompletionStreamRequest(chunk=pb.GeneratedSequence(token_ids=[5, 5]))

    deltas = [d async for d in render.DerenderCompletionStream(completion(), metadata=AUTH)]
    assert len(deltas) == 201
