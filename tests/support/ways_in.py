"""Every way into a server the launcher runs, and how each tenant-isolation promise holds there.

One table, `WAYS_IN`: a row per way in (each RPC of every service the launcher
serves, each route of vLLM's HTTP app as the launcher builds it, and the ports
and sockets besides), a column per harm one tenant could do another
(`HARMS`):

- `hold`: hold a slot (engine, call, keyless, connection) without moving;
- `cost`: make one request cost past a budget (tokenizer, event loop, memory);
- `read`: read another tenant's data or reach its requests (ids, outputs,
  cached prompts, stored responses);
- `poison`: poison what another tenant's requests draw on (prefix and media
  caches, connectors, adapters, the load balancers' view).

Each cell is the pytest node id of a wire test that proves the promise for that
way in (or a tuple of them); a `Via` when the proof is the test of a mechanism
this way in shares; `NotApplicable` or `Keyless` with a one-line reason; or a
`Gap` naming what is missing. `tests/test_ways_in.py` holds the table to what
is served, to the tests it cites, to docs/security.md's "Every way in, every
promise" table (each row's `doc` is the bold name of its row there) and to its
short list of known gaps.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields

from vllm_servicer.proto.methods import ADMIN_METHODS

__all__ = ["HARMS", "WAYS_IN", "Cell", "Gap", "Keyless", "NotApplicable", "Via", "WayIn", "cited"]


@dataclass(frozen=True)
class Via:
    """Proved by the test of a mechanism this way in shares, not on this way in itself.

    Attributes:
        test: the pytest node id of the shared mechanism's test.
        note: the mechanism, and why this way in goes through it.
    """

    test: str
    note: str


@dataclass(frozen=True)
class NotApplicable:
    """The harm cannot be done through this way in.

    Attributes:
        reason: why, in one line.
    """

    reason: str


@dataclass(frozen=True)
class Keyless:
    """No key, by design: the promise rests on what keeps keyless callers apart.

    Attributes:
        reason: what bounds it, in one line.
        test: the pytest node id of a test of that bound, if there is one.
    """

    reason: str
    test: str | None = None


@dataclass(frozen=True)
class Gap:
    """The promise does not hold here, or nothing proves it: listed in the test's known gaps.

    Attributes:
        missing: what is missing, in one line.
    """

    missing: str


Proof = str | Via
Cell = Proof | tuple[Proof, ...] | NotApplicable | Keyless | Gap


@dataclass(frozen=True)
class WayIn:
    """One way in and how each harm is kept from it.

    Attributes:
        doc: the bold name of its row in docs/security.md's "Every way in, every promise".
        name: "/package.Service/Method", "METHOD /path" (WS for a WebSocket route,
            MOUNT for an app mounted under the path), or a port's or socket's name.
        hold: hold a slot without moving.
        cost: cost past a budget.
        read: read another tenant's data or reach its requests.
        poison: poison what another tenant's requests draw on.
    """

    doc: str
    name: str
    hold: Cell
    cost: Cell
    read: Cell
    poison: Cell

    def cells(self) -> dict[str, Cell]:
        """Each harm's cell, by harm."""
        return {harm: getattr(self, harm) for harm in HARMS}


HARMS = tuple(f.name for f in fields(WayIn))[2:]
"""The harms, the table's columns: hold, cost, read, poison."""


def cited(cell: Cell) -> tuple[str, ...]:
    """The pytest node ids a cell cites."""
    proofs = cell if isinstance(cell, tuple) else (cell,)
    found: list[str] = []
    for proof in proofs:
        if isinstance(proof, str):
            found.append(proof)
        elif isinstance(proof, Via):
            found.append(proof.test)
        elif isinstance(proof, Keyless) and proof.test:
            found.append(proof.test)
    return tuple(found)


def _ways(
    doc: str, names: Iterable[str], *, hold: Cell, cost: Cell, read: Cell, poison: Cell
) -> tuple[WayIn, ...]:
    """Rows of `doc` sharing every cell, one per name."""
    return tuple(WayIn(doc, name, hold, cost, read, poison) for name in names)


def _rpcs(service: str, *methods: str) -> tuple[str, ...]:
    return tuple(f"/{service}/{method}" for method in methods)


# ----- the wire tests cited ---------------------------------------------------------------

