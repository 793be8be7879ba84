"""A mount's stream interval: fewer, larger messages for streamed generations.

`mount(stream_interval=N)` (the launcher's `--grpc-stream-interval`) hands
vLLM's per-request `stream_interval` to every streamed generation of both gRPC
protocols, from `stream_interval_min_inflight` engine calls in flight on. The
engine holds a stream's outputs until N new tokens are ready; the first and
the last leave at once. Over the session's real engine: the same tokens and
text in fewer messages, for vllm.Inference and VllmEngine alike.
"""

from __future__ import annotations

import types
from collections.abc import AsyncIterator
from typing import Any

import pytest
from support import request, serving
from vllm.sampling_params import RequestOutputKind, SamplingParams

from vllm_servicer import SERVICE_NAME
from vllm_servicer.options import MountOptions
from vllm_servicer.proto import INFERENCE_SERVICE, vllm_engine_pb2_grpc
from vllm_servicer.servicer.engine_call import EngineCallSteps
from vllm_servicer.servicer.tenancy import RunningRequests
from vllm_servicer.servicer.tenant_engine import TenantEngine
from vllm_servicer.testing.stand_in import StandInEngine

SERVICES = (SERVICE_NAME, INFERENCE_SERVICE)
TEXT = "the quick brown fox"
TOKENS = 14  # 1 at once, then 4, 4 and 4, then the last 1 with the finish


def _steps(in_flight: int, interval: int = 4, min_inflight: int = 3) -> EngineCallSteps:
    return EngineCallSteps(
        TenantEngine(StandInEngine(), RunningRequests()),
        stream_interval=interval,
        min_inflight=min_inflight,
        in_flight=lambda: in_flight,
    )


@pytest.mark.parametrize(
    ("in_flight", "kind", "expected"),
    [
        (3, RequestOutputKind.DELTA, 4),
        (9, RequestOutputKind.DELTA, 4),
        (2, RequestOutputKind.DELTA, None),
        (9, RequestOutputKind.FINAL_ONLY, None),
    ],
    ids=["at-the-threshold", "above-it", "below-it", "not-streamed"],
)
def test_the_interval_applies_to_streams_from_the_threshold_on(
    in_flight: int, kind: RequestOutputKind, expected: int | None
) -> None:
    sampling = SamplingParams(max_tokens=8, output_kind=kind)
    _steps(in_flight).pace(sampling)
    assert sampling.stream_interval == expected


def test_a_request_keeps_a_longer_interval_of_its_own() -> None:
    sampling = SamplingParams(max_tokens=8, output_kind=RequestOutputKind.DELTA, stream_interval=8)
    _steps(5).pace(sampling)
    assert sampling.stream_interval == 8


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"stream_interval": 0}, "stream_interval must be at least 1"),
        ({"stream_interval_min_inflight": -1}, "stream_interval_min_inflight must be 0 or more"),
    ],
)
def test_out_of_range_options_are_refused(fields: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MountOptions.of(**fields)


# ----- over the real engine ----------------------------------------------------------------


@pytest.fixture(scope="module")
async def every_step(engine: Any) -> AsyncIterator[Any]:
    async with serving(engine, services=SERVICES) as served:
        yield served


@pytest.fixture(scope="module")
async def gathered(engine: Any) -> AsyncIterator[Any]:
    # A threshold of one call in flight: any stream, the one asking included.
    async with serving(
        engine, services=SERVICES, stream_interval=4, stream_interval_min_inflight=1
    ) as served:
        yield served


def _inference_request(ref: types.ModuleType) -> Any:
    message = ref.GenerateRequest(text=TEXT)
    message.stopping.max_new_tokens = TOKENS
    message.stopping.ignore_eos = True
    message.response.output_token_ids = True
    return message


def _sizes_gathered_by_four(sizes: list[int]) -> None:
    assert sum(sizes) == TOKENS
    assert sizes[0] == 1  # the first token leaves at once (time to first token unchanged)
    # Then at least 4 a message (more only when the reader fell behind); the last holds the rest.
    assert all(n >= 4 for n in sizes[1:-1]) and 1 <= sizes[-1]
    assert len(sizes) <= 5


async def test_inference_streams_the_same_tokens_in_fewer_messages(
    every_step: Any, gathered: Any, ref: types.ModuleType, ref_grpc: types.ModuleType
) -> None:
    message = _inference_request(ref)
    every = [m async for m in ref_grpc.InferenceStub(every_step.channel).GenerateStream(message)]
    fewer = [m async for m in ref_grpc.InferenceStub(gathered.channel).GenerateStream(message)]
    assert fewer[0].HasField("prompt_info")
    deltas = [m.outputs for m in fewer[1:]]
    _sizes_gathered_by_four([d.num_tokens for d in deltas])
    assert all(d.num_tokens == len(d.token_ids) for d in deltas)
    assert deltas[-1].finish_info.num_output_tokens == TOKENS
    assert [t for d in deltas for t in d.token_ids] == [
        t for m in every[1:] for t in m.outputs.token_ids
    ]
    assert "".join(d.text for d in deltas) == "".join(m.outputs.text for m in every[1:])


async def test_vllm_engine_streams_the_same_tokens_in_fewer_chunks(
    every_step: Any, gathered: Any
) -> None:
    message = request(TEXT, stream=True, max_tokens=TOKENS, ignore_eos=True)

    async def chunks(served: Any) -> tuple[list[list[int]], Any]:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(served.channel)
        replies = [m async for m in stub.Generate(message)]
        return [list(m.chunk.token_ids) for m in replies if m.HasField("chunk")], replies[-1]

    every, every_complete = await chunks(every_step)
    fewer, complete = await chunks(gathered)
    _sizes_gathered_by_four([len(c) for c in fewer])
    assert [t for c in fewer for t in c] == [t for c in every for t in c]
    assert complete.complete.finish_reason == every_complete.complete.finish_reason == "length"
