"""The head's watch over engines on other nodes, on a stand-in engine client.

Which ranks are remote follows the layout; an engine that stops answering is
counted dead after the misses allowed, as a local engine whose process ended,
and one that answers slowly but within the misses is not. The real engine's
case (a headless node's engine killed) is in test_dp_headless.py.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from grpc_health.v1 import health_pb2  # type: ignore[import-untyped]

from vllm_servicer.health import NOT_SERVING, SERVING, EngineHealthServicer, rank_service
from vllm_servicer.serve.remote_engines import remote_ranks, watch_remote_engines


def _parallel(**fields: Any) -> Any:
    config = {
        "data_parallel_size": 1,
        "data_parallel_size_local": 1,
        "data_parallel_rank": 0,
        "data_parallel_rank_local": None,
        "data_parallel_external_lb": False,
        "data_parallel_hybrid_lb": False,
        **fields,
    }
    config.setdefault("data_parallel_index", config["data_parallel_rank"])
    return SimpleNamespace(**config)


@pytest.mark.parametrize(
    ("parallel", "remote"),
    [
        (_parallel(), range(0)),
        (_parallel(data_parallel_size=2, data_parallel_size_local=2), range(0)),
        # A head over four ranks, two of them its own: 2 and 3 are headless nodes'.
        (_parallel(data_parallel_size=4, data_parallel_size_local=2), range(2, 4)),
        (_parallel(data_parallel_size=2, data_parallel_size_local=0), range(0, 2)),
        (
            _parallel(
                data_parallel_size=4,
                data_parallel_size_local=2,
                data_parallel_rank=2,
                data_parallel_hybrid_lb=True,
            ),
            range(0),
        ),
        (
            _parallel(data_parallel_size=2, data_parallel_rank=1, data_parallel_external_lb=True),
            range(0),
        ),
    ],
)
def test_the_remote_ranks_of_each_layout(parallel: Any, remote: range) -> None:
    engine = SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=parallel))
    assert remote_ranks(engine) == remote


class _Core:
    """An engine-core client whose engines answer, or not, as told."""

    def __init__(self, silent: set[int], slow: float = 0.0) -> None:
        self.core_engines = [rank.to_bytes(2, "little") for rank in range(2)]
        self.silent = silent
        self.slow = slow
        self.asked: list[int] = []
        self.resources = SimpleNamespace(engine_dead=False)
        self.shut = False

    async def _call_utility_async(self, method: str, *args: Any, engine: bytes) -> Any:
        index = self.core_engines.index(engine)
        self.asked.append(index)
        if index in self.silent:
            await asyncio.Event().wait()
        await asyncio.sleep(self.slow)
        return False

    def shutdown(self) -> None:
        self.shut = True


class _Engine:
    def __init__(self, core: _Core) -> None:
        self.engine_core = core
        self.vllm_config = SimpleNamespace(
            parallel_config=_parallel(data_parallel_size=2, data_parallel_size_local=1)
        )

    @property
    def errored(self) -> bool:
        return bool(self.engine_core.resources.engine_dead)


async def test_a_remote_engine_that_stops_answering_is_counted_dead() -> None:
    core = _Core(silent={1})
    engine = _Engine(core)
    await asyncio.wait_for(
        watch_remote_engines(engine, interval=0.01, timeout=0.05, misses_allowed=2), 5
    )
    assert engine.errored and core.shut
    # Only the remote engine (rank 1) is asked, three times: two misses forgiven.
    assert core.asked == [1, 1, 1]


async def test_a_slow_answer_within_the_misses_allowed_is_no_death() -> None:
    core = _Core(silent=set(), slow=0.02)
    engine = _Engine(core)
    watch = asyncio.ensure_future(
        watch_remote_engines(engine, interval=0.01, timeout=0.1, misses_allowed=1)
    )
    await asyncio.sleep(0.5)
    assert not watch.done() and not engine.errored
    assert len(core.asked) >= 5
    watch.cancel()


async def test_a_rank_that_misses_a_question_is_not_ready_until_it_answers() -> None:
    core = _Core(silent={1})
    engine = _Engine(core)
    health = EngineHealthServicer(engine, services=("",))
    # Every rank served has its own service, by its global number.
    assert await _status(health, rank_service(0)) == SERVING
    assert await _status(health, rank_service(1)) == SERVING
    watch = asyncio.ensure_future(
        watch_remote_engines(
            engine,
            interval=0.01,
            timeout=0.05,
            misses_allowed=100,
            on_answer=health.rank_answered,
        )
    )
    for _ in range(100):
        await asyncio.sleep(0.02)
        if await _status(health, rank_service(1)) == NOT_SERVING:
            break
    # The silent rank is not ready; the server and the other rank still are.
    assert await _status(health, rank_service(1)) == NOT_SERVING
    assert await _status(health, "") == SERVING
    assert await _status(health, rank_service(0)) == SERVING
    core.silent.clear()
    for _ in range(100):
        await asyncio.sleep(0.02)
        if await _status(health, rank_service(1)) == SERVING:
            break
    assert await _status(health, rank_service(1)) == SERVING
    watch.cancel()
    assert not engine.errored


async def test_an_engine_of_one_rank_has_no_rank_services() -> None:
    engine = SimpleNamespace(
        errored=False, vllm_config=SimpleNamespace(parallel_config=_parallel())
    )
    health = EngineHealthServicer(engine, services=("",))
    assert await _status(health, "") == SERVING
    with pytest.raises(_Aborted, match="NOT_FOUND"):
        await _status(health, rank_service(0))


class _Aborted(Exception):
    pass


class _Context:
    """What Check uses of a call's context: its abort."""

    async def abort(self, code: Any, details: str = "") -> None:
        raise _Aborted(code.name)


async def _status(health: EngineHealthServicer, service: str) -> int:
    reply = await health.Check(health_pb2.HealthCheckRequest(service=service), _Context())
    return int(reply.status)
