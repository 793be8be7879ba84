"""The protocols' servicers (VllmEngine, vllm.Inference, vllm.Control, Pooling,
Render) and what their RPCs share: the one generation preparation and call
frame (`engine_call.py`), the tenant-aware engine (`tenant_engine.py`), the
registry of running ids (`tenancy.py`) and the mount's state (`state.py`)."""

from .vllm_engine import VllmEngineServicer

__all__ = ["VllmEngineServicer"]
