"""Images named by URL (`media_refs`) reach a real vision-language model.

The session's vision engine, the tiny LLaVA (random weights on disk, so each
image changes the logits), served twice: with media references on (data:
URLs, files under one directory, http from loopback only) and with them off.
Greedy tokens show the image reaches the model: two images give two outputs,
the same image the same output, and the output equals vLLM's own for the
same decoded image.

A media `uuid` (vllm.Inference's `media[i].uuid`) is vLLM's cache key for
the item in place of its content's hash: served with two tenants' keys, each
tenant's uuids are keys of its own, so neither runs on the other's image
(`prefix_cache.salted`).
"""

from __future__ import annotations

import base64
import functools
import http.server
import io
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from support import bearer, collect, completes, free_port, request, serving, wait_until_idle

from vllm_servicer import SERVICE_NAME, MediaRefOptions
from vllm_servicer.context import ADMIN_ROLE, ROUTER_ROLE, Identity, current_identity
from vllm_servicer.interceptors.api_keys import ApiKeyVerifier
from vllm_servicer.interceptors.auth import AuthInterceptor
from vllm_servicer.prefix_cache import keyed_media_uuids, salted, tenant_media_uuid
from vllm_servicer.proto import INFERENCE_SERVICE, common_pb2, vllm_engine_pb2_grpc
from vllm_servicer.proto import vllm_engine_pb2 as pb
from vllm_servicer.testing.tiny_vlm import IMAGE_TOKEN

MAX_ITEM_BYTES = 64 * 1024


def _png(color: tuple[int, int, int], size: tuple[int, int] = (40, 50)) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()


RED, BLUE = _png((255, 0, 0)), _png((0, 0, 255))


def _data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("media")
    (root / "red.png").write_bytes(RED)
    (root / "broken.png").write_bytes(b"not an image at all")
    (root / "big.png").write_bytes(b"\0" * (MAX_ITEM_BYTES + 1))
    (root.parent / "outside.png").write_bytes(RED)
    return root


