"""Conversion on its own, with no server and no engine.

Wire requests in, vLLM params out; vLLM outputs in, wire messages out.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind
from vllm.v1.metrics.stats import RequestSpecDecodeMetrics

from vllm_servicer.errors import InvalidRequestError
from vllm_servicer.proto import vllm_engine_pb2 as pb
from vllm_servicer.wire import vllm_engine
from vllm_servicer.wire.fields import is_set


def _request(json_text: str | None = None, host: str = "", port: int = 0) -> pb.GenerateRequest:
    req = pb.GenerateRequest()
    if json_text is not None:
        req.kv_transfer_params_json = json_text
    if host or port:
        req.kv_transfer_params.remote_host, req.kv_transfer_params.remote_port = host, port
    return req


@pytest.mark.parametrize(
    ("req", "expected"),
    [
        (_request(), None),
        (_request("{}"), None),  # nothing to hand over
        (_request('{"do_remote_prefill": true, "b": [1]}'), {"do_remote_prefill": True, "b": [1]}),
        (_request(host="h", port=1), {"remote_host": "h", "remote_port": 1}),
        (
            _request('{"remote_block_ids": [4]}', "h", 9),
            {"remote_host": "h", "remote_port": 9, "remote_block_ids": [4]},
        ),
        (_request('{"remote_port": 9}', "h", 9), {"remote_host": "h", "remote_port": 9}),
    ],
)
def test_kv_transfer_params_reach_extra_args(
    req: pb.GenerateRequest, expected: dict[str, object] | None
) -> None:
    params = vllm_engine.kv_transfer_params(req)
    assert params == expected
    sampling = vllm_engine.sampling_params_from_proto(
        pb.SamplingParams(), stream=False, kv_transfer=params
    )
    assert sampling.extra_args == ({"kv_transfer_params": expected} if expected else None)


@pytest.mark.parametrize(
    ("req", "field"),
    [
        (_request("{"), "kv_transfer_params_json"),
        (_request('"text"'), "kv_transfer_params_json"),
        (_request(host="h"), "kv_transfer_params"),
        (_request(port=80), "kv_transfer_params"),
        (_request('{"remote_host": "g"}', "h", 9), "kv_transfer_params.remote_host"),
    ],
)
def test_bad_kv_transfer_params_name_the_field(req: pb.GenerateRequest, field: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        vllm_engine.kv_transfer_params(req)
    assert err.value.field == field


def _finished(kv: dict[str, object] | None, spec: RequestSpecDecodeMetrics | None) -> RequestOutput:
    completion = CompletionOutput(
        index=0, text="", token_ids=[4, 5], cumulative_logprob=None, logprobs=None
    )
    completion.finish_reason = "length"
    completion.spec_decode_metrics = spec
    return RequestOutput(
        request_id="r",
        prompt=None,
        prompt_token_ids=[1, 2, 3],
        prompt_logprobs=None,
        outputs=[completion],
        finished=True,
        kv_transfer_params=kv,
    )


def test_the_complete_carries_the_engines_kv_params_and_spec_counts() -> None:
    spec = RequestSpecDecodeMetrics(num_spec_tokens=3, histogram=[1, 0, 1, 3], num_draft_tokens=14)
    kv = {"remote_host": "10.0.0.2", "remote_port": 7000, "remote_block_ids": [1, 2]}
    output = _finished(kv, spec)
    complete = vllm_engine.ResponseBuilder(pb.SamplingParams()).complete(output, output.outputs[0])
    done = complete.complete
    assert json.loads(done.kv_transfer_params_json) == kv
    assert (done.kv_transfer_params.remote_host, done.kv_transfer_params.remote_port) == (
        "10.0.0.2",
        7000,
    )
    assert (done.spec_accepted_tokens, done.spec_draft_tokens) == (0 + 2 + 9, 14)


def test_params_without_a_host_leave_the_typed_message_unset() -> None:
    output = _finished({"do_remote_decode": True}, None)
    done = (
        vllm_engine.ResponseBuilder(pb.SamplingParams())
        .complete(output, output.outputs[0])
        .complete
    )
    assert json.loads(done.kv_transfer_params_json) == {"do_remote_decode": True}
    assert not done.HasField("kv_transfer_params")
    assert (done.spec_accepted_tokens, done.spec_draft_tokens) == (0, 0)


def test_grammar_from_first_token_needs_a_constraint() -> None:
    assert not vllm_engine.grammar_from_first_token(
        pb.SamplingParams(grammar_from_first_token=True)
    )
    assert vllm_engine.grammar_from_first_token(
        pb.SamplingParams(grammar_from_first_token=True, regex="a+")
    )
    assert not vllm_engine.grammar_from_first_token(pb.SamplingParams(regex="a+"))


def test_presence_follows_each_kind_of_field() -> None:
    req = pb.GenerateRequest()
    assert not any(is_set(req, p) for p in ("mm_inputs", "extra_mm_inputs", "media_refs", "stream"))
    req.mm_inputs.SetInParent()  # present though empty
    req.extra_mm_inputs.add()
    req.stream = True
    assert all(is_set(req, p) for p in ("mm_inputs", "extra_mm_inputs", "stream"))
    assert not is_set(req, "sampling_params.temperature")
    req.sampling_params.temperature = 0.0  # optional: set, though zero
    assert is_set(req, "sampling_params.temperature")


# ----- proto in, vLLM params out ----------------------------------------------------------


def test_unset_sampling_fields_take_the_neutral_values() -> None:
    params = vllm_engine.sampling_params_from_proto(pb.SamplingParams(), stream=False)
    assert (params.temperature, params.top_p, params.repetition_penalty, params.n) == (1, 1, 1, 1)
    assert (params.max_tokens, params.seed, params.logprobs, params.stop) == (None, None, None, [])
    assert params.structured_outputs is None and params.extra_args is None
    assert params.output_kind == RequestOutputKind.FINAL_ONLY
    assert not params.detokenize  # token ids out: no text unless a stop string needs it


def test_set_sampling_fields_reach_vllm() -> None:
    wire = pb.SamplingParams(
        temperature=0.7,
        top_p=0.5,
        top_k=7,
        max_tokens=9,
        stop=["\n\n"],
        stop_token_ids=[2],
        n=2,
        seed=3,
        logprobs=4,
        logit_bias={5: -1.5},
        regex="(ab)+",
    )
    params = vllm_engine.sampling_params_from_proto(wire, stream=True)
    assert (params.top_p, params.top_k, params.max_tokens) == (0.5, 7, 9)
    assert params.temperature == pytest.approx(0.7)  # a float32 on the wire
    assert (params.stop, params.stop_token_ids, params.n, params.seed) == (["\n\n"], [2], 2, 3)
    assert params.logprobs == 4 and params.logit_bias == {5: -1.5}
    assert params.structured_outputs is not None and params.structured_outputs.regex == "(ab)+"
    assert params.detokenize  # a stop string is matched on text
    assert params.output_kind == RequestOutputKind.DELTA


@pytest.mark.parametrize(
    ("wire", "field"),
    [
        (pb.SamplingParams(temperature=float("nan")), "sampling_params.temperature"),
        (pb.SamplingParams(top_p=float("inf")), "sampling_params.top_p"),
        (pb.SamplingParams(logit_bias={9: float("-inf")}), "sampling_params.logit_bias[9]"),
        (pb.SamplingParams(choice=pb.ChoiceConstraint()), "sampling_params.choice.choices"),
    ],
)
def test_values_vllm_cannot_take_are_refused_naming_the_field(
    wire: pb.SamplingParams, field: str
) -> None:
    with pytest.raises(InvalidRequestError) as err:
        vllm_engine.sampling_params_from_proto(wire, stream=False)
    assert err.value.field == field


def test_a_token_prompt_keeps_its_text_and_is_refused_past_the_context() -> None:
    req = pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=[5, 6, 7], original_text="hi"))
    assert vllm_engine.prompt_from_request(req, max_prompt_tokens=3) == {
        "prompt_token_ids": [5, 6, 7],
        "prompt": "hi",
    }
    with pytest.raises(InvalidRequestError, match="prompt length 3 is longer than .* 2"):
        vllm_engine.prompt_from_request(req, max_prompt_tokens=2)
    with pytest.raises(InvalidRequestError, match="set either"):
        vllm_engine.prompt_from_request(pb.GenerateRequest())


# ----- vLLM outputs in, messages out -------------------------------------------------------


def _step(token_ids: list[int], *, index: int = 0, logprobs: Any = None) -> RequestOutput:
    completion = CompletionOutput(
        index=index,
        text="",
        token_ids=token_ids,
        cumulative_logprob=None,
        logprobs=logprobs,
        finish_reason=None,
    )
    return RequestOutput(
        request_id="r",
        prompt=None,
        prompt_token_ids=[1, 2, 3, 4],
        prompt_logprobs=None,
        outputs=[completion],
        finished=False,
        num_cached_tokens=2,
    )


def test_a_stream_chunk_carries_the_steps_tokens_and_no_zero_fields() -> None:
    builder = vllm_engine.ResponseBuilder(pb.SamplingParams())
    output = _step([10, 11])
    chunk = builder.chunk(output, output.outputs[0]).chunk
    assert (list(chunk.token_ids), chunk.prompt_tokens, chunk.completion_tokens) == ([10, 11], 4, 2)
    assert (chunk.cached_tokens, chunk.index) == (2, 0)
    assert not chunk.HasField("output_logprobs")
    second = _step([12], index=1)
    assert builder.chunk(second, second.outputs[0]).chunk.index == 1


def test_logprobs_are_sent_for_the_sampled_token_and_the_top_k_asked_for() -> None:
    step = {10: Logprob(-0.5), 20: Logprob(-1.0), 30: Logprob(-2.0)}
    output = _step([10], logprobs=[step])
    builder = vllm_engine.ResponseBuilder(pb.SamplingParams(logprobs=2))
    lps = builder.chunk(output, output.outputs[0]).chunk.output_logprobs
    assert (list(lps.token_ids), list(lps.token_logprobs)) == ([10], [-0.5])
    top = lps.top_logprobs[0]
    assert (list(top.token_ids), list(top.values)) == ([10, 20], [-0.5, -1.0])


def test_a_stop_string_or_token_is_named_in_the_complete() -> None:
    output = _step([10, 11])
    completion = output.outputs[0]
    completion.finish_reason, completion.stop_reason = "stop", "\n\n"
    done = vllm_engine.ResponseBuilder(pb.SamplingParams()).complete(output, completion).complete
    assert (done.finish_reason, done.matched_stop_str, list(done.output_ids)) == (
        "stop",
        "\n\n",
        [10, 11],
    )
    completion.stop_reason = 2
    done = vllm_engine.ResponseBuilder(pb.SamplingParams()).complete(output, completion).complete
    assert done.WhichOneof("matched_stop") == "matched_token_id" and done.matched_token_id == 2
