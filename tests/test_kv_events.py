"""SubscribeKvEvents on a real engine started with KV events on.

This module builds its own engine (the tiny model with prefix caching and vLLM's
ZMQ KV-event publisher); the relay's mapping is also checked on recorded
publisher messages. Profiling is tested through the launcher (test_profiler.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import msgspec
import pytest
from smg_grpc_proto.generated import common_pb2 as ref_common
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as ref_grpc
from support import (
    ENGINE_STOP_SECONDS,
    bearer,
    collect,
    next_kv_event,
    request,
    serving,
    settle,
    wait_until_idle,
)
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

from vllm_servicer.errors import EventsLostError, FieldOutOfRangeError, TooManySubscribersError
from vllm_servicer.interceptors.api_keys import ApiKeyVerifier
from vllm_servicer.interceptors.auth import ADMIN_ROLE, AuthInterceptor, Identity, current_identity
from vllm_servicer.interceptors.verifiers import AnyOf
from vllm_servicer.proto import common_pb2, vllm_engine_pb2_grpc
from vllm_servicer.servicer.kv_events import BatchDecoder, Source, relay, to_int64
from vllm_servicer.servicer.tenancy import SubscriberLimit
from vllm_servicer.testing.tiny_model import build_tiny_engine


# This module's two engines publish KV events, which no other test's engine does;
# one keeps a replay buffer and the other must not (a resume point is refused there).
@pytest.fixture(scope="module")
async def featured(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[Any, grpc.aio.Channel]]:
    work = tmp_path_factory.mktemp("featured")
    engine = build_tiny_engine(
        tiny_model_dir,
        enable_prefix_caching=True,
        kv_events_config=KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=f"ipc://{work}/kv-events"
        ),
    )
    try:
        async with serving(engine, health=False) as served:
            yield engine, served.channel
    finally:
        engine.shutdown(timeout=ENGINE_STOP_SECONDS)


def _stub(channel: grpc.aio.Channel, kind: str) -> tuple[Any, Any]:
    if kind == "own":
        return vllm_engine_pb2_grpc.VllmEngineStub(channel), common_pb2
    return ref_grpc.VllmEngineStub(channel), ref_common


@pytest.mark.parametrize("kind", ["own", "reference"])
async def test_kv_events_from_a_real_engine(featured: Any, kind: str) -> None:
    engine, channel = featured
    stub, common = _stub(channel, kind)
    own = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    block_size = engine.vllm_config.cache_config.block_size
    prompt = [(7 * i + (kind == "own")) % 300 + 3 for i in range(block_size + 5)]

    call = stub.SubscribeKvEvents(common.SubscribeKvEventsRequest())
    await call.initial_metadata()  # the servicer is subscribed
    await asyncio.sleep(0.5)  # ZMQ subscriptions reach the publisher asynchronously
    try:
        await collect(own.Generate(request(prompt, max_tokens=2)))
        batch, event = await next_kv_event(call, "stored")
        assert batch.dp_rank == 0 and batch.timestamp > 0 and event.event_id > 0
        first = event.stored.blocks[0]
        assert list(first.token_ids) == prompt[:block_size]
        assert first.block_size == block_size

        assert await wait_until_idle(engine) == 0
        flushed = await own.FlushCache(common_pb2.FlushCacheRequest(timeout_s=5))
        assert flushed.success
        # vLLM publishes the queued "cleared" event with its next engine step.
        await collect(own.Generate(request(max_tokens=1)))
        await next_kv_event(call, "cleared")
    finally:
        call.cancel()
    assert await call.code() == grpc.StatusCode.CANCELLED


# ----- the mapping, on recorded publisher messages --------------------------------


def _frames(batch: KVEventBatch, seq: int) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode(batch)]


def _stored(**overrides: Any) -> BlockStored:
    fields: dict[str, Any] = {
        "block_hashes": [b"\xff" * 32, 12345],
        "parent_block_hash": 7,
        "token_ids": [1, 2, 3, 4],
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    fields.update(overrides)
    return BlockStored(**fields)


def test_recorded_batch_maps_every_event_kind() -> None:
    batch = KVEventBatch(
        ts=12.5,
        events=[
            _stored(group_idx=1, locality="LOCAL"),
            BlockRemoved(block_hashes=[2**63 + 5], medium="CPU"),
            AllBlocksCleared(),
        ],
        data_parallel_rank=2,
    )
    out = BatchDecoder()(_frames(batch, 41))
    assert out is not None
    assert (out.sequence_number, out.timestamp, out.dp_rank) == (41, 12.5, 2)
    stored, removed, cleared = out.events
    assert [e.event_id for e in out.events] == [1, 2, 3]
    assert [list(b.token_ids) for b in stored.stored.blocks] == [[1, 2], [3, 4]]
    assert [b.block_hash for b in stored.stored.blocks] == [-1, 12345]
    assert stored.stored.parent_block_hash == 7 and stored.stored.group_idx == 1
    assert stored.stored.tier == common_pb2.KV_CACHE_TIER_DEVICE
    assert stored.stored.locality == common_pb2.KV_CACHE_LOCALITY_LOCAL
    assert list(removed.removed.block_hashes) == [to_int64(2**63 + 5)] == [-(2**63) + 5]
    assert removed.removed.tier == common_pb2.KV_CACHE_TIER_HOST
    assert cleared.WhichOneof("data") == "cleared"


def test_unmappable_events_and_frames_are_skipped() -> None:
    decode = BatchDecoder()
    ragged = KVEventBatch(ts=1.0, events=[_stored(token_ids=[1, 2, 3]), AllBlocksCleared()])
    out = decode(_frames(ragged, 0))
    assert out is not None and not out.HasField("dp_rank")
    # The ragged store is dropped, yet ids still count it: gaps show skipped events.
    assert [e.event_id for e in out.events] == [2]
    assert decode([b"", b"\x00" * 8, b"not msgpack"]) is None
    assert decode([b"only one frame"]) is None


def _live_relay(tmp_path: Path, **options: Any) -> tuple[Any, Any, asyncio.Event]:
    """A real ZMQ publisher, a relay subscribed to it, and an event set once it is."""
    endpoint = f"ipc://{tmp_path}/pub"
    publisher = ZmqEventPublisher(0, endpoint=endpoint, topic="kv")
    subscribed = asyncio.Event()

    async def mark() -> None:
        subscribed.set()

    stream = relay(
        [Source(0, endpoint)], topic="kv", engine_dead=lambda: False, on_subscribed=mark, **options
    )
    return publisher, stream, subscribed


async def test_relay_streams_a_live_publisher(tmp_path: Path) -> None:
    publisher, stream, subscribed = _live_relay(tmp_path)
    try:
        first = asyncio.ensure_future(stream.__anext__())
        await subscribed.wait()
        await asyncio.sleep(0.3)
        for ts in (1.0, 2.0):
            publisher.publish(KVEventBatch(ts=ts, events=[AllBlocksCleared()]))
        batch = await asyncio.wait_for(first, 10)
        assert (batch.sequence_number, batch.timestamp, batch.dp_rank) == (0, 1.0, 0)
        batch = await asyncio.wait_for(stream.__anext__(), 10)
        assert (batch.sequence_number, batch.timestamp) == (1, 2.0)
    finally:
        await stream.aclose()
        publisher.shutdown()


async def test_a_resume_point_is_refused_where_the_publisher_keeps_no_replay_buffer(
    featured: Any,
) -> None:
    _, channel = featured
    stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    call = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=7))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call.read()
    assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
    details = err.value.details() or ""
    assert details.startswith("start_sequence_number: 7: ") and "replay_endpoint" in details


# ----- resuming and filling gaps from the publisher's replay buffer -------------


@pytest.fixture(scope="module")
async def replaying(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[Any, grpc.aio.Channel]]:
    """A real engine whose publisher keeps a replay buffer, served with the reference's stubs."""
    work = tmp_path_factory.mktemp("replaying")
    engine = build_tiny_engine(
        tiny_model_dir,
        enable_prefix_caching=True,
        kv_events_config=KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=f"ipc://{work}/kv-events",
            replay_endpoint=f"ipc://{work}/kv-replay",
        ),
    )
    try:
        async with serving(engine, health=False) as served:
            yield engine, served.channel
    finally:
        engine.shutdown(timeout=ENGINE_STOP_SECONDS)


