"""`mm_inputs` / `extra_mm_inputs`: a router's preprocessed tensors, as vLLM's engine input.

A router that runs the model's image processor itself sends what it made:
token ids with every image's placeholder tokens already expanded, and the
tensors the model's encoder takes (`pixel_values`, model-specific ones such as
`image_grid_thw`), one `MultimodalInputs` batch per modality (`mm_inputs`,
then `extra_mm_inputs`). This module turns them into vLLM's multimodal engine
input (`vllm.inputs.engine.mm_input`), which the engine takes as it is: vLLM's
renderer and processor do not run again.

Each tensor arrives inline or in a POSIX shared-memory segment on this host
(read by `tensor_payloads`). Everything a request can get wrong on the wire
is refused before the engine sees it, each message naming the field: unknown
dtypes, byte counts that do not match the shape, placeholders outside the
prompt, overlapping or not covering the model's image token, a number of
placeholders other than the number of items, hashes that do not match the
items, more items than the engine takes per prompt.

What the model itself would reject is refused here too where it can be known:
a tensor the engine's worker cannot take fails the engine as a whole (vLLM
treats any error in the model's forward pass as fatal). So each image item is
compared with what vLLM's own processor makes for this model (`ModelMedia`,
learnt once from two blank images of different sizes): every tensor it makes
must be there, each dimension that did not change with the image's size must
match (LLaVA-1.5: `pixel_values` of [3, 336, 336]; a model that cuts images
into patches: the values of each patch), and so must the number of embedding
positions when that did not change either.
What changes with the image (a patch count, say) stays the router's part of
the contract, as with vLLM's own preprocessed-input servers.

The engine's cache key for each item is computed here from its tensors, not
taken from `mm_hashes`: a hash that does not match its image could otherwise
make the engine serve another request's cached image.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..budgets import DEFAULT_MAX_REQUEST_SHM_BYTES, check_request_id
from ..context import may_route
from ..errors import (
    InvalidRequestError,
    RoutingDataError,
    UnimplementedFieldError,
    UnsupportedError,
)
from ..proto import common_pb2
from ..proto import vllm_engine_pb2 as pb
from ..wire import fields
from .model_media import ItemShape, ModelMedia
from .tensor_items import Batch, check_no_overlap, field_configs, item_placeholders
from .tensor_payloads import itemsize, shape_text, tensor_from

_SHM_ROLE = (
    "tensors through shared memory are a router's beside the server (the caller names a "
    "segment of this host, which the server reads into the prompt): a router key "
    "(--router-api-key, or role=router on its line of the key file), a --router-tls-subject "
    "certificate or an admin key"
)
# Payloads above this are copied in a worker thread, not on the event loop.
OFF_LOOP_BYTES = 1 << 20

_PRIMARY_KEY = "pixel_values"
# vLLM's models take a video's pixels under their own name.
_VIDEO_PRIMARY_KEY = "pixel_values_videos"
_MODALITIES = {
    common_pb2.MODALITY_UNSPECIFIED: "image",
    common_pb2.IMAGE: "image",
    common_pb2.VIDEO: "video",
}


def sent(request: pb.GenerateRequest) -> bool:
    """Whether a Generate request carries preprocessed tensors (`mm_inputs`, `extra_mm_inputs`)."""
    return request.HasField("mm_inputs") or len(request.extra_mm_inputs) > 0


async def engine_input(
    request: pb.GenerateRequest,
    prompt: Any,
    media: ModelMedia,
    *,
    max_shm_bytes: int = DEFAULT_MAX_REQUEST_SHM_BYTES,
) -> Any:
    """vLLM's multimodal engine input for a request that carries preprocessed tensors.

    Args:
        request: the Generate request (`mm_inputs` and/or `extra_mm_inputs` set).
        prompt: its prompt as `convert.prompt_from_request` made it (token
            ids, placeholders expanded).
        media: what the served model takes.
        max_shm_bytes: the most bytes all its tensors together may name in
            shared memory, checked before any segment is opened.

    Raises:
        InvalidRequestError: a malformed batch, tensor or placeholder (named).
        UnimplementedFieldError: a transport or modality this server does not serve.
        UnsupportedError: the model takes no items of the batch's modality.
    """
    batches = _batches(request)
    first = batches[0].path
    if request.HasField("media_refs"):
        raise InvalidRequestError(
            first, "cannot be combined with media_refs; send each image one way only"
        )
    if request.WhichOneof("input") != "tokenized":
        raise InvalidRequestError(
            first, "needs tokenized input (token ids with each image's placeholders expanded)"
        )
    if request.sampling_params.HasField("truncate_prompt_tokens"):
        raise InvalidRequestError(
            "sampling_params.truncate_prompt_tokens",
            f"cannot be used with {first}: truncating the prompt would move its placeholders",
        )
    for batch in batches:
        _check_transports(batch, media)
    _check_shm_total(batches, max_shm_bytes)
    for batch in batches:
        _check_served(batch, media)
    _check_one_batch_per_modality(batches)
    prompt_ids = prompt["prompt_token_ids"]
    text = request.tokenized.original_text or None
    if not media.learnt:
        # Once, off the event loop: the model's processor runs on two images.
        await asyncio.to_thread(media.learn)
    if sum(_payload_bytes(batch.message) for batch in batches) > OFF_LOOP_BYTES:
        return await asyncio.to_thread(_build, batches, prompt_ids, media, text)
    return _build(batches, prompt_ids, media, text)


# ----- the request's shape ----------------------------------------------------------------


def _batches(request: pb.GenerateRequest) -> list[Batch]:
    messages = [("mm_inputs", request.mm_inputs)] if request.HasField("mm_inputs") else []
    messages += [(f"extra_mm_inputs[{i}]", m) for i, m in enumerate(request.extra_mm_inputs)]
    batches = []
    for path, message in messages:
        modality = _MODALITIES.get(message.modality)
        if modality is None:
            raise UnimplementedFieldError(
                f"{path}.modality",
                f"{common_pb2.Modality.Name(message.modality)}: this server takes preprocessed "
                "images and videos only",
            )
        # Each tensor's name is copied into the engine request (its item's
        # keyword for the model): held to the request-id rule, as ids are.
        for key in message.model_specific_tensors:
            check_request_id(f"{path}.model_specific_tensors", key, "tensor name")
        if message.HasField("encoder_input_key"):
            check_request_id(f"{path}.encoder_input_key", message.encoder_input_key, "tensor name")
        batches.append(Batch(path, message, modality))
    return batches


def _tensors_of(batch: Batch) -> list[tuple[str, str, pb.TensorData]]:
    """The batch's tensors as (field path, the keyword the model takes it as, tensor)."""
    message = batch.message
    found = []
    if message.HasField("pixel_values"):
        found.append((f"{batch.path}.pixel_values", _primary_key(batch), message.pixel_values))
    for key in sorted(message.model_specific_tensors):
        path = f"{batch.path}.model_specific_tensors[{key!r}]"
        found.append((path, key, message.model_specific_tensors[key]))
    return found


