"""Generated protocol modules (run `make proto`): `vllm.grpc.engine.VllmEngine`,
vLLM's own `vllm.Inference` and `vllm.Control`, this package's own
`vllm_servicer.v1.Pooling` and `Render` (`pooling_pb2`, `render_pb2`), ORCA's load reports
(`orca_load_report_pb2`, `orca_pb2`: cncf/xds's `xds.data.orca.v3` and
`xds.service.orca.v3`); the services' names and each method's role (`methods.py`).

from vllm_servicer.proto import vllm_engine_pb2, vllm_engine_pb2_grpc

The `*_pb2_grpc` modules import grpc, so they load on first use: code that
needs only the messages (conversion) does not import grpc.
"""

from __future__ import annotations

import importlib
import types
from typing import TYPE_CHECKING

from . import (
    common_pb2,
    control_pb2,
    inference_pb2,
    orca_load_report_pb2,
    orca_pb2,
    pooling_pb2,
    render_pb2,
    vllm_engine_pb2,
)
from ._pool import POOL
from .methods import (
    ADMIN_METHODS,
    CONTROL_SERVICE,
    COUNTED_METHODS,
    GENERATION_METHODS,
    INFERENCE_SERVICE,
    METHOD_ROLES,
    ORCA_SERVICE,
    POOLING_SERVICE,
    RENDER_SERVICE,
    ROUTING_METHODS,
    SERVICE_NAME,
    VLLM_ENGINE_SERVICE,
    VLLM_PROTO_VERSION,
    VLLM_SCHEMA_RELEASE,
    MethodRole,
)

if TYPE_CHECKING:
    from . import (
        common_pb2_grpc,
        control_pb2_grpc,
        inference_pb2_grpc,
        orca_pb2_grpc,
        pooling_pb2_grpc,
        render_pb2_grpc,
        vllm_engine_pb2_grpc,
    )

__all__ = [
    "ADMIN_METHODS",
    "CONTROL_SERVICE",
    "COUNTED_METHODS",
    "GENERATION_METHODS",
    "INFERENCE_SERVICE",
    "METHOD_ROLES",
    "ORCA_SERVICE",
    "POOL",
    "POOLING_SERVICE",
    "RENDER_SERVICE",
    "ROUTING_METHODS",
    "SERVICE_NAME",
    "VLLM_ENGINE_SERVICE",
    "VLLM_PROTO_VERSION",
    "VLLM_SCHEMA_RELEASE",
    "MethodRole",
    "common_pb2",
    "common_pb2_grpc",
    "control_pb2",
    "control_pb2_grpc",
    "inference_pb2",
    "inference_pb2_grpc",
    "orca_load_report_pb2",
    "orca_pb2",
    "orca_pb2_grpc",
    "pooling_pb2",
    "pooling_pb2_grpc",
    "render_pb2",
    "render_pb2_grpc",
    "vllm_engine_pb2",
    "vllm_engine_pb2_grpc",
]

_GRPC_MODULES = frozenset(
    (
        "common_pb2_grpc",
        "vllm_engine_pb2_grpc",
        "inference_pb2_grpc",
        "control_pb2_grpc",
        "orca_pb2_grpc",
        "pooling_pb2_grpc",
        "render_pb2_grpc",
    )
)


def __getattr__(name: str) -> types.ModuleType:
    if name not in _GRPC_MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # The import binds the submodule on this package: later lookups skip this function.
    return importlib.import_module(f".{name}", __name__)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
