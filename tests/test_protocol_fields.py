"""No request field is ignored: each is honoured, or refused with a typed status naming it.

The inventory walks each protocol's own descriptors (VllmEngine and
vllm.Inference), so a field added to a protocol fails here until
`vllm_servicer.wire.fields` says what happens to it. Every VllmEngine refusal
is then shown over a real channel against the session's real engine (those of
vllm.Inference in test_inference.py),
and the prefill/decode hand-off and speculative counts against the session's
engine with a KV connector and n-gram speculative decoding (`kv_echo_engine`).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import Descriptor
from support import collect, completes, error_info, request, serving, wait_until_idle
from support.kv_echo_connector import FINISHED_LOG

from vllm_servicer import vllm_releases
from vllm_servicer.proto import (
    INFERENCE_SERVICE,
    POOLING_SERVICE,
    RENDER_SERVICE,
    SERVICE_NAME,
    common_pb2,
    inference_pb2,
    pooling_pb2,
    render_pb2,
    vllm_engine_pb2,
    vllm_engine_pb2_grpc,
)
from vllm_servicer.proto import vllm_engine_pb2 as pb
from vllm_servicer.vllm_releases import start_profile_options
from vllm_servicer.wire.fields import HONOURED, REFUSED

# Every protocol service the package serves requests of, by full name.
SERVICES = {
    SERVICE_NAME: vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"],
    INFERENCE_SERVICE: inference_pb2.DESCRIPTOR.services_by_name["Inference"],
    POOLING_SERVICE: pooling_pb2.DESCRIPTOR.services_by_name["Pooling"],
    RENDER_SERVICE: render_pb2.DESCRIPTOR.services_by_name["Render"],
}
PROTOCOL_DOC = Path(__file__).resolve().parent.parent / "docs" / "protocol.md"
# Where the page's vllm.Inference section starts: its table has no RPC column
# (both of its methods take the same request).
INFERENCE_HEADING = "## vllm.Inference"
# Where the section of the package's own services starts (after vllm.Inference's).
OWN_SERVICES_HEADING = "## vllm_servicer.v1.Pooling and Render"


def _paths(message: Descriptor, refused: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    """Every field path of `message` a client can set, down through honoured sub-messages."""
    for field in message.fields:
        path = prefix + field.name
        yield path
        sub = field.message_type
        if sub is None or sub.GetOptions().map_entry or path in refused:
            continue  # a map is one field; nothing inside a refused message is read
        yield from _paths(sub, refused, path + ".")


@pytest.mark.parametrize("service", list(SERVICES))
def test_every_request_field_is_honoured_or_refused(service: str) -> None:
    methods = SERVICES[service].methods_by_name
    honoured_by, refused_by = HONOURED.get(service, {}), REFUSED.get(service, {})
    assert set(honoured_by) | set(refused_by) == set(methods)
    for name, method in methods.items():
        honoured = honoured_by.get(name, frozenset())
        refused = refused_by.get(name, {})
        assert not honoured & set(refused), f"{name}: both honoured and refused"
        fields = set(_paths(method.input_type, refused))
        unlisted = fields - honoured - set(refused)
        assert not unlisted, f"{name}: fields neither honoured nor refused: {unlisted}"
        stale = (honoured | set(refused)) - fields
        assert not stale, f"{name}: listed but not in the protocol: {stale}"


def _table(service: str, method: str) -> dict[str, str]:
    """What the field table says of each field of one method: "honoured" or the code."""
    rows = {path: "honoured" for path in HONOURED[service].get(method, ())}
    rows |= {p: r.error.status_code for p, r in REFUSED.get(service, {}).get(method, {}).items()}
    return rows


def test_the_protocol_page_shows_the_same_tables() -> None:
    engine_part, _, inference_part = PROTOCOL_DOC.read_text().partition(INFERENCE_HEADING)
    inference_part, _, own_part = inference_part.partition(OWN_SERVICES_HEADING)
    assert own_part, f"no {OWN_SERVICES_HEADING!r} section"
    rows = re.findall(r"^\| (\w+) \| `([\w.]+)` \| (honoured|refused: `(\w+)`)", own_part, re.M)
    documented_own = {(method, path): code or "honoured" for method, path, _, code in rows}
    assert documented_own == {
        (method, path): handling
        for service in (POOLING_SERVICE, RENDER_SERVICE)
        for method in SERVICES[service].methods_by_name
        for path, handling in _table(service, method).items()
    }
    assert inference_part, f"no {INFERENCE_HEADING!r} section"
    rows = re.findall(r"^\| (\w+) \| `([\w.]+)` \| (honoured|refused: `(\w+)`)", engine_part, re.M)
    documented = {(method, path): code or "honoured" for method, path, _, code in rows}
    expected = {
        (method, path): handling
        for method in SERVICES[SERVICE_NAME].methods_by_name
        for path, handling in _table(SERVICE_NAME, method).items()
    }
    assert documented == expected
    rows = re.findall(r"^\| `([\w.]+)` \| (honoured|refused: `(\w+)`)", inference_part, re.M)
    documented_inference = {path: code or "honoured" for path, _, code in rows}
    for method in SERVICES[INFERENCE_SERVICE].methods_by_name:
        assert documented_inference == _table(INFERENCE_SERVICE, method), method


# ----- every refusal, over the wire ----------------------------------------------------------


def _generate(build: Callable[[pb.GenerateRequest], Any]) -> Callable[[Any], Awaitable[Any]]:
    def call(stub: Any) -> Awaitable[Any]:
        req = request(max_tokens=2)
        build(req)
        return collect(stub.Generate(req, timeout=30))

    return call


def _remote_pixels(inputs: pb.MultimodalInputs) -> None:
    inputs.pixel_values.remote.transport = "nixl"
    inputs.pixel_values.shape.extend([1, 3, 2, 2])
    inputs.pixel_values.dtype = "uint8"
    inputs.mm_placeholders.add(offset=0, length=1)


def _shm_pixels(inputs: pb.MultimodalInputs) -> None:
    inputs.pixel_values.shm.name = "/any-segment-of-this-host"
    inputs.pixel_values.shm.nbytes = 12
    inputs.pixel_values.shape.extend([1, 3, 2, 2])
    inputs.pixel_values.dtype = "uint8"
    inputs.mm_placeholders.add(offset=0, length=1)


# One call per REFUSED row: (the call, what else its message must say).
REFUSALS: dict[tuple[str, str], tuple[Callable[[Any], Awaitable[Any]], str]] = {
    ("Generate", "mm_inputs.pixel_values.remote"): (
        _generate(lambda r: _remote_pixels(r.mm_inputs)),
        "inline",
    ),
    ("Generate", "extra_mm_inputs.pixel_values.remote"): (
        _generate(lambda r: _remote_pixels(r.extra_mm_inputs.add())),
        "inline",
    ),
    ("Generate", "mm_inputs.pixel_values.shm"): (
        _generate(lambda r: _shm_pixels(r.mm_inputs)),
        "--enable-shm-tensors",
    ),
    ("Generate", "extra_mm_inputs.pixel_values.shm"): (
        _generate(lambda r: _shm_pixels(r.extra_mm_inputs.add())),
        "--enable-shm-tensors",
    ),
    ("Generate", "media_refs"): (
        _generate(lambda r: r.media_refs.items.add(url="https://example.com/a.png")),
        "--enable-media-refs",
    ),
    ("Generate", "kv_transfer_params"): (
        _generate(
            lambda r: r.kv_transfer_params.MergeFrom(
                pb.KvTransferParams(remote_host="10.0.0.2", remote_port=7000)
            )
        ),
        "--kv-transfer-config",
    ),
    ("Generate", "kv_transfer_params_json"): (
        _generate(lambda r: setattr(r, "kv_transfer_params_json", '{"do_remote_prefill": true}')),
        "--kv-transfer-config",
    ),
    ("StartProfile", "output_dir"): (
        lambda s: s.StartProfile(common_pb2.StartProfileRequest(output_dir="/tmp/traces")),
        "--profiler-config",
    ),
    ("StartProfile", "activities"): (
        lambda s: s.StartProfile(common_pb2.StartProfileRequest(activities=["CPU"])),
        "--profiler-config",
    ),
    ("StartProfile", "with_stack"): (
        lambda s: s.StartProfile(common_pb2.StartProfileRequest(with_stack=False)),
        "--profiler-config",
    ),
    ("StartProfile", "record_shapes"): (
        lambda s: s.StartProfile(common_pb2.StartProfileRequest(record_shapes=True)),
        "--profiler-config",
    ),
    ("StartProfile", "profile_by_stage"): (
        lambda s: s.StartProfile(common_pb2.StartProfileRequest(profile_by_stage=True)),
        "not supported",
    ),
}
# Refused only on vLLM before 0.33, whose profiler takes no per-session options.
PER_SESSION_FROM_033 = {("StartProfile", "with_stack"), ("StartProfile", "record_shapes")}
# Refusals that need an engine feature the session's engine lacks, shown over
# the wire in their own module.
REFUSALS_ELSEWHERE = {
    # On an engine that publishes KV events without a replay buffer.
    ("SubscribeKvEvents", "start_sequence_number"): "test_kv_events.py",
}


def _unindexed(path: str) -> str:
    return re.sub(r"\[\d+\]", "", path)


def test_every_refusal_has_a_wire_test() -> None:
    shown = set(REFUSALS) | set(REFUSALS_ELSEWHERE)
    assert shown == {(m, p) for m, rows in REFUSED[SERVICE_NAME].items() for p in rows}


@pytest.mark.parametrize(("method", "path"), list(REFUSALS), ids=lambda v: v)
async def test_a_refused_field_is_refused_with_its_code_and_name(
    method: str, path: str, stub: Any, engine: Any
) -> None:
    call, words = REFUSALS[(method, path)]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call(stub)
    if (method, path) in PER_SESSION_FROM_033 and "profiler_kwargs" in start_profile_options(
        engine.start_profile
    ):
        # Taken per session on this vLLM: what stops it is the engine's lack of a profiler.
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
        assert "--profiler-config" in (err.value.details() or "")
        return
    expected = grpc.StatusCode[REFUSED[SERVICE_NAME][method][path].error.status_code]
    assert err.value.code() == expected, err.value.details()
    details = err.value.details() or ""
    # The message names the item of a repeated field ("extra_mm_inputs[0]..."); the table does not.
    assert _unindexed(details).startswith(f"{path}: ") and words in details, details
    info = error_info(err.value)
    assert (_unindexed(info.metadata["field"]), info.metadata["method"]) == (path, method)
    assert await wait_until_idle(engine) == 0


@pytest.mark.parametrize(
    ("build", "code", "field"),
    [
        pytest.param(
            lambda r: r.mm_inputs.SetInParent(),
            grpc.StatusCode.FAILED_PRECONDITION,
            "mm_inputs",
            id="empty mm_inputs",
        ),
        pytest.param(
            lambda r: r.extra_mm_inputs.add(),
            grpc.StatusCode.FAILED_PRECONDITION,
            "extra_mm_inputs[0]",
            id="empty extra_mm_inputs",
        ),
        pytest.param(
            lambda r: r.media_refs.SetInParent(),
            grpc.StatusCode.UNIMPLEMENTED,
            "media_refs",
            id="empty media_refs",
        ),
    ],
)
async def test_a_multimodal_message_is_refused_by_a_text_model_when_present_even_empty(
    build: Callable[[pb.GenerateRequest], None], code: grpc.StatusCode, field: str, stub: Any
) -> None:
    """This engine's model takes no images, whatever the message holds."""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _generate(build)(stub)
    assert err.value.code() == code
    assert (err.value.details() or "").startswith(f"{field}: "), err.value.details()


