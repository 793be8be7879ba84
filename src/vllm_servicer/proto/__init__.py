"""Generated protocol modules for `vllm.grpc.engine.VllmEngine` (run `make proto`).

from vllm_servicer.proto import vllm_engine_pb2, vllm_engine_pb2_grpc
"""

from . import common_pb2, common_pb2_grpc, vllm_engine_pb2, vllm_engine_pb2_grpc
from ._pool import POOL

SERVICE_NAME: str = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name

GENERATE_METHOD: str = f"/{SERVICE_NAME}/Generate"
EMBED_METHOD: str = f"/{SERVICE_NAME}/Embed"
ENGINE_METHODS: frozenset[str] = frozenset((GENERATE_METHOD, EMBED_METHOD))
"""The full names of the calls that run on the engine (Generate and Embed)."""

__all__ = [
    "EMBED_METHOD",
    "ENGINE_METHODS",
    "GENERATE_METHOD",
    "POOL",
    "SERVICE_NAME",
    "common_pb2",
    "common_pb2_grpc",
    "vllm_engine_pb2",
    "vllm_engine_pb2_grpc",
]
