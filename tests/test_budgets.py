"""Per-request budgets, on the wire: past one, a call is refused before any engine work.

Each refusal is INVALID_ARGUMENT naming the field and the limit (the request
alone is too big) or RESOURCE_EXHAUSTED (the process's decoded images in
flight are at their budget), on both protocols where the field exists. The
text engine is served with the default budgets; the vision engine once with
the defaults (shared memory) and once with small media budgets, so that
ordinary test images pass them.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import struct
import threading
import types
import zlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import (
    bearer,
    collect,
    completes,
    request,
    serving,
    streamed_tokens,
    wait_until_idle,
)
from support.router_side import RED, Routed, solid_image
from support.vllm_protocol import reference_modules

from vllm_servicer import SERVICE_NAME, AuthInterceptor, MediaRefOptions, RequestBudgets
from vllm_servicer.frontends import FrontendGroup, TableFullError, id_room, table_capacity
from vllm_servicer.interceptors.api_keys import ApiKeyVerifier
from vllm_servicer.proto import CONTROL_SERVICE, INFERENCE_SERVICE, common_pb2, vllm_engine_pb2_grpc
from vllm_servicer.proto import vllm_engine_pb2 as pb
from vllm_servicer.testing.tiny_vlm import IMAGE_TOKEN

ctl, ctl_grpc = reference_modules("control")

# The defaults (vllm_servicer.budgets), as the docs give them.
DEFAULT_MAX_CONSTRAINT_BYTES = 64 * 1024
DEFAULT_MAX_ABORT_IDS = 1024

PROMPT = [5, 17, 42, 99, 7, 63, 21, 88]
ALL_SERVICES = (SERVICE_NAME, INFERENCE_SERVICE, CONTROL_SERVICE)
INVALID = grpc.StatusCode.INVALID_ARGUMENT


async def _refused(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        if hasattr(call, "__aiter__"):  # a streaming call
            await collect(call)
        else:
            await call
    return err.value


def _inference_request(ref: types.ModuleType, ids: list[int], **fields: Any) -> Any:
    message = ref.GenerateRequest(**fields)
    message.token_ids.ids.extend(ids)
    message.stopping.max_new_tokens = 2
    return message


# ----- the text engine, default budgets -----------------------------------------------------


@pytest.fixture(scope="module")
async def text(engine: Any) -> AsyncIterator[Any]:
    async with serving(engine, services=ALL_SERVICES) as served:
        yield served


@pytest.fixture
def engine_stub(text: Any) -> Any:
    return vllm_engine_pb2_grpc.VllmEngineStub(text.channel)


@pytest.fixture
def inference_stub(text: Any, ref_grpc: types.ModuleType) -> Any:
    return ref_grpc.InferenceStub(text.channel)


async def test_n_past_the_budget_is_refused_naming_it(engine_stub: Any, engine: Any) -> None:
    err = await _refused(engine_stub.Generate(request(n=129, temperature=1.0, max_tokens=1)))
    assert err.code() is INVALID
    assert err.details() == (
        "sampling_params.n: 129 sequences, more than this server's budget of 128 (--max-n)"
    )
    assert await wait_until_idle(engine) == 0
    # At the budget: served.
    done = completes(
        await collect(engine_stub.Generate(request(n=128, temperature=1.0, max_tokens=1)))
    )
    assert len(done) == 128


# A schema that compiles at once, only long: what is counted is its size.
LONG_SCHEMA = json.dumps({"type": "string", "description": "x" * DEFAULT_MAX_CONSTRAINT_BYTES})


async def test_a_constraint_past_the_budget_is_refused_on_both_protocols(
    engine_stub: Any, inference_stub: Any, ref: types.ModuleType
) -> None:
    size = len(LONG_SCHEMA)
    limit = f"more than this server's budget of {DEFAULT_MAX_CONSTRAINT_BYTES} bytes"
    req = request(max_tokens=2)
    req.sampling_params.json_schema = LONG_SCHEMA
    err = await _refused(engine_stub.Generate(req))
    assert err.code() is INVALID
    assert (err.details() or "").startswith(f"sampling_params.json_schema: {size} bytes, {limit}")
    assert "--max-constraint-bytes" in (err.details() or "")

    message = _inference_request(ref, PROMPT)
    message.decoding.json = LONG_SCHEMA
    err = await _refused(inference_stub.Generate(message))
    assert err.code() is INVALID
    assert (err.details() or "").startswith(f"decoding.json: {size} bytes, {limit}")


async def test_a_choice_list_counts_its_choices_together(engine_stub: Any) -> None:
    choices = ["y" * 1000] * (DEFAULT_MAX_CONSTRAINT_BYTES // 1000 + 1)
    err = await _refused(engine_stub.Generate(request(max_tokens=2, choice=choices)))
    assert err.code() is INVALID
    assert (err.details() or "").startswith(
        f"sampling_params.choice.choices: {len(choices) * 1000}"
    )


async def test_an_abort_of_more_ids_than_the_budget_is_refused_on_both_protocols(
    engine_stub: Any, text: Any
) -> None:
    too_many = [f"id-{i}" for i in range(DEFAULT_MAX_ABORT_IDS + 1)]
    expected = (
        f"request_ids: {len(too_many)} ids, more than this server's budget of "
        f"{DEFAULT_MAX_ABORT_IDS} per Abort (--max-abort-ids); send them in several calls"
    )
    err = await _refused(engine_stub.Abort(pb.AbortRequest(request_ids=too_many), timeout=10))
    assert (err.code(), err.details()) == (INVALID, expected)
    control = ctl_grpc.ControlStub(text.channel)
    err = await _refused(control.Abort(ctl.AbortRequest(request_ids=too_many), timeout=10))
    assert (err.code(), err.details()) == (INVALID, expected)
    # At the budget: an Abort as any other.
    await engine_stub.Abort(pb.AbortRequest(request_ids=too_many[:-1]), timeout=10)
    await control.Abort(ctl.AbortRequest(request_ids=too_many[:-1]), timeout=10)


CONTROL_IDS = ["kv-subscriber\0alice", "line\nbreak", "bell\x07", "del\x7f"]


@pytest.mark.parametrize("request_id", CONTROL_IDS, ids=["nul", "newline", "bell", "del"])
async def test_a_request_id_with_a_control_character_is_refused_on_both_protocols(
    request_id: str, engine_stub: Any, inference_stub: Any, ref: types.ModuleType, engine: Any
) -> None:
    err = await _refused(engine_stub.Generate(request(request_id=request_id, max_tokens=2)))
    assert err.code() is INVALID
    assert (err.details() or "").startswith("request_id: has the control character")
    err = await _refused(
        inference_stub.Generate(_inference_request(ref, PROMPT, request_id=request_id))
    )
    assert err.code() is INVALID
    assert (err.details() or "").startswith("request_id: has the control character")
    err = await _refused(engine_stub.Abort(pb.AbortRequest(request_ids=["ok", request_id])))
    assert err.code() is INVALID
    assert (err.details() or "").startswith("request_ids[1]: has the control character")
    assert await wait_until_idle(engine) == 0


# Ids a client chooses that vLLM copies into the engine request: a session id
# into the KV event of every block the request stores (six Generates with a
# 24 MB one were accepted, and every router's KV-event subscription stalled
# on the events), a cache salt and media uuids into the blocks' keys, KV hints
# and a KV connector's host to the engine as they are.
CLIENT_IDS: dict[str, Any] = {
    "session_id": lambda m, v: setattr(m, "session_id", v),
    "kv.cache_salt": lambda m, v: setattr(m.kv, "cache_salt", v),
    "media[0].uuid": lambda m, v: m.media.add(
        modality=1, data_uri="data:image/png;base64,AA==", uuid=v
    ),
    "kv_hints.message_id": lambda m, v: setattr(m.kv_hints, "message_id", v),
    "kv_hints.actions[0].action_type": lambda m, v: m.kv_hints.actions.add(action_type=v),
}


@pytest.mark.parametrize("field", list(CLIENT_IDS))
async def test_ids_the_engine_copies_keep_to_the_request_id_rule(
    field: str, inference_stub: Any, ref: types.ModuleType, engine: Any
) -> None:
    for value, words in (
        ("s" * 1025, "1025 characters, more than the 1024 a "),
        ("line\nbreak", "has the control character '\\n' at position 4"),
    ):
        message = _inference_request(ref, PROMPT)
        CLIENT_IDS[field](message, value)
        err = await _refused(inference_stub.Generate(message, timeout=60))
        assert err.code() is INVALID, err.details()
        details = err.details() or ""
        assert details.startswith(f"{field}: {words}"), details
    assert await wait_until_idle(engine) == 0


async def test_ids_at_the_rule_are_served_and_vllm_engines_are_kept_to_it(
    inference_stub: Any, engine_stub: Any, ref: types.ModuleType, engine: Any
) -> None:
    message = _inference_request(ref, PROMPT, session_id="s" * 1024)
    message.kv.cache_salt = "c" * 1024
    assert (await inference_stub.Generate(message, timeout=60)).outputs.num_tokens == 2
    # VllmEngine's: the KV connector's host (before its role is asked: this
    # server has no keys) and the names of preprocessed tensors.
    req = request(max_tokens=2)
    req.kv_transfer_params.remote_host = "h" * 1025
    req.kv_transfer_params.remote_port = 9
    err = await _refused(engine_stub.Generate(req, timeout=60))
    assert err.code() is INVALID
    assert (err.details() or "").startswith("kv_transfer_params.remote_host: 1025 characters")
    req = request(max_tokens=2)
    req.mm_inputs.modality = common_pb2.IMAGE
    req.mm_inputs.model_specific_tensors["x" * 1025].shape.append(1)
    err = await _refused(engine_stub.Generate(req, timeout=60))
    assert err.code() is INVALID
    assert (err.details() or "").startswith("mm_inputs.model_specific_tensors: 1025 characters")
    assert await wait_until_idle(engine) == 0


# ----- stop strings ---------------------------------------------------------------------------

# The defaults (vllm_servicer.budgets), as the docs give them.
DEFAULT_MAX_STOP_STRINGS = 64
DEFAULT_MAX_STOP_BYTES = 16 * 1024


async def _stop_refusals(
    engine_stub: Any, inference_stub: Any, ref: Any, stop: list[str]
) -> list[str]:
    """Both protocols' refusals of a generation with `stop`, each INVALID_ARGUMENT."""
    req = request(max_tokens=2)
    req.sampling_params.stop.extend(stop)
    message = _inference_request(ref, PROMPT)
    message.stopping.stop_strings.extend(stop)
    details = []
    for call in (engine_stub.Generate(req), inference_stub.Generate(message)):
        err = await _refused(call)
        assert err.code() is INVALID, err.details()
        details.append(err.details() or "")
    return details


