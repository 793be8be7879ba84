"""Structured outputs as both generation protocols carry them.

VllmEngine's `SamplingParams.constraint` and vllm.Inference's
`DecodingParameters.structured_output` are one oneof of the same kinds (a JSON
schema, a regex, a grammar, a structural tag, a choice list, a JSON-object
flag); each protocol's wire module reads its own message and asks here for
the two things they share: the size a budget counts, and an engine error
restated to name the request's field.

Pure data: no grpc, no vLLM.
"""

from __future__ import annotations

from typing import Any

from ..budgets import encoded_size
from ..errors import InvalidRequestError

__all__ = ["structured_output_error", "structured_output_size"]


def structured_output_size(message: Any, oneof: str, prefix: str) -> tuple[str, int] | None:
    """The structured-output field set in `message`'s `oneof` (named under `prefix`)
    and its size in bytes, if one is set: both protocols' constraints are a oneof of
    the same kinds.

    A choice list counts all its choices together; `json_object` is a flag
    and has no size.
    """
    kind = message.WhichOneof(oneof)
    if kind is None or kind == "json_object":
        return None
    if kind == "choice":
        return f"{prefix}.choice.choices", encoded_size(*message.choice.choices)
    return f"{prefix}.{kind}", encoded_size(getattr(message, kind))


# Words in vLLM's structured-output error messages, which do not name the field
# ("Invalid structured outputs: ..." from vLLM 0.33, raised as VLLMValidationError).
_CONSTRAINT_WORDS = ("grammar", "schema", "regex", "structural", "structured", "choice", "json")


def structured_output_error(exc: Exception, field: str | None) -> Exception:
    """`exc` restated to name `field`, the request's structured-output field, when
    it is that field's fault (None: the request has none).

    vLLM rejects a bad JSON schema or grammar with messages such as "Grammar
    error: ..." that do not say which request field was at fault.
    """
    if field is None or isinstance(exc, InvalidRequestError):
        return exc
    if getattr(exc, "parameter", None):  # vLLM already named the parameter
        return exc
    text = str(exc)
    if not any(word in text.lower() for word in _CONSTRAINT_WORDS):
        return exc
    error = InvalidRequestError(field, text)
    error.__cause__ = exc
    return error
