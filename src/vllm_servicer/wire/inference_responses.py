"""vLLM's outputs back as vLLM's own `vllm.Inference` responses.

This module is on the path of every token: `ResponseBuilder` decides
once per request what each message carries, and builds each SequenceOutput
from a dict in one call, with nothing it was not asked for.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..proto import inference_pb2 as pb
from .inference import output_candidates, prompt_candidates

if TYPE_CHECKING:
    from google.protobuf import struct_pb2
    from vllm.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger("vllm_servicer")

GenerateResponse = pb.GenerateResponse
_FinishReason = pb.FinishInfo.FinishReason

# vLLM's finish reasons as the protocol's. A repetition stop ends the
# sequence early without a stop, as an abort does (vLLM's Rust server agrees).
_FINISH_REASONS: Mapping[str, pb.FinishInfo.FinishReason] = {
    "stop": _FinishReason.STOP,
    "length": _FinishReason.LENGTH,
    "abort": _FinishReason.ABORTED,
    "repetition": _FinishReason.ABORTED,
}
_ENGINE_ERROR = "error"


class GenerationFailedError(RuntimeError):
    """The engine ended a request with an error of its own (finish reason "error").

    Not the client's fault: the error layer answers INTERNAL.
    """


def fill_struct(struct: struct_pb2.Struct, params: Mapping[str, Any], name: str) -> None:
    """Fill `struct` from `params`; left empty (and logged) when they are not JSON-like."""
    try:
        struct.update(params)
    except (TypeError, ValueError):
        struct.Clear()
        logger.warning("%s not representable as a Struct, left out: %r", name, params)


def _position_logprobs(
    entries: Sequence[dict[int, Any] | None],
    token_ids: Sequence[int],
    fields: dict[str, Any],
    *,
    values: bool,
    candidates: bool,
    ranked: bool,
) -> None:
    """Fill `fields` with the logprob and rank of each token, and its candidates.

    A position without an entry (the first prompt token) gets 0.0, rank 0
    and no candidates, as vLLM's Rust server sends it. Candidates are the
    position's other tokens, the token itself left out.
    """
    logprobs: list[float] = []
    ranks: list[int] = []
    others: list[dict[str, Any]] = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        own = entry.get(token_id) if entry else None
        if values:
            logprobs.append(own.logprob if own is not None else 0.0)
            ranks.append((own.rank or 0) if own is not None else 0)
        if candidates:
            tokens = [
                {"id": other, "logprob": lp.logprob, "rank": (lp.rank or 0) if ranked else 0}
                for other, lp in (entry or {}).items()
                if other != token_id
            ]
            others.append({"tokens": tokens})
    if values:
        fields["logprobs"] = logprobs
        fields["ranks"] = ranks
    if candidates:
        fields["candidate_tokens"] = others


class ResponseBuilder:
    """Builds the GenerateResponse messages of one request.

    Holds what is fixed for the request (what to send, the output tokens sent
    so far) so each engine step costs only the message it produces.

    Args:
        response: the request's ResponseOptions.
    """

    __slots__ = (
        "_masks",
        "_out",
        "_out_candidates",
        "_out_ranked",
        "_out_values",
        "_prompt",
        "_prompt_candidates",
        "_prompt_ids",
        "_prompt_ranked",
        "_prompt_values",
        "_sent",
        "_text",
        "_token_ids",
    )

    def __init__(self, response: pb.ResponseOptions) -> None:
        self._text = response.output_text if response.HasField("output_text") else True
        self._token_ids = response.output_token_ids
        self._prompt_ids = response.prompt_token_ids
        # Logprobs and ranks when asked for; candidates when a selector asks for them.
        out = output_candidates(response)
        self._out = out is not None
        self._out_values = response.output_logprobs
        self._out_candidates = response.HasField("output_candidates")
        self._out_ranked = out is not None and out.ranked
        prompt = prompt_candidates(response)
        self._prompt = prompt is not None
        self._prompt_values = response.prompt_logprobs
        self._prompt_candidates = response.HasField("prompt_candidates")
        self._prompt_ranked = prompt is not None and prompt.ranked
        self._sent = 0  # output tokens sent so far
        self._masks: list[list[int]] = []  # sampling masks, when the engine captures them

    def prompt_info(self, output: RequestOutput) -> pb.PromptInfo:
        """The PromptInfo: the prompt's length and, when asked, its tokens and logprobs."""
        ids = output.prompt_token_ids or []
        fields: dict[str, Any] = {"num_prompt_tokens": len(ids)}
        if self._prompt_ids:
            fields["token_ids"] = ids
        if self._prompt and output.prompt_logprobs:
            _position_logprobs(
                output.prompt_logprobs,
                ids,
                fields,
                values=self._prompt_values,
                candidates=self._prompt_candidates,
                ranked=self._prompt_ranked,
            )
        return pb.PromptInfo(**fields)

    def first(self, output: RequestOutput) -> GenerateResponse:
        """A stream's first message: the PromptInfo alone."""
        return GenerateResponse(prompt_info=self.prompt_info(output))

    def delta(self, output: RequestOutput, completion: CompletionOutput) -> GenerateResponse:
        """A stream's message for one engine step: its new text and tokens.

        The step that finishes the sequence carries its FinishInfo too.
        """
        token_ids = completion.token_ids
        self._sent += len(token_ids)
        return GenerateResponse(outputs=self._sequence(output, completion, token_ids, self._sent))

    def whole(self, output: RequestOutput) -> GenerateResponse:
        """Generate's one message: the PromptInfo and the whole finished sequence."""
        completion = output.outputs[0]
        token_ids = completion.token_ids
        return GenerateResponse(
            prompt_info=self.prompt_info(output),
            outputs=self._sequence(output, completion, token_ids, len(token_ids)),
        )

    def _sequence(
        self,
        output: RequestOutput,
        completion: CompletionOutput,
        token_ids: Sequence[int],
        total: int,
    ) -> dict[str, Any]:
        # A dict with only the fields set: one constructor call per message.
        fields: dict[str, Any] = {"num_tokens": len(token_ids)}
        if self._text:
            text = completion.text
            if text:
                fields["text"] = text
        if self._token_ids:
            fields["token_ids"] = token_ids
        if self._out and completion.logprobs:
            _position_logprobs(
                completion.logprobs,
                token_ids,
                fields,
                values=self._out_values,
                candidates=self._out_candidates,
                ranked=self._out_ranked,
            )
        mask = getattr(completion, "sampling_mask", None)  # captured with --return-sampling-mask
        if mask is not None:
            # vLLM gives each delta its own positions; the schema sends them all at the end.
            self._masks.extend(mask.token_ids)
        if completion.finish_reason is not None:
            fields["finish_info"] = finish_info(output, completion, token_ids, total)
            if self._masks:
                fields["sampling_mask"] = [{"ids": ids} for ids in self._masks]
        return fields


