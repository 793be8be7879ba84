"""The head's watch over engines on other nodes (`serve --headless` there).

vLLM's frontend watches only the engine processes it started: when a
headless node's engine dies or hangs, the head stays SERVING, a call pinned
to that rank waits until its deadline, and unpinned calls can still be
balanced onto it. Here every engine the frontend serves but did not start is
asked a cheap question (`vllm_releases.ask_engine_core`) every
`PROBE_INTERVAL` seconds; an engine answers between two of its steps, so a
long step may miss one, and `MISSES_ALLOWED` in a row are forgiven. One more
and the engine counts as dead, as vLLM's client counts a local engine whose
process ended (`vllm_releases.engine_core_died`): every request waiting on
the engine fails with EngineDeadError (UNAVAILABLE, with a retry hint), health
turns NOT_SERVING, and the launcher drains and exits 1 unless
`VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1`.

Which engines are remote is read from the parallel config: in the internal
layout a head serves every rank and starts the first
`--data-parallel-size-local` of them; in the hybrid and external layouts a
frontend serves only engines it started.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from ..ranks import describe, served_ranks
from ..vllm_releases import ask_engine_core, engine_core_died

__all__ = ["remote_ranks", "watch_remote_engines"]

logger = logging.getLogger("vllm_servicer.serve")

PROBE_INTERVAL = 2.0
"""Seconds between two questions to each remote engine."""
PROBE_TIMEOUT = 3.0
"""Seconds an engine has to answer one (more than one step takes)."""
MISSES_ALLOWED = 2
"""Unanswered questions in a row forgiven; the next one counts the engine dead."""


def remote_ranks(engine: Any) -> range:
    """The ranks this frontend serves on engines other nodes started."""
    served = served_ranks(engine)
    parallel = getattr(getattr(engine, "vllm_config", None), "parallel_config", None)
    if parallel is None or getattr(parallel, "data_parallel_rank_local", None) is not None:
        return range(0)
    if getattr(parallel, "data_parallel_external_lb", False) or getattr(
        parallel, "data_parallel_hybrid_lb", False
    ):
        return range(0)
    local = getattr(parallel, "data_parallel_size_local", None)
    return served[len(served) if local is None else int(local) :]


async def watch_remote_engines(
    engine: Any,
    *,
    interval: float = PROBE_INTERVAL,
    timeout: float = PROBE_TIMEOUT,
    misses_allowed: int = MISSES_ALLOWED,
    on_answer: Callable[[int, bool], None] | None = None,
) -> None:
    """Ask each remote engine until one stops answering (then mark the engine
    dead) or the engine dies otherwise; returns at once when none is remote.

    `on_answer(rank, answered)` is told each rank's answer (the health
    service's `rank_answered`: a rank that misses one is not ready)."""
    remote = remote_ranks(engine)
    if not remote:
        return
    first = served_ranks(engine).start
    logger.info("watching the engines of %s on other nodes", describe(remote))
    missed = dict.fromkeys(remote, 0)
    while not engine.errored:
        answers = await asyncio.gather(
            *(_answers(engine, rank - first, timeout) for rank in remote)
        )
        for rank, answered in zip(remote, answers, strict=True):
            missed[rank] = 0 if answered else missed[rank] + 1
            if on_answer is not None:
                on_answer(rank, answered)
        silent = [rank for rank in remote if missed[rank] > misses_allowed]
        if silent and not engine.errored:
            logger.error(
                "the engine of data-parallel rank %s on another node did not answer %d "
                "questions in a row (%.0f s apart, %.0f s to answer each): counting the engine "
                "dead",
                ", ".join(str(r) for r in silent),
                misses_allowed + 1,
                interval,
                timeout,
            )
            engine_core_died(engine)
            return
        await asyncio.sleep(interval)


async def _answers(engine: Any, index: int, timeout: float) -> bool:
    try:
        await asyncio.wait_for(ask_engine_core(engine, index), timeout)
    except asyncio.CancelledError:
        raise
    except Exception:
        return False
    return True
