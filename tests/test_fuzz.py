"""Property-based fuzzing of Generate against the live server and its real engine.

How the examples reach the server: the session's server runs on the session's
event loop, so a synchronous `@given` test with a blocking channel would
deadlock (the loop that serves the call is not running while the test blocks
it). Instead the tests are `async def` under `@given`: pytest-asyncio runs each
Hypothesis example as a coroutine on the session loop, so every example is a
real call over a real channel to the same server and engine as the rest of
the suite. Examples are bounded (small max_tokens, a fixed count, no
database) to keep the run short on a shared 2-core machine.

Invariants, for every example: the call is answered within its deadline; the
status is never INTERNAL or UNKNOWN (bytes that are not a GenerateRequest get
INVALID_ARGUMENT naming the message); the engine holds
no request afterwards. After the module's fuzzing (whatever order its tests ran
in) the health service still says SERVING and a good call still works.
"""

from __future__ import annotations

import collections
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import request, wait_until_idle

from vllm_servicer import SERVICE_NAME
from vllm_servicer.proto import vllm_engine_pb2 as pb
from vllm_servicer.proto import vllm_engine_pb2_grpc

GENERATE = "/vllm.grpc.engine.VllmEngine/Generate"
NEVER = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
ANSWER_WITHIN_S = 30.0
SETTINGS = settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TALLY: collections.Counter[str] = collections.Counter()

f32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
i32 = st.integers(-(2**31), 2**31 - 1)
u32 = st.integers(0, 2**32 - 1)