async def test_stop_strings_past_the_count_are_refused_on_both_protocols(
    engine_stub: Any, inference_stub: Any, ref: types.ModuleType, engine: Any
) -> None:
    too_many = [f"<stop-{i}>" for i in range(DEFAULT_MAX_STOP_STRINGS + 1)]
    limit = (
        f"{len(too_many)} stop strings, more than this server's budget of "
        f"{DEFAULT_MAX_STOP_STRINGS} per request (--max-stop-strings)"
    )
    assert await _stop_refusals(engine_stub, inference_stub, ref, too_many) == [
        f"sampling_params.stop: {limit}",
        f"stopping.stop_strings: {limit}",
    ]
    assert await wait_until_idle(engine) == 0
    # At both budgets (count and bytes): served.
    each = DEFAULT_MAX_STOP_BYTES // DEFAULT_MAX_STOP_STRINGS
    stop = [f"{i:04d}".ljust(each, "~") for i in range(DEFAULT_MAX_STOP_STRINGS)]
    req = request(max_tokens=2)
    req.sampling_params.stop.extend(stop)
    done = completes(await collect(engine_stub.Generate(req, timeout=60)))
    assert len(done[0].output_ids) == 2
    message = _inference_request(ref, PROMPT)
    message.stopping.stop_strings.extend(stop)
    reply = await inference_stub.Generate(message, timeout=60)
    assert reply.outputs.num_tokens == 2


