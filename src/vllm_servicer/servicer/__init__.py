"""The `vllm.grpc.engine.VllmEngine` servicer and the parts of each RPC."""

from .service import VllmEngineServicer

__all__ = ["VllmEngineServicer"]
