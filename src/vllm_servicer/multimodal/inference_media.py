"""`vllm.Inference`'s `media` items, resolved by the resolver VllmEngine's `media_refs` use.

Images sent by `url` or `data_uri` are read and decoded by `MediaResolver`,
under the same operator rules (`MediaRefOptions`); what it reports about an
item is named by the item's own field (`media[0].data_uri: ...`). Raw bytes,
preprocessed features and modalities other than images are refused, each
naming its field.
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import (
    BudgetFullError,
    InvalidRequestError,
    MediaUnavailableError,
    UnimplementedFieldError,
)
from ..proto import INFERENCE_SERVICE, common_pb2, vllm_engine_pb2
from ..proto import inference_pb2 as pb
from ..wire import fields
from .decoded import RequestMedia
from .media import MediaResolver


def _reason(path: str) -> str:
    """What the field table tells a client after the refused field's name."""
    return fields.REFUSED[INFERENCE_SERVICE]["Generate"][path].reason


MEDIA_HINT = fields.INFERENCE_MEDIA_HINT

# "media_refs.items" or "media_refs.items[i].url", as MediaResolver names them.
_RESOLVER_FIELD = re.compile(r"media_refs\.items(?:\[(\d+)\]\.url)?")


def _checked_url(index: int, item: pb.MediaItem) -> str:
    """The URL the resolver reads for one item; the item's own faults refused first."""
    modality = item.modality
    if modality == pb.MODALITY_UNSPECIFIED:
        raise InvalidRequestError(f"media[{index}].modality", "is required")
    if modality != pb.MODALITY_IMAGE:
        raise UnimplementedFieldError(
            f"media[{index}].modality",
            f"{pb.Modality.Name(modality)}: " + _reason("media.modality"),
        )
    if item.mime_type and not item.mime_type.lower().startswith("image/"):
        raise InvalidRequestError(
            f"media[{index}].mime_type", f"{item.mime_type!r} is not an image type"
        )
    source = item.WhichOneof("source")
    if source == "url":
        if item.url[:5].lower() == "data:":
            raise InvalidRequestError(f"media[{index}].url", "a data: URI goes in data_uri")
        return item.url
    if source == "data_uri":
        if item.data_uri[:5].lower() != "data:":
            raise InvalidRequestError(f"media[{index}].data_uri", "must use the data: scheme")
        return item.data_uri
    if source == "raw_bytes":
        raise UnimplementedFieldError(f"media[{index}].raw_bytes", _reason("media.raw_bytes"))
    if source == "features":
        raise UnimplementedFieldError(f"media[{index}].features", _reason("media.features"))
    raise InvalidRequestError(f"media[{index}].source", "is required (url or data_uri)")


def checked_items(media: Any) -> list[str]:
    """The URL of each item of `media` (a repeated MediaItem), in prompt order.

    Raises:
        InvalidRequestError: an item without a modality or source, or a
            source that does not match its field.
        UnimplementedFieldError: raw bytes, features, or a modality other than images.
    """
    return [_checked_url(index, item) for index, item in enumerate(media)]


_ResolverError = (
    InvalidRequestError | MediaUnavailableError | UnimplementedFieldError | BudgetFullError
)


def _renamed(exc: _ResolverError, media: Any) -> Exception:
    """The resolver's error, naming the `vllm.Inference` field instead of `media_refs`."""
    match = _RESOLVER_FIELD.match(exc.field)
    if match is None:
        return exc
    if match[1] is None:
        field = "media"
    else:
        index = int(match[1])
        # The resolver read the item's URL from whichever field the client used.
        field = f"media[{index}].{media[index].WhichOneof('source')}"
    renamed = type(exc)(field + exc.field[match.end() :], exc.reason)
    renamed.__cause__ = exc
    return renamed


async def images(resolver: MediaResolver, media: Any, account: RequestMedia) -> list[Any]:
    """The decoded images of `media`, by the resolver's rules, counted in `account`.

    Raises:
        InvalidRequestError, MediaUnavailableError, UnimplementedFieldError,
            BudgetFullError: as `MediaResolver.images`, naming the item's field.
    """
    refs = vllm_engine_pb2.MediaRefs()
    for url in checked_items(media):
        refs.items.add(modality=common_pb2.IMAGE, url=url)
    try:
        return await resolver.images(refs, account)
    except (
        InvalidRequestError,
        MediaUnavailableError,
        UnimplementedFieldError,
        BudgetFullError,
    ) as exc:
        raise _renamed(exc, media) from None


def uuids(media: Any) -> list[str | None] | None:
    """The items' `uuid`s as vLLM's `multi_modal_uuids` (its cache key), when any is given."""
    given = [item.uuid or None for item in media]
    return given if any(given) else None