# Holding slots.
HALF_OPEN_GENERATES = (
    "tests/test_tenant_call_slots.py::test_half_open_generates_give_their_slots_back"
)
HEADER_ONLY_CALLS = (
    "tests/test_still_calls.py::"
    "test_header_only_calls_give_their_call_slots_to_the_admin_and_another_tenant"
)
UNREAD_GENERATES = (
    "tests/test_still_calls.py::"
    "test_generates_whose_client_takes_nothing_end_and_give_their_slots_back"
)
STILL_DERENDER_STREAMS = (
    "tests/test_still_calls.py::"
    "test_derender_streams_that_stop_sending_give_their_engine_slots_to_another_tenant"
)
HEADER_ONLY_CHECKS = (
    "tests/test_tenant_call_slots.py::test_header_only_checks_do_not_keep_a_probe_from_its_answer"
)
KEYLESS_STREAMS = (
    "tests/test_keyless_surfaces.py::"
    "test_keyless_streams_take_no_slot_of_a_keyed_call_nor_of_a_probe"
)
ORCA_KEYLESS = (
    "tests/test_load_report.py::test_reports_need_no_key_on_the_stream_but_one_on_the_calls"
)
KV_SUBSCRIBER_CAP = "tests/test_kv_events.py::test_one_key_cannot_take_every_subscriber_slot"
STALLED_BODIES = (
    "tests/test_http_admission.py::"
    "test_stalled_bodies_get_408_at_the_read_deadline_and_the_other_tenant_is_served"
)
STALLED_HEADERS = "tests/test_http_admission.py::test_a_connection_stalled_in_its_headers_is_closed"
CONNECTION_CAP = "tests/test_http_admission.py::test_connections_past_the_cap_are_refused_at_once"
HTTP_SHARE = (
    "tests/test_http_slots.py::"
    "test_a_tenant_past_its_share_of_call_slots_is_refused_the_other_served"
)
SHM_FIFO = "tests/test_budgets.py::test_a_fifo_named_as_a_segment_is_refused_without_blocking"

# Budgets.
BUDGET_N = "tests/test_budgets.py::test_n_past_the_budget_is_refused_naming_it"
BUDGET_STOP_FLOOD = (
    "tests/test_budgets.py::test_a_flood_of_stop_strings_is_refused_and_others_are_served"
)
BUDGET_STOP_BOTH = (
    "tests/test_budgets.py::test_stop_strings_past_the_count_are_refused_on_both_protocols"
)
BUDGET_CONSTRAINT = (
    "tests/test_budgets.py::test_a_constraint_past_the_budget_is_refused_on_both_protocols"
)
BUDGET_IMAGE_BOMB = (
    "tests/test_budgets.py::test_an_image_bomb_is_refused_from_its_header_on_both_protocols"
)
BUDGET_CONTROL_CHARS = (
    "tests/test_budgets.py::test_a_request_id_with_a_control_character_is_refused_on_both_protocols"
)
BUDGET_ABORT_IDS = (
    "tests/test_budgets.py::test_an_abort_of_more_ids_than_the_budget_is_refused_on_both_protocols"
)
BUDGET_SHM = (
    "tests/test_budgets.py::test_shared_memory_past_the_request_budget_is_refused_before_any_read"
)
PROMPT_PAST_CONTEXT = (
    "tests/test_bad_input.py::test_a_prompt_past_the_context_is_refused_by_its_length"
)
EMBED_PAST_CONTEXT = "tests/test_bad_input.py::test_embed_edge[prompt_over_max_model_len]"
POOLING_BAD_INPUT = "tests/test_pooling.py::test_bad_input_is_refused_naming_the_field"
RENDER_CHARS = (
    "tests/test_render.py::test_a_render_past_its_characters_is_refused_before_any_is_tokenized"
)
RENDER_BAD_CHAT = "tests/test_render.py::test_bad_chat_input_is_refused_naming_the_field"
DERENDER_BAD_CHAT = (
    "tests/test_derender.py::test_bad_derender_chat_input_is_refused_naming_the_field"
)
DERENDER_COMPLETION = "tests/test_derender.py::test_derender_completion_needs_a_key_and_its_prompts"
DERENDER_COMPLETION_STREAM = (
    "tests/test_derender.py::test_a_completion_stream_needs_a_key_and_keeps_to_its_budgets"
)
DERENDER_CHAT_CHUNKS = (
    "tests/test_derender.py::test_a_chat_stream_ends_with_its_finish_and_keeps_to_its_chunk_budget"
)
DERENDER_CHAT_REPLAY = (
    "tests/test_derender.py::test_a_chat_stream_is_cut_past_the_tokens_its_chunks_replay"
)
KV_SLOW_SUBSCRIBER = (
    "tests/test_kv_events.py::"
    "test_a_slow_subscriber_keeps_the_newest_batches_not_the_engines_memory"
)
ORCA_FLOOR = "tests/test_load_report.py::test_the_stream_reports_no_more_often_than_its_floor"
AUTH_FLOOD = "tests/test_auth_flood.py::test_an_unauthenticated_gzip_flood_does_not_stall_a_stream"
PROBE_PORT = "tests/test_probe_port.py::test_probes_reach_health_in_plaintext_and_nothing_else"
HTTP_N = "tests/test_http_slots.py::test_http_n_past_the_budget_is_refused_naming_n"
HTTP_BODY = (
    "tests/test_http_slots.py::"
    "test_a_body_declared_past_the_message_limit_is_refused_before_it_is_read"
)
HTTP_STOP_COMPLETIONS = (
    "tests/test_one_guard.py::test_http_stop_strings_past_a_budget_are_refused_400_naming_stop"
    "[/v1/completions]"
)
HTTP_STOP_CHAT = (
    "tests/test_one_guard.py::test_http_stop_strings_past_a_budget_are_refused_400_naming_stop"
    "[/v1/chat/completions]"
)
HTTP_REQUEST_ID = (
    "tests/test_one_guard.py::test_an_http_request_id_past_the_checks_is_refused_400_naming_it"
)
HTTP_CONSTRAINT = (
    "tests/test_http_admission.py::"
    "test_a_constraint_past_the_budget_is_refused_at_once_naming_the_flag"
)
HTTP_TOKENIZE = (
    "tests/test_http_admission.py::"
    "test_tokenize_and_detokenize_past_the_render_budgets_are_refused_naming_the_flag"
)
METRICS_KEY = "tests/test_http_admission.py::test_metrics_need_a_key_when_keys_are_set"

