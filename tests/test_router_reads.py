"""What a router reads off a launcher: KV events where GetKvEventSources says, and a live clock.

One launcher, KV events on, its publisher at `tcp://[::ffff:127.0.0.1]:P`: an
endpoint vLLM's publisher listens on (the `::` makes it bind) and ZeroMQ binds
as 127.0.0.1 only. A subscriber written with pyzmq alone, no code of this
package's, connects where GetKvEventSources says and reads the events a
Generate caused; the launcher's own relay (SubscribeKvEvents) reads the same
publisher. GetServerInfo's `last_receive_timestamp` is the start until the
first request, then that request's arrival.

Without a launcher: vLLM's publisher given each form (does it listen where
`kv_events.listens` says?), and a publisher in vLLM's connect form, which
GetKvEventSources and SubscribeKvEvents refuse, naming the forms that listen.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import msgspec
import pytest
import zmq
import zmq.asyncio
from support import KV_TOPIC, collect, free_port, loopback_kv_events, next_kv_event, request
from support.launcher import Launched, launched, launcher_env
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed.kv_events import AllBlocksCleared, KVEventBatch, ZmqEventPublisher

from vllm_servicer.errors import NotEnabledError
from vllm_servicer.proto import common_pb2, control_pb2, control_pb2_grpc, vllm_engine_pb2_grpc
from vllm_servicer.proto import vllm_engine_pb2 as pb
from vllm_servicer.servicer import kv_events
from vllm_servicer.testing.stand_in import StandInEngine


@dataclass
class Server:
    """The launcher, its publisher's port, and the wall-clock time just before it started."""

    launched: Launched
    port: int
    before_start: float


@pytest.fixture(scope="module")
async def server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Server]:
    work = tmp_path_factory.mktemp("router-reads")
    port = free_port()
    flags = ["--services", "vllm-engine", "control", "--kv-events-config", loopback_kv_events(port)]
    before_start = time.time()
    async with launched(*flags, env=launcher_env(work / "cache")) as served:
        yield Server(launched=served, port=port, before_start=before_start)


@pytest.fixture(scope="module")
async def channel(server: Server) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(server.launched.address) as channel:
        yield channel


# First in the module: no request may have reached the launcher before it.
async def test_last_receive_timestamp_is_the_start_until_a_request_arrives(
    server: Server, channel: grpc.aio.Channel
) -> None:
    stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    asked = time.time()
    info = await stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30)
    # The servicer's build, which uptime_seconds counts from, not 0.
    assert server.before_start <= info.last_receive_timestamp <= asked
    assert abs(info.last_receive_timestamp - (asked - info.uptime_seconds)) < 5, info

    sent = time.time()
    await collect(stub.Generate(request(max_tokens=1), timeout=120))
    after = await stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30)
    assert sent <= after.last_receive_timestamp <= time.time()


async def _stored(subscriber: zmq.asyncio.Socket) -> tuple[list[bytes], dict[str, Any]]:
    """The next frames whose batch holds a BlockStored event, and that event, read plainly."""
    while True:
        frames = await subscriber.recv_multipart()
        # vLLM's framing: topic, 8-byte big-endian sequence, msgpack [ts, events, rank].
        _, events, _ = msgspec.msgpack.decode(frames[2])
        for event in events:
            if event["type"] == "BlockStored":
                return frames, event


async def test_a_plain_zmq_subscriber_at_the_reported_endpoint_reads_the_events(
    server: Server, channel: grpc.aio.Channel
) -> None:
    stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    control = control_pb2_grpc.ControlStub(channel)
    (source,) = (await control.GetKvEventSources(control_pb2.GetKvEventSourcesRequest())).sources
    # Where the publisher listens, as any ZeroMQ socket (IPv6 off) dials it.
    assert source.endpoint == f"tcp://127.0.0.1:{server.port}", source
    assert (source.transport, source.topic) == ("zmq", KV_TOPIC)

    context = zmq.asyncio.Context()
    subscriber = context.socket(zmq.SUB)
    subscriber.setsockopt(zmq.LINGER, 0)
    subscriber.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
    subscriber.connect(source.endpoint)
    relayed = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())
    try:
        await asyncio.wait_for(relayed.initial_metadata(), 30)  # the relay is subscribed
        await asyncio.sleep(0.5)  # ZMQ subscriptions reach the publisher asynchronously
        # A prompt new to the prefix cache, a little over one 128-token block.
        prompt = [(11 * i + 5) % 250 + 3 for i in range(133)]
        await collect(stub.Generate(request(prompt, max_tokens=2), timeout=120))

        frames, event = await asyncio.wait_for(_stored(subscriber), 60)
        assert frames[0] == KV_TOPIC.encode()
        size = int(event["block_size"])
        assert size > 0 and list(event["token_ids"][:size]) == prompt[:size]
        # The launcher's relay reads the same publisher.
        _, wire = await next_kv_event(relayed, "stored", timeout=60)
        assert list(wire.stored.blocks[0].token_ids) == prompt[:size]
    finally:
        relayed.cancel()
        subscriber.close(linger=0)
        context.term()


