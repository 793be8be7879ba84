"""The request-to-engine conversion of fields whose effect a default engine cannot show."""

from __future__ import annotations

import json

import pytest
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.v1.metrics.stats import RequestSpecDecodeMetrics

from vllm_servicer import convert
from vllm_servicer.errors import InvalidRequestError
from vllm_servicer.fields import is_set
from vllm_servicer.proto import vllm_engine_pb2 as pb


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
    params = convert.kv_transfer_params(req)
    assert params == expected
    sampling = convert.sampling_params_from_proto(
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
        convert.kv_transfer_params(req)
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
    complete = convert.ResponseBuilder(pb.SamplingParams()).complete(output, output.outputs[0])
    done = complete.complete
    assert json.loads(done.kv_transfer_params_json) == kv
    assert (done.kv_transfer_params.remote_host, done.kv_transfer_params.remote_port) == (
        "10.0.0.2",
        7000,
    )
    assert (done.spec_accepted_tokens, done.spec_draft_tokens) == (0 + 2 + 9, 14)


def test_params_without_a_host_leave_the_typed_message_unset() -> None:
    output = _finished({"do_remote_decode": True}, None)
    done = convert.ResponseBuilder(pb.SamplingParams()).complete(output, output.outputs[0]).complete
    assert json.loads(done.kv_transfer_params_json) == {"do_remote_decode": True}
    assert not done.HasField("kv_transfer_params")
    assert (done.spec_accepted_tokens, done.spec_draft_tokens) == (0, 0)


def test_grammar_from_first_token_needs_a_constraint() -> None:
    assert not convert.grammar_from_first_token(pb.SamplingParams(grammar_from_first_token=True))
    assert convert.grammar_from_first_token(
        pb.SamplingParams(grammar_from_first_token=True, regex="a+")
    )
    assert not convert.grammar_from_first_token(pb.SamplingParams(regex="a+"))


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
