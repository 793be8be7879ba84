"""`SequenceOutput.sampling_mask` of vLLM's released schema, from vLLM's own outputs.

vLLM captures the mask (the token ids each sampled position could have taken
after top-k, top-p and min-p) only in its GPU model runner, with
`--return-sampling-mask`; its CPU runner has no such capture, so no engine
here produces one. These tests hand `wire.inference_responses.ResponseBuilder` vLLM's
own `RequestOutput`, `CompletionOutput` and `SamplingMask` as that runner's
output processor builds them: one mask per engine step of a stream, the
whole mask in a unary call's one output. On a GPU host:
`vllm serve MODEL --return-sampling-mask` and a GenerateStream shows it.
"""

from __future__ import annotations

from vllm.outputs import CompletionOutput, RequestOutput, SamplingMask

from vllm_servicer.proto import inference_pb2 as pb
from vllm_servicer.wire.inference_responses import ResponseBuilder


def _output(tokens: list[int], mask: list[list[int]] | None, finished: bool) -> RequestOutput:
    completion = CompletionOutput(
        index=0,
        text="",
        token_ids=tokens,
        cumulative_logprob=None,
        logprobs=None,
        finish_reason="length" if finished else None,
        sampling_mask=SamplingMask(mask) if mask is not None else None,
    )
    return RequestOutput(
        request_id="r",
        prompt=None,
        prompt_token_ids=[1, 2, 3],
        prompt_logprobs=None,
        outputs=[completion],
        finished=finished,
    )


def test_a_streams_masks_are_sent_whole_with_its_finish() -> None:
    builder = ResponseBuilder(pb.ResponseOptions(output_token_ids=True))
    steps = [
        _output([7], [[7, 9]], finished=False),
        _output([8, 4], [[8], [4, 5, 6]], finished=True),
    ]
    messages = [builder.delta(step, step.outputs[0]) for step in steps]
    assert not messages[0].outputs.sampling_mask  # the schema sends it at the end
    assert [list(m.ids) for m in messages[1].outputs.sampling_mask] == [[7, 9], [8], [4, 5, 6]]
    assert messages[1].outputs.finish_info.num_output_tokens == 3


def test_a_unary_calls_mask_is_its_outputs() -> None:
    output = _output([7, 8], [[7, 9], [8]], finished=True)
    reply = ResponseBuilder(pb.ResponseOptions()).whole(output)
    assert [list(m.ids) for m in reply.outputs.sampling_mask] == [[7, 9], [8]]


def test_no_mask_when_the_engine_captures_none() -> None:
    output = _output([7, 8], None, finished=True)
    assert not ResponseBuilder(pb.ResponseOptions()).whole(output).outputs.sampling_mask
