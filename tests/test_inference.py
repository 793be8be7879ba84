"""vLLM's own `vllm.Inference` (Generate, GenerateStream) on the session's real engine.

Mounted beside VllmEngine with `mount(..., services=(SERVICE_NAME, INFERENCE_SERVICE))`
over a real loopback channel, and called with stubs compiled at test time from
the released schema (`protos/reference/vllm/inference.proto`), not the
package's own: what a client of vLLM's own server sends. Every refused field
of the field table is shown over the wire, for both methods.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import types
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from google.protobuf import json_format
from support import (
    ENGINE_STOP_SECONDS,
    bearer,
    error_info,
    hold_hand_over,
    note_releases,
    request,
    serving,
    settle,
    unfinished,
    wait_until_idle,
)
from support.kv_echo_connector import FINISHED_LOG

from vllm_servicer import SERVICE_NAME
from vllm_servicer.interceptors.api_keys import ApiKeyVerifier
from vllm_servicer.interceptors.auth import AuthInterceptor
from vllm_servicer.proto import INFERENCE_SERVICE, vllm_engine_pb2_grpc
from vllm_servicer.proto import vllm_engine_pb2 as engine_pb
from vllm_servicer.serve.args import parse_args
from vllm_servicer.serve.http_api import HttpApi
from vllm_servicer.wire.fields import REFUSED

PROMPT = [5, 17, 42, 99, 7, 63, 21, 88]
TEXT = "the quick brown fox"
EOS = 2  # the tiny tokenizer's </s>
METHODS = ("Generate", "GenerateStream")
SERVICES = (SERVICE_NAME, INFERENCE_SERVICE)


@pytest.fixture(scope="module")
async def served(engine: Any) -> AsyncIterator[Any]:
    async with serving(engine, services=SERVICES) as served:
        yield served


@pytest.fixture
def stub(served: Any, ref_grpc: types.ModuleType) -> Any:
    return ref_grpc.InferenceStub(served.channel)


@pytest.fixture
def engine_stub(served: Any) -> vllm_engine_pb2_grpc.VllmEngineStub:
    return vllm_engine_pb2_grpc.VllmEngineStub(served.channel)


def generate_request(
    ref: types.ModuleType, prompt: list[int] | str = PROMPT, max_new_tokens: int = 8, **fields: Any
) -> Any:
    """A vllm.GenerateRequest: greedy (temperature omitted), `max_new_tokens`, EOS ignored."""
    message = ref.GenerateRequest(**fields)
    if isinstance(prompt, str):
        message.text = prompt
    else:
        message.token_ids.ids.extend(prompt)
    message.stopping.max_new_tokens = max_new_tokens
    message.stopping.ignore_eos = True
    return message


async def streamed(call: Any) -> list[Any]:
    return [message async for message in call]


def reason(ref: types.ModuleType, name: str) -> int:
    return int(ref.FinishInfo.FinishReason.Value(name))


async def _call(stub: Any, method: str, message: Any, **kwargs: Any) -> Any:
    """The unary answer, or every message of the stream."""
    if method == "Generate":
        return await stub.Generate(message, timeout=60, **kwargs)
    return await streamed(stub.GenerateStream(message, timeout=60, **kwargs))


async def _refusal(stub: Any, method: str, message: Any, **kwargs: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _call(stub, method, message, **kwargs)
    return err.value


# ----- generation ------------------------------------------------------------------------


async def test_a_text_prompt_generates_greedy_text(stub: Any, ref: types.ModuleType) -> None:
    reply = await stub.Generate(generate_request(ref, TEXT), timeout=60)
    again = await stub.Generate(generate_request(ref, TEXT), timeout=60)
    assert reply.prompt_info.num_prompt_tokens > 0
    assert not reply.prompt_info.token_ids  # not asked for
    out = reply.outputs
    assert out.text and out.num_tokens == 8 and not out.token_ids
    assert out.finish_info.num_output_tokens == 8
    assert out.finish_info.finish_reason == reason(ref, "LENGTH")
    assert again.outputs.text == out.text  # greedy: the same every time


async def test_a_token_prompt_generates_and_returns_what_is_asked(
    stub: Any, ref: types.ModuleType
) -> None:
    message = generate_request(ref, PROMPT, 6)
    message.response.prompt_token_ids = True
    message.response.output_token_ids = True
    reply = await stub.Generate(message, timeout=60)
    assert list(reply.prompt_info.token_ids) == PROMPT
    assert reply.prompt_info.num_prompt_tokens == len(PROMPT)
    assert len(reply.outputs.token_ids) == reply.outputs.num_tokens == 6
    assert reply.outputs.text


async def test_both_protocols_give_the_same_greedy_tokens(
    stub: Any, engine_stub: Any, ref: types.ModuleType
) -> None:
    """The text tokenized with special tokens, as VllmEngine's text input is."""
    engine_reply = [
        m async for m in engine_stub.Generate(request(TEXT, max_tokens=8, ignore_eos=True))
    ]
    engine_tokens = list(engine_reply[-1].complete.output_ids)
    message = generate_request(ref, TEXT)
    message.response.output_token_ids = True
    message.response.prompt_token_ids = True
    reply = await stub.Generate(message, timeout=60)
    assert list(reply.outputs.token_ids) == engine_tokens
    assert reply.prompt_info.num_prompt_tokens == engine_reply[-1].complete.prompt_tokens
    assert reply.prompt_info.token_ids[0] == 1  # <s>: special tokens added


