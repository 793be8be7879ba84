"""A real router's index, fed by the launchers' KV events: the SMG gateway's cache-aware policy.

Two launchers, each publishing its engine's KV events where docs/routers.md
advises (a private listening address, `tcp://[::ffff:127.0.0.1]:P`), behind one
SMG gateway (PyPI smg, the release benchmarks/gateway.py measures, in its own
venv) run with `--policy cache_aware`. The gateway subscribes to each
launcher's SubscribeKvEvents and builds its prefix index from those events
(smg's event-driven mode); nothing else tells it where a prefix is.

Every prompt is placed on a replica directly, never through the gateway, so
the gateway can know where it is only from the events. The test keeps its own
mirror of both engines' caches from the same streams (stored blocks, minus
removed and cleared ones) and checks that:

- the gateway's index holds as many blocks as the mirror (`smg_kv_index_memberships`);
- a placed prompt, sent through the gateway, lands on the replica that holds
  it and hits its cache, every time;
- blocks the engine evicts (a KV cache of eight blocks, filled with other
  prompts) or flushes (FlushCache) leave the index, and the prompt, placed on
  the other replica since, goes there. (vLLM publishes events after an engine
  step: a flush reaches the index with the engine's next request.)

Which replica served a gateway call is read off each replica's
`GetServerInfo.last_receive_timestamp`.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import free_port, loopback_kv_events, request, settle
from support.launcher import ROOT, Launched, launch, launcher_env, stop, stop_launched

from vllm_servicer.proto import common_pb2, vllm_engine_pb2_grpc
from vllm_servicer.proto import vllm_engine_pb2 as pb

sys.path.insert(0, str(ROOT / "benchmarks"))
import gateway  # noqa: E402  (benchmarks/gateway.py: the smg release and its venv)

pytestmark = [pytest.mark.bench, pytest.mark.engine]

BLOCK = 128
"""The tiny model's KV block, in tokens (vLLM's CPU default)."""
KV_CACHE_BYTES = 8 * BLOCK * 1024
"""Eight blocks of the tiny model (1 KiB a token): a few prompts evict the oldest."""
PROMPT = 300
"""A placed prompt's length: two full blocks, which the engine caches and publishes."""


@dataclass
class Replica:
    """One launcher, its stub, and the blocks its engine holds as its events say."""

    name: str
    launched: Launched
    stub: vllm_engine_pb2_grpc.VllmEngineStub
    held: set[int] = field(default_factory=set)
    stored: dict[int, list[int]] = field(default_factory=dict)  # hash -> its tokens
    evicted: set[int] = field(default_factory=set)

    def apply(self, batch: common_pb2.KvEventBatch) -> None:
        for event in batch.events:
            kind = event.WhichOneof("data")
            if kind == "stored":
                for block in event.stored.blocks:
                    self.held.add(block.block_hash)
                    self.stored[block.block_hash] = list(block.token_ids)
            elif kind == "removed":
                self.held.difference_update(event.removed.block_hashes)
                self.evicted.update(event.removed.block_hashes)
            elif kind == "cleared":
                self.evicted.update(self.held)
                self.held.clear()

    def holds(self, prompt: list[int]) -> bool:
        """Whether every full block of `prompt` is in this engine's cache."""
        blocks = [prompt[i : i + BLOCK] for i in range(0, len(prompt) - BLOCK + 1, BLOCK)]
        cached = [tokens for h, tokens in self.stored.items() if h in self.held]
        return all(block in cached for block in blocks)


@dataclass
class Routed:
    """Both replicas, the gateway in front of them, and its model's name."""

    replicas: list[Replica]
    gateway_url: str
    metrics_url: str
    model: str
    log: Path


async def _mirror(replica: Replica, channel: grpc.aio.Channel) -> None:
    stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    async for batch in stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest()):
        replica.apply(batch)


