"""Recommended grpc.aio server options for serving LLM traffic."""

from __future__ import annotations

DEFAULT_MAX_MESSAGE_BYTES = 32 * 1024 * 1024


def server_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """grpc.aio server options that suit LLM serving, for `grpc.aio.server(options=...)`.

    - Message sizes are bounded (32 MiB each way by default; vLLM's own gRPC
      server leaves them unlimited, which lets one client exhaust memory).
      Raise `max_message_bytes` for very long prompts or large logprob payloads.
    - `max_ping_strikes=0`: a non-streaming Generate writes nothing while the
      engine decodes; client keepalive pings in that time must not count as
      strikes, or the server sends GOAWAY(too_many_pings) and kills every call
      on the connection.
    - Routers ping every ~30 s, also between requests: allow pings without
      data every 10 s and without calls.
    """
    if max_message_bytes <= 0:
        raise ValueError("max_message_bytes must be positive; unlimited sizes are unsafe")
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]
