"""SubscribeKvEvents: relay vLLM's ZMQ KV-cache events as `KvEventBatch` messages.

vLLM's engine cores publish block stored / removed / cleared events on a ZMQ
PUB socket when started with `--kv-events-config` (enable_kv_cache_events and
the "zmq" publisher). Each subscriber gets its own SUB socket connected to
every data-parallel rank's publisher; batches keep the publisher's sequence
number and carry the rank they came from.

When the publisher keeps a replay buffer (`replay_endpoint` in the
KV-events config), a subscriber may resume from a sequence number it names,
and a batch missed mid-stream (dropped by ZMQ or by the subscriber's backlog)
is fetched from the buffer before anything later is sent: the stream has no
gaps, or it ends with DATA_LOSS (the batches are gone; resubscribe from 0).

Only a publisher that listens can be subscribed to. vLLM's publisher decides
by its endpoint's text whether to listen or to dial (`listens`):
`tcp://127.0.0.1:P` makes it connect to a subscriber there, so neither this
relay nor a router could reach it; such a publisher is named nowhere
(`sources` refuses it, saying why) rather than reported at an address where
nothing listens.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
from collections.abc import AsyncGenerator, Callable
from typing import Any, NamedTuple

# Before vLLM is imported below: an untested vLLM release fails here, naming both versions.
from .. import _vllm_version  # noqa: F401

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

from ..engine import EngineClient
from ..errors import (
    EventsLostError,
    FieldOutOfRangeError,
    NotEnabledError,
)
from ..load_reports.stats_tap import managed_ranks
from ..proto import common_pb2
from ..vllm_releases import BLOCK_STORED_LOOKAHEAD

logger = logging.getLogger("vllm_servicer")

ENABLE_HINT = (
    "KV-cache events are not enabled on this engine; start vLLM with "
    '--kv-events-config \'{"enable_kv_cache_events": true, "publisher": "zmq"}\' '
    "(and prefix caching on) to use SubscribeKvEvents"
)
# Why a publisher in vLLM's connect form has nothing to subscribe to, and what listens.
LISTENING_FORMS = (
    "ipc:///path (this machine only; the socket file's permissions say who may "
    "subscribe), tcp://[::ffff:127.0.0.1]:PORT (TCP on loopback only: the '::' makes "
    "vLLM listen, and ZeroMQ binds it as 127.0.0.1) or tcp://*:PORT (every interface: "
    "firewall it to the routers)"
)
CONNECT_FORM_HINT = (
    "the engine's KV-event publisher connects to {endpoint} instead of listening: vLLM "
    "listens only on an endpoint with '*' or '::' in it, or an ipc:// or inproc:// one, "
    "and dials any other, so its events go to whatever listens at that address and no "
    "subscriber can connect to it here. To subscribe here, start vLLM with a listening "
    "endpoint in --kv-events-config: " + LISTENING_FORMS
)
# How often an idle stream checks that the engine is still alive.
_IDLE_CHECK_S = 1.0
# Batches kept for a subscriber whose client reads slower than the engine
# publishes. The socket is drained regardless (so the queue builds neither in
# the engine nor in ZMQ); past this the oldest are dropped, and the client sees
# the gap in sequence numbers.
DEFAULT_BACKLOG = 1024
# How long a replay buffer may take to answer (vLLM's publisher polls it every 0.1 s).
REPLAY_TIMEOUT_S = 5.0
_END_OF_REPLAY = ZmqEventPublisher.END_SEQ

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


class Source(NamedTuple):
    """One rank's publisher, as connectable addresses."""

    rank: int
    endpoint: str
    replay: str | None = None  # its replay buffer's ROUTER socket, when it keeps one


def publisher_config(engine: EngineClient) -> Any:
    """The engine's KVEventsConfig when it publishes over ZMQ, else None."""
    config = getattr(engine.vllm_config, "kv_events_config", None)
    if config is None or not config.enable_kv_cache_events or config.publisher != "zmq":
        return None
    return config


def sources(engine: EngineClient, config: Any) -> list[Source]:
    """Every rank's publisher: as the engine cores reported them, else from the config.

    Raises:
        NotEnabledError: the engine publishes no KV-cache events, or publishes
            them in vLLM's connect form (to a subscriber that listens
            elsewhere), or its listening port is not known yet.
    """
    # Asked of the endpoint as configured: a reported one is the address bound
    # (vLLM reports `tcp://*:0` as `tcp://<node address>:<port>`), whose text no
    # longer tells.
    configured = str(config.endpoint or "")
    if not listens(configured):
        raise NotEnabledError(CONNECT_FORM_HINT.format(endpoint=configured))
    reported = engine.get_kv_event_sources()
    if reported:  # where each rank's publisher actually is (a port 0 resolved)
        endpoints = {
            rank: (str(cfg.endpoint), cfg.replay_endpoint)
            for rank, cfg in sorted(reported.items())
            if getattr(cfg, "endpoint", None)
        }
    else:  # none reported (yet): each rank offsets the base ports by its rank
        if configured.startswith("tcp://") and configured.endswith(":0"):
            # vLLM picks the port as it binds; only its report names it.
            raise NotEnabledError(
                f"the engine's KV-event publisher listens at {configured}, on a port "
                "chosen when it started, and has not reported which; retry once it has"
            )
        offset = ZmqEventPublisher.offset_endpoint_port
        endpoints = {
            rank: (str(offset(config.endpoint, rank)), offset(config.replay_endpoint, rank))
            for rank in managed_ranks(engine)
        }
    found = [
        Source(rank, connectable(endpoint), _replay_address(replay))
        for rank, (endpoint, replay) in endpoints.items()
    ]
    if not found:
        raise NotEnabledError(ENABLE_HINT)
    return found


