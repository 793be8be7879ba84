"""FlushCache and StartProfile/StopProfile: operator calls on the engine.

Errors are raised, not answered: the servicer hands them to
`abort_for_exception`, the one place that sets error statuses.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from .. import vllm_releases
from ..engine import EngineClient
from ..errors import InvalidRequestError, UnsupportedError
from ..proto import VLLM_ENGINE_SERVICE, common_pb2
from ..wire import fields

# A reset that gets no answer within this long is reported as a timeout, even
# with timeout_s 0 ("one attempt, now").
RESET_CALL_LIMIT_S = 30.0
# Between reset attempts while running requests hold the cache.
RESET_RETRY_S = 0.1
# The most a profiler start or stop may take, the call's deadline permitting.
PROFILE_CALL_LIMIT_S = 600.0

PROFILER_HINT = (
    "this engine has no profiler configured; start vLLM with "
    "--profiler-config.profiler=torch --profiler-config.torch_profiler_dir=/abs/dir"
)


def _budget(limit: float, time_remaining: float | None) -> float:
    return limit if time_remaining is None else min(limit, time_remaining)


async def flush_cache(
    engine: EngineClient, timeout_s: float, time_remaining: Any
) -> common_pb2.FlushCacheResponse:
    """Reset the engine's prefix cache, waiting up to `timeout_s` for it to be idle.

    vLLM refuses the reset while running requests hold cached blocks; a
    positive `timeout_s` retries until then, 0 tries once. The answer is
    `success` with a message either way; only the call's deadline (or an
    engine that does not answer) makes it an error.

    Args:
        engine: the engine (`reset_prefix_cache()` returns whether it reset).
        timeout_s: seconds to wait for running requests to finish.
        time_remaining: the call's `context.time_remaining` (None: no deadline).

    Raises:
        InvalidRequestError: `timeout_s` is negative or not finite.
        TimeoutError: the call's deadline passed, or the engine did not answer.
    """
    if not math.isfinite(timeout_s) or timeout_s < 0:
        raise InvalidRequestError("timeout_s", f"must be finite and >= 0, got {timeout_s}")
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + timeout_s
    while True:
        budget = _budget(RESET_CALL_LIMIT_S, time_remaining())
        if budget <= 0:
            raise TimeoutError("the call's deadline passed before the prefix cache was flushed")
        try:
            ok = await asyncio.wait_for(engine.reset_prefix_cache(), timeout=budget)
        except TimeoutError:
            raise TimeoutError(
                f"the engine did not answer the prefix-cache reset within {budget:g}s; "
                "it may still complete it"
            ) from None
        if ok is None or ok:
            return common_pb2.FlushCacheResponse(success=True, message="prefix cache flushed")
        left = give_up_at - loop.time()
        if left <= 0:
            waited = f" after waiting {timeout_s:g}s" if timeout_s else ""
            return common_pb2.FlushCacheResponse(
                success=False,
                message=f"prefix cache not flushed: requests are running{waited}; "
                "set timeout_s to wait for the engine to go idle",
            )
        await asyncio.sleep(min(RESET_RETRY_S, left))


def profiler_configured(engine: EngineClient) -> bool:
    """Whether the engine was started with a profiler (`--profiler-config`)."""
    config = getattr(engine.vllm_config, "profiler_config", None)
    return getattr(config, "profiler", None) is not None


async def start_profile(
    engine: EngineClient, request: common_pb2.StartProfileRequest, time_remaining: Any
) -> common_pb2.ProfileResponse:
    """Start the engine's profiler on every worker.

    `start_step` and `num_steps` become vLLM's delay and iteration bounds,
    `with_stack` and `record_shapes` its per-session profiler options where
    the release takes them (`vllm_releases.start_profile_options`); the trace
    directory and the activities are fixed when the engine starts, so a
    request that sets what this engine cannot take is refused rather than
    ignored (the rows of `fields.REFUSED[VLLM_ENGINE_SERVICE]["StartProfile"]`).

    Raises:
        InvalidRequestError: the request sets an option this vLLM takes only at start.
        UnsupportedError: the engine has no profiler configured, or its profiler
            takes no step bounds (vLLM 0.31).
        TimeoutError: the profiler did not start within the call's deadline.
    """
    # Refused whatever the engine: no profiler would take these per request.
    fields.refuse_unserved(VLLM_ENGINE_SERVICE, "StartProfile", request)
    options = vllm_releases.start_profile_options(engine.start_profile)
    overrides = {
        name: getattr(request, name) for name in PROFILER_OVERRIDES if request.HasField(name)
    }
    if overrides and "profiler_kwargs" not in options:
        name = next(iter(overrides))
        raise InvalidRequestError(
            name, fields.REFUSED[VLLM_ENGINE_SERVICE]["StartProfile"][name].reason
        )
    if not profiler_configured(engine):
        raise UnsupportedError(PROFILER_HINT)
    kwargs: dict[str, Any] = {}  # only what was asked for: vLLM 0.31 takes none of it
    if request.HasField("start_step"):
        kwargs["delay_iterations"] = request.start_step
    if request.HasField("num_steps"):
        kwargs["max_iterations"] = request.num_steps
    if overrides:
        kwargs["profiler_kwargs"] = overrides
    if "delay_iterations" in kwargs or "max_iterations" in kwargs:
        if "delay_iterations" not in options:
            raise UnsupportedError(
                "this vLLM's profiler takes no step bounds (vLLM 0.32 and later do)",
                field="start_step" if "delay_iterations" in kwargs else "num_steps",
            )
    await _bounded(engine.start_profile(**kwargs), time_remaining, "start")
    return common_pb2.ProfileResponse(success=True, message="profiler started")


# The torch profiler's options a session may override (vLLM 0.33's profiler_kwargs).
PROFILER_OVERRIDES = ("with_stack", "record_shapes")


async def stop_profile(engine: EngineClient, time_remaining: Any) -> common_pb2.ProfileResponse:
    """Stop the engine's profiler and write its traces.

    Raises:
        UnsupportedError: the engine has no profiler configured.
        TimeoutError: the traces were not written within the call's deadline.
    """
    if not profiler_configured(engine):
        raise UnsupportedError(PROFILER_HINT)
    await _bounded(engine.stop_profile(), time_remaining, "stop")
    return common_pb2.ProfileResponse(success=True, message="profiler stopped; traces written")


async def _bounded(call: Any, time_remaining: Any, what: str) -> None:
    budget = _budget(PROFILE_CALL_LIMIT_S, time_remaining())
    try:
        await asyncio.wait_for(call, timeout=max(budget, 0.0))
    except TimeoutError:
        raise TimeoutError(f"the profiler did not {what} within {budget:g}s") from None
