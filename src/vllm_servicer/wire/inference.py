"""vLLM's own `vllm.Inference` messages to vLLM's request objects.

The conversion follows what vLLM's Rust server does with the same schema:
an omitted `temperature` is greedy (0.0); 0 in any other numeric field means
unset, which takes the model's generation-config default where vLLM's server
takes one (top_p, top_k, min_p, repetition_penalty, max_new_tokens) and the
neutral value otherwise; `max_new_tokens` unset runs to the end of the context
unless the model's generation config bounds it. vLLM detokenizes and matches
stop strings itself (`RequestOutputKind.DELTA` when streaming), so each
message's text is vLLM's own delta.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

# Before vLLM is imported below: an untested vLLM release fails here, naming both versions.
from .. import _vllm_version  # noqa: F401

# isort: split
from vllm.inputs import TextPrompt, TokensPrompt
from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

from ..budgets import check_request_id
from ..errors import InvalidRequestError
from ..proto import inference_pb2 as pb
from .structured_outputs import (
    ConstraintFields,
    structured_output_arguments,
    structured_output_error,
    structured_output_size,
)

if TYPE_CHECKING:
    from google.protobuf import struct_pb2

# Integers a JSON number (a double) holds exactly: Struct numbers within it
# that are whole go to the connector as ints, as vLLM's Rust server sends them.
_MAX_SAFE_INTEGER = 2**53 - 1


class ModelDefaults(NamedTuple):
    """The model's generation-config sampling defaults that an unset field takes.

    The ones vLLM's Rust server takes from the model; None: the neutral value.
    """

    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    @classmethod
    def of(cls, diff: Mapping[str, Any]) -> ModelDefaults:
        """The defaults in vLLM's `ModelConfig.get_diff_sampling_param()` answer."""
        return cls(**{name: diff[name] for name in cls._fields if diff.get(name) is not None})


# An explicit `json_object: false` asks for no constraint, as in vLLM's Rust server.
CONSTRAINT = ConstraintFields("structured_output", "decoding", "json", True)


def prompt_from_request(
    request: pb.GenerateRequest, max_prompt_tokens: int | None
) -> TextPrompt | TokensPrompt:
    """The engine prompt: text (tokenized by vLLM, special tokens added) or token ids.

    Args:
        request: the request.
        max_prompt_tokens: refuse token prompts longer than this (the model's
            context) by their length, before a list of them is built; None
            when the engine cuts the prompt (truncation asked for) or no limit is known.

    Raises:
        InvalidRequestError: no prompt, an empty token prompt, or one too long.
    """
    kind = request.WhichOneof("prompt")
    prompt: TextPrompt | TokensPrompt
    if kind == "text":
        prompt = TextPrompt(prompt=request.text)
    elif kind == "token_ids":
        ids = request.token_ids.ids
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            raise InvalidRequestError(
                "token_ids.ids",
                f"prompt length {len(ids)} is longer than the maximum model length "
                f"{max_prompt_tokens}",
            )
        if not ids:
            raise InvalidRequestError("token_ids.ids", "the prompt is empty")
        prompt = TokensPrompt(prompt_token_ids=list(ids))
    else:
        raise InvalidRequestError("prompt", "prompt is required (text or token_ids)")
    if request.kv.cache_salt:
        prompt["cache_salt"] = request.kv.cache_salt
    return prompt


def check_client_ids(request: pb.GenerateRequest) -> None:
    """Refuse an id or key the client chooses that vLLM copies into the engine
    request, past the rule of request ids (`budgets.check_request_id`: at most
    1,024 characters, none a control character).

    vLLM copies the session id into the KV event of every block the request
    stores, and a router's cache salt and media uuids into their block keys
    (the events' `extra_keys`); the KV hints go to the engine as they are. The
    request id is checked when it is claimed.

    Raises:
        InvalidRequestError: naming the field.
    """
    if request.HasField("session_id"):
        check_request_id("session_id", request.session_id, "session id")
    if request.kv.cache_salt:
        check_request_id("kv.cache_salt", request.kv.cache_salt, "cache salt")
    for index, item in enumerate(request.media):
        if item.uuid:
            check_request_id(f"media[{index}].uuid", item.uuid, "media uuid")
    if request.HasField("kv_hints"):
        hints = request.kv_hints
        check_request_id("kv_hints.protocol_version", hints.protocol_version, "KV hint id")
        check_request_id("kv_hints.message_id", hints.message_id, "KV hint id")
        for index, action in enumerate(hints.actions):
            for name in ("action_id", "action_type", "action_version"):
                field = f"kv_hints.actions[{index}].{name}"
                check_request_id(field, getattr(action, name), "KV hint id")


