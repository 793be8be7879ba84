"""One table from exceptions to gRPC status codes, and the single place that aborts for one.

Client mistakes come back as INVALID_ARGUMENT with the engine's own message
(it names the parameter); a dead engine is UNAVAILABLE (retry elsewhere);
anything unexpected is INTERNAL with a fixed message, while the traceback and
request id go to the server log only.

Every error status also carries a `google.rpc.Status` in its trailers (the
standard rich error model): an `ErrorInfo` with a stable `reason` and the
domain "vllm-servicer", plus `BadRequest` field violations when the faulty
request field is known, so clients can act on errors without parsing text
(`grpc_status.rpc_status.from_call`).
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn

# Before vLLM is imported below: an untested vLLM release fails here, naming both versions.
from . import _vllm_version  # noqa: F401

# isort: split
import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2  # type: ignore[import-untyped]
from grpc_status import rpc_status  # type: ignore[import-untyped]
from vllm.exceptions import (
    MaxQueuedTokensError,
    QueueOverflowError,
    VLLMClientError,
    VLLMNotFoundError,
    VLLMValidationError,
)
from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

from .context import current_request_id
from .errors import (
    AlreadyExistsError,
    AuthError,
    BudgetFullError,
    CheckpointStateError,
    EngineRefusedError,
    EventsLostError,
    FieldOutOfRangeError,
    InvalidRequestError,
    KeylessLimitError,
    MediaUnavailableError,
    NotEnabledError,
    NotFoundError,
    PermissionDenied,
    RequestIdInUseError,
    RequestNotSentError,
    RoutingDataError,
    TableFullError,
    TokenShareError,
    TooManySubscribersError,
    Unauthenticated,
    UnimplementedFieldError,
    UnsupportedError,
)
from .proto import vllm_engine_pb2 as pb
from .vllm_releases import EngineFaultedError, ProfilerAlreadyActiveError, RetryableRequestError

if TYPE_CHECKING:
    import grpc.aio

logger = logging.getLogger("vllm_servicer")

ERROR_DOMAIN = "vllm-servicer"


class ErrorRule(NamedTuple):
    """One row of ERROR_TABLE: an exception class, its status and a stable reason."""

    exc_type: type[BaseException]
    code: grpc.StatusCode
    reason: str


def _own(exc_type: Any) -> ErrorRule:
    """The row of one of this package's exceptions: the status it carries (errors.py)."""
    return ErrorRule(exc_type, grpc.StatusCode[exc_type.status_code], exc_type.status_reason)


