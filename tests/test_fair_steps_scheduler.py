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

from vllm_servicer.fair_work import SCHEDULER_NAME, SHARED_STEP_TOKENS_ENV, TENANT_ARG

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

from vllm_servicer.fair_steps import (  # noqa: E402
    FairStepAsyncScheduler,
    FairStepScheduler,
    is_light,
)
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


def _request(
    tenant: str | None, tokens: int, priority: int, computed: int = 0, **fields: Any
) -> Request:
    """vLLM's request as the engine adds it, named for `tenant` (None: unnamed),
    `computed` of its prompt's tokens already run."""
    arrival = next(_arrivals)
    extra = None if tenant is None else {TENANT_ARG: tenant}
    params = SamplingParams(max_tokens=4, extra_args=extra)
    request = Request(
        f"{tenant}-{arrival}", list(range(3, 3 + tokens)), params, None,
        arrival_time=float(arrival), priority=priority, **fields,
    )  # fmt: skip
    request.num_computed_tokens = computed
    return request


@pytest.fixture(autouse=True)
def _short_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SHARED_STEP_TOKENS_ENV, str(SHORT_STEP))


def test_a_light_request_is_short_of_a_tenant_not_in_prefill_and_first_in_order() -> None:
    long = 480
    a_running = _request("a", long, 100, computed=256)
    a_waiting = [_request("a", long, 200 + i) for i in range(3)]
    b = _request("b", 16, 150)
    assert is_light(b, [a_running], a_waiting, 256)
    # A's own short prompt while A's prompts are in prefill: one tenant, vLLM's steps.
    assert not is_light(_request("a", 16, 90), [a_running], a_waiting, 256)
    # Nobody else's prompt waiting or in prefill: nothing to go before.
    assert not is_light(b, [_request("a", long, 100, computed=long)], [], 256)
    # A's prompts all waiting, none started: B goes before them all the same.
    assert is_light(b, [], a_waiting, 256)
    # A long prompt is no light request: two heavy tenants keep vLLM's long steps.
    assert not is_light(_request("b", long, 150), [a_running], a_waiting, 256)
    # B's own prompt in prefill: B is not light.
    assert not is_light(b, [a_running, _request("b", long, 120, computed=256)], [], 256)
    # A request the mount did not name (pooling) is a tenant of its own.
    assert is_light(_request(None, 16, 150), [a_running], [], 256)


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
    would be left out, and a second adapter past `max_loras` stops the engine
    (0.34 asserts on every running request's adapter, 0.31 to 0.33 on a
    step's)."""
    from vllm.config import LoRAConfig
    from vllm.lora.request import LoRARequest

    scheduler = _scheduler(FairStepScheduler, lora_config=LoRAConfig(max_loras=1, max_lora_rank=8))
    a = _request("a", 480, 100, lora_request=LoRARequest("one", 1, "/one"))
    scheduler.add_request(a)
    assert _steps(scheduler, 1) == [{a.request_id: 128}]
    b = _request("b", 8, 200, lora_request=LoRARequest("two", 2, "/two"))
    scheduler.add_request(b)
    for _ in range(4):
        scheduler.schedule()
        adapters = {request.lora_request.lora_int_id for request in scheduler.running}
        assert len(adapters) <= 1, f"adapters {adapters} running past max_loras=1"


def test_it_schedules_asynchronously_where_the_engine_does() -> None:
    """A scheduler class replaces vLLM's choice of `AsyncScheduler` (a GPU's
    default): the fair steps build themselves over it."""
    asynchronous = _scheduler(FairStepScheduler, async_scheduling=True)
    assert isinstance(asynchronous, FairStepAsyncScheduler)
    assert isinstance(asynchronous, AsyncScheduler)
    assert not isinstance(_scheduler(FairStepScheduler), AsyncScheduler)


def test_the_name_the_launcher_gives_vllm_loads_this_class() -> None:
    from vllm.utils.import_utils import resolve_obj_by_qualname

    assert resolve_obj_by_qualname(SCHEDULER_NAME) is FairStepScheduler
