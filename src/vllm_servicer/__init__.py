"""vllm-servicer: serve vLLM's gRPC engine protocol from any grpc.aio server.

from vllm_servicer import mount
mount(server, async_llm)
"""

import importlib.metadata

# First: an untested vLLM fails here, before any module uses it.
from . import _vllm_version  # noqa: F401
from .engine import EngineClient
from .errors import ERROR_TABLE, InvalidRequestError
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
