"""VllmEngine's wire messages to vLLM's request objects, and its outputs back.

This module is on the hot path of every token: response builders do only the
work a message needs (no logprob conversion unless logprobs were asked for,
no empty sub-messages).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from typing import TYPE_CHECKING, Any

# Before vLLM is imported below: an untested vLLM release fails here, naming both versions.
from .. import _vllm_version  # noqa: F401

# isort: split
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

from ..budgets import check_request_id
from ..errors import InvalidRequestError
from ..proto import vllm_engine_pb2 as pb
from .structured_outputs import (
    ConstraintFields,
    structured_output_arguments,
    structured_output_error,
    structured_output_size,
)

if TYPE_CHECKING:
    from vllm.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger("vllm_servicer")

GenerateResponse = pb.GenerateResponse
GenerateComplete = pb.GenerateComplete


# The reference schema's spelling; `json_object` handed on as sent.
CONSTRAINT = ConstraintFields("constraint", "sampling_params", "json_schema", False)


def prompt_from_request(
    request: pb.GenerateRequest | pb.EmbedRequest, max_prompt_tokens: int | None = None
) -> Any:
    """The engine prompt for a request: token ids (the main path) or text.

    Args:
        request: the Generate or Embed request.
        max_prompt_tokens: refuse token prompts longer than this (the model's
            context) by their length, before a list of them is built.
    """
    kind = request.WhichOneof("input") if isinstance(request, pb.GenerateRequest) else "tokenized"
    if kind == "tokenized":
        count = len(request.tokenized.input_ids)
        if max_prompt_tokens is not None and count > max_prompt_tokens:
            raise InvalidRequestError(
                "tokenized.input_ids",
                f"prompt length {count} is longer than the maximum model length "
                f"{max_prompt_tokens}",
            )
        ids = list(request.tokenized.input_ids)
        if not ids:
            raise InvalidRequestError("tokenized.input_ids", "the prompt is empty")
        prompt = TokensPrompt(prompt_token_ids=ids)
        if request.tokenized.original_text:
            prompt["prompt"] = request.tokenized.original_text
        return prompt
    if kind == "text":
        if not request.text:  # type: ignore[union-attr]
            raise InvalidRequestError("text", "the prompt is empty")
        return request.text  # type: ignore[union-attr]
    raise InvalidRequestError("input", "set either `tokenized` or `text`")


def _structured_outputs(params: pb.SamplingParams) -> StructuredOutputsParams | None:
    arguments = structured_output_arguments(params, CONSTRAINT)
    return None if arguments is None else StructuredOutputsParams(**arguments)


def constraint_size(params: pb.SamplingParams) -> tuple[str, int] | None:
    """The request's structured-output constraint field and its size in bytes, if it has one."""
    return structured_output_size(params, CONSTRAINT)


def _finite(name: str, value: float) -> float:
    if not math.isfinite(value):
        raise InvalidRequestError(f"sampling_params.{name}", f"must be finite, got {value}")
    return value


def kv_transfer_params(request: pb.GenerateRequest) -> dict[str, Any] | None:
    """The KV-connector params a request hands the engine (prefill/decode), or None.

    `kv_transfer_params_json` is the connector's own object, passed on as it
    is; the typed `kv_transfer_params` (the older form) adds its
    remote_host/remote_port. Routers may send both, so both are read, and a
    host or port they disagree on is refused rather than one silently winning.

    Raises:
        InvalidRequestError: the JSON is not an object, or the typed params
            are incomplete, contradict it or name a host no host has (past
            the request-id rule).
    """
    params: dict[str, Any] | None = None
    if request.HasField("kv_transfer_params_json"):
        try:
            loaded = json.loads(request.kv_transfer_params_json)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError("kv_transfer_params_json", f"not valid JSON: {exc}") from None
        if not isinstance(loaded, dict):
            raise InvalidRequestError("kv_transfer_params_json", "must be a JSON object")
        params = loaded
    if request.HasField("kv_transfer_params"):
        typed = request.kv_transfer_params
        if not typed.remote_host or not 1 <= typed.remote_port <= 65535:
            raise InvalidRequestError(
                "kv_transfer_params",
                "remote_host must be set and remote_port must be in [1, 65535]",
            )
        # Copied into the engine request for its KV connector, as an id is.
        check_request_id("kv_transfer_params.remote_host", typed.remote_host, "host name")
        given: dict[str, Any] = {"remote_host": typed.remote_host, "remote_port": typed.remote_port}
        for key, value in given.items():
            if params is not None and key in params and params[key] != value:
                raise InvalidRequestError(
                    f"kv_transfer_params.{key}",
                    f"{value!r} contradicts kv_transfer_params_json's {params[key]!r}",
                )
        params = {**given, **(params or {})}
    return params or None