# Another tenant's data and requests.
ID_TAKEN = "tests/test_launcher_auth.py::test_another_key_cannot_take_a_running_request_id"
ABORT_OWN = "tests/test_launcher_auth.py::test_abort_reaches_own_requests_only_unless_admin[other]"
CONTROL_ABORT_OWN = "tests/test_control.py::test_a_caller_cannot_abort_another_callers_request"
INFERENCE_ID = "tests/test_inference.py::test_a_running_request_id_is_its_callers_in_both_protocols"
POOLING_ID = "tests/test_pooling.py::test_a_request_id_running_for_one_caller_is_not_anothers"
HTTP_ID = "tests/test_one_guard.py::test_an_http_requests_engine_id_is_its_callers_alone"
_PREFIX = (
    "tests/test_prefix_cache_salt.py::"
    "test_a_tenant_finds_its_own_prompt_in_the_cache_and_no_other_does"
)
PREFIX_ENGINE = f"{_PREFIX}[salted-VllmEngine.Generate]"
PREFIX_INFERENCE = f"{_PREFIX}[salted-Inference.Generate]"
PREFIX_INFERENCE_STREAM = f"{_PREFIX}[salted-Inference.GenerateStream]"
PREFIX_HTTP = "tests/test_prefix_cache_salt.py::test_an_http_prompt_is_kept_to_its_tenant[salted]"
KV_EVENTS_READ = (
    "tests/test_routing_data.py::"
    "test_a_tenant_reads_no_kv_events_a_router_reads_every_tenants_tokens"
)
RESPONSES_STORE = "tests/test_runtime_lora_http.py::test_the_responses_store_is_an_admin_keys"
REFLECTION_FILES = "tests/test_mount.py::test_reflection_reveals_nothing_but_the_mounted_services"
PEERS_OTHER_USER = (
    "tests/test_api_servers.py::test_another_user_is_refused_where_the_directory_would_let_it_in"
)
PEERS_PLANTED = "tests/test_api_servers.py::test_a_socket_planted_in_a_peers_place_is_not_believed"
KV_PUBLISHER_WARNING = (
    "tests/test_kv_publisher_warning.py::test_vllms_default_endpoint_is_named_in_a_warning"
)

# What other tenants' requests draw on.
PREFIX_OWN_SALT = (
    "tests/test_prefix_cache_salt.py::"
    "test_a_tenants_own_salt_still_parts_its_requests_and_never_reaches_another[salted]"
)
MEDIA_UUID = (
    "tests/test_images.py::test_a_uuid_another_tenant_sent_first_does_not_replace_a_tenants_image"
)
_KV_TRANSFER = "tests/test_routing_data.py::test_kv_transfer_params_are_a_routers"
KV_TRANSFER_ENGINE = f"{_KV_TRANSFER}[routers-only-vllm-engine]"
KV_TRANSFER_INFERENCE = f"{_KV_TRANSFER}[routers-only-inference]"
KV_TRANSFER_COMPLETIONS = f"{_KV_TRANSFER}[routers-only-completions]"
KV_TRANSFER_CHAT = f"{_KV_TRANSFER}[routers-only-chat]"
EC_TRANSFER = "tests/test_routing_data.py::test_encoder_cache_transfer_params_are_a_routers_too"
KV_HINTS = "tests/test_routing_data.py::test_kv_hints_are_a_routers"
ADAPTER_RESOLVER = (
    "tests/test_runtime_lora_http.py::"
    "test_a_tenant_naming_an_unknown_model_makes_vllm_load_no_adapter"
)
RENDER_NO_STEP = "tests/test_render.py::test_rendering_runs_no_engine_step"
LOAD_REPORT_ERRORS = (
    "tests/test_load_report.py::"
    "test_engine_calls_ending_ok_carry_the_report_and_server_faults_count_as_errors"
)

