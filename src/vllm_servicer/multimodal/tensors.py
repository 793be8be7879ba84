"""`mm_inputs` / `extra_mm_inputs`: a router's preprocessed tensors, as vLLM's engine input.

A router that runs the model's image processor itself sends what it made:
token ids with every image's placeholder tokens already expanded, and the
tensors the model's encoder takes (`pixel_values`, model-specific ones such as
`image_grid_thw`), one `MultimodalInputs` batch per modality (`mm_inputs`,
then `extra_mm_inputs`). This module turns them into vLLM's multimodal engine
input (`vllm.inputs.engine.mm_input`), which the engine takes as it is: vLLM's
renderer and processor do not run again.

Each tensor arrives inline (bytes, shape, dtype) or as a handle to a POSIX
shared-memory segment on this host (`shm`: name, offset, nbytes), which is
read and copied, never unlinked: the segment is its sender's. Everything a
request can get wrong on the wire is refused before the engine sees it, each
message naming the field: unknown dtypes, byte counts that do not match the
shape, placeholders outside the prompt, overlapping or not covering the
model's image token, a number of placeholders other than the number of items,
hashes that do not match the items, more items than the engine takes per
prompt.

What the model itself would reject is refused here too where it can be known:
a tensor the engine's worker cannot take fails the engine as a whole (vLLM
treats any error in the model's forward pass as fatal). So each image item is
compared with what vLLM's own processor makes for this model, learnt once from
two blank images of different sizes: every tensor it makes must be there, each
dimension that did not change with the image's size must match (LLaVA-1.5:
`pixel_values` of [3, 336, 336]; a model that cuts images into patches: the
values of each patch), and so must the number of embedding positions when
that did not change either.
What changes with the image (a patch count, say) stays the router's part of
the contract, as with vLLM's own preprocessed-input servers.

The engine's cache key for each item is computed here from its tensors, not
taken from `mm_hashes`: a hash that does not match its image could otherwise
make the engine serve another request's cached image.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import functools
import hashlib
import logging
import math
import os
import stat
import threading
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

logger = logging.getLogger("vllm_servicer")

# The wire's dtype names, as the reference server reads them. A name not listed
# is refused: read at the wrong width, the bytes would make plausible nonsense.
DTYPES: Mapping[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "uint8": torch.uint8,
    "int64": torch.int64,
    "uint32": torch.uint32,
}
# POSIX shared memory lives here on Linux. Read as a file, not through
# multiprocessing.shared_memory: before Python 3.13 attaching registers the
# segment with the resource tracker, which unlinks it when this process exits.
SHM_DIR = "/dev/shm"

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
# Where vLLM's model configs keep each modality's placeholder token id.
_TOKEN_ATTRS = {
    "image": ("image_token_index", "image_token_id"),
    "video": ("video_token_index", "video_token_id"),
}


@dataclasses.dataclass(frozen=True)
class ItemShape:
    """What vLLM's own processor makes of one image for this model.

    Attributes:
        dims: each tensor's per-item shape by keyword; None where a dimension
            changes with the image's size.
        embeds: embedding positions per image; None when that changes with the image.
    """

    dims: Mapping[str, tuple[int | None, ...]]
    embeds: int | None


class ModelMedia:
    """What the served model takes: items per prompt by modality, placeholder tokens, dtype.

    Attributes:
        limits: the engine's items per prompt for each modality it takes
            (vLLM's `--limit-mm-per-prompt` within the model's own limits).
        token_ids: each modality's placeholder token id, where the model has one.
        dtype: the model's dtype, that floating-point tensors are cast to.
        shm: whether tensors may come through this host's shared memory (off
            by default: a caller could name any segment the server can read).
    """

    def __init__(
        self,
        limits: Mapping[str, int],
        token_ids: Mapping[str, int],
        dtype: torch.dtype,
        processor: Any = None,
        *,
        shm: bool = False,
    ) -> None:
        self.limits = {m: n for m, n in limits.items() if n > 0}
        self.token_ids = dict(token_ids)
        self.dtype = dtype
        self.shm = shm
        self._processor = processor
        self._image_shape: ItemShape | None = None
        self._learnt = False
        self._learning = threading.Lock()
        self._encoder_budget: int | None = None

    @classmethod
    def of(cls, engine: Any, *, shm: bool = False) -> ModelMedia:
        """The facts of `engine`'s model (none for a text model); `shm` as in the attributes."""
        processor = getattr(getattr(engine, "renderer", None), "mm_processor", None)
        limits = dict(getattr(getattr(processor, "info", None), "allowed_mm_limits", None) or {})
        config = getattr(engine, "model_config", None)
        hf_config = getattr(config, "hf_config", None)
        token_ids = {}
        for modality, attrs in _TOKEN_ATTRS.items():
            found = [getattr(hf_config, attr, None) for attr in attrs]
            ids = [value for value in found if isinstance(value, int)]
            if ids:
                token_ids[modality] = ids[0]
        dtype = getattr(config, "dtype", None)
        dtype = dtype if isinstance(dtype, torch.dtype) else torch.float32
        return cls(limits, token_ids, dtype, processor, shm=shm)

    def encoder_budget(self, vllm_config: Any) -> int:
        """The most embedding positions one item may take and still be scheduled.

        vLLM's own figure (the lesser of the encoder compute budget and the
        encoder cache), as its start-up log gives it; 0 for a model that takes
        no media, or when this vLLM cannot tell. Works out the model's largest
        item on first use: call it off the event loop.
        """
        if self._encoder_budget is None:
            self._encoder_budget = _encoder_budget(vllm_config) if self.limits else 0
        return self._encoder_budget

    @property
    def encoder_budget_known(self) -> bool:
        """Whether `encoder_budget` has its answer already (no model work left)."""
        return self._encoder_budget is not None

    @property
    def item_limits(self) -> str:
        """Items per prompt as a router reads them: sorted "modality=count" pairs."""
        return ",".join(f"{m}={n}" for m, n in sorted(self.limits.items()))

    @property
    def takes_images(self) -> bool:
        """Whether preprocessed images can reach the model."""
        return self.limits.get("image", 0) > 0

    @property
    def learnt(self) -> bool:
        """Whether `item_shape` has what it needs (learning it runs the model's processor)."""
        return self._learnt

    def learn(self) -> None:
        """Learns what the model's processor makes of an image, once."""
        with self._learning:
            if not self._learnt and self._processor is not None and self.takes_images:
                self._image_shape = _learn_image_shape(self._processor)
            self._learnt = True

    def item_shape(self, modality: str) -> ItemShape | None:
        """What the model's processor makes of one item (images only), or None."""
        if modality != "image":
            return None
        self.learn()
        return self._image_shape


