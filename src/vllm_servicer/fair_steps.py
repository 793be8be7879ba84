"""vLLM's scheduler, in which a light tenant's request joins the next step.

The fair order (`fair_work.py`) tags each request with the work its tenant
has been served, and vLLM's priority scheduling admits the lowest tag first:
a light tenant's request goes ahead of a heavy tenant's queue. It does not go
ahead of the heavy tenant's prompts already in prefill. vLLM gives the running
requests the step's token budget before any waiting one, so the light request
waits for every chunk of those prompts, and for the step in progress, which
with a budget of thousands of tokens is long: on a CPU a 1,843-token prefill
step takes about 17 ms while a 16-token request alone gets its first token
in 3 ms.

`FairStepScheduler` changes two things while a light request is first in
the fair order. Light: its whole prompt fits in one short step, its tenant
has no prompt in prefill, and another tenant's prompts wait or are in
prefill. Then:

- it joins the next step before the running prompts' chunks, which sit that
  one step out (the step's decodes still run, and only the light request is
  admitted in the held prompts' place); never two steps running, so the held
  advance at least every other step, and not again for a while when the
  light request could not be admitted (no KV blocks for it); never with LoRA
  adapters (vLLM counts only the running requests' adapters);
- steps are short (`shared_step_tokens`, 192 by default) and every running
  decode gets its token before prefill chunks share what is left, until
  `SHARED_HOLD_SECONDS` after the last light request, so that the next one
  waits at most one short step.

With one tenant, or with long prompts only, it schedules exactly as vLLM
does: two heavy tenants keep vLLM's long steps, and their order is the tags'.
Tenants are told apart by the name the mount's engine puts in each request's
`SamplingParams.extra_args` (`TENANT_ARG`); a request without it (pooling)
counts as one tenant of its own.

Both changes need chunked prefill: with whole prompts only a short budget
would keep long prompts out, so with chunked prefill off it schedules as
vLLM does. The engine process loads it by name: start the engine with
`scheduler_cls="vllm_servicer.fair_steps.FairStepScheduler"` and
`scheduling_policy="priority"` (the launcher does both). The short step's
budget comes from `SHARED_STEP_TOKENS_ENV` in the engine's environment
(`--shared-step-tokens`), since vLLM's configuration has no field of ours.
The attributes it changes for one `schedule()` call are the same in vLLM 0.31
to 0.34 (`running`, `max_num_scheduled_tokens`, and the admission limits
`max_num_active_reqs` and `max_num_running_reqs`). A scheduler class replaces
vLLM's choice between `Scheduler` and `AsyncScheduler`, so it builds itself
over the one the configuration asks for.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from .fair_work import (
    SHARED_HOLD_SECONDS,
    SHARED_STEP_TOKENS,
    SHARED_STEP_TOKENS_ENV,
    TENANT_ARG,
)

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = [
    "FairStepAsyncScheduler",
    "FairStepScheduler",
    "is_light",
    "shared_step_tokens",
    "tenant_mark",
]

_STEP_LIMITS = ("max_num_running_reqs", "max_num_active_reqs")


def shared_step_tokens() -> int:
    """The short step's budget in this process (its environment, or the default)."""
    value = os.environ.get(SHARED_STEP_TOKENS_ENV, "")
    return int(value) if value.strip() else SHARED_STEP_TOKENS


def in_prefill(request: Request) -> bool:
    """Whether part of the request's prompt is still to be computed."""
    return bool(request.num_computed_tokens < request.num_prompt_tokens)


def tenant_mark(request: Request) -> object:
    """The tenant the mount's engine named in the request (`TENANT_ARG`); None unnamed."""
    params = request.sampling_params
    extra = params.extra_args if params is not None else None
    return extra.get(TENANT_ARG) if extra else None