def sampling_params_from_proto(
    params: pb.SamplingParams, *, stream: bool, kv_transfer: dict[str, Any] | None = None
) -> SamplingParams:
    """vLLM SamplingParams for a wire SamplingParams, with the protocol's defaults.

    Unset proto3 scalars mean "use the neutral value": temperature 1.0, top_p 1.0,
    repetition_penalty 1.0, n 1, max_tokens bounded only by the context. The
    model's generation-config defaults are not applied here: GetModelInfo
    advertises them and the router applies them. `kv_transfer` (see
    `kv_transfer_params`) reaches the engine's KV connector through
    `extra_args["kv_transfer_params"]`, where vLLM's connectors read it.
    """
    stop = list(params.stop) or None
    logit_bias = dict(params.logit_bias) or None
    if logit_bias is not None:
        for token_id, bias in logit_bias.items():
            _finite(f"logit_bias[{token_id}]", bias)
    return SamplingParams(
        temperature=_finite("temperature", params.temperature)
        if params.HasField("temperature")
        else 1.0,
        top_p=_finite("top_p", params.top_p) if params.top_p != 0.0 else 1.0,
        top_k=params.top_k,
        min_p=_finite("min_p", params.min_p),
        frequency_penalty=_finite("frequency_penalty", params.frequency_penalty),
        presence_penalty=_finite("presence_penalty", params.presence_penalty),
        repetition_penalty=_finite("repetition_penalty", params.repetition_penalty)
        if params.repetition_penalty != 0.0
        else 1.0,
        max_tokens=params.max_tokens if params.HasField("max_tokens") else None,
        min_tokens=params.min_tokens,
        stop=stop,
        stop_token_ids=list(params.stop_token_ids) or None,
        skip_special_tokens=params.skip_special_tokens,
        spaces_between_special_tokens=params.spaces_between_special_tokens,
        ignore_eos=params.ignore_eos,
        n=params.n or 1,
        logprobs=params.logprobs if params.HasField("logprobs") else None,
        prompt_logprobs=params.prompt_logprobs if params.HasField("prompt_logprobs") else None,
        seed=params.seed if params.HasField("seed") else None,
        include_stop_str_in_output=params.include_stop_str_in_output,
        logit_bias=logit_bias,
        structured_outputs=_structured_outputs(params),
        extra_args={"kv_transfer_params": kv_transfer} if kv_transfer else None,
        # Token ids are the output; text is needed only to match stop strings.
        detokenize=stop is not None,
        output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
    )


def tokenization_kwargs(params: pb.SamplingParams) -> dict[str, int] | None:
    """Prompt truncation settings, when the request asks for any."""
    if params.HasField("truncate_prompt_tokens"):
        keep = params.truncate_prompt_tokens
        if keep == 0 or keep < -1:
            raise InvalidRequestError(
                "sampling_params.truncate_prompt_tokens",
                f"must be -1 (the model's maximum) or at least 1, got {keep}",
            )
        return {"truncate_prompt_tokens": keep}
    return None


