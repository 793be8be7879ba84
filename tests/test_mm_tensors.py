"""Preprocessed images (`mm_inputs`, `extra_mm_inputs`) reach a real vision-language model.

The session's vision engine, the tiny LLaVA (random weights on disk, so each
image changes the logits). The requests are made the way a router makes them:
the model directory's own HF processor expands the image placeholder in the
token ids and produces `pixel_values`, sent inline or through POSIX shared
memory. Greedy tokens show the tensors reach the model: two images give two
outputs, and an image sent as tensors gives the tokens the same image gives
when sent by URL (`media_refs`, where vLLM's own processor runs).
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
from collections.abc import AsyncIterator, Callable, Iterator
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as ref_grpc
from support import collect, completes, request, serving, streamed_tokens, wait_until_idle
from support.router_side import BLUE, PROMPT, RED, Routed, router_request, solid_image

from vllm_servicer import MediaRefOptions
from vllm_servicer.context import ROUTER_ROLE, Identity
from vllm_servicer.interceptors.auth import AuthInterceptor
from vllm_servicer.interceptors.verifiers import CallableVerifier
from vllm_servicer.proto import common_pb2, vllm_engine_pb2_grpc
from vllm_servicer.proto import vllm_engine_pb2 as pb


def _png(color: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    solid_image(color).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def unexpanded_ids(vlm_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(str(vlm_dir))(PROMPT)["input_ids"])


@pytest.fixture(scope="module")
async def channel(vlm_engine: Any) -> AsyncIterator[grpc.aio.Channel]:
    """A server with media references and shared memory on, to compare the routes on one engine."""
    async with serving(vlm_engine, media_refs=MediaRefOptions(), shm_tensors=True) as served:
        yield served.channel


@pytest.fixture(scope="module")
def stub(channel: grpc.aio.Channel) -> Any:
    return vllm_engine_pb2_grpc.VllmEngineStub(channel)


@pytest.fixture(scope="module")
async def refs_off(vlm_engine: Any) -> AsyncIterator[Any]:
    """A server with media references off: tensors are then the only way in."""
    async with serving(vlm_engine) as served:
        yield vllm_engine_pb2_grpc.VllmEngineStub(served.channel)


@pytest.fixture
def segment() -> Iterator[Callable[[bytes, int], shared_memory.SharedMemory]]:
    """POSIX shared memory as a router makes it: written, handed over, unlinked by its owner."""
    made: list[shared_memory.SharedMemory] = []

    def make(data: bytes, offset: int) -> shared_memory.SharedMemory:
        shm = shared_memory.SharedMemory(create=True, size=offset + len(data) + 16)
        assert shm.buf is not None
        shm.buf[offset : offset + len(data)] = data
        made.append(shm)
        return shm

    yield make
    for shm in made:
        shm.close()
        shm.unlink()


def _tensor_request(
    routed: Routed, *, where: str = "mm_inputs", **sampling: Any
) -> pb.GenerateRequest:
    req = request(routed.ids, **sampling)
    batch = req.mm_inputs if where == "mm_inputs" else req.extra_mm_inputs.add()
    batch.pixel_values.inline = routed.pixels
    batch.pixel_values.shape.extend(routed.shape)
    batch.pixel_values.dtype = "float32"
    batch.batched_keys.append("pixel_values")
    batch.mm_placeholders.add(offset=routed.offset, length=routed.length)
    batch.modality = common_pb2.IMAGE
    return req


def _via_shm(req: pb.GenerateRequest, shm: shared_memory.SharedMemory, offset: int) -> None:
    tensor = req.mm_inputs.pixel_values
    nbytes = len(tensor.inline)
    tensor.shm.name = "/" + shm.name
    tensor.shm.offset = offset
    tensor.shm.nbytes = nbytes


async def _tokens(stub: Any, req: Any) -> list[int]:
    done = completes(await collect(stub.Generate(req, timeout=60)))
    return list(done[0].output_ids)


async def _refused(stub: Any, req: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub.Generate(req, timeout=60))
    return err.value


def _data_url(color: tuple[int, int, int]) -> str:
    return "data:image/png;base64," + base64.b64encode(_png(color)).decode()


def _by_url(ids: list[int], color: tuple[int, int, int]) -> pb.GenerateRequest:
    req = request(ids)
    req.media_refs.items.add(modality=common_pb2.IMAGE, url=_data_url(color))
    return req


# ----- the image reaches the model ---------------------------------------------------------


async def test_different_images_give_different_tokens(stub: Any, preprocess: Any) -> None:
    red = await _tokens(stub, _tensor_request(preprocess(RED)))
    blue = await _tokens(stub, _tensor_request(preprocess(BLUE)))
    assert len(red) == len(blue) == 8
    assert red != blue
    assert await _tokens(stub, _tensor_request(preprocess(RED))) == red


@pytest.mark.parametrize("color", [RED, BLUE], ids=["red", "blue"])
async def test_tensors_give_the_tokens_of_vllms_own_processor(
    stub: Any, preprocess: Any, unexpanded_ids: list[int], color: tuple[int, int, int]
) -> None:
    """The router's processor output equals what vLLM's processor makes of the same image."""
    by_tensors = await _tokens(stub, _tensor_request(preprocess(color)))
    assert await _tokens(stub, _by_url(unexpanded_ids, color)) == by_tensors


async def test_shared_memory_gives_the_tokens_of_inline_and_is_left_to_its_owner(
    stub: Any, preprocess: Any, segment: Any
) -> None:
    routed = preprocess(BLUE)
    inline = await _tokens(stub, _tensor_request(routed))
    shm = segment(routed.pixels, 64)
    req = _tensor_request(routed)
    _via_shm(req, shm, 64)
    assert req.mm_inputs.pixel_values.WhichOneof("payload") == "shm"
    assert await _tokens(stub, req) == inline
    # Read, not unlinked: the segment is its owner's.
    assert await asyncio.to_thread(os.path.exists, f"/dev/shm/{shm.name}")
    # Advertised, so that a router on this host knows it may send it so.
    info = await stub.GetServerInfo(pb.GetServerInfoRequest())
    assert info.shm_namespace_id == _this_hosts_shm()


async def test_shared_memory_is_refused_unless_switched_on(
    refs_off: Any, preprocess: Any, segment: Any
) -> None:
    routed = preprocess(BLUE)
    req = _tensor_request(routed)
    _via_shm(req, segment(routed.pixels, 0), 0)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _tokens(refs_off, req)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = err.value.details() or ""
    assert details.startswith("mm_inputs.pixel_values.shm: ") and "--enable-shm-tensors" in details


async def test_shared_memory_is_a_routers_with_keys(
    vlm_engine: Any, preprocess: Any, segment: Any
) -> None:
    """Any segment the server's user can read would reach a tenant's prompt: with
    keys, only a router (or an admin) names one."""
    keys = {
        "tenant-key-0123456789": Identity("tenant"),
        "router-key-0123456789": Identity("router", roles=frozenset({ROUTER_ROLE})),
    }
    auth = AuthInterceptor(
        CallableVerifier(
            lambda md, _ctx: keys.get(dict(md).get("x-key", "")), reads_auth_context=False
        )
    )
    routed = preprocess(BLUE)
    req = _tensor_request(routed)
    _via_shm(req, segment(routed.pixels, 0), 0)
    async with serving(vlm_engine, shm_tensors=True, interceptors=[auth]) as served:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(served.channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub.Generate(req, metadata=(("x-key", "tenant-key-0123456789"),)))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        details = err.value.details() or ""
        assert details.startswith("mm_inputs.pixel_values.shm: ") and "router" in details
        router = (("x-key", "router-key-0123456789"),)
        assert completes(await collect(stub.Generate(req, metadata=router, timeout=60)))


async def test_a_batch_in_extra_mm_inputs_is_served_as_in_mm_inputs(
    stub: Any, preprocess: Any
) -> None:
    routed = preprocess(RED)
    assert await _tokens(stub, _tensor_request(routed, where="extra")) == await _tokens(
        stub, _tensor_request(routed)
    )


async def test_streaming_and_an_explicit_image_token_give_the_same_tokens(
    stub: Any, preprocess: Any
) -> None:
    routed = preprocess(BLUE)
    plain = await _tokens(stub, _tensor_request(routed))
    req = _tensor_request(routed, stream=True)
    req.mm_inputs.im_token_id = routed.image_token
    req.mm_inputs.mm_hashes.append("blake3-of-the-image")
    assert streamed_tokens(await collect(stub.Generate(req, timeout=60)))[0] == plain


async def test_reference_stubs_send_tensors_the_server_serves(
    channel: grpc.aio.Channel, stub: Any, preprocess: Any
) -> None:
    """A request built with the reference's generated code, as a router would."""
    routed = preprocess(RED)
    req = router_request(routed, "reference-mm")
    reference = ref_grpc.VllmEngineStub(channel)
    assert await _tokens(reference, req) == await _tokens(stub, _tensor_request(routed))