async def test_a_stream_is_prompt_info_then_deltas_then_finish_info(
    stub: Any, ref: types.ModuleType
) -> None:
    message = generate_request(ref, TEXT, 12)
    message.response.output_token_ids = True
    whole = await stub.Generate(message, timeout=60)
    messages = await streamed(stub.GenerateStream(message, timeout=60))
    first, deltas = messages[0], messages[1:]
    assert first.HasField("prompt_info") and not first.HasField("outputs")
    assert first.prompt_info.num_prompt_tokens == whole.prompt_info.num_prompt_tokens
    assert deltas and all(not m.HasField("prompt_info") for m in deltas)
    assert all(not m.outputs.HasField("finish_info") for m in deltas[:-1])
    finish = deltas[-1].outputs.finish_info
    assert finish.finish_reason == reason(ref, "LENGTH") and finish.num_output_tokens == 12
    assert "".join(m.outputs.text for m in deltas) == whole.outputs.text
    assert [t for m in deltas for t in m.outputs.token_ids] == list(whole.outputs.token_ids)
    assert sum(m.outputs.num_tokens for m in deltas) == 12
    assert all(m.outputs.num_tokens == len(m.outputs.token_ids) for m in deltas)


async def test_output_text_off_sends_tokens_only(stub: Any, ref: types.ModuleType) -> None:
    message = generate_request(ref, PROMPT, 4)
    message.response.output_text = False
    message.response.output_token_ids = True
    reply = await stub.Generate(message, timeout=60)
    assert reply.outputs.text == "" and len(reply.outputs.token_ids) == 4


# ----- stops -----------------------------------------------------------------------------


async def _greedy(stub: Any, ref: types.ModuleType, tokens: int = 16) -> Any:
    message = generate_request(ref, PROMPT, tokens)
    message.response.output_token_ids = True
    return (await stub.Generate(message, timeout=60)).outputs


@pytest.mark.parametrize("method", METHODS)
async def test_a_stop_string_ends_the_text_before_it(
    stub: Any, ref: types.ModuleType, method: str
) -> None:
    full = (await _greedy(stub, ref)).text
    stop = next(full[i : i + 2] for i in range(3, len(full) - 2) if full[i : i + 2].strip())
    message = generate_request(ref, PROMPT, 16)
    message.stopping.stop_strings.append(stop)
    replies = await _call(stub, method, message)
    outputs = [replies.outputs] if method == "Generate" else [m.outputs for m in replies[1:]]
    finish = outputs[-1].finish_info
    assert finish.finish_reason == reason(ref, "STOP")
    assert finish.WhichOneof("stop_reason") == "stop_string" and finish.stop_string == stop
    assert "".join(o.text for o in outputs) == full[: full.index(stop)]
    message.stopping.include_stop_strings = True
    reply = await stub.Generate(message, timeout=60)
    assert reply.outputs.text == full[: full.index(stop) + len(stop)]


async def test_a_stop_token_is_named(stub: Any, ref: types.ModuleType) -> None:
    tokens = list((await _greedy(stub, ref)).token_ids)
    stop = tokens[3]
    message = generate_request(ref, PROMPT, 16)
    message.stopping.stop_token_ids.append(stop)
    finish = (await stub.Generate(message, timeout=60)).outputs.finish_info
    assert finish.finish_reason == reason(ref, "STOP")
    assert finish.WhichOneof("stop_reason") == "stop_token_id" and finish.stop_token_id == stop
    assert finish.num_output_tokens == tokens.index(stop) + 1


async def test_an_eos_stop_names_the_eos_token(stub: Any, ref: types.ModuleType) -> None:
    message = ref.GenerateRequest(token_ids=ref.TokenIds(ids=PROMPT))
    message.decoding.allowed_token_ids.append(EOS)  # the only token it may choose
    message.response.output_token_ids = True
    out = (await stub.Generate(message, timeout=60)).outputs
    assert out.finish_info.finish_reason == reason(ref, "STOP")
    assert out.finish_info.WhichOneof("stop_reason") == "eos_token_id"
    assert out.finish_info.eos_token_id == EOS and list(out.token_ids) == [EOS]


async def test_min_new_tokens_hold_the_eos_back(stub: Any, ref: types.ModuleType) -> None:
    message = ref.GenerateRequest(token_ids=ref.TokenIds(ids=PROMPT))
    message.decoding.allowed_token_ids.extend([EOS, 40])
    message.stopping.min_new_tokens = 3
    message.stopping.max_new_tokens = 10
    message.response.output_token_ids = True
    out = (await stub.Generate(message, timeout=60)).outputs
    assert list(out.token_ids[:3]) == [40, 40, 40]


async def test_an_unset_max_new_tokens_runs_to_the_end_of_the_context(
    stub: Any, ref: types.ModuleType, engine: Any
) -> None:
    """As vLLM's Rust server: the model's generation config sets no bound here."""
    room = 5
    prompt = (PROMPT * 64)[: engine.model_config.max_model_len - room]
    message = ref.GenerateRequest(token_ids=ref.TokenIds(ids=prompt))
    message.stopping.ignore_eos = True
    finish = (await stub.Generate(message, timeout=60)).outputs.finish_info
    assert finish.finish_reason == reason(ref, "LENGTH") and finish.num_output_tokens == room


# ----- logprobs and candidates -----------------------------------------------------------


async def test_output_logprobs_and_ranks_are_vllms_as_vllm_engine_reports_them(
    stub: Any, engine_stub: Any, ref: types.ModuleType
) -> None:
    message = generate_request(ref, PROMPT, 5)
    message.response.output_logprobs = True
    message.response.output_token_ids = True
    out = (await stub.Generate(message, timeout=60)).outputs
    # Ranks in the vocabulary (dummy weights tie many logits: greedy is not always rank 1).
    assert len(out.logprobs) == len(out.ranks) == 5 and min(out.ranks) >= 1
    assert not out.candidate_tokens  # not asked for
    engine_reply = [
        m
        async for m in engine_stub.Generate(
            request(PROMPT, max_tokens=5, ignore_eos=True, logprobs=0)
        )
    ]
    engine_lps = engine_reply[-1].complete.output_logprobs
    assert list(engine_lps.token_ids) == list(out.token_ids)
    assert list(out.logprobs) == pytest.approx(list(engine_lps.token_logprobs))


