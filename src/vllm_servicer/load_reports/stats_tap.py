"""The engine's latest scheduler stats per data-parallel rank, for GetLoads and the load reports.

vLLM's `AsyncLLM` has no "current stats" call: each engine core sends a
`SchedulerStats` with its step outputs, and the frontend hands it to the stat
loggers of `engine.logger_manager`. `attach()` adds one small logger there,
`SchedulerStatsTap`, that keeps the latest snapshot of each rank (plus a short
window of generated tokens and prefix-cache lookups), so GetLoads
(`servicer/loads.py`) and the load report (`engine_load.py`) read a dictionary
and never wait on the engine.

A rank with no snapshot yet (no step since the tap was attached, or stats
turned off with `--disable-log-stats`) has no figures: zeros would read as an
idle rank to a router, which is worse than no figure.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from typing import Any, NamedTuple

# Before vLLM is imported below: an untested vLLM release fails here, naming both versions.
from .. import _vllm_version  # noqa: F401

# isort: split
from vllm.v1.metrics.loggers import AggregateStatLoggerBase

from ..engine import EngineClient

# Seconds of history behind gen_throughput and cache_hit_rate.
RATE_WINDOW = 5.0


class _Sample(NamedTuple):
    at: float
    generated_tokens: int
    prefix_queries: int
    prefix_hits: int


class _Rank:
    __slots__ = ("samples", "stats", "stats_at")

    def __init__(self) -> None:
        self.stats: Any = None  # the latest SchedulerStats
        self.stats_at = 0.0
        self.samples: deque[_Sample] = deque()

    def trim(self, now: float) -> None:
        samples = self.samples
        while samples and now - samples[0].at > RATE_WINDOW:
            samples.popleft()


class SchedulerStatsTap(AggregateStatLoggerBase):
    """A vLLM stat logger that keeps the latest `SchedulerStats` of each rank.

    Runs inside the engine's output loop on every step, so `record` does a
    dictionary lookup and a deque append, nothing more.

    Args:
        vllm_config: the engine's config (unused; vLLM's logger signature).
        engine_indexes: the data-parallel ranks this frontend manages.
    """

    def __init__(self, vllm_config: Any, engine_indexes: Iterable[int]) -> None:
        self.engine_indexes = list(engine_indexes)
        self._ranks: dict[int, _Rank] = {}

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        """Keep `engine_idx`'s snapshot and this step's token and cache counts."""
        rank = self._ranks.get(engine_idx)
        if rank is None:
            rank = self._ranks[engine_idx] = _Rank()
        now = time.monotonic()
        generated = iteration_stats.num_generation_tokens if iteration_stats is not None else 0
        queries = hits = 0
        if scheduler_stats is not None:
            rank.stats = scheduler_stats
            rank.stats_at = now
            prefix = scheduler_stats.prefix_cache_stats
            if prefix is not None:
                queries, hits = prefix.queries, prefix.hits
        if generated or queries:
            rank.samples.append(_Sample(now, generated, queries, hits))
            rank.trim(now)

    def log_engine_initialized(self) -> None:
        """Nothing to log: this logger only keeps figures for GetLoads and the load reports."""

    def window(self) -> dict[int, RankWindow]:
        """Each rank's latest stats and its last `RATE_WINDOW` seconds of counts.

        What another frontend process on the engine merges with its own
        (`snapshot`): vLLM hands each step's SchedulerStats to one frontend
        only, and each frontend counts its own requests' tokens.
        """
        now = time.monotonic()
        windows = {}
        for index, state in self._ranks.items():
            state.trim(now)
            windows[index] = RankWindow(
                state.stats,
                state.stats_at,
                sum(s.generated_tokens for s in state.samples),
                sum(s.prefix_queries for s in state.samples),
                sum(s.prefix_hits for s in state.samples),
            )
        return windows

    def snapshot(
        self, rank: int, elsewhere: Iterable[dict[int, RankWindow]] = ()
    ) -> tuple[Any, float, float] | None:
        """`rank`'s latest SchedulerStats, tokens/s and prefix hit rate (None if none yet).

        With `elsewhere`, the other frontend processes' windows: the newest
        stats of all, and their counts added to this process's.
        """
        windows = [w[rank] for w in (self.window(), *elsewhere) if rank in w]
        windows = [w for w in windows if w.stats is not None]
        if not windows:
            return None
        newest = max(windows, key=lambda w: w.stats_at)
        generated = sum(w.generated_tokens for w in windows)
        queries = sum(w.prefix_queries for w in windows)
        hits = sum(w.prefix_hits for w in windows)
        return newest.stats, generated / RATE_WINDOW, (hits / queries if queries else 0.0)


class RankWindow(NamedTuple):
    """One rank's figures in one frontend process (see `SchedulerStatsTap.window`)."""

    stats: Any  # the latest SchedulerStats, or None
    stats_at: float  # time.monotonic(): one clock for every process of the host
    generated_tokens: int
    prefix_queries: int
    prefix_hits: int


def attach(engine: EngineClient) -> SchedulerStatsTap | None:
    """Add a `SchedulerStatsTap` to a running engine's stat loggers (once).

    Returns None when the engine collects no stats (`--disable-log-stats`):
    the engine core then sends no SchedulerStats at all.
    """
    # None, not absent, when the engine collects no stats (--disable-log-stats).
    manager = engine.logger_manager
    if manager is None:
        return None
    loggers: list[Any] = manager.stat_loggers
    for existing in loggers:
        if isinstance(existing, SchedulerStatsTap):
            return existing
    tap = SchedulerStatsTap(engine.vllm_config, managed_ranks(engine))
    loggers.append(tap)
    return tap


def managed_ranks(engine: EngineClient) -> list[int]:
    """The data-parallel ranks this frontend serves, in order."""
    return sorted(int(r) for r in engine.engine_core.engine_ranks_managed)