def _this_hosts_shm() -> str:
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return f"{boot_id}:{os.stat('/dev/shm').st_dev}"


async def test_vision_is_advertised_without_media_refs(
    refs_off: Any, preprocess: Any, vlm_engine: Any
) -> None:
    assert (await refs_off.GetModelInfo(pb.GetModelInfoRequest())).supports_vision
    info = await refs_off.GetServerInfo(pb.GetServerInfoRequest())
    assert (info.mm_processor, info.mm_media_ref_schemes) == ("", "")
    # What a router needs to send tensors: how many; shared memory is off here.
    assert (info.mm_item_limits, info.shm_namespace_id) == ("image=1", "")
    # vLLM's encoder budget: the lesser of its compute budget and its cache,
    # each the scheduler's setting where one item fits within it (here).
    scheduler = vlm_engine.vllm_config.scheduler_config
    limits = (scheduler.max_num_encoder_input_tokens, scheduler.encoder_cache_size)
    routed = preprocess(RED)
    assert routed.length <= info.mm_encoder_budget == min(limits)
    assert len(await _tokens(refs_off, _tensor_request(routed))) == 8


# ----- bad input is refused, named, and leaves the engine serving ----------------------------


def _set_dtype(req: pb.GenerateRequest, routed: Routed) -> None:
    req.mm_inputs.pixel_values.dtype = "float64"