async def test_a_subscriber_resumes_where_it_left_off_on_a_real_engine(replaying: Any) -> None:
    engine, channel = replaying
    stub = ref_grpc.VllmEngineStub(channel)  # the reference's client
    own = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    block_size = engine.vllm_config.cache_config.block_size

    def prompt(salt: int) -> list[int]:
        return [(11 * i + salt) % 300 + 3 for i in range(2 * block_size)]

    first = stub.SubscribeKvEvents(ref_common.SubscribeKvEventsRequest())
    await first.initial_metadata()
    await asyncio.sleep(0.5)  # ZMQ subscriptions reach the publisher asynchronously
    await collect(own.Generate(request(prompt(1), max_tokens=2)))
    batch, _ = await next_kv_event(first, "stored")
    left_at = batch.sequence_number
    first.cancel()

    for salt in (2, 3, 4):  # published while nobody listens
        await collect(own.Generate(request(prompt(salt), max_tokens=2)))
    await asyncio.sleep(0.5)  # sent by the engine's publisher thread

    resumed = stub.SubscribeKvEvents(
        ref_common.SubscribeKvEventsRequest(start_sequence_number=left_at + 1)
    )
    await resumed.initial_metadata()
    await asyncio.sleep(0.5)
    await collect(own.Generate(request(prompt(5), max_tokens=2)))  # and one live
    seen: list[int] = []
    stored: list[list[int]] = []

    async def until_the_live_one() -> None:
        while prompt(5)[:block_size] not in stored:
            batch = await resumed.read()
            assert batch is not grpc.aio.EOF
            seen.append(batch.sequence_number)
            for event in batch.events:
                if event.stored.blocks:
                    stored.append(list(event.stored.blocks[0].token_ids))

    try:
        await asyncio.wait_for(until_the_live_one(), 20)
    finally:
        resumed.cancel()
    # Every batch since the first subscription, in order, none missing.
    assert seen == list(range(left_at + 1, left_at + 1 + len(seen))), seen
    # Including the blocks stored while nobody listened, in the order stored.
    firsts = [prompt(salt)[:block_size] for salt in (2, 3, 4, 5)]
    assert [block for block in stored if block in firsts] == firsts
    assert await wait_until_idle(engine) == 0


