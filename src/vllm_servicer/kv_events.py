"""SubscribeKvEvents: relay vLLM's ZMQ KV-cache events as `KvEventBatch` messages.

vLLM's engine cores publish block stored / removed / cleared events on a ZMQ
PUB socket when started with `--kv-events-config` (enable_kv_cache_events and
the "zmq" publisher). Each subscriber gets its own SUB socket connected to
every data-parallel rank's publisher; batches keep the publisher's sequence
number and carry the rank they came from.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable, Iterator
from typing import Any, NamedTuple

# Before vLLM is imported below: an untested vLLM release fails here, naming both versions.
from . import _vllm_version  # noqa: F401

# isort: split
import msgspec
import zmq
import zmq.asyncio
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)
from vllm.v1.engine.exceptions import EngineDeadError

from .engine import EngineClient
from .errors import NotEnabledError, TooManySubscribersError
from .interceptors.auth import ADMIN_ROLE, current_identity
from .loads import managed_ranks
from .options import DEFAULT_MAX_KV_SUBSCRIBERS
from .proto import common_pb2

logger = logging.getLogger("vllm_servicer")

ENABLE_HINT = (
    "KV-cache events are not enabled on this engine; start vLLM with "
    '--kv-events-config \'{"enable_kv_cache_events": true, "publisher": "zmq"}\' '
    "(and prefix caching on) to use SubscribeKvEvents"
)
# How often an idle stream checks that the engine is still alive.
_IDLE_CHECK_S = 1.0
DEFAULT_MAX_SUBSCRIBERS = DEFAULT_MAX_KV_SUBSCRIBERS
# Batches kept for a subscriber whose client reads slower than the engine
# publishes. The socket is drained regardless (so the queue builds neither in
# the engine nor in ZMQ); past this the oldest are dropped, and the client sees
# the gap in sequence numbers.
DEFAULT_BACKLOG = 1024

_U64 = 1 << 64
_TIERS = {
    "GPU": common_pb2.KV_CACHE_TIER_DEVICE,
    "CPU": common_pb2.KV_CACHE_TIER_HOST,
    "STORAGE": common_pb2.KV_CACHE_TIER_DISK,
}
_LOCALITIES = {
    "LOCAL": common_pb2.KV_CACHE_LOCALITY_LOCAL,
    "REMOTE": common_pb2.KV_CACHE_LOCALITY_REMOTE,
}


class SubscriberLimit:
    """Caps the SubscribeKvEvents streams open at once, in total and per caller.

    Without authentication every stream counts against `maximum` only. With it
    (an identity in `current_identity`), one identity may also hold at most
    `per_caller` of them, half of `maximum` rounded up: one key cannot take
    every slot and lock out another (a router that needs the events), however
    many streams it opens. Identities are told apart by name, as Abort tells
    them apart. Identities with `ADMIN_ROLE` are held to the total only: the
    operator may already change the server for everyone.

    Args:
        maximum: streams allowed at once; the next one gets RESOURCE_EXHAUSTED.
    """

    def __init__(self, maximum: int = DEFAULT_MAX_SUBSCRIBERS) -> None:
        if maximum < 1:
            raise ValueError(f"the subscriber limit must be at least 1, got {maximum}")
        self.maximum = maximum
        self.per_caller = (maximum + 1) // 2
        self.active = 0
        self._held: dict[str, int] = {}

    def held_by(self, name: str) -> int:
        """Streams the identity called `name` holds now."""
        return self._held.get(name, 0)

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        """Holds one stream's place, for the calling identity, while the block runs.

        Raises:
            TooManySubscribersError: the caller holds `per_caller` streams
                already, or `maximum` streams are open in all.
        """
        identity = current_identity.get()
        name = None if identity is None or ADMIN_ROLE in identity.roles else identity.name
        # The caller's own share first: freeing others' streams would not admit it.
        if name is not None and self.held_by(name) >= self.per_caller:
            raise TooManySubscribersError(
                f"this caller holds {self.held_by(name)} KV-event subscriptions, the "
                f"per-caller limit is {self.per_caller} (half the server's {self.maximum}); "
                "close one of its streams"
            )
        if self.active >= self.maximum:
            raise TooManySubscribersError(
                f"{self.active} KV-event subscribers are connected, the total limit is "
                f"{self.maximum}; close one or raise the server's subscriber limit"
            )
        self.active += 1
        if name is not None:
            self._held[name] = self.held_by(name) + 1
        try:
            yield
        finally:
            self.active -= 1
            if name is not None:
                left = self._held[name] - 1
                if left:
                    self._held[name] = left
                else:
                    del self._held[name]  # no entry outlives its identity's streams


class Source(NamedTuple):
    """One rank's publisher, as a connectable address."""

    rank: int
    endpoint: str


