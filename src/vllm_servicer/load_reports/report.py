"""Load reports for balancers: the engine's load as one ORCA `OrcaLoadReport`, cached.

gRPC's `weighted_round_robin` policy (gRFC A58) and Envoy's client-side
weighted round robin read a report (gRFC A51) from each endpoint, in the
trailer `endpoint-load-metrics-bin` of every call or from an
`OpenRcaService` stream, and weigh the endpoint by

    rps_fractional / (application_utilization + eps / rps_fractional * penalty)

so that new calls go where the load is lighter. `LoadReporter` builds that
report from the engine's figures (`EngineLoad`, read by whoever knows the
engine: `engine_load.py`) and the calls' rates (`CallRates`), at most once
per `REFRESH_SECONDS`, and keeps it serialized: a call's trailer costs a
cached bytes object, never an engine read nor a serialization.

No grpc and no vLLM here.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import NamedTuple

from ..frontends import FrontendGroup
from ..proto import orca_load_report_pb2

TRAILER_KEY = "endpoint-load-metrics-bin"
"""The trailing-metadata key gRPC's and Envoy's balancers read a per-call report from."""

REFRESH_SECONDS = 0.25
"""How stale a report may be: the engine's figures are read at most this often."""

RATE_WINDOW_SECONDS = 10.0
"""The recent past `rps_fractional` and `eps` are averaged over."""

# A rate over less than this would read a single call as a burst (one call in
# 10 ms: 100 calls a second).
_MIN_RATE_SPAN_SECONDS = 1.0

# An idle engine reports half a sequence slot, never zero: gRPC's and Envoy's
# weighted round robin ignore a report whose utilization is zero (the weight
# would be infinite) and weigh that endpoint as the average of the others, so
# an idle replica would get no more calls than a busy one. Half a slot reads
# lighter than any engine running a request, and is not zero.
_IDLE_SLOTS = 0.5


class RankLoad(NamedTuple):
    """One data-parallel rank's load, by its global number (`ranks.py`)."""

    rank: int
    running: int
    waiting: int
    kv_cache_usage: float


class EngineLoad(NamedTuple):
    """The engine's load, all its data-parallel ranks together.

    Attributes:
        running: requests the scheduler runs (vLLM's `num_requests_running`).
        waiting: requests queued for a slot or KV blocks (`num_requests_waiting`).
        max_num_seqs: sequences the engine runs at once, all ranks together.
        kv_cache_usage: the KV cache's used share, 0 to 1 (`kv_cache_usage_perc`,
            a fraction despite its name); None when the engine keeps no stats
            (`--disable-log-stats`: `running` is then the calls in flight).
        ranks: each rank's own figures when the engine is data-parallel (a
            router in front of several launchers tells ranks apart by them);
            empty otherwise.
        waiting_prompt_tokens: prompt tokens admitted whose prefill has not
            run yet, every process's (`fair_work.QueuedPrompts`): the work
            queued, where `waiting` counts requests whatever their length.
    """

    running: int
    waiting: int
    max_num_seqs: int
    kv_cache_usage: float | None = None
    ranks: tuple[RankLoad, ...] = ()
    waiting_prompt_tokens: int = 0


def utilization(load: EngineLoad) -> float:
    """The share of the engine's capacity in use: ORCA's `application_utilization`.

    The larger of the two things an LLM engine runs out of: KV-cache blocks
    (long prompts and outputs fill it before the sequence slots) and sequence
    slots (`max_num_seqs`; many short requests fill them first). Waiting
    requests count as slots asked for, so a queue reads above 1.0, which ORCA
    allows ("usage exceeds the reporter's notion of soft limits"): a replica
    that queues weighs less than one that is merely full. By Little's law the
    requests held are rate x duration, so rps / utilization is about the
    requests per second the replica can take: what the balancers' weight
    means. CPU utilization, gRPC's default, says nothing of an engine on an
    accelerator, and a KV-cache figure alone misses a full batch of short requests.
    """
    slots = max(1, load.max_num_seqs)
    asked = (load.running + load.waiting) / slots
    return max(load.kv_cache_usage or 0.0, asked, _IDLE_SLOTS / slots)


def report_of(load: EngineLoad, rps: float, eps: float) -> orca_load_report_pb2.OrcaLoadReport:
    """The ORCA report for `load` and the rates of calls and errors, with vLLM's metric names
    (and each rank's, prefixed `rank.N.`, when the engine is data-parallel)."""
    named = {
        "num_requests_running": float(load.running),
        "num_requests_waiting": float(load.waiting),
        # Tokens, not requests: a balancer sends a long prompt elsewhere before
        # this replica's first tokens slow down.
        "num_waiting_prompt_tokens": float(load.waiting_prompt_tokens),
    }
    if load.kv_cache_usage is not None:
        named["kv_cache_usage_perc"] = load.kv_cache_usage
    for rank in load.ranks:  # "rank.2.num_requests_running": rank 2's own figure
        prefix = f"rank.{rank.rank}."
        named[prefix + "num_requests_running"] = float(rank.running)
        named[prefix + "num_requests_waiting"] = float(rank.waiting)
        named[prefix + "kv_cache_usage_perc"] = rank.kv_cache_usage
    return orca_load_report_pb2.OrcaLoadReport(
        application_utilization=utilization(load),
        rps_fractional=rps,
        eps=eps,
        named_metrics=named,
    )