def grammar_from_first_token(params: pb.SamplingParams) -> bool:
    """Whether to tell the engine the request's reasoning has ended before it starts.

    vLLM holds a grammar back until its reasoning parser sees the end of the
    model's thought (when the engine runs one); a request whose prompt already
    closed the thought asks for the grammar from the first token.
    """
    return params.grammar_from_first_token and params.WhichOneof("constraint") is not None


def kv_transfer_response(params: dict[str, Any], complete: pb.GenerateComplete) -> None:
    """The engine's returned KV-connector params into `complete`, as JSON and typed.

    The typed message (for older routers) is filled only when the params carry
    a usable remote_host/remote_port.
    """
    try:
        complete.kv_transfer_params_json = json.dumps(params, separators=(",", ":"))
    except (TypeError, ValueError):
        logger.warning("kv_transfer_params not JSON-serialisable, left out: %r", params)
    host, port = params.get("remote_host"), params.get("remote_port")
    if isinstance(host, str) and host and isinstance(port, int) and 1 <= port <= 65535:
        complete.kv_transfer_params.remote_host = host
        complete.kv_transfer_params.remote_port = port


def constraint_error(exc: Exception, params: pb.SamplingParams) -> Exception:
    """`exc` restated to name the constraint field, when it is a constraint's fault."""
    kind = params.WhichOneof("constraint")
    return structured_output_error(exc, f"sampling_params.{kind}" if kind else None)


def _top_logprobs(entry: dict[int, Any] | None, k: int) -> pb.TopLogProbs:
    top = pb.TopLogProbs()
    if entry and k != 0:
        # k < 0 asks for every entry the engine returned.
        for token_id, lp in itertools.islice(entry.items(), k if k > 0 else None):
            top.token_ids.append(token_id)
            top.values.append(lp.logprob)
    return top


def output_logprobs(
    logprobs: list[dict[int, Any]] | None, token_ids: list[int], k: int
) -> pb.OutputLogProbs | None:
    """Sampled-token logprobs (and top-k alternatives) for the given tokens."""
    if not logprobs:
        return None
    out = pb.OutputLogProbs()
    for token_id, entry in zip(token_ids, logprobs, strict=False):
        lp = entry.get(token_id)
        if lp is None:
            continue
        out.token_logprobs.append(lp.logprob)
        out.token_ids.append(token_id)
        if k != 0:
            out.top_logprobs.append(_top_logprobs(entry, k))
    return out if out.token_ids else None


def input_logprobs(
    logprobs: list[dict[int, Any] | None] | None, prompt_ids: list[int], k: int
) -> pb.InputLogProbs | None:
    """Prompt logprobs; the first prompt token has none (an unset value)."""
    if not logprobs:
        return None
    out = pb.InputLogProbs()
    for token_id, entry in zip(prompt_ids, logprobs, strict=False):
        value = pb.InputTokenLogProb()
        if entry is not None and token_id in entry:
            value.value = entry[token_id].logprob
        out.token_logprobs.append(value)
        out.token_ids.append(token_id)
        if k != 0:
            out.top_logprobs.append(_top_logprobs(entry, k))
    return out if out.token_ids else None