def finish_info(
    output: RequestOutput, completion: CompletionOutput, token_ids: Sequence[int], total: int
) -> pb.FinishInfo:
    """How the sequence ended: the reason, the stop that matched, the connectors' params.

    Args:
        output: the request's last output.
        completion: its finished sequence.
        token_ids: the tokens of the message it ends (an EOS stop is the last).
        total: the sequence's output tokens in all.

    Raises:
        GenerationFailedError: the engine ended the request with an error.
    """
    reason = completion.finish_reason or "stop"
    if reason == _ENGINE_ERROR:
        raise GenerationFailedError(f"the engine failed request {output.request_id!r}")
    info = pb.FinishInfo(
        num_output_tokens=total,
        finish_reason=_FINISH_REASONS.get(reason, _FinishReason.ABORTED),
    )
    if reason == "stop":
        stop = completion.stop_reason
        if isinstance(stop, int):
            info.stop_token_id = stop
        elif stop is not None:
            info.stop_string = str(stop)
        elif token_ids:
            # vLLM names no stop for EOS; the EOS is the last token sent.
            info.eos_token_id = token_ids[-1]
    if output.num_cached_tokens is not None:
        info.num_cached_tokens = output.num_cached_tokens  # prefix-cache hits
    if output.kv_transfer_params:
        fill_struct(info.kv_transfer_params, output.kv_transfer_params, "kv_transfer_params")
    ec_params = getattr(output, "ec_transfer_params", None)
    if ec_params:
        fill_struct(info.ec_transfer_params, ec_params, "ec_transfer_params")
    return info