def _primary_key(batch: Batch) -> str:
    if batch.message.HasField("encoder_input_key") and batch.message.encoder_input_key:
        return batch.message.encoder_input_key
    return _VIDEO_PRIMARY_KEY if batch.modality == "video" else _PRIMARY_KEY


def _check_transports(batch: Batch, media: ModelMedia) -> None:
    for path, _, tensor in _tensors_of(batch):
        payload = tensor.WhichOneof("payload")
        if payload == "remote":
            raise UnimplementedFieldError(f"{path}.remote", fields.REMOTE_TENSOR_HINT)
        if payload == "shm":
            if not media.shm:
                raise UnsupportedError(fields.SHM_TENSORS_HINT, field=f"{path}.shm")
            if not may_route():
                # The caller names a segment of this host and the server reads it
                # into the prompt: any its user can read, another tenant's too.
                raise RoutingDataError(f"{path}.shm", _SHM_ROLE)


def _check_shm_total(batches: Sequence[Batch], limit: int) -> None:
    """Refuse a request whose shared-memory tensors declare more than `limit` bytes together.

    Counted from the handles (and each one's shape, whichever is larger) before
    any segment is opened: a refusal costs no read.
    """
    total = 0
    for batch in batches:
        for path, _, tensor in _tensors_of(batch):
            if tensor.WhichOneof("payload") != "shm":
                continue
            declared = math.prod(tensor.shape) * itemsize(tensor.dtype)
            total += max(tensor.shm.nbytes, declared)
            if total > limit:
                raise InvalidRequestError(
                    f"{path}.shm.nbytes",
                    f"the request's shared-memory tensors come to {total} bytes with this one, "
                    f"more than this server's budget of {limit} per request "
                    "(--max-request-shm-bytes)",
                )


def _check_served(batch: Batch, media: ModelMedia) -> None:
    if batch.modality not in media.limits:
        what = "images" if batch.modality == "image" else "videos"
        raise UnsupportedError(
            f"this server's model takes no {what}; serve a model that does (for images, a "
            "vision-language model) with a --limit-mm-per-prompt above 0",
            field=batch.path,
        )
    if not batch.message.HasField("pixel_values"):
        raise UnimplementedFieldError(
            f"{batch.path}.pixel_values",
            "a batch without pixel_values (the decode side of a prefill/decode hand-off) is "
            "not served; send the pixels",
        )


def _check_one_batch_per_modality(batches: Sequence[Batch]) -> None:
    seen: set[str] = set()
    for batch in batches:
        if batch.modality in seen:
            raise InvalidRequestError(
                f"{batch.path}.modality",
                f"a second {batch.modality} batch; send all {batch.modality} items in one batch",
            )
        seen.add(batch.modality)


