"""`FairStepScheduler` step by step, over vLLM's own scheduler with a real KV cache.

No model runs: vLLM's `Scheduler` is built from the tiny model's
configuration with a KV cache of a chosen size, requests are added as the
engine adds them, and each `schedule()` is read as the model runner would get
it. What the launcher tests show on the wire (`test_fair_steps.py`) is
checked here one step at a time, with the faults a reviewer found in an
earlier shape: a light request that could not be admitted stopping every
step, a held prompt's LoRA adapter left out of vLLM's count, and vLLM's
asynchronous scheduler lost to a custom class.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from vllm_servicer.fair_work import SHARED_STEP_TOKENS_ENV, TENANT_ARG

torch = pytest.importorskip("torch")

from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from vllm_servicer.fair_steps import FairStepAsyncScheduler, FairStepScheduler  # noqa: E402
from vllm_servicer.testing.tiny_model import ensure_tiny_model  # noqa: E402

BLOCK = 16
SHORT_STEP = 64
_arrivals = itertools.count(1)


def _scheduler(cls: type[Scheduler], blocks: int = 400, budget: int = 128, **engine: Any) -> Any:
    """`cls` over a KV cache of `blocks` blocks, a step budget of `budget` tokens,
    chunked prefill and the priority policy; `engine` sets `VllmConfig` fields
    (`lora_config`) or, after it is built, the scheduler configuration's."""
    model = ModelConfig(model=str(ensure_tiny_model()), dtype="float32", max_model_len=512, seed=0)
    scheduler = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=budget,
        max_model_len=512,
        enable_chunked_prefill=True,
        policy="priority",
        is_encoder_decoder=False,
    )
    cache = CacheConfig(block_size=BLOCK, cache_dtype="auto", enable_prefix_caching=False)
    cache.num_gpu_blocks = blocks
    lora = {"lora_config": engine.pop("lora_config")} if "lora_config" in engine else {}
    vllm_config = VllmConfig(
        model_config=model, scheduler_config=scheduler, cache_config=cache, **lora
    )
    for name, value in engine.items():  # after the platform's own choices (a CPU's)
        setattr(vllm_config.scheduler_config, name, value)
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=16, dtype=torch.float32)
    kv_cache = KVCacheConfig(
        num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["x"], spec)]
    )
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK,
    )


def _request(tenant: str, tokens: int, priority: int, **fields: Any) -> Request:
    arrival = next(_arrivals)
    params = SamplingParams(max_tokens=4, extra_args={TENANT_ARG: tenant})
    return Request(
        f"{tenant}-{arrival}", list(range(3, 3 + tokens)), params, None,
        arrival_time=float(arrival), priority=priority, **fields,
    )  # fmt: skip


@pytest.fixture(autouse=True)
def _short_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SHARED_STEP_TOKENS_ENV, str(SHORT_STEP))


def _steps(scheduler: Any, count: int) -> list[dict[str, int]]:
    """The tokens each of the next `count` steps schedules, by request."""
    return [dict(scheduler.schedule().num_scheduled_tokens) for _ in range(count)]


@pytest.mark.parametrize("cls", [Scheduler, FairStepScheduler], ids=["vllm", "fair-steps"])
def test_a_light_request_joins_the_next_step_before_a_running_prompts_chunks(
    cls: type[Scheduler],
) -> None:
    scheduler = _scheduler(cls)
    a, a_next = _request("a", 480, 100), _request("a", 480, 300)
    scheduler.add_request(a)
    scheduler.add_request(a_next)
    assert _steps(scheduler, 1) == [{a.request_id: 128}]
    b = _request("b", 8, 200)  # ahead of A's waiting prompt, behind its running one
    scheduler.add_request(b)
    if cls is Scheduler:
        # vLLM: the running prompt's chunks take each step; B waits for its prefill to end.
        assert _steps(scheduler, 3) == [
            {a.request_id: 128},
            {a.request_id: 128},
            {a.request_id: 96, b.request_id: 8, a_next.request_id: 24},
        ]
        return
    # B alone in the next step; then A's prompt goes on, in short steps.
    assert _steps(scheduler, 3) == [{b.request_id: 8}] + [{a.request_id: SHORT_STEP}] * 2


def test_one_tenant_is_scheduled_as_vllm_schedules_it() -> None:
    """A's long prompts and short ones, and a client priority of its own: the
    same steps as vLLM's own scheduler."""
    plans = []
    for cls in (Scheduler, FairStepScheduler):
        scheduler = _scheduler(cls)
        for tokens, priority in ((480, 100), (8, 50), (300, 120), (16, 10)):
            scheduler.add_request(_request("a", tokens, priority))
        plans.append([sorted(step.values()) for step in _steps(scheduler, 8)])
    assert plans[0] == plans[1]
    assert any(plans[0]), "nothing was scheduled"


def test_a_light_request_without_kv_blocks_holds_a_prompt_one_step_only() -> None:
    """The KV cache has no room for B: the step that held A's prompt for it
    admits nothing, and A's prompt runs from the next step on; B is not let
    hold it again (an earlier shape stopped every step from then on)."""
    scheduler = _scheduler(FairStepScheduler, blocks=19, budget=256)
    a = _request("a", 280, 100)
    scheduler.add_request(a)
    assert _steps(scheduler, 1) == [{a.request_id: 256}]
    scheduler.add_request(_request("a", 280, 300))
    scheduler.add_request(_request("b", 60, 200))
    assert _steps(scheduler, 2) == [{}, {a.request_id: 24}]
    assert a.num_computed_tokens == a.num_prompt_tokens


def test_with_lora_adapters_no_prompt_is_held() -> None:
    """vLLM counts the adapters of its running requests only: a held prompt's
    would be left out, and a second adapter past `max_loras` stops the engine."""
    from vllm.config import LoRAConfig
    from vllm.lora.request import LoRARequest

    scheduler = _scheduler(FairStepScheduler, lora_config=LoRAConfig(max_loras=1, max_lora_rank=8))
    a = _request("a", 480, 100, lora_request=LoRARequest("one", 1, "/one"))
    scheduler.add_request(a)
    assert _steps(scheduler, 1) == [{a.request_id: 128}]
    b = _request("b", 8, 200, lora_request=LoRARequest("two", 2, "/two"))
    scheduler.add_request(b)
    for step in _steps(scheduler, 4):  # vLLM's assertion would stop the engine here
        assert b.request_id not in step or a.request_id not in step


def test_it_schedules_asynchronously_where_the_engine_does() -> None:
    """A scheduler class replaces vLLM's choice of `AsyncScheduler` (a GPU's
    default): the fair steps build themselves over it."""
    asynchronous = _scheduler(FairStepScheduler, async_scheduling=True)
    assert isinstance(asynchronous, FairStepAsyncScheduler)
    assert isinstance(asynchronous, AsyncScheduler)
    assert not isinstance(_scheduler(FairStepScheduler), AsyncScheduler)