def _replaying_relay(
    tmp_path: Path, *, buffer_steps: int = 1000, **options: Any
) -> tuple[Any, Callable[..., Any]]:
    """A real ZMQ publisher with a replay buffer, and a relay factory subscribed to it."""
    endpoint, replay = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    publisher = ZmqEventPublisher(
        0, endpoint=endpoint, replay_endpoint=replay, buffer_steps=buffer_steps, topic="kv"
    )

    def subscribe(start: int = 0, on_subscribed: Any = None) -> Any:
        return relay(
            [Source(0, endpoint, replay)],
            topic="kv",
            engine_dead=lambda: False,
            on_subscribed=on_subscribed,
            start=start,
            **options,
        )

    return publisher, subscribe


def _publish(publisher: Any, count: int) -> None:
    for _ in range(count):
        publisher.publish(KVEventBatch(ts=1.0, events=[AllBlocksCleared()]))


async def _published(publisher: Any, count: int) -> None:
    """Publish `count` batches and give the publisher thread time to send them."""
    _publish(publisher, count)
    await asyncio.sleep(0.5)


async def test_a_resume_replays_the_kept_batches_then_goes_live(tmp_path: Path) -> None:
    publisher, subscribe = _replaying_relay(tmp_path)

    async def publish_once_subscribed() -> None:
        # Batches 5 and 6 reach the subscriber both live and from the replay.
        await asyncio.sleep(0.3)
        await _published(publisher, 2)

    stream = subscribe(start=2, on_subscribed=publish_once_subscribed)
    try:
        await _published(publisher, 5)  # 0..4, before the subscriber asks
        got = [(await asyncio.wait_for(stream.__anext__(), 10)).sequence_number for _ in range(5)]
        assert got == [2, 3, 4, 5, 6]
        _publish(publisher, 2)
        got = [(await asyncio.wait_for(stream.__anext__(), 10)).sequence_number for _ in range(2)]
        assert got == [7, 8]  # live now, nothing repeated
    finally:
        await stream.aclose()
        publisher.shutdown()


async def test_a_resume_point_no_longer_kept_is_out_of_range_naming_the_oldest(
    tmp_path: Path,
) -> None:
    publisher, subscribe = _replaying_relay(tmp_path, buffer_steps=3)
    stream = subscribe(start=1)
    try:
        await _published(publisher, 6)  # 3, 4 and 5 kept
        with pytest.raises(FieldOutOfRangeError, match=r"^start_sequence_number: 1: .* from 3 on"):
            await asyncio.wait_for(stream.__anext__(), 10)
    finally:
        await stream.aclose()
        publisher.shutdown()


