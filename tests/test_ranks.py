"""One rank numbering: every pinned rank is global, translated for the engine once.

vLLM takes `data_parallel_rank` as an index among a frontend's own engines;
GetLoads, vLLM's metrics and KV events name ranks globally. These tests read
the ranks a frontend serves from stand-in parallel configs shaped as vLLM
builds them for each layout, and check each way in (VllmEngine's field,
vllm.Inference's metadata, the HTTP API's header) on a stand-in engine that
serves ranks 2-3 of four, as a hybrid launcher does.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from vllm.exceptions import GracefulHTTPError
from vllm.sampling_params import SamplingParams

from vllm_servicer import ranks
from vllm_servicer.errors import InvalidRequestError
from vllm_servicer.proto import inference_pb2, inference_pb2_grpc, vllm_engine_pb2_grpc
from vllm_servicer.proto import vllm_engine_pb2 as pb
from vllm_servicer.serve.http_guard import GuardedEngine
from vllm_servicer.servicer.tenancy import Claim, RunningRequests
from vllm_servicer.servicer.tenant_engine import TenantEngine
from vllm_servicer.testing.serving import serving
from vllm_servicer.testing.stand_in import FaultEngine


def _parallel(**fields: Any) -> Any:
    """A parallel config as vLLM's `ParallelConfig` holds it for one layout."""
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


def _engine(parallel: Any) -> Any:
    return SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=parallel))


LAYOUTS = {
    # One launcher over every rank, local or on headless nodes.
    "one rank": (_parallel(), range(0, 1)),
    "internal": (_parallel(data_parallel_size=4, data_parallel_size_local=2), range(0, 4)),
    # A launcher per rank: `--data-parallel-size 4 --data-parallel-rank 2`.
    "external": (
        _parallel(data_parallel_size=4, data_parallel_rank=2, data_parallel_external_lb=True),
        range(2, 3),
    ),
    # A launcher per node: `--data-parallel-start-rank 2 --data-parallel-size-local 2`.
    "hybrid": (
        _parallel(
            data_parallel_size=4,
            data_parallel_size_local=2,
            data_parallel_rank=2,
            data_parallel_hybrid_lb=True,
        ),
        range(2, 4),
    ),
    # A dense model's engine resets its own rank; the index keeps the global one.
    "index kept": (
        _parallel(
            data_parallel_size=4,
            data_parallel_rank=0,
            data_parallel_index=3,
            data_parallel_external_lb=True,
        ),
        range(3, 4),
    ),
    # vLLM's offline SPMD mode: one engine per process.
    "offline": (
        _parallel(data_parallel_size=2, data_parallel_rank=1, data_parallel_rank_local=1),
        range(1, 2),
    ),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_ranks_served_in_each_layout(layout: str) -> None:
    parallel, served = LAYOUTS[layout]
    engine = _engine(parallel)
    assert ranks.served_ranks(engine) == served
    # Each served rank is the engine's index from the first served.
    assert [ranks.engine_index(engine, rank) for rank in served] == list(range(len(served)))


def test_an_engine_without_a_parallel_config_serves_rank_0() -> None:
    assert ranks.served_ranks(SimpleNamespace()) == range(1)
    assert ranks.served_ranks(SimpleNamespace(vllm_config=SimpleNamespace())) == range(1)


@pytest.mark.parametrize("rank", [0, 1, 4, -1])
def test_a_rank_not_served_is_refused_naming_the_ranks_served(rank: int) -> None:
    engine = _engine(LAYOUTS["hybrid"][0])
    with pytest.raises(InvalidRequestError) as refused:
        ranks.engine_index(engine, rank, "x-data-parallel-rank")
    assert str(refused.value) == (
        f"x-data-parallel-rank: rank {rank} is not served here: this server serves ranks 2-3"
    )
    assert ranks.engine_index_if_served(engine, rank) is None


def test_one_rank_is_described_alone() -> None:
    engine = _engine(LAYOUTS["external"][0])
    with pytest.raises(InvalidRequestError, match="this server serves rank 2$"):
        ranks.engine_index(engine, 0)
    assert ranks.engine_index_if_served(engine, 2) == 0
    assert ranks.engine_index_if_served(engine, None) is None


class HybridEngine(FaultEngine):
    """Stand-in serving ranks 2 and 3 of four; records the index each call asked for."""

    def __init__(self) -> None:
        super().__init__(step_interval=0.001)
        self.engine_core = SimpleNamespace(engine_ranks_managed=[2, 3])
        self.vllm_config = SimpleNamespace(parallel_config=LAYOUTS["hybrid"][0])
        self.indexes: list[int | None] = []

    def generate(self, *args: Any, data_parallel_rank: int | None = None, **kwargs: Any) -> Any:
        self.indexes.append(data_parallel_rank)
        return super().generate(*args, data_parallel_rank=data_parallel_rank, **kwargs)


@pytest.fixture(scope="module")
async def hybrid() -> AsyncIterator[tuple[HybridEngine, grpc.aio.Channel]]:
    engine = HybridEngine()
    async with serving(engine) as served:
        yield engine, served.channel


def _vllm_engine_request(rank: int | None) -> pb.GenerateRequest:
    request = pb.GenerateRequest(
        request_id=f"pin-{rank}",
        tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]),
        sampling_params=pb.SamplingParams(max_tokens=2),
    )
    if rank is not None:
        request.data_parallel_rank = rank
    return request