class ResponseBuilder:
    """Builds the GenerateResponse messages of one request.

    Holds what is fixed for the request (logprob settings, prompt length) so
    each engine step costs only the message it produces.
    """

    __slots__ = (
        "_first_seen",
        "_k_out",
        "_k_prompt",
        "_prompt_len",
        "_prompt_lps",
        "_want_out",
        "_want_prompt",
    )

    def __init__(self, params: pb.SamplingParams) -> None:
        self._want_out = params.HasField("logprobs")
        self._k_out = params.logprobs if self._want_out else 0
        self._want_prompt = params.HasField("prompt_logprobs")
        self._k_prompt = params.prompt_logprobs if self._want_prompt else 0
        self._prompt_len = -1
        self._prompt_lps: pb.InputLogProbs | None = None
        self._first_seen: set[int] = set()

    def _prompt_tokens(self, output: RequestOutput) -> int:
        if self._prompt_len < 0:
            self._prompt_len = len(output.prompt_token_ids or ())
        return self._prompt_len

    def _prompt_logprobs(self, output: RequestOutput) -> pb.InputLogProbs | None:
        """The prompt's logprobs: this output's, else the first ones the request saw.

        Each choice of n > 1 runs as a request of its own in the engine, and
        its first output carries the prompt's logprobs; but vLLM merges the
        outputs a slow reader has not taken yet and keeps only the first's
        prompt logprobs, so a choice whose first output was merged into
        another's would get none. The prompt is the same for every choice.
        """
        if self._prompt_lps is None and output.prompt_logprobs:
            self._prompt_lps = input_logprobs(
                output.prompt_logprobs,  # type: ignore[arg-type]
                list(output.prompt_token_ids or ()),
                self._k_prompt,
            )
        return self._prompt_lps

    def chunk(self, output: RequestOutput, completion: CompletionOutput) -> GenerateResponse:
        """A streaming chunk: this step's new tokens for one choice."""
        token_ids = completion.token_ids
        prompt_len = self._prompt_len
        if prompt_len < 0:
            prompt_len = self._prompt_tokens(output)
        # Built from a dict in one call (no separate sub-message to copy), and
        # zero fields left out: this runs once per engine step of every stream.
        fields: dict[str, Any] = {
            "token_ids": token_ids,
            "prompt_tokens": prompt_len,
            "completion_tokens": len(token_ids),
        }
        cached = output.num_cached_tokens
        if cached:
            fields["cached_tokens"] = cached
        index = completion.index
        if index:
            fields["index"] = index
        response = GenerateResponse(chunk=fields)
        if self._want_out:
            lps = output_logprobs(completion.logprobs, token_ids, self._k_out)  # type: ignore[arg-type]
            if lps is not None:
                response.chunk.output_logprobs.CopyFrom(lps)
        if self._want_prompt and index not in self._first_seen:
            # Every choice's first chunk carries them, whichever output brought it.
            self._first_seen.add(index)
            ilps = self._prompt_logprobs(output)
            if ilps is not None:
                response.chunk.input_logprobs.CopyFrom(ilps)
        return response

    def complete(self, output: RequestOutput, completion: CompletionOutput) -> GenerateResponse:
        """The end of one choice, with its finish reason and matched stop.

        Non-streaming: all of the choice's tokens. Streaming: the last delta,
        as the reference server sends it (clients accumulate the chunks).
        """
        token_ids = completion.token_ids
        complete = GenerateComplete(
            output_ids=token_ids,
            finish_reason=completion.finish_reason or "stop",
            prompt_tokens=self._prompt_tokens(output),
            completion_tokens=len(token_ids),
            cached_tokens=output.num_cached_tokens or 0,
            index=completion.index,
        )
        stop_reason = completion.stop_reason
        if stop_reason is not None:
            if isinstance(stop_reason, int):
                complete.matched_token_id = stop_reason
            else:
                complete.matched_stop_str = str(stop_reason)
        if self._want_out:
            lps = output_logprobs(completion.logprobs, token_ids, self._k_out)  # type: ignore[arg-type]
            if lps is not None:
                complete.output_logprobs.CopyFrom(lps)
        if self._want_prompt and output.prompt_logprobs:
            ilps = self._prompt_logprobs(output)
            if ilps is not None:
                complete.input_logprobs.CopyFrom(ilps)
        if output.kv_transfer_params:
            kv_transfer_response(output.kv_transfer_params, complete)
        # Filled by vLLM only with --per-request-spec-decode-metrics (and n == 1).
        spec = completion.spec_decode_metrics
        if spec is not None:
            # histogram[j]: verify steps that accepted j draft tokens.
            complete.spec_accepted_tokens = sum(j * n for j, n in enumerate(spec.histogram))
            complete.spec_draft_tokens = spec.num_draft_tokens
        return GenerateResponse(complete=complete)