class CallRates:
    """Engine calls and failed calls per second over the last `window` seconds.

    Each call's end is counted (`ended`); the rates are read from samples of
    the totals taken when a report is made (a few a second at most), not kept
    per call. With `group`, the totals are the frontend processes' together
    (`serve --api-server-count`): the endpoint a balancer weighs is the port,
    not one process.

    Args:
        group: the frontend processes sharing the engine, or None.
        window: seconds of the recent past the rates cover.
        clock: monotonic seconds (tests give their own).
    """

    def __init__(
        self,
        group: FrontendGroup | None = None,
        *,
        window: float = RATE_WINDOW_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._group = group
        self._window = window
        self._clock = clock
        self._ended = 0
        self._failed = 0
        self._samples: deque[tuple[float, int, int]] = deque([(clock(), *self.totals())])

    def ended(self, failed: bool) -> None:
        """One engine call ended; `failed`: with a status that counts as an error."""
        if self._group is not None:
            self._group.count_ended(failed)
            return
        self._ended += 1
        if failed:
            self._failed += 1

    def totals(self) -> tuple[int, int]:
        """Engine calls ended so far, and how many failed (every process's, with a group)."""
        if self._group is not None:
            return self._group.ended
        return self._ended, self._failed

    def rates(self) -> tuple[float, float]:
        """Calls and failed calls per second over about the last `window` seconds."""
        now = self._clock()
        ended, failed = self.totals()
        samples = self._samples
        samples.append((now, ended, failed))
        # The oldest sample kept is the newest one at least a window old: the
        # rates span the window (a little more), however seldom they are read.
        while len(samples) > 2 and now - samples[1][0] >= self._window:
            samples.popleft()
        since, ended_then, failed_then = samples[0]
        span = max(now - since, _MIN_RATE_SPAN_SECONDS)
        # A process of the group that ended takes its counts with it: never below zero.
        return max(0, ended - ended_then) / span, max(0, failed - failed_then) / span


class LoadReporter:
    """The engine's ORCA report, made at most once per `refresh` seconds.

    Args:
        read_load: the engine's load now (cheap: a dictionary read, no engine call).
        rates: the engine calls' rates, counted by whoever sees them end.
        refresh: seconds a report is reused for.
        update: what a report that can wait awaits first (`fresh_report`): the
            other frontend processes' figures, which `read_load` otherwise
            takes as last fetched.
        clock: monotonic seconds (tests give their own).
    """

    def __init__(
        self,
        read_load: Callable[[], EngineLoad],
        rates: CallRates,
        *,
        refresh: float = REFRESH_SECONDS,
        update: Callable[[], Awaitable[bool]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read_load = read_load
        self._update = update
        self.rates = rates
        self._refresh = refresh
        self._clock = clock
        self._made_at = float("-inf")
        self._report = orca_load_report_pb2.OrcaLoadReport()
        self._serialized = b""
        self._trailer: tuple[tuple[str, bytes], ...] = ()

    def call_ended(self, failed: bool) -> None:
        """Count one engine call's end (`failed`: an error status) in the rates."""
        self.rates.ended(failed)

    def report(self) -> orca_load_report_pb2.OrcaLoadReport:
        """The current report (do not change it: it is shared until the next refresh)."""
        self._fresh()
        return self._report

    def serialized(self) -> bytes:
        """The current report, serialized: a trailer's value."""
        self._fresh()
        return self._serialized

    def trailer(self) -> tuple[tuple[str, bytes], ...]:
        """The current report as a call's trailing metadata: `((TRAILER_KEY, serialized),)`."""
        self._fresh()
        return self._trailer

    async def fresh_report(self) -> orca_load_report_pb2.OrcaLoadReport:
        """The report, made anew if `update` brought newer figures (the out-of-band stream's)."""
        if self._update is not None and await self._update():
            self._made_at = float("-inf")
        return self.report()

    def _fresh(self) -> None:
        now = self._clock()
        if now - self._made_at < self._refresh:
            return
        rps, eps = self.rates.rates()
        self._report = report_of(self._read_load(), rps, eps)
        self._serialized = self._report.SerializeToString()
        self._trailer = ((TRAILER_KEY, self._serialized),)
        self._made_at = now