# An admin's alone.
GRPC_ADMIN = (
    "tests/test_launcher_auth.py::test_inference_key_serves_but_neither_routes_nor_administers"
)
HTTP_ADMIN = (
    "tests/test_two_protocols.py::"
    "test_http_keys_are_the_grpc_verifier_with_admin_paths_for_admin_keys"
)
HTTP_LORA_ADMIN = (
    "tests/test_runtime_lora_http.py::test_an_inference_key_may_not_change_the_adapters_over_http"
)

# ----- cells many ways in share -----------------------------------------------------------

_ENGINE_SLOTS = Via(
    HALF_OPEN_GENERATES,
    "counted in flight as the engine calls (COUNTED_METHODS): the engine and call slots "
    "Generate's test takes back",
)
_CALL_SLOT = Via(
    HEADER_ONLY_CALLS, "a keyed call's slot, taken back once it waits on its client (every method)"
)
_WRITE_DEADLINE = Via(
    UNREAD_GENERATES, "the call slots' write deadline and reclaim, every keyed stream's"
)
_NO_INPUT = NotApplicable("a request without fields, an answer of fixed size")
_SERVERS_FACTS = NotApplicable("the server's model, configuration or load: every tenant's alike")
_CHANGES_NOTHING = NotApplicable("changes nothing another tenant's requests draw on")
_GRPC_ADMIN = Via(
    GRPC_ADMIN,
    "an admin's method (ADMIN_METHODS, proto/methods.py: one role rule): PERMISSION_DENIED "
    "for a tenant before its message is read",
)
_HTTP_ADMIN = Via(
    HTTP_ADMIN,
    "an admin's path (outside the front's inference paths): 403 for a tenant's key before "
    "its body is read",
)
_NO_ENGINE_REQUEST = NotApplicable("no engine request, no id: answers from what its caller sent")
_NO_ENGINE_STEP = NotApplicable("runs no engine step: touches no cache of the engine's")
_HTTP_BODY_BOUND = Via(
    HTTP_BODY,
    "the front's body bound (--max-message-bytes) and the tenant's share of the call slots; "
    "vLLM's own limits past them",
)
_HTTP_GENERATE_COST = Via(
    HTTP_STOP_CHAT,
    "GuardedEngine.generate, every HTTP generation's one point: stop strings, n, the "
    "constraint; the front: body size and request ids",
)
_HTTP_GENERATE_READ = Via(
    HTTP_ID,
    "GuardedEngine claims every HTTP engine request's id for its caller and salts its prompt "
    "for its tenant",
)
_HTTP_GENERATE_POISON = Via(
    KV_TRANSFER_CHAT,
    "GuardedEngine.generate: connector parameters a router's, a resolver's adapter an "
    "admin's, prompt and media uuids salted",
)
_HTTP_SALTED = Via(PREFIX_HTTP, "GuardedEngine.generate salts every HTTP prompt for its tenant")
_HTTP_ENCODE_READ = Via(
    HTTP_ID, "GuardedEngine.encode claims each engine request's id for its caller"
)
_HTTP_ENCODE_POISON = Via(PREFIX_HTTP, "GuardedEngine.encode salts each prompt for its tenant")
_DP_SOCKETS = Keyless(
    "no key nor encryption (vLLM's msgpack sockets): keep them on a network only the nodes reach"
)

# ----- the gaps ---------------------------------------------------------------------------

HTTP_UNREAD_ANSWER = (
    "tests/test_http_admission.py::"
    "test_an_answer_its_client_does_not_read_ends_and_gives_its_slots_back"
)
IDLE_WEBSOCKET = Gap("a deadline between messages: an idle realtime session keeps its call slot")
SHM_ANY_SEGMENT = "tests/test_mm_tensors.py::test_shared_memory_is_a_routers_with_keys"
HTTP_ABORT_ANY_ID = (
    "tests/test_http_admission.py::test_the_scale_out_abort_stops_only_the_callers_own_requests"
)
HTTP_ABORT_IDS = HTTP_ABORT_ANY_ID

# ----- the table --------------------------------------------------------------------------

ENGINE = "vllm.grpc.engine.VllmEngine"
INFERENCE = "vllm.Inference"
CONTROL = "vllm.Control"
POOLING = "vllm_servicer.v1.Pooling"
RENDER = "vllm_servicer.v1.Render"

HTTP_ADMIN_PATHS = (
    "GET /openapi.json",
    "GET /docs",
    "GET /docs/oauth2-redirect",
    "GET /redoc",
    "GET /kv_event_sources",
    "POST /start_profile",
    "POST /stop_profile",
    "POST /reset_prefix_cache",
    "POST /reset_mm_cache",
    "POST /reset_encoder_cache",
    "POST /collective_rpc",
    "GET /server_info",
    "POST /sleep",
    "POST /release_kv_cache_memory",
    "POST /wake_up",
    "GET /is_sleeping",
    "POST /pause",
    "POST /resume",
    "POST /abort_requests",
    "GET /is_paused",
    "POST /init_weight_transfer_engine",
    "POST /shutdown_weight_transfer_engine",
    "POST /start_weight_update",
    "POST /start_draft_weight_update",
    "POST /update_weights",
    "POST /finish_weight_update",
    "POST /update_weight_version",
    "GET /weight_info",
    "POST /weight_checker",
    "GET /get_world_size",
    "POST /generative_scoring",
    "POST /scale_elastic_ep",
    "POST /is_scaling_elastic_ep",
    "POST /fault_tolerance/apply",
    "GET /fault_tolerance/status",
    "POST /adapters",
    "DELETE /adapters/{adapter_name}",
)
"""vLLM's routes outside the front's inference paths (serve/http_front.py): an admin key's."""

