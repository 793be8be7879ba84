"""Every GenerateRequest / EmbedRequest field at its edges, against a real engine.

A client mistake must come back as a client-side code (INVALID_ARGUMENT, or
OUT_OF_RANGE / RESOURCE_EXHAUSTED where grpc itself sets it) whose message
names the field, never UNKNOWN or INTERNAL; and the server must serve the next
good request as if nothing happened. Rows marked FINE are edges the protocol
accepts: they must succeed, or at worst be rejected with a client-side code.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
from support import collect, completes, request, serving, wait_until_idle

from vllm_servicer.proto import vllm_engine_pb2 as pb
from vllm_servicer.proto import vllm_engine_pb2_grpc

GENERATE = "/vllm.grpc.engine.VllmEngine/Generate"
CLIENT_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.FAILED_PRECONDITION,
}
NEVER = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
U32 = 2**32 - 1
I32 = 2**31 - 1
PROMPT = [5, 17, 42, 99, 7, 63, 21, 88]
MAX_LEN = 512  # TINY_ENGINE_KWARGS["max_model_len"]
FINE = ""  # expected field for rows the protocol accepts


@dataclasses.dataclass(frozen=True)
class Row:
    """One bad input: how to build it and the field its error must name ("" = accepted)."""

    build: Callable[[], pb.GenerateRequest]
    field: str
    code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT


def sp(**sampling: Any) -> Callable[[], pb.GenerateRequest]:
    """A small request with these sampling fields (max_tokens 2 unless given)."""
    sampling.setdefault("max_tokens", 2)
    return lambda: request(**sampling)


def raw(build: Callable[[pb.GenerateRequest], None], **sampling: Any) -> Any:
    def make() -> pb.GenerateRequest:
        req = request(**{"max_tokens": 2, **sampling})
        build(req)
        return req

    return make


def ids(n: int, token: int = 7) -> list[int]:
    return [token] * n


def _set_text(text: str) -> Callable[[pb.GenerateRequest], None]:
    return lambda r: setattr(r, "text", text)


def _bias(bias: dict[int, float]) -> Callable[[pb.GenerateRequest], None]:
    return lambda r: r.sampling_params.logit_bias.update(bias)


def _choice(choices: list[str]) -> Callable[[pb.GenerateRequest], None]:
    def set_choice(r: pb.GenerateRequest) -> None:
        r.sampling_params.choice.SetInParent()
        r.sampling_params.choice.choices.extend(choices)

    return set_choice


def _field(name: str, value: Any) -> Callable[[pb.GenerateRequest], None]:
    return lambda r: setattr(r.sampling_params, name, value)


def _top(name: str, value: Any) -> Callable[[pb.GenerateRequest], None]:
    return lambda r: setattr(r, name, value)


def _clear_input(r: pb.GenerateRequest) -> None:
    r.ClearField("tokenized")


def _empty_ids(r: pb.GenerateRequest) -> None:
    del r.tokenized.input_ids[:]


GENERATE_ROWS: dict[str, Row] = {
    # --- input ---
    "no_input": Row(raw(_clear_input), "input"),
    "empty_input_ids": Row(raw(_empty_ids), "input_ids"),
    "empty_text": Row(raw(_set_text("")), "text"),
    "oov_token_id": Row(sp(prompt=[5, 100_000]), "token"),
    "max_uint32_token_id": Row(sp(prompt=[5, U32]), "token"),
    "prompt_over_max_model_len": Row(sp(prompt=ids(MAX_LEN + 88)), "prompt"),
    "prompt_at_max_model_len": Row(sp(prompt=ids(MAX_LEN)), "prompt"),
    "text_over_max_model_len": Row(raw(_set_text("hello world " * 20_000)), "prompt"),
    "text_over_message_limit": Row(
        raw(_set_text("x" * (5 << 20))), "", grpc.StatusCode.RESOURCE_EXHAUSTED
    ),
    "huge_original_text": Row(
        raw(lambda r: setattr(r.tokenized, "original_text", "y" * 500_000)), FINE
    ),
    "text_control_chars": Row(raw(_set_text("\x00\x01\ufffe\U0010ffff")), FINE),
    # --- request id ---
    "missing_request_id": Row(raw(_top("request_id", "")), FINE),
    "huge_request_id": Row(raw(_top("request_id", "r" * 100_000)), FINE),
    "odd_request_id": Row(raw(_top("request_id", "\x00/\n\U0001f600")), FINE),
    # --- floats ---
    "temperature_negative": Row(sp(temperature=-1.0), "temperature"),
    "temperature_nan": Row(sp(temperature=math.nan), "temperature"),
    "temperature_inf": Row(sp(temperature=math.inf), "temperature"),
    "temperature_huge": Row(sp(temperature=1e30), "temperature"),
    "top_p_negative": Row(sp(top_p=-0.5), "top_p"),
    "top_p_over_one": Row(sp(top_p=1.5), "top_p"),
    "top_p_nan": Row(sp(top_p=math.nan), "top_p"),
    "min_p_negative": Row(sp(min_p=-1.0), "min_p"),
    "min_p_over_one": Row(sp(min_p=2.0), "min_p"),
    "min_p_nan": Row(sp(min_p=math.nan), "min_p"),
    "frequency_penalty_low": Row(sp(frequency_penalty=-3.0), "frequency_penalty"),
    "frequency_penalty_inf": Row(sp(frequency_penalty=math.inf), "frequency_penalty"),
    "presence_penalty_high": Row(sp(presence_penalty=3.0), "presence_penalty"),
    "presence_penalty_nan": Row(sp(presence_penalty=math.nan), "presence_penalty"),
    "repetition_penalty_negative": Row(sp(repetition_penalty=-1.0), "repetition_penalty"),
    "repetition_penalty_inf": Row(sp(repetition_penalty=math.inf), "repetition_penalty"),
    "logit_bias_nan": Row(raw(_bias({5: math.nan})), "logit_bias"),
    "logit_bias_oov": Row(raw(_bias({100_000: 1.0})), "logit_bias"),
    "logit_bias_negative_id": Row(raw(_bias({-1: 1.0})), "logit_bias"),
    # --- integers ---
    "top_k_max_uint32": Row(sp(top_k=U32), FINE),
    "max_tokens_zero": Row(sp(max_tokens=0), "max_tokens"),
    "max_tokens_far_beyond_context": Row(
        sp(prompt=ids(MAX_LEN - 4), max_tokens=U32, ignore_eos=True), FINE
    ),
    "min_tokens_over_max_tokens": Row(sp(max_tokens=2, min_tokens=5), "min_tokens"),
    "min_tokens_beyond_context": Row(
        raw(lambda r: r.sampling_params.ClearField("max_tokens"), min_tokens=U32), "min_tokens"
    ),
    # Past vLLM's own cap (16,384) and this server's budget (--max-n, 128).
    "n_over_limit": Row(sp(n=16_385, temperature=1.0), "sampling_params.n: 16385 sequences"),
    "n_max_uint32": Row(sp(n=U32, temperature=1.0), "sampling_params.n"),
    "n_greedy_contradiction": Row(sp(n=2, temperature=0.0), "n must"),
    "n_at_max_num_seqs": Row(sp(n=64, temperature=1.0, max_tokens=1), FINE),
    "logprobs_above_max": Row(sp(logprobs=21), "logprobs"),
    "logprobs_negative": Row(sp(logprobs=-2), "logprobs"),
    "logprobs_all_vocab": Row(sp(logprobs=-1), "logprobs"),
    "logprobs_int32_max": Row(sp(logprobs=I32), "logprobs"),
    "prompt_logprobs_above_max": Row(sp(prompt_logprobs=21), "prompt_logprobs"),
    "prompt_logprobs_negative": Row(sp(prompt_logprobs=-5), "prompt_logprobs"),
    "seed_negative": Row(sp(seed=-(2**31), temperature=1.0), FINE),
    "truncate_prompt_tokens_negative": Row(sp(truncate_prompt_tokens=-5), "truncate_prompt_tokens"),
    "truncate_prompt_tokens_zero": Row(sp(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    "truncate_prompt_tokens_huge": Row(sp(truncate_prompt_tokens=I32), FINE),
    "data_parallel_rank_out_of_range": Row(
        raw(_top("data_parallel_rank", 5)), "data_parallel_rank"
    ),
    "data_parallel_rank_negative": Row(raw(_top("data_parallel_rank", -1)), "data_parallel_rank"),
    # --- stops ---
    "stop_empty_string": Row(sp(stop=[""]), "stop"),
    "stop_enormous_string": Row(sp(stop=["z" * 200_000]), FINE),
    "stop_token_ids_oov": Row(sp(stop_token_ids=[10**9]), "stop_token_ids"),
    # --- structured output ---
    "json_schema_malformed": Row(raw(_field("json_schema", "{not json")), "json"),
    "json_schema_wrong_type": Row(raw(_field("json_schema", '{"type": "bogus"}')), "json"),
    "json_schema_empty": Row(raw(_field("json_schema", "")), "json"),
    "regex_malformed": Row(raw(_field("regex", "([a-z")), "regex"),
    "grammar_malformed": Row(raw(_field("grammar", "root ::= (")), "grammar"),
    "structural_tag_malformed": Row(raw(_field("structural_tag", "not a tag")), "structural_tag"),
    "json_object_false": Row(raw(_field("json_object", False)), "json_object"),
    "choice_empty": Row(raw(_choice([])), "choice"),
    "choice_empty_string": Row(raw(_choice([""])), FINE),
    "choice_with_stop_contradiction": Row(
        raw(_choice(["alpha", "beta"]), stop=["a"], max_tokens=8), FINE
    ),
    "json_object_min_tokens_contradiction": Row(
        raw(_field("json_object", True), max_tokens=3, min_tokens=3), FINE
    ),
    "kv_transfer_params_json_malformed": Row(
        raw(_top("kv_transfer_params_json", "{nope")), "kv_transfer_params_json"
    ),
}

# Rows whose current behaviour is a known bug in the servicer (none open).
GENERATE_BUGS: dict[str, str] = {}


def _param(name: str) -> Any:
    marks = []
    if name in GENERATE_BUGS:
        marks.append(pytest.mark.xfail(strict=True, reason=GENERATE_BUGS[name]))
    return pytest.param(name, id=name, marks=marks)


async def good_request_still_works(stub: Any) -> None:
    messages = await collect(stub.Generate(request(max_tokens=3, ignore_eos=True), timeout=30))
    assert len(completes(messages)[0].output_ids) == 3


def check_rejection(err: grpc.aio.AioRpcError, row: Row) -> None:
    code = err.code()
    assert code not in NEVER, f"{code.name}: {err.details()}"
    if row.code is not grpc.StatusCode.INVALID_ARGUMENT:
        assert code is row.code, f"{code.name}: {err.details()}"
        return
    assert code in CLIENT_CODES, f"{code.name}: {err.details()}"
    if row.field:
        assert row.field.lower() in (err.details() or "").lower(), err.details()


@pytest.mark.parametrize("name", [_param(n) for n in GENERATE_ROWS])
async def test_generate_edge(name: str, channel: grpc.aio.Channel, engine: Any) -> None:
    row = GENERATE_ROWS[name]
    stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    try:
        messages = await collect(stub.Generate(row.build(), timeout=60))
    except grpc.aio.AioRpcError as err:
        check_rejection(err, row)
    else:
        assert not row.field and row.code is grpc.StatusCode.INVALID_ARGUMENT, (
            f"accepted; expected a rejection naming {row.field!r}"
        )
        done = completes(messages)
        assert done, "no complete message"
        for c in done.values():
            assert c.prompt_tokens + c.completion_tokens <= MAX_LEN
    assert await wait_until_idle(engine) == 0
    await good_request_still_works(stub)


async def test_invalid_utf8_text_is_rejected(channel: grpc.aio.Channel) -> None:
    """protobuf will not build a str field holding invalid UTF-8, so send the bytes raw."""
    good = request("hello", max_tokens=2).SerializeToString()
    payload = good.replace(b"hello", b"he\xff\xfeo")
    call = channel.unary_stream(GENERATE)(payload, timeout=30)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(call)
    assert err.value.code() not in NEVER, f"{err.value.code().name}: {err.value.details()}"
    assert err.value.code() in CLIENT_CODES
    await good_request_still_works(vllm_engine_pb2_grpc.VllmEngineStub(channel))


async def test_duplicate_request_ids_run_side_by_side(
    channel: grpc.aio.Channel, engine: Any
) -> None:
    """vLLM accepts a reused id (it suffixes it internally); each call gets its own tokens."""
    stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    calls = [
        collect(stub.Generate(request(request_id="dup", max_tokens=5, ignore_eos=True, stream=s)))
        for s in (True, False, True, False, True)
    ]
    results = await asyncio.wait_for(asyncio.gather(*calls), 60)
    for messages in results:
        done = completes(messages)
        assert list(done) == [0] and done[0].finish_reason == "length"
    assert await wait_until_idle(engine) == 0


# ----- Embed, on a pooling engine ------------------------------------------------


@pytest.fixture(scope="module")
async def embed_stub(embedding_engine: Any) -> AsyncIterator[Any]:
    async with serving(embedding_engine, health=False, reflection_service=False) as served:
        yield vllm_engine_pb2_grpc.VllmEngineStub(served.channel)
        assert served.mounted.servicer.active_requests == 0


def embed(input_ids: list[int] | None, request_id: str = "e") -> pb.EmbedRequest:
    req = pb.EmbedRequest(request_id=request_id)
    if input_ids is not None:
        req.tokenized.input_ids.extend(input_ids)
    return req


EMBED_ROWS: dict[str, tuple[pb.EmbedRequest, str]] = {
    "no_input": (embed(None), "input_ids"),
    "empty_input_ids": (embed([]), "input_ids"),
    "oov_token_id": (embed([5, 100_000]), "token"),
    "max_uint32_token_id": (embed([U32]), "token"),
    "prompt_over_max_model_len": (embed(ids(MAX_LEN + 1)), "prompt"),
    "prompt_at_max_model_len": (embed(ids(MAX_LEN)), FINE),
    "missing_request_id": (embed([5, 6], request_id=""), FINE),
    "huge_request_id": (embed([5, 6], request_id="e" * 100_000), FINE),
}
EMBED_BUGS: dict[str, str] = {}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(
            n,
            id=n,
            marks=[pytest.mark.xfail(strict=True, reason=EMBED_BUGS[n])] if n in EMBED_BUGS else [],
        )
        for n in EMBED_ROWS
    ],
)
async def test_embed_edge(name: str, embed_stub: Any) -> None:
    req, field = EMBED_ROWS[name]
    try:
        reply = await embed_stub.Embed(req, timeout=60)
    except grpc.aio.AioRpcError as err:
        check_rejection(err, Row(lambda: req, field))  # type: ignore[arg-type,return-value]
    else:
        assert not field, f"accepted; expected a rejection naming {field!r}"
        assert reply.embedding_dim == len(reply.embedding) > 0
    good = await embed_stub.Embed(embed([5, 6, 7]), timeout=60)
    assert good.prompt_tokens == 3


async def test_a_prompt_past_the_context_is_refused_by_its_length(
    channel: grpc.aio.Channel, engine: Any
) -> None:
    """Two million token ids: refused by the servicer's count, not the engine's."""
    stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    for stream in (False, True):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub.Generate(request([7] * 2_000_000, stream=stream)))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = err.value.details() or ""
        assert "tokenized.input_ids" in details, details
        assert f"prompt length 2000000 is longer than the maximum model length {MAX_LEN}" in details
    # Truncation asked for: the engine keeps the prompt's last tokens and serves it.
    long_prompt = request([7] * (MAX_LEN + 100), max_tokens=2, truncate_prompt_tokens=MAX_LEN - 8)
    replies = await collect(stub.Generate(long_prompt))
    assert completes(replies)[0].finish_reason == "length"
    assert await wait_until_idle(engine) == 0
