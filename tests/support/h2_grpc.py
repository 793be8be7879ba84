"""A gRPC call made over raw HTTP/2, for what grpc's own client keeps from the caller.

grpc's client consumes some trailers itself: `endpoint-load-metrics-bin` (an
ORCA load report) goes to its balancing policy and never reaches the call's
`trailing_metadata()`. `raw_call` sends one request with `h2` and returns the
response's headers, messages and trailers as they came over the wire.

grpc's client also never starts a call without sending its message:
`HalfOpen` opens calls that send their headers and nothing more, and records
how the server ends each.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import socket
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType

import h2.config
import h2.connection
import h2.events
import h2.settings


@dataclass
class RawReply:
    """One call's answer as sent: headers, messages (payloads) with each one's
    compressed flag (the frame's first byte), trailers."""

    headers: dict[str, str] = field(default_factory=dict)
    messages: list[bytes] = field(default_factory=list)
    trailers: dict[str, str] = field(default_factory=dict)
    compressed: list[int] = field(default_factory=list)

    @property
    def status(self) -> int:
        """The grpc-status (in the trailers, or the headers of a trailers-only answer)."""
        return int(self.trailers.get("grpc-status", self.headers.get("grpc-status", "-1")))

    @property
    def details(self) -> str:
        """The grpc-message, decoded."""
        raw = self.trailers.get("grpc-message", self.headers.get("grpc-message", ""))
        return urllib.parse.unquote(raw)

    def binary(self, key: str) -> bytes | None:
        """A `-bin` trailer's value, decoded (HTTP/2 carries it in base64)."""
        value = self.trailers.get(key)
        if value is None:
            return None
        return base64.b64decode(value + "=" * (-len(value) % 4))


def _call(address: str, path: str, message: bytes, metadata: Sequence[tuple[str, str]]) -> RawReply:
    host, port = address.rsplit(":", 1)
    reply = RawReply()
    data = b""
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        )
        conn.initiate_connection()
        stream = conn.get_next_available_stream_id()
        conn.send_headers(
            stream,
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", path),
                (":authority", address),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
                *metadata,
            ],
        )
        conn.send_data(stream, b"\0" + len(message).to_bytes(4, "big") + message, end_stream=True)
        sock.sendall(conn.data_to_send())
        ended = False
        while not ended:
            chunk = sock.recv(65536)
            if not chunk:
                break
            for event in conn.receive_data(chunk):
                if isinstance(event, h2.events.ResponseReceived):
                    reply.headers = dict(event.headers)  # type: ignore[arg-type]
                elif isinstance(event, h2.events.DataReceived):
                    data += event.data
                    conn.acknowledge_received_data(event.flow_controlled_length, stream)
                elif isinstance(event, h2.events.TrailersReceived):
                    reply.trailers = dict(event.headers)  # type: ignore[arg-type]
                elif isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset)):
                    ended = True
            sock.sendall(conn.data_to_send())
    while data:  # length-prefixed messages
        size = int.from_bytes(data[1:5], "big")
        reply.compressed.append(data[0])
        reply.messages.append(data[5 : 5 + size])
        data = data[5 + size :]
    return reply


async def raw_call(
    address: str, path: str, message: bytes, metadata: Sequence[tuple[str, str]] = ()
) -> RawReply:
    """Call `path` ("/package.Service/Method") at `address` with one serialized
    request, over a connection of its own; in a thread, so the loop serves on."""
    return await asyncio.to_thread(_call, address, path, message, metadata)


class HalfOpen:
    """Calls on one connection of their own that send their headers and never their
    message (nor end their stream), held open until the server ends them or `close`.

    `async with HalfOpen(address) as conn: ids = await conn.start(path, metadata, n)`;
    `conn.ended[id]` is each call's answer once the server ended it (poll it
    with `support.settle`).

    With `window` (bytes), each stream grants the server that much HTTP/2
    flow-control window and never more: 0 and the server cannot send a byte
    of any answer's messages (a client that stops reading).
    """

    def __init__(self, address: str, *, window: int | None = None) -> None:
        self.address = address
        self.window = window
        self.ended: dict[int, RawReply] = {}
        self._replies: dict[int, RawReply] = {}
        self._conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        )
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task[None] | None = None

    async def __aenter__(self) -> HalfOpen:
        host, port = self.address.rsplit(":", 1)
        reader, self._writer = await asyncio.open_connection(host, int(port))
        self._conn.initiate_connection()
        if self.window is not None:
            self._conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: self.window})
        await self._flush()
        self._reading = asyncio.ensure_future(self._read(reader))
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def start(
        self,
        path: str,
        metadata: Sequence[tuple[str, str]],
        n: int,
        *,
        message: bytes | None = None,
    ) -> list[int]:
        """Open `n` calls of `path`, headers only (or with `message`, their request
        sent whole); their stream ids."""
        ids = []
        for _ in range(n):
            stream = self._conn.get_next_available_stream_id()
            self._conn.send_headers(
                stream,
                [
                    (":method", "POST"),
                    (":scheme", "http"),
                    (":path", path),
                    (":authority", self.address),
                    ("content-type", "application/grpc"),
                    ("te", "trailers"),
                    *metadata,
                ],
            )
            if message is not None:
                frame = b"\x00" + len(message).to_bytes(4, "big") + message
                self._conn.send_data(stream, frame, end_stream=True)
            self._replies[stream] = RawReply()
            ids.append(stream)
        await self._flush()
        return ids

    def open_ids(self) -> list[int]:
        """The calls the server has not ended."""
        return [s for s in self._replies if s not in self.ended]

    async def close(self) -> None:
        if self._reading is not None:
            self._reading.cancel()
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(Exception):
                await self._writer.wait_closed()

    async def _flush(self) -> None:
        assert self._writer is not None
        self._writer.write(self._conn.data_to_send())
        await self._writer.drain()

    async def _read(self, reader: asyncio.StreamReader) -> None:
        while chunk := await reader.read(65536):
            for event in self._conn.receive_data(chunk):
                stream = getattr(event, "stream_id", None)
                reply = self._replies.get(stream) if stream else None
                if reply is None:
                    continue
                if isinstance(event, h2.events.ResponseReceived):
                    reply.headers = dict(event.headers)  # type: ignore[arg-type]
                elif isinstance(event, h2.events.TrailersReceived):
                    reply.trailers = dict(event.headers)  # type: ignore[arg-type]
                elif isinstance(event, h2.events.DataReceived):
                    if self.window is None:
                        self._conn.acknowledge_received_data(event.flow_controlled_length, stream)
                elif isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset)):
                    self.ended[stream] = reply
            await self._flush()