WAYS_IN: tuple[WayIn, ...] = (
    # ----- VllmEngine
    WayIn(
        "VllmEngine",
        f"/{ENGINE}/Generate",
        hold=(HALF_OPEN_GENERATES, UNREAD_GENERATES),
        cost=(
            BUDGET_N,
            BUDGET_STOP_FLOOD,
            BUDGET_CONSTRAINT,
            BUDGET_IMAGE_BOMB,
            PROMPT_PAST_CONTEXT,
        ),
        read=(ID_TAKEN, PREFIX_ENGINE),
        poison=(PREFIX_ENGINE, KV_TRANSFER_ENGINE),
    ),
    WayIn(
        "VllmEngine",
        f"/{ENGINE}/Embed",
        hold=_ENGINE_SLOTS,
        cost=EMBED_PAST_CONTEXT,
        read=Via(ID_TAKEN, "the one id registry every engine call claims its id in"),
        poison=Via(PREFIX_ENGINE, "Embed's prompt salted for its tenant as Generate's"),
    ),
    WayIn(
        "VllmEngine",
        f"/{ENGINE}/GetModelInfo",
        hold=HEADER_ONLY_CALLS,
        cost=_NO_INPUT,
        read=_SERVERS_FACTS,
        poison=_CHANGES_NOTHING,
    ),
    *_ways(
        "VllmEngine",
        _rpcs(ENGINE, "HealthCheck", "GetServerInfo", "GetLoads"),
        hold=_CALL_SLOT,
        cost=_NO_INPUT,
        read=_SERVERS_FACTS,
        poison=_CHANGES_NOTHING,
    ),
    WayIn(
        "VllmEngine",
        f"/{ENGINE}/GetTokenizer",
        hold=_WRITE_DEADLINE,
        cost=NotApplicable("the served tokenizer's files, the same for every call"),
        read=NotApplicable("the served tokenizer's files, every tenant's alike"),
        poison=_CHANGES_NOTHING,
    ),
    *_ways(
        "VllmEngine",
        _rpcs(ENGINE, "FlushCache", "StartProfile", "StopProfile"),
        hold=GRPC_ADMIN,
        cost=GRPC_ADMIN,
        read=GRPC_ADMIN,
        poison=GRPC_ADMIN,
    ),
    WayIn(
        "VllmEngine",
        f"/{ENGINE}/Abort",
        hold=_CALL_SLOT,
        cost=BUDGET_ABORT_IDS,
        read=ABORT_OWN,
        poison=NotApplicable("stops requests, the caller's own: touches no cache"),
    ),
    WayIn(
        "VllmEngine",
        f"/{ENGINE}/SubscribeKvEvents",
        hold=KV_SUBSCRIBER_CAP,
        cost=KV_SLOW_SUBSCRIBER,
        read=KV_EVENTS_READ,
        poison=NotApplicable("a stream of events out: nothing in"),
    ),
    # ----- vllm.Inference
    WayIn(
        "vllm.Inference",
        f"/{INFERENCE}/Generate",
        hold=Via(HALF_OPEN_GENERATES, "the engine and call slots of the one stack, one share"),
        cost=(BUDGET_STOP_BOTH, BUDGET_CONSTRAINT, BUDGET_IMAGE_BOMB, BUDGET_CONTROL_CHARS),
        read=(INFERENCE_ID, PREFIX_INFERENCE),
        poison=(PREFIX_OWN_SALT, MEDIA_UUID, KV_TRANSFER_INFERENCE, EC_TRANSFER, KV_HINTS),
    ),
    WayIn(
        "vllm.Inference",
        f"/{INFERENCE}/GenerateStream",
        hold=Via(UNREAD_GENERATES, "the same write deadline and reclaim as VllmEngine's stream"),
        cost=(BUDGET_STOP_BOTH, BUDGET_CONSTRAINT),
        read=(INFERENCE_ID, PREFIX_INFERENCE_STREAM),
        poison=Via(
            PREFIX_OWN_SALT,
            "built as Generate's engine call: one salting, media uuid and routing-data path",
        ),
    ),
    # ----- vllm_servicer.v1.Pooling
    *_ways(
        "vllm_servicer.v1.Pooling",
        _rpcs(POOLING, "Classify", "Score", "Rerank"),
        hold=_ENGINE_SLOTS,
        cost=POOLING_BAD_INPUT,
        read=POOLING_ID,
        poison=Via(PREFIX_ENGINE, "vllm_app.py salts each pooling prompt as Generate's"),
    ),
    # ----- vllm_servicer.v1.Render
    WayIn(
        "vllm_servicer.v1.Render",
        f"/{RENDER}/RenderChat",
        hold=_ENGINE_SLOTS,
        cost=(RENDER_CHARS, RENDER_BAD_CHAT),
        read=_NO_ENGINE_REQUEST,
        poison=RENDER_NO_STEP,
    ),
    WayIn(
        "vllm_servicer.v1.Render",
        f"/{RENDER}/RenderCompletion",
        hold=_ENGINE_SLOTS,
        cost=RENDER_CHARS,
        read=_NO_ENGINE_REQUEST,
        poison=RENDER_NO_STEP,
    ),
    WayIn(
        "vllm_servicer.v1.Render derender",
        f"/{RENDER}/DerenderChat",
        hold=_ENGINE_SLOTS,
        cost=DERENDER_BAD_CHAT,
        read=_NO_ENGINE_REQUEST,
        poison=Via(RENDER_NO_STEP, "derendering runs no engine step either (frontend CPU)"),
    ),
    WayIn(
        "vllm_servicer.v1.Render derender",
        f"/{RENDER}/DerenderCompletion",
        hold=_ENGINE_SLOTS,
        cost=DERENDER_COMPLETION,
        read=_NO_ENGINE_REQUEST,
        poison=Via(RENDER_NO_STEP, "derendering runs no engine step either (frontend CPU)"),
    ),
    WayIn(
        "vllm_servicer.v1.Render derender",
        f"/{RENDER}/DerenderChatStream",
        hold=Via(STILL_DERENDER_STREAMS, "the completion stream's read deadline and reclaim"),
        cost=(DERENDER_CHAT_CHUNKS, DERENDER_CHAT_REPLAY),
        read=_NO_ENGINE_REQUEST,
        poison=Via(RENDER_NO_STEP, "derendering runs no engine step either (frontend CPU)"),
    ),
    WayIn(
        "vllm_servicer.v1.Render derender",
        f"/{RENDER}/DerenderCompletionStream",
        hold=STILL_DERENDER_STREAMS,
        cost=DERENDER_COMPLETION_STREAM,
        read=_NO_ENGINE_REQUEST,
        poison=Via(RENDER_NO_STEP, "derendering runs no engine step either (frontend CPU)"),
    ),
    # ----- vllm.Control
    *_ways(
        "vllm.Control",
        # Every engine-changing method, from the package's own role table: each
        # is refused to a tenant by the one role rule.
        tuple(sorted(m for m in ADMIN_METHODS if m.startswith(f"/{CONTROL}/"))),
        hold=_GRPC_ADMIN,
        cost=_GRPC_ADMIN,
        read=_GRPC_ADMIN,
        poison=_GRPC_ADMIN,
    ),
    *_ways(
        "vllm.Control",
        _rpcs(
            CONTROL,
            "GetServerInfo",
            "GetModelInfo",
            "ListLoras",
            "IsPaused",
            "IsSleeping",
            "GetWeightVersion",
        ),
        hold=_CALL_SLOT,
        cost=_NO_INPUT,
        read=_SERVERS_FACTS,
        poison=_CHANGES_NOTHING,
    ),
    WayIn(
        "vllm.Control",
        f"/{CONTROL}/Abort",
        hold=_CALL_SLOT,
        cost=BUDGET_ABORT_IDS,
        read=CONTROL_ABORT_OWN,
        poison=NotApplicable("stops requests, the caller's own: touches no cache"),
    ),
    WayIn(
        "vllm.Control",
        f"/{CONTROL}/GetKvEventSources",
        hold=_CALL_SLOT,
        cost=_NO_INPUT,
        read=KV_EVENTS_READ,
        poison=_CHANGES_NOTHING,
    ),
    # ----- health, reflection, load reports (main port, no key)
    WayIn(
        "health",
        "/grpc.health.v1.Health/Check",
        hold=Keyless(
            "keyless checks' slots, apart; one without its message yields", HEADER_ONLY_CHECKS
        ),
        cost=Keyless("no key: a compressed request refused at its headers", AUTH_FLOOD),
        read=NotApplicable("a serving status"),
        poison=_CHANGES_NOTHING,
    ),
    WayIn(
        "health",
        "/grpc.health.v1.Health/List",
        hold=Keyless(
            "a keyless call of one answer: the checks' slots, as Check", HEADER_ONLY_CHECKS
        ),
        cost=Keyless("no key: a compressed request refused at its headers", AUTH_FLOOD),
        read=NotApplicable("the served services' statuses"),
        poison=_CHANGES_NOTHING,
    ),
    WayIn(
        "health",
        "/grpc.health.v1.Health/Watch",
        hold=Keyless("the keyless stream cap, and each connection's share", KEYLESS_STREAMS),
        cost=Keyless("no key: a compressed request refused at its headers", AUTH_FLOOD),
        read=NotApplicable("a serving status"),
        poison=_CHANGES_NOTHING,
    ),
    WayIn(
        "reflection",
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        hold=Keyless("the keyless stream cap, and each connection's share", KEYLESS_STREAMS),
        cost=Keyless(
            "no key: compressed requests refused; each answer a descriptor lookup", AUTH_FLOOD
        ),
        read=REFLECTION_FILES,
        poison=_CHANGES_NOTHING,
    ),
    WayIn(
        "ORCA load reports",
        "/xds.service.orca.v3.OpenRcaService/StreamCoreMetrics",
        hold=Keyless("the keyless stream cap, refused past it", ORCA_KEYLESS),
        cost=Keyless(
            "a report a second per stream at most, built every 250 ms at most", ORCA_FLOOR
        ),
        read=NotApplicable("the engine's load, no tenant's requests"),
        poison=LOAD_REPORT_ERRORS,
    ),
    # ----- vLLM's HTTP API (--http-port)
    *_ways(
        "HTTP API",
        ("GET /health", "GET /ping", "POST /ping"),
        hold=Keyless(
            "probes take no call slot; their connection meets the header deadline", STALLED_HEADERS
        ),
        cost=Keyless("no key: the body is never read, the answer the engine's health"),
        read=NotApplicable("the engine's health"),
        poison=_CHANGES_NOTHING,
    ),
    *_ways(
        "HTTP API",
        ("GET /v1/models", "GET /version"),
        hold=Via(
            CONNECTION_CAP, "no call slot (fixed facts): its connection meets the cap and deadline"
        ),
        cost=NotApplicable("no body, a fixed answer"),
        read=NotApplicable("the served models and vLLM's version, every tenant's alike"),
        poison=_CHANGES_NOTHING,
    ),
    *_ways(
        "HTTP API",
        ("GET /metrics", "MOUNT /metrics"),
        hold=Via(
            CONNECTION_CAP, "a scrape takes no call slot, other methods one: connections capped"
        ),
        cost=Via(METRICS_KEY, "a key of any role; the page built once per scrape from no input"),
        read=NotApplicable("the whole server's series: no tenant's prompts, ids or outputs"),
        poison=_CHANGES_NOTHING,
    ),
    *_ways(
        "HTTP API",
        HTTP_ADMIN_PATHS,
        hold=_HTTP_ADMIN,
        cost=_HTTP_ADMIN,
        read=_HTTP_ADMIN,
        poison=_HTTP_ADMIN,
    ),
    *_ways(
        "HTTP API",
        ("POST /v1/load_lora_adapter", "POST /v1/unload_lora_adapter"),
        hold=HTTP_LORA_ADMIN,
        cost=HTTP_LORA_ADMIN,
        read=HTTP_LORA_ADMIN,
        poison=HTTP_LORA_ADMIN,
    ),
    WayIn(
        "HTTP API",
        "POST /v1/completions",
        hold=HTTP_UNREAD_ANSWER,
        cost=(HTTP_N, HTTP_STOP_COMPLETIONS, HTTP_CONSTRAINT, HTTP_BODY, HTTP_REQUEST_ID),
        read=(HTTP_ID, PREFIX_HTTP),
        poison=(PREFIX_HTTP, KV_TRANSFER_COMPLETIONS, ADAPTER_RESOLVER),
    ),
    WayIn(
        "HTTP API",
        "POST /v1/chat/completions",
        hold=HTTP_UNREAD_ANSWER,
        cost=(HTTP_STOP_CHAT, HTTP_REQUEST_ID),
        read=_HTTP_GENERATE_READ,
        poison=(KV_TRANSFER_CHAT, ADAPTER_RESOLVER, _HTTP_SALTED),
    ),
    WayIn(
        "HTTP API",
        "POST /v1/responses",
        hold=HTTP_UNREAD_ANSWER,
        cost=_HTTP_GENERATE_COST,
        read=(RESPONSES_STORE, _HTTP_GENERATE_READ),
        poison=_HTTP_GENERATE_POISON,
    ),
    *_ways(
        "HTTP API",
        (
            "POST /v1/chat/completions/batch",
            "POST /v1/messages",
            "POST /v1/systemone",
            "POST /invocations",
            "POST /inference/v1/generate",
            "POST /v1/audio/transcriptions",
            "POST /v1/audio/translations",
        ),
        hold=HTTP_UNREAD_ANSWER,
        cost=_HTTP_GENERATE_COST,
        read=_HTTP_GENERATE_READ,
        poison=_HTTP_GENERATE_POISON,
    ),
    WayIn(
        "HTTP API",
        "WS /v1/realtime",
        hold=IDLE_WEBSOCKET,
        cost=Via(HTTP_STOP_CHAT, "GuardedEngine.generate checks each generation's parameters"),
        read=_HTTP_GENERATE_READ,
        poison=_HTTP_GENERATE_POISON,
    ),
    *_ways(
        "HTTP API",
        ("GET /v1/responses/{response_id}", "POST /v1/responses/{response_id}/cancel"),
        hold=HTTP_UNREAD_ANSWER,
        cost=NotApplicable("names a stored response: no prompt, no engine work"),
        read=RESPONSES_STORE,
        poison=_CHANGES_NOTHING,
    ),
    *_ways(
        "HTTP API",
        ("POST /tokenize", "POST /detokenize"),
        hold=HTTP_UNREAD_ANSWER,
        cost=HTTP_TOKENIZE,
        read=_NO_ENGINE_REQUEST,
        poison=_NO_ENGINE_STEP,
    ),
    WayIn(
        "HTTP API",
        "POST /v1/messages/count_tokens",
        hold=Via(STALLED_BODIES, "the body's read deadline; a count is written at once"),
        cost=_HTTP_BODY_BOUND,
        read=_NO_ENGINE_REQUEST,
        poison=_NO_ENGINE_STEP,
    ),
    *_ways(
        "HTTP API",
        (
            "POST /v1/chat/completions/render",
            "POST /v1/messages/render",
            "POST /v1/completions/render",
            "POST /v1/responses/render",
            "POST /v1/chat/completions/derender",
            "POST /v1/completions/derender",
        ),
        hold=HTTP_UNREAD_ANSWER,
        cost=_HTTP_BODY_BOUND,
        read=_NO_ENGINE_REQUEST,
        poison=_NO_ENGINE_STEP,
    ),
    *_ways(
        "HTTP API",
        (
            "POST /pooling",
            "POST /classify",
            "POST /v1/embeddings",
            "POST /v2/embed",
            "POST /score",
            "POST /v1/score",
            "POST /rerank",
            "POST /v1/rerank",
            "POST /v2/rerank",
        ),
        hold=HTTP_UNREAD_ANSWER,
        cost=(HTTP_REQUEST_ID, _HTTP_BODY_BOUND),
        read=_HTTP_ENCODE_READ,
        poison=_HTTP_ENCODE_POISON,
    ),
    WayIn(
        "HTTP API",
        "GET /load",
        hold=Via(HTTP_SHARE, "a call slot of its tenant's share while its handler runs"),
        cost=NotApplicable("no body: the server's load"),
        read=NotApplicable("the server's load, every tenant's alike"),
        poison=_CHANGES_NOTHING,
    ),
    WayIn(
        "HTTP API",
        "POST /inference/v1/abort_requests",
        hold=Via(STALLED_BODIES, "the body's read deadline; the answer is empty"),
        cost=HTTP_ABORT_IDS,
        read=HTTP_ABORT_ANY_ID,
        poison=NotApplicable("stops requests: touches no cache"),
    ),
    # ----- ports and sockets besides
    WayIn(
        "probe port",
        "--health-port: grpc.health.v1.Health",
        hold=Keyless("16 Watch, 48 Check, 4 per connection", KEYLESS_STREAMS),
        cost=Keyless("plaintext, health only, 64 KiB messages", PROBE_PORT),
        read=NotApplicable("a serving status"),
        poison=_CHANGES_NOTHING,
    ),
    WayIn(
        "metrics",
        "--metrics-port: Prometheus page",
        hold=Keyless("no key: bound to --metrics-address (127.0.0.1 by default), for Prometheus"),
        cost=Keyless("no key: bound to --metrics-address (127.0.0.1 by default), for Prometheus"),
        read=NotApplicable("the whole server's series: no tenant's prompts, ids or outputs"),
        poison=_CHANGES_NOTHING,
    ),
    WayIn(
        "KV-event publisher",
        "vLLM's ZeroMQ KV-event socket",
        hold=NotApplicable("vLLM's own socket: no slot of the launcher's to hold"),
        cost=NotApplicable("vLLM's own socket: no request of the launcher's to cost"),
        read=Keyless(
            "no key: kept to routers by where it listens; warned past loopback",
            KV_PUBLISHER_WARNING,
        ),
        poison=NotApplicable("publishes events out: nothing in"),
    ),
    WayIn(
        "data-parallel sockets",
        "vLLM's data-parallel ZeroMQ sockets",
        hold=_DP_SOCKETS,
        cost=_DP_SOCKETS,
        read=_DP_SOCKETS,
        poison=_DP_SOCKETS,
    ),
    WayIn(
        "peers socket",
        "--api-server-count peers socket",
        hold=NotApplicable("the launcher's own frontend processes only (SO_PEERCRED)"),
        cost=NotApplicable("JSON between the launcher's own processes, never pickle"),
        read=PEERS_OTHER_USER,
        poison=PEERS_PLANTED,
    ),
    WayIn(
        "shared memory",
        "--enable-shm-tensors segments",
        hold=SHM_FIFO,
        cost=BUDGET_SHM,
        read=SHM_ANY_SEGMENT,
        poison=NotApplicable("read only: the server writes no segment"),
    ),
)
"""Every way in, one row each."""
