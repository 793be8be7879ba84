"""Options: the grpc.aio server's that suit LLM traffic (`server_options`), and
what `mount()` serves and how (`MountOptions`, in groups that are also the
launcher's flags)."""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, ClassVar

from .budgets import RequestBudgets
from .flags import flag, group, held_groups, not_a_flag
from .proto import CONTROL_SERVICE, INFERENCE_SERVICE, POOLING_SERVICE, RENDER_SERVICE, SERVICE_NAME

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


# The protocols by the launcher's short names (`--services`).
SERVICES_BY_SHORT_NAME: Mapping[str, str] = MappingProxyType(
    {
        "vllm-engine": SERVICE_NAME,
        "inference": INFERENCE_SERVICE,
        "control": CONTROL_SERVICE,
        "pooling": POOLING_SERVICE,
        "render": RENDER_SERVICE,
    }
)


def _services(names: list[str] | None) -> tuple[str, ...]:
    """`--services` as full names; not named, `DEFAULT_SERVICES` (the launcher
    widens them to every protocol when calls need credentials)."""
    if names is None:
        return DEFAULT_SERVICES
    return tuple(SERVICES_BY_SHORT_NAME[name] for name in names)


def _lora_modules(given: list[str]) -> Mapping[str, str]:
    """`name=path` pairs (vLLM's `--lora-modules` form) as a mapping."""
    modules: dict[str, str] = {}
    for item in given:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes name=path, got {item!r}")
        if name in modules:
            raise ValueError(f"--lora-modules names {name!r} twice")
        modules[name] = path
    return MappingProxyType(modules)


DEFAULT_MAX_ITEM_BYTES = 16 * 1024 * 1024
# Pillow's own warning threshold for decompression bombs.
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485


@dataclasses.dataclass(frozen=True)
class MediaRefOptions:
    """Turns on `media_refs` and bounds what the server will read.

    Attributes:
        data_urls: accept base64 `data:` URLs.
        allowed_local_media_path: directory `file:` URLs must lie under; None
            takes the engine's `--allowed-local-media-path` ("" there: no files).
        allowed_media_domains: hosts `http(s):` URLs may name; None takes the
            engine's `--allowed-media-domains` (none there: no network fetch).
        max_item_bytes: largest encoded image accepted, in bytes.
        max_image_pixels: largest decoded image accepted, in pixels.
    """

    data_urls: bool = True
    allowed_local_media_path: str | None = None
    allowed_media_domains: Sequence[str] | None = None
    max_item_bytes: int = DEFAULT_MAX_ITEM_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS

    def __post_init__(self) -> None:
        if self.max_item_bytes <= 0 or self.max_image_pixels <= 0:
            raise ValueError("max_item_bytes and max_image_pixels must be positive")


def _media_refs(enabled: bool) -> MediaRefOptions | None:
    """`--enable-media-refs` as `MediaOptions.media_refs`: the launcher's rules, or None."""
    return MediaRefOptions() if enabled else None