async def test_stop_strings_past_the_bytes_are_refused_on_both_protocols(
    engine_stub: Any, inference_stub: Any, ref: types.ModuleType
) -> None:
    # Two strings, each under the total: together one byte past it.
    half = DEFAULT_MAX_STOP_BYTES // 2
    stop = ["a" * half, "é" + "b" * (half - 1)]
    limit = (
        f"{DEFAULT_MAX_STOP_BYTES + 1} bytes of stop strings, more than this server's budget "
        f"of {DEFAULT_MAX_STOP_BYTES} per request (--max-stop-bytes)"
    )
    assert await _stop_refusals(engine_stub, inference_stub, ref, stop) == [
        f"sampling_params.stop: {limit}",
        f"stopping.stop_strings: {limit}",
    ]


async def test_a_flood_of_stop_strings_is_refused_and_others_are_served(
    engine_stub: Any, text: Any, engine: Any
) -> None:
    """300,000 stop strings (under grpc's 4 MB message), which vLLM would match
    against each new token on the serving loop: refused before the engine
    sees them, while another stream and a health Check are served."""
    flood = request(max_tokens=16)
    flood.sampling_params.stop.extend(f"s{i}" for i in range(300_000))
    other = engine_stub.Generate(request(max_tokens=16, stream=True), timeout=60)
    err = await _refused(engine_stub.Generate(flood, timeout=60))
    assert err.code() is INVALID
    assert "--max-stop-strings" in (err.details() or "")
    health = health_pb2_grpc.HealthStub(text.channel)
    answer = await health.Check(health_pb2.HealthCheckRequest(), timeout=30)
    assert answer.status == health_pb2.HealthCheckResponse.SERVING
    assert len(streamed_tokens(await collect(other))[0]) == 16
    assert await wait_until_idle(engine) == 0


