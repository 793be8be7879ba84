"""vllm_servicer.v1.Render against vLLM's own /tokenize and chat and completion paths.

One launcher as users run it (the built-in tiny model, whose tokenizer has a
chat template; keys, metrics, vLLM's HTTP API on the same engine), called over
gRPC with stubs compiled from the shipped render.proto and over HTTP: the token
ids must be those vLLM's /tokenize gives and those its chat and completion
paths run (`prompt_token_ids`), for messages, tools, tool calls and the
template's switches. Rendering runs no engine step; bad input is refused
naming the field; the examples in Python and Node.js run against it.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import types
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import pytest
from support import bearer
from support.launcher import ROOT, Launched, launched, launcher_env
from support.node import run_node
from support.vllm_http import post_json
from support.vllm_protocol import shipped_modules

KEY = "render-tenant-0123456789abcdef0123"
MAX_RENDER_ITEMS = 16
MAX_RENDER_CHARS = 200_000
AUTH = bearer(KEY)
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "description": "a city"}},
    "required": ["city"],
}
SYSTEM = {"role": "system", "content": "Be brief."}
USER = {"role": "user", "content": "What is the weather in Paris?"}


@pytest.fixture(scope="module")
def stubs() -> tuple[types.ModuleType, types.ModuleType]:
    return shipped_modules("render")


@pytest.fixture(scope="module")
async def launcher(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Launched]:
    cache = tmp_path_factory.mktemp("render-cache")
    flags = ("--http-port", "0", "--metrics-port", "0", "--api-key", KEY)
    flags += (
        "--max-render-items",
        str(MAX_RENDER_ITEMS),
        "--max-render-chars",
        str(MAX_RENDER_CHARS),
    )
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


@pytest.fixture(scope="module")
async def model(http: httpx.AsyncClient) -> str:
    return str((await http.get("/v1/models")).json()["data"][0]["id"])


def _tool(pb: Any) -> Any:
    return pb.Tool(name="weather", description="the weather", parameters=json.dumps(WEATHER))


HTTP_TOOL = {
    "type": "function",
    "function": {"name": "weather", "description": "the weather", "parameters": WEATHER},
}
CALL = {
    "id": "call-1",
    "type": "function",
    "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
}


def _message(pb: Any, message: dict[str, Any]) -> Any:
    calls = [
        pb.ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
        for c in message.get("tool_calls", ())
    ]
    return pb.ChatMessage(
        role=message["role"],
        content=message.get("content") or "",
        tool_calls=calls,
        tool_call_id=message.get("tool_call_id", ""),
    )


# Each case: the messages (OpenAI's shape), then the switches both sides get.
CASES = {
    "a question": ([SYSTEM, USER], {}),
    "with tools": ([SYSTEM, USER], {"tools": True}),
    "no generation prompt": ([SYSTEM, USER], {"add_generation_prompt": False}),
    "continuing the answer": (
        [USER, {"role": "assistant", "content": "It is"}],
        {"add_generation_prompt": False, "continue_final_message": True},
    ),
    "a tool call and its result": (
        [
            USER,
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "content": "Sunny, 21 C", "tool_call_id": "call-1"},
        ],
        {"tools": True},
    ),
    "template variables": ([USER], {"chat_template_kwargs": {"enable_thinking": False}}),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_render_chat_gives_the_token_ids_vllm_tokenizes_and_runs(
    render: Any, stubs: Any, http: httpx.AsyncClient, model: str, case: str
) -> None:
    pb = stubs[0]
    messages, switches = CASES[case]
    request = pb.RenderChatRequest(messages=[_message(pb, m) for m in messages])
    body: dict[str, Any] = {"model": model, "messages": messages}
    if switches.get("tools"):
        request.tools.append(_tool(pb))
        body["tools"] = [HTTP_TOOL]
    for name in ("add_generation_prompt", "continue_final_message"):
        if name in switches:
            setattr(request, name, switches[name])
            body[name] = switches[name]
    if "chat_template_kwargs" in switches:
        request.chat_template_kwargs.update(switches["chat_template_kwargs"])
        body["chat_template_kwargs"] = switches["chat_template_kwargs"]
    rendered = await render.RenderChat(request, metadata=AUTH)
    tokenized = await post_json(http, "/tokenize", body)
    assert list(rendered.token_ids) == tokenized["tokens"]
    # The text is those tokens' (special ones included), as the template wrote them.
    assert rendered.text.startswith("<s>") and "weather in Paris" in rendered.text
    assert rendered.text.endswith("<|assistant|>") == body.get("add_generation_prompt", True)
    # What the chat path runs: the prompt of a one-token completion of the same chat.
    chat = await post_json(
        http,
        "/v1/chat/completions",
        {**body, "max_tokens": 1, "return_token_ids": True, "tool_choice": "none"}
        if "tools" in body
        else {**body, "max_tokens": 1, "return_token_ids": True},
    )
    assert chat["prompt_token_ids"] == list(rendered.token_ids)


async def test_render_completion_gives_what_the_completion_path_runs(
    render: Any, stubs: Any, http: httpx.AsyncClient, model: str
) -> None:
    pb = stubs[0]
    prompts = ["Hello, world", "The capital of France is"]
    reply = await render.RenderCompletion(pb.RenderCompletionRequest(prompt=prompts), metadata=AUTH)
    assert len(reply.prompts) == 2
    for prompt, rendered in zip(prompts, reply.prompts, strict=True):
        tokenized = await post_json(http, "/tokenize", {"model": model, "prompt": prompt})
        assert list(rendered.token_ids) == tokenized["tokens"]
        assert rendered.text == "<s>" + prompt
        completion = await post_json(
            http,
            "/v1/completions",
            {"model": model, "prompt": prompt, "max_tokens": 1, "return_token_ids": True},
        )
        assert completion["choices"][0]["prompt_token_ids"] == list(rendered.token_ids)
    bare = await render.RenderCompletion(
        pb.RenderCompletionRequest(prompt=prompts[:1], add_special_tokens=False), metadata=AUTH
    )
    assert list(bare.prompts[0].token_ids) == list(reply.prompts[0].token_ids)[1:]
    cut = await render.RenderCompletion(
        pb.RenderCompletionRequest(prompt=prompts[1:], truncate_prompt_tokens=3), metadata=AUTH
    )
    truncated = await post_json(
        http,
        "/v1/completions",
        {
            "model": model,
            "prompt": prompts[1],
            "max_tokens": 1,
            "return_token_ids": True,
            "truncate_prompt_tokens": 3,
        },
    )
    # vLLM keeps the last tokens of the text, then adds its special ones.
    assert list(cut.prompts[0].token_ids) == truncated["choices"][0]["prompt_token_ids"]
    assert len(cut.prompts[0].token_ids) == 3
    # Far past the context (cut before it is tokenized): the tokens vLLM keeps of it whole.
    huge = "The quick brown fox jumps over the lazy dog. " * 2_000 + prompts[1]
    for keep in (16, 400):
        cut = await render.RenderCompletion(
            pb.RenderCompletionRequest(prompt=[huge], truncate_prompt_tokens=keep), metadata=AUTH
        )
        truncated = await post_json(
            http,
            "/v1/completions",
            {
                "model": model,
                "prompt": huge,
                "max_tokens": 1,
                "return_token_ids": True,
                "truncate_prompt_tokens": keep,
            },
        )
        assert list(cut.prompts[0].token_ids) == truncated["choices"][0]["prompt_token_ids"]
        assert len(cut.prompts[0].token_ids) == keep


def _counter(page: str, name: str) -> float:
    found = re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", page, re.M)
    assert found, name
    return sum(float(v) for v in found)


async def test_rendering_runs_no_engine_step(
    render: Any, stubs: Any, http: httpx.AsyncClient, launcher: Launched
) -> None:
    """The engine's own counters stand still through a hundred renders."""
    pb = stubs[0]
    metrics = "vllm:prompt_tokens_total"

    async def engine_prompt_tokens() -> float:
        return _counter((await http.get("/metrics")).text, metrics)

    before = await engine_prompt_tokens()
    request = pb.RenderChatRequest(messages=[_message(pb, USER)], tools=[_tool(pb)])
    replies = await asyncio.gather(*(render.RenderChat(request, metadata=AUTH) for _ in range(100)))
    assert {tuple(r.token_ids) for r in replies} == {tuple(replies[0].token_ids)}
    assert await engine_prompt_tokens() == before

    def handled(page: str) -> float:
        pattern = r'grpc_server_handled_total\{[^}]*grpc_method="RenderChat"[^}]*\} (\S+)'
        return sum(float(n) for n in re.findall(pattern, page))

    # A call is counted just after its status left: the page is read until it tells.
    page = ""
    async with httpx.AsyncClient(timeout=30) as client:
        for _ in range(50):
            page = (await client.get(launcher.metrics_url)).text
            if handled(page) >= 100:
                break
            await asyncio.sleep(0.1)
    assert handled(page) >= 100