def publisher_config(engine: EngineClient) -> Any:
    """The engine's KVEventsConfig when it publishes over ZMQ, else None."""
    config = getattr(engine.vllm_config, "kv_events_config", None)
    if config is None or not config.enable_kv_cache_events or config.publisher != "zmq":
        return None
    return config


def sources(engine: EngineClient, config: Any) -> list[Source]:
    """Every rank's publisher: as the engine cores reported them, else from the config.

    Raises:
        NotEnabledError: the engine publishes no KV-cache events.
    """
    reported = engine.get_kv_event_sources()
    if reported:
        found = [
            Source(rank, connectable(cfg.endpoint))
            for rank, cfg in sorted(reported.items())
            if getattr(cfg, "endpoint", None)
        ]
    else:  # none reported (yet): each rank offsets the base port by its rank
        found = [
            Source(rank, connectable(ZmqEventPublisher.offset_endpoint_port(config.endpoint, rank)))
            for rank in managed_ranks(engine)
        ]
    if not found:
        raise NotEnabledError(ENABLE_HINT)
    return found


def connectable(endpoint: str | None) -> str:
    """A publisher's bind address as one a subscriber on this host can connect to."""
    address = str(endpoint or "")
    return address.replace("*", "127.0.0.1").replace("0.0.0.0", "127.0.0.1")


def to_int64(value: int | bytes) -> int:
    """A block hash (int, or bytes read big-endian) folded into a signed 64-bit id."""
    if isinstance(value, (bytes, bytearray)):
        value = int.from_bytes(value, "big")
    value %= _U64
    return value - _U64 if value >= _U64 // 2 else value


def convert_event(event: Any, event_id: int) -> common_pb2.KvCacheEvent | None:
    """One vLLM KV event as a wire event (None for kinds the protocol lacks)."""
    if isinstance(event, BlockStored):
        size = int(event.block_size)
        tokens = event.token_ids
        if size <= 0 or len(tokens) != size * len(event.block_hashes):
            # Blocks are full by construction; anything else cannot be split per block.
            logger.warning(
                "KV event skipped: %d tokens for %d blocks of %d",
                len(tokens),
                len(event.block_hashes),
                size,
            )
            return None
        stored = common_pb2.KvBlocksStored()
        for i, block_hash in enumerate(event.block_hashes):
            block = stored.blocks.add(
                block_hash=to_int64(block_hash),
                token_ids=tokens[i * size : (i + 1) * size],
                block_size=size,
            )
            if event.lora_id is not None:
                block.lora_id = event.lora_id
        if event.parent_block_hash is not None:
            stored.parent_block_hash = to_int64(event.parent_block_hash)
        _placement(stored, event)
        if event.kv_cache_spec_kind is not None:
            stored.kv_cache_spec_kind = event.kv_cache_spec_kind
        if event.kv_cache_spec_sliding_window is not None:
            stored.kv_cache_spec_sliding_window = event.kv_cache_spec_sliding_window
        if event.lora_name is not None:
            stored.lora_name = event.lora_name
        if event.session_id is not None:
            stored.session_id = event.session_id
        return common_pb2.KvCacheEvent(event_id=event_id, stored=stored)
    if isinstance(event, BlockRemoved):
        removed = common_pb2.KvBlocksRemoved(block_hashes=[to_int64(h) for h in event.block_hashes])
        _placement(removed, event)
        return common_pb2.KvCacheEvent(event_id=event_id, removed=removed)
    if isinstance(event, AllBlocksCleared):
        return common_pb2.KvCacheEvent(event_id=event_id, cleared=common_pb2.KvCacheCleared())
    return None