async def test_a_resume_point_past_the_next_batch_is_out_of_range(tmp_path: Path) -> None:
    publisher, subscribe = _replaying_relay(tmp_path)
    await _published(publisher, 2)  # 0 and 1
    subscribed = asyncio.Event()

    async def mark() -> None:
        subscribed.set()

    stream = subscribe(start=9, on_subscribed=mark)
    try:
        pending = asyncio.ensure_future(stream.__anext__())
        await subscribed.wait()
        await asyncio.sleep(0.3)
        _publish(publisher, 1)  # 2, the first live one
        with pytest.raises(FieldOutOfRangeError, match="next batch is 2"):
            await asyncio.wait_for(pending, 10)
    finally:
        await stream.aclose()
        publisher.shutdown()


async def test_batches_a_slow_subscriber_missed_are_filled_in_from_the_replay_buffer(
    tmp_path: Path,
) -> None:
    publisher, subscribe = _replaying_relay(tmp_path, backlog=10)
    subscribed = asyncio.Event()

    async def mark() -> None:
        subscribed.set()

    stream = subscribe(on_subscribed=mark)
    try:
        first = asyncio.ensure_future(stream.__anext__())
        await subscribed.wait()
        await asyncio.sleep(0.3)
        _publish(publisher, 1)
        assert (await asyncio.wait_for(first, 10)).sequence_number == 0
        await _published(publisher, 200)  # read by nobody: the backlog keeps the last 10
        got = [(await asyncio.wait_for(stream.__anext__(), 10)).sequence_number for _ in range(200)]
        assert got == list(range(1, 201))
    finally:
        await stream.aclose()
        publisher.shutdown()


async def test_missed_batches_no_longer_kept_end_the_stream_with_events_lost(
    tmp_path: Path,
) -> None:
    publisher, subscribe = _replaying_relay(tmp_path, buffer_steps=20, backlog=10)
    subscribed = asyncio.Event()

    async def mark() -> None:
        subscribed.set()

    stream = subscribe(on_subscribed=mark)
    try:
        first = asyncio.ensure_future(stream.__anext__())
        await subscribed.wait()
        await asyncio.sleep(0.3)
        _publish(publisher, 1)
        assert (await asyncio.wait_for(first, 10)).sequence_number == 0
        await _published(publisher, 200)  # 1..190 dropped here, 181..200 kept there
        with pytest.raises(EventsLostError, match="batches 1 to 190 of rank 0"):
            await asyncio.wait_for(stream.__anext__(), 10)
    finally:
        await stream.aclose()
        publisher.shutdown()


async def test_subscribers_past_the_limit_are_resource_exhausted(featured: Any) -> None:
    engine, _ = featured
    async with serving(
        engine, health=False, reflection_service=False, max_kv_subscribers=2
    ) as served:
        mounted = served.mounted
        stub = vllm_engine_pb2_grpc.VllmEngineStub(served.channel)
        open_calls = [stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())]
        open_calls.append(stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest()))
        for call in open_calls:
            await call.initial_metadata()  # subscribed
        refused = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await refused.read()
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "limit is 2" in (err.value.details() or "")

        # A closed stream gives its place back.
        open_calls[0].cancel()
        assert await settle(lambda: mounted.servicer.kv_subscribers.active == 1)
        again = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())
        await asyncio.wait_for(again.initial_metadata(), 10)
        again.cancel()
        open_calls[1].cancel()
        assert await settle(lambda: mounted.servicer.kv_subscribers.active == 0)


# ----- the subscriber limit, without an engine ------------------------------


@contextlib.contextmanager
def _as(identity: Identity | None) -> Iterator[None]:
    token = current_identity.set(identity)
    try:
        yield
    finally:
        current_identity.reset(token)


@contextlib.contextmanager
def _hold(limit: SubscriberLimit, identity: Identity | None, count: int) -> Iterator[None]:
    with _as(identity), contextlib.ExitStack() as stack:
        for _ in range(count):
            stack.enter_context(limit.slot())
        yield


@pytest.mark.parametrize(("maximum", "share"), [(1, 1), (2, 1), (5, 3), (16, 8)])
def test_one_identity_holds_at_most_half_the_slots(maximum: int, share: int) -> None:
    limit = SubscriberLimit(maximum)
    tenant = Identity("tenant", kind="api_key")
    assert limit.per_caller == share
    with _hold(limit, tenant, share):
        assert limit.held_by("tenant") == share
        with _as(tenant), pytest.raises(TooManySubscribersError, match="per-caller limit"):
            limit.slot().__enter__()
        # Another identity gets the rest, up to the total.
        with _hold(limit, Identity("router", kind="api_key"), maximum - share):
            with _as(Identity("third")), pytest.raises(TooManySubscribersError, match="total"):
                limit.slot().__enter__()
    assert (limit.active, limit.held_by("tenant"), limit.held_by("router")) == (0, 0, 0)