# ----- without a launcher ---------------------------------------------------------------


@pytest.mark.parametrize(
    "form", ["tcp://127.0.0.1:{port}", "tcp://[::ffff:127.0.0.1]:{port}", "ipc://{dir}/kv"]
)
async def test_vllms_publisher_listens_where_listens_says(form: str, tmp_path: Path) -> None:
    """vLLM's own publisher, given each form: a subscriber at the connectable
    address hears it exactly when `listens` says that it listens."""
    endpoint = form.format(port=free_port(), dir=tmp_path)
    publisher = ZmqEventPublisher(0, endpoint=endpoint, topic=KV_TOPIC)
    context = zmq.asyncio.Context()
    subscriber = context.socket(zmq.SUB)
    subscriber.setsockopt(zmq.LINGER, 0)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    subscriber.connect(kv_events.connectable(endpoint))
    try:
        await asyncio.sleep(0.5)  # the subscription reaches a listening publisher
        publisher.publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
        heard = bool(await subscriber.poll(timeout=2000))
        assert heard == kv_events.listens(endpoint) == (form != "tcp://127.0.0.1:{port}")
        if form.startswith("tcp://[::ffff:"):  # bound on loopback alone
            bound = publisher._pub.getsockopt_string(zmq.LAST_ENDPOINT)  # type: ignore[union-attr]
            assert bound == kv_events.connectable(endpoint)
    finally:
        subscriber.close(linger=0)
        context.term()
        publisher.shutdown()


class _Publishing(StandInEngine):
    """A stand-in whose configuration publishes KV events at `endpoint`; its engine
    core reports `bound` as where it listens, or nothing yet."""

    def __init__(self, endpoint: str, bound: str | None = None) -> None:
        config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint)
        super().__init__(vllm_config=SimpleNamespace(kv_events_config=config))
        self._bound = bound

    def get_kv_event_sources(self) -> dict[int, Any]:
        if self._bound is None:
            return {}
        return {0: KVEventsConfig(enable_kv_cache_events=True, endpoint=self._bound)}


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5557", "tcp://epp.example:5557"])
def test_a_publisher_that_dials_is_named_nowhere(endpoint: str) -> None:
    """vLLM's connect form: GetKvEventSources and SubscribeKvEvents (both read
    `sources`) refuse it, naming where it dials and the forms that listen."""
    engine = _Publishing(endpoint)
    config = kv_events.publisher_config(engine)
    with pytest.raises(NotEnabledError) as refused:
        kv_events.sources(engine, config)
    message = str(refused.value)
    assert f"connects to {endpoint}" in message, message
    assert "ipc://" in message and "tcp://[::ffff:127.0.0.1]:PORT" in message, message
    assert "tcp://*:PORT" in message, message


def test_listening_publishers_are_named_where_a_subscriber_here_dials_them() -> None:
    for endpoint, named in [
        ("tcp://*:5557", "tcp://127.0.0.1:5557"),
        ("tcp://[::ffff:127.0.0.1]:6001", "tcp://127.0.0.1:6001"),
        ("ipc:///run/vllm/kv-events", "ipc:///run/vllm/kv-events"),
    ]:
        engine = _Publishing(endpoint)
        (source,) = kv_events.sources(engine, kv_events.publisher_config(engine))
        assert source == kv_events.Source(0, named), endpoint


def test_a_port_chosen_at_bind_is_named_once_reported() -> None:
    """vLLM binds `tcp://*:0` on this node's address and a port of the OS's
    choosing, and reports both: named as reported (its text has no `*` left to
    tell it listens), and refused, saying why, until it is reported."""
    engine = _Publishing("tcp://*:0", bound="tcp://10.0.0.7:41234")
    (source,) = kv_events.sources(engine, kv_events.publisher_config(engine))
    assert source.endpoint == "tcp://10.0.0.7:41234"
    unreported = _Publishing("tcp://*:0")
    with pytest.raises(NotEnabledError, match="has not reported which"):
        kv_events.sources(unreported, kv_events.publisher_config(unreported))