def _placement(message: Any, event: Any) -> None:
    # Where the blocks live: fields shared by stored and removed events.
    if event.medium is not None:
        message.medium = event.medium
        if event.medium in _TIERS:
            message.tier = _TIERS[event.medium]
    if event.group_idx is not None:
        message.group_idx = event.group_idx
    if event.locality in _LOCALITIES:
        message.locality = _LOCALITIES[event.locality]
    if event.ownership is not None:
        message.ownership = event.ownership


class BatchDecoder:
    """Decodes published frames into KvEventBatch messages, numbering events per stream."""

    def __init__(self) -> None:
        self._decode = msgspec.msgpack.Decoder(KVEventBatch).decode
        self._event_id = 0

    def __call__(self, frames: list[bytes]) -> common_pb2.KvEventBatch | None:
        """`[topic, 8-byte big-endian sequence, msgpack batch]` as a wire batch, or None."""
        if len(frames) < 3:
            return None
        try:
            batch = self._decode(frames[2])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("KV event batch skipped: cannot decode it: %s", exc)
            return None
        out = common_pb2.KvEventBatch(
            sequence_number=int.from_bytes(frames[1], "big"), timestamp=batch.ts
        )
        if batch.data_parallel_rank is not None:
            out.dp_rank = batch.data_parallel_rank
        for event in batch.events:
            # Ids advance for every engine event, so gaps show skipped ones.
            self._event_id += 1
            converted = convert_event(event, self._event_id)
            if converted is not None:
                out.events.append(converted)
        return out


async def relay(
    ranks: list[Source],
    *,
    topic: str,
    engine_dead: Callable[[], bool],
    on_subscribed: Callable[[], Any] | None = None,
    backlog: int = DEFAULT_BACKLOG,
) -> AsyncGenerator[common_pb2.KvEventBatch, None]:
    """Stream every rank's published batches until the caller stops iterating.

    A reader task drains the socket as batches arrive, whatever the caller's
    pace, into a queue of at most `backlog` batches (the oldest go first).

    Args:
        ranks: the publishers to subscribe to.
        topic: the publishers' topic (ZMQ prefix match).
        engine_dead: checked while idle; a dead engine ends the stream.
        on_subscribed: awaited once the socket is connected (e.g. to send
            the call's initial metadata, so the client knows it is live).
        backlog: batches held for a caller that reads slower than they arrive.

    Raises:
        EngineDeadError: the engine died while the stream was open.
    """
    context = zmq.asyncio.Context.instance()
    socket = context.socket(zmq.SUB)
    received: asyncio.Queue[list[bytes]] = asyncio.Queue(maxsize=backlog)
    reader: asyncio.Future[None] | None = None
    try:
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVHWM, backlog)
        socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
        for source in ranks:
            socket.connect(source.endpoint)
        if on_subscribed is not None:
            await on_subscribed()
        reader = asyncio.ensure_future(_read(socket, received, engine_dead))
        decode = BatchDecoder()
        while True:
            batch = decode(await _next(received, reader))
            if batch is not None:
                yield batch
    finally:
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, EngineDeadError):
                await reader
        socket.close(linger=0)


async def _read(
    socket: Any, received: asyncio.Queue[list[bytes]], engine_dead: Callable[[], bool]
) -> None:
    dropped = 0
    while True:
        # poll first: a cancelled recv future can lose a dequeued message.
        if not await socket.poll(timeout=int(_IDLE_CHECK_S * 1000)):
            if engine_dead():
                raise EngineDeadError()
            continue
        frames = await socket.recv_multipart()
        if received.full():
            received.get_nowait()
            dropped += 1
            if dropped == 1 or dropped % 1000 == 0:
                logger.warning("KV-event subscriber reads too slowly: %d batches dropped", dropped)
        received.put_nowait(frames)


async def _next(received: asyncio.Queue[list[bytes]], reader: asyncio.Future[None]) -> list[bytes]:
    """The next received frames, or the reader's error once it ended."""
    if not received.empty():
        return received.get_nowait()
    getter = asyncio.ensure_future(received.get())
    try:
        await asyncio.wait((getter, reader), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not getter.done():
            getter.cancel()
    if getter.done() and not getter.cancelled():
        return getter.result()
    reader.result()  # raises what ended the reader
    raise EngineDeadError()  # pragma: no cover - the reader only ends by raising
