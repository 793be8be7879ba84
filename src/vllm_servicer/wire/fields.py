"""What this server does with every request field: honoured, or refused with a code.

A field the server cannot serve is refused with a typed status that names it
and says what would serve it, so a client never gets a plausible answer that
left part of its request out. This module is the one list, by service (full
name) then method: the servicers refuse the unconditional rows through
`refuse_unserved`, docs/protocol.md shows the same tables, and a test walks
each protocol's descriptors so that a field in neither `HONOURED` nor
`REFUSED` fails the build.

Paths are dotted from the RPC's request message, without indexes through
repeated fields (`media.url` is every item's `url`). A message field that is
honoured has its own fields listed too; a refused one does not (nothing in it
is read). Map fields are listed whole.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from google.protobuf.message import Message

from ..errors import (
    FieldError,
    FieldOutOfRangeError,
    InvalidRequestError,
    UnimplementedFieldError,
    UnsupportedError,
)
from ..proto import (
    CONTROL_SERVICE,
    INFERENCE_SERVICE,
    POOLING_SERVICE,
    RENDER_SERVICE,
    VLLM_ENGINE_SERVICE,
    VLLM_PROTO_VERSION,
    VLLM_SCHEMA_RELEASE,
)


class RefusedField(NamedTuple):
    """How a field is refused.

    Attributes:
        error: what a request that uses it raises; its status (`status_code`)
            is the one the client gets.
        when: "" when it is refused whenever set; otherwise the condition
            (checked where the field is read, not by `refuse_unserved`).
        reason: what the client is told after the field's name.
    """

    error: type[FieldError]
    when: str
    reason: str


_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "max_tokens",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "ignore_eos",
    "n",
    "logprobs",
    "prompt_logprobs",
    "seed",
    "include_stop_str_in_output",
    "logit_bias",
    "truncate_prompt_tokens",
    # vLLM starts a grammar at the first token unless a reasoning parser holds
    # it back; when set, the request tells the engine its reasoning has ended.
    "grammar_from_first_token",
    "json_schema",
    "regex",
    "grammar",
    "structural_tag",
    "json_object",
    "choice",
    "choice.choices",
)

# A preprocessed multimodal batch (multimodal/tensors.py). `mm_hashes` is checked
# against the items, and the engine's cache key computed from the tensors
# themselves. Shared memory is refused unless switched on (see REFUSED).
_TENSOR = ("shape", "dtype", "inline")
_MULTIMODAL = (
    "pixel_values",
    *(f"pixel_values.{name}" for name in _TENSOR),
    "model_specific_tensors",
    "im_token_id",
    "mm_placeholders",
    "mm_placeholders.offset",
    "mm_placeholders.length",
    "mm_hashes",
    "batched_keys",
    "flat_keys",
    "keep_on_cpu_keys",
    "modality",
    "encoder_input_key",
)

_ENGINE_HONOURED: Mapping[str, frozenset[str]] = {
    "Generate": frozenset(
        (
            "request_id",
            "tokenized",
            "tokenized.original_text",
            "tokenized.input_ids",
            "text",
            "sampling_params",
            "stream",
            "data_parallel_rank",
            *(f"sampling_params.{name}" for name in _SAMPLING),
            "mm_inputs",
            "extra_mm_inputs",
            *(f"mm_inputs.{name}" for name in _MULTIMODAL),
            *(f"extra_mm_inputs.{name}" for name in _MULTIMODAL),
        )
    ),
    "Embed": frozenset(
        ("request_id", "tokenized", "tokenized.original_text", "tokenized.input_ids")
    ),
    "HealthCheck": frozenset(),
    "FlushCache": frozenset(("timeout_s",)),
    "StartProfile": frozenset(("start_step", "num_steps")),
    "StopProfile": frozenset(),
    "Abort": frozenset(("request_ids",)),
    "GetModelInfo": frozenset(),
    "GetServerInfo": frozenset(),
    # `include`: the sections this protocol's clients name (load_sections).
    "GetLoads": frozenset(("dp_rank", "include")),
    "GetTokenizer": frozenset(),
    # A subscriber's statement that it can take load records first; this
    # server sends none, so there is nothing to put before the first batch.
    "SubscribeKvEvents": frozenset(("load_records_before_first_batch",)),
}

KV_CONNECTOR_HINT = (
    "the engine has no KV connector for prefill/decode hand-off; start vLLM with "
    '--kv-transfer-config (e.g. \'{"kv_connector": "NixlConnector", "kv_role": "kv_both"}\')'
)
SHM_TENSORS_HINT = (
    "tensors in shared memory are off on this server; send them inline, or start it with "
    "--enable-shm-tensors (MountOptions.of(shm_tensors=True)) where every caller may read "
    "this host's shared memory"
)
REMOTE_TENSOR_HINT = (
    "remote tensor transports are not served; send the tensor inline or, on the same host, "
    "through shared memory (shm)"
)
# Checked where the tensors are read: a tensor may also sit in a
# model_specific_tensors value, and the message names the one at fault.
_ANY_TENSOR = "set on any tensor of the batch (model_specific_tensors values too)"
MEDIA_REFS_HINT = (
    "this server does not resolve media references; serve a model that takes images and "
    "start the server with --enable-media-refs (MountOptions.of(media_refs=MediaRefOptions()))"
)
_AT_START = "set when the engine starts (--profiler-config), not per request"
_BEFORE_033 = "on vLLM before 0.33"
_AT_START_BEFORE_033 = (
    "set when the engine starts (--profiler-config) on this vLLM; vLLM 0.33 and later "
    "take it per session"
)
LOAD_SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues", "all")
"""The sections a GetLoads `include` may name: those the protocol's clients ask for
(the SMG gateway polls with "core", "disagg", "queues" and "memory"). This
schema's `SchedulerLoad` carries the core figures only, so every answer is the
core section, the others absent, as vLLM's and SGLang's servers answer."""

_ENGINE_REFUSED: Mapping[str, Mapping[str, RefusedField]] = {
    "Generate": {
        "mm_inputs.pixel_values.remote": RefusedField(
            UnimplementedFieldError, _ANY_TENSOR, REMOTE_TENSOR_HINT
        ),
        "extra_mm_inputs.pixel_values.remote": RefusedField(
            UnimplementedFieldError, _ANY_TENSOR, REMOTE_TENSOR_HINT
        ),
        # Honoured when on (multimodal/tensor_payloads.py): the segment is read and copied,
        # never unlinked (its owner_id does that).
        "mm_inputs.pixel_values.shm": RefusedField(
            UnsupportedError,
            "shared-memory tensors are off; " + _ANY_TENSOR,
            SHM_TENSORS_HINT,
        ),
        "extra_mm_inputs.pixel_values.shm": RefusedField(
            UnsupportedError,
            "shared-memory tensors are off; " + _ANY_TENSOR,
            SHM_TENSORS_HINT,
        ),
        # Honoured when on (media.py): images by URL, decoded here.
        "media_refs": RefusedField(
            UnimplementedFieldError,
            "media references are off, or the model takes no images",
            MEDIA_REFS_HINT,
        ),
        "kv_transfer_params": RefusedField(
            UnsupportedError, "the engine has no KV connector", KV_CONNECTOR_HINT
        ),
        "kv_transfer_params_json": RefusedField(
            UnsupportedError, "the engine has no KV connector", KV_CONNECTOR_HINT
        ),
    },
    "StartProfile": {
        "output_dir": RefusedField(InvalidRequestError, "", _AT_START),
        "activities": RefusedField(InvalidRequestError, "", _AT_START),
        # Taken per session from vLLM 0.33 (its profiler_kwargs); before, at start only.
        "with_stack": RefusedField(InvalidRequestError, _BEFORE_033, _AT_START_BEFORE_033),
        "record_shapes": RefusedField(InvalidRequestError, _BEFORE_033, _AT_START_BEFORE_033),
        "profile_by_stage": RefusedField(
            InvalidRequestError, "", "not supported by vLLM's profiler"
        ),
    },
    "SubscribeKvEvents": {
        # Honoured where the engine keeps a replay buffer (kv_events.py).
        "start_sequence_number": RefusedField(
            FieldOutOfRangeError,
            "the engine keeps no replay buffer, publishes from several ranks, or no longer "
            "keeps the batch asked for",
            "subscribe from 0 (the current state) and resynchronise; a resume needs "
            "replay_endpoint in --kv-events-config",
        ),
    },
}


# ----- vllm.Inference (GenerateRequest, the same for Generate and GenerateStream) -------

EC_CONNECTOR_HINT = (
    "the engine has no encoder-cache connector for encoder/prefill/decode hand-off; start "
    "vLLM with --ec-transfer-config"
)
INFERENCE_MEDIA_HINT = (
    "this server does not resolve media; serve a model that takes images and start the "
    "server with --enable-media-refs (MountOptions.of(media_refs=MediaRefOptions()))"
)
THINKING_BUDGET_HINT = (
    "a thinking budget needs the engine's reasoning parser to tell thinking from the "
    "answer; start vLLM with --reasoning-parser (a reasoning model's, e.g. deepseek_r1)"
)
_CANDIDATES = ("top_n", "all")

_INFERENCE_REQUEST = frozenset(
    (
        "request_id",
        # A name other than the served model's: NOT_FOUND (the model is not here).
        "model",
        "text",
        "token_ids",
        "token_ids.ids",
        "temperature",
        "sampling",
        "sampling.top_k",
        "sampling.top_p",
        "sampling.min_p",
        "sampling.seed",
        "decoding",
        "decoding.presence_penalty",
        "decoding.frequency_penalty",
        "decoding.repetition_penalty",
        "decoding.logit_bias",
        "decoding.allowed_token_ids",
        "decoding.json",
        "decoding.regex",
        "decoding.choice",
        "decoding.choice.choices",
        "decoding.grammar",
        "decoding.json_object",
        "decoding.structural_tag",
        # vLLM's tokenized bad words (`SamplingParams._bad_words_token_ids`).
        "decoding.bad_words_token_ids",
        "decoding.bad_words_token_ids.ids",
        "stopping",
        "stopping.max_new_tokens",
        "stopping.min_new_tokens",
        "stopping.stop_token_ids",
        "stopping.stop_strings",
        "stopping.include_stop_strings",
        "stopping.ignore_eos",
        "response",
        "response.prompt_token_ids",
        "response.prompt_logprobs",
        "response.prompt_candidates",
        *(f"response.prompt_candidates.{name}" for name in _CANDIDATES),
        "response.output_text",
        "response.output_token_ids",
        "response.output_logprobs",
        "response.output_candidates",
        *(f"response.output_candidates.{name}" for name in _CANDIDATES),
        "response.output_candidates.token_ids",
        "response.output_candidates.token_ids.ids",
        "response.skip_special_tokens",
        "kv",
        "kv.bypass_prefix_cache",
        "kv.cache_salt",
        "truncate_prompt_tokens",
        "priority",
        "session_id",
        "media",
        "media.mime_type",
        "media.uuid",
        "watermarking",
        # Onto `engine.generate` where the installed vLLM takes them
        # (vllm_releases.GENERATE_TAKES_*); refused naming them where it does not.
        "engine_reasoning_gate",
        "engine_reasoning_gate.reasoning_ended",
        "engine_reasoning_gate.chat_template_kwargs",
        "engine_reasoning_gate.chat_template_kwargs.fields",
        "kv_hints",
        "kv_hints.protocol_version",
        "kv_hints.message_id",
        "kv_hints.actions",
        "kv_hints.actions.action_id",
        "kv_hints.actions.action_type",
        "kv_hints.actions.action_version",
        "kv_hints.actions.payload",
        "kv_hints.actions.payload.fields",
    )
)

_INFERENCE_REFUSED: Mapping[str, RefusedField] = {
    # Honoured (vLLM's SamplingParams.thinking_token_budget) when the engine runs one.
    "stopping.thinking_token_budget": RefusedField(
        UnsupportedError, "the engine runs no reasoning parser", THINKING_BUDGET_HINT
    ),
    "sampling.num_sequences": RefusedField(
        InvalidRequestError,
        "above 1",
        "num_sequences > 1 is not supported; send one request per sequence",
    ),
    "response.prompt_candidates.token_ids": RefusedField(
        UnimplementedFieldError,
        "",
        "vLLM scores chosen prompt tokens only with its V2 model runner; ask for top_n or all",
    ),
    "kv.kv_transfer_params": RefusedField(
        UnsupportedError, "the engine has no KV connector", KV_CONNECTOR_HINT
    ),
    "kv.ec_transfer_params": RefusedField(
        UnsupportedError, "the engine has no encoder-cache connector", EC_CONNECTOR_HINT
    ),
    # Resolved through the mount's adapter registry (vllm.Control loads into
    # it, and lora_modules); an unknown name is NOT_FOUND.
    "lora_name": RefusedField(
        UnsupportedError,
        "the engine runs without LoRA",
        "LoRA adapters are not enabled on this server: start the engine with --enable-lora "
        "and load adapters with --lora-modules or vllm.Control's LoadLora; an empty "
        "lora_name is the base model",
    ),
    # Honoured when on (multimodal/inference_media.py): images, decoded here.
    "media.url": RefusedField(
        UnimplementedFieldError,
        "media references are off, or the model takes no images",
        INFERENCE_MEDIA_HINT,
    ),
    "media.data_uri": RefusedField(
        UnimplementedFieldError,
        "media references are off, or the model takes no images",
        INFERENCE_MEDIA_HINT,
    ),
    "media.modality": RefusedField(
        UnimplementedFieldError, "VIDEO or AUDIO (IMAGE is served)", "this server takes images only"
    ),
    "media.raw_bytes": RefusedField(
        UnimplementedFieldError,
        "",
        "raw bytes are not decoded by this server; send the image as a base64 data_uri",
    ),
    "media.features": RefusedField(
        UnimplementedFieldError,
        "",
        "preprocessed media features are not served; send the image itself as url or data_uri",
    ),
}

# vllm_servicer.v1.Pooling and Render (wire/pooling.py, wire/render.py and wire/derender.py read
# each of these):
# a model name that is neither the served one nor a LoRA adapter's is NOT_FOUND,
# a truncation past the context or texts past --max-pooling-inputs
# INVALID_ARGUMENT, naming the field.
_POOLING_OPTIONS = frozenset(
    {"options", "options.truncate_prompt_tokens", "options.model", "options.priority"}
)
_POOLING_HONOURED = {
    "Classify": frozenset({"request_id", "input"}) | _POOLING_OPTIONS,
    "Score": frozenset({"request_id", "text_1", "text_2"}) | _POOLING_OPTIONS,
    "Rerank": frozenset({"request_id", "query", "documents", "top_n", "return_documents"})
    | _POOLING_OPTIONS,
}
_RENDER_HONOURED = {
    "RenderChat": frozenset(
        {
            "messages",
            "messages.role",
            "messages.content",
            "messages.parts",
            "messages.parts.text",
            "messages.name",
            "messages.tool_calls",
            "messages.tool_calls.id",
            "messages.tool_calls.name",
            "messages.tool_calls.arguments",
            "messages.tool_call_id",
            "tools",
            "tools.name",
            "tools.description",
            "tools.parameters",
            "add_generation_prompt",
            "continue_final_message",
            "chat_template_kwargs",
            "chat_template_kwargs.fields",
            "model",
            "truncate_prompt_tokens",
        }
    ),
    "RenderCompletion": frozenset(
        {"prompt", "add_special_tokens", "model", "truncate_prompt_tokens"}
    ),
}
# A generated sequence, as the derenders take it (wire/derender.py).
_GENERATED = (
    "index",
    "token_ids",
    "finish_reason",
    "stop_string",
    "stop_token_id",
    "logprobs",
    "logprobs.token_id",
    "logprobs.logprob",
    "logprobs.top_logprobs",
    "logprobs.top_logprobs.token_id",
    "logprobs.top_logprobs.logprob",
)
_RENDER_HONOURED["DerenderChat"] = frozenset(
    {
        "chat",
        # The chat is the parsers' context, never rendered again: an image in it
        # is neither fetched nor decoded.
        "chat.messages.parts.image_url",
        *(f"chat.{name}" for name in _RENDER_HONOURED["RenderChat"]),
        "tool_choice",
        "prompt_token_ids",
        "choices",
        *(f"choices.{name}" for name in _GENERATED),
    }
)
_RENDER_HONOURED["DerenderChatStream"] = frozenset(
    {
        "start",
        "start.chat",
        "start.chat.messages.parts.image_url",
        *(f"start.chat.{name}" for name in _RENDER_HONOURED["RenderChat"]),
        "start.tool_choice",
        "start.prompt_token_ids",
        "chunk",
        *(f"chunk.{name}" for name in _GENERATED),
    }
)
_RENDER_HONOURED["DerenderCompletionStream"] = frozenset(
    {
        "start",
        "start.model",
        "start.prompt_token_ids",
        "chunk",
        *(f"chunk.{name}" for name in _GENERATED),
    }
)
_RENDER_HONOURED["DerenderCompletion"] = frozenset(
    {
        "prompts",
        "prompts.prompt_token_ids",
        "prompts.choices",
        *(f"prompts.choices.{name}" for name in _GENERATED),
        "model",
    }
)
_RENDER_REFUSED = {
    "RenderChat": {
        # Honoured as a data: URL (counted against the media budgets from its header).
        "messages.parts.image_url": RefusedField(
            UnimplementedFieldError,
            "a URL other than data:",
            "Render takes images inline (data: URLs) only; it fetches nothing",
        ),
    },
}

HONOURED: Mapping[str, Mapping[str, frozenset[str]]] = {
    VLLM_ENGINE_SERVICE: _ENGINE_HONOURED,
    INFERENCE_SERVICE: {"Generate": _INFERENCE_REQUEST, "GenerateStream": _INFERENCE_REQUEST},
    POOLING_SERVICE: _POOLING_HONOURED,
    RENDER_SERVICE: _RENDER_HONOURED,
}
"""The fields each method honours, by service full name, then method name."""

REFUSED: Mapping[str, Mapping[str, Mapping[str, RefusedField]]] = {
    VLLM_ENGINE_SERVICE: _ENGINE_REFUSED,
    INFERENCE_SERVICE: {"Generate": _INFERENCE_REFUSED, "GenerateStream": _INFERENCE_REFUSED},
    RENDER_SERVICE: _RENDER_REFUSED,
}
"""The fields each method refuses and how, by service full name, then method name."""


def first_set(message: Message, path: str) -> str | None:
    """Where the request first sets the field at `path`, indexed through repeated
    fields (`media[1].raw_bytes`); None when it does not set it anywhere.

    Set means present, non-empty or non-zero.
    """
    return _first_set(message, path.split("."), "")


def _first_set(message: Message, parts: list[str], prefix: str) -> str | None:
    name, rest = parts[0], parts[1:]
    if not rest:
        return prefix + name if _sets(message, name) else None
    if message.DESCRIPTOR.fields_by_name[name].is_repeated:
        for index, item in enumerate(getattr(message, name)):
            found = _first_set(item, rest, f"{prefix}{name}[{index}].")
            if found is not None:
                return found
        return None
    if not message.HasField(name):
        return None
    return _first_set(getattr(message, name), rest, f"{prefix}{name}.")


def _sets(message: Message, name: str) -> bool:
    field = message.DESCRIPTOR.fields_by_name[name]
    if field.is_repeated:
        return len(getattr(message, name)) > 0
    if field.has_presence:
        return message.HasField(name)
    return bool(getattr(message, name) != field.default_value)


def is_set(message: Message, path: str) -> bool:
    """Whether the request sets the field at `path` (in any item of a repeated parent)."""
    return first_set(message, path) is not None


def refuse_unserved(service: str, method: str, request: Message) -> None:
    """Raise for the first field of `request` that the method refuses whenever it is set.

    Args:
        service: the service's full name (`VLLM_ENGINE_SERVICE`, `INFERENCE_SERVICE`).
        method: the method's name.
        request: its request.

    Raises:
        UnimplementedFieldError, FieldOutOfRangeError, InvalidRequestError: the
            row's error; the message names the field (and the item of a
            repeated one) and what would serve it.
    """
    for path, refusal in REFUSED.get(service, {}).get(method, {}).items():
        if not refusal.when:
            found = first_set(request, path)
            if found is not None:
                raise _raised(refusal, found)


def _raised(refusal: RefusedField, path: str) -> FieldError:
    # By name: UnsupportedError takes its (optional) field second.
    return refusal.error(field=path, reason=refusal.reason)


def load_sections(include: list[str]) -> None:
    """Check GetLoads' `include`: each a section of LOAD_SECTIONS.

    Raises:
        InvalidRequestError: a name no client of the protocol uses (a typo).
    """
    for section in include:
        if section not in LOAD_SECTIONS:
            raise InvalidRequestError(
                "include", f"no section {section!r}; the sections are " + ", ".join(LOAD_SECTIONS)
            )


# ----- fields the schema does not know ----------------------------------------------------

SCHEMA_VERSIONS: Mapping[str, str] = {
    INFERENCE_SERVICE: VLLM_PROTO_VERSION,
    CONTROL_SERVICE: VLLM_PROTO_VERSION,
}
"""The services whose requests may carry no field their schema lacks, with the schema's
version as `ServerInfo.proto_version` states it (vLLM's `vllm-proto` crate's).