def _with_kwargs(request: Any, kwargs: dict[str, Any]) -> Any:
    request.chat_template_kwargs.update(kwargs)
    return request


# An object nesting lists 1,100 deep (past what Python's JSON parser recurses
# into), short enough to fit the tiny model's context.
DEEP_JSON = '{"a":' + "[" * 1_100 + "]" * 1_100 + "}"


@pytest.mark.parametrize(
    ("build", "code", "field"),
    [
        (
            lambda pb: pb.RenderChatRequest(
                messages=[pb.ChatMessage(role="user", content="x" * 4_000_000)],
                truncate_prompt_tokens=-1,
            ),
            "INVALID_ARGUMENT",
            "messages",
        ),
        (
            lambda pb: _with_kwargs(
                pb.RenderChatRequest(messages=[pb.ChatMessage(role="user", content="hi")]),
                {"unused": list(range(500_000))},
            ),
            "INVALID_ARGUMENT",
            "messages",
        ),
        (
            lambda pb: pb.RenderChatRequest(
                messages=[pb.ChatMessage(role="user", content="hi")],
                tools=[pb.Tool(name="f", parameters=DEEP_JSON)],
            ),
            "INVALID_ARGUMENT",
            "tools[0].parameters",
        ),
        (
            lambda pb: pb.RenderChatRequest(
                messages=[
                    pb.ChatMessage(
                        role="assistant", tool_calls=[pb.ToolCall(name="f", arguments=DEEP_JSON)]
                    )
                ]
            ),
            "INVALID_ARGUMENT",
            "messages[0].tool_calls[0].arguments",
        ),
        (
            lambda pb: pb.RenderChatRequest(
                messages=[
                    pb.ChatMessage(
                        role="assistant", tool_calls=[pb.ToolCall(name="f", arguments="{oops")]
                    )
                ]
            ),
            "INVALID_ARGUMENT",
            "messages[0].tool_calls[0].arguments",
        ),
        (
            lambda pb: pb.RenderChatRequest(
                messages=[pb.ChatMessage(role="r" * 4_000, content="hi")],
                truncate_prompt_tokens=-1,
            ),
            "INVALID_ARGUMENT",
            "messages",
        ),
        (
            lambda pb: pb.RenderChatRequest(
                messages=[pb.ChatMessage(role="user", content="hi")],
                tools=[pb.Tool(name="f", parameters='{"a":' * 65 + "1" + "}" * 65)],
            ),
            "INVALID_ARGUMENT",
            "tools[0].parameters",
        ),
        (
            lambda pb: pb.RenderChatRequest(
                messages=[pb.ChatMessage(role="user", content="hi")] * (MAX_RENDER_ITEMS + 1)
            ),
            "INVALID_ARGUMENT",
            "messages",
        ),
        (
            lambda pb: _with_kwargs(
                pb.RenderChatRequest(messages=[pb.ChatMessage(role="user", content="hi")]),
                {"padding": "max_length"},
            ),
            "INVALID_ARGUMENT",
            "chat_template_kwargs.padding",
        ),
        (lambda pb: pb.RenderChatRequest(), "INVALID_ARGUMENT", "messages"),
        (
            lambda pb: pb.RenderChatRequest(messages=[pb.ChatMessage(content="hi")]),
            "INVALID_ARGUMENT",
            "messages[0].role",
        ),
        (
            lambda pb: pb.RenderChatRequest(
                messages=[
                    pb.ChatMessage(role="user", content="hi", parts=[pb.ContentPart(text="x")])
                ]
            ),
            "INVALID_ARGUMENT",
            "messages[0]",
        ),
        (
            lambda pb: pb.RenderChatRequest(
                messages=[
                    pb.ChatMessage(
                        role="user", parts=[pb.ContentPart(image_url="http://127.0.0.1:9/x.png")]
                    )
                ]
            ),
            "UNIMPLEMENTED",
            "messages[0].parts[0].image_url",
        ),
        (
            lambda pb: pb.RenderChatRequest(
                messages=[
                    pb.ChatMessage(role="user", parts=[pb.ContentPart(image_url="data:,abc")])
                ]
            ),
            "INVALID_ARGUMENT",
            "messages[0].parts[0].image_url",
        ),
        (
            lambda pb: pb.RenderChatRequest(
                messages=[pb.ChatMessage(role="user", content="hi")],
                tools=[pb.Tool(name="f", parameters="{not json")],
            ),
            "INVALID_ARGUMENT",
            "tools[0].parameters",
        ),
        (
            lambda pb: pb.RenderChatRequest(
                messages=[pb.ChatMessage(role="user", content="hi")], tools=[pb.Tool()]
            ),
            "INVALID_ARGUMENT",
            "tools[0].name",
        ),
        (
            lambda pb: pb.RenderChatRequest(
                messages=[pb.ChatMessage(role="assistant", content="hi")],
                continue_final_message=True,
            ),
            "INVALID_ARGUMENT",
            "continue_final_message",
        ),
        (
            lambda pb: pb.RenderChatRequest(
                messages=[pb.ChatMessage(role="user", content="hi")], model="not-served"
            ),
            "NOT_FOUND",
            "model",
        ),
        (
            lambda pb: pb.RenderChatRequest(
                messages=[pb.ChatMessage(role="user", content="hi")], truncate_prompt_tokens=0
            ),
            "INVALID_ARGUMENT",
            "truncate_prompt_tokens",
        ),
    ],
    ids=[
        *(
            "a chat past the context, truncated",
            "template variables past the context",
            "parameters nested too deeply",
            "arguments nested too deeply",
            "arguments not JSON",
            "a role past the context",
            "parameters nested past the depth",
        ),
        "messages past the budget",
        "a reserved template variable",
        "no messages",
        "no role",
        "content and parts",
        "an image to fetch",
        "an image that is none",
        "parameters not JSON",
        "a tool without a name",
        "continuing with a generation prompt",
        "a model not served",
        "truncation to nothing",
    ],
)
async def test_bad_chat_input_is_refused_naming_the_field(
    render: Any, stubs: Any, build: Any, code: str, field: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await render.RenderChat(build(stubs[0]), metadata=AUTH)
    assert err.value.code() == grpc.StatusCode[code], err.value.details()
    assert (err.value.details() or "").startswith(f"{field}: "), err.value.details()


async def test_render_needs_a_key_and_the_completion_prompt_is_required(
    render: Any, stubs: Any
) -> None:
    pb = stubs[0]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await render.RenderCompletion(pb.RenderCompletionRequest(prompt=["x"]))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    for request in (
        pb.RenderCompletionRequest(),
        pb.RenderCompletionRequest(prompt=["x"] * (MAX_RENDER_ITEMS + 1)),
        pb.RenderCompletionRequest(prompt=["x" * 4_000_000]),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await render.RenderCompletion(request, metadata=AUTH)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (err.value.details() or "").startswith("prompt"), err.value.details()


async def test_a_render_past_its_characters_is_refused_before_any_is_tokenized(
    render: Any, stubs: Any
) -> None:
    """Each prompt fits (truncation cuts it), the call's sum does not: refused
    naming the flag, before vLLM's one tokenizer thread sees any of it."""
    pb = stubs[0]
    long = "The quick brown fox jumps over the lazy dog. " * 2_000  # 90,000 characters
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await render.RenderCompletion(
            pb.RenderCompletionRequest(prompt=[long] * 3, truncate_prompt_tokens=16), metadata=AUTH
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == (
        f"prompt: {3 * len(long)} characters to render, more than this server's budget of "
        f"{MAX_RENDER_CHARS} per call (--max-render-chars); send fewer or shorter prompts"
    )
    chat = pb.RenderChatRequest(
        messages=[
            pb.ChatMessage(role="user", content=long),
            pb.ChatMessage(role="assistant", content=long),
            pb.ChatMessage(role="user", content=long),
        ]
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await render.RenderChat(chat, metadata=AUTH)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = err.value.details() or ""
    assert details.startswith("messages: ") and "(--max-render-chars)" in details, details
    # Under the budget: rendered.
    served = await render.RenderCompletion(
        pb.RenderCompletionRequest(prompt=[long] * 2, truncate_prompt_tokens=16), metadata=AUTH
    )
    assert [len(prompt.token_ids) for prompt in served.prompts] == [16, 16]


async def test_a_pooling_call_on_a_generation_model_names_what_is_missing(
    launcher: Launched,
) -> None:
    pb, pooling = shipped_modules("pooling")
    async with grpc.aio.insecure_channel(launcher.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pooling.PoolingStub(channel).Classify(
                pb.ClassifyRequest(input=["x"]), metadata=AUTH
            )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "'classify' task" in (err.value.details() or "")


def _lines(output: str) -> dict[str, Any]:
    return {m[1]: json.loads(m[2]) for m in re.finditer(r"^(\w+): (.*)$", output, re.M)}


async def test_the_examples_render_the_same_in_python_and_node(
    launcher: Launched, http: httpx.AsyncClient, model: str
) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(ROOT / "examples" / "render.py"),
        launcher.address,
        "--api-key",
        KEY,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, out.decode()
    python = _lines(out.decode())
    code, output = await run_node("render.js", launcher.address, KEY)
    assert code == 0, output
    node = _lines(output)
    assert python == node
    assert set(python) == {"render_chat", "render_completion", "derender_completion", "router_loop"}
    assert python["derender_completion"] == [{"text": "Hello, world", "finish_reason": "length"}]
    # The router's loop (render, generate by ids, derender) is vLLM's chat
    # completion of the same chat: the same ids, text and finish.
    loop = python["router_loop"]
    expected = await post_json(
        http,
        "/v1/chat/completions",
        {
            "model": model,
            "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Say hello."},
            ],
            "temperature": 0,
            "max_tokens": 8,
            "return_token_ids": True,
        },
    )
    (choice,) = expected["choices"]
    assert loop["token_ids"] == choice["token_ids"] and loop["token_ids"]
    assert loop["content"] == choice["message"]["content"] and loop["content"]
    assert loop["finish_reason"] == choice["finish_reason"]
    assert loop["completion_tokens"] == expected["usage"]["completion_tokens"]
    prompts = python["render_completion"]
    tokenized = await post_json(http, "/tokenize", {"model": model, "prompt": "Hello, world"})
    assert prompts[0]["token_ids"] == tokenized["tokens"]
    assert "<|tools|>" in python["render_chat"]["text"]


async def test_the_launchers_stack_traces_and_counts_renders_on_a_mount(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mount() with the launcher's own interceptors, in its order (tracing, metrics,
    keys, the in-flight limit) and a chat template of the host's: renders are
    spans with their operation and prompt size, counted, and leave nothing in flight."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from prometheus_client import CollectorRegistry
    from support import serving

    from vllm_servicer.interceptors.tracing import TracingInterceptor
    from vllm_servicer.serve.args import parse_args
    from vllm_servicer.serve.stack import build_interceptors

    # The launcher's metrics go to prometheus_client's global registry, which
    # another test of this process may have filled: a registry of this test's own.
    monkeypatch.setattr("vllm_servicer.interceptors.metrics.REGISTRY", CollectorRegistry())
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    args = parse_args(["serve", "--metrics-port", "0", "--api-key", KEY, "--max-inflight", "4"])
    stack, metrics = build_interceptors(args)
    assert metrics is not None
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    pb, stubs = shipped_modules("render")
    async with serving(
        engine,
        interceptors=[TracingInterceptor.for_engine(engine, provider), *stack],
        chat_template=template,
    ) as running:
        render = stubs.RenderStub(running.channel)
        chat = await render.RenderChat(
            pb.RenderChatRequest(messages=[pb.ChatMessage(role="user", content="hi")]),
            metadata=AUTH,
        )
        assert chat.text == "[user] hi\n"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await render.RenderChat(pb.RenderChatRequest(), metadata=AUTH)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # The slot is released once the handler has returned, which may be just
        # after the client read the refusal.
        assert await running.mounted.inflight.wait_idle(10)
        assert running.mounted.inflight.limited_everywhere == 0
    provider.shutdown()
    spans = [s for s in exporter.get_finished_spans() if s.name.endswith("/RenderChat")]
    assert len(spans) == 2, [s.name for s in exporter.get_finished_spans()]
    ok = next(s for s in spans if s.status.is_ok)
    assert (ok.attributes or {}).get("gen_ai.operation.name") == "render_chat"
    assert (ok.attributes or {}).get("gen_ai.usage.input_tokens") == len(chat.token_ids)
    counted = {
        sample.labels["grpc_code"]: sample.value
        for family in metrics.handled.collect()
        for sample in family.samples
        if sample.labels.get("grpc_method") == "RenderChat" and sample.name.endswith("_total")
    }
    assert counted == {"OK": 1.0, "INVALID_ARGUMENT": 1.0}, counted


async def test_an_inline_image_is_rendered_with_its_placeholder_tokens(vlm_engine: Any) -> None:
    """The tiny LLaVA: the chat's image becomes its placeholder tokens, located and hashed."""
    import base64
    import io

    from PIL import Image
    from support import serving

    from vllm_servicer.testing.tiny_vlm import IMAGE_TOKEN

    image = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(image, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(image.getvalue()).decode()
    pb, stubs = shipped_modules("render")
    parts = [pb.ContentPart(text="What is this? "), pb.ContentPart(image_url=url)]
    async with serving(vlm_engine) as running:
        rendered = await stubs.RenderStub(running.channel).RenderChat(
            pb.RenderChatRequest(messages=[pb.ChatMessage(role="user", parts=parts)])
        )
        assert running.mounted.state.decoded_media.held == 0
    image_token = vlm_engine.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    runs = [i for i, token in enumerate(rendered.token_ids) if token == image_token]
    [placeholder] = rendered.placeholders
    assert placeholder.modality == "image" and placeholder.hash
    assert runs == list(range(placeholder.offset, placeholder.offset + placeholder.length))
    assert placeholder.length > 1  # expanded to the image's tokens, not one marker
