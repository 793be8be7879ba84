"""Generated protocol modules (run `make proto`): `vllm.grpc.engine.VllmEngine`,
and vLLM's own `vllm.Inference` and `vllm.Control`.

from vllm_servicer.proto import vllm_engine_pb2, vllm_engine_pb2_grpc

The `*_pb2_grpc` modules import grpc, so they load on first use: code that
needs only the messages (conversion) does not import grpc.
"""

from __future__ import annotations

import importlib
import types
from typing import TYPE_CHECKING

from . import common_pb2, control_pb2, inference_pb2, vllm_engine_pb2
from ._pool import POOL

if TYPE_CHECKING:
    from . import common_pb2_grpc, control_pb2_grpc, inference_pb2_grpc, vllm_engine_pb2_grpc

SERVICE_NAME: str = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name

GENERATE_METHOD: str = f"/{SERVICE_NAME}/Generate"
EMBED_METHOD: str = f"/{SERVICE_NAME}/Embed"
INFERENCE_SERVICE: str = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
CONTROL_SERVICE: str = control_pb2.DESCRIPTOR.services_by_name["Control"].full_name

GENERATION_METHODS: frozenset[str] = frozenset(
    (GENERATE_METHOD, f"/{INFERENCE_SERVICE}/Generate", f"/{INFERENCE_SERVICE}/GenerateStream")
)
"""The full names of the generation calls, whose servicers keep a usage record."""
ENGINE_METHODS: frozenset[str] = GENERATION_METHODS | {EMBED_METHOD}
"""The full names of the calls that run on the engine (generation and embedding)."""

__all__ = [
    "CONTROL_SERVICE",
    "EMBED_METHOD",
    "ENGINE_METHODS",
    "GENERATE_METHOD",
    "GENERATION_METHODS",
    "INFERENCE_SERVICE",
    "POOL",
    "SERVICE_NAME",
    "common_pb2",
    "common_pb2_grpc",
    "control_pb2",
    "control_pb2_grpc",
    "inference_pb2",
    "inference_pb2_grpc",
    "vllm_engine_pb2",
    "vllm_engine_pb2_grpc",
]

_GRPC_MODULES = frozenset(
    ("common_pb2_grpc", "vllm_engine_pb2_grpc", "inference_pb2_grpc", "control_pb2_grpc")
)


def __getattr__(name: str) -> types.ModuleType:
    if name not in _GRPC_MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # The import binds the submodule on this package: later lookups skip this function.
    return importlib.import_module(f".{name}", __name__)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