# Looked up in order by class hierarchy; the first match wins. `reason` is the
# ErrorInfo reason clients switch on: part of the API, never renamed. Every
# status this package answers for an exception comes from this table.
ERROR_TABLE: tuple[ErrorRule, ...] = (
    ErrorRule(EngineDeadError, grpc.StatusCode.UNAVAILABLE, "ENGINE_DEAD"),
    # Admission limits: this replica is full, another may not be.
    ErrorRule(QueueOverflowError, grpc.StatusCode.UNAVAILABLE, "ENGINE_BUSY"),
    ErrorRule(MaxQueuedTokensError, grpc.StatusCode.UNAVAILABLE, "ENGINE_BUSY"),
    # A transient failure the engine says is safe to retry: from vLLM 0.33 a
    # paused engine ("abort" or "wait" mode) refuses new requests with it.
    ErrorRule(RetryableRequestError, grpc.StatusCode.UNAVAILABLE, "RETRYABLE"),
    # vLLM 0.34+ with --enable-fault-tolerance: the engine faulted and awaits
    # recovery; its HTTP server answers 503 so that clients go elsewhere.
    ErrorRule(EngineFaultedError, grpc.StatusCode.UNAVAILABLE, "ENGINE_FAULTED"),
    _own(TooManySubscribersError),
    _own(BudgetFullError),
    _own(TableFullError),
    _own(KeylessLimitError),
    _own(TokenShareError),
    _own(RequestNotSentError),
    _own(EventsLostError),
    _own(MediaUnavailableError),
    _own(RequestIdInUseError),
    _own(RoutingDataError),
    _own(AlreadyExistsError),
    _own(NotFoundError),
    ErrorRule(ProfilerAlreadyActiveError, grpc.StatusCode.FAILED_PRECONDITION, "PROFILER_ACTIVE"),
    _own(UnsupportedError),
    _own(CheckpointStateError),
    _own(EngineRefusedError),
    _own(NotEnabledError),
    _own(UnimplementedFieldError),
    _own(FieldOutOfRangeError),
    ErrorRule(VLLMNotFoundError, grpc.StatusCode.NOT_FOUND, "NOT_FOUND"),
    # VLLMValidationError and the rest of the request's faults (no longer ValueError in 0.32).
    ErrorRule(VLLMClientError, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT"),
    _own(InvalidRequestError),
    _own(Unauthenticated),
    _own(PermissionDenied),
    _own(AuthError),
    # An engine call that outlived its budget (FlushCache, profiling).
    ErrorRule(TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED, "TIMEOUT"),
    # vLLM also validates with plain ValueError/OverflowError (e.g.
    # SamplingParams checks, tokenizer limits): the client's fault. A TypeError
    # is not: request fields arrive typed, so it is a server bug (INTERNAL).
    ErrorRule(ValueError, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT"),
    ErrorRule(OverflowError, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT"),
)
_INTERNAL = ErrorRule(BaseException, grpc.StatusCode.INTERNAL, "INTERNAL")

# Reasons whose status tells the client when to try again: grpc's retry
# pushback (`grpc-retry-pushback-ms`, honoured by grpc's retry policy) and a
# google.rpc.RetryInfo in the details.
RETRY_AFTER_MS = {"RETRYABLE": 1000, "ENGINE_FAULTED": 1000, "TOKEN_SHARE": 1000}

_INTERNAL_MESSAGE = "internal error while serving request {request_id!r}; see server log"
# vLLM names sampling parameters as the wire does, one level down.
_SAMPLING_FIELDS = frozenset(pb.SamplingParams.DESCRIPTOR.fields_by_name)


def rule_for(exc: BaseException) -> ErrorRule:
    """The first row of ERROR_TABLE that matches `exc` (INTERNAL when none does)."""
    for rule in ERROR_TABLE:
        if isinstance(exc, rule.exc_type):
            return rule
    return _INTERNAL


def message_for(exc: BaseException, code: grpc.StatusCode, request_id: str) -> str:
    """What the client is told: the exception's own words unless the fault is ours.

    Paths of this server's files (a model or tokenizer directory in a
    tokenizer's error, say) are left out: they tell a client how the host is laid out.
    """
    if code is grpc.StatusCode.INTERNAL or isinstance(exc, EngineGenerateError):
        return _INTERNAL_MESSAGE.format(request_id=request_id)
    if isinstance(exc, EngineDeadError):
        return "engine is not running; retry on another replica"
    return redact_paths(str(exc)) or type(exc).__name__


# A URL with a network scheme (https://..., http://[::1]:8000/...): a host's
# address, not a file here; `file:` URLs are left to the paths below.
_NETWORK_URL = r"(?<![\w.+-])(?![Ff][Ii][Ll][Ee]:)[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"`<>]*"
# A word of a message that holds a slash: it starts after whitespace, a quote,
# a bracket, "=" or ":" and runs to the next.
_SLASHED_WORD = r"(?<![^\s'\"`()\[\]{}<>=:,;])[^\s'\"`()\[\]{}<>=:,;]*/[^\s'\"`()\[\]{}<>=:,;]*"
_URL_OR_SLASHED_WORD = re.compile(f"(?P<url>{_NETWORK_URL})|{_SLASHED_WORD}")
# A file name's extension (".json", ".ebnf"), not a version's (".5-7B", ".1").
_EXTENSION = re.compile(r"\.[A-Za-z][A-Za-z0-9]{0,11}$")


def redact_paths(text: str) -> str:
    """`text` with every word that reads as a file path replaced by "<path>".

    Decided from the text alone: nothing is looked up on this machine, so what
    is redacted tells a client nothing about which folders or users exist here.
    A path is a word that is absolute (`/...`, a `file:///` URL's path),
    home-relative (`~`, `~user/...`), explicitly relative (`./...`,
    `../...`), or relative with two slashes or more (`models/tiny/x`) or a
    file name at its end (`grammars/g.ebnf`). Kept: URLs with a network
    scheme (`https://...`), and words of one slash without a file name
    ("and/or", "1/2", a repository id such as "org/model-1.5B"). A client's
    own absolute text (a regex `/a+b/`, a route `/v1/models`) reads as a
    path too: telling it apart would take the look-up this avoids.
    """

    def hide(match: re.Match[str]) -> str:
        word = match.group(0)
        if match.group("url") is not None:
            return word
        path = word.rstrip(".!?")
        return "<path>" + word[len(path) :] if _reads_as_path(path) else word

    return _URL_OR_SLASHED_WORD.sub(hide, text)


def _reads_as_path(path: str) -> bool:
    first, _, rest = path.partition("/")
    if not first:
        # Absolute. A word starting "//" is a URL's host (kept), unless it is
        # the "///" of a "file:///..." URL.
        if rest.startswith("/"):
            return rest.startswith("//") and len(rest) > 2
        return bool(rest)
    if first.startswith("~") or first in (".", ".."):
        return True
    return path.count("/") >= 2 or bool(_EXTENSION.search(path.rpartition("/")[2]))


def field_violation(exc: BaseException) -> tuple[str, str] | None:
    """The request field at fault and why, when the exception names one."""
    if isinstance(exc, InvalidRequestError):
        return exc.field, exc.reason
    if isinstance(exc, VLLMValidationError) and exc.parameter:
        name = exc.parameter
        field = f"sampling_params.{name}" if name in _SAMPLING_FIELDS else name
        # The message without the "(parameter=..., value=...)" suffix __str__ adds.
        return field, str(exc.args[0]) if exc.args else str(exc)
    return None


def rich_status(
    exc: BaseException, rule: ErrorRule, message: str, method: str
) -> status_pb2.Status:
    """The `google.rpc.Status` sent with the error: ErrorInfo, and BadRequest if known.

    Everything in it that a client reads as text (the message, each violation's
    description) has this server's paths left out, as `message_for` does.
    """
    metadata = {"method": method}
    field = getattr(exc, "field", "")
    if field and isinstance(field, str):
        # A refused field is named here whatever the code, for clients to switch on.
        metadata["field"] = field
    info = error_details_pb2.ErrorInfo(reason=rule.reason, domain=ERROR_DOMAIN, metadata=metadata)
    details = [_pack(info)]
    retry_ms = RETRY_AFTER_MS.get(rule.reason)
    if retry_ms is not None:
        retry = error_details_pb2.RetryInfo()
        retry.retry_delay.FromMilliseconds(retry_ms)
        details.append(_pack(retry))
    if rule.code is grpc.StatusCode.INVALID_ARGUMENT:
        violation = field_violation(exc)
        if violation is not None:
            field, why = violation
            bad = error_details_pb2.BadRequest()
            bad.field_violations.add(field=field, description=redact_paths(why))
            details.append(_pack(bad))
    return status_pb2.Status(
        code=rule.code.value[0], message=redact_paths(message), details=details
    )


def _pack(message: Any) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


async def abort_for_exception(
    context: grpc.aio.ServicerContext[object, object],
    exc: BaseException,
    *,
    method: str,
    request_id: str = "",
) -> NoReturn:
    """Abort the call with the status that ERROR_TABLE gives for `exc`.

    The status carries a `google.rpc.Status` with typed details (ErrorInfo,
    BadRequest). Cancellation and an earlier abort pass through untouched, so
    a call is never aborted twice and the engine still sees the client's cancel.
    """
    if isinstance(exc, (asyncio.CancelledError, grpc.aio.AbortError)):
        raise exc
    rule = rule_for(exc)
    code = rule.code
    if code is grpc.StatusCode.INTERNAL:
        logger.error("%s failed for request %r", method, request_id, exc_info=exc)
    else:
        logger.info("%s request %r rejected with %s: %s", method, request_id, code.name, exc)
    message = message_for(exc, code, request_id)
    status = rpc_status.to_status(rich_status(exc, rule, message, method))
    retry_ms = RETRY_AFTER_MS.get(rule.reason)
    if retry_ms is not None:
        pushback = (("grpc-retry-pushback-ms", str(retry_ms)),)
        status = status._replace(trailing_metadata=status.trailing_metadata + pushback)
    await context.abort_with_status(status)
    raise AssertionError("unreachable: context.abort raises")  # pragma: no cover


async def error_layer(
    context: grpc.aio.ServicerContext[object, object], exc: Exception, method: str
) -> NoReturn:
    """The error layer of every VllmEngine method: `exc` as the status ERROR_TABLE gives.

    `method` is the full name; the call's request id comes from `current_request_id`.
    """
    await abort_for_exception(
        context, exc, method=method.rpartition("/")[2], request_id=current_request_id.get()
    )