protobuf keeps a field it does not know on the parsed message and the server
would go on without it; a client built from a newer schema (a router upgraded
before its servers) must learn that its bad words or thinking budget were not
applied, so such a request is refused instead."""


class UnknownFieldParser:
    """A request deserializer that refuses a message carrying a field its schema lacks.

    Args:
        parse: the message class's `FromString`.
        service: the service's full name (a key of `SCHEMA_VERSIONS`).

    The check costs a message without unknown fields one `DiscardUnknownFields`
    and one `ByteSize` (both in protobuf's C code): a canonical encoding's size
    is its length, and only a message whose size moved is parsed again and
    walked to find the field (a non-canonical encoding, an explicit zero say,
    is walked too and passes).
    """

    __slots__ = ("__self__", "_parse", "_service")

    def __init__(self, parse: Callable[[bytes], Message], service: str) -> None:
        self._parse = parse
        self._service = service
        # What the call wrapper reads to name the message when it does not parse.
        self.__self__ = getattr(parse, "__self__", None)

    def __call__(self, data: bytes) -> Message:
        """The parsed request.

        Raises:
            InvalidRequestError: it carries a field number its schema lacks.
        """
        message = self._parse(data)
        message.DiscardUnknownFields()
        if message.ByteSize() != len(data):
            found = _unknown_field(self._parse(data), "")
            if found is not None:
                path, number = found
                raise InvalidRequestError(
                    path or "request",
                    f"field number {number} is not in "
                    f"{_where(message, path) if path else message.DESCRIPTOR.full_name} of the "
                    f"schema this server speaks ({self._service} as vLLM "
                    f"{VLLM_SCHEMA_RELEASE} ships it, proto_version "
                    f'"{SCHEMA_VERSIONS[self._service]}"); refused rather than left out',
                )
        return message


def _where(message: Message, path: str) -> str:
    """The full name of the message at dotted `path` (indexes allowed) inside `message`."""
    descriptor: Any = message.DESCRIPTOR
    for part in path.split("."):
        descriptor = descriptor.fields_by_name[part.split("[")[0]].message_type
    return str(descriptor.full_name)


def _unknown_field(message: Message, prefix: str) -> tuple[str, int] | None:
    """Where the first unknown field of `message` is: (the path of the message that
    holds it, its number); None when there is none."""
    from google.protobuf import unknown_fields

    unknown = unknown_fields.UnknownFieldSet(message)
    if len(unknown):
        return prefix.rstrip("."), unknown[0].field_number
    for descriptor, value in message.ListFields():
        if descriptor.message_type is None or descriptor.message_type.GetOptions().map_entry:
            continue
        if descriptor.is_repeated:
            for index, item in enumerate(value):
                found = _unknown_field(item, f"{prefix}{descriptor.name}[{index}].")
                if found is not None:
                    return found
        else:
            found = _unknown_field(value, f"{prefix}{descriptor.name}.")
            if found is not None:
                return found
    return None
