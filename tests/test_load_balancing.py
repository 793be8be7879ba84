"""gRPC's own balancer sends new calls to the less-loaded replica, by the load reports.

Two launchers as users run them, one kept busy by long streams. A grpcio
client over both addresses, balancing with gRPC's `weighted_round_robin`
(gRFC A58; its C core weighs each replica by the ORCA reports the launchers
send: per call, in the trailers, then out of band, from `OpenRcaService`),
sends most of its short calls to the idle replica; with `round_robin` it
splits them evenly. Which replica served a call is read from each launcher's
own metrics (`grpc_server_handled_total`), the busy streams being another
method's. One pair of launchers serves the whole module.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import request
from support.launcher import START_TIMEOUT, Launched, launch, launcher_env, stop_launched

from vllm_servicer.proto import inference_pb2, inference_pb2_grpc, vllm_engine_pb2_grpc

pytestmark = pytest.mark.timeout(2 * START_TIMEOUT + 180)

BUSY_STREAMS = 8  # of the launchers' 16 sequence slots (--max-num-seqs)
CALLS = 200  # short calls counted per policy
CONCURRENCY = 2
WARM_UP_SECONDS = 3.0  # short calls before counting: reports arrive, weights settle
# Short periods so that weights follow the reports within the test's seconds
# (defaults: 10 s of blackout, weights updated each second, OOB reports every 10 s).
WRR = {
    "blackoutPeriod": "0s",
    "weightUpdatePeriod": "0.1s",
    "weightExpirationPeriod": "3s",
}


def service_config(policy: str, *, oob: bool = False) -> str:
    config: dict[str, Any] = {}
    if policy == "weighted_round_robin":
        config = dict(WRR)
        if oob:
            config |= {"enableOobLoadReport": True, "oobReportingPeriod": "1s"}
    return json.dumps({"loadBalancingConfig": [{policy: config}]})


@pytest.fixture(scope="module")
async def replicas(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[list[Launched]]:
    """Two launchers, started together: [busy, idle]."""
    env = launcher_env(tmp_path_factory.mktemp("cache"))
    flags = ("--metrics-port", "0", "--max-num-seqs", "16")
    started = await asyncio.gather(
        launch(*flags, env=env), launch(*flags, env=env), return_exceptions=True
    )
    served = [s for s in started if isinstance(s, Launched)]
    try:
        for failed in started:
            if isinstance(failed, BaseException):
                raise failed
        yield served
    finally:
        for launched in served:
            await stop_launched(launched)


@pytest.fixture(scope="module")
async def busy(replicas: list[Launched]) -> AsyncIterator[Launched]:
    """The first replica, kept busy by long streams as long as the module runs."""
    stop = asyncio.Event()
    channel = grpc.aio.insecure_channel(replicas[0].address)
    stub = inference_pb2_grpc.InferenceStub(channel)

    async def stream(i: int) -> None:
        message = inference_pb2.GenerateRequest(
            token_ids=inference_pb2.TokenIds(ids=[3 + i] * 8),
            stopping=inference_pb2.StoppingCriteria(max_new_tokens=480, ignore_eos=True),
        )
        while not stop.is_set():
            async for _ in stub.GenerateStream(message):
                if stop.is_set():
                    break

    streams = [asyncio.ensure_future(stream(i)) for i in range(BUSY_STREAMS)]
    await asyncio.sleep(2)  # every stream running
    try:
        yield replicas[0]
    finally:
        stop.set()
        for task in streams:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await asyncio.gather(*streams)
        await channel.close()


def _generates_handled(metrics_url: str) -> float:
    """VllmEngine Generate calls the launcher has answered, from its own metrics."""
    text = urllib.request.urlopen(metrics_url, timeout=30).read().decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if (
                sample.name == "grpc_server_handled_total"
                and labels.get("grpc_service") == "vllm.grpc.engine.VllmEngine"
                and labels.get("grpc_method") == "Generate"
            ):
                total += sample.value
    return total


async def split(replicas: list[Launched], policy: str, *, oob: bool = False) -> list[int]:
    """How many of `CALLS` short Generates each replica served, through one
    channel over both addresses that balances with `policy`."""
    target = "ipv4:" + ",".join(r.address for r in replicas)
    options = [
        ("grpc.service_config", service_config(policy, oob=oob)),
        ("grpc.use_local_subchannel_pool", 1),  # this channel's own connections and weights
    ]
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)

        async def calls(n: int) -> None:
            for _ in range(n):
                async for _ in stub.Generate(request(max_tokens=2)):
                    pass

        started = time.monotonic()
        while time.monotonic() - started < WARM_UP_SECONDS:
            await asyncio.gather(*(calls(4) for _ in range(CONCURRENCY)))
        before = [await asyncio.to_thread(_generates_handled, r.metrics_url) for r in replicas]
        await asyncio.gather(*(calls(CALLS // CONCURRENCY) for _ in range(CONCURRENCY)))
        after = [await asyncio.to_thread(_generates_handled, r.metrics_url) for r in replicas]
    served = [round(a - b) for a, b in zip(after, before, strict=True)]
    print(f"{policy}{' (out of band)' if oob else ''}: busy {served[0]}, idle {served[1]}")
    assert sum(served) == CALLS
    return served


async def test_round_robin_splits_evenly(replicas: list[Launched], busy: Launched) -> None:
    served = await split(replicas, "round_robin")
    assert 0.4 <= served[1] / CALLS <= 0.6


async def test_weighted_round_robin_sends_most_calls_to_the_idle_replica(
    replicas: list[Launched], busy: Launched
) -> None:
    served = await split(replicas, "weighted_round_robin")
    assert served[1] / CALLS >= 0.8, served


async def test_out_of_band_reports_weigh_the_replicas_too(
    replicas: list[Launched], busy: Launched
) -> None:
    # With OOB reporting the policy reads no trailer: its weights come from
    # OpenRcaService streams alone (without them, it would fall back to round robin).
    served = await split(replicas, "weighted_round_robin", oob=True)
    assert served[1] / CALLS >= 0.8, served
