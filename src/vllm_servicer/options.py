"""Options: the grpc.aio server's that suit LLM traffic (`server_options`), and
what `mount()` was told that its servicers read (`MountOptions`)."""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

from .budgets import RequestBudgets

if TYPE_CHECKING:
    from .multimodal.media import MediaRefOptions

DEFAULT_MAX_MESSAGE_BYTES = 32 * 1024 * 1024
# Concurrent SubscribeKvEvents streams: each holds a socket in the serving
# process and a send queue in every engine core's publisher.
DEFAULT_MAX_KV_SUBSCRIBERS = 16


@dataclasses.dataclass(frozen=True)
class MountOptions:
    """What `mount()` was told that its servicers read: one object, passed to each unchanged.

    A serving option is a field here, read by the servicer that needs it;
    `mount()` (its keyword arguments, documented there) only fills it.

    Attributes:
        max_kv_subscribers: SubscribeKvEvents streams allowed at once.
        media_refs: the rules images named by URL are fetched by; None refuses them.
        shm_tensors: take preprocessed tensors (`mm_inputs`) through this
            host's shared memory too.
        lora_modules: LoRA adapters loaded at first use, by name: their paths.
        budgets: what one request may cost.
        load_reports: send balancers the engine's load (ORCA): in the trailer
            `endpoint-load-metrics-bin` of every engine call, and on
            `xds.service.orca.v3.OpenRcaService` streams.
        stream_interval: the new tokens a streamed generation's message
            gathers before it leaves (vLLM's per-request `stream_interval`;
            the first token and the last leave at once); 1 sends each engine
            step's. Fewer messages cost the serving process less per token;
            a token then waits up to `stream_interval - 1` engine steps.
        stream_interval_min_inflight: the interval applies to streams that
            start while at least this many engine calls are in flight (the
            new one counted); 0: to every stream.
        chat_template: the chat template Render uses instead of the model's
            (a file or the template itself, as vLLM's `--chat-template`);
            None: the model's.
        routing_data_for_every_key: take KV transfer parameters from every
            caller, not only from identities with the router or admin role.
            KV events follow the authentication's permissions instead
            (`role_permissions` keeps them to routers; the launcher's
            `--routing-data-for-every-key` opens both).
        shared_prefix_cache: one prefix cache for every tenant, as vLLM has
            it: no tenant's prompts salted (`prefix_cache.py`). Only where
            tenants trust each other: each could read the others' prompts
            from its cached token counts.
    """

    max_kv_subscribers: int = DEFAULT_MAX_KV_SUBSCRIBERS
    media_refs: MediaRefOptions | None = None
    shm_tensors: bool = False
    lora_modules: Mapping[str, str] = dataclasses.field(default_factory=dict)
    budgets: RequestBudgets = dataclasses.field(default_factory=RequestBudgets)
    load_reports: bool = True
    stream_interval: int = 1
    stream_interval_min_inflight: int = 0
    chat_template: str | None = None
    routing_data_for_every_key: bool = False
    shared_prefix_cache: bool = False

    def __post_init__(self) -> None:
        # Frozen all through: a copy the caller cannot change under the servicers.
        object.__setattr__(self, "lora_modules", MappingProxyType(dict(self.lora_modules)))
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {self.stream_interval}")
        if self.stream_interval_min_inflight < 0:
            raise ValueError(
                "stream_interval_min_inflight must be 0 or more, "
                f"got {self.stream_interval_min_inflight}"
            )


def server_options(
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    *,
    max_connection_age: float | None = None,
    max_connection_age_grace: float = 30.0,
    request_compression: bool = False,
) -> list[tuple[str, int]]:
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
    - `max_connection_age` (seconds, off by default): the server asks clients
      to reconnect after this long (GOAWAY), letting calls in flight run for
      `max_connection_age_grace` more seconds. Client-side and proxy
      balancing then re-spread load after a scale-up instead of keeping every
      long-lived HTTP/2 connection on the old replicas.
    - Compressed requests are refused (`request_compression=False`, the
      default): a client that sends `grpc-encoding: gzip` or `deflate` gets
      UNIMPLEMENTED ("Compression algorithm 'gzip' is disabled") from grpc's
      core, before any handler and before a byte is inflated. A few KiB of
      gzip inflate to the whole receive limit, and grpc inflates in the
      serving process before an interceptor can refuse the call: for methods
      that take no key (health, reflection) and for clients with a key.
      Clients send uncompressed requests unless told otherwise (grpc's own,
      Go's and Rust's tonic alike); turn it on only where every client is
      trusted. The server still answers uncompressed.
    - `so_reuseport=0`: grpc turns SO_REUSEPORT on by default, so a second
      server started on a port that one already serves binds it too and the
      kernel splits the traffic between them (perhaps two different models);
      off, the second bind fails. Hosts that want several processes on one
      port on purpose can append ("grpc.so_reuseport", 1).
    """
    if max_message_bytes <= 0:
        raise ValueError("max_message_bytes must be positive; unlimited sizes are unsafe")
    options = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.so_reuseport", 0),
    ]
    if not request_compression:
        options.append(("grpc.compression_enabled_algorithms_bitset", 1))  # identity only
    if max_connection_age is not None:
        if max_connection_age <= 0:
            raise ValueError("max_connection_age must be positive")
        options += [
            ("grpc.max_connection_age_ms", int(max_connection_age * 1000)),
            ("grpc.max_connection_age_grace_ms", int(max_connection_age_grace * 1000)),
        ]
    return options


def shared_port(options: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """`options` with SO_REUSEPORT on: for several processes serving one port on
    purpose (`serve --api-server-count`)."""
    return [o for o in options if o[0] != "grpc.so_reuseport"] + [("grpc.so_reuseport", 1)]


def port_in_use(host: str, port: int) -> bool:
    """Whether a TCP port already has a listener on `host` (False for port 0).

    A check before a slow start-up (loading a model), so that a port taken by
    another server fails at once rather than after the engine is up.
    """
    if port == 0:
        return False
    try:
        addresses = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror:
        return False  # the server's own bind reports a bad host
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            # As grpc binds: a port in TIME_WAIT after a restart is free.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError:
                return True
    return False
