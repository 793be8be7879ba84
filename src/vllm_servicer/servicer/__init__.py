"""The `vllm.grpc.engine.VllmEngine` servicer and the parts of each RPC."""

from .vllm_engine import VllmEngineServicer

__all__ = ["VllmEngineServicer"]