def _short_bytes(req: pb.GenerateRequest, routed: Routed) -> None:
    req.mm_inputs.pixel_values.inline = b"\0" * 100
    del req.mm_inputs.pixel_values.shape[:]
    req.mm_inputs.pixel_values.shape.extend([1, 3, 4, 4])


def _past_the_prompt(req: pb.GenerateRequest, routed: Routed) -> None:
    req.mm_inputs.mm_placeholders[0].offset = len(routed.ids) - 2


def _off_by_one(req: pb.GenerateRequest, routed: Routed) -> None:
    req.mm_inputs.mm_placeholders[0].offset = routed.offset - 1


def _two_images_one_placeholder(req: pb.GenerateRequest, routed: Routed) -> None:
    req.mm_inputs.pixel_values.inline = routed.pixels * 2
    req.mm_inputs.pixel_values.shape[0] = 2


def _twice_the_size(req: pb.GenerateRequest, routed: Routed) -> None:
    """Pixels the encoder cannot take: before this was refused, they stopped the engine."""
    import torch

    pixels = torch.frombuffer(bytearray(routed.pixels), dtype=torch.float32).reshape(routed.shape)
    bigger = torch.nn.functional.interpolate(pixels, scale_factor=2).contiguous()
    req.mm_inputs.pixel_values.inline = bigger.numpy().tobytes()
    del req.mm_inputs.pixel_values.shape[:]
    req.mm_inputs.pixel_values.shape.extend(bigger.shape)


def _one_image_token_more(req: pb.GenerateRequest, routed: Routed) -> None:
    ids = routed.ids[: routed.offset] + [routed.image_token] + routed.ids[routed.offset :]
    req.tokenized.input_ids[:] = ids
    req.mm_inputs.mm_placeholders[0].length += 1


def _two_hashes(req: pb.GenerateRequest, routed: Routed) -> None:
    req.mm_inputs.mm_hashes.extend(["a", "b"])


def _no_placeholders(req: pb.GenerateRequest, routed: Routed) -> None:
    del req.mm_inputs.mm_placeholders[:]


def _missing_segment(req: pb.GenerateRequest, routed: Routed) -> None:
    tensor = req.mm_inputs.pixel_values
    tensor.shm.name = "/vllm-servicer-test-no-such-segment"
    tensor.shm.nbytes = len(routed.pixels)


def _path_as_name(req: pb.GenerateRequest, routed: Routed) -> None:
    _missing_segment(req, routed)
    req.mm_inputs.pixel_values.shm.name = "segment/elsewhere"


def _media_refs_too(req: pb.GenerateRequest, routed: Routed) -> None:
    req.media_refs.items.add(modality=common_pb2.IMAGE, url=_data_url(RED))


def _text_input(req: pb.GenerateRequest, routed: Routed) -> None:
    req.text = PROMPT


def _second_image_batch(req: pb.GenerateRequest, routed: Routed) -> None:
    req.extra_mm_inputs.add().CopyFrom(req.mm_inputs)


def _truncated(req: pb.GenerateRequest, routed: Routed) -> None:
    req.sampling_params.truncate_prompt_tokens = 4