def tokenization_kwargs(request: pb.GenerateRequest) -> dict[str, int] | None:
    """Prompt truncation (keep the last N tokens), when the request asks for it."""
    keep = request.truncate_prompt_tokens
    return {"truncate_prompt_tokens": keep} if keep else None


def _finite(name: str, value: float) -> float:
    if not math.isfinite(value):
        raise InvalidRequestError(name, f"must be finite, got {value}")
    return value


def _or_default(name: str, value: float, default: float | None, neutral: float) -> float:
    """`value` unless it is 0 (unset): then the model's default, else `neutral`."""
    if value != 0.0:
        return _finite(name, value)
    return neutral if default is None else default


def _sampling_knobs(
    sampling: pb.RandomSampling, defaults: ModelDefaults
) -> tuple[float, int, float]:
    """`(top_p, top_k, min_p)`: a present field is the client's, in range; an absent one
    the model's default, else the neutral value (`optional` in the released schema).

    Raises:
        InvalidRequestError: a present top_p outside (0, 1] or min_p outside [0, 1],
            worded as vLLM's Rust frontend words it.
    """
    if sampling.HasField("top_p"):
        top_p = sampling.top_p
        if not (0.0 < top_p <= 1.0):
            raise InvalidRequestError("sampling.top_p", f"top_p must be in (0, 1], got {top_p:g}")
    else:
        top_p = 1.0 if defaults.top_p is None else defaults.top_p
    if sampling.HasField("min_p"):
        min_p = sampling.min_p
        if not (0.0 <= min_p <= 1.0):
            raise InvalidRequestError("sampling.min_p", f"min_p must be in [0, 1], got {min_p:g}")
    else:
        min_p = 0.0 if defaults.min_p is None else defaults.min_p
    # 0 disables top-k, as in vLLM's SamplingParams.
    top_k = sampling.top_k if sampling.HasField("top_k") else (defaults.top_k or 0)
    return top_p, top_k, min_p


def bad_words(decoding: pb.DecodingParameters, vocab_size: int) -> list[list[int]] | None:
    """`decoding.bad_words_token_ids` as vLLM's tokenized bad words, checked.

    vLLM's sampler bans a sequence's last token whenever the tokens generated
    just before it are the rest of the sequence (a one-token sequence is banned
    outright): what vLLM's `bad_words` become once tokenized, given as ids.

    Raises:
        InvalidRequestError: an empty sequence, an id outside the vocabulary, more
            sequences or tokens than vLLM takes (VLLM_MAX_NUM_BAD_WORDS,
            VLLM_MAX_BAD_WORDS_TOTAL_TOKENS).
    """
    sequences = decoding.bad_words_token_ids
    if not sequences:
        return None
    limit = _max_bad_words()
    if len(sequences) > limit:
        raise InvalidRequestError(
            "decoding.bad_words_token_ids",
            f"{len(sequences)} sequences; vLLM takes at most {limit} (VLLM_MAX_NUM_BAD_WORDS)",
        )
    words: list[list[int]] = []
    for index, sequence in enumerate(sequences):
        ids = list(sequence.ids)
        if not ids:
            raise InvalidRequestError(
                f"decoding.bad_words_token_ids[{index}].ids", "each sequence must be nonempty"
            )
        for token_id in ids:
            if token_id >= vocab_size:
                raise InvalidRequestError(
                    f"decoding.bad_words_token_ids[{index}].ids",
                    f"token id {token_id} is outside the vocabulary (size {vocab_size})",
                )
        words.append(ids)
    total, most = sum(map(len, words)), _max_bad_words_tokens()
    if total > most:
        # vLLM's GPU model runner raises past it inside the engine, for every request there.
        raise InvalidRequestError(
            "decoding.bad_words_token_ids",
            f"{total} tokens in all; vLLM takes at most {most} (VLLM_MAX_BAD_WORDS_TOTAL_TOKENS)",
        )
    return words


def _max_bad_words() -> int:
    import vllm.envs

    return int(vllm.envs.VLLM_MAX_NUM_BAD_WORDS)


def _max_bad_words_tokens() -> int:
    import vllm.envs

    return int(getattr(vllm.envs, "VLLM_MAX_BAD_WORDS_TOTAL_TOKENS", 1024))