async def test_vllm_engine_pins_by_global_rank(hybrid: Any) -> None:
    engine, channel = hybrid
    stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    engine.indexes.clear()
    for rank in (3, 2, None):
        assert [m async for m in stub.Generate(_vllm_engine_request(rank))]
    assert engine.indexes == [1, 0, None]
    for rank in (0, 1, 4):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Generate(_vllm_engine_request(rank)).read()
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details() == (
            f"data_parallel_rank: rank {rank} is not served here: this server serves ranks 2-3"
        )
    assert engine.indexes == [1, 0, None]
    # GetLoads names the same ranks the pins take.
    loads = await stub.GetLoads(pb.GetLoadsRequest(dp_rank=3))
    assert loads.dp_rank_count == 2


async def test_vllm_inference_pins_by_global_rank(hybrid: Any) -> None:
    engine, channel = hybrid
    stub = inference_pb2_grpc.InferenceStub(channel)
    request = inference_pb2.GenerateRequest(
        token_ids=inference_pb2.TokenIds(ids=[1, 2, 3]),
        stopping=inference_pb2.StoppingCriteria(max_new_tokens=2),
    )
    engine.indexes.clear()
    await stub.Generate(request, metadata=(("x-data-parallel-rank", "3"),))
    assert engine.indexes == [1]
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Generate(request, metadata=(("x-data-parallel-rank", "1"),))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == (
        "x-data-parallel-rank: rank 1 is not served here: this server serves ranks 2-3"
    )
    assert engine.indexes == [1]


async def test_the_http_apis_header_pins_by_global_rank() -> None:
    engine = HybridEngine()
    guarded = GuardedEngine(engine, _Guard(engine))  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=1)
    outputs = guarded.generate({"prompt_token_ids": [1]}, params, "h-1", data_parallel_rank=3)
    assert [o.finished async for o in outputs] == [True]
    assert engine.indexes == [1]
    with pytest.raises(GracefulHTTPError) as refused:
        guarded.generate({"prompt_token_ids": [1]}, params, "h-2", data_parallel_rank=0)
    assert refused.value.http_status == 400
    assert "X-data-parallel-rank: rank 0 is not served here: this server serves ranks 2-3" in str(
        refused.value
    )
    assert engine.indexes == [1]


class _Guard:
    """As much of `EngineGuard` as an HTTP generation asks, holding no slot."""

    def __init__(self, engine: Any) -> None:
        self.tenant = TenantEngine(engine, RunningRequests())
        self.running = self.tenant.running

    def check(self, request_id: str, method: str) -> None:
        pass

    def hold(self, request_id: str, method: str) -> contextlib.AbstractContextManager[Claim]:
        return contextlib.nullcontext(self.tenant.claim(request_id, method))
