"""`media_refs`: images a request names by URL, resolved by this server.

Off unless the operator turns it on (`MountOptions.of(media_refs=MediaRefOptions())`,
the launcher's `--enable-media-refs`). Which URLs are then accepted follows
vLLM's own options for its OpenAI server, read from the engine's model config
unless given here:

- `data:` URLs (base64), unless `data_urls=False`;
- `file:` URLs only under `--allowed-local-media-path`, after symlinks and
  `..` are resolved;
- `http(s):` URLs only to the hosts in `--allowed-media-domains`, without
  following redirects. With no domains allowed this server makes no network
  fetch (vLLM's own server would fetch from any host).

Every item is bounded by `max_item_bytes` before it is decoded and by
`max_image_pixels` before its pixels are loaded; all of a request's items
together by the request's media budgets (`RequestMedia`, from each image's
header), and every request's by the process's, before the first is decoded.
Then they are decoded one after another. Reading and decoding run in a
worker thread; the decoded images go to the engine as `multi_modal_data`,
where vLLM's own processor turns them into model input.
"""

from __future__ import annotations

__all__ = [
    "DEFAULT_MAX_IMAGE_PIXELS",
    "DEFAULT_MAX_ITEM_BYTES",
    "MediaRefOptions",
    "MediaResolver",
]

import asyncio
import base64
import binascii
import io
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit
from urllib.request import url2pathname

from ..errors import InvalidRequestError, MediaUnavailableError, UnimplementedFieldError
from ..options import DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_ITEM_BYTES, MediaRefOptions
from ..proto import common_pb2
from ..proto import vllm_engine_pb2 as pb
from .decoded import RequestMedia

_FETCH_TIMEOUT_S = 10.0