def thinking_budget(stopping: pb.StoppingCriteria) -> int | None:
    """`stopping.thinking_token_budget`: None when omitted or -1 (no budget).

    Raises:
        InvalidRequestError: below -1.
    """
    if not stopping.HasField("thinking_token_budget"):
        return None
    budget = stopping.thinking_token_budget
    if budget == -1:
        return None
    if budget < -1:
        raise InvalidRequestError(
            "stopping.thinking_token_budget", f"must be -1 (no budget) or at least 0, got {budget}"
        )
    return budget


def _structured_outputs(decoding: pb.DecodingParameters) -> StructuredOutputsParams | None:
    arguments = structured_output_arguments(decoding, CONSTRAINT)
    return None if arguments is None else StructuredOutputsParams(**arguments)


def constraint_size(decoding: pb.DecodingParameters) -> tuple[str, int] | None:
    """The request's structured-output field and its size in bytes, if it has one."""
    return structured_output_size(decoding, CONSTRAINT)


def _logit_bias(decoding: pb.DecodingParameters) -> dict[int, float] | None:
    bias = dict(decoding.logit_bias)
    for token_id, value in bias.items():
        _finite(f"decoding.logit_bias[{token_id}]", value)
    return bias or None


class CandidateSpec(NamedTuple):
    """What vLLM is asked for at each position: a top-k count, or chosen token ids.

    Attributes:
        logprobs: vLLM's `logprobs` / `prompt_logprobs` (0: the token itself only,
            -1: the whole vocabulary); None with `token_ids`.
        token_ids: vLLM's `logprob_token_ids`.
        ranked: whether vLLM ranks the candidates in the vocabulary (top_n
            only: the ranks it gives tokens chosen by id, or of the whole
            vocabulary, are positions in its own list).
    """

    logprobs: int | None
    token_ids: list[int] | None
    ranked: bool


_NO_CANDIDATES = CandidateSpec(0, None, False)


def candidate_spec(candidates: pb.CandidateTokens | None) -> CandidateSpec:
    """The vLLM logprob request for a CandidateTokens selector (None: none asked for).

    As vLLM's Rust server maps it: `top_n` k asks for the k most likely,
    `all` for the whole vocabulary, non-empty `token_ids` for those ids, and
    anything else for the token itself only.
    """
    kind = candidates.WhichOneof("select") if candidates is not None else None
    if candidates is None or kind is None:
        return _NO_CANDIDATES
    if kind == "top_n":
        return CandidateSpec(candidates.top_n, None, True)
    if kind == "all":
        return CandidateSpec(-1, None, False) if candidates.all else _NO_CANDIDATES
    ids = list(candidates.token_ids.ids)
    return CandidateSpec(None, ids, False) if ids else _NO_CANDIDATES


def output_candidates(response: pb.ResponseOptions) -> CandidateSpec | None:
    """The output logprobs asked for, or None when neither logprobs nor candidates are."""
    asked = response.HasField("output_candidates")
    if not (response.output_logprobs or asked):
        return None
    return candidate_spec(response.output_candidates if asked else None)


def prompt_candidates(response: pb.ResponseOptions) -> CandidateSpec | None:
    """The prompt logprobs asked for, or None when neither logprobs nor candidates are.

    Candidates by token id were refused already (`fields.REFUSED`).
    """
    asked = response.HasField("prompt_candidates")
    if not (response.prompt_logprobs or asked):
        return None
    return candidate_spec(response.prompt_candidates if asked else None)