def is_light(
    head: Request, running: list[Request], waiting: Iterable[Request], step_tokens: int
) -> bool:
    """Whether the first request in the fair order is light while another
    tenant's prompts wait or are in prefill.

    Light: its whole prompt fits in one short step and its tenant has no
    prompt in prefill. First: no waiting request has a better priority, so
    none of another tenant is ahead of it. Never with one tenant, or with long
    prompts only: then steps are vLLM's. `waiting` is read only when no other
    tenant is in prefill, and only until another tenant's request is found.
    """
    if head.num_prompt_tokens - head.num_computed_tokens > step_tokens:
        return False
    tenant = tenant_mark(head)
    prefilling = {tenant_mark(request) for request in running if in_prefill(request)}
    if tenant in prefilling:
        return False
    return bool(prefilling) or any(tenant_mark(request) != tenant for request in waiting)


def _queued(queue: Any) -> Iterable[Request]:
    """The waiting requests in any order: the priority queue's heap as it is (its
    iteration pops a copy, a sort), else the queue's own order."""
    heap = getattr(queue, "_heap", None)
    return heap if isinstance(heap, list) else queue


class FairStepScheduler(Scheduler):
    """vLLM's scheduler; a light tenant's request joins the next step, in short steps.

    Built as `FairStepAsyncScheduler` when the engine schedules asynchronously
    (a GPU's default), since a `scheduler_cls` replaces vLLM's choice of one.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> FairStepScheduler:
        config = kwargs.get("vllm_config", args[0] if args else None)
        asynchronous = getattr(getattr(config, "scheduler_config", None), "async_scheduling", False)
        chosen = FairStepAsyncScheduler if cls is FairStepScheduler and asynchronous else cls
        return super().__new__(chosen)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shared_step_tokens = shared_step_tokens()
        self._shared_until = float("-inf")
        self._no_hold_until = float("-inf")
        self._held_last_step = False
        # With LoRA adapters vLLM counts the adapters of `running` only: a held
        # prompt's adapter would be left out of its limit.
        self._may_hold = getattr(self, "lora_config", None) is None
        self._splits_prompts = bool(self.scheduler_config.enable_chunked_prefill)

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        """One step: vLLM's, or shared as the module says while a light request waits."""
        if self.shared_step_tokens <= 0 or not self._splits_prompts:
            return super().schedule(*args, **kwargs)
        now = time.monotonic()
        light = bool(self.waiting) and is_light(
            self.waiting.peek_request(),
            self.running,
            _queued(self.waiting),
            self.shared_step_tokens,
        )
        if light:
            self._shared_until = now + SHARED_HOLD_SECONDS
        elif now >= self._shared_until:
            self._held_last_step = False
            return super().schedule(*args, **kwargs)
        # Decodes first: a running prompt's chunk must not take their token.
        self.running.sort(key=in_prefill)
        # Never two steps running: held prompts advance at least every other step.
        hold = light and self._may_hold and not self._held_last_step and now >= self._no_hold_until
        held = [request for request in self.running if in_prefill(request)] if hold else []
        self._held_last_step = bool(held)
        with self._step_limited(held):
            output = super().schedule(*args, **kwargs)
        if held and not output.scheduled_new_reqs:
            # The light request could not be admitted (KV blocks, a paused
            # engine): no prompt is held for it again for a while.
            self._no_hold_until = now + SHARED_HOLD_SECONDS
        return output

    @contextlib.contextmanager
    def _step_limited(self, held: list[Request]) -> Iterator[None]:
        """One short step; with `held` out of it and only the light request admitted."""
        budget = self.max_num_scheduled_tokens
        limits = {name: getattr(self, name) for name in _STEP_LIMITS if hasattr(self, name)}
        self.max_num_scheduled_tokens = min(budget, self.shared_step_tokens)
        if held:
            self.running = [request for request in self.running if not in_prefill(request)]
            # The held keep their seats: one request is admitted in their place
            # (vLLM's gate also counts paused streaming sessions).
            seats = len(self.running) + getattr(self, "num_waiting_for_streaming_input", 0) + 1
            for name in limits:
                setattr(self, name, min(limits[name] - len(held), seats))
        try:
            yield
        finally:
            self.max_num_scheduled_tokens = budget
            for name, limit in limits.items():
                setattr(self, name, limit)
            # Behind this step's requests: next step they continue, decodes first.
            self.running.extend(held)


class FairStepAsyncScheduler(FairStepScheduler, AsyncScheduler):
    """`FairStepScheduler` over vLLM's `AsyncScheduler` (asynchronous scheduling)."""
