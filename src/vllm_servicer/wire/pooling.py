"""vllm_servicer.v1's Pooling messages as vLLM's HTTP bodies, and back.

Each request becomes the JSON body vLLM's HTTP server would take for the same
call (/classify, /score, /rerank), which vLLM's request model validates, and
each answer is read from the body vLLM would send (built from its handler's
outputs, not parsed from JSON: `servicer/vllm_app.py`): the numbers and tokens
are vLLM's own, and only this mapping is ours.
Every field of the request messages is read here (`wire/fields.py` lists
them), the checks vLLM would report without naming the wire's field made first.

Pure data: no grpc, no vLLM.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from ..budgets import check_request_id
from ..errors import InvalidRequestError
from ..proto import pooling_pb2 as pool_pb

__all__ = [
    "ModelLimits",
    "classify_body",
    "classify_response",
    "non_empty",
    "rerank_body",
    "rerank_response",
    "score_body",
    "score_response",
    "truncation",
]


# The request fields that carry one text (the others are repeated).
_SINGLE_TEXTS = frozenset({"text_1", "query"})


@dataclasses.dataclass(frozen=True)
class ModelLimits:
    """What the served model takes, for the checks made before vLLM sees a request.

    Attributes:
        served_model: the served model's name ("" in a request means it).
        max_model_len: the model's context in tokens; None: unknown.
        max_text_chars: the longest text that can fit that context (the context
            times the longest token's characters: a text longer than this
            cannot be that few tokens); None: unknown.
        truncation_side: the side the tokenizer truncates a text from ("left"
            keeps the last tokens, "right" the first).
    """

    served_model: str
    max_model_len: int | None = None
    max_text_chars: int | None = None
    truncation_side: str = "right"

    def fitted(self, field: str, texts: Sequence[str], truncating: bool) -> list[str]:
        """`texts` bounded by the context, before anything tokenizes them.

        vLLM tokenizes a text whole before it truncates, and a Score's query
        once per pair: a text past `max_text_chars` is refused at once, or,
        with truncation, cut to that many characters on the tokenizer's
        truncation side (what vLLM itself does when a request names the side).
        What is cut lies past the tokens truncation keeps: `max_text_chars`
        characters are at least the context's count of tokens, unless the
        tokenizer drops characters (a WordPiece one drops runs of spaces), in
        which case a text made mostly of them keeps fewer: only its own
        result changes.

        Raises:
            InvalidRequestError: a text cannot fit and nothing truncates it.
        """
        bound = self.max_text_chars
        if bound is None:
            return list(texts)
        if truncating:
            left = self.truncation_side == "left"
            return [text[-bound:] if left else text[:bound] for text in texts]
        for index, text in enumerate(texts):
            if len(text) > bound:
                name = field if field in _SINGLE_TEXTS else f"{field}[{index}]"
                raise InvalidRequestError(
                    name,
                    f"{len(text)} characters cannot fit the model's context of "
                    f"{self.max_model_len} tokens; shorten it or set truncate_prompt_tokens",
                )
        return list(texts)

    def check_chat_fits(self, field: str, size: int) -> None:
        """Refuse a chat that cannot fit the context, truncated or not.

        A chat is rendered whole before its tokens are truncated, and the
        rendered prompt holds at least the chat's own characters; `size` is
        its bytes (at least its characters), counted before anything parses it.

        Raises:
            InvalidRequestError: `size` past `max_text_chars`.
        """
        if self.max_text_chars is not None and size > self.max_text_chars:
            raise InvalidRequestError(
                field,
                f"{size} bytes of messages, tools and template variables cannot fit the "
                f"model's context of {self.max_model_len} tokens; shorten the chat",
            )


def non_empty(field: str, texts: Sequence[str], what: str) -> list[str]:
    """`texts` as a list, refused (naming `field`) when it holds no `what`."""
    if not texts:
        raise InvalidRequestError(field, f"at least one {what} is required")
    return list(texts)


def truncation(field: str, value: int, max_model_len: int | None) -> int:
    """A request's `truncate_prompt_tokens` (in `field`), checked against the context."""
    if value < -1:
        raise InvalidRequestError(field, f"{value}; -1 (the model's context) or a count of tokens")
    if value == 0:
        raise InvalidRequestError(
            field, "0 tokens would leave nothing; unset it to refuse longer prompts"
        )
    if max_model_len is not None and value > max_model_len:
        raise InvalidRequestError(
            field, f"{value} tokens, more than the model's context of {max_model_len}"
        )
    return value


