"""GetLoads: per data-parallel rank load, read from the engine's own scheduler stats
(`load_reports/stats_tap.py`, attached once per engine: `attach`).

A rank with no snapshot yet (no step since the tap was attached, or stats
turned off with `--disable-log-stats`) gets no entry: zeros would read as an
idle rank to a router, which is worse than no figure.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from typing import NamedTuple

# Before vLLM is imported below: an untested vLLM release fails here, naming both versions.
from .. import _vllm_version  # noqa: F401

# isort: split
import vllm

from ..engine import EngineClient
from ..errors import InvalidRequestError
from ..load_reports.stats_tap import RankWindow, SchedulerStatsTap, managed_ranks
from ..proto import vllm_engine_pb2 as pb

__all__ = ["MISSING_RANKS_KEY", "VLLM_VERSION", "LoadReport", "load_report"]

VLLM_VERSION: str = getattr(vllm, "__version__", "")
# Trailing-metadata key listing the ranks GetLoads had no figures for.
MISSING_RANKS_KEY = "vllm-servicer-loads-missing-ranks"


class LoadReport(NamedTuple):
    """A GetLoads answer and the ranks it has no figures for."""

    response: pb.GetLoadsResponse
    missing_ranks: list[int]


def load_report(
    engine: EngineClient,
    tap: SchedulerStatsTap | None,
    dp_rank: int | None,
    elsewhere: Iterable[dict[int, RankWindow]] = (),
    waiting_prompt_tokens: int = 0,
) -> LoadReport:
    """The GetLoads response for one rank (`dp_rank`) or all ranks (None);
    `elsewhere`: the other frontend processes' windows, merged in;
    `waiting_prompt_tokens`: the prompt tokens admitted whose prefill has not
    run (`fair_work.QueuedPrompts.total`), given as `num_waiting_uncached_tokens`
    of an engine of one rank (the count is not kept per rank).

    Raises:
        InvalidRequestError: `dp_rank` is not a rank this frontend serves.
    """
    ranks = managed_ranks(engine)
    if dp_rank is not None:
        if dp_rank not in ranks:
            raise InvalidRequestError(
                "dp_rank", f"rank {dp_rank} is not served here; served ranks: {ranks}"
            )
        wanted = [dp_rank]
    else:
        wanted = ranks
    config = engine.vllm_config
    cache = getattr(config, "cache_config", None)
    scheduler = getattr(config, "scheduler_config", None)
    # num_gpu_blocks is summed over the frontend's engines (see vLLM's core client).
    blocks = int(getattr(cache, "num_gpu_blocks", 0) or 0) // max(1, len(ranks))
    capacity = blocks * int(getattr(cache, "block_size", 0) or 0)
    max_running = int(getattr(scheduler, "max_num_seqs", 0) or 0)

    loads, missing = [], []
    for rank in wanted:
        figures = tap.snapshot(rank, elsewhere) if tap is not None else None
        if figures is None:
            missing.append(rank)
            continue
        stats, throughput, hit_rate = figures
        running = int(stats.num_running_reqs)
        waiting = int(stats.num_waiting_reqs) + int(stats.num_skipped_waiting_reqs)
        usage = float(stats.kv_cache_usage)
        loads.append(
            pb.SchedulerLoad(
                dp_rank=rank,
                num_running_reqs=running,
                num_waiting_reqs=waiting,
                num_total_reqs=running + waiting,
                num_used_tokens=round(usage * capacity),
                max_total_num_tokens=capacity,
                token_usage=usage,
                utilization=usage,
                gen_throughput=throughput,
                cache_hit_rate=hit_rate,
                max_running_requests=max_running,
                num_waiting_uncached_tokens=waiting_prompt_tokens if len(ranks) == 1 else 0,
            )
        )
    response = pb.GetLoadsResponse(
        timestamp=datetime.now(UTC).isoformat(),
        version=VLLM_VERSION,
        dp_rank_count=len(ranks),
        loads=loads,
    )
    return LoadReport(response, missing)
