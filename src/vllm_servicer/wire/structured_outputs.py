"""Structured outputs as both generation protocols carry them.

VllmEngine's `SamplingParams.constraint` and vllm.Inference's
`DecodingParameters.structured_output` are one oneof of the same kinds (a JSON
schema, a regex, a grammar, a structural tag, a choice list, a JSON-object
flag); each protocol's wire module names its own spelling of them
(`ConstraintFields`) and asks here for what they share: vLLM's arguments
for the constraint, the size a budget counts, and an engine error restated
to name the request's field.

Pure data: no grpc, no vLLM.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..budgets import encoded_size
from ..errors import InvalidRequestError

__all__ = [
    "ConstraintFields",
    "structured_output_arguments",
    "structured_output_error",
    "structured_output_size",
]


@dataclasses.dataclass(frozen=True)
class ConstraintFields:
    """How one protocol's message spells the structured-output oneof.

    Attributes:
        oneof: the oneof's name.
        prefix: the message's field path, for refusals.
        json: the name of its JSON-schema member.
        false_json_object_is_none: whether `json_object: false` asks for no
            constraint (vllm.Inference, as vLLM's Rust server), or is handed on.
    """

    oneof: str
    prefix: str
    json: str
    false_json_object_is_none: bool


def structured_output_arguments(message: Any, spelled: ConstraintFields) -> dict[str, Any] | None:
    """vLLM's `StructuredOutputsParams` arguments for the constraint `message`
    sets, if it sets one.

    Raises:
        InvalidRequestError: a choice list without a choice.
    """
    kind = message.WhichOneof(spelled.oneof)
    if kind is None:
        return None
    if kind == "choice":
        choices = list(message.choice.choices)
        if not choices:
            raise InvalidRequestError(
                f"{spelled.prefix}.choice.choices", "needs at least one choice"
            )
        return {"choice": choices}
    if kind == "json_object":
        if spelled.false_json_object_is_none and not message.json_object:
            return None
        return {"json_object": message.json_object}
    return {"json" if kind == spelled.json else kind: getattr(message, kind)}


def structured_output_size(message: Any, spelled: ConstraintFields) -> tuple[str, int] | None:
    """The structured-output field set in `message` (as `spelled`) and its size
    in bytes, if one is set: both protocols' constraints are a oneof of the
    same kinds.

    A choice list counts all its choices together; `json_object` is a flag
    and has no size.
    """
    kind = message.WhichOneof(spelled.oneof)
    if kind is None or kind == "json_object":
        return None
    if kind == "choice":
        return f"{spelled.prefix}.choice.choices", encoded_size(*message.choice.choices)
    return f"{spelled.prefix}.{kind}", encoded_size(getattr(message, kind))


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
