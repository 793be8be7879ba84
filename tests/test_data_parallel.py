"""Data parallelism inside one server: rank pinning and per-rank loads.

A stand-in engine (vllm_servicer.testing.stand_in) that claims two ranks, for
the servicer's part alone: `GenerateRequest.data_parallel_rank` reaches
`engine.generate`, and GetLoads reports each rank from the SchedulerStats the
engine's output loop hands to stat loggers. The real engine's layouts are in
test_dp_layouts.py and test_dp_headless.py; the rank numbering in test_ranks.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from support import serving

from vllm_servicer.load_reports import stats_tap
from vllm_servicer.proto import vllm_engine_pb2 as pb
from vllm_servicer.proto import vllm_engine_pb2_grpc
from vllm_servicer.testing.stand_in import FaultEngine


class TwoRankEngine(FaultEngine):
    """Stand-in claiming two data-parallel ranks; records the rank each request asked for."""

    def __init__(self) -> None:
        super().__init__(step_interval=0.001)
        self.engine_core = SimpleNamespace(engine_ranks_managed=[0, 1])
        self.logger_manager = SimpleNamespace(stat_loggers=[])
        self.vllm_config = SimpleNamespace(
            parallel_config=SimpleNamespace(data_parallel_size=2, data_parallel_rank=0),
            cache_config=SimpleNamespace(num_gpu_blocks=200, block_size=16, cache_dtype="auto"),
            scheduler_config=SimpleNamespace(max_num_seqs=64),
        )
        self.ranks_asked: list[int | None] = []

    def generate(self, *args: Any, data_parallel_rank: int | None = None, **kwargs: Any) -> Any:
        self.ranks_asked.append(data_parallel_rank)
        return super().generate(*args, data_parallel_rank=data_parallel_rank, **kwargs)


def _stats(running: int, waiting: int, usage: float) -> Any:
    return SimpleNamespace(
        num_running_reqs=running,
        num_waiting_reqs=waiting,
        num_skipped_waiting_reqs=0,
        kv_cache_usage=usage,
        prefix_cache_stats=None,
    )


@pytest.fixture(scope="module")
async def dp() -> AsyncIterator[tuple[TwoRankEngine, Any]]:
    engine = TwoRankEngine()
    async with serving(engine) as served:
        yield engine, vllm_engine_pb2_grpc.VllmEngineStub(served.channel)


async def test_generate_pins_the_requested_rank(dp: Any) -> None:
    engine, stub = dp
    for rank in (1, 0, None):
        request = pb.GenerateRequest(
            request_id=f"dp-{rank}",
            tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]),
            sampling_params=pb.SamplingParams(max_tokens=2),
        )
        if rank is not None:
            request.data_parallel_rank = rank
        assert [m async for m in stub.Generate(request)]
    assert engine.ranks_asked == [1, 0, None]


async def test_get_loads_reports_each_rank(dp: Any) -> None:
    engine, stub = dp
    info = await stub.GetServerInfo(pb.GetServerInfoRequest())
    assert info.data_parallel_size == 2
    tap = stats_tap.attach(engine)  # the one the servicer attached
    assert tap is not None and engine.logger_manager.stat_loggers == [tap]
    # Before any stats: no rank is reported as idle, but both are counted.
    empty = await stub.GetLoads(pb.GetLoadsRequest())
    assert empty.dp_rank_count == 2 and not empty.loads
    tap.record(_stats(3, 1, 0.25), None, engine_idx=0)
    tap.record(_stats(5, 0, 0.5), None, engine_idx=1)
    both = await stub.GetLoads(pb.GetLoadsRequest())
    by_rank = {load.dp_rank: load for load in both.loads}
    assert sorted(by_rank) == [0, 1]
    assert (by_rank[0].num_running_reqs, by_rank[0].num_waiting_reqs) == (3, 1)
    assert by_rank[1].num_total_reqs == 5 and by_rank[1].token_usage == 0.5
    # num_gpu_blocks is the frontend's total: each rank has half.
    assert by_rank[1].max_total_num_tokens == 100 * 16
    one = await stub.GetLoads(pb.GetLoadsRequest(dp_rank=1))
    assert [load.dp_rank for load in one.loads] == [1]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.GetLoads(pb.GetLoadsRequest(dp_rank=2))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "dp_rank" in err.value.details()
