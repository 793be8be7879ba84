"""Stand-in engines for tests: shaped like vLLM's `AsyncLLM`; one able to die on demand.

`StandInEngine` has every member and does nothing; tests that need an engine
without a feature a real one always has (no local tokenizer, stats off)
subclass it.

A real engine cannot be made to die at a chosen moment, mid-stream, from a
test; this stand-in can. It implements the `EngineClient` protocol from
`vllm_servicer.engine` and produces synthetic tokens (real `RequestOutput`
objects) at a fixed pace. After `die()`, it behaves as vLLM's `AsyncLLM` does
when its EngineCore process is gone: `errored` is True, every running
`generate()` raises `EngineDeadError`, and so does every new call.
It is used only for engine-death tests; everything else runs a real engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterable, Mapping
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, TypeVar

from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.exceptions import EngineDeadError

if TYPE_CHECKING:
    from vllm.config.kv_events import KVEventsConfig
    from vllm.outputs import PoolingRequestOutput
    from vllm.pooling_params import PoolingParams
    from vllm.sampling_params import SamplingParams
    from vllm.tasks import SupportedTask
    from vllm.v1.metrics.loggers import StatLoggerManager

    from ..engine import EnginePrompt

_Prompt = TypeVar("_Prompt")


async def _echo_prompt(prompt: _Prompt, arrival_time: float) -> _Prompt:
    return prompt


class StandInEngine:
    """Every member of `EngineClient`, answering as an idle engine would (tests only).

    One rank, stats off, no profiler, no KV events; token prompts go to
    `generate()` as they are. Once `errored` is True each call raises
    `EngineDeadError`, as `AsyncLLM`'s do when its EngineCore process is gone.
    Tests subclass it for the members they look at.
    """

    def __init__(self, model_config: Any = None, vllm_config: Any = None) -> None:
        self.model_config = model_config if model_config is not None else SimpleNamespace()
        self.vllm_config = vllm_config if vllm_config is not None else SimpleNamespace()
        self.renderer = SimpleNamespace(
            process_for_engine=lambda prompt, arrival_time: prompt,
            process_for_engine_async=_echo_prompt,
        )
        self.engine_core = SimpleNamespace(engine_ranks_managed=[0])
        self.logger_manager: StatLoggerManager | None = None

    @property
    def errored(self) -> bool:
        return False

    async def generate(
        self,
        prompt: EnginePrompt,
        sampling_params: SamplingParams,
        request_id: str,
        **kwargs: object,
    ) -> AsyncGenerator[RequestOutput, None]:
        raise EngineDeadError() if self.errored else NotImplementedError("no generation here")
        yield  # pragma: no cover - makes this an async generator

    async def encode(
        self,
        prompt: EnginePrompt,
        pooling_params: PoolingParams,
        request_id: str,
        **kwargs: object,
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        raise EngineDeadError() if self.errored else NotImplementedError("no pooling here")
        yield  # pragma: no cover - makes this an async generator

    async def get_supported_tasks(self) -> tuple[SupportedTask, ...]:
        # AsyncLLM asks the EngineCore process, so this fails once it is gone.
        if self.errored:
            raise EngineDeadError()
        return ("generate", "embed")

    async def abort(self, request_id: str | Iterable[str]) -> None:
        if self.errored:
            raise EngineDeadError()

    async def is_paused(self) -> bool:
        # Unlike AsyncLLM's (which asks the EngineCore process, so raises once
        # it is gone), this answers after death too: GetServerInfo tests use that.
        return False

    async def notify_kv_transfer_request_rejected(
        self,
        request_id: str,
        kv_transfer_params: dict[str, object],
        *,
        data_parallel_rank: int | None = None,
    ) -> None:
        if self.errored:
            raise EngineDeadError()

    async def reset_prefix_cache(self) -> bool:
        if self.errored:
            raise EngineDeadError()
        return True

    async def start_profile(
        self,
        profile_prefix: str | None = None,
        *,
        delay_iterations: int | None = None,
        max_iterations: int | None = None,
    ) -> None:
        raise EngineDeadError() if self.errored else NotImplementedError("no profiler here")

    async def stop_profile(self) -> None:
        raise EngineDeadError() if self.errored else NotImplementedError("no profiler here")

    def get_kv_event_sources(self) -> dict[int, KVEventsConfig]:
        return {}


class FaultEngine(StandInEngine):
    """Stand-in for `AsyncLLM` that dies mid-stream when told to (tests only).

    Args:
        step_interval: seconds between synthetic tokens.
        max_model_len: the context length it claims.
    """

    def __init__(self, step_interval: float = 0.02, max_model_len: int = 512) -> None:
        self._step_interval = step_interval
        self._dead = asyncio.Event()
        self.running: set[str] = set()
        self.generate_calls = 0
        self.model_config = SimpleNamespace(
            model="fault-engine",
            served_model_name="fault-engine",
            tokenizer="",
            max_model_len=max_model_len,
            runner_type="generate",
            dtype="float32",
            hf_config=SimpleNamespace(
                model_type="fault", architectures=[], eos_token_id=2, pad_token_id=0, bos_token_id=1
            ),
            get_vocab_size=lambda: 320,
        )
        super().__init__(model_config=self.model_config)

    @property
    def errored(self) -> bool:
        return self._dead.is_set()

    def die(self) -> None:
        """Kill the stand-in: running and future calls raise EngineDeadError."""
        self._dead.set()

    async def _step_or_die(self) -> None:
        # Either the next token is due, or the engine died first.
        try:
            await asyncio.wait_for(self._dead.wait(), self._step_interval)
        except TimeoutError:
            return
        raise EngineDeadError()

    async def generate(  # type: ignore[override]
        self,
        prompt: Any,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        tokenization_kwargs: dict[str, object] | None = None,
        trace_headers: Mapping[str, str] | None = None,
        data_parallel_rank: int | None = None,
        reasoning_ended: bool | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        self.generate_calls += 1
        if self.errored:
            raise EngineDeadError()
        prompt_ids = list(prompt["prompt_token_ids"]) if isinstance(prompt, dict) else [1]
        limit = sampling_params.max_tokens or 16
        delta = sampling_params.output_kind != RequestOutputKind.FINAL_ONLY
        produced: list[int] = []
        self.running.add(request_id)
        try:
            for i in range(limit):
                await self._step_or_die()
                token = 3 + i % 300
                produced.append(token)
                last = i == limit - 1
                if delta or last:
                    yield RequestOutput(
                        request_id=request_id,
                        prompt=None,
                        prompt_token_ids=prompt_ids,
                        prompt_logprobs=None,
                        outputs=[
                            CompletionOutput(
                                index=0,
                                text="",
                                token_ids=[token] if delta else list(produced),
                                cumulative_logprob=None,
                                logprobs=None,
                                finish_reason="length" if last else None,
                            )
                        ],
                        finished=last,
                    )
        finally:
            self.running.discard(request_id)

    async def encode(  # type: ignore[override]
        self,
        prompt: EnginePrompt,
        pooling_params: PoolingParams,
        request_id: str,
        *,
        trace_headers: Mapping[str, str] | None = None,
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        raise EngineDeadError() if self.errored else NotImplementedError("no pooling here")
        yield  # pragma: no cover - makes this an async generator
