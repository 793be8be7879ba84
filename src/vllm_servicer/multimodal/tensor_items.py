"""How one `MultimodalInputs` batch maps onto vLLM's items: its tensors' layout, its placeholders.

Each tensor of a batch is per item (`batched_keys`: one entry per placeholder
along its first dimension), sliced into items by the sizes another of its
tensors gives (`flat_keys`), or shared by all its items. Each placeholder is
a range of the prompt whose every token is the model's placeholder token, or,
given `im_token_id`, holds that token among the model's structural ones (an
image's start and end markers): ranges stay inside the prompt, do not
overlap, and number no more than the items the engine takes per prompt.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..errors import InvalidRequestError
from ..proto import vllm_engine_pb2 as pb
from .model_media import ModelMedia


@dataclasses.dataclass(frozen=True)
class Batch:
    """One `MultimodalInputs` of a request, with its field path and vLLM modality."""

    path: str
    message: pb.MultimodalInputs
    modality: str


# ----- how the tensors split into items ------------------------------------------------------


def field_configs(batch: Batch, tensors: Mapping[str, torch.Tensor], items: int) -> dict[str, Any]:
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


def _check_batched(batch: Batch, key: str, tensor: torch.Tensor, items: int) -> None:
    if tensor.dim() == 0 or tensor.shape[0] != items:
        first = tensor.shape[0] if tensor.dim() else "no"
        raise InvalidRequestError(
            f"{batch.path}.batched_keys",
            f"{key!r} has {first} entries along its first dimension for {items} placeholders",
        )


def _flat_sizes(
    batch: Batch, key: str, sizes_key: str, tensors: Mapping[str, torch.Tensor], items: int
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


def item_placeholders(batch: Batch, prompt_ids: list[int], media: ModelMedia) -> list[Any]:
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


def check_no_overlap(batches: Sequence[Batch], placeholders: Mapping[str, list[Any]]) -> None:
    spans = sorted(
        (r.offset, r.offset + r.length, f"{b.path}.mm_placeholders[{i}]")
        for b in batches
        for i, r in enumerate(placeholders[b.modality])
    )
    for (_, end, _), (start, _, path) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise InvalidRequestError(path, "overlaps another placeholder")
