"""Server reflection over this package's descriptor pool and the default one.

The protocol's descriptors live in a private pool (see vllm_servicer.proto);
health, reflection and the host's own services live in protobuf's default
pool. Reflection looks in both, so `grpcurl` resolves every service mounted
on the server.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pool

from .proto import POOL


class ChainedPool:
    """A read-only view that answers descriptor lookups from several pools in order."""

    def __init__(self, *pools: descriptor_pool.DescriptorPool) -> None:
        self._pools = pools or (POOL, descriptor_pool.Default())

    def _first(self, method: str, *args: Any) -> Any:
        last: Exception | None = None
        for pool in self._pools:
            try:
                return getattr(pool, method)(*args)
            except (KeyError, TypeError) as exc:
                last = exc
        raise last if last is not None else KeyError(args)

    def FindFileByName(self, name: str) -> Any:  # noqa: N802 - DescriptorPool's API
        return self._first("FindFileByName", name)

    def FindFileContainingSymbol(self, symbol: str) -> Any:  # noqa: N802
        return self._first("FindFileContainingSymbol", symbol)

    def FindMessageTypeByName(self, name: str) -> Any:  # noqa: N802
        return self._first("FindMessageTypeByName", name)

    def FindExtensionByNumber(self, message: Any, number: int) -> Any:  # noqa: N802
        return self._first("FindExtensionByNumber", message, number)

    def FindAllExtensions(self, message: Any) -> list[Any]:  # noqa: N802
        found: list[Any] = []
        for pool in self._pools:
            try:
                found.extend(pool.FindAllExtensions(message))
            except (KeyError, TypeError):
                continue
        return found
