"""The slice of vLLM's engine client that the servicer uses.

Typed as a Protocol so that anything shaped like vLLM's `AsyncLLM` (its
`EngineClient`) can be mounted, including a fault-injecting stand-in in tests.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterable, Mapping
from typing import Any, Protocol, runtime_checkable


def served_model_name(engine: Any) -> str:
    """The model name the engine serves (`--served-model-name`, else the model path).

    Args:
        engine: an `AsyncLLM` or anything with a vLLM `model_config`.
    """
    config = getattr(engine, "model_config", None)
    served = getattr(config, "served_model_name", None) or getattr(config, "model", "")
    if isinstance(served, (list, tuple)):
        served = served[0] if served else ""
    return str(served or "")


@runtime_checkable
class EngineClient(Protocol):
    """What `VllmEngineServicer` calls on the engine (vLLM's `AsyncLLM` fits)."""

    model_config: Any
    vllm_config: Any

    @property
    def errored(self) -> bool: ...

    def generate(
        self,
        prompt: Any,
        sampling_params: Any,
        request_id: str,
        *,
        tokenization_kwargs: dict[str, Any] | None = None,
        trace_headers: Mapping[str, str] | None = None,
        data_parallel_rank: int | None = None,
        reasoning_ended: bool | None = None,
    ) -> AsyncGenerator[Any, None]: ...

    def encode(
        self,
        prompt: Any,
        pooling_params: Any,
        request_id: str,
        *,
        trace_headers: Mapping[str, str] | None = None,
    ) -> AsyncGenerator[Any, None]: ...

    async def abort(self, request_id: str | Iterable[str]) -> None: ...
