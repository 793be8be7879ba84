"""Options: the grpc.aio server's that suit LLM traffic (`server_options`), and
what `mount()` serves and how (`MountOptions`)."""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from .budgets import RequestBudgets
from .proto import CONTROL_SERVICE, INFERENCE_SERVICE, POOLING_SERVICE, RENDER_SERVICE, SERVICE_NAME

if TYPE_CHECKING:
    from .multimodal.media import MediaRefOptions

DEFAULT_MAX_MESSAGE_BYTES = 32 * 1024 * 1024
# Concurrent SubscribeKvEvents streams: each holds a socket in the serving
# process and a send queue in every engine core's publisher.
DEFAULT_MAX_KV_SUBSCRIBERS = 16
# Prompt tokens waiting for their prefill, every tenant's: 128 prompts of
# 2,048 tokens, many engine steps of any model; a ceiling per tenant, not the
# order (that is the fair order's, fair_work.py).
DEFAULT_MAX_QUEUED_PROMPT_TOKENS = 262_144

SERVICES: tuple[str, ...] = (
    SERVICE_NAME,
    INFERENCE_SERVICE,
    CONTROL_SERVICE,
    POOLING_SERVICE,
    RENDER_SERVICE,
)
"""Every protocol service `mount()` can serve, by full name."""
DEFAULT_SERVICES: tuple[str, ...] = (
    SERVICE_NAME,
    INFERENCE_SERVICE,
    POOLING_SERVICE,
    RENDER_SERVICE,
)
"""What `mount()` serves unless told: the inference protocols, pooling and
rendering (each refuses what the model cannot do), not vLLM's Control."""


def _option(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    default_factory: Any = dataclasses.MISSING,
    flag: str | None = "",
    metavar: str | None = None,
) -> Any:
    """A `MountOptions` field: its help (the one description of it, which the
    launcher's flag shows too) and how the launcher spells its flag.

    `flag`: "" for `--` and the field's name, None for no flag of its own; a
    field on by default is turned off by its flag (`--no-reflection`).
    """
    metadata: dict[str, Any] = {"help": help, "flag": flag}
    if metavar is not None:
        metadata["metavar"] = metavar
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def option_flag(field: dataclasses.Field[Any]) -> str | None:
    """The launcher flag of a `MountOptions` field (`--max-kv-subscribers`), or None."""
    flag: str | None = field.metadata["flag"]
    if flag == "":
        return "--" + field.name.replace("_", "-")
    return flag