def _pooling_options(options: pool_pb.PoolingOptions, limits: ModelLimits) -> dict[str, object]:
    body: dict[str, object] = {
        # The served model's name: an adapter named goes to the engine by itself.
        "model": limits.served_model,
        "priority": options.priority,
    }
    if options.HasField("truncate_prompt_tokens"):
        body["truncate_prompt_tokens"] = truncation(
            "options.truncate_prompt_tokens", options.truncate_prompt_tokens, limits.max_model_len
        )
    return body


def _texts(
    request: pool_pb.ClassifyRequest | pool_pb.ScoreRequest | pool_pb.RerankRequest,
    field: str,
    limits: ModelLimits,
    what: str | None = None,
) -> dict[str, object]:
    """The body's `field`, its texts bounded by the context (`ModelLimits.fitted`);
    a repeated field must hold one (`what`) at least."""
    truncating = request.options.HasField("truncate_prompt_tokens")
    if what is None:
        return {field: limits.fitted(field, [getattr(request, field)], truncating)[0]}
    texts = non_empty(field, getattr(request, field), what)
    return {field: limits.fitted(field, texts, truncating)}


def _request_id(given: str) -> dict[str, str]:
    # vLLM's engine ids are "<route>-<request_id>-<index>"; "": vLLM makes one up.
    if given:
        check_request_id("request_id", given)
    return {"request_id": given} if given else {}


def classify_body(request: pool_pb.ClassifyRequest, limits: ModelLimits) -> dict[str, object]:
    """The /classify body for `request`.

    Raises:
        InvalidRequestError: no input, a text that cannot fit the context, a
            truncation out of range, a bad request id (named by field).
    """
    return {
        **_texts(request, "input", limits, "text"),
        **_pooling_options(request.options, limits),
        **_request_id(request.request_id),
    }


def score_body(request: pool_pb.ScoreRequest, limits: ModelLimits) -> dict[str, object]:
    """The /score body for `request`: text_1 against each of text_2."""
    return {
        **_texts(request, "text_1", limits),
        **_texts(request, "text_2", limits, "text"),
        **_pooling_options(request.options, limits),
        **_request_id(request.request_id),
    }


def rerank_body(request: pool_pb.RerankRequest, limits: ModelLimits) -> dict[str, object]:
    """The /rerank body for `request`."""
    return {
        **_texts(request, "query", limits),
        **_texts(request, "documents", limits, "document"),
        "top_n": request.top_n,
        **_pooling_options(request.options, limits),
        **_request_id(request.request_id),
    }


def _usage_tokens(body: Mapping[str, Any]) -> int:
    return int((body.get("usage") or {}).get("prompt_tokens") or 0)


def classify_response(body: Mapping[str, Any], request_id: str) -> pool_pb.ClassifyResponse:
    """ClassifyResponse from vLLM's /classify answer."""
    return pool_pb.ClassifyResponse(
        request_id=request_id,
        model=body.get("model", ""),
        results=[
            pool_pb.ClassifyResult(
                index=item["index"], label=item.get("label") or "", probs=item["probs"]
            )
            for item in body["data"]
        ],
        prompt_tokens=_usage_tokens(body),
    )


def score_response(body: Mapping[str, Any], request_id: str) -> pool_pb.ScoreResponse:
    """ScoreResponse from vLLM's /score answer."""
    return pool_pb.ScoreResponse(
        request_id=request_id,
        model=body.get("model", ""),
        results=[
            pool_pb.ScoreResult(index=item["index"], score=item["score"]) for item in body["data"]
        ],
        prompt_tokens=_usage_tokens(body),
    )


def rerank_response(
    body: Mapping[str, Any], request_id: str, return_documents: bool
) -> pool_pb.RerankResponse:
    """RerankResponse from vLLM's /rerank answer (documents echoed when asked)."""
    results = []
    for item in body["results"]:
        document = ((item.get("document") or {}).get("text") or "") if return_documents else ""
        results.append(
            pool_pb.RerankResult(
                index=item["index"], relevance_score=item["relevance_score"], document=document
            )
        )
    return pool_pb.RerankResponse(
        request_id=request_id,
        model=body.get("model", ""),
        results=results,
        prompt_tokens=_usage_tokens(body),
    )