def listens(endpoint: str) -> bool:
    """Whether vLLM's ZMQ publisher listens on (binds) `endpoint` rather than dialling it.

    vLLM decides by the text alone: it binds an endpoint with `*` or `::` in
    it, or an `ipc://` or `inproc://` one, and connects to any other, so
    `tcp://127.0.0.1:P` is dialled, never listened on. (Its replay socket
    always binds.) vLLM's own test is asked where it has one (0.32's
    `_is_bind_endpoint`); earlier releases make the same test inline.
    """
    own = getattr(ZmqEventPublisher, "_is_bind_endpoint", None)
    if callable(own):
        return bool(own(endpoint))
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _replay_address(endpoint: str | None) -> str | None:
    return connectable(endpoint) if endpoint else None


def check_resumable(ranks: list[Source], start: int) -> None:
    """Refuse a resume point (`start_sequence_number`) these publishers cannot serve.

    Raises:
        FieldOutOfRangeError: no replay buffer, or several ranks (each numbers
            its batches on its own, so one number cannot name a point in all).
    """
    if len(ranks) > 1:
        raise FieldOutOfRangeError(
            "start_sequence_number",
            f"the engine publishes from {len(ranks)} data-parallel ranks, each numbering "
            "its batches on its own; subscribe from 0 (the current state)",
        )
    if ranks[0].replay is None:
        raise FieldOutOfRangeError(
            "start_sequence_number",
            f"{start}: the engine keeps no replay buffer to resume from; subscribe from 0 "
            "(the current state), or start vLLM with replay_endpoint in --kv-events-config",
        )


# An IPv4 address written IPv6-mapped, as vLLM's publisher is made to listen on one.
_IPV4_MAPPED = re.compile(r"\[::ffff:(\d{1,3}(?:\.\d{1,3}){3})\]", re.IGNORECASE)


def connectable(endpoint: str | None) -> str:
    """A publisher's bind address as one a subscriber on this host can connect to.

    A bind to every interface (`*`, `0.0.0.0`) is reached at 127.0.0.1; an
    IPv4 address written IPv6-mapped (`[::ffff:127.0.0.1]`, which ZeroMQ binds
    as that IPv4 address) is given plainly, so that a ZeroMQ socket without
    IPv6 switched on, as most subscribers' are, can dial it.
    """
    address = _IPV4_MAPPED.sub(r"\1", str(endpoint or ""))
    return address.replace("*", "127.0.0.1").replace("0.0.0.0", "127.0.0.1")


def to_int64(value: int | bytes) -> int:
    """A block hash (int, or bytes read big-endian) folded into a signed 64-bit id."""
    if isinstance(value, (bytes, bytearray)):
        value = int.from_bytes(value, "big")
    value %= _U64
    return value - _U64 if value >= _U64 // 2 else value