@dataclasses.dataclass(frozen=True)
class MountOptions:
    """What `mount()` serves and how: one object, validated here once.

    Each field carries its help in its metadata (`dataclasses.fields`), which
    the launcher shows as the help of the flag that sets it (`option_flag`):
    a serving option is a field here plus the code that reads it. `mount()`
    reads the services, health and reflection; the servicers it builds read
    their own fields from the state they share (`MountState.options`).

    Raises:
        ValueError: `services` names none, or a service this package does not
            serve; a stream interval out of range.
    """

    services: tuple[str, ...] = _option(
        DEFAULT_SERVICES,
        help="the protocol services to serve, by full name (`SERVICES`; default: all but "
        "vllm.Control). vllm.Control changes the engine for everyone (adapters, pause, sleep, "
        "weight updates, shutdown): serve it where callers are authenticated and only "
        "administrators may call it (`AuthInterceptor` does so)",
        flag=None,  # the launcher names them its own way (--services)
    )
    health: bool = _option(
        True,
        help='serve grpc.health.v1.Health (services "" and each one served; NOT_SERVING '
        "while the engine is dead). Off where the host runs its own",
        flag=None,
    )
    reflection_service: bool = _option(
        True,
        help="serve server reflection (v1alpha) for the services mounted: it resolves their "
        "files and imports, nothing else of the process",
        flag="--no-reflection",
    )
    load_reports: bool = _option(
        True,
        help="send balancers the engine's load as ORCA reports, which gRPC's "
        "weighted_round_robin and Envoy read: in the endpoint-load-metrics-bin trailer of "
        "every engine call that ends OK (Generate, Embed...), and on "
        "xds.service.orca.v3.OpenRcaService (no key needed, as health)",
        flag="--no-load-reports",
    )
    max_kv_subscribers: int = _option(
        DEFAULT_MAX_KV_SUBSCRIBERS,
        help="most SubscribeKvEvents streams open at once; the next one is answered "
        "RESOURCE_EXHAUSTED",
    )
    media_refs: MediaRefOptions | None = _option(
        None,
        help="resolve images that Generate names by URL (media_refs) by these rules (the "
        "launcher's: data: URLs, file: under --allowed-local-media-path, http(s): only to "
        "--allowed-media-domains); None refuses them with UNIMPLEMENTED",
        flag="--enable-media-refs",
    )
    shm_tensors: bool = _option(
        False,
        help="take preprocessed image tensors (mm_inputs) through this host's shared memory "
        "too, not only inline: a caller names the segment and the server reads any its user "
        "can, so only where every caller may read this host's shared memory",
        flag="--enable-shm-tensors",
    )
    lora_modules: Mapping[str, str] = _option(
        default_factory=lambda: MappingProxyType({}),
        help="LoRA adapters to serve by name from the start, each name's path on this host "
        "(vLLM's --lora-modules; needs --enable-lora), loaded at first use; more can be "
        "loaded through vllm.Control's LoadLora",
        metavar="NAME=PATH",
    )
    budgets: RequestBudgets = _option(
        default_factory=RequestBudgets,
        help="what one request may cost (decoded image pixels and bytes, n, constraint size, "
        "ids per Abort, shared-memory bytes...), and the decoded images the process holds at "
        "once; past one, a call is refused before any engine work",
        flag=None,  # a flag per field, declared there
    )
    stream_interval: int = _option(
        1,
        help="new tokens a streamed generation's message gathers before it is sent, both "
        "gRPC generation protocols (vLLM's per-request stream_interval; the first and the "
        "last token go at once): fewer messages cost the serving process less per token, "
        "and a token waits up to N-1 engine steps; the engine's own --stream-interval (every "
        "frontend, vLLM's HTTP API included) stays the floor (default 1: every step)",
        flag="--grpc-stream-interval",
        metavar="N",
    )
    stream_interval_min_inflight: int = _option(
        0,
        help="apply the stream interval only to streams that start while at least this many "
        "engine calls are in flight (the new one counted), so that a lightly loaded server "
        "streams every step (default 0: always)",
        flag="--grpc-stream-interval-min-inflight",
        metavar="K",
    )
    chat_template: str | None = _option(
        None,
        help="chat template (a file or inline Jinja) instead of the model's, for Render and "
        "the launcher's HTTP API (/v1/chat/completions), as vLLM's own --chat-template",
    )
    tool_call_parser: str | None = _option(
        None,
        help="vLLM's tool-call parser by name (hermes, pythonic, ...), as vLLM's own "
        "--tool-call-parser: Render's DerenderChat parses tool calls with it, and so does the "
        "launcher's HTTP API; the engine's --reasoning-parser splits reasoning for both",
    )
    enable_auto_tool_choice: bool = _option(
        False,
        help="let the model choose to call tools (tool_choice auto) and parse its calls with "
        "--tool-call-parser, as vLLM's own --enable-auto-tool-choice",
    )
    routing_data_for_every_key: bool = _option(
        False,
        help="take KV transfer parameters (kv_transfer_params: they make a prefill engine "
        "hold KV blocks, a decode engine connect to a host the caller names) from every "
        "authenticated caller, not only from identities with the router or admin role (others "
        "get PERMISSION_DENIED; calls without credentials always may). KV events follow the "
        "authentication's permissions instead: the launcher opens both to every key, carrying "
        "every tenant's token ids, so only where no tenant may be kept from another's prompts",
    )
    shared_prefix_cache: bool = _option(
        False,
        help="one prefix cache for every tenant, as vLLM has it: tenants' prompts are not "
        "salted by their name (admin callers' and unauthenticated ones never are), so a common "
        "system prompt is reused across tenants, and each can read from cached token counts "
        "whether another's prompts share a prefix it guesses. Only where tenants trust each "
        "other",
    )
    max_queued_prompt_tokens: int = _option(
        DEFAULT_MAX_QUEUED_PROMPT_TOKENS,
        help="prompt tokens waiting for their prefill that tenants share: while several want "
        "them each is held to its weighted share of this many, and a request past it is "
        "answered RESOURCE_EXHAUSTED (HTTP 503) naming the share, with a retry hint; a tenant "
        "alone, callers without a key and admins are not held; 0: no shares",
    )

    def __post_init__(self) -> None:
        # Frozen all through: copies the caller cannot change under the servicers.
        object.__setattr__(self, "lora_modules", MappingProxyType(dict(self.lora_modules)))
        object.__setattr__(self, "services", tuple(self.services))
        unknown = sorted(set(self.services) - set(SERVICES))
        if unknown or not self.services:
            raise ValueError(
                f"services must be some of {', '.join(SERVICES)}; got {unknown or 'none'}"
            )
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError(
                "enable_auto_tool_choice needs a tool_call_parser "
                "(the launcher's --enable-auto-tool-choice needs --tool-call-parser)"
            )
        if self.max_queued_prompt_tokens < 0:
            raise ValueError(
                "max_queued_prompt_tokens must be 0 (no limit) or more, "
                f"got {self.max_queued_prompt_tokens} (the launcher's --max-queued-prompt-tokens)"
            )
        if self.stream_interval < 1:
            raise ValueError(
                f"stream_interval must be at least 1, got {self.stream_interval} "
                "(the launcher's --grpc-stream-interval)"
            )
        if self.stream_interval_min_inflight < 0:
            raise ValueError(
                "stream_interval_min_inflight must be 0 or more, "
                f"got {self.stream_interval_min_inflight} "
                "(the launcher's --grpc-stream-interval-min-inflight)"
            )

    def __reduce__(self) -> tuple[Any, ...]:
        # Handed to each frontend process (--api-server-count): a read-only
        # mapping does not pickle, so the adapters travel as a dict.
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["lora_modules"] = dict(self.lora_modules)
        return (_unpickle_mount_options, (fields,))


def _unpickle_mount_options(fields: dict[str, Any]) -> MountOptions:
    return MountOptions(**fields)


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