# Two sizes no processor keeps as they are, so what changes with the image shows.
_SAMPLE_SIZES = ((61, 47), (333, 250))


def _learn_image_shape(processor: Any) -> ItemShape | None:
    """Runs vLLM's processor on two blank images (no cache) and keeps what they share."""
    try:
        samples = [_processed_image(processor, size) for size in _SAMPLE_SIZES]
    except Exception:  # a processor that cannot: no check rather than no images
        logger.warning(
            "could not learn this model's image tensors from its processor; preprocessed "
            "images are not checked against them",
            exc_info=True,
        )
        return None
    (first, first_embeds), (second, second_embeds) = samples
    dims = {
        key: tuple(a if a == b else None for a, b in zip(shape, second[key], strict=True))
        for key, shape in first.items()
        if key in second and len(shape) == len(second[key])
    }
    return ItemShape(dims, first_embeds if first_embeds == second_embeds else None)


def _processed_image(
    processor: Any, size: tuple[int, int]
) -> tuple[dict[str, tuple[int, ...]], int]:
    from PIL import Image
    from vllm.multimodal.processing.context import TimingContext

    seq_len = processor.info.ctx.model_config.max_model_len
    inputs = processor.get_dummy_inputs(seq_len=seq_len, mm_counts={"image": 1}, mm_options={})
    items = processor.info.parse_mm_data({"image": [Image.new("RGB", size)]}, validate=False)
    inputs = dataclasses.replace(inputs, mm_data_items=items, cache=None)
    out = processor.apply(inputs, TimingContext(enabled=False))
    item = out["mm_kwargs"]["image"][0]
    shapes = {
        key: tuple(elem.data.shape)
        for key, elem in item.items()
        if isinstance(elem.data, torch.Tensor)
    }
    return shapes, out["mm_placeholders"]["image"][0].get_num_embeds()


def _encoder_budget(vllm_config: Any) -> int:
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.encoder_budget import MultiModalBudget

    try:
        budget = MultiModalBudget(vllm_config, MULTIMODAL_REGISTRY, enable_cache=False)
        return max(int(budget.get_encoder_budget()), 0)
    except Exception:  # a figure for routers: never worth failing GetServerInfo over
        logger.warning("the engine's encoder budget could not be worked out", exc_info=True)
        return 0