def _fetch(url: str, body: dict[str, Any] | None = None) -> str:
    """GET `url`, or POST `body` to it as JSON: the answer's text."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=60) as reply:
        return str(reply.read().decode())


@pytest.fixture(scope="module")
async def routed(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Routed]:
    problem = await asyncio.to_thread(gateway.ensure_smg, gateway.SMG_VENV)
    assert problem is None, problem
    work = tmp_path_factory.mktemp("router-index")
    env = launcher_env(work / "cache")  # one model path: the gateway's one model
    flags = ("--kv-cache-memory-bytes", str(KV_CACHE_BYTES))
    started = await asyncio.gather(
        *(
            launch(*flags, "--kv-events-config", loopback_kv_events(free_port()), env=env)
            for _ in range(2)
        ),
        return_exceptions=True,
    )
    launched = [s for s in started if isinstance(s, Launched)]
    channels: list[grpc.aio.Channel] = []
    mirrors: list[asyncio.Task[None]] = []
    smg = None
    try:
        for s in started:
            if isinstance(s, BaseException):
                raise s
        replicas = []
        for name, served in zip("AB", launched, strict=True):
            channel = grpc.aio.insecure_channel(served.address)
            channels.append(channel)
            replica = Replica(name, served, vllm_engine_pb2_grpc.VllmEngineStub(channel))
            replicas.append(replica)
            mirrors.append(asyncio.ensure_future(_mirror(replica, channel)))
        model = str(work / "cache" / "tiny-llama")
        port, metrics_port = free_port(), free_port()
        log = work / "smg.log"
        cmd = [str(gateway.smg_binary(gateway.SMG_VENV)), "launch", "--host", "127.0.0.1"]
        cmd += ["--port", str(port), "--prometheus-host", "127.0.0.1"]
        cmd += ["--prometheus-port", str(metrics_port), "--model-path", model]
        cmd += ["--worker-urls", *(f"grpc://{r.launched.address}" for r in replicas)]
        # Cache-aware routing with no warm-up detours: a miss or a hit goes where
        # the index says, so each choice shows what the index holds.
        cmd += ["--policy", "cache_aware", "--worker-warmup-secs", "0"]
        cmd += ["--worker-warmup-divert-every", "0"]
        with log.open("wb") as out:
            smg = await asyncio.create_subprocess_exec(
                *cmd, stdout=out, stderr=out, env={**os.environ, "RUST_LOG": "info"}
            )
        url = f"http://127.0.0.1:{port}"

        def subscribed() -> bool:
            assert smg is not None and smg.returncode is None, log.read_text()[-3000:]
            return log.read_text(errors="replace").count("KV event stream connected") >= 2

        assert await settle(subscribed, 60), "the gateway did not subscribe to both launchers"
        yield Routed(replicas, url, f"http://127.0.0.1:{metrics_port}/metrics", model, log)
    finally:
        if smg is not None:
            await stop(smg)
        for task in mirrors:
            task.cancel()
        for channel in channels:
            await channel.close()
        await asyncio.gather(*(stop_launched(s) for s in launched), return_exceptions=True)


# ----- what the test does to the replicas and asks the gateway -----------------------------


async def _place(replica: Replica, prompt: list[int]) -> None:
    """`prompt` generated on `replica` directly, and its blocks in the mirror."""
    await replica.stub.Generate(request(prompt, max_tokens=1), timeout=120).read()
    assert await settle(lambda: replica.holds(prompt), 60), f"{replica.name} published no blocks"


async def _index_size(routed: Routed) -> int:
    """The (block, replica) pairs the gateway's index holds for the model."""
    text = await asyncio.to_thread(_fetch, routed.metrics_url)
    for family in text_string_to_metric_families(text):
        if family.name == "smg_kv_index_memberships":
            return int(
                sum(s.value for s in family.samples if s.labels.get("model") == routed.model)
            )
    raise AssertionError("the gateway reports no smg_kv_index_memberships")


