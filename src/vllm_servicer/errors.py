"""One table from exceptions to gRPC status codes, and the single place that aborts.

Client mistakes come back as INVALID_ARGUMENT with the engine's own message
(it names the parameter); a dead engine is UNAVAILABLE (retry elsewhere);
anything unexpected is INTERNAL with a fixed message, while the traceback and
request id go to the server log only.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, NoReturn

import grpc
from vllm.exceptions import VLLMClientError, VLLMNotFoundError
from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

if TYPE_CHECKING:
    import grpc.aio

logger = logging.getLogger("vllm_servicer")


class InvalidRequestError(ValueError):
    """A request the servicer rejects before it reaches the engine.

    Args:
        field: the request field at fault, as a dotted path
            (e.g. "sampling_params.n").
        reason: what is wrong with it.
    """

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class EngineUnavailableError(RuntimeError):
    """The engine cannot take requests (dead, or not the kind this RPC needs)."""


class UnsupportedError(RuntimeError):
    """The engine lacks a feature this RPC needs (no pooling runner, no profiler)."""


# Looked up in order by class hierarchy; the first match wins.
ERROR_TABLE: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (EngineDeadError, grpc.StatusCode.UNAVAILABLE),
    (EngineUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (UnsupportedError, grpc.StatusCode.FAILED_PRECONDITION),
    (VLLMNotFoundError, grpc.StatusCode.NOT_FOUND),
    # VLLMValidationError and the rest of the request's faults (no longer ValueError in 0.32).
    (VLLMClientError, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    # vLLM also validates with plain ValueError/TypeError/OverflowError
    # (e.g. SamplingParams checks, tokenizer limits): the client's fault.
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (TypeError, grpc.StatusCode.INVALID_ARGUMENT),
    (OverflowError, grpc.StatusCode.INVALID_ARGUMENT),
)

_INTERNAL_MESSAGE = "internal error while serving request {request_id!r}; see server log"


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The status code for an exception, by the first matching row of ERROR_TABLE."""
    for exc_type, code in ERROR_TABLE:
        if isinstance(exc, exc_type):
            return code
    return grpc.StatusCode.INTERNAL


def message_for(exc: BaseException, code: grpc.StatusCode, request_id: str) -> str:
    """What the client is told: the exception's own words unless the fault is ours."""
    if code is grpc.StatusCode.INTERNAL or isinstance(exc, EngineGenerateError):
        return _INTERNAL_MESSAGE.format(request_id=request_id)
    if isinstance(exc, EngineDeadError):
        return "engine is not running; retry on another replica"
    return str(exc) or type(exc).__name__


async def abort_for_exception(
    context: grpc.aio.ServicerContext[object, object],
    exc: BaseException,
    *,
    method: str,
    request_id: str = "",
) -> NoReturn:
    """Abort the call with the status that ERROR_TABLE gives for `exc`.

    Cancellation and an earlier abort pass through untouched, so a call is
    never aborted twice and the engine still sees the client's cancel.
    """
    if isinstance(exc, (asyncio.CancelledError, grpc.aio.AbortError)):
        raise exc
    code = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        logger.error("%s failed for request %r", method, request_id, exc_info=exc)
    else:
        logger.info("%s request %r rejected with %s: %s", method, request_id, code.name, exc)
    await context.abort(code, message_for(exc, code, request_id))
    raise AssertionError("unreachable: context.abort raises")  # pragma: no cover