@functools.cache
def _warn_lookahead_dropped() -> None:
    logger.warning(
        "KV events: stored blocks carry lookahead (draft) tokens, which the protocol's "
        "KvBlocksStored cannot carry; their block hashes cover tokens a router does not "
        "see, so prefix matching on them may miss (see docs/protocol.md, KV events)"
    )


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
        if getattr(event, BLOCK_STORED_LOOKAHEAD, None):
            _warn_lookahead_dropped()
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

    @property
    def numbered(self) -> int:
        """Events numbered so far."""
        return self._event_id

    def renumber_from(self, numbered: int) -> None:
        """Number the next events as if only `numbered` had been (to decode missed ones first)."""
        self._event_id = numbered

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
    start: int = 0,
) -> AsyncGenerator[common_pb2.KvEventBatch, None]:
    """Stream every rank's published batches until the caller stops iterating.

    A reader task drains the socket as batches arrive, whatever the caller's
    pace, into a queue of at most `backlog` batches (the oldest go first).
    Where a rank keeps a replay buffer, the batches missing from its stream
    are fetched from it before a later one is sent.

    Args:
        ranks: the publishers to subscribe to.
        topic: the publishers' topic (ZMQ prefix match).
        engine_dead: checked while idle; a dead engine ends the stream.
        on_subscribed: awaited once the socket is connected (e.g. to send
            the call's initial metadata, so the client knows it is live).
        backlog: batches held for a caller that reads slower than they arrive.
        start: the first sequence number wanted; 0 streams from now on.
            Needs one rank with a replay buffer (see `check_resumable`).

    Raises:
        EngineDeadError: the engine died while the stream was open.
        FieldOutOfRangeError: `start` is older than the oldest batch kept, or
            newer than the next one the publisher will send.
        EventsLostError: a missed batch is no longer kept, or the publisher
            restarted its numbering.
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
        order = _InOrder(ranks, BatchDecoder())
        if start:
            # Subscribed first: whatever is published after the replay arrives live.
            for batch in await order.resume(start):
                yield batch
        while True:
            for batch in await order.accept(await _next(received, reader)):
                yield batch
    finally:
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, EngineDeadError):
                await reader
        socket.close(linger=0)


def _sequence(frames: list[bytes]) -> int:
    return int.from_bytes(frames[1], "big")


class _InOrder:
    """Sends each rank's batches in sequence, without gaps, where its replay buffer allows.

    For a rank with a replay buffer it keeps the next sequence number owed
    and the lowest one sent: a batch below the next one is a repeat of a
    replayed batch (dropped) or, below the lowest, a restarted publisher.
    Ranks without a buffer pass through as they come.
    """

    def __init__(self, ranks: list[Source], decode: BatchDecoder) -> None:
        self._decode = decode
        self._replay = {source.rank: source.replay for source in ranks if source.replay}
        self._only_rank = ranks[0].rank if len(ranks) == 1 else None
        self._next: dict[int, int] = {}
        self._lowest: dict[int, int] = {}

    async def resume(self, start: int) -> list[common_pb2.KvEventBatch]:
        """The kept batches from `start` on, for the one rank (see `check_resumable`)."""
        rank = self._only_rank
        assert rank is not None and rank in self._replay
        kept = await fetch_replay(self._replay[rank], start)
        if kept and _sequence(kept[0]) > start:
            oldest = _sequence(kept[0])
            raise FieldOutOfRangeError(
                "start_sequence_number",
                f"{start}: the publisher keeps batches from {oldest} on, the older ones are "
                "gone; subscribe from 0 (the current state) and resynchronise",
            )
        self._lowest[rank] = self._next[rank] = start
        return self._in_order(rank, kept)

    async def accept(self, frames: list[bytes]) -> list[common_pb2.KvEventBatch]:
        """What to send for one received batch: those missed before it, then it."""
        numbered = self._decode.numbered
        batch = self._decode(frames)
        if batch is None:
            return []
        rank = batch.dp_rank if batch.HasField("dp_rank") else self._only_rank
        if rank not in self._replay:
            return [batch]
        assert rank is not None
        seq = batch.sequence_number
        owed = self._next.get(rank)
        if owed is None:  # the rank's first batch on a stream from now on
            self._lowest[rank] = seq
        elif seq < owed:
            if seq >= self._lowest[rank]:
                return []  # sent already, from the replay buffer
            if owed == self._lowest[rank]:  # nothing sent yet: asked for a future batch
                raise FieldOutOfRangeError(
                    "start_sequence_number",
                    f"{owed}: the publisher's next batch is {seq}; subscribe from 0 "
                    "(the current state) and resynchronise",
                )
            raise EventsLostError(
                f"the KV-event publisher of rank {rank} restarted (its batches went back "
                f"from {owed - 1} to {seq}); resubscribe from 0 and resynchronise"
            )
        elif seq > owed:
            missed = await fetch_replay(self._replay[rank], owed)
            missed = [frames for frames in missed if _sequence(frames) < seq]
            if not missed or _sequence(missed[0]) != owed:
                raise EventsLostError(
                    f"KV-event batches {owed} to {seq - 1} of rank {rank} were missed and the "
                    "publisher no longer keeps them; resubscribe from 0 and resynchronise"
                )
            # Event ids follow the order sent: the missed batches are numbered first.
            self._decode.renumber_from(numbered)
            return self._in_order(rank, [*missed, frames])
        self._next[rank] = seq + 1
        return [batch]

    def _in_order(self, rank: int, kept: list[list[bytes]]) -> list[common_pb2.KvEventBatch]:
        out = []
        for frames in kept:
            self._next[rank] = _sequence(frames) + 1
            batch = self._decode(frames)
            if batch is not None:
                out.append(batch)
        return out


async def fetch_replay(
    endpoint: str, start: int, timeout: float = REPLAY_TIMEOUT_S
) -> list[list[bytes]]:
    """The batches a publisher keeps from `start` on, as SUB frames [topic, sequence, payload].

    vLLM's publisher answers a DEALER that sends an 8-byte big-endian start
    with every kept batch from there, then a marker whose sequence is -1.

    Raises:
        EventsLostError: the replay buffer did not answer within `timeout` seconds.
    """
    socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    kept: list[list[bytes]] = []
    try:
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(endpoint)
        await socket.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            if not await socket.poll(timeout=int(timeout * 1000)):
                raise EventsLostError(
                    f"the KV-event replay buffer did not answer within {timeout:g}s; "
                    "resubscribe from 0 and resynchronise"
                )
            frames = (await socket.recv_multipart())[1:]  # after the empty delimiter
            if len(frames) < 3 or frames[1] == _END_OF_REPLAY:
                return kept
            kept.append(frames)
    finally:
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