def sampling_params_from_request(
    request: pb.GenerateRequest,
    *,
    stream: bool,
    defaults: ModelDefaults,
    extra_args: dict[str, Any] | None = None,
) -> SamplingParams:
    """vLLM SamplingParams for a `vllm.GenerateRequest`, with the protocol's defaults.

    Args:
        request: the request; its unconditionally refused fields were refused.
        stream: deltas (GenerateStream) or only the final output (Generate).
        defaults: the model's generation-config defaults for unset fields.
        extra_args: the connectors' transfer params (`kv_transfer_params`,
            `ec_transfer_params`), where vLLM's connectors read them.

    Raises:
        InvalidRequestError: more than one sequence, a non-finite number, an
            empty choice list.
    """
    sampling, decoding = request.sampling, request.decoding
    stopping, response = request.stopping, request.response
    if sampling.num_sequences > 1:
        raise InvalidRequestError(
            "sampling.num_sequences", "num_sequences > 1 is not supported; send one request each"
        )
    stop = list(stopping.stop_strings) or None
    output_text = response.output_text if response.HasField("output_text") else True
    out = output_candidates(response)
    prompt = prompt_candidates(response)
    top_p, top_k, min_p = _sampling_knobs(sampling, defaults)
    optional: dict[str, Any] = {}
    if request.HasField("watermarking"):
        optional["watermarking"] = request.watermarking  # unset: vLLM's default (on)
    budget = thinking_budget(stopping)
    if budget is not None:
        optional["thinking_token_budget"] = budget
    if out is not None and out.token_ids is not None:
        optional["logprob_token_ids"] = out.token_ids
    return SamplingParams(
        # Greedy when omitted, unlike HTTP's 1.0: the protocol's default.
        temperature=_finite("temperature", request.temperature)
        if request.HasField("temperature")
        else 0.0,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        seed=sampling.seed if sampling.HasField("seed") else None,
        presence_penalty=_finite("decoding.presence_penalty", decoding.presence_penalty),
        frequency_penalty=_finite("decoding.frequency_penalty", decoding.frequency_penalty),
        repetition_penalty=_or_default(
            "decoding.repetition_penalty",
            decoding.repetition_penalty,
            defaults.repetition_penalty,
            1.0,
        ),
        logit_bias=_logit_bias(decoding),
        allowed_token_ids=list(decoding.allowed_token_ids) or None,
        structured_outputs=_structured_outputs(decoding),
        # None: up to the end of the context (vLLM works it out per prompt).
        max_tokens=stopping.max_new_tokens or defaults.max_tokens,
        min_tokens=stopping.min_new_tokens,
        stop=stop,
        stop_token_ids=list(stopping.stop_token_ids) or None,
        include_stop_str_in_output=stopping.include_stop_strings,
        ignore_eos=stopping.ignore_eos,
        skip_special_tokens=response.skip_special_tokens
        if response.HasField("skip_special_tokens")
        else True,
        logprobs=out.logprobs if out is not None else None,
        prompt_logprobs=prompt.logprobs if prompt is not None else None,
        skip_reading_prefix_cache=True if request.kv.bypass_prefix_cache else None,
        extra_args=extra_args or None,
        # Text only when it is sent or stop strings need it: detokenizing costs.
        detokenize=output_text or stop is not None,
        output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        **optional,
    )


def constraint_error(exc: Exception, decoding: pb.DecodingParameters) -> Exception:
    """`exc` restated to name the structured-output field, when it is that field's fault."""
    kind = decoding.WhichOneof("structured_output")
    return structured_output_error(exc, f"decoding.{kind}" if kind else None)


def kv_hints(request: pb.GenerateRequest) -> Any:
    """`kv_hints` as vLLM's `KvHintsEnvelope` (None when the request has none)."""
    if not request.HasField("kv_hints"):
        return None
    from vllm.v1.kv_hints.protocol import KvHintAction, KvHintsEnvelope

    envelope = request.kv_hints
    return KvHintsEnvelope(
        protocol_version=envelope.protocol_version,
        message_id=envelope.message_id,
        actions=[
            KvHintAction(
                action_id=action.action_id,
                action_type=action.action_type,
                action_version=action.action_version,
                payload=struct_to_dict(action.payload),
            )
            for action in envelope.actions
        ],
    )


def reasoning_gate(request: pb.GenerateRequest) -> dict[str, Any]:
    """`engine_reasoning_gate` as `engine.generate`'s keyword arguments (none when unset).

    `reasoning_ended` omitted lets the engine's reasoning parser read the state
    off the prompt; `chat_template_kwargs` reach the parser as its kwargs.
    """
    if not request.HasField("engine_reasoning_gate"):
        return {}
    gate = request.engine_reasoning_gate
    kwargs: dict[str, Any] = {}
    if gate.HasField("reasoning_ended"):
        kwargs["reasoning_ended"] = gate.reasoning_ended
    if gate.HasField("chat_template_kwargs"):
        kwargs["reasoning_parser_kwargs"] = {
            "chat_template_kwargs": struct_to_dict(gate.chat_template_kwargs)
        }
    return kwargs


# ----- Struct -> dict (the connectors' transfer params) --------------------------------


def _plain(value: struct_pb2.Value) -> Any:
    kind = value.WhichOneof("kind")
    if kind == "number_value":
        number = value.number_value
        if number.is_integer() and abs(number) <= _MAX_SAFE_INTEGER:
            return int(number)
        return number
    if kind == "string_value":
        return value.string_value
    if kind == "bool_value":
        return value.bool_value
    if kind == "struct_value":
        return struct_to_dict(value.struct_value)
    if kind == "list_value":
        return [_plain(item) for item in value.list_value.values]
    return None


def struct_to_dict(struct: struct_pb2.Struct) -> dict[str, Any]:
    """A Struct as a plain dict; whole numbers as ints (JSON has one number type)."""
    return {key: _plain(value) for key, value in struct.fields.items()}