async def _index_mirrors_the_engines(routed: Routed) -> None:
    """The gateway's index holds as many (block, replica) pairs as the engines'
    events say they hold; where it places prompts is the routing tests' part."""
    want = sum(len(r.held) for r in routed.replicas)
    deadline = time.monotonic() + 30
    while (held := await _index_size(routed)) != want:
        assert time.monotonic() < deadline, f"the gateway's index holds {held} blocks, not {want}"
        await asyncio.sleep(0.2)


async def _through_gateway(routed: Routed, prompt: list[int]) -> tuple[str, int]:
    """`prompt` sent through the gateway: the replica that served it and its cached tokens."""
    stamps = [await _stamp(r) for r in routed.replicas]
    body = {"model": routed.model, "input_ids": prompt, "sampling_params": {"max_new_tokens": 1}}
    (answer,) = json.loads(await asyncio.to_thread(_fetch, routed.gateway_url + "/generate", body))
    served = [r.name for r, s in zip(routed.replicas, stamps, strict=True) if await _stamp(r) != s]
    assert len(served) == 1, served
    return served[0], answer["meta_info"]["cached_tokens"]


async def _stamp(replica: Replica) -> float:
    info = await replica.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30)
    return info.last_receive_timestamp


def _prompts(seed: int, count: int, length: int = PROMPT) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(length)] for _ in range(count)]


# ----- the router's index -------------------------------------------------------------------


async def test_each_prompt_goes_to_the_replica_whose_events_placed_it(routed: Routed) -> None:
    a, b = routed.replicas
    placed = [(p, a if i % 2 == 0 else b) for i, p in enumerate(_prompts(1, 6))]
    for prompt, home in placed:
        await _place(home, prompt)
    await _index_mirrors_the_engines(routed)
    assert "Learned block_size from KV event" in routed.log.read_text(errors="replace")
    # Each repeat (a longer prompt with the placed one as its prefix), through the gateway.
    for prompt, home in placed:
        served, cached = await _through_gateway(routed, [*prompt, 7, 8])
        assert (served, cached) == (home.name, 2 * BLOCK)


async def test_evicted_blocks_leave_the_index(routed: Routed) -> None:
    a, b = routed.replicas
    (prompt,) = _prompts(2, 1)
    await _place(a, prompt)
    await _index_mirrors_the_engines(routed)
    assert (await _through_gateway(routed, [*prompt, 9]))[0] == "A"

    # Other prompts fill A's eight blocks: the engine evicts the placed prompt's.
    placed_blocks = {h for h, tokens in a.stored.items() if tokens == prompt[:BLOCK]}
    for filler in _prompts(3, 4, length=4 * BLOCK - 8):
        await _place(a, filler)
    assert await settle(lambda: not a.holds(prompt), 60), "A kept the placed prompt"
    assert placed_blocks and placed_blocks <= a.evicted
    await _place(b, prompt)
    await _index_mirrors_the_engines(routed)
    served, cached = await _through_gateway(routed, [*prompt, 10])
    assert (served, cached) == ("B", 2 * BLOCK)


async def test_a_flushed_cache_leaves_the_index(routed: Routed) -> None:
    a, b = routed.replicas
    (prompt,) = _prompts(4, 1)
    await _place(b, prompt)
    await _index_mirrors_the_engines(routed)
    assert (await _through_gateway(routed, [*prompt, 11]))[0] == "B"

    flushed = await b.stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=60)
    assert flushed.success, flushed
    # vLLM publishes a step's events after the step: an idle engine's flush reaches
    # the subscribers with its next request, here one too short to fill a block.
    await b.stub.Generate(request(list(range(3, 19)), max_tokens=1), timeout=120).read()
    assert await settle(lambda: not b.held, 60), "B's events did not clear its cache"
    await _index_mirrors_the_engines(routed)
    await _place(a, prompt)
    await _index_mirrors_the_engines(routed)
    served, cached = await _through_gateway(routed, [*prompt, 12])
    assert (served, cached) == ("A", 2 * BLOCK)