def mostly(sane: st.SearchStrategy[Any], edge: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Usually an in-range value, one time in six an edge: so that most examples pass
    validation and reach the engine, while every edge still turns up."""
    pick = st.sampled_from([False] * 5 + [True])
    return pick.flatmap(lambda use_edge: edge if use_edge else sane)


edges = st.one_of(st.sampled_from([-1.0, 2.5, 1e30, -0.0]), f32)
token = mostly(st.integers(0, 300), st.one_of(st.integers(300, 400), u32))
SCHEMAS = ['{"type": "object"}', '{"type": "integer"}', "{not json", '{"type": "bogus"}', ""]
REGEXES = ["[a-c]{1,3}", "([a-z", "a*", ""]
GRAMMARS = ['root ::= "a" | "b"', "root ::= (", ""]
IN_RANGE = {
    "temperature": st.floats(0.0, 2.0, width=32),
    "top_p": st.floats(0.125, 1.0, width=32),
    "min_p": st.floats(0.0, 1.0, width=32),
    "frequency_penalty": st.floats(-2.0, 2.0, width=32),
    "presence_penalty": st.floats(-2.0, 2.0, width=32),
    "repetition_penalty": st.floats(0.125, 2.0, width=32),
}


@st.composite
def generate_requests(draw: st.DrawFn) -> pb.GenerateRequest:
    params = pb.SamplingParams(max_tokens=draw(mostly(st.integers(1, 6), st.just(0))))
    for name, sane in IN_RANGE.items():
        if draw(st.booleans()):
            setattr(params, name, draw(mostly(sane, edges)))
    params.top_k = draw(mostly(st.integers(0, 50), u32))
    params.min_tokens = draw(mostly(st.integers(0, 1), u32))
    params.n = draw(st.integers(0, 3))
    params.ignore_eos = draw(st.booleans())
    params.stop.extend(
        draw(st.lists(mostly(st.text(min_size=1, max_size=4), st.just("")), max_size=2))
    )
    params.stop_token_ids.extend(draw(st.lists(token, max_size=3)))
    bias_values = mostly(st.floats(-100, 100, width=32), f32)
    params.logit_bias.update(draw(st.dictionaries(st.integers(-5, 400), bias_values, max_size=2)))
    params.include_stop_str_in_output = draw(st.booleans())
    for name in ("logprobs", "prompt_logprobs"):
        value = draw(
            st.one_of(st.none(), mostly(st.integers(0, 5), st.one_of(st.integers(-2, 25), i32)))
        )
        if value is not None:
            setattr(params, name, value)
    seed = draw(st.one_of(st.none(), i32))
    if seed is not None:
        params.seed = seed
    truncate = draw(st.one_of(st.none(), st.none(), mostly(st.integers(1, 20), st.integers(-3, 0))))
    if truncate is not None:
        params.truncate_prompt_tokens = truncate
    constraint = draw(
        st.sampled_from([None] * 10 + ["json_schema", "regex", "grammar", "choice", "json_object"])
    )
    if constraint == "json_schema":
        params.json_schema = draw(st.sampled_from(SCHEMAS))
    elif constraint == "regex":
        params.regex = draw(st.sampled_from(REGEXES))
    elif constraint == "grammar":
        params.grammar = draw(st.sampled_from(GRAMMARS))
    elif constraint == "choice":
        params.choice.SetInParent()
        params.choice.choices.extend(draw(st.lists(st.text(max_size=5), max_size=3)))
    elif constraint == "json_object":
        params.json_object = draw(st.booleans())
    req = pb.GenerateRequest(
        request_id=draw(st.one_of(st.just(""), st.text(max_size=12))),
        sampling_params=params,
        stream=draw(st.booleans()),
    )
    kind = draw(mostly(st.sampled_from(["ids", "ids", "text"]), st.just("none")))
    if kind == "ids":
        req.tokenized.input_ids.extend(draw(st.lists(token, min_size=1, max_size=16)))
        if draw(st.integers(0, 9)) == 0:
            del req.tokenized.input_ids[:]
    elif kind == "text":
        req.text = draw(mostly(st.text(min_size=1, max_size=40), st.just("")))
    return req


@pytest.mark.timeout(240)
@SETTINGS
@given(req=generate_requests())
async def test_fuzzed_generate_requests(
    req: pb.GenerateRequest, channel: grpc.aio.Channel, engine: Any
) -> None:
    stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    try:
        messages = [m async for m in stub.Generate(req, timeout=ANSWER_WITHIN_S)]
    except grpc.aio.AioRpcError as err:
        code = err.code()
        TALLY[f"generate:{code.name}"] += 1
        assert code not in NEVER, f"{code.name}: {err.details()}\n{req}"
        assert code is not grpc.StatusCode.DEADLINE_EXCEEDED, f"not answered in time:\n{req}"
    else:
        TALLY["generate:OK"] += 1
        n = req.sampling_params.n or 1
        done = {m.complete.index for m in messages if m.HasField("complete")}
        assert done == set(range(n)), f"choices {done} of {n}\n{req}"
    assert await wait_until_idle(engine, timeout=10) == 0


@st.composite
def mangled_payloads(draw: st.DrawFn) -> bytes:
    """A good serialized request, truncated / overwritten / spliced, or random bytes."""
    good = request(
        max_tokens=3, stream=draw(st.booleans()), request_id="raw-fuzz"
    ).SerializeToString()
    how = draw(st.sampled_from(["truncate", "overwrite", "insert", "random"]))
    at = draw(st.integers(0, len(good)))
    junk = draw(st.binary(min_size=1, max_size=16))
    if how == "truncate":
        return good[:at]
    if how == "overwrite":
        return good[:at] + junk + good[at + len(junk) :]
    if how == "insert":
        return good[:at] + junk + good[at:]
    return draw(st.binary(max_size=64))


@pytest.mark.timeout(240)
@SETTINGS
@given(payload=mangled_payloads())
async def test_mangled_bytes_get_a_clean_status(
    payload: bytes, channel: grpc.aio.Channel, engine: Any
) -> None:
    call = channel.unary_stream(GENERATE)(payload, timeout=ANSWER_WITHIN_S)
    try:
        async for _ in call:
            pass
        TALLY["raw:OK"] += 1
    except grpc.aio.AioRpcError as err:
        code, details = err.code(), err.details() or ""
        TALLY[f"raw:{code.name}"] += 1
        assert code not in NEVER, details
        assert code is not grpc.StatusCode.DEADLINE_EXCEEDED, payload
    assert await wait_until_idle(engine, timeout=10) == 0


@pytest.fixture(scope="module", autouse=True)
async def still_serving_after_fuzzing(
    channel: grpc.aio.Channel, engine: Any, server: Any
) -> AsyncIterator[None]:
    """After every test of this module: health, a good call, nothing in flight."""
    yield
    print(f"\nfuzz outcomes: {dict(TALLY)}")
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", SERVICE_NAME):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    messages = [m async for m in stub.Generate(request(max_tokens=3, ignore_eos=True))]
    assert len(messages[-1].complete.output_ids) == 3
    assert await wait_until_idle(engine) == 0
    assert server.mounted.servicer.active_requests == 0