@pytest.mark.parametrize("method", METHODS)
async def test_top_n_candidates_are_the_others_ranked(
    stub: Any, ref: types.ModuleType, method: str
) -> None:
    message = generate_request(ref, PROMPT, 4)
    message.response.output_logprobs = True
    message.response.output_token_ids = True
    message.response.output_candidates.top_n = 3
    replies = await _call(stub, method, message)
    outputs = [replies.outputs] if method == "Generate" else [m.outputs for m in replies[1:]]
    tokens = [t for o in outputs for t in o.token_ids]
    candidates = [c for o in outputs for c in o.candidate_tokens]
    assert len(candidates) == len(tokens) == 4
    ranks = [r for o in outputs for r in o.ranks]
    for token, rank, position in zip(tokens, ranks, candidates, strict=True):
        # The top 3 but the token itself: 2 of them when it is among the top 3.
        expected = [r for r in (1, 2, 3) if r != rank] if rank <= 3 else [1, 2, 3]
        assert [c.rank for c in position.tokens] == expected[: len(position.tokens)]
        assert len(position.tokens) == (2 if rank <= 3 else 3)
        assert token not in {c.id for c in position.tokens}
        lps = [c.logprob for c in position.tokens]
        assert lps == sorted(lps, reverse=True)


async def test_candidates_by_token_id_are_those_tokens(stub: Any, ref: types.ModuleType) -> None:
    message = generate_request(ref, PROMPT, 3)
    message.response.output_candidates.token_ids.ids.extend([40, 41])
    message.response.output_token_ids = True
    out = (await stub.Generate(message, timeout=60)).outputs
    assert not out.logprobs  # candidates asked for, not the tokens' own logprobs
    assert len(out.candidate_tokens) == 3
    for token, position in zip(out.token_ids, out.candidate_tokens, strict=True):
        assert {c.id for c in position.tokens} == {40, 41} - {token}
        # vLLM does not rank tokens chosen by id: no rank is claimed.
        assert all(c.rank == 0 and c.logprob < 0 for c in position.tokens)


async def test_prompt_logprobs_cover_every_prompt_position(
    stub: Any, ref: types.ModuleType
) -> None:
    message = generate_request(ref, PROMPT, 2)
    message.response.prompt_logprobs = True
    message.response.prompt_candidates.top_n = 2
    info = (await stub.Generate(message, timeout=60)).prompt_info
    assert len(info.logprobs) == len(info.ranks) == len(info.candidate_tokens) == len(PROMPT)
    # The first prompt token has nothing before it to be scored from.
    assert (info.logprobs[0], info.ranks[0], len(info.candidate_tokens[0].tokens)) == (0.0, 0, 0)
    assert all(lp < 0 for lp in info.logprobs[1:]) and all(r >= 1 for r in info.ranks[1:])
    for token, position in zip(PROMPT[1:], info.candidate_tokens[1:], strict=True):
        assert 1 <= len(position.tokens) <= 2 and token not in {c.id for c in position.tokens}


# ----- request fields honoured -----------------------------------------------------------


async def test_structured_output_constrains_the_text(stub: Any, ref: types.ModuleType) -> None:
    message = generate_request(ref, PROMPT, 12)
    message.stopping.ignore_eos = False
    message.decoding.regex = "(ab|cd){3}"
    assert re.fullmatch("(ab|cd){3}", (await stub.Generate(message, timeout=60)).outputs.text)
    choice = generate_request(ref, PROMPT, 12)
    choice.stopping.ignore_eos = False
    choice.decoding.choice.choices.extend(["yes", "no"])
    assert (await stub.Generate(choice, timeout=60)).outputs.text in ("yes", "no")


async def test_a_bad_grammar_names_its_field(stub: Any, ref: types.ModuleType) -> None:
    message = generate_request(ref, PROMPT, 4)
    message.decoding.json = "{not json"
    err = await _refusal(stub, "Generate", message)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_truncation_keeps_the_last_prompt_tokens(stub: Any, ref: types.ModuleType) -> None:
    message = generate_request(ref, PROMPT, 2, truncate_prompt_tokens=3)
    message.response.prompt_token_ids = True
    info = (await stub.Generate(message, timeout=60)).prompt_info
    assert info.num_prompt_tokens == 3 and list(info.token_ids) == PROMPT[-3:]


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda m: setattr(m, "priority", 5), id="priority"),
        pytest.param(lambda m: setattr(m, "session_id", "conversation-7"), id="session_id"),
        pytest.param(lambda m: setattr(m, "watermarking", False), id="watermarking"),
        pytest.param(lambda m: setattr(m.kv, "cache_salt", "tenant-a"), id="cache_salt"),
        pytest.param(
            lambda m: setattr(m.kv, "bypass_prefix_cache", True), id="bypass_prefix_cache"
        ),
        pytest.param(
            lambda m: setattr(m.response, "skip_special_tokens", False), id="skip_special"
        ),
    ],
)
async def test_fields_that_leave_greedy_tokens_alone(
    build: Callable[[Any], None], stub: Any, ref: types.ModuleType
) -> None:
    baseline = generate_request(ref, PROMPT, 6)
    baseline.response.output_token_ids = True
    message = generate_request(ref, PROMPT, 6)
    message.response.output_token_ids = True
    build(message)
    reply = await stub.Generate(message, timeout=60)
    expected = await stub.Generate(baseline, timeout=60)
    assert list(reply.outputs.token_ids) == list(expected.outputs.token_ids)


async def test_logit_bias_steers_the_tokens(stub: Any, ref: types.ModuleType) -> None:
    message = generate_request(ref, PROMPT, 4)
    message.decoding.logit_bias[40] = 100.0
    message.response.output_token_ids = True
    assert list((await stub.Generate(message, timeout=60)).outputs.token_ids) == [40] * 4


@pytest.fixture(scope="module")
async def priority_served(tiny_model_dir: Path) -> AsyncIterator[Any]:
    """An engine that schedules by priority and runs one sequence at a time, so the rest queue."""
    from vllm_servicer.testing.tiny_model import build_tiny_engine

    llm = build_tiny_engine(tiny_model_dir, scheduling_policy="priority", max_num_seqs=1)
    try:
        async with serving(llm, services=SERVICES) as served:
            yield served
    finally:
        llm.shutdown(timeout=ENGINE_STOP_SECONDS)