@pytest.fixture(scope="module")
def web(media_dir: Path) -> Iterator[str]:
    """An HTTP server on loopback serving `media_dir`."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(media_dir))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="module")
async def images_on(vlm_engine: Any, media_dir: Path) -> AsyncIterator[Any]:
    options = MediaRefOptions(
        allowed_local_media_path=str(media_dir),
        allowed_media_domains=["127.0.0.1"],
        max_item_bytes=MAX_ITEM_BYTES,
    )
    async with serving(vlm_engine, media_refs=options) as served:
        yield vllm_engine_pb2_grpc.VllmEngineStub(served.channel)


@pytest.fixture(scope="module")
async def images_off(vlm_engine: Any) -> AsyncIterator[Any]:
    async with serving(vlm_engine) as served:
        yield vllm_engine_pb2_grpc.VllmEngineStub(served.channel)


@pytest.fixture(scope="module")
def prompt_ids(vlm_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(vlm_dir))
    return list(tokenizer(f"{IMAGE_TOKEN} What is in this picture?")["input_ids"])


def _with_images(ids: list[int], *urls: str, **sampling: Any) -> pb.GenerateRequest:
    req = request(ids, **sampling)
    for url in urls:
        req.media_refs.items.add(modality=common_pb2.IMAGE, url=url)
    return req


async def _tokens(stub: Any, ids: list[int], *urls: str) -> list[int]:
    done = completes(await collect(stub.Generate(_with_images(ids, *urls), timeout=60)))
    return list(done[0].output_ids)


async def _refused(stub: Any, req: pb.GenerateRequest) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub.Generate(req, timeout=60))
    return err.value


# ----- the image reaches the model ---------------------------------------------------------


async def test_different_images_give_different_tokens(
    images_on: Any, prompt_ids: list[int]
) -> None:
    red = await _tokens(images_on, prompt_ids, _data_url(RED))
    blue = await _tokens(images_on, prompt_ids, _data_url(BLUE))
    assert len(red) == len(blue) == 8
    assert red != blue


async def test_the_same_image_gives_the_same_tokens_by_any_route(
    images_on: Any, prompt_ids: list[int], media_dir: Path, web: str
) -> None:
    by_data = await _tokens(images_on, prompt_ids, _data_url(RED))
    assert await _tokens(images_on, prompt_ids, _data_url(RED)) == by_data
    assert await _tokens(images_on, prompt_ids, (media_dir / "red.png").as_uri()) == by_data
    assert await _tokens(images_on, prompt_ids, f"{web}/red.png") == by_data
    # A JPEG of the same colour decodes to (nearly) the same pixels, and to an RGB image.
    assert len(await _tokens(images_on, prompt_ids, _data_url(RED, "image/jpeg"))) == 8


async def test_tokens_equal_vllm_offline_generate(
    images_on: Any, vlm_engine: Any, prompt_ids: list[int]
) -> None:
    from PIL import Image
    from vllm import SamplingParams

    served = await _tokens(images_on, prompt_ids, _data_url(BLUE))
    image = Image.open(io.BytesIO(BLUE)).convert("RGB")
    final = None
    async for output in vlm_engine.generate(
        {"prompt_token_ids": prompt_ids, "multi_modal_data": {"image": image}},
        SamplingParams(temperature=0.0, max_tokens=8),
        "offline-blue",
    ):
        final = output
    assert final is not None
    assert list(final.outputs[0].token_ids) == served
    # The placeholder was expanded to the image's tokens by vLLM's processor.
    assert len(final.prompt_token_ids) > len(prompt_ids)


async def test_vision_and_schemes_are_advertised_only_when_images_can_be_sent(
    images_on: Any, images_off: Any
) -> None:
    assert (await images_on.GetModelInfo(pb.GetModelInfoRequest())).supports_vision
    info = await images_on.GetServerInfo(pb.GetServerInfoRequest())
    assert (info.mm_processor, info.mm_media_ref_schemes) == ("inprocess", "data,file,http,https")
    # Preprocessed tensors (mm_inputs) still reach the model: vision, but no media refs.
    assert (await images_off.GetModelInfo(pb.GetModelInfoRequest())).supports_vision
    info = await images_off.GetServerInfo(pb.GetServerInfoRequest())
    assert (info.mm_processor, info.mm_media_ref_schemes) == ("", "")


# ----- refusals ---------------------------------------------------------------------------


async def test_off_by_default_the_refusal_names_the_switch(
    images_off: Any, prompt_ids: list[int], vlm_engine: Any
) -> None:
    err = await _refused(images_off, _with_images(prompt_ids, _data_url(RED)))
    assert err.code() == grpc.StatusCode.UNIMPLEMENTED
    assert (err.details() or "").startswith("media_refs: ")
    assert "--enable-media-refs" in (err.details() or "")
    assert await wait_until_idle(vlm_engine) == 0


@pytest.mark.parametrize(
    ("url", "words"),
    [
        pytest.param(
            lambda d, w: _data_url(b"not an image"), "not a decodable image", id="undecodable"
        ),
        pytest.param(
            lambda d, w: (d / "broken.png").as_uri(), "not a decodable image", id="bad-file"
        ),
        pytest.param(
            lambda d, w: "data:image/png;base64,@@@@", "not valid base64", id="bad-base64"
        ),
        pytest.param(lambda d, w: "data:image/png,rawbytes", "must be base64", id="not-base64"),
        pytest.param(
            lambda d, w: _data_url(b"\0" * (MAX_ITEM_BYTES + 3)), "byte limit", id="too-large-data"
        ),
        pytest.param(lambda d, w: (d / "big.png").as_uri(), "byte limit", id="too-large-file"),
        pytest.param(
            lambda d, w: (d.parent / "outside.png").as_uri(),
            "allowed-local-media-path",
            id="outside",
        ),
        pytest.param(
            lambda d, w: f"file://{d}/../outside.png", "allowed-local-media-path", id="dot-dot"
        ),
        pytest.param(lambda d, w: (d / "missing.png").as_uri(), "cannot read", id="missing-file"),
        pytest.param(lambda d, w: "ftp://127.0.0.1/red.png", "'ftp' is not accepted", id="ftp"),
        pytest.param(lambda d, w: "/etc/hostname", "'none' is not accepted", id="bare-path"),
        pytest.param(
            lambda d, w: "https://example.com/red.png", "allowed-media-domains", id="other-host"
        ),
        pytest.param(lambda d, w: f"{w}/missing.png", "could not fetch", id="http-404"),
    ],
)
async def test_bad_items_are_invalid_and_named(
    url: Any,
    words: str,
    images_on: Any,
    prompt_ids: list[int],
    media_dir: Path,
    web: str,
    vlm_engine: Any,
) -> None:
    err = await _refused(images_on, _with_images(prompt_ids, url(media_dir, web)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    details = err.details() or ""
    assert details.startswith("media_refs.items[0].url: ") and words in details, details
    assert await wait_until_idle(vlm_engine) == 0


class _Unavailable(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the handler's protocol
        self.send_error(503, "down for maintenance")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def down_web() -> Iterator[str]:
    """An HTTP server on loopback that answers every request 503."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Unavailable)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize("where", ["http-503", "connection-refused"])
