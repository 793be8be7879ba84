"""The engine's load as every load report reads it (`EngineLoadReader`).

What GetLoads reads: the latest `SchedulerStats` of each data-parallel rank
(`stats_tap.SchedulerStatsTap`, a dictionary, no engine call), merged with the
other frontend processes' (`serve --api-server-count`: vLLM hands each engine
step's stats to one frontend). Their figures are fetched at most once per
`report.REFRESH_SECONDS`: in the background for a call's trailer, which never
waits on a peer (it takes the figures last fetched, a report's life old under
traffic), and awaited by the out-of-band stream, whose reports come seconds
apart. Without stats (`--disable-log-stats`) the engine calls in flight stand
for the running requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ..engine import EngineClient
from ..frontends import FrontendGroup
from .report import REFRESH_SECONDS, EngineLoad, RankLoad
from .stats_tap import RankWindow, attach, managed_ranks

logger = logging.getLogger("vllm_servicer")

# How long a report waits for the other processes' figures (they answer in
# milliseconds; a peer that is stopping takes the peers socket's 5 s).
_PEERS_WAIT_SECONDS = 1.0


class EngineLoadReader:
    """The engine's load now (`EngineLoad`), all its ranks together; cheap to call.

    Args:
        engine: the engine served.
        in_flight: the engine calls in flight (the mount's count), read when
            the engine keeps no stats or has not stepped yet.
        frontends: the frontend processes sharing the engine, or None.
        refresh: seconds between two fetches of the other processes' figures.
        waiting_prompt_tokens: the prompt tokens admitted whose prefill has not
            run yet (`fair_work.QueuedPrompts.total`).
    """

    def __init__(
        self,
        engine: EngineClient,
        in_flight: Callable[[], int],
        *,
        frontends: FrontendGroup | None = None,
        refresh: float = REFRESH_SECONDS,
        waiting_prompt_tokens: Callable[[], int] = lambda: 0,
    ) -> None:
        self._tap = attach(engine)
        self._waiting_prompt_tokens = waiting_prompt_tokens
        self._ranks = managed_ranks(engine)
        parallel = getattr(engine.vllm_config, "parallel_config", None)
        # Each rank's figures too when there are several ranks in all (this
        # launcher may serve one of them): routers tell the ranks apart.
        self._per_rank = int(getattr(parallel, "data_parallel_size", 1) or 1) > 1
        scheduler = getattr(engine.vllm_config, "scheduler_config", None)
        self._max_num_seqs = int(getattr(scheduler, "max_num_seqs", 0) or 0) * len(self._ranks)
        self._in_flight = in_flight
        self._group = frontends
        self._refresh = refresh
        self._elsewhere: list[dict[int, RankWindow]] = []
        self._asked_at = float("-inf")
        self._asking: asyncio.Task[None] | None = None

    def __call__(self) -> EngineLoad:
        tap = self._tap
        if tap is None:  # no stats: the calls in flight are what is known
            return EngineLoad(
                self._in_flight(),
                0,
                self._max_num_seqs,
                waiting_prompt_tokens=self._waiting_prompt_tokens(),
            )
        self._ask_peers()
        ranks: list[RankLoad] = []
        for rank in self._ranks:
            figures = tap.snapshot(rank, self._elsewhere)
            if figures is None:
                continue
            stats = figures[0]
            ranks.append(
                RankLoad(
                    rank,
                    int(stats.num_running_reqs),
                    int(stats.num_waiting_reqs) + int(stats.num_skipped_waiting_reqs),
                    float(stats.kv_cache_usage),
                )
            )
        if not ranks:  # no engine step seen yet
            return EngineLoad(
                self._in_flight(),
                0,
                self._max_num_seqs,
                waiting_prompt_tokens=self._waiting_prompt_tokens(),
            )
        # Every rank has a KV cache of the same size: the mean is the engine's share.
        return EngineLoad(
            sum(r.running for r in ranks),
            sum(r.waiting for r in ranks),
            self._max_num_seqs,
            sum(r.kv_cache_usage for r in ranks) / len(ranks),
            tuple(ranks) if self._per_rank else (),
            self._waiting_prompt_tokens(),
        )

    async def update(self) -> bool:
        """Fetch the other frontend processes' figures when due (or await the fetch
        under way); whether one was awaited, so that a report is made anew."""
        asking = self._ask_peers()
        if asking is None:
            return False
        # A peer that is slow to answer holds no report back for long.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(asking), _PEERS_WAIT_SECONDS)
        return True

    def _ask_peers(self) -> asyncio.Task[None] | None:
        """The fetch of the other processes' figures under way, started when due."""
        ask = self._group.loads_elsewhere if self._group is not None else None
        if ask is None or self._asking is not None:
            return self._asking
        now = time.monotonic()
        if now - self._asked_at < self._refresh:
            return None
        self._asked_at = now
        with contextlib.suppress(RuntimeError):  # no running loop: the last figures stand
            self._asking = asyncio.get_running_loop().create_task(self._fetch(ask))
        return self._asking

    async def _fetch(self, ask: Callable[[], Awaitable[list[Any]]]) -> None:
        try:
            self._elsewhere = await ask()
        except Exception:  # a peer stopping: its figures are left out, as GetLoads does
            logger.debug("load report: the other frontends' figures not had", exc_info=True)
        finally:
            self._asking = None