def _payload_bytes(message: pb.MultimodalInputs) -> int:
    """The bytes the batch's tensors declare (reading `inline` to measure it would copy it)."""
    tensors = [message.pixel_values, *message.model_specific_tensors.values()]
    return sum(math.prod(t.shape) * itemsize(t.dtype) for t in tensors)


# ----- building the engine input (in a worker thread when large) ----------------------------


def _build(
    batches: Sequence[Batch], prompt_ids: list[int], media: ModelMedia, text: str | None
) -> Any:
    from transformers import BatchFeature
    from vllm.inputs.engine import mm_input
    from vllm.multimodal.inputs import MultiModalKwargsItems

    tensors: dict[str, torch.Tensor] = {}
    configs: dict[str, Any] = {}
    placeholders: dict[str, list[Any]] = {}
    for batch in batches:
        ranges = item_placeholders(batch, prompt_ids, media)
        own = _decoded(batch, media.dtype)
        clash = own.keys() & tensors.keys()
        if clash:
            raise InvalidRequestError(
                f"{batch.path}.model_specific_tensors",
                f"{sorted(clash)} already sent by another batch",
            )
        tensors.update(own)
        configs.update(field_configs(batch, own, len(ranges)))
        placeholders[batch.modality] = ranges
    check_no_overlap(batches, placeholders)
    try:
        items = MultiModalKwargsItems.from_hf_inputs(BatchFeature(tensors), configs)
    except (ValueError, RuntimeError, IndexError) as exc:
        raise InvalidRequestError(
            batches[0].path, f"the tensors do not split into items: {exc}"
        ) from None
    hashes = {}
    for batch in batches:
        found = list(items.get(batch.modality, ()))
        ranges = placeholders[batch.modality]
        _check_item_count(batch, len(found), len(ranges))
        expected = media.item_shape(batch.modality)
        if expected is not None:
            _check_items_fit(batch, found, ranges, expected)
        hashes[batch.modality] = [_item_key(batch.modality, item) for item in found]
    return mm_input(
        prompt_token_ids=prompt_ids,
        mm_kwargs=items,
        mm_hashes=hashes,
        mm_placeholders=placeholders,
        prompt=text,
    )


def _check_item_count(batch: Batch, items: int, ranges: int) -> None:
    if items != ranges:
        raise InvalidRequestError(
            f"{batch.path}.mm_placeholders",
            f"{ranges} placeholders for {items} {batch.modality} items",
        )
    hashes = batch.message.mm_hashes
    if hashes and len(hashes) != items:
        raise InvalidRequestError(
            f"{batch.path}.mm_hashes", f"{len(hashes)} hashes for {items} {batch.modality} items"
        )


def _check_items_fit(
    batch: Batch, items: Sequence[Mapping[str, Any]], ranges: Sequence[Any], expected: ItemShape
) -> None:
    """Each item against what the model's own processor makes (see the module's docstring)."""
    paths = {key: path for path, key, _ in _tensors_of(batch)}
    for index, (item, placeholder) in enumerate(zip(items, ranges, strict=True)):
        for key, dims in expected.dims.items():
            if key not in item:
                raise InvalidRequestError(
                    batch.path, f"has no {key!r} tensor, which this model takes for each item"
                )
            shape = tuple(item[key].data.shape)
            fits = len(shape) == len(dims) and all(
                d in (None, s) for s, d in zip(shape, dims, strict=True)
            )
            if not fits:
                raise InvalidRequestError(
                    paths.get(key, batch.path),
                    f"item {index} is {shape_text(shape)}; this model takes "
                    f"{shape_text(['*' if d is None else d for d in dims])} per item",
                )
        embeds = placeholder.get_num_embeds()
        if expected.embeds is not None and embeds != expected.embeds:
            raise InvalidRequestError(
                f"{batch.path}.mm_placeholders[{index}]",
                f"{embeds} image token positions; this model makes {expected.embeds} per image",
            )


def _item_key(modality: str, item: Mapping[str, Any]) -> str:
    """A digest of everything the model reads for one item: its cache identity."""
    digest = hashlib.sha256(b"vllm-servicer preprocessed " + modality.encode())
    for key in sorted(item):
        data = item[key].data
        digest.update(f"\0{key}\0{data.dtype}\0{tuple(data.shape)}\0".encode())
        digest.update(data.reshape(-1).contiguous().view(torch.uint8).numpy())
    return digest.hexdigest()


# ----- tensors ------------------------------------------------------------------------------


def _decoded(batch: Batch, model_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The batch's tensors by the keyword the model takes them as."""
    out = {}
    for path, key, data in _tensors_of(batch):
        tensor = tensor_from(path, data)
        # As vLLM's processor leaves them: floating point at the model's dtype.
        out[key] = tensor.to(model_dtype) if tensor.is_floating_point() else tensor
    return out