async def test_a_fetch_failing_on_the_far_side_is_unavailable(
    where: str, images_on: Any, prompt_ids: list[int], down_web: str, vlm_engine: Any
) -> None:
    """The server's fault, not the request's: UNAVAILABLE, so a client may retry."""
    url = (
        f"{down_web}/red.png" if where == "http-503" else f"http://127.0.0.1:{free_port()}/red.png"
    )
    err = await _refused(images_on, _with_images(prompt_ids, url))
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
    assert (err.details() or "").startswith("media_refs.items[0].url: could not fetch"), (
        err.details()
    )
    assert await wait_until_idle(vlm_engine) == 0


async def test_other_malformed_requests_are_refused(
    images_on: Any, prompt_ids: list[int], vlm_engine: Any
) -> None:
    # Text input: the router tokenizes, as for the reference server.
    req = _with_images(prompt_ids, _data_url(RED))
    req.text = f"{IMAGE_TOKEN} hello"
    err = await _refused(images_on, req)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.details() or "").startswith("media_refs: needs tokenized input")
    # More images than the model takes per prompt.
    err = await _refused(images_on, _with_images(prompt_ids, _data_url(RED), _data_url(BLUE)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.details() or "").startswith("media_refs.items: 2 images")
    # Another modality.
    req = _with_images(prompt_ids)
    req.media_refs.items.add(modality=common_pb2.AUDIO, url=_data_url(RED))
    err = await _refused(images_on, req)
    assert err.code() == grpc.StatusCode.UNIMPLEMENTED
    assert (err.details() or "").startswith("media_refs.items[0].modality: AUDIO")
    # No items at all.
    req = _with_images(prompt_ids)
    req.media_refs.SetInParent()
    assert (await _refused(images_on, req)).code() == grpc.StatusCode.INVALID_ARGUMENT
    # An image but no placeholder for it: vLLM's processor refuses it.
    err = await _refused(images_on, _with_images(prompt_ids[:1] + prompt_ids[2:], _data_url(RED)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert await wait_until_idle(vlm_engine) == 0
    # The engine still serves images afterwards. The refusal above came after
    # vLLM's frontend had cached the image (P0) and before its engine core did
    # (P1); depending on what else that session engine served, the next call
    # with the same image may meet vLLM 0.32's self-healing drift: it ends at
    # once with finish reason "error" and no tokens, and a resend carries the
    # image again, as vLLM asks of its clients.
    done = completes(await collect(images_on.Generate(_with_images(prompt_ids, _data_url(RED)))))
    if not done[0].output_ids:
        assert done[0].finish_reason == "error", done
    assert len(await _tokens(images_on, prompt_ids, _data_url(RED))) == 8


# ----- media uuids are a tenant's own ------------------------------------------------------

TENANT_A = "images-tenant-a-0123456789abcdefABCDEF"
TENANT_B = "images-tenant-b-0123456789abcdefABCDEF"


@pytest.fixture(scope="module")
async def tenants(vlm_engine: Any) -> AsyncIterator[Any]:
    """vllm.Inference with data: URLs on, two tenants' keys."""
    auth = AuthInterceptor(ApiKeyVerifier({"tenant-a": TENANT_A, "tenant-b": TENANT_B}))
    async with serving(
        vlm_engine,
        services=(SERVICE_NAME, INFERENCE_SERVICE),
        media_refs=MediaRefOptions(),
        interceptors=[auth],
    ) as served:
        yield served


async def _inference_tokens(
    served: Any, ref: Any, ref_grpc: Any, key: str, ids: list[int], image: bytes, name: str = ""
) -> list[int]:
    """vllm.Inference's greedy tokens for `ids` with `image` (sent under the uuid `name`)."""
    message = ref.GenerateRequest()
    message.token_ids.ids.extend(ids)
    message.stopping.max_new_tokens = 8
    message.stopping.ignore_eos = True
    message.response.output_token_ids = True
    message.media.add(modality=1, data_uri=_data_url(image), uuid=name)
    stub = ref_grpc.InferenceStub(served.channel)
    reply = await stub.Generate(message, metadata=bearer(key), timeout=60)
    return list(reply.outputs.token_ids)


async def test_another_tenants_uuid_runs_the_senders_own_image(
    tenants: Any, ref: Any, ref_grpc: Any, prompt_ids: list[int]
) -> None:
    name = f"photo-{uuid.uuid4()}"  # the session engine's caches outlive this test
    red = await _inference_tokens(tenants, ref, ref_grpc, TENANT_A, prompt_ids, RED)
    blue = await _inference_tokens(tenants, ref, ref_grpc, TENANT_B, prompt_ids, BLUE)
    assert len(red) == len(blue) == 8 and red != blue
    # A's red image cached under the uuid, A's again under it.
    assert await _inference_tokens(tenants, ref, ref_grpc, TENANT_A, prompt_ids, RED, name) == red
    assert await _inference_tokens(tenants, ref, ref_grpc, TENANT_A, prompt_ids, RED, name) == red
    # B's blue image under A's uuid is B's blue image, not A's red one.
    assert await _inference_tokens(tenants, ref, ref_grpc, TENANT_B, prompt_ids, BLUE, name) == blue


async def test_a_uuid_another_tenant_sent_first_does_not_replace_a_tenants_image(
    tenants: Any, ref: Any, ref_grpc: Any, prompt_ids: list[int]
) -> None:
    name = f"photo-{uuid.uuid4()}"
    red = await _inference_tokens(tenants, ref, ref_grpc, TENANT_A, prompt_ids, RED)
    # B sends its blue image under the uuid first; A's red one under it is red.
    await _inference_tokens(tenants, ref, ref_grpc, TENANT_B, prompt_ids, BLUE, name)
    assert await _inference_tokens(tenants, ref, ref_grpc, TENANT_A, prompt_ids, RED, name) == red


def test_a_tenants_uuids_are_keyed_by_its_name_routers_and_admins_unkeyed() -> None:
    def as_caller(identity: Identity | None, prompt: Any, shared: bool = False) -> Any:
        token = current_identity.set(identity)
        try:
            return salted(prompt, shared)
        finally:
            current_identity.reset(token)

    def prompt() -> dict[str, Any]:
        uuids = {"image": ["cat", None, "dog"], "video": "clip"}
        return {"prompt_token_ids": [1, 2], "multi_modal_uuids": uuids}

    a, b = Identity("tenant-a"), Identity("tenant-b")
    keyed = as_caller(a, prompt())["multi_modal_uuids"]
    assert keyed == {
        "image": [tenant_media_uuid("tenant-a", "cat"), None, tenant_media_uuid("tenant-a", "dog")],
        "video": tenant_media_uuid("tenant-a", "clip"),
    }
    assert as_caller(a, prompt())["multi_modal_uuids"] == keyed  # the same every time
    assert as_caller(b, prompt())["multi_modal_uuids"]["video"] != keyed["video"]
    # Even with the prefix cache shared: a shared uuid would share an image.
    shared = as_caller(a, prompt(), shared=True)
    assert shared["multi_modal_uuids"] == keyed and "cache_salt" not in shared
    # Length-prefixed, under a domain of its own: no name and uuid reach another
    # pair, nor the tenant's cache salt.
    assert tenant_media_uuid("ab", "c") != tenant_media_uuid("a", "bc")
    assert tenant_media_uuid("a", "") != as_caller(a, prompt())["cache_salt"]
    # A router's encoder-cache transfer names items by their uuids: unkeyed, as
    # an admin's and an unauthenticated server's.
    for caller in (
        Identity("router", roles=frozenset({ROUTER_ROLE})),
        Identity("admin", roles=frozenset({ADMIN_ROLE})),
        None,
    ):
        assert as_caller(caller, prompt()) == prompt()
    # Each part of an encoder-decoder prompt; the caller's own mapping left as it was.
    uuids = {"image": "cat"}
    encdec = {
        "encoder_prompt": {"prompt_token_ids": [1], "multi_modal_uuids": uuids},
        "decoder_prompt": {"prompt_token_ids": [2]},
    }
    keyed_encdec = keyed_media_uuids(encdec, "tenant-a")
    assert keyed_encdec["encoder_prompt"]["multi_modal_uuids"] == {
        "image": tenant_media_uuid("tenant-a", "cat")
    }
    assert uuids == {"image": "cat"}