# ----- the frontends' shared id table (--api-server-count) -----------------------------------

TENANT_A = "budget-tenant-a-0123456789abcdefABCDEF"
TENANT_B = "budget-tenant-b-0123456789abcdefABCDEF"
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


@contextlib.asynccontextmanager
async def _grouped(
    engine: Any, capacity: int, claims_per_owner: int | None = None
) -> AsyncIterator[Any]:
    """A mount as one of two frontend processes, with two tenants' keys."""
    bound = {} if claims_per_owner is None else {"claims_per_owner": claims_per_owner}
    group = FrontendGroup(2, capacity, **bound)
    group.join(0)
    auth = AuthInterceptor(ApiKeyVerifier([TENANT_A, TENANT_B]))
    try:
        async with serving(engine, interceptors=[auth], frontends=group) as served:
            yield vllm_engine_pb2_grpc.VllmEngineStub(served.channel)
    finally:
        group.remove_directory()


@contextlib.asynccontextmanager
async def _running(stub: Any, key: str) -> AsyncIterator[None]:
    """A stream of `key`'s, running (its first message read) until the block ends."""
    call = stub.Generate(request(max_tokens=400, stream=True), metadata=bearer(key), timeout=120)
    await call.read()
    try:
        yield
    finally:
        call.cancel()


async def test_one_callers_ids_in_the_shared_table_are_bounded(engine: Any) -> None:
    async with _grouped(engine, capacity=64, claims_per_owner=1) as stub, _running(stub, TENANT_A):
        err = await _refused(stub.Generate(request(max_tokens=2), metadata=bearer(TENANT_A)))
        assert err.code() is EXHAUSTED, err.details()
        assert "runs 1 request ids across the frontend processes, its most (1" in (
            err.details() or ""
        )
        # The other tenant's ids are its own to claim.
        done = completes(
            await collect(stub.Generate(request(max_tokens=2), metadata=bearer(TENANT_B)))
        )
        assert len(done[0].output_ids) == 2
    assert await wait_until_idle(engine) == 0


