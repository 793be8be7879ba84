"""vLLM's scheduler, with short steps while the fair order moves a request ahead.

The fair order (`fair_work.py`) tags each request with the work its tenant
has been served, and vLLM's priority scheduling admits the lowest tag first:
a light tenant's request goes ahead of a heavy tenant's queue. It does not go
ahead of the heavy tenant's prompts already in prefill. vLLM gives the running
requests the step's token budget before any waiting one, so the light request
waits for every running prompt's remaining chunks, and it also waits for the
step in progress, which with a budget of thousands of tokens is long: on a CPU
a 1,843-token prefill step takes about 17 ms while a 16-token request alone
gets its first token in 3 ms.

`FairStepScheduler` changes two things, and only while the fair order is
moving requests ahead of earlier arrivals (with one tenant, or callers that
set no priority, tags follow arrival and it schedules exactly as vLLM does):

- a request the order moved ahead of the oldest waiting one joins the next
  step before the running prompts' chunks, which sit that one step out (the
  step's decodes still run);
- steps are short (`shared_step_tokens`, 256 by default) and every running
  decode gets its token before prefill chunks share what is left, until
  `SHARED_HOLD_SECONDS` after the last such request, so that the next one
  waits at most one short step.

Both need chunked prefill: with whole prompts only a short budget would keep
long prompts out, so with chunked prefill off it schedules as vLLM does.
Nothing is held back while the engine has room: the held chunks give their
place to the request moved ahead for one step, and the short steps run back
to back.

The engine process loads it by name: start the engine with
`scheduler_cls="vllm_servicer.fair_steps.FairStepScheduler"` and
`scheduling_policy="priority"` (the launcher does both). The short step's
budget comes from `SHARED_STEP_TOKENS_ENV` in the engine's environment
(`--shared-step-tokens`), since vLLM's configuration has no field of ours.
The step's own attributes it changes for one `schedule()` call are the same
in vLLM 0.31 to 0.34 (`running`, `waiting`, `max_num_scheduled_tokens`,
`max_num_running_reqs`, and 0.32's `max_num_active_reqs`).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from vllm.v1.core.sched.scheduler import Scheduler

from .fair_work import SHARED_HOLD_SECONDS, SHARED_STEP_TOKENS, SHARED_STEP_TOKENS_ENV

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["FairStepScheduler", "moved_ahead", "shared_step_tokens"]

_STEP_LIMITS = ("max_num_running_reqs", "max_num_active_reqs")


def shared_step_tokens() -> int:
    """The short step's budget in this process (its environment, or the default)."""
    value = os.environ.get(SHARED_STEP_TOKENS_ENV, "")
    return int(value) if value.strip() else SHARED_STEP_TOKENS


def in_prefill(request: Request) -> bool:
    """Whether part of the request's prompt is still to be computed."""
    return bool(request.num_computed_tokens < request.num_prompt_tokens)


def moved_ahead(waiting: list[Request]) -> list[Request]:
    """The waiting requests the priority order put ahead of the oldest waiting one.

    They are a prefix of the priority order: a request ahead of one that is
    ahead of the oldest is ahead of it too. Empty when priorities follow
    arrival, as a lone tenant's tags do.
    """
    if len(waiting) < 2:
        return []
    oldest = min(waiting, key=lambda request: request.arrival_time)
    return sorted(request for request in waiting if request < oldest)


def _queued(queue: Any) -> list[Request]:
    """The waiting requests in any order: the priority queue's heap as it is (its
    iteration pops a copy, a sort per step), else the queue's own order."""
    heap = getattr(queue, "_heap", None)
    return list(heap) if isinstance(heap, list) else list(queue)


class FairStepScheduler(Scheduler):
    """vLLM's scheduler, with short steps while the fair order moves a request ahead."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shared_step_tokens = shared_step_tokens()
        self._shared_until = float("-inf")
        self._splits_prompts = bool(self.scheduler_config.enable_chunked_prefill)

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        """One step: vLLM's, shared as the module says while requests are moved ahead."""
        if self.shared_step_tokens <= 0 or not self._splits_prompts:
            return super().schedule(*args, **kwargs)
        ahead = moved_ahead(_queued(self.waiting))
        now = time.monotonic()
        if ahead:
            self._shared_until = now + SHARED_HOLD_SECONDS
        elif now >= self._shared_until:
            return super().schedule(*args, **kwargs)
        # Decodes first: a running prompt's chunk must not take their token.
        self.running.sort(key=in_prefill)
        held = [request for request in self.running if in_prefill(request)] if ahead else []
        with self._step_limited(held, admit=len(ahead)):
            return super().schedule(*args, **kwargs)

    @contextlib.contextmanager
    def _step_limited(self, held: list[Request], admit: int) -> Iterator[None]:
        """One short step, with `held` out of it and, when any are, only `admit` new requests."""
        budget = self.max_num_scheduled_tokens
        limits = {name: getattr(self, name) for name in _STEP_LIMITS if hasattr(self, name)}
        self.max_num_scheduled_tokens = min(budget, self.shared_step_tokens)
        if held:
            self.running = [request for request in self.running if not in_prefill(request)]
            for name in limits:
                # The held stay in the engine: new requests may not take their seats, and
                # only those moved ahead are admitted in their place this step.
                setattr(self, name, min(limits[name] - len(held), len(self.running) + admit))
        try:
            yield
        finally:
            self.max_num_scheduled_tokens = budget
            for name, limit in limits.items():
                setattr(self, name, limit)
            # Behind this step's requests: next step they continue, decodes first.
            self.running.extend(held)