@functools.cache
def shm_namespace() -> str:
    """Which shared memory this process sees: "<boot id>:<device of /dev/shm>".

    A router on the same host, or in a container sharing this one's
    /dev/shm, sees the same pair and may send tensors through shared memory.
    The boot id pins the host (it is not namespaced); the device, the tmpfs
    behind /dev/shm. Empty when either cannot be read.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot_id = f.read().strip()
        return f"{boot_id}:{os.stat(SHM_DIR).st_dev}"
    except OSError:
        return ""


def sent(request: pb.GenerateRequest) -> bool:
    """Whether a Generate request carries preprocessed tensors (`mm_inputs`, `extra_mm_inputs`)."""
    return request.HasField("mm_inputs") or len(request.extra_mm_inputs) > 0


@dataclasses.dataclass(frozen=True)
class _Batch:
    """One `MultimodalInputs` of a request, with its field path and vLLM modality."""

    path: str
    message: pb.MultimodalInputs
    modality: str


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


def _batches(request: pb.GenerateRequest) -> list[_Batch]:
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
        batches.append(_Batch(path, message, modality))
    return batches


def _tensors_of(batch: _Batch) -> list[tuple[str, str, pb.TensorData]]:
    """The batch's tensors as (field path, the keyword the model takes it as, tensor)."""
    message = batch.message
    found = []
    if message.HasField("pixel_values"):
        found.append((f"{batch.path}.pixel_values", _primary_key(batch), message.pixel_values))
    for key in sorted(message.model_specific_tensors):
        path = f"{batch.path}.model_specific_tensors[{key!r}]"
        found.append((path, key, message.model_specific_tensors[key]))
    return found


def _primary_key(batch: _Batch) -> str:
    if batch.message.HasField("encoder_input_key") and batch.message.encoder_input_key:
        return batch.message.encoder_input_key
    return _VIDEO_PRIMARY_KEY if batch.modality == "video" else _PRIMARY_KEY


def _check_transports(batch: _Batch, media: ModelMedia) -> None:
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


def _check_shm_total(batches: Sequence[_Batch], limit: int) -> None:
    """Refuse a request whose shared-memory tensors declare more than `limit` bytes together.

    Counted from the handles (and each one's shape, whichever is larger) before
    any segment is opened: a refusal costs no read.
    """
    total = 0
    for batch in batches:
        for path, _, tensor in _tensors_of(batch):
            if tensor.WhichOneof("payload") != "shm":
                continue
            declared = math.prod(tensor.shape) * _itemsize(tensor.dtype)
            total += max(tensor.shm.nbytes, declared)
            if total > limit:
                raise InvalidRequestError(
                    f"{path}.shm.nbytes",
                    f"the request's shared-memory tensors come to {total} bytes with this one, "
                    f"more than this server's budget of {limit} per request "
                    "(--max-request-shm-bytes)",
                )


def _check_served(batch: _Batch, media: ModelMedia) -> None:
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


def _check_one_batch_per_modality(batches: Sequence[_Batch]) -> None:
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
    return sum(math.prod(t.shape) * _itemsize(t.dtype) for t in tensors)


def _itemsize(dtype: str) -> int:
    known = DTYPES.get(dtype)
    return known.itemsize if known is not None else 0


# ----- building the engine input (in a worker thread when large) ----------------------------


def _build(
    batches: Sequence[_Batch], prompt_ids: list[int], media: ModelMedia, text: str | None
) -> Any:
    from transformers import BatchFeature
    from vllm.inputs.engine import mm_input
    from vllm.multimodal.inputs import MultiModalKwargsItems

    tensors: dict[str, torch.Tensor] = {}
    configs: dict[str, Any] = {}
    placeholders: dict[str, list[Any]] = {}
    for batch in batches:
        ranges = _placeholders(batch, prompt_ids, media)
        own = _decoded(batch, media.dtype)
        clash = own.keys() & tensors.keys()
        if clash:
            raise InvalidRequestError(
                f"{batch.path}.model_specific_tensors",
                f"{sorted(clash)} already sent by another batch",
            )
        tensors.update(own)
        configs.update(_field_configs(batch, own, len(ranges)))
        placeholders[batch.modality] = ranges
    _check_no_overlap(batches, placeholders)
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


def _check_item_count(batch: _Batch, items: int, ranges: int) -> None:
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
    batch: _Batch, items: Sequence[Mapping[str, Any]], ranges: Sequence[Any], expected: ItemShape
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
                    f"item {index} is {_shape_text(shape)}; this model takes "
                    f"{_shape_text(['*' if d is None else d for d in dims])} per item",
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