async def test_a_full_shared_table_answers_resource_exhausted(engine: Any) -> None:
    # Four slots fill at three: A's running id and A's count of ids take two.
    async with _grouped(engine, capacity=4) as stub, _running(stub, TENANT_A):
        err = await _refused(stub.Generate(request(max_tokens=2), metadata=bearer(TENANT_B)))
        assert err.code() is EXHAUSTED, err.details()
        assert "the frontends' shared table of running ids is full (3 entries)" in (
            err.details() or ""
        )
    assert await wait_until_idle(engine) == 0


def test_the_launchers_table_holds_what_the_budgets_allow_twice() -> None:
    """`--max-inflight` calls of `--max-pooling-inputs` ids each, for one
    identity, leave as many for the others."""
    room = id_room(64, 16)
    group = FrontendGroup(2, table_capacity(64, 16, 16), claims_per_owner=room)
    try:
        group.join(0)
        for i in range(room):
            assert group.claim(f"a-{i}", "tenant-a")
        with pytest.raises(TableFullError, match="its most"):
            group.claim("a-more", "tenant-a")
        for i in range(room):
            assert group.claim(f"b-{i}", "tenant-b")
        assert group.claims_held_by("tenant-a") == group.claims_held_by("tenant-b") == room
        group.release("a-0")
        assert group.claims_held_by("tenant-a") == room - 1
        assert group.claim("a-more", "tenant-a")
    finally:
        group.remove_directory()


# ----- images: small media budgets on the vision engine -------------------------------------

# A 40x50 RGB image takes 8,000 bytes decoded (PIL keeps RGB at 4 a pixel): one
# fits the process's budget, two at once do not.
SMALL_MEDIA = {
    "max_request_media_pixels": 1_000_000,
    "max_request_media_bytes": 12_000,
    "max_media_bytes_in_flight": 12_000,
}


def _png(size: tuple[int, int]) -> bytes:
    out = io.BytesIO()
    solid_image(RED).resize(size).save(out, format="PNG")
    return out.getvalue()


