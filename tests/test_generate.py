"""Generate against a real engine over a real channel: the protocol's semantics."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import grpc
import pytest
from support import collect, completes, request, streamed_tokens, wait_until_idle

from vllm_servicer.proto import vllm_engine_pb2 as pb

LONG = {"max_tokens": 400, "ignore_eos": True}


async def greedy(stub: Any, n_tokens: int = 16, **kw: Any) -> list[int]:
    messages = await collect(stub.Generate(request(max_tokens=n_tokens, ignore_eos=True, **kw)))
    return list(completes(messages)[0].output_ids)


# Seeded sampling: the same tokens every run, and varied ones, where a release's
# greedy output on random weights may repeat one token (vLLM 0.33's does here).
VARIED = {"temperature": 1.0, "seed": 11}


async def test_stream_and_unary_give_same_tokens(stub: Any) -> None:
    unary = await collect(stub.Generate(request(max_tokens=12, ignore_eos=True)))
    streamed = await collect(stub.Generate(request(max_tokens=12, ignore_eos=True, stream=True)))
    [done] = completes(unary).values()
    assert len(done.output_ids) == 12
    assert done.finish_reason == "length"
    assert done.prompt_tokens == 8 and done.completion_tokens == 12
    assert streamed_tokens(streamed)[0] == list(done.output_ids)
    # Every chunk counts its own delta; the stream ends with one complete.
    chunks = [m.chunk for m in streamed if m.WhichOneof("response") == "chunk"]
    assert all(c.completion_tokens == len(c.token_ids) for c in chunks)
    assert streamed[-1].WhichOneof("response") == "complete"
    assert streamed[-1].complete.finish_reason == "length"


async def test_greedy_is_deterministic_and_max_tokens_holds(stub: Any) -> None:
    first = await greedy(stub, 10)
    second = await greedy(stub, 10)
    assert first == second and len(first) == 10


async def test_text_input(stub: Any) -> None:
    messages = await collect(stub.Generate(request("hello world", max_tokens=5, ignore_eos=True)))
    [done] = completes(messages).values()
    assert done.prompt_tokens > 0 and len(done.output_ids) == 5


@pytest.mark.parametrize("stream", [False, True])
async def test_n_choices_have_their_own_index(stub: Any, stream: bool) -> None:
    messages = await collect(
        stub.Generate(
            request(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True, stream=stream)
        )
    )
    done = completes(messages)
    assert sorted(done) == [0, 1, 2]
    if stream:
        tokens = streamed_tokens(messages)
        assert sorted(tokens) == [0, 1, 2]
        assert all(len(t) == 6 for t in tokens.values())
    else:
        assert all(len(c.output_ids) == 6 for c in done.values())


async def test_seed_reproduces_sampling(stub: Any) -> None:
    a = await greedy(stub, 12, temperature=1.0, seed=1234)
    b = await greedy(stub, 12, temperature=1.0, seed=1234)
    c = await greedy(stub, 12, temperature=1.0, seed=99)
    assert a == b
    assert a != c


async def test_output_and_prompt_logprobs(stub: Any) -> None:
    messages = await collect(
        stub.Generate(request(max_tokens=5, ignore_eos=True, logprobs=3, prompt_logprobs=2))
    )
    [done] = completes(messages).values()
    out = done.output_logprobs
    assert list(out.token_ids) == list(done.output_ids)
    assert len(out.token_logprobs) == 5 and all(v <= 0.0 for v in out.token_logprobs)
    assert len(out.top_logprobs) == 5
    assert all(len(top.token_ids) >= 3 for top in out.top_logprobs)
    prompt = done.input_logprobs
    assert len(prompt.token_ids) == 8
    assert not prompt.token_logprobs[0].HasField("value")  # first prompt token has none
    assert all(lp.HasField("value") for lp in prompt.token_logprobs[1:])


async def test_streamed_logprobs_cover_every_token_and_prompt_once(stub: Any) -> None:
    messages = await collect(
        stub.Generate(
            request(max_tokens=6, ignore_eos=True, logprobs=1, prompt_logprobs=0, stream=True)
        )
    )
    chunks = [m.chunk for m in messages if m.WhichOneof("response") == "chunk"]
    ids = [t for c in chunks for t in c.output_logprobs.token_ids]
    assert ids == streamed_tokens(messages)[0]
    with_prompt = [c for c in chunks if c.HasField("input_logprobs")]
    assert len(with_prompt) == 1 and with_prompt[0] is chunks[0]


async def test_no_logprobs_unless_asked(stub: Any) -> None:
    messages = await collect(stub.Generate(request(max_tokens=3, stream=True)))
    for m in messages:
        part = getattr(m, m.WhichOneof("response"))
        assert not part.HasField("output_logprobs") and not part.HasField("input_logprobs")


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_token_is_reported(stub: Any, stream: bool) -> None:
    tokens = await greedy(stub, 12, **VARIED)
    stop_at = next(i for i in range(2, 12) if tokens[i] not in tokens[:i])
    stop = [tokens[stop_at]]
    messages = await collect(
        stub.Generate(
            request(max_tokens=12, ignore_eos=True, stop_token_ids=stop, stream=stream, **VARIED)
        )
    )
    [done] = completes(messages).values()
    assert done.finish_reason == "stop"
    assert done.WhichOneof("matched_stop") == "matched_token_id"
    assert done.matched_token_id == tokens[stop_at]
    got = streamed_tokens(messages)[0] if stream else list(done.output_ids)
    assert got[:stop_at] == tokens[:stop_at] and len(got) <= stop_at + 1


async def test_stop_string_is_reported(stub: Any, engine: Any) -> None:
    tokens = await greedy(stub, 16, **VARIED)
    tokenizer = engine.get_tokenizer()
    if asyncio.iscoroutine(tokenizer):
        tokenizer = await tokenizer
    text = tokenizer.decode(tokens)
    # A stop string from the middle of the greedy text; the output must end before it.
    stop = next(
        text[i : i + 2]
        for i in range(3, len(text) - 2)
        if text[i : i + 2].strip() and text.find(text[i : i + 2]) == i
    )
    messages = await collect(
        stub.Generate(request(max_tokens=16, ignore_eos=True, stop=[stop], **VARIED))
    )
    [done] = completes(messages).values()
    assert done.finish_reason == "stop"
    assert done.matched_stop_str == stop
    assert len(done.output_ids) < 16


async def test_choice_constraint(stub: Any, engine: Any) -> None:
    choices = ["alpha", "beta", "gamma"]
    messages = await collect(stub.Generate(request(max_tokens=20, choice=choices)))
    [done] = completes(messages).values()
    tokenizer = engine.get_tokenizer()
    assert tokenizer.decode(list(done.output_ids), skip_special_tokens=True) in choices


async def test_regex_constraint(stub: Any, engine: Any) -> None:
    messages = await collect(stub.Generate(request(max_tokens=20, regex="[ab]{4}")))
    [done] = completes(messages).values()
    text = engine.get_tokenizer().decode(list(done.output_ids), skip_special_tokens=True)
    assert re.fullmatch("[ab]{4}", text), text


async def test_json_schema_constraint(stub: Any, engine: Any) -> None:
    # Values with no room for whitespace: an object's, which the grammar allows
    # between tokens, can fill max_tokens on random weights (vLLM 0.33 here).
    schema = {"type": "array", "items": {"enum": ["yes", "no"]}, "minItems": 1, "maxItems": 1}
    messages = await collect(
        stub.Generate(request(max_tokens=40, json_schema=json.dumps(schema), **VARIED))
    )
    [done] = completes(messages).values()
    text = engine.get_tokenizer().decode(list(done.output_ids), skip_special_tokens=True)
    assert json.loads(text)[0] in ("yes", "no"), text


async def test_grammar_constraint(stub: Any, engine: Any) -> None:
    grammar = 'root ::= "yes" | "no"'
    messages = await collect(stub.Generate(request(max_tokens=10, grammar=grammar)))
    [done] = completes(messages).values()
    text = engine.get_tokenizer().decode(list(done.output_ids), skip_special_tokens=True)
    assert text in ("yes", "no")


async def test_json_object_constraint(stub: Any, engine: Any) -> None:
    messages = await collect(stub.Generate(request(max_tokens=60, json_object=True)))
    [done] = completes(messages).values()
    text = engine.get_tokenizer().decode(list(done.output_ids), skip_special_tokens=True)
    if done.finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: still a JSON object's prefix
        assert text.lstrip().startswith("{")


async def test_logit_bias_forces_a_token(stub: Any) -> None:
    tokens = await greedy(stub, 4, logit_bias={200: 100.0})
    assert tokens == [200, 200, 200, 200]


async def test_truncate_prompt_tokens(stub: Any) -> None:
    messages = await collect(
        stub.Generate(request(list(range(10, 40)), max_tokens=2, truncate_prompt_tokens=5))
    )
    [done] = completes(messages).values()
    assert done.prompt_tokens == 5


async def test_client_cancel_frees_the_engine(stub: Any, engine: Any) -> None:
    call = stub.Generate(request(stream=True, **LONG))
    received = 0
    async for _ in call:
        received += 1
        if received == 3:
            break
    call.cancel()
    assert await wait_until_idle(engine) == 0


async def test_deadline_frees_the_engine(stub: Any, engine: Any) -> None:
    call = stub.Generate(request(stream=True, max_tokens=5000, ignore_eos=True), timeout=0.5)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(call)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert await wait_until_idle(engine) == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_abort_rpc_ends_a_running_request(stub: Any, engine: Any, stream: bool) -> None:
    rid = f"to-abort-{stream}"
    call = stub.Generate(request(request_id=rid, stream=stream, max_tokens=5000, ignore_eos=True))
    if stream:
        await call.read()  # it is running
    else:
        await asyncio.sleep(0.5)
    await stub.Abort(pb.AbortRequest(request_ids=[rid]))
    rest = []
    while (message := await call.read()) is not grpc.aio.EOF:
        rest.append(message)
    assert await call.code() == grpc.StatusCode.OK
    [done] = completes(rest).values()
    assert done.finish_reason == "abort"
    assert await wait_until_idle(engine) == 0


async def test_abort_of_unknown_and_finished_ids_is_quiet(stub: Any) -> None:
    await stub.Abort(pb.AbortRequest(request_ids=["never-seen", "also-unknown"]))
    await stub.Abort(pb.AbortRequest(request_ids=[]))
    messages = await collect(stub.Generate(request(request_id="finished-1", max_tokens=2)))
    assert completes(messages)
    await stub.Abort(pb.AbortRequest(request_ids=["finished-1"]))


INVALID = [
    ("top_p", {"top_p": 1.5}),
    ("temperature", {"temperature": -1.0}),
    ("logprobs", {"logprobs": 50}),
    ("regex", {"regex": "(unclosed"}),
    ("json", {"json_schema": "{not json"}),
]


@pytest.mark.parametrize(("name", "sampling"), INVALID, ids=[n for n, _ in INVALID])
async def test_invalid_parameters_are_invalid_argument(
    stub: Any, name: str, sampling: dict[str, Any]
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub.Generate(request(**sampling)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert name in err.value.details().lower()
    # and the server keeps serving
    assert completes(await collect(stub.Generate(request(max_tokens=2))))


@pytest.mark.parametrize(
    ("prompt", "needle"),
    [([], "prompt"), ([5, 999_999], "token"), (list(range(1, 300)) * 2, "length")],
    ids=["empty", "out-of-vocab", "too-long"],
)
async def test_invalid_prompts_are_invalid_argument(
    stub: Any, prompt: list[int], needle: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub.Generate(request(prompt)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in err.value.details().lower()


async def test_request_without_input_is_invalid_argument(stub: Any) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub.Generate(pb.GenerateRequest(request_id="no-input")))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "input" in err.value.details()