def _decoded(batch: _Batch, model_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The batch's tensors by the keyword the model takes them as."""
    out = {}
    for path, key, data in _tensors_of(batch):
        tensor = tensor_from(path, data)
        # As vLLM's processor leaves them: floating point at the model's dtype.
        out[key] = tensor.to(model_dtype) if tensor.is_floating_point() else tensor
    return out


def tensor_from(path: str, data: pb.TensorData) -> torch.Tensor:
    """The tensor a `TensorData` carries, checked against its shape and dtype.

    Args:
        path: the field's path, for messages.
        data: the wire tensor (inline or shm).

    Raises:
        InvalidRequestError: an unknown dtype, an empty tensor, a byte count
            that does not match, or a shared-memory segment that cannot be read.
    """
    dtype = DTYPES.get(data.dtype)
    if dtype is None:
        raise InvalidRequestError(
            f"{path}.dtype", f"{data.dtype!r} is not one of {', '.join(DTYPES)}"
        )
    shape = list(data.shape)
    needed = math.prod(shape) * dtype.itemsize
    if needed == 0:
        raise InvalidRequestError(f"{path}.shape", f"{_shape_text(shape)} has no elements")
    kind = data.WhichOneof("payload")
    if kind not in ("inline", "shm"):
        raise InvalidRequestError(path, "carries no payload; set inline or shm")
    inline = data.inline if kind == "inline" else b""  # each read of the field copies it
    given = len(inline) if kind == "inline" else data.shm.nbytes
    if given != needed:
        raise InvalidRequestError(
            path, f"shape {_shape_text(shape)} {data.dtype} needs {needed} bytes, got {given}"
        )
    # Writable, as torch wants, and independent of the message or the sender's segment.
    raw = bytearray(inline) if kind == "inline" else _read_shm(path, data.shm)
    return torch.frombuffer(raw, dtype=dtype).reshape(shape)


def _shape_text(shape: Sequence[int | str]) -> str:
    return "[" + ",".join(map(str, shape)) + "]"


def _read_shm(path: str, handle: common_pb2.ShmHandle) -> bytearray:
    """A copy of the handle's bytes; the segment stays as it is (its owner unlinks it)."""
    name = handle.name.removeprefix("/")  # POSIX names start with one slash
    if not name or "/" in name or name in (".", "..") or "\0" in name:
        raise InvalidRequestError(f"{path}.shm.name", f"{handle.name!r} is not a segment name")
    try:
        # Non-blocking: a FIFO under that name would otherwise hold the event
        # loop until some writer opened it. Regular files ignore the flag.
        fd = os.open(
            os.path.join(SHM_DIR, name),
            os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
        )
    except OSError as exc:
        raise InvalidRequestError(f"{path}.shm.name", _open_failure(name, exc)) from None
    try:
        return _read_range(path, fd, handle)
    finally:
        os.close(fd)


def _open_failure(name: str, exc: OSError) -> str:
    if exc.errno == errno.ENOENT:
        return f"no shared-memory segment {name!r} on this host"
    if exc.errno == errno.ELOOP:
        return f"{name!r} is a symbolic link, not a shared-memory segment"
    return f"cannot open shared-memory segment {name!r}: {exc.strerror}"


def _read_range(path: str, fd: int, handle: common_pb2.ShmHandle) -> bytearray:
    # Named without the POSIX slash: a word starting with "/" reads as a path,
    # which error messages do not show (status.redact_paths).
    name = handle.name.removeprefix("/")
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise InvalidRequestError(f"{path}.shm.name", f"{name!r} is not a segment")
    end = handle.offset + handle.nbytes
    if end > info.st_size:
        raise InvalidRequestError(
            f"{path}.shm",
            f"offset {handle.offset} + nbytes {handle.nbytes} runs past the end of segment "
            f"{name!r} ({info.st_size} bytes)",
        )
    raw = bytearray(handle.nbytes)
    view = memoryview(raw)
    done = 0
    while done < handle.nbytes:
        read = os.preadv(fd, [view[done:]], handle.offset + done)
        if read == 0:
            raise InvalidRequestError(f"{path}.shm", f"segment {name!r} shrank while read")
        done += read
    return raw


# ----- how the tensors split into items ------------------------------------------------------


def _field_configs(
    batch: _Batch, tensors: Mapping[str, torch.Tensor], items: int
) -> dict[str, Any]:
    """vLLM's field layout for each tensor: per item (batched), sliced (flat) or shared."""
    from vllm.multimodal.inputs import MultiModalFieldConfig

    message = batch.message
    batched = set(message.batched_keys)
    flat = dict(message.flat_keys)
    on_cpu = set(message.keep_on_cpu_keys)
    configs = {}
    for key, tensor in tensors.items():
        keep = key in on_cpu
        if key in batched and key in flat:
            raise InvalidRequestError(
                f"{batch.path}.flat_keys", f"{key!r} is also in batched_keys; list it once"
            )
        if key in batched:
            _check_batched(batch, key, tensor, items)
            configs[key] = MultiModalFieldConfig.batched(batch.modality, keep_on_cpu=keep)
        elif key in flat:
            sizes = _flat_sizes(batch, key, flat[key], tensors, items)
            configs[key] = MultiModalFieldConfig.flat_from_sizes(
                batch.modality, sizes, keep_on_cpu=keep
            )
        else:
            configs[key] = MultiModalFieldConfig.shared(batch.modality, items, keep_on_cpu=keep)
    return configs


def _check_batched(batch: _Batch, key: str, tensor: torch.Tensor, items: int) -> None:
    if tensor.dim() == 0 or tensor.shape[0] != items:
        first = tensor.shape[0] if tensor.dim() else "no"
        raise InvalidRequestError(
            f"{batch.path}.batched_keys",
            f"{key!r} has {first} entries along its first dimension for {items} placeholders",
        )


def _flat_sizes(
    batch: _Batch, key: str, sizes_key: str, tensors: Mapping[str, torch.Tensor], items: int
) -> torch.Tensor:
    field = f"{batch.path}.flat_keys[{key!r}]"
    sizes = tensors.get(sizes_key)
    if sizes is None or sizes.is_floating_point():
        raise InvalidRequestError(field, f"names {sizes_key!r}, not an integer tensor of the batch")
    sizes = sizes.flatten().to(torch.int64)
    rows = tensors[key].shape[0] if tensors[key].dim() else 0
    if len(sizes) != items or bool((sizes < 0).any()) or int(sizes.sum()) != rows:
        raise InvalidRequestError(
            field,
            f"sizes {sizes.tolist()} must give one size per placeholder ({items}) adding up to "
            f"the first dimension of {key!r} ({rows})",
        )
    return sizes


# ----- placeholders -------------------------------------------------------------------------


def _placeholders(batch: _Batch, prompt_ids: list[int], media: ModelMedia) -> list[Any]:
    """vLLM's placeholder ranges of a batch, checked against the prompt.

    Without `im_token_id`, every token of a range must be the model's
    placeholder token. With it, a range may also hold the model's structural
    tokens (an image's start and end markers): embeddings go to the
    positions that hold `im_token_id`.
    """
    from vllm.multimodal.inputs import PlaceholderRange

    message = batch.message
    field = f"{batch.path}.mm_placeholders"
    if not message.mm_placeholders:
        raise InvalidRequestError(field, "is empty: give each item's range of the prompt")
    limit = media.limits.get(batch.modality, 0)
    if len(message.mm_placeholders) > limit:
        raise InvalidRequestError(
            field,
            f"{len(message.mm_placeholders)} {batch.modality} items, more than this model takes "
            f"per prompt ({limit})",
        )
    marked = message.HasField("im_token_id")
    token = message.im_token_id if marked else media.token_ids.get(batch.modality)
    ranges = []
    for index, placeholder in enumerate(message.mm_placeholders):
        where = f"{field}[{index}]"
        start, length = placeholder.offset, placeholder.length
        if length == 0 or start + length > len(prompt_ids):
            raise InvalidRequestError(
                where,
                f"[{start}, {start + length}) is not a non-empty range of the "
                f"{len(prompt_ids)}-token prompt",
            )
        is_embed = None
        if token is not None:
            is_embed = _embed_mask(where, prompt_ids[start : start + length], token, marked)
        ranges.append(PlaceholderRange(offset=start, length=length, is_embed=is_embed))
    return ranges


def _embed_mask(where: str, tokens: list[int], token: int, marked: bool) -> torch.Tensor | None:
    mask = torch.tensor(tokens, dtype=torch.int64) == token
    if bool(mask.all()):
        return None  # every position takes an embedding: vLLM's cheaper form
    if not marked or not bool(mask.any()):
        outside = tokens[int((~mask).nonzero()[0])]
        raise InvalidRequestError(
            where, f"covers token {outside}, not the placeholder token {token}"
        )
    return mask


def _check_no_overlap(batches: Sequence[_Batch], placeholders: Mapping[str, list[Any]]) -> None:
    spans = sorted(
        (r.offset, r.offset + r.length, f"{b.path}.mm_placeholders[{i}]")
        for b in batches
        for i, r in enumerate(placeholders[b.modality])
    )
    for (_, end, _), (start, _, path) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise InvalidRequestError(path, "overlaps another placeholder")
