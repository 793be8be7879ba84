"""What decoded images cost: each request's running totals, and the process's bytes in flight.

An image's size is in its header: PIL opens it lazily, so its width, height
and mode are known before a pixel is decoded. Each item of a request is
counted from its header against the request's budgets (pixels and decoded
bytes, running totals over its items) and takes its bytes from the process's
budget (`DecodedMedia`), all before the request's first image is decoded.
The bytes go back when the request ends: until then its images, or what the
model's processor made of them, are held for it.

Everything here runs on the event loop, so the counts need no lock.
"""

from __future__ import annotations

from typing import Any

from ..budgets import RequestBudgets
from ..errors import BudgetFullError, InvalidRequestError

# Bytes a pixel takes in PIL's memory, by mode: one-band 8-bit modes take one,
# 16-bit ones two, every other mode (RGB included, padded) four.
_ONE_BYTE_MODES = frozenset({"1", "L", "P"})


def decoded_bytes(width: int, height: int, mode: str) -> int:
    """The bytes an image of this header takes once decoded and converted to RGB.

    The decoded image in its own mode and its RGB copy live together while
    it is converted, so both count.
    """
    pixels = width * height
    if mode in _ONE_BYTE_MODES:
        own = pixels
    elif mode.startswith("I;16"):
        own = 2 * pixels
    else:
        own = 4 * pixels
    return own + (4 * pixels if mode != "RGB" else 0)


class DecodedMedia:
    """The bytes of decoded images this process holds for running requests, and its limit.

    Args:
        budgets: the budgets; `max_media_bytes_in_flight` is this one's limit.
    """

    def __init__(self, budgets: RequestBudgets) -> None:
        self.budgets = budgets
        self.limit = budgets.max_media_bytes_in_flight
        self._held = 0

    @property
    def held(self) -> int:
        """Bytes held now for running requests."""
        return self._held

    def request(self) -> RequestMedia:
        """A new request's account: its totals start at zero."""
        return RequestMedia(self)

    def _take(self, field: str, nbytes: int) -> None:
        if self._held + nbytes > self.limit:
            raise BudgetFullError(
                field,
                f"decoding this image ({nbytes} bytes) would take this server's decoded images "
                f"in flight past its budget of {self.limit} bytes (--max-media-bytes-in-flight, "
                f"{self._held} held now); retry later or on another replica",
            )
        self._held += nbytes

    def _give_back(self, nbytes: int) -> None:
        self._held -= nbytes


class RequestMedia:
    """One request's images: their running totals, and the bytes it holds of the process's.

    Release it when the request ends (`release`); releasing twice is harmless.
    """

    def __init__(self, pool: DecodedMedia) -> None:
        self._pool = pool
        self.pixels = 0
        self.bytes = 0

    def admit(self, field: str, image: Any) -> None:
        """Count an opened (not yet decoded) image against the budgets, or refuse it.

        Args:
            field: the request field naming the image.
            image: a PIL image as `Image.open` returns it (header read only).

        Raises:
            InvalidRequestError: the request's images together would pass a
                per-request budget.
            BudgetFullError: the process's budget cannot take them now.
        """
        budgets = self._pool.budgets
        width, height = image.size
        pixels = self.pixels + width * height
        if pixels > budgets.max_request_media_pixels:
            raise InvalidRequestError(
                field,
                f"image is {width}x{height}; the request's images would come to {pixels} "
                f"pixels, more than this server's budget of {budgets.max_request_media_pixels} "
                "per request (--max-request-media-pixels)",
            )
        nbytes = decoded_bytes(width, height, image.mode)
        total = self.bytes + nbytes
        if total > budgets.max_request_media_bytes:
            raise InvalidRequestError(
                field,
                f"image is {width}x{height} ({image.mode}); decoded, the request's images would "
                f"take {total} bytes, more than this server's budget of "
                f"{budgets.max_request_media_bytes} per request (--max-request-media-bytes)",
            )
        self._pool._take(field, nbytes)
        self.pixels, self.bytes = pixels, total

    def release(self) -> None:
        """Give the request's bytes back to the process (at its end)."""
        self._pool._give_back(self.bytes)
        self.bytes = 0