def test_without_identities_and_for_admins_only_the_total_binds() -> None:
    limit = SubscriberLimit(4)
    with _hold(limit, None, 4):
        with pytest.raises(TooManySubscribersError, match="total limit is 4"):
            limit.slot().__enter__()
    admin = Identity("ops", roles=frozenset({ADMIN_ROLE}))
    with _hold(limit, admin, 4):
        assert limit.held_by("ops") == 0
        with _as(admin), pytest.raises(TooManySubscribersError, match="total limit is 4"):
            limit.slot().__enter__()
    assert limit.active == 0


def test_a_failing_stream_gives_its_callers_slot_back() -> None:
    limit = SubscriberLimit(2)
    tenant = Identity("tenant")
    with _as(tenant):
        with pytest.raises(RuntimeError), limit.slot():
            raise RuntimeError("the stream failed")
        with limit.slot():
            assert limit.held_by("tenant") == 1
    assert (limit.active, limit.held_by("tenant")) == (0, 0)


# ----- over the wire, with keys ----------------------------------------------


TENANT_KEY = "tenant-key-0123456789"
ROUTER_KEY = "router-key-0123456789"
ADMIN_KEY = "admin-key-0123456789"


async def test_one_key_cannot_take_every_subscriber_slot(featured: Any) -> None:
    """With keys, one identity holds at most half the slots; the rest stay for the others."""
    engine, _ = featured
    auth = AuthInterceptor(
        AnyOf(
            ApiKeyVerifier({"admin": ADMIN_KEY}, roles=(ADMIN_ROLE,)),
            ApiKeyVerifier({"tenant": TENANT_KEY, "router": ROUTER_KEY}),
        )
    )
    open_calls: list[Any] = []
    async with serving(
        engine,
        health=False,
        reflection_service=False,
        interceptors=[auth],
        max_kv_subscribers=5,
    ) as served:
        mounted = served.mounted
        stub = vllm_engine_pb2_grpc.VllmEngineStub(served.channel)
        try:

            async def subscribe(key: str) -> Any:
                call = stub.SubscribeKvEvents(
                    common_pb2.SubscribeKvEventsRequest(), metadata=bearer(key)
                )
                open_calls.append(call)
                return call

            async def refused(key: str) -> str:
                call = await subscribe(key)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    # An admitted stream would wait for events: bound the read.
                    await asyncio.wait_for(call.read(), 10)
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                return err.value.details() or ""

            for _ in range(3):  # half of 5, rounded up
                await asyncio.wait_for((await subscribe(TENANT_KEY)).initial_metadata(), 10)
            details = await refused(TENANT_KEY)
            assert "per-caller limit is 3" in details, details

            # The router still subscribes, up to the total.
            for _ in range(2):
                await asyncio.wait_for((await subscribe(ROUTER_KEY)).initial_metadata(), 10)
            assert mounted.servicer.kv_subscribers.active == 5
            details = await refused(ROUTER_KEY)
            assert "total limit is 5" in details, details
            # An admin is not held to a share, but the total binds everyone.
            details = await refused(ADMIN_KEY)
            assert "total limit is 5" in details, details
        finally:
            for call in open_calls:
                call.cancel()
            assert await settle(lambda: mounted.servicer.kv_subscribers.active == 0)


async def test_a_slow_subscriber_keeps_the_newest_batches_not_the_engines_memory(
    tmp_path: Path,
) -> None:
    """The socket is drained while the caller does not read; past the backlog the oldest go."""
    publisher, stream, subscribed = _live_relay(tmp_path, backlog=10)
    try:
        first = asyncio.ensure_future(stream.__anext__())
        await subscribed.wait()
        await asyncio.sleep(0.3)
        publisher.publish(KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))
        assert (await asyncio.wait_for(first, 10)).sequence_number == 0
        # The caller reads nothing while 200 batches are published.
        for ts in range(1, 201):
            publisher.publish(KVEventBatch(ts=float(ts), events=[AllBlocksCleared()]))
        await asyncio.sleep(1.0)
        got = [(await asyncio.wait_for(stream.__anext__(), 10)).sequence_number for _ in range(10)]
        assert got == list(range(191, 201)), got
    finally:
        await stream.aclose()
        publisher.shutdown()