@dataclasses.dataclass(frozen=True)
class ServedOptions:
    """What is served: the protocols, health, reflection, load reports and LoRA adapters.

    Attributes:
        services: the protocol services to serve, by full name (`SERVICES`;
            default: all but vllm.Control). vllm.Control changes the engine for
            everyone (adapters, pause, sleep, weight updates, shutdown): serve
            it where callers are authenticated and only administrators may
            call it (`AuthInterceptor` does so).
        health: serve grpc.health.v1.Health (services "" and each one served;
            NOT_SERVING while the engine is dead). Off where the host runs its own.

    Raises:
        ValueError: `services` names none, or one this package does not serve;
            LoRA adapters with no protocol that serves them.
    """

    FLAG_TITLE: ClassVar[str] = "vllm-servicer: what is served"

    services: tuple[str, ...] = flag(
        DEFAULT_SERVICES,
        help="the protocols to serve: vllm-engine (vllm.grpc.engine.VllmEngine), "
        "inference (vLLM's vllm.Inference), pooling (vllm_servicer.v1.Pooling: classify, "
        "score, rerank), render (vllm_servicer.v1.Render: prompts as the engine runs them) "
        "and control (vLLM's vllm.Control: adapters, pause, sleep, weight updates, shutdown; "
        "administrators only when keys are set); default: all of them with API keys or "
        "--tls-client-ca, else all but control (naming control then serves it to anyone "
        "who reaches the port, with a warning)",
        nargs="+",
        choices=tuple(SERVICES_BY_SHORT_NAME),
        parsed_default=None,
        convert=_services,
    )
    health: bool = not_a_flag(True)
    reflection_service: bool = flag(
        True,
        help="serve server reflection (v1alpha) for the services mounted: it resolves their "
        "files and imports, nothing else of the process",
        spelled="--no-reflection",
    )
    load_reports: bool = flag(
        True,
        help="send balancers the engine's load as ORCA reports, which gRPC's "
        "weighted_round_robin and Envoy read: in the endpoint-load-metrics-bin trailer of "
        "every engine call that ends OK (Generate, Embed...), and on "
        "xds.service.orca.v3.OpenRcaService (no key needed, as health)",
        spelled="--no-load-reports",
    )
    lora_modules: Mapping[str, str] = flag(
        default_factory=lambda: MappingProxyType({}),
        help="LoRA adapters to serve by name from the start, each name's path on this host "
        "(vLLM's --lora-modules; needs --enable-lora), loaded at first use; more can be "
        "loaded through vllm.Control's LoadLora",
        metavar="NAME=PATH",
        nargs="+",
        parsed_default=[],
        convert=_lora_modules,
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
        if self.lora_modules and set(self.services) <= {SERVICE_NAME}:
            raise ValueError(
                "lora_modules are served through vllm.Inference (lora_name), vllm.Control "
                "and Pooling and Render (model), not VllmEngine: add one of them to services "
                "(the launcher's --lora-modules and --services)"
            )

    def __reduce__(self) -> tuple[object, ...]:
        # Handed to each frontend process (--api-server-count): a read-only
        # mapping does not pickle, so the adapters travel as a dict.
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["lora_modules"] = dict(self.lora_modules)
        return (_unpickle_served, (fields,))


def _unpickle_served(fields: dict[str, Any]) -> ServedOptions:
    return ServedOptions(**fields)


@dataclasses.dataclass(frozen=True)
class StreamingOptions:
    """How streams are sent: tokens per message, and KV event subscribers.

    Raises:
        ValueError: an interval or a limit out of range.
    """

    FLAG_TITLE: ClassVar[str] = "vllm-servicer: streaming"

    stream_interval: int = flag(
        1,
        help="new tokens a streamed generation's message gathers before it is sent, both "
        "gRPC generation protocols (vLLM's per-request stream_interval; the first and the "
        "last token go at once): fewer messages cost the serving process less per token, "
        "and a token waits up to N-1 engine steps; the engine's own --stream-interval (every "
        "frontend, vLLM's HTTP API included) stays the floor (default 1: every step)",
        spelled="--grpc-stream-interval",
        metavar="N",
    )
    stream_interval_min_inflight: int = flag(
        0,
        help="apply the stream interval only to streams that start while at least this many "
        "engine calls are in flight (the new one counted), so that a lightly loaded server "
        "streams every step (default 0: always)",
        spelled="--grpc-stream-interval-min-inflight",
        metavar="K",
    )
    max_kv_subscribers: int = flag(
        DEFAULT_MAX_KV_SUBSCRIBERS,
        help="most SubscribeKvEvents streams open at once; the next one is answered "
        "RESOURCE_EXHAUSTED",
    )

    def __post_init__(self) -> None:
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


@dataclasses.dataclass(frozen=True)
class MediaOptions:
    """Where images may come from besides the request itself: URLs, shared memory."""

    FLAG_TITLE: ClassVar[str] = "vllm-servicer: media"

    media_refs: MediaRefOptions | None = flag(
        None,
        help="resolve images that Generate names by URL (media_refs) by these rules (the "
        "launcher's: data: URLs, file: under --allowed-local-media-path, http(s): only to "
        "--allowed-media-domains); None refuses them with UNIMPLEMENTED",
        spelled="--enable-media-refs",
        action="store_true",
        parsed_default=False,
        convert=_media_refs,
    )
    shm_tensors: bool = flag(
        False,
        help="take preprocessed image tensors (mm_inputs) through this host's shared memory "
        "too, not only inline: a caller names the segment and the server reads any its user "
        "can, so only where every caller may read this host's shared memory",
        spelled="--enable-shm-tensors",
    )


@dataclasses.dataclass(frozen=True)
class ChatOptions:
    """How chats are laid out and read back, for Render and the HTTP API.

    Raises:
        ValueError: automatic tool choice without a tool-call parser.
    """

    FLAG_TITLE: ClassVar[str] = "vllm-servicer: chat (Render and the HTTP API)"

    chat_template: str | None = flag(
        None,
        help="chat template (a file or inline Jinja) instead of the model's, for Render and "
        "the launcher's HTTP API (/v1/chat/completions), as vLLM's own --chat-template",
    )
    tool_call_parser: str | None = flag(
        None,
        help="vLLM's tool-call parser by name (hermes, pythonic, ...), as vLLM's own "
        "--tool-call-parser: Render's DerenderChat parses tool calls with it, and so does the "
        "launcher's HTTP API; the engine's --reasoning-parser splits reasoning for both",
    )
    enable_auto_tool_choice: bool = flag(
        False,
        help="let the model choose to call tools (tool_choice auto) and parse its calls with "
        "--tool-call-parser, as vLLM's own --enable-auto-tool-choice",
    )

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError(
                "enable_auto_tool_choice needs a tool_call_parser "
                "(the launcher's --enable-auto-tool-choice needs --tool-call-parser)"
            )


@dataclasses.dataclass(frozen=True)
class TenancyOptions:
    """What tenants share: routing data, the prefix cache, queued prompt tokens.

    Raises:
        ValueError: a negative token ceiling.
    """

    FLAG_TITLE: ClassVar[str] = "vllm-servicer: tenancy"

    routing_data_for_every_key: bool = flag(
        False,
        help="take KV transfer parameters (kv_transfer_params: they make a prefill engine "
        "hold KV blocks, a decode engine connect to a host the caller names) from every "
        "authenticated caller, not only from identities with the router or admin role (others "
        "get PERMISSION_DENIED; calls without credentials always may). KV events follow the "
        "authentication's permissions instead: the launcher opens both to every key, carrying "
        "every tenant's token ids, so only where no tenant may be kept from another's prompts",
    )
    shared_prefix_cache: bool = flag(
        False,
        help="one prefix cache for every tenant, as vLLM has it: tenants' prompts are not "
        "salted by their name (admin callers' and unauthenticated ones never are), so a common "
        "system prompt is reused across tenants, and each can read from cached token counts "
        "whether another's prompts share a prefix it guesses. Only where tenants trust each "
        "other",
    )
    max_queued_prompt_tokens: int = flag(
        DEFAULT_MAX_QUEUED_PROMPT_TOKENS,
        help="prompt tokens waiting for their prefill that tenants share: while several want "
        "them each is held to its weighted share of this many, and a request past it is "
        "answered RESOURCE_EXHAUSTED (HTTP 503) naming the share, with a retry hint; a tenant "
        "alone, callers without a key and admins are not held; 0: no shares",
    )

    def __post_init__(self) -> None:
        if self.max_queued_prompt_tokens < 0:
            raise ValueError(
                "max_queued_prompt_tokens must be 0 (no limit) or more, "
                f"got {self.max_queued_prompt_tokens} (the launcher's --max-queued-prompt-tokens)"
            )


@dataclasses.dataclass(frozen=True)
class MountOptions:
    """What `mount()` serves and how: one object of groups, each validated once.

    Each group is a frozen dataclass whose fields carry their help, which the
    launcher shows as the help of the flag that sets each (`flags.py`): a
    serving option is a field of its group plus the code that reads it.
    `mount()` reads what is served; the servicers it builds read their own
    groups from the state they share (`MountState.options`).

    Attributes:
        served: the protocols, health, reflection, load reports, LoRA adapters.
        streaming: tokens per streamed message, KV event subscribers.
        media: images by URL and through shared memory.
        chat: the chat template and tool calls, for Render and the HTTP API.
        tenancy: what tenants share.
        budgets: what one request may cost (decoded image pixels and bytes, n,
            constraint size, ids per Abort, shared-memory bytes...), and the
            decoded images the process holds at once; past one, a call is
            refused before any engine work.
    """

    served: ServedOptions = group(ServedOptions)
    streaming: StreamingOptions = group(StreamingOptions)
    media: MediaOptions = group(MediaOptions)
    chat: ChatOptions = group(ChatOptions)
    tenancy: TenancyOptions = group(TenancyOptions)
    budgets: RequestBudgets = group(RequestBudgets)

    @classmethod
    def option_names(cls) -> frozenset[str]:
        """Every name `of` takes: each group's, and each field's of a group."""
        groups = held_groups(cls)
        return frozenset(
            [*groups, *(field.name for of in groups.values() for field in dataclasses.fields(of))]
        )

    @classmethod
    def of(cls, **fields: Any) -> MountOptions:
        """`MountOptions` from its groups' fields by name, each put in its group:
        `MountOptions.of(load_reports=False, stream_interval=4)`. A group's own
        name takes the whole group (`budgets=RequestBudgets(...)`).

        Raises:
            TypeError: a name that is no group's field.
        """
        unknown = sorted(set(fields) - cls.option_names())
        if unknown:
            raise TypeError(f"MountOptions has no option {unknown[0]!r}")
        groups: dict[str, Any] = {}
        for name, of in held_groups(cls).items():
            if name in fields:
                groups[name] = fields.pop(name)
            elif mine := {f.name for f in dataclasses.fields(of)} & set(fields):
                groups[name] = of(**{option: fields.pop(option) for option in mine})
        return cls(**groups)


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
