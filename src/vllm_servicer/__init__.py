"""vllm-servicer: serve vLLM's gRPC engine protocol from any grpc.aio server.

from vllm_servicer import mount
mount(server, async_llm)

The names below load on first use (PEP 562): importing the package, or a
part of it that needs no engine (`vllm_servicer.interceptors`), imports no vLLM.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names of _SOURCES, for type checkers (test_packaging compares)
    from .budgets import RequestBudgets
    from .engine import EngineClient
    from .errors import InvalidRequestError
    from .health import EngineHealthServicer
    from .interceptors import (
        AuthInterceptor,
        InflightInterceptor,
        MetricsInterceptor,
        TracingInterceptor,
    )
    from .mounting import MountedServices, MountError, mount
    from .options import MediaRefOptions, MountOptions, server_options
    from .proto import SERVICE_NAME, VLLM_ENGINE_SERVICE
    from .servicer import VllmEngineServicer
    from .servicer.state import MountState
    from .status import ERROR_TABLE

try:
    __version__ = importlib.metadata.version("vllm-servicer")  # pyproject.toml's, when installed
except importlib.metadata.PackageNotFoundError:  # imported from a source tree
    __version__ = "0+unknown"

# Each public name and the submodule that defines it: the one list of them.
_SOURCES: dict[str, str] = {
    "ERROR_TABLE": ".status",
    "SERVICE_NAME": ".proto",
    "EngineClient": ".engine",
    "EngineHealthServicer": ".health",
    "AuthInterceptor": ".interceptors",
    "InflightInterceptor": ".interceptors",
    "InvalidRequestError": ".errors",
    "MediaRefOptions": ".options",
    "MetricsInterceptor": ".interceptors",
    "MountError": ".mounting",
    "TracingInterceptor": ".interceptors",
    "MountedServices": ".mounting",
    "MountOptions": ".options",
    "MountState": ".servicer.state",
    "RequestBudgets": ".budgets",
    "VLLM_ENGINE_SERVICE": ".proto",
    "VllmEngineServicer": ".servicer",
    "mount": ".mounting",
    "server_options": ".options",
}

__all__ = [*sorted(_SOURCES), "__version__"]


def __getattr__(name: str) -> Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(source, __name__), name)
    globals()[name] = value  # later lookups find it without this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
