"""The slice of vLLM's engine client that the servicers use.

Typed as a Protocol so that anything shaped like vLLM's `AsyncLLM` (its
`EngineClient`) can be mounted, including a fault-injecting stand-in in tests.
vLLM is not imported here: the interceptors import this module, and they run
without vLLM.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterable, Mapping
from typing import TYPE_CHECKING, Protocol, TypeAlias, runtime_checkable

if TYPE_CHECKING:
    from vllm.config import ModelConfig, VllmConfig
    from vllm.config.kv_events import KVEventsConfig
    from vllm.inputs import EngineInput, PromptType
    from vllm.outputs import PoolingRequestOutput, RequestOutput
    from vllm.pooling_params import PoolingParams
    from vllm.renderers.inputs.tokenize import TokPrompt
    from vllm.sampling_params import SamplingParams
    from vllm.tasks import SupportedTask
    from vllm.tokenizers import TokenizerLike
    from vllm.v1.metrics.loggers import StatLoggerManager

    EnginePrompt: TypeAlias = PromptType | EngineInput
    """A prompt as the engine takes it: a text, token or embeddings prompt
    (vLLM's `PromptType`), or one already rendered (`EngineInput`)."""


def missing_members(engine: object) -> list[str]:
    """The `EngineClient` members that `engine` lacks (none for vLLM's `AsyncLLM`)."""
    declared = set(EngineClient.__annotations__) | {
        name for name in vars(EngineClient) if not name.startswith("_")
    }
    return sorted(name for name in declared if not hasattr(engine, name))


def require_engine(engine: object) -> None:
    """Refuse an engine that lacks an `EngineClient` member, naming what it lacks.

    Raised when a servicer is built, not as an AttributeError in the middle
    of some later request.

    Raises:
        TypeError: `engine` lacks a member (the message names each).
    """
    missing = missing_members(engine)
    if missing:
        raise TypeError(
            f"the engine must be a vLLM AsyncLLM or shaped like one (EngineClient); "
            f"{type(engine).__name__} has no {', '.join(missing)}"
        )


def served_model_name(engine: object) -> str:
    """The model name the engine serves (`--served-model-name`, else the model path).

    vLLM's `ModelConfig` settles it when built (its `get_served_model_name`:
    the first of several names, else the model); this reads that answer.

    Args:
        engine: an `AsyncLLM` or anything with a vLLM `model_config`.
    """
    return str(getattr(getattr(engine, "model_config", None), "served_model_name", "") or "")


class Renderer(Protocol):
    """The part of vLLM's renderer (`AsyncLLM.renderer`) used: prompt to engine input."""

    def process_for_engine(self, prompt: TokPrompt, arrival_time: float) -> EngineInput: ...

    async def process_for_engine_async(
        self, prompt: TokPrompt, arrival_time: float
    ) -> EngineInput: ...

    def get_tokenizer(self) -> TokenizerLike:
        """The engine's tokenizer (vLLM's `AsyncLLM.renderer` has one in every release)."""
        ...


class EngineCoreClient(Protocol):
    """The part of vLLM's engine-core client (`AsyncLLM.engine_core`) used."""

    @property
    def engine_ranks_managed(self) -> list[int]:
        """The data-parallel ranks this frontend serves."""
        ...


@runtime_checkable
class EngineClient(Protocol):
    """What the servicers use of the engine (vLLM's `AsyncLLM` fits); only
    vllm.Control's pause, sleep, weight-update and shutdown calls reach past
    it, to `AsyncLLM`'s own.

    Every member is required: `AsyncLLM` has each of them in every supported
    vLLM (0.31 to 0.34, `_vllm_version.SUPPORTED_VLLM`), so the package reads
    them directly; `require_engine` refuses an engine lacking one when a
    servicer is built. Two are present but vary, and only there does the
    package handle the difference (the section at the end):

    - `logger_manager` is None when the engine collects no stats
      (`--disable-log-stats`); GetLoads then reports no ranks' figures.
    - `start_profile`'s keywords beyond the prefix vary by release, so none
      is declared: `vllm_releases.start_profile_options` reads which the
      engine takes, and `admin.start_profile` passes only those.

    `isinstance(x, EngineClient)` checks only that the members exist.
    """

    model_config: ModelConfig
    vllm_config: VllmConfig

    @property
    def errored(self) -> bool: ...

    @property
    def renderer(self) -> Renderer: ...

    @property
    def engine_core(self) -> EngineCoreClient: ...

    def generate(
        self,
        prompt: EnginePrompt,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        tokenization_kwargs: dict[str, object] | None = None,
        trace_headers: Mapping[str, str] | None = None,
        data_parallel_rank: int | None = None,
        reasoning_ended: bool | None = None,
    ) -> AsyncGenerator[RequestOutput, None]: ...

    def encode(
        self,
        prompt: EnginePrompt,
        pooling_params: PoolingParams,
        request_id: str,
        *,
        trace_headers: Mapping[str, str] | None = None,
    ) -> AsyncGenerator[PoolingRequestOutput, None]: ...

    async def abort(self, request_id: str | Iterable[str]) -> None: ...

    async def is_paused(self) -> bool: ...

    async def get_supported_tasks(self) -> tuple[SupportedTask, ...]: ...

    async def notify_kv_transfer_request_rejected(
        self,
        request_id: str,
        kv_transfer_params: dict[str, object],
        *,
        data_parallel_rank: int | None = None,
    ) -> None: ...

    async def reset_prefix_cache(self) -> bool:
        """Whether the prefix cache was reset (False while running requests hold it)."""
        ...

    async def stop_profile(self) -> None: ...

    def get_kv_event_sources(self) -> dict[int, KVEventsConfig]:
        """Each engine core's KVEventsConfig by rank, as they reported it (may be empty)."""
        ...

    # ----- present, but varying by vLLM release or engine configuration ----

    # None when the engine collects no stats (--disable-log-stats):
    # `stats_tap.attach` handles None.
    logger_manager: StatLoggerManager | None

    async def start_profile(self, profile_prefix: str | None = None) -> None:
        """Start the profiler (vLLM 0.31's signature, which every supported release accepts).

        vLLM 0.32 adds keyword-only `delay_iterations` / `max_iterations`, 0.33
        `profiler_kwargs`; `vllm_releases.start_profile_options` reads which
        the engine takes before `admin.start_profile` passes them.
        """
        ...
