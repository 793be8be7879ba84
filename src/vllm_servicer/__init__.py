"""vllm-servicer: serve vLLM's gRPC engine protocol from any grpc.aio server.

from vllm_servicer import mount
mount(server, async_llm)

The names below load on first use (PEP 562): importing the package, or a
part of it that needs no engine (`vllm_servicer.interceptors`), imports no vLLM.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .engine import EngineClient
    from .errors import InvalidRequestError
    from .health import EngineHealthServicer
    from .interceptors import (
        AuthInterceptor,
        InflightInterceptor,
        MetricsInterceptor,
        TracingInterceptor,
    )
    from .media import MediaRefOptions
    from .mount import MountedServices, MountError, mount
    from .options import server_options
    from .proto import SERVICE_NAME
    from .servicer import VllmEngineServicer
    from .status import ERROR_TABLE

try:
    __version__ = importlib.metadata.version("vllm-servicer")  # pyproject.toml's, when installed
except importlib.metadata.PackageNotFoundError:  # imported from a source tree
    __version__ = "0+unknown"

__all__ = [
    "ERROR_TABLE",
    "SERVICE_NAME",
    "EngineClient",
    "EngineHealthServicer",
    "AuthInterceptor",
    "InflightInterceptor",
    "InvalidRequestError",
    "MediaRefOptions",
    "MetricsInterceptor",
    "MountError",
    "TracingInterceptor",
    "MountedServices",
    "VllmEngineServicer",
    "__version__",
    "mount",
    "server_options",
]

# Each public name and the submodule that defines it (the imports above, for type checkers).
_SOURCES: dict[str, str] = {
    "ERROR_TABLE": ".status",
    "SERVICE_NAME": ".proto",
    "EngineClient": ".engine",
    "EngineHealthServicer": ".health",
    "AuthInterceptor": ".interceptors",
    "InflightInterceptor": ".interceptors",
    "InvalidRequestError": ".errors",
    "MediaRefOptions": ".media",
    "MetricsInterceptor": ".interceptors",
    "MountError": ".mount",
    "TracingInterceptor": ".interceptors",
    "MountedServices": ".mount",
    "VllmEngineServicer": ".servicer",
    "mount": ".mount",
    "server_options": ".options",
}


def __getattr__(name: str) -> Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(source, __name__), name)
    globals()[name] = value  # later lookups find it without this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value: Any) -> None:
        # Importing a submodule binds it on the package under its own name, and
        # `vllm_servicer.mount` is both a submodule and the function it defines:
        # the package keeps the function there, whichever is imported first.
        if (
            name in _SOURCES
            and isinstance(value, types.ModuleType)
            and value.__name__ == f"{self.__name__}.{name}"
        ):
            value = getattr(value, name, value)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
