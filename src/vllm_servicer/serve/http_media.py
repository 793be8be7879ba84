"""The media vLLM's HTTP API fetches: http(s) only from the domains of
`--allowed-media-domains`, and no redirect.

vLLM's chat API fetches every http(s) `image_url` (audio, video) a request
names when `--allowed-media-domains` is not given, and follows redirects
(VLLM_MEDIA_URL_ALLOW_REDIRECTS defaults to 1): a client could make the
server fetch from its own network (127.0.0.1, 169.254.169.254), which the
gRPC side allows only with --enable-media-refs and a domain list.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.connections import HTTPConnection

__all__ = ["MEDIA_FETCHING_OFF", "gate_media_fetching"]

MEDIA_FETCHING_OFF = (
    "this server fetches no media over http(s): send the image inline (a data: URL), "
    "or ask the operator to allow its domain with --allowed-media-domains"
)


def gate_media_fetching() -> None:
    """Make vLLM's media connector fetch http(s) URLs only from the domains of
    `--allowed-media-domains`, and follow no redirect.

    vLLM builds its connector by name from a registry (`VLLM_MEDIA_CONNECTOR`,
    "http" by default; the same in 0.31-0.33): the class registered as "http"
    is replaced by a subclass that refuses http(s) URLs while the domain list
    is empty, and fetches without redirects unless `VLLM_MEDIA_URL_ALLOW_REDIRECTS`
    is set in the environment (a redirect could leave the listed domains).
    data: URLs are untouched; file: URLs stay behind vLLM's own
    `--allowed-local-media-path`. Idempotent; the launcher's process only.
    """
    from vllm.multimodal.media import MEDIA_CONNECTOR_REGISTRY

    registered = MEDIA_CONNECTOR_REGISTRY.name2class.get("http")
    if registered is None or getattr(registered, "_servicer_gated", False):
        return
    MEDIA_CONNECTOR_REGISTRY.register("http")(_gated_connector(registered))


def _gated_connector(base: Any) -> type:
    class GatedMediaConnector(base):  # type: ignore[misc]
        """vLLM's connector, fetching http(s) only from listed domains, without redirects."""

        _servicer_gated = True
        connection: HTTPConnection | _WithoutRedirects
        allowed_media_domains: list[str]

        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)
            if "VLLM_MEDIA_URL_ALLOW_REDIRECTS" not in os.environ:
                self.connection = _WithoutRedirects(self.connection)

        def load_from_url(self, url: str, *args: object, **kwargs: object) -> object:
            self._refuse_unlisted(url)
            return super().load_from_url(url, *args, **kwargs)

        async def load_from_url_async(self, url: str, *args: object, **kwargs: object) -> object:
            self._refuse_unlisted(url)
            return await super().load_from_url_async(url, *args, **kwargs)

        def _refuse_unlisted(self, url: str) -> None:
            # Every scheme but data: and file: is one vLLM fetches over the
            # network (or refuses): decided on the text's first bytes, so no
            # URL parser can read it differently.
            if not self.allowed_media_domains and url[:5].lower() not in ("data:", "file:"):
                raise ValueError(MEDIA_FETCHING_OFF)

    return GatedMediaConnector


class _WithoutRedirects:
    """vLLM's HTTP connection, with `allow_redirects` always off."""

    def __init__(self, connection: HTTPConnection | _WithoutRedirects) -> None:
        self._connection = connection

    def get_bytes(self, url: str, **kwargs: Any) -> bytes:
        return bytes(self._connection.get_bytes(url, **{**kwargs, "allow_redirects": False}))

    async def async_get_bytes(self, url: str, **kwargs: Any) -> bytes:
        kwargs["allow_redirects"] = False
        return bytes(await self._connection.async_get_bytes(url, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._connection, name)
