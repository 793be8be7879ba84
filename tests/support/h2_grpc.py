"""A gRPC call made over raw HTTP/2, for what grpc's own client keeps from the caller.

grpc's client consumes some trailers itself: `endpoint-load-metrics-bin` (an
ORCA load report) goes to its balancing policy and never reaches the call's
`trailing_metadata()`. `raw_call` sends one request with `h2` and returns the
response's headers, messages and trailers as they came over the wire.
"""

from __future__ import annotations

import asyncio
import base64
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.events


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