@pytest.mark.engine  # an engine of its own (priority_served)
@pytest.mark.parametrize(
    ("first", "second", "finish_first"),
    [
        pytest.param(10, 5, "second", id="lower-value-overtakes"),
        pytest.param(5, 5, "first", id="equal-keeps-arrival-order"),
    ],
)
async def test_priority_reorders_queued_requests(
    priority_served: Any,
    ref: types.ModuleType,
    ref_grpc: types.ModuleType,
    first: int,
    second: int,
    finish_first: str,
) -> None:
    stub = ref_grpc.InferenceStub(priority_served.channel)
    # The one running sequence: long enough that both others arrive while it runs
    # (200 tokens could end within the waits below on an idle machine; the
    # context holds 512).
    blocker = stub.GenerateStream(generate_request(ref, PROMPT, 480), timeout=120)
    assert (await blocker.read()).HasField("prompt_info")
    assert (await blocker.read()).outputs.num_tokens > 0  # running, not queued
    order: list[str] = []

    async def queued(name: str, priority: int, prompt: list[int]) -> None:
        message = generate_request(ref, prompt, 4, priority=priority)
        await stub.Generate(message, timeout=120)
        order.append(name)

    tasks = [asyncio.create_task(queued("first", first, PROMPT[::-1]))]
    await asyncio.sleep(0.1)  # "first" is in the engine's queue before "second" is sent
    tasks.append(asyncio.create_task(queued("second", second, PROMPT[1:])))
    await asyncio.sleep(0.1)
    assert order == []  # both still queued behind the running one
    await asyncio.gather(*tasks)
    blocker.cancel()
    assert order[0] == finish_first


async def test_an_abort_by_id_finishes_the_stream_aborted(
    stub: Any, engine_stub: Any, ref: types.ModuleType
) -> None:
    """Whichever protocol sends it: the stream ends OK, its finish reason ABORTED."""
    rid = "inference-aborted"
    call = stub.GenerateStream(generate_request(ref, PROMPT, 400, request_id=rid), timeout=60)
    assert (await call.read()).HasField("prompt_info")
    await engine_stub.Abort(engine_pb.AbortRequest(request_ids=[rid]))
    rest = []
    while (message := await call.read()) is not grpc.aio.EOF:
        rest.append(message)
    finish = rest[-1].outputs.finish_info
    assert finish.finish_reason == reason(ref, "ABORTED") and finish.num_output_tokens < 400
    assert await call.code() == grpc.StatusCode.OK


async def test_a_seed_makes_sampling_repeatable(stub: Any, ref: types.ModuleType) -> None:
    runs = []
    for _ in range(2):
        message = generate_request(ref, PROMPT, 8, temperature=1.0)
        message.sampling.seed = 1234
        message.response.output_token_ids = True
        runs.append(list((await stub.Generate(message, timeout=60)).outputs.token_ids))
    assert runs[0] == runs[1]


# ----- the fields vLLM 0.33's and 0.34's released schema added -------------------------


async def _greedy_ids(stub: Any, message: Any) -> list[int]:
    message.response.output_token_ids = True
    return list((await stub.Generate(message, timeout=60)).outputs.token_ids)


@pytest.mark.parametrize("method", METHODS)
async def test_bad_words_token_ids_ban_the_greedy_tokens(
    method: str, stub: Any, ref: types.ModuleType
) -> None:
    greedy = await _greedy_ids(stub, generate_request(ref, PROMPT, 8))
    banned = generate_request(ref, PROMPT, 8)
    banned.decoding.bad_words_token_ids.add(ids=[greedy[0]])
    banned.response.output_token_ids = True
    replies = await _call(stub, method, banned)
    outputs = [replies.outputs] if method == "Generate" else [m.outputs for m in replies[1:]]
    tokens = [t for out in outputs for t in out.token_ids]
    assert len(tokens) == 8 and greedy[0] not in tokens, (greedy, tokens)
    # A two-token sequence bans its second token only right after its first
    # (among the generated tokens, as vLLM's sampler reads them).
    pair = generate_request(ref, PROMPT, 4)
    pair.decoding.bad_words_token_ids.add(ids=[greedy[0], greedy[1]])
    tokens = await _greedy_ids(stub, pair)
    assert tokens[0] == greedy[0] and tokens[1] != greedy[1], (greedy, tokens)


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("top_p", 0.0, "top_p must be in (0, 1], got 0"),
        ("top_p", 1.5, "top_p must be in (0, 1], got 1.5"),
        ("min_p", 2.0, "min_p must be in [0, 1], got 2"),
    ],
)
async def test_a_present_sampling_knob_out_of_range_is_invalid(
    field: str, value: float, words: str, stub: Any, ref: types.ModuleType
) -> None:
    message = generate_request(ref, PROMPT, 2, temperature=1.0)
    setattr(message.sampling, field, value)
    err = await _refusal(stub, "Generate", message)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == f"sampling.{field}: {words}"


