"""Wire compatibility with vLLM's own gRPC protocol (reference: smg-grpc-proto 0.4.28).

Clients built for vLLM's `--grpc` server use the reference stubs; these tests
drive this server with exactly those stubs, and compare the two sets of
descriptors field by field.
"""

from __future__ import annotations

import time
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pb2

# Both sets of stubs in one process: the reference registers in protobuf's
# default pool, this package in its own, so neither import fails.
from smg_grpc_proto.generated import common_pb2 as ref_common
from smg_grpc_proto.generated import vllm_engine_pb2 as ref
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as ref_grpc
from support import wait_until_idle

from vllm_servicer.proto import common_pb2, vllm_engine_pb2


def _file_proto(module: Any) -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto()
    module.DESCRIPTOR.CopyToProto(proto)
    return proto


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [(vllm_engine_pb2, ref), (common_pb2, ref_common)],
    ids=["vllm_engine.proto", "common.proto"],
)
def test_descriptors_match_the_reference(ours: Any, theirs: Any) -> None:
    # Same file name, package, messages, fields (names, numbers, types, labels,
    # presence, oneofs), enums and services: the descriptors are equal as a whole.
    assert _file_proto(ours) == _file_proto(theirs)


def test_both_stub_sets_coexist_in_one_process() -> None:
    assert (
        ref.GenerateRequest.DESCRIPTOR.full_name
        == vllm_engine_pb2.GenerateRequest.DESCRIPTOR.full_name
    )
    assert ref.GenerateRequest is not vllm_engine_pb2.GenerateRequest
    message = vllm_engine_pb2.GenerateRequest(request_id="x", text="hi")
    assert ref.GenerateRequest.FromString(message.SerializeToString()).text == "hi"


@pytest.fixture
def ref_stub(channel: grpc.aio.Channel) -> Any:
    return ref_grpc.VllmEngineStub(channel)


def _ref_request(rid: str, stream: bool, **sampling: Any) -> Any:
    sampling.setdefault("temperature", 0.0)
    return ref.GenerateRequest(
        request_id=rid,
        tokenized=ref.TokenizedInput(input_ids=[5, 17, 42, 99]),
        sampling_params=ref.SamplingParams(**sampling),
        stream=stream,
    )


async def test_reference_generate_stream_and_unary(ref_stub: Any) -> None:
    streamed = [
        m
        async for m in ref_stub.Generate(_ref_request("ref-s", True, max_tokens=6, ignore_eos=True))
    ]
    unary = [
        m
        async for m in ref_stub.Generate(
            _ref_request("ref-u", False, max_tokens=6, ignore_eos=True)
        )
    ]
    tokens = [t for m in streamed if m.HasField("chunk") for t in m.chunk.token_ids]
    assert streamed[-1].complete.finish_reason == "length"
    assert [m.complete.output_ids for m in unary] == [tokens]


async def test_reference_unary_rpcs(ref_stub: Any, engine: Any) -> None:
    health = await ref_stub.HealthCheck(ref.HealthCheckRequest())
    assert health.healthy and health.message == "Health"

    info = await ref_stub.GetModelInfo(ref.GetModelInfoRequest())
    assert info.is_generation
    assert info.max_context_length == 512 == info.max_req_input_len
    assert info.vocab_size == engine.model_config.get_vocab_size()
    assert list(info.architectures) == ["LlamaForCausalLM"]
    assert info.model_type == "llama"
    assert info.served_model_name and info.tokenizer_path
    assert list(info.eos_token_ids) == [engine.model_config.hf_config.eos_token_id]
    assert info.default_sampling_params_json.startswith("{")

    server = await ref_stub.GetServerInfo(ref.GetServerInfoRequest())
    assert server.server_type == "vllm-grpc"
    assert server.uptime_seconds > 0
    assert server.last_receive_timestamp > 0  # earlier tests sent Generate calls
    assert server.active_requests == 0
    assert server.data_parallel_size == 1
    assert server.max_num_seqs > 0
    # A text model: no media of any kind, so no shared-memory transport either.
    assert (server.mm_item_limits, server.shm_namespace_id, server.mm_processor) == ("", "", "")
    # Read off the engine's configuration: float32, no reasoning parser (so a
    # grammar runs from the first token), the attention backend left to the worker.
    assert (server.multimodal_encoder_dtype, server.engine_reasoning_parser) == ("float32", "")
    assert (server.constrained_decoding_start, server.attention_backend) == ("first_token", "")
    assert not server.mm_device_do_normalize and server.mm_encoder_budget == 0

    await ref_stub.Abort(ref.AbortRequest(request_ids=["nobody"]))

    flushed = await ref_stub.FlushCache(ref_common.FlushCacheRequest())
    assert flushed.success


async def test_server_info_counts_active_requests(ref_stub: Any, engine: Any) -> None:
    sent = time.time()
    call = ref_stub.Generate(_ref_request("ref-active", True, max_tokens=5000, ignore_eos=True))
    await call.read()
    info = await ref_stub.GetServerInfo(ref.GetServerInfoRequest())
    assert info.active_requests == 1
    # Stamped when the call arrived, not when it ends.
    assert sent <= info.last_receive_timestamp <= time.time()
    call.cancel()
    assert await wait_until_idle(engine) == 0


def test_a_reasoning_engine_tells_routers_its_grammar_waits_for_the_thought() -> None:
    """What vLLM's structured-output config with a reasoning parser gives (the tiny
    model has no thinking tokens to build an engine with one)."""
    from types import SimpleNamespace

    from vllm.config import StructuredOutputsConfig

    from vllm_servicer.servicer.info import _engine_facts

    def facts(**structured: Any) -> dict[str, Any]:
        config = SimpleNamespace(structured_outputs_config=StructuredOutputsConfig(**structured))
        return _engine_facts(config)

    held = facts(reasoning_parser="deepseek_r1")
    assert (held["engine_reasoning_parser"], held["constrained_decoding_start"]) == (
        "deepseek_r1",
        "after_reasoning",
    )
    inside = facts(reasoning_parser="deepseek_r1", enable_in_reasoning=True)
    assert inside["constrained_decoding_start"] == "first_token"
    assert _engine_facts(SimpleNamespace())["constrained_decoding_start"] == ""  # unknown