INVALID = [
    (_set_dtype, "mm_inputs.pixel_values.dtype: 'float64' is not one of float32, bfloat16"),
    (_short_bytes, "mm_inputs.pixel_values: shape [1,3,4,4] float32 needs 192 bytes, got 100"),
    (_past_the_prompt, "mm_inputs.mm_placeholders[0]: [{end}, {end_plus_4}) is not a non-empty"),
    (_off_by_one, "mm_inputs.mm_placeholders[0]: covers token "),
    (_two_images_one_placeholder, "mm_inputs.batched_keys: 'pixel_values' has 2 entries"),
    (_two_hashes, "mm_inputs.mm_hashes: 2 hashes for 1 image items"),
    (_twice_the_size, "mm_inputs.pixel_values: item 0 is [3,64,64]; this model takes [3,32,32]"),
    (_one_image_token_more, "mm_inputs.mm_placeholders[0]: 5 image token positions; this model"),
    (_no_placeholders, "mm_inputs.mm_placeholders: is empty"),
    (_missing_segment, "mm_inputs.pixel_values.shm.name: no shared-memory segment"),
    (_path_as_name, "mm_inputs.pixel_values.shm.name: 'segment/elsewhere' is not a segment"),
    (_media_refs_too, "mm_inputs: cannot be combined with media_refs"),
    (_text_input, "mm_inputs: needs tokenized input"),
    (_second_image_batch, "extra_mm_inputs[0].modality: a second image batch"),
    (_truncated, "sampling_params.truncate_prompt_tokens: cannot be used with mm_inputs"),
]


@pytest.mark.parametrize(("spoil", "message"), INVALID, ids=[f.__name__ for f, _ in INVALID])
async def test_bad_input_is_invalid_and_named(
    stub: Any, vlm_engine: Any, preprocess: Any, spoil: Any, message: str
) -> None:
    routed = preprocess(RED)
    req = _tensor_request(routed)
    spoil(req, routed)
    err = await _refused(stub, req)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    end = len(routed.ids) - 2
    expected = message.format(end=end, end_plus_4=end + 4)
    assert (err.details() or "").startswith(expected), err.details()
    assert await wait_until_idle(vlm_engine) == 0


async def test_a_segment_too_short_for_its_range_is_invalid(
    stub: Any, preprocess: Any, segment: Any
) -> None:
    routed = preprocess(RED)
    req = _tensor_request(routed)
    _via_shm(req, segment(routed.pixels[:64], 0), 0)
    err = await _refused(stub, req)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.details() or "").startswith("mm_inputs.pixel_values.shm: offset 0 + nbytes")


@pytest.mark.parametrize("where", ["pixel_values", "model_specific_tensors"])
async def test_remote_tensors_are_unimplemented_and_named(
    stub: Any, preprocess: Any, where: str
) -> None:
    req = _tensor_request(preprocess(RED))
    if where == "pixel_values":
        tensor = req.mm_inputs.pixel_values
        path = "mm_inputs.pixel_values.remote"
    else:
        tensor = req.mm_inputs.model_specific_tensors["image_sizes"]
        tensor.shape.append(2)
        tensor.dtype = "int64"
        path = "mm_inputs.model_specific_tensors['image_sizes'].remote"
    tensor.remote.transport = "nixl"
    tensor.remote.nbytes = 16
    err = await _refused(stub, req)
    assert err.code() == grpc.StatusCode.UNIMPLEMENTED
    assert (err.details() or "").startswith(f"{path}: remote tensor transports")


async def test_another_modality_is_unimplemented_and_named(stub: Any, preprocess: Any) -> None:
    req = _tensor_request(preprocess(RED))
    req.mm_inputs.modality = common_pb2.AUDIO
    err = await _refused(stub, req)
    assert err.code() == grpc.StatusCode.UNIMPLEMENTED
    assert (err.details() or "").startswith("mm_inputs.modality: AUDIO")


async def test_a_modality_the_model_lacks_is_a_failed_precondition(
    stub: Any, preprocess: Any
) -> None:
    req = _tensor_request(preprocess(RED))
    req.mm_inputs.modality = common_pb2.VIDEO
    err = await _refused(stub, req)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (err.details() or "").startswith("mm_inputs: this server's model takes no videos")


async def test_the_engine_serves_images_after_the_refusals(stub: Any, preprocess: Any) -> None:
    assert len(await _tokens(stub, _tensor_request(preprocess(BLUE)))) == 8
