"""Per-tenant work for Prometheus: the tokens each tenant brought, was refused and has queued.

A `prometheus_client` collector over a mount's `TenantEngine` (its
`fair_work.WorkTotals` and `fair_work.QueuedPrompts`), read at each scrape,
so the request path pays no metric updates of its own. The `tenant` label is
a key's name (the key file bounds them; "" for callers without a key and for
administrators). The launcher registers it beside its other series; a host
that mounts the servicers registers it on its own registry:

    registry.register(TenantWorkCollector(mounted.state.tenant, model_name="my-model"))

With `--api-server-count` above 1 the parent serves every process's series
through Prometheus's multiprocess mode, which merges counters, not
collectors: each frontend then counts into `TenantWorkCounters` (the same
series names), and the parent reads the prompt tokens waiting, every
process's, from their shared memory (`WaitingPromptTokens`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

if TYPE_CHECKING:
    from .frontends import FrontendGroup
    from .servicer.tenant_engine import TenantEngine

__all__ = ["TenantWorkCollector", "TenantWorkCounters", "WaitingPromptTokens"]

_COUNTERS = (
    (
        "prompt_tokens",
        "vllm_servicer_tenant_prompt_tokens",
        "Prompt tokens prefilled for the tenant",
    ),
    (
        "cached_prompt_tokens",
        "vllm_servicer_tenant_cached_prompt_tokens",
        "Of those, tokens found in the prefix cache (no prefill run)",
    ),
    ("output_tokens", "vllm_servicer_tenant_output_tokens", "Tokens generated for the tenant"),
    (
        "refused_prompt_tokens",
        "vllm_servicer_tenant_refused_prompt_tokens",
        "Prompt tokens of the tenant's requests refused past its share of "
        "--max-queued-prompt-tokens",
    ),
    (
        "refused_requests",
        "vllm_servicer_tenant_refused_requests",
        "The tenant's requests refused past its share of --max-queued-prompt-tokens",
    ),
)


class TenantWorkCollector(Collector):
    """The per-tenant series of one mount's `TenantEngine`.

    Args:
        tenant: the mount's engine (`MountState.tenant`).
        model_name: the `model_name` label, as the other `vllm_servicer_*` series carry it.
    """

    def __init__(self, tenant: TenantEngine, model_name: str = "") -> None:
        self._tenant = tenant
        self._model = model_name

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        works = dict(self._tenant.work.by_tenant)
        labels = ["model_name", "tenant"]
        for attribute, name, text in _COUNTERS:
            family = CounterMetricFamily(name, text, labels=labels)
            for tenant, work in works.items():
                family.add_metric([self._model, tenant], getattr(work, attribute))
            yield family
        queued = self._tenant.queued
        waiting = GaugeMetricFamily(
            "vllm_servicer_tenant_waiting_prompt_tokens",
            "The tenant's prompt tokens admitted whose prefill has not run yet "
            "(every frontend process's)",
            labels=labels,
        )
        for tenant in works:
            waiting.add_metric([self._model, tenant], queued.held(tenant))
        yield waiting
        yield _waiting_total(self._model, queued.total)


class TenantWorkCounters:
    """The per-tenant counters as `prometheus_client` counters, for a process
    whose series a parent merges (`--api-server-count`): set `add` as the
    mount's `TenantEngine.work.mirror`.

    Args:
        model_name: the `model_name` label.
        registry: where they are registered (None: nowhere; in multiprocess
            mode their values reach the parent's collector all the same).
    """

    def __init__(self, model_name: str = "", registry: CollectorRegistry | None = None) -> None:
        self._model = model_name
        # The counter's name without `_total`: prometheus_client adds it.
        self._counters = {
            attribute: Counter(name, text, ["model_name", "tenant"], registry=registry)
            for attribute, name, text in _COUNTERS
        }

    def add(self, tenant: str, field: str, amount: int) -> None:
        self._counters[field].labels(self._model, tenant).inc(amount)


class WaitingPromptTokens(Collector):
    """`vllm_servicer_waiting_prompt_tokens` from the frontend processes'
    shared memory, for the parent that serves their series."""

    def __init__(self, group: FrontendGroup, model_name: str = "") -> None:
        self._group = group
        self._model = model_name

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield _waiting_total(self._model, int(self._group.queued_prompt_tokens.value))


def _waiting_total(model: str, tokens: int) -> GaugeMetricFamily:
    total = GaugeMetricFamily(
        "vllm_servicer_waiting_prompt_tokens",
        "Prompt tokens admitted whose prefill has not run yet, every tenant's "
        "(--max-queued-prompt-tokens bounds them)",
        labels=["model_name"],
    )
    total.add_metric([model], tokens)
    return total