def _one_bit_png(width: int, height: int) -> bytes:
    """A black 1-bit PNG, written row by row: a few KB that decode to width*height pixels."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body)
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    row = b"\0" * (1 + (width + 7) // 8)  # filter byte, then the packed bits
    packer = zlib.compressobj(9)
    data = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data) + chunk(b"IEND", b"")
    )


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def image_prompt(vlm_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(vlm_dir))
    return list(tokenizer(f"{IMAGE_TOKEN} What is in this picture?")["input_ids"])


@pytest.fixture(scope="module")
async def small_media(vlm_engine: Any) -> AsyncIterator[Any]:
    async with serving(
        vlm_engine,
        services=(SERVICE_NAME, INFERENCE_SERVICE),
        media_refs=MediaRefOptions(),
        budgets=RequestBudgets(**SMALL_MEDIA),
    ) as served:
        yield served


def _by_url(ids: list[int], url: str, **sampling: Any) -> pb.GenerateRequest:
    req = request(ids, **sampling)
    req.media_refs.items.add(modality=common_pb2.IMAGE, url=url)
    return req


def _held(served: Any) -> int:
    return int(served.mounted.servicer.decoded_media.held)


async def test_an_image_bomb_is_refused_from_its_header_on_both_protocols(
    small_media: Any, image_prompt: list[int], ref: types.ModuleType, ref_grpc: Any
) -> None:
    # 11 KB on the wire, 89 million pixels decoded: within the per-image limit
    # (Pillow's), past the request's budget.
    bomb = _data_url(_one_bit_png(9459, 9459))
    assert len(bomb) < 16_000
    stub = vllm_engine_pb2_grpc.VllmEngineStub(small_media.channel)
    expected = (
        "image is 9459x9459; the request's images would come to 89472681 pixels, more than "
        "this server's budget of 1000000 per request (--max-request-media-pixels)"
    )
    err = await _refused(stub.Generate(_by_url(image_prompt, bomb), timeout=60))
    assert (err.code(), err.details()) == (INVALID, f"media_refs.items[0].url: {expected}")

    message = _inference_request(ref, image_prompt)
    message.media.add(modality=1, data_uri=bomb)
    err = await _refused(ref_grpc.InferenceStub(small_media.channel).Generate(message, timeout=60))
    assert (err.code(), err.details()) == (INVALID, f"media[0].data_uri: {expected}")
    assert _held(small_media) == 0


async def test_an_image_past_the_request_byte_budget_is_refused(
    small_media: Any, image_prompt: list[int]
) -> None:
    stub = vllm_engine_pb2_grpc.VllmEngineStub(small_media.channel)
    err = await _refused(
        stub.Generate(_by_url(image_prompt, _data_url(_png((60, 60)))), timeout=60)
    )
    assert err.code() is INVALID
    assert err.details() == (
        "media_refs.items[0].url: image is 60x60 (RGB); decoded, the request's images would "
        "take 14400 bytes, more than this server's budget of 12000 per request "
        "(--max-request-media-bytes)"
    )


async def test_decoded_images_in_flight_are_bounded_across_both_protocols(
    small_media: Any, image_prompt: list[int], ref: types.ModuleType, ref_grpc: Any, vlm_engine: Any
) -> None:
    image = _data_url(_png((40, 50)))
    stub = vllm_engine_pb2_grpc.VllmEngineStub(small_media.channel)
    holding = stub.Generate(
        _by_url(image_prompt, image, stream=True, max_tokens=400, ignore_eos=True), timeout=60
    )
    try:
        first = await holding.read()
        assert first.WhichOneof("response") == "chunk"
        assert _held(small_media) == 8000

        message = _inference_request(ref, image_prompt)
        message.media.add(modality=1, data_uri=image)
        inference = ref_grpc.InferenceStub(small_media.channel)
        err = await _refused(inference.Generate(message, timeout=60))
        assert err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert err.details() == (
            "media[0].data_uri: decoding this image (8000 bytes) would take this server's "
            "decoded images in flight past its budget of 12000 bytes "
            "(--max-media-bytes-in-flight, 8000 held now); retry later or on another replica"
        )
    finally:
        holding.cancel()
    assert await wait_until_idle(vlm_engine) == 0
    assert _held(small_media) == 0
    # Given back at the end of the first: the same image is served now.
    done = completes(await collect(stub.Generate(_by_url(image_prompt, image), timeout=60)))
    assert done[0].finish_reason in ("length", "stop")
    assert _held(small_media) == 0


def test_images_decoded_count_their_own_mode_and_the_rgb_copy() -> None:
    from vllm_servicer.multimodal.decoded import decoded_bytes

    assert decoded_bytes(40, 50, "RGB") == 8000
    assert decoded_bytes(9459, 9459, "1") == 5 * 9459 * 9459  # one byte, then RGB's four
    assert decoded_bytes(10, 10, "RGBA") == 800
    assert decoded_bytes(10, 10, "I;16") == 600


def test_a_requests_images_are_counted_together_item_after_item() -> None:
    # The tiny vision model takes one image per prompt: several are shown here.
    from PIL import Image

    from vllm_servicer.errors import BudgetFullError, InvalidRequestError
    from vllm_servicer.multimodal.decoded import DecodedMedia

    pool = DecodedMedia(RequestBudgets(**SMALL_MEDIA))
    account = pool.request()
    small = Image.open(io.BytesIO(_png((20, 25))))  # header only: 500 pixels, 2,000 bytes
    for index in range(6):
        account.admit(f"media_refs.items[{index}].url", small)
    assert (account.pixels, account.bytes, pool.held) == (3000, 12000, 12000)
    with pytest.raises(InvalidRequestError) as refused:
        account.admit("media_refs.items[6].url", small)
    assert refused.value.field == "media_refs.items[6].url"
    assert "take 14000 bytes, more than this server's budget of 12000" in str(refused.value)
    with pytest.raises(BudgetFullError):
        pool.request().admit("media_refs.items[0].url", small)
    account.release()
    assert pool.held == 0


# ----- shared-memory tensors, default budgets -------------------------------------------------


@pytest.fixture(scope="module")
async def shm_on(vlm_engine: Any) -> AsyncIterator[Any]:
    async with serving(vlm_engine, shm_tensors=True) as served:
        yield vllm_engine_pb2_grpc.VllmEngineStub(served.channel)


def _shm_request(routed: Routed, name: str, shape: list[int], nbytes: int) -> pb.GenerateRequest:
    req = request(routed.ids, max_tokens=2)
    batch = req.mm_inputs
    batch.pixel_values.shm.name = name
    batch.pixel_values.shm.nbytes = nbytes
    batch.pixel_values.shape.extend(shape)
    batch.pixel_values.dtype = "float32"
    batch.batched_keys.append("pixel_values")
    batch.mm_placeholders.add(offset=routed.offset, length=routed.length)
    batch.modality = common_pb2.IMAGE
    return req


@pytest.fixture
def fifo() -> Iterator[tuple[str, threading.Event]]:
    """A FIFO in /dev/shm, and an event set once a writer opened it.

    The writer opens it only if the test has not finished within 10 s: a
    server that opened it blocking would hang (this very event loop) until then.
    """
    name = f"vllm-servicer-test-fifo-{os.getpid()}"
    path = f"/dev/shm/{name}"
    os.mkfifo(path)
    done, opened = threading.Event(), threading.Event()

    def writer() -> None:
        if not done.wait(10):
            opened.set()
            with open(path, "wb"):
                pass

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        yield name, opened
    finally:
        done.set()
        thread.join()
        os.unlink(path)


async def test_a_fifo_named_as_a_segment_is_refused_without_blocking(
    shm_on: Any, preprocess: Any, fifo: tuple[str, threading.Event]
) -> None:
    name, writer_opened = fifo
    routed = preprocess(RED)
    req = _shm_request(routed, "/" + name, routed.shape, len(routed.pixels))
    err = await _refused(shm_on.Generate(req, timeout=60))
    assert not writer_opened.is_set()  # refused before any writer came
    assert err.code() is INVALID
    assert err.details() == f"mm_inputs.pixel_values.shm.name: '{name}' is not a segment"


async def test_shared_memory_past_the_request_budget_is_refused_before_any_read(
    shm_on: Any, preprocess: Any
) -> None:
    routed = preprocess(RED)
    shape = [1, 3, 20_000, 20_000]  # 4.8 GB of float32, past the 1 GiB budget
    nbytes = 4 * 3 * 20_000 * 20_000
    req = _shm_request(routed, "/vllm-servicer-test-never-opened", shape, nbytes)
    err = await _refused(shm_on.Generate(req, timeout=60))
    assert err.code() is INVALID
    assert err.details() == (
        f"mm_inputs.pixel_values.shm.nbytes: the request's shared-memory tensors come to "
        f"{nbytes} bytes with this one, more than this server's budget of {1 << 30} per "
        "request (--max-request-shm-bytes)"
    )


# ----- the launcher's flags ---------------------------------------------------------------------


def test_each_budget_is_a_launcher_flag() -> None:
    from vllm_servicer.serve.args import parse_args

    args = parse_args(["serve", "--max-n", "4", "--max-abort-ids", "16"])
    assert (args.options.budgets.max_n, args.options.budgets.max_abort_ids) == (4, 16)
    assert args.options.budgets.max_constraint_bytes == DEFAULT_MAX_CONSTRAINT_BYTES
    with pytest.raises(SystemExit) as exited:
        parse_args(["serve", "--max-request-media-bytes", "2", "--max-media-bytes-in-flight", "1"])
    assert exited.value.code == 2


async def test_the_engine_serves_after_the_refusals(engine_stub: Any) -> None:
    done = completes(await collect(engine_stub.Generate(request(max_tokens=2), timeout=60)))
    assert len(done[0].output_ids) == 2