@pytest.mark.parametrize(
    ("json_text", "typed", "field"),
    [
        ("{nope", None, "kv_transfer_params_json"),
        ("[1, 2]", None, "kv_transfer_params_json"),
        (None, ("", 7000), "kv_transfer_params"),
        (None, ("10.0.0.2", 0), "kv_transfer_params"),
        ('{"remote_port": 7001}', ("10.0.0.2", 7000), "kv_transfer_params.remote_port"),
    ],
)
async def test_malformed_kv_transfer_params_are_invalid_whatever_the_engine(
    json_text: str | None, typed: tuple[str, int] | None, field: str, stub: Any
) -> None:
    req = request(max_tokens=2)
    if json_text is not None:
        req.kv_transfer_params_json = json_text
    if typed is not None:
        req.kv_transfer_params.remote_host, req.kv_transfer_params.remote_port = typed
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub.Generate(req, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith(f"{field}: ")


# ----- honoured fields that had nothing to show before ---------------------------------------


@pytest.mark.parametrize(
    "include",
    [[], ["core"], ["all"], ["core", "all"], ["core", "disagg", "queues", "memory"]],
    ids=["none", "core", "all", "core+all", "the SMG gateway's poll"],
)
async def test_the_load_sections_clients_name_are_answered_with_the_core(
    include: list[str], stub: Any
) -> None:
    reply = await stub.GetLoads(pb.GetLoadsRequest(include=include))
    assert reply.dp_rank_count == 1


async def test_a_load_section_no_client_names_is_refused_by_name(stub: Any) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.GetLoads(pb.GetLoadsRequest(include=["core", "memroy"]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == (
        "include: no section 'memroy'; the sections are core, memory, spec, lora, disagg, "
        "queues, all"
    )


async def test_vision_is_not_advertised(stub: Any) -> None:
    assert not (await stub.GetModelInfo(pb.GetModelInfoRequest())).supports_vision


async def test_grammar_from_first_token_constrains_from_the_first_token(stub: Any) -> None:
    """Without a reasoning parser vLLM starts a grammar at once: set or not, the same tokens."""
    outputs = []
    for first in (False, True):
        req = request(max_tokens=6, regex="(ab|cd){3}", grammar_from_first_token=first)
        outputs.append(list(completes(await collect(stub.Generate(req, timeout=60)))[0].output_ids))
    assert outputs[0] == outputs[1] and outputs[0]


# ----- an engine with a KV connector and speculative decoding --------------------------------


@pytest.fixture(scope="module")
async def handoff(
    kv_echo_engine: Any, kv_echo_storage: Path
) -> AsyncIterator[tuple[Any, Path, Any]]:
    """A stub on the engine with the echoing KV connector and n-gram speculative
    decoding, its connector's log folder, and the engine."""
    async with serving(kv_echo_engine, health=False, reflection_service=False) as served:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(served.channel)
        yield stub, kv_echo_storage, kv_echo_engine


REPEATING = [5, 6, 7] * 6  # n-gram lookup finds drafts in a repeating prompt


@pytest.mark.parametrize("stream", [False, True])
async def test_kv_transfer_params_reach_the_connector_and_come_back(
    handoff: tuple[Any, Path, Any], stream: bool
) -> None:
    stub, _, _ = handoff
    sent = {"do_remote_decode": True, "remote_host": "10.0.0.2", "remote_port": 7000, "ids": [1]}
    req = request(REPEATING, max_tokens=4, stream=stream)
    req.kv_transfer_params_json = json.dumps(sent)
    req.kv_transfer_params.remote_host, req.kv_transfer_params.remote_port = "10.0.0.2", 7000
    done = completes(await collect(stub.Generate(req, timeout=60)))[0]
    assert json.loads(done.kv_transfer_params_json) == {**sent, "echoed_by": "EchoConnector"}
    assert (done.kv_transfer_params.remote_host, done.kv_transfer_params.remote_port) == (
        "10.0.0.2",
        7000,
    )


async def test_typed_kv_transfer_params_alone_reach_the_connector(
    handoff: tuple[Any, Path, Any],
) -> None:
    stub, _, _ = handoff
    req = request(max_tokens=2)
    req.kv_transfer_params.remote_host, req.kv_transfer_params.remote_port = "10.0.0.3", 7001
    done = completes(await collect(stub.Generate(req, timeout=60)))[0]
    assert json.loads(done.kv_transfer_params_json) == {
        "remote_host": "10.0.0.3",
        "remote_port": 7001,
        "echoed_by": "EchoConnector",
    }


async def test_a_rejected_remote_prefill_request_is_reported_to_the_connector(
    handoff: tuple[Any, Path, Any],
) -> None:
    """The prefill side would otherwise hold the request's blocks until its lease ran out."""
    stub, storage, _ = handoff
    req = request(max_tokens=2, temperature=-1.0, request_id="rejected-decode")
    req.kv_transfer_params_json = '{"do_remote_prefill": true, "remote_block_ids": [3]}'
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub.Generate(req, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    log = storage / FINISHED_LOG
    told: list[Any] = []
    for _ in range(100):  # the engine core runs the connector's hook on its next step
        lines = log.read_text().splitlines() if log.exists() else []
        told = [e for e in map(json.loads, lines) if e["request_id"] == "rejected-decode"]
        if told:
            break
        await asyncio.sleep(0.05)
    assert [e["params"] for e in told] == [{"do_remote_prefill": True, "remote_block_ids": [3]}]


async def _connector_told(storage: Path, request_id: str, settle_s: float) -> list[Any]:
    log = storage / FINISHED_LOG
    await asyncio.sleep(settle_s)  # the engine core runs the connector's hook on its next steps
    lines = log.read_text().splitlines() if log.exists() else []
    return [e["params"] for e in map(json.loads, lines) if e["request_id"] == request_id]


async def test_a_paused_engine_tells_the_connector_of_a_rejection_once(
    handoff: tuple[Any, Path, Any],
) -> None:
    """vLLM 0.33 rejects a request while paused: the connector hears of it once
    (from the servicer: the engine's own abort path does not reach its hook),
    neither twice nor never."""
    stub, storage, engine = handoff
    req = request(max_tokens=2, request_id="paused-decode")
    req.kv_transfer_params_json = '{"do_remote_prefill": true, "remote_block_ids": [4]}'
    await engine.pause_generation(mode="abort", clear_cache=False)
    try:
        call = stub.Generate(req, timeout=30)
        if vllm_releases.PAUSE_REJECTS:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(call)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
        else:
            # Before 0.33 the request waits for the resume: nothing is rejected.
            pending = asyncio.ensure_future(collect(call))
            await asyncio.sleep(1.0)
            assert not pending.done()
            assert await _connector_told(storage, "paused-decode", 0) == []
    finally:
        await engine.resume_generation()
    if not vllm_releases.PAUSE_REJECTS:
        completes(await pending)
        return
    told = await _connector_told(storage, "paused-decode", 2.0)
    assert told == [{"do_remote_prefill": True, "remote_block_ids": [4]}]


@pytest.mark.parametrize("stream", [False, True])
async def test_speculative_counts_come_from_the_engine(
    handoff: tuple[Any, Path, Any], stream: bool
) -> None:
    stub, _, _ = handoff
    req = request(REPEATING, max_tokens=12, ignore_eos=True, stream=stream)
    done = completes(await collect(stub.Generate(req, timeout=60)))[0]
    assert done.spec_draft_tokens > 0
    assert 0 < done.spec_accepted_tokens <= done.spec_draft_tokens