def _spied(engine: Any, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The keyword arguments of each `engine.generate` call from now on."""
    calls: list[dict[str, Any]] = []
    generate = engine.generate

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return generate(*args, **kwargs)

    monkeypatch.setattr(engine, "generate", spy)
    return calls


async def test_the_engine_reasoning_gate_reaches_the_engine(
    stub: Any, ref: types.ModuleType, engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    greedy = await _greedy_ids(stub, generate_request(ref, PROMPT, 4))
    calls = _spied(engine, monkeypatch)
    message = generate_request(ref, PROMPT, 4)
    message.engine_reasoning_gate.reasoning_ended = True
    message.engine_reasoning_gate.chat_template_kwargs.update({"enable_thinking": False})
    # No reasoning parser on this engine: the gate has nothing to hold back.
    assert await _greedy_ids(stub, message) == greedy
    assert calls[-1]["reasoning_ended"] is True
    assert calls[-1]["reasoning_parser_kwargs"] == {
        "chat_template_kwargs": {"enable_thinking": False}
    }
    unset = generate_request(ref, PROMPT, 4)
    unset.engine_reasoning_gate.SetInParent()  # present, empty: the engine infers the state
    assert await _greedy_ids(stub, unset) == greedy
    assert "reasoning_ended" not in calls[-1]


async def test_kv_hints_reach_the_engine(
    stub: Any, ref: types.ModuleType, engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.v1.kv_hints.protocol import KvHintAction, KvHintsEnvelope

    calls = _spied(engine, monkeypatch)
    message = generate_request(ref, PROMPT, 2)
    message.kv_hints.protocol_version = "1"
    message.kv_hints.message_id = "m-1"
    action = message.kv_hints.actions.add(
        action_id="a-1", action_type="prefetch", action_version="1"
    )
    action.payload.update({"blocks": 3, "tier": "cpu"})
    assert (await stub.Generate(message, timeout=60)).outputs.num_tokens == 2
    assert calls[-1]["kv_hints"] == KvHintsEnvelope(
        protocol_version="1",
        message_id="m-1",
        actions=[KvHintAction("a-1", "prefetch", "1", {"blocks": 3, "tier": "cpu"})],
    )


@pytest.mark.parametrize("method", METHODS)
async def test_finish_info_counts_the_prompt_tokens_found_in_the_prefix_cache(
    method: str, stub: Any, ref: types.ModuleType, engine: Any
) -> None:
    block = engine.vllm_config.cache_config.block_size
    # Two whole KV blocks and a part, a prompt no other test sends (the tiny vocabulary).
    prompt = [(7 * i + len(method)) % 300 + 3 for i in range(2 * block + 10)]
    cached = []
    for _ in range(2):
        replies = await _call(stub, method, generate_request(ref, prompt, 2))
        last = replies.outputs if method == "Generate" else replies[-1].outputs
        assert last.finish_info.HasField("num_cached_tokens")  # sent even when 0
        cached.append(last.finish_info.num_cached_tokens)
    assert cached == [0, 2 * block], cached


async def _raw(served: Any, method: str, data: bytes) -> grpc.aio.AioRpcError:
    """`data` sent as it is, as a client built from another schema would send it."""
    if method == "GenerateStream":
        call: Any = served.channel.unary_stream(f"/vllm.Inference/{method}")(data, timeout=60)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            [m async for m in call]
    else:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await served.channel.unary_unary(f"/vllm.Inference/{method}")(data, timeout=60)
    return err.value


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field `number` holding `payload`."""
    key = (number << 3) | 2
    return _varint(key) + _varint(len(payload)) + payload


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


@pytest.mark.parametrize("method", METHODS)
async def test_a_field_the_schema_does_not_know_is_refused_naming_it(
    method: str, served: Any, ref: types.ModuleType, engine: Any
) -> None:
    request_bytes = generate_request(ref, PROMPT, 2).SerializeToString()
    err = await _raw(served, method, request_bytes + _field(99, b"x"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    details = err.details() or ""
    assert details.startswith("request: field number 99 is not in vllm.GenerateRequest"), details
    assert 'proto_version "0.7.0"' in details and "vLLM 0.34.0" in details, details
    # Nested: an unknown field inside `sampling` (field 6) is named there.
    sampling = ref.RandomSampling(seed=3).SerializeToString() + _field(50, b"")
    err = await _raw(served, method, request_bytes + _field(6, sampling))
    assert (err.details() or "").startswith("sampling: field number 50 is not in "), err.details()
    assert await wait_until_idle(engine) == 0


# ----- malformed and unservable requests -------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
async def test_a_missing_prompt_is_invalid(stub: Any, ref: types.ModuleType, method: str) -> None:
    err = await _refusal(stub, method, ref.GenerateRequest())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt is required" in (err.details() or "")


@pytest.mark.parametrize("method", METHODS)
async def test_a_model_other_than_the_served_one_is_not_found(
    stub: Any, ref: types.ModuleType, method: str, engine: Any
) -> None:
    err = await _refusal(stub, method, generate_request(ref, model="no-such-model"))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert "no-such-model" in (err.details() or "")
    served_name = engine.model_config.served_model_name
    assert await _call(stub, method, generate_request(ref, PROMPT, 2, model=served_name))


@pytest.mark.parametrize("value", ["abc", "-1", "4294967296", "1.5", ""])
async def test_a_bad_data_parallel_rank_header_is_invalid(
    stub: Any, ref: types.ModuleType, value: str
) -> None:
    metadata = (("x-data-parallel-rank", value),)
    err = await _refusal(stub, "GenerateStream", generate_request(ref), metadata=metadata)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.details() or "").startswith("x-data-parallel-rank: ")


async def test_the_data_parallel_rank_header_reaches_the_engine(
    stub: Any, ref: types.ModuleType
) -> None:
    reply = await stub.Generate(
        generate_request(ref, PROMPT, 2), metadata=(("x-data-parallel-rank", "0"),), timeout=60
    )
    assert reply.outputs.num_tokens == 2
    # One rank here: vLLM refuses any other.
    err = await _refusal(
        stub, "Generate", generate_request(ref), metadata=(("x-data-parallel-rank", "1"),)
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_dropped_stream_leaves_nothing_in_the_engine(
    stub: Any, ref: types.ModuleType, engine: Any, served: Any
) -> None:
    call = stub.GenerateStream(generate_request(ref, PROMPT, 400), timeout=60)
    assert (await call.read()).HasField("prompt_info")
    assert (await call.read()).HasField("outputs")
    call.cancel()
    assert await wait_until_idle(engine) == 0
    assert await settle(lambda: not served.mounted.servicer.running_request_ids)


@pytest.mark.parametrize("protocol", ["inference", "vllm-engine"])
async def test_a_stream_dropped_while_its_writes_wait_leaves_the_engine_before_its_id_is_free(
    served: Any,
    ref: types.ModuleType,
    ref_grpc: types.ModuleType,
    engine: Any,
    monkeypatch: pytest.MonkeyPatch,
    protocol: str,
) -> None:
    """A stream dropped while its writes wait for the client's flow-control window
    is out of the engine when its id is let go (another call may take the id
    then, an unload drop its adapter): grpc closes the handler at its yield,
    where the engine's own stream would otherwise wait to be collected."""
    released = note_releases(
        served.mounted.state.running, lambda _: unfinished(engine), monkeypatch
    )
    rid = f"blocked-{protocol}"
    # A small window the client never widens: the server's writes soon wait.
    options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{served.port}", options=options) as channel:
        if protocol == "inference":
            message = generate_request(ref, PROMPT, 500, request_id=rid)
            message.response.output_token_ids = True
            message.response.output_logprobs = True
            message.response.output_candidates.top_n = 20
            call = ref_grpc.InferenceStub(channel).GenerateStream(message, timeout=60)
        else:
            generate = request(PROMPT, stream=True, request_id=rid, max_tokens=500, logprobs=20)
            generate.sampling_params.ignore_eos = True
            call = vllm_engine_pb2_grpc.VllmEngineStub(channel).Generate(generate, timeout=60)
        await call.read()
        await asyncio.sleep(0.5)  # the server's writes wait; the engine generates on
        assert unfinished(engine) == 1, "the request ended before the test could drop it"
        call.cancel()
        assert await settle(lambda: any(request_id == rid for request_id, _ in released))
    assert [left for request_id, left in released if request_id == rid] == [0]


@pytest.mark.parametrize("protocol", ["inference", "vllm-engine", "http"])
async def test_a_call_cancelled_while_its_request_enters_the_engine_leaves_it(
    served: Any,
    ref: types.ModuleType,
    ref_grpc: types.ModuleType,
    engine: Any,
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    protocol: str,
) -> None:
    """A cancel landing while vLLM hands the request to its engine core (its
    `generate` has no output stream yet, so it aborts nothing) still takes the
    request out of the engine before the call's id is let go: otherwise the
    engine runs it to its end for no one, past the call's in-flight slot and
    adapter hold. Both gRPC protocols, and the HTTP API beside them (vLLM's own
    handlers, through the mount's guard)."""
    assert await wait_until_idle(engine, 30) == 0  # what an earlier test left has ended
    rid = f"entering-{protocol}"
    handed = hold_hand_over(engine, rid, monkeypatch)
    released = note_releases(
        served.mounted.state.running, lambda _: unfinished(engine), monkeypatch
    )
    async with contextlib.AsyncExitStack() as stack:
        if protocol == "http":
            args = parse_args(["serve", "--model", str(tiny_model_dir), "--http-port", "0"])
            api = await HttpApi.build(
                engine, args, host="127.0.0.1", port=0, guard=served.mounted.guard
            )
            await api.start()
            stack.push_async_callback(api.stop, 0)
            client = await stack.enter_async_context(httpx.AsyncClient(timeout=60))
            body = {"prompt": PROMPT, "max_tokens": 500, "ignore_eos": True, "stream": True}
            headers = {"X-Request-Id": rid}
            url = f"http://127.0.0.1:{api.port}/v1/completions"

            async def read_http() -> None:
                async with client.stream("POST", url, json=body, headers=headers) as reply:
                    async for _ in reply.aiter_bytes():
                        pass

            call: Any = asyncio.ensure_future(read_http())
        else:
            channel = await stack.enter_async_context(
                grpc.aio.insecure_channel(f"127.0.0.1:{served.port}")
            )
            if protocol == "inference":
                message = generate_request(ref, PROMPT, 500, request_id=rid)
                call = ref_grpc.InferenceStub(channel).Generate(message, timeout=60)
            else:
                generate = request(
                    PROMPT, stream=True, request_id=rid, max_tokens=500, ignore_eos=True
                )
                call = vllm_engine_pb2_grpc.VllmEngineStub(channel).Generate(generate, timeout=60)
        assert await settle(lambda: bool(handed), 30)
        assert unfinished(engine) == 1
        call.cancel()
        assert await settle(lambda: any(rid in request_id for request_id, _ in released))
    assert [left for request_id, left in released if rid in request_id] == [0]
    assert await wait_until_idle(engine) == 0


# ----- every refused field, over the wire ------------------------------------------------


def _raw_image(m: Any) -> None:
    m.media.add(modality=1, raw_bytes=b"\x89PNG")


def _empty_token_prompt(m: Any) -> None:
    del m.token_ids.ids[:]


# One request change per refused row of the table: (the change, what else the message says).
REFUSALS: dict[str, tuple[Callable[[Any], None], str]] = {
    "sampling.num_sequences": (lambda m: setattr(m.sampling, "num_sequences", 2), "> 1"),
    "response.prompt_candidates.token_ids": (
        lambda m: m.response.prompt_candidates.token_ids.ids.append(40),
        "top_n",
    ),
    "kv.kv_transfer_params": (
        lambda m: m.kv.kv_transfer_params.update({"do_remote_decode": True}),
        "--kv-transfer-config",
    ),
    "kv.ec_transfer_params": (
        lambda m: m.kv.ec_transfer_params.update({"ec_items": []}),
        "--ec-transfer-config",
    ),
    "lora_name": (lambda m: setattr(m, "lora_name", "my-adapter"), "--enable-lora"),
    "stopping.thinking_token_budget": (
        lambda m: setattr(m.stopping, "thinking_token_budget", 64),
        "--reasoning-parser",
    ),
    "media.url": (
        lambda m: m.media.add(modality=1, url="https://example.com/a.png"),
        "--enable-media-refs",
    ),
    "media.data_uri": (
        lambda m: m.media.add(modality=1, data_uri="data:image/png;base64,iVBORw0KGgo="),
        "--enable-media-refs",
    ),
    "media.modality": (
        lambda m: m.media.add(modality=2, url="https://example.com/a.mp4"),
        "images only",
    ),
    "media.raw_bytes": (_raw_image, "data_uri"),
    "media.features": (
        lambda m: m.media.add(modality=1, features={"kwargs": b"\x80", "length": 1}),
        "url or data_uri",
    ),
}


def _unindexed(path: str) -> str:
    return re.sub(r"\[\d+\]", "", path)


def test_every_refusal_has_a_wire_test() -> None:
    for method in METHODS:
        assert set(REFUSED[INFERENCE_SERVICE][method]) == set(REFUSALS), method


@pytest.mark.parametrize("path", list(REFUSALS))
@pytest.mark.parametrize("method", METHODS)
async def test_a_refused_field_is_refused_with_its_code_and_name(
    method: str, path: str, stub: Any, ref: types.ModuleType, engine: Any
) -> None:
    change, words = REFUSALS[path]
    message = generate_request(ref, PROMPT, 2)
    change(message)
    err = await _refusal(stub, method, message)
    expected = grpc.StatusCode[REFUSED[INFERENCE_SERVICE][method][path].error.status_code]
    details = err.details() or ""
    assert err.code() == expected, details
    assert _unindexed(details).startswith(f"{path}: ") and words in details, details
    info = error_info(err)
    assert (_unindexed(info.metadata["field"]), info.metadata["method"]) == (path, method)
    assert await wait_until_idle(engine) == 0


@pytest.mark.parametrize(
    ("build", "field"),
    [
        pytest.param(lambda m: m.media.add(url="https://example.com/a.png"), "media[0].modality"),
        pytest.param(lambda m: m.media.add(modality=1), "media[0].source"),
        pytest.param(
            lambda m: m.media.add(modality=1, url="data:image/png;base64,AA=="), "media[0].url"
        ),
        pytest.param(
            lambda m: m.media.add(modality=1, data_uri="https://example.com/a"), "media[0].data_uri"
        ),
        pytest.param(
            lambda m: m.media.add(modality=1, url="https://e.com/a", mime_type="audio/wav"),
            "media[0].mime_type",
        ),
        pytest.param(lambda m: m.decoding.choice.SetInParent(), "decoding.choice.choices"),
        pytest.param(_empty_token_prompt, "token_ids.ids"),
        pytest.param(
            lambda m: m.decoding.bad_words_token_ids.add(),
            "decoding.bad_words_token_ids[0].ids",
            id="empty-bad-words",
        ),
        pytest.param(
            lambda m: m.decoding.bad_words_token_ids.add(ids=[5, 10**6]),
            "decoding.bad_words_token_ids[0].ids",
            id="bad-word-outside-the-vocabulary",
        ),
        pytest.param(
            lambda m: [m.decoding.bad_words_token_ids.add(ids=[5] * 600) for _ in range(2)],
            "decoding.bad_words_token_ids",
            id="bad-words-past-vllms-token-total",
        ),
        pytest.param(
            lambda m: [m.decoding.bad_words_token_ids.add(ids=[5]) for _ in range(129)],
            "decoding.bad_words_token_ids",
            id="more-bad-words-than-vllm-takes",
        ),
        pytest.param(
            lambda m: setattr(m.stopping, "thinking_token_budget", -2),
            "stopping.thinking_token_budget",
            id="thinking-budget-below-minus-one",
        ),
    ],
)
async def test_malformed_fields_are_invalid_naming_them(
    build: Callable[[Any], None], field: str, stub: Any, ref: types.ModuleType
) -> None:
    message = generate_request(ref, PROMPT, 2)
    build(message)
    err = await _refusal(stub, "Generate", message)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert (err.details() or "").startswith(f"{field}: "), err.details()


# ----- request ids belong to their caller, across protocols ------------------------------

ALICE = "alice-0123456789abcdefABCDEF"
BOB = "bob-0123456789abcdefABCDEF"


@pytest.fixture(scope="module")
async def authenticated(engine: Any) -> AsyncIterator[Any]:
    auth = AuthInterceptor(ApiKeyVerifier({"alice": ALICE, "bob": BOB}))
    async with serving(engine, services=SERVICES, interceptors=[auth]) as served:
        yield served


@pytest.mark.parametrize("first", ["VllmEngine", "Inference"])
async def test_a_running_request_id_is_its_callers_in_both_protocols(
    authenticated: Any, ref: types.ModuleType, ref_grpc: types.ModuleType, first: str
) -> None:
    inference = ref_grpc.InferenceStub(authenticated.channel)
    engine_stub = vllm_engine_pb2_grpc.VllmEngineStub(authenticated.channel)
    rid = f"taken-across-{first}"
    long_inference = generate_request(ref, PROMPT, 400, request_id=rid)
    long_engine = request(PROMPT, max_tokens=400, ignore_eos=True, stream=True, request_id=rid)
    if first == "VllmEngine":
        running = engine_stub.Generate(long_engine, metadata=bearer(ALICE))
        assert (await running.read()).HasField("chunk")
        intruder = _refusal(
            inference, "Generate", generate_request(ref, request_id=rid), metadata=bearer(BOB)
        )
    else:
        running = inference.GenerateStream(long_inference, metadata=bearer(ALICE))
        assert (await running.read()).HasField("prompt_info")
        short = request(PROMPT, max_tokens=2, request_id=rid)
        intruder = _refusal_engine(engine_stub, short, bearer(BOB))
    err = await intruder
    running.cancel()
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS
    assert error_info(err).reason == "REQUEST_ID_IN_USE" and rid in (err.details() or "")
    # The owner may reuse it, as vLLM allows, in the other protocol too.
    again = await inference.Generate(
        generate_request(ref, PROMPT, 2, request_id=rid), metadata=bearer(ALICE), timeout=60
    )
    assert again.outputs.num_tokens == 2


async def _refusal_engine(
    stub: vllm_engine_pb2_grpc.VllmEngineStub, message: engine_pb.GenerateRequest, metadata: Any
) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        _ = [m async for m in stub.Generate(message, metadata=metadata, timeout=60)]
    return err.value


# ----- an engine with a KV connector ------------------------------------------------------


@pytest.fixture(scope="module")
async def handoff(kv_echo_engine: Any, ref_grpc: types.ModuleType) -> AsyncIterator[Any]:
    """A stub on the session's engine whose KV connector hands its params back."""
    async with serving(
        kv_echo_engine, services=SERVICES, health=False, reflection_service=False
    ) as served:
        yield ref_grpc.InferenceStub(served.channel)


@pytest.mark.parametrize("method", METHODS)
async def test_kv_transfer_params_reach_the_connector_and_come_back(
    handoff: Any, ref: types.ModuleType, method: str, kv_echo_storage: Path
) -> None:
    sent = {"do_remote_decode": True, "remote_host": "10.0.0.2", "remote_port": 7000, "ids": [1]}
    rid = f"handoff-{method}-call"  # neither method's id a prefix of the other's
    message = generate_request(ref, PROMPT, 3, request_id=rid)
    message.kv.kv_transfer_params.update(sent)
    replies = await _call(handoff, method, message)
    last = replies.outputs if method == "Generate" else replies[-1].outputs
    returned = json_format.MessageToDict(last.finish_info.kv_transfer_params)
    assert returned == {**sent, "echoed_by": "EchoConnector"}
    lines = (kv_echo_storage / FINISHED_LOG).read_text().splitlines()
    # The engine's own id for the request starts with the client's.
    told = [e["params"] for e in map(json.loads, lines) if e["request_id"].startswith(rid)]
    # Whole numbers reach the connector as ints (a Struct holds doubles), as from vLLM's server.
    assert told == [sent] and isinstance(told[0]["remote_port"], int)


@pytest.mark.parametrize("method", METHODS)
async def test_a_rejected_remote_prefill_is_reported_to_the_connector_as_on_vllm_engine(
    handoff: Any, ref: types.ModuleType, method: str, kv_echo_storage: Path
) -> None:
    """The same refusal VllmEngine reports (test_protocol_fields.py's
    `test_a_rejected_remote_prefill_request_is_reported_to_the_connector`):
    a temperature below 0, after the routing data was read."""
    rid = f"rejected-prefill-{method}-call"  # neither method's id a prefix of the other's
    message = generate_request(ref, PROMPT, 2, request_id=rid)
    message.temperature = -1.0
    sent = {"do_remote_prefill": True, "remote_block_ids": [3]}
    message.kv.kv_transfer_params.update(sent)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _call(handoff, method, message)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    told: list[Any] = []
    for _ in range(100):  # the engine core runs the connector's hook on its next step
        log = kv_echo_storage / FINISHED_LOG
        lines = log.read_text().splitlines() if log.exists() else []
        told = [e["params"] for e in map(json.loads, lines) if e["request_id"].startswith(rid)]
        if told:
            break
        await asyncio.sleep(0.05)
    assert told == [{"do_remote_prefill": True, "remote_block_ids": [3]}]


async def test_the_readme_call_streams_text_to_its_finish(
    served: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    (sample,) = [
        block
        for block in re.findall(r"```python\n(.*?)```", readme, re.S)
        if "InferenceStub" in block
    ]
    body = sample.replace("127.0.0.1:50051", served.address)
    namespace: dict[str, Any] = {}
    exec("async def call():\n" + "".join(f"    {line}\n" for line in body.splitlines()), namespace)
    await namespace["call"]()
    printed = capsys.readouterr().out
    assert printed.rstrip().rsplit("\n", 1)[-1].endswith(("LENGTH", "STOP")), printed


async def test_a_burst_through_the_launchers_full_stack_all_completes(
    engine: Any, ref: types.ModuleType, ref_grpc: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """300 calls at once over both protocols, seeded, with 121-token prompts, through the
    stack the launcher builds with tracing on (tracing, metrics, auth, the keyed call
    slots, the in-flight limit, in its order): every one completes, and nothing stays
    in flight."""
    from vllm_servicer.engine import served_model_name
    from vllm_servicer.interceptors import (
        AuthInterceptor,
        InflightInterceptor,
        MetricsInterceptor,
        TracingInterceptor,
    )
    from vllm_servicer.interceptors.call_slots import CallSlotsInterceptor
    from vllm_servicer.serve.args import parse_args
    from vllm_servicer.serve.stack import build_interceptors

    key = "burst-key-0123456789abcdef"
    # Spans go to an OTLP exporter as in production; nothing listens on port 9.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    argv = ["serve", "--model", "m", "--api-key", key, "--metrics-port", "0"]
    # As the launcher builds it: the model name is the engine's.
    stack, metrics = build_interceptors(parse_args(argv), model=served_model_name(engine))
    assert metrics is not None
    kinds = [type(i) for i in stack]
    assert kinds == [
        TracingInterceptor,
        MetricsInterceptor,
        AuthInterceptor,
        CallSlotsInterceptor,
        InflightInterceptor,
    ]
    prompt = [(7 * i + 3) % 240 + 3 for i in range(121)]

    async with serving(engine, interceptors=stack, services=SERVICES) as served:
        inference = ref_grpc.InferenceStub(served.channel)
        vllm_engine = vllm_engine_pb2_grpc.VllmEngineStub(served.channel)

        async def one(i: int) -> int:
            if i % 2:
                message = generate_request(ref, prompt[i % 7 :], 8, temperature=0.8)
                message.sampling.seed = i
                message.response.output_token_ids = True
                tokens = 0
                async for reply in inference.GenerateStream(
                    message, metadata=bearer(key), timeout=240
                ):
                    tokens += len(reply.outputs.token_ids)
                return tokens
            req = request(max_tokens=8, ignore_eos=True, temperature=0.8, seed=i, stream=True)
            req.tokenized.input_ids[:] = prompt[i % 7 :]
            replies = [
                r async for r in vllm_engine.Generate(req, metadata=bearer(key), timeout=240)
            ]
            return sum(len(r.chunk.token_ids) for r in replies if r.HasField("chunk"))

        assert await asyncio.gather(*(one(i) for i in range(300))) == [8] * 300
        assert served.mounted.inflight.limited_total == 0
        # Both protocols' tokens are counted (from the usage record each servicer keeps).
        generated = metrics.generation_tokens.labels(served_model_name(engine))._value.get()
        assert generated == 300 * 8
    await wait_until_idle(engine)
