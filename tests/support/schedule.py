"""How `make test`'s workers share the modules (pytest-xdist, `--dist loadfile`).

Most of the suite's time is engine starts: a launcher process or an engine of
a module's own (~50 s each on two busy cores), and each session engine
(conftest.py) once in every worker that uses it. xdist's own order, modules
with the most tests first, leaves the modules that start a launcher per test
(few tests, minutes each) to the end, where the last of them can keep one
worker busy for minutes after the other has run out of work. `HeaviestFirst`
keeps xdist's rule, each module on one worker, with two changes:

- The modules that share a session engine few modules use (SHARED_ENGINES) run
  on one worker, so that engine is built once, not once in each worker.
- Work is handed out heaviest first (`cost`: the module's own engine starts,
  from STARTS, and its tests), so the short modules come last and fill in
  where one worker finishes before the other.

Both tables only order and group work: a module missing from them runs all the
same (`tests/conftest.py` warns when a module uses one of SHARED_ENGINES'
engines and is not listed there).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from xdist.scheduler import LoadFileScheduling

SHARED_ENGINES: dict[str, frozenset[str]] = {
    "vlm_engine": frozenset(
        {
            "test_budgets.py",
            "test_http_media.py",
            "test_images.py",
            "test_mm_tensors.py",
            "test_reference_servicer.py",
            "test_render.py",
        }
    ),
    "kv_echo_engine": frozenset(
        {"test_inference.py", "test_protocol_fields.py", "test_reference_servicer.py"}
    ),
    "embedding_engine": frozenset(
        {"test_bad_input.py", "test_embed_and_shutdown.py", "test_load_report.py"}
    ),
    "recipe_launcher": frozenset({"test_grafana_dashboard.py", "test_kubernetes_recipe.py"}),
}
"""Session engines only some modules use, each with the modules that use it."""

STARTS: dict[str, int] = {
    "test_drain.py": 9,
    "test_api_servers.py": 3,
    "test_keyless_surfaces.py": 3,
    "test_scale_out.py": 3,
    "test_auth_flood.py": 2,
    "test_derender_loop.py": 2,
    "test_disaggregation.py": 2,
    "test_examples.py": 2,
    "test_fair_shares.py": 2,
    "test_fair_work_order.py": 2,
    "test_kv_events.py": 2,
    "test_load_balancing.py": 2,
    "test_one_guard.py": 1,
    "test_prefix_cache_salt.py": 2,
    "test_routing_data.py": 2,
    "test_two_protocols.py": 2,
    "test_control.py": 1,
    "test_derender.py": 1,
    "test_embed_and_shutdown.py": 1,
    "test_http_admission.py": 1,
    "test_http_slots.py": 1,
    "test_inference.py": 1,
    "test_metrics.py": 1,
    "test_pooling.py": 1,
    "test_pooling_lora.py": 1,
    "test_port_in_use.py": 1,
    "test_priority.py": 1,
    "test_probe_port.py": 1,
    "test_router_reads.py": 1,
    "test_still_calls.py": 1,
    "test_profiler.py": 1,
    "test_released_fields.py": 1,
    "test_render.py": 1,
    "test_runtime_lora_http.py": 1,
    "test_tenant_call_slots.py": 1,
    "test_tracing_otlp.py": 1,
}
"""Engines each module starts of its own: launcher processes (support/launcher.py,
examples, benchmarks) and engines built in the module, counted once per start."""

START_SECONDS = 50
"""About what one engine start takes with the other worker busy."""
TEST_SECONDS = 0.5


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0].rsplit("/", 1)[-1]


def _groups() -> dict[str, str]:
    """Each module that shares an engine of SHARED_ENGINES -> its group's name
    (modules linked through any shared engine are one group)."""
    sets: list[set[str]] = []
    for modules in SHARED_ENGINES.values():
        linked = [s for s in sets if s & modules]
        merged = set(modules).union(*linked)
        sets = [s for s in sets if not s & modules] + [merged]
    return {module: "+".join(sorted(s)) for s in sets for module in s}


GROUPS = _groups()


def cost(scope: str, tests: int) -> float:
    """Estimated seconds of one work unit: its modules' engine starts, the shared
    engines it builds, its tests."""
    modules = {_module(m) for m in scope.split("+")}
    engines = sum(1 for members in SHARED_ENGINES.values() if members & modules)
    starts = sum(STARTS.get(m, 0) for m in modules) + engines
    return START_SECONDS * starts + TEST_SECONDS * tests


class HeaviestFirst(LoadFileScheduling):
    """xdist's per-module scheduling, with SHARED_ENGINES' modules together and
    the heaviest work handed out first."""

    def __init__(self, config: Any, log: Any = None) -> None:
        super().__init__(config, log)
        self._ordered = False

    def _split_scope(self, nodeid: str) -> str:
        return GROUPS.get(_module(nodeid), nodeid.split("::", 1)[0])

    def _assign_work_unit(self, node: Any) -> None:
        if not self._ordered:  # the queue is complete once the first unit is handed out
            ordered = sorted(self.workqueue.items(), key=lambda unit: -cost(unit[0], len(unit[1])))
            self.workqueue = OrderedDict(ordered)
            self._ordered = True
        super()._assign_work_unit(node)
