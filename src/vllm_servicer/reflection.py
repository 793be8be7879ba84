"""Server reflection over the mounted services' descriptors, and nothing else.

The protocol's descriptors live in a private pool (see vllm_servicer.proto);
health and reflection live in protobuf's default pool. Reflection looks in
both, so `grpcurl` resolves every service mounted here. It answers only for the
files that define the mounted services and the files they import: reflection
needs no credentials, and the default pool also holds whatever else the host
process loaded (its own services, their internal messages).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from google.protobuf import descriptor_pool
from google.protobuf.descriptor import Descriptor, FileDescriptor

from .proto import POOL


class ChainedPool:
    """A read-only view that answers descriptor lookups from several pools in order.

    Args:
        pools: where to look, first match wins (default: this package's pool,
            then protobuf's default pool).
        services: when given, only the files defining these services (full
            names) and their imports are visible; any other lookup is a KeyError.
    """

    def __init__(
        self, *pools: descriptor_pool.DescriptorPool, services: Iterable[str] | None = None
    ) -> None:
        self._pools = pools or (POOL, descriptor_pool.Default())
        self._files: frozenset[str] | None = None
        if services is not None:
            self._files = frozenset(self._closure(services))

    def _closure(self, services: Iterable[str]) -> set[str]:
        seen: set[str] = set()
        todo = []
        for service in services:
            try:
                todo.append(self._first("FindFileContainingSymbol", service))
            except KeyError:
                continue
        while todo:
            file = todo.pop()
            if file.name not in seen:
                seen.add(file.name)
                todo.extend(file.dependencies)
        return seen

    def _visible(self, file: FileDescriptor, key: object) -> None:
        if self._files is not None and file.name not in self._files:
            raise KeyError(key)

    def _first(self, method: str, *args: object) -> Any:
        last: Exception | None = None
        for pool in self._pools:
            try:
                return getattr(pool, method)(*args)
            except (KeyError, TypeError) as exc:
                last = exc
        raise last if last is not None else KeyError(args)

    def FindFileByName(self, name: str) -> FileDescriptor:  # noqa: N802 - DescriptorPool's API
        found: FileDescriptor = self._first("FindFileByName", name)
        self._visible(found, name)
        return found

    def FindFileContainingSymbol(self, symbol: str) -> FileDescriptor:  # noqa: N802
        found: FileDescriptor = self._first("FindFileContainingSymbol", symbol)
        self._visible(found, symbol)
        return found

    def FindMessageTypeByName(self, name: str) -> Descriptor:  # noqa: N802
        found: Descriptor = self._first("FindMessageTypeByName", name)
        self._visible(found.file, name)
        return found

    # An extension is a FieldDescriptor, whose `file` protobuf's stubs leave out.
    def FindExtensionByNumber(self, message: Descriptor, number: int) -> Any:  # noqa: N802
        found = self._first("FindExtensionByNumber", message, number)
        self._visible(found.file, number)
        return found

    def FindAllExtensions(self, message: Descriptor) -> list[Any]:  # noqa: N802
        found: list[Any] = []
        for pool in self._pools:
            try:
                found.extend(pool.FindAllExtensions(message))
            except (KeyError, TypeError):
                continue
        if self._files is None:
            return found
        return [extension for extension in found if extension.file.name in self._files]