class MediaResolver:
    """Turns a request's `media_refs` into PIL images, by the options' rules.

    Args:
        options: what the operator allowed.
        model_config: the engine's `ModelConfig` (allow-lists, item limits).
    """

    def __init__(self, options: MediaRefOptions, model_config: Any) -> None:
        local = options.allowed_local_media_path
        if local is None:
            local = getattr(model_config, "allowed_local_media_path", "") or ""
        self._local_root = Path(local).resolve() if local else None
        if self._local_root is not None and not self._local_root.is_dir():
            raise ValueError(f"allowed local media path {local!r} is not a directory")
        domains = options.allowed_media_domains
        if domains is None:
            domains = getattr(model_config, "allowed_media_domains", None) or ()
        self._domains = frozenset(d.lower() for d in domains)
        self._options = options
        schemes = ["data"] if options.data_urls else []
        if self._local_root is not None:
            schemes.append("file")
        if self._domains:
            schemes += ["http", "https"]
        self.schemes: tuple[str, ...] = tuple(schemes)
        mm_config = getattr(model_config, "multimodal_config", None)
        self._max_images = mm_config.get_limit_per_prompt("image") if mm_config is not None else 0

    @property
    def takes_images(self) -> bool:
        """Whether any image can be sent: the model takes images and a scheme is open."""
        return self._max_images > 0 and bool(self.schemes)

    async def images(self, refs: pb.MediaRefs, account: RequestMedia) -> list[Any]:
        """The decoded images of `refs`, in prompt order, counted in `account`.

        Every item is read and its header counted before any is decoded; then
        they are decoded one at a time.

        Raises:
            InvalidRequestError: an item is malformed, not allowed, too large
                or not a decodable image, or the items together pass a
                per-request budget; the message names the item.
            BudgetFullError: the process's decoded-media budget is full.
            UnimplementedFieldError: an item of a modality other than images.
        """
        items = list(refs.items)
        if not items:
            raise InvalidRequestError("media_refs.items", "is empty")
        if len(items) > self._max_images:
            raise InvalidRequestError(
                "media_refs.items",
                f"{len(items)} images, more than this model takes per prompt ({self._max_images})",
            )
        for index, item in enumerate(items):
            if item.modality != common_pb2.IMAGE:
                raise UnimplementedFieldError(
                    f"media_refs.items[{index}].modality",
                    f"{common_pb2.Modality.Name(item.modality)}: this server takes images only",
                )
            self._check_url(index, item.url)
        opened = []
        for index, item in enumerate(items):
            field = f"media_refs.items[{index}].url"
            image = await self._opened(field, item.url)
            account.admit(field, image)
            opened.append((field, image))
        decoded = []
        while opened:
            # Taken off the list: an image decoded in another mode is dropped
            # once converted, not held beside its RGB copy to the end.
            field, image = opened.pop(0)
            decoded.append(await asyncio.to_thread(self._decode, field, image))
        return decoded

    def _check_url(self, index: int, url: str) -> None:
        scheme = urlsplit(url).scheme.lower() if url else ""
        if scheme not in self.schemes:
            raise InvalidRequestError(
                f"media_refs.items[{index}].url",
                f"scheme {scheme or 'none'!r} is not accepted by this server (accepted: "
                f"{', '.join(self.schemes) or 'none'}); file: needs --allowed-local-media-path, "
                "http(s): needs --allowed-media-domains",
            )
        if scheme.startswith("http"):
            host = (urlsplit(url).hostname or "").lower()
            if host not in self._domains:
                raise InvalidRequestError(
                    f"media_refs.items[{index}].url",
                    f"host {host!r} is not in --allowed-media-domains",
                )

    async def _opened(self, field: str, url: str) -> Any:
        """The item's image with its header read, not decoded."""
        if url[:5].lower() == "data:" or url[:5].lower() == "file:":
            # Reading a file and base64 decoding both scale with the item.
            data = await asyncio.to_thread(self._read_local, field, url)
        else:
            data = await self._fetch(field, url)
        return await asyncio.to_thread(self._open, field, data)

    def _read_local(self, field: str, url: str) -> bytes:
        limit = self._options.max_item_bytes
        if url[:5].lower() == "data:":
            header, sep, payload = url[5:].partition(",")
            if not sep or not header.lower().endswith(";base64"):
                raise InvalidRequestError(
                    field, "a data: URL must be base64 (data:TYPE;base64,...)"
                )
            if len(payload) * 3 // 4 > limit:
                raise InvalidRequestError(field, f"image is larger than the {limit}-byte limit")
            try:
                return base64.b64decode(payload, validate=True)
            except binascii.Error as exc:
                raise InvalidRequestError(field, f"not valid base64: {exc}") from None
        parts = urlsplit(url)
        path = Path(url2pathname(parts.netloc + parts.path)).resolve()
        assert self._local_root is not None  # checked with the scheme
        if self._local_root not in path.parents:
            raise InvalidRequestError(
                field, "the file is not under this server's --allowed-local-media-path"
            )
        try:
            with path.open("rb") as file:
                data = file.read(limit + 1)
        except OSError as exc:
            raise InvalidRequestError(field, f"cannot read the file: {exc.strerror}") from None
        if len(data) > limit:
            raise InvalidRequestError(field, f"image is larger than the {limit}-byte limit")
        return data

    async def _fetch(self, field: str, url: str) -> bytes:
        from vllm.connections import global_http_connection

        limit = self._options.max_item_bytes
        try:
            data = await global_http_connection.async_get_bytes(
                url, timeout=_FETCH_TIMEOUT_S, allow_redirects=False, max_bytes=limit + 1
            )
        except Exception as exc:
            status = getattr(exc, "status", None)  # an HTTP error status, when there was one
            if isinstance(status, int) and 400 <= status < 500:
                # The URL is the client's fault (not there, not allowed): do not retry.
                raise InvalidRequestError(field, f"could not fetch the image: {exc}") from None
            reason = str(exc) or type(exc).__name__
            raise MediaUnavailableError(field, f"could not fetch the image: {reason}") from None
        if len(data) > limit:
            raise InvalidRequestError(field, f"image is larger than the {limit}-byte limit")
        return data

    def _open(self, field: str, data: bytes) -> Any:
        """The image's header (size, mode), its pixels left undecoded; the per-image limit."""
        from PIL import Image

        try:
            image = Image.open(io.BytesIO(data))
        except (OSError, ValueError, Image.DecompressionBombError) as exc:
            raise InvalidRequestError(field, f"not a decodable image: {exc}") from None
        width, height = image.size
        if width * height > self._options.max_image_pixels:
            raise InvalidRequestError(
                field,
                f"image is {width}x{height}, more than the "
                f"{self._options.max_image_pixels}-pixel limit",
            )
        return image

    def _decode(self, field: str, image: Any) -> Any:
        """The opened image's pixels, as RGB; refused if they are not what its header said."""
        from PIL import Image

        counted = image.size
        try:
            image.load()
        except (OSError, ValueError, Image.DecompressionBombError) as exc:
            raise InvalidRequestError(field, f"not a decodable image: {exc}") from None
        if image.size != counted:
            # A format that picks its size on load (an icon's largest entry, say)
            # would be counted at one size and held at another.
            raise InvalidRequestError(
                field, f"image decoded at {image.size}, not the {counted} its header gave"
            )
        # RGB, as vLLM's own media loader hands images to the processor (an
        # RGB image as it is: a copy would double what it holds).
        return image if image.mode == "RGB" else image.convert("RGB")
