"""The exceptions this package raises for a call it will not serve.

Each names the request field at fault where there is one (those derive from
`FieldError`, which writes the message "field: reason"), and carries its
status: `status_code` (a `grpc.StatusCode` name) and `status_reason` (the
ErrorInfo reason clients switch on, part of the API). `status.ERROR_TABLE`
orders them beside vLLM's own exceptions; this module imports no grpc, so
any layer can raise them.
"""

from __future__ import annotations

from typing import ClassVar


class FieldError(Exception):
    """A call refused for one request field: `field` names it, `reason` says why.

    The message, which the client reads, is "field: reason". Each subclass
    adds its status and its built-in base (`ValueError` and so on). Every one
    takes `field` and `reason` by name, `UnsupportedError` too (whose field
    is optional and comes second when positional).

    Args:
        field: the request field at fault, as a dotted path
            (e.g. "sampling_params.n").
        reason: what is wrong with it.
    """

    status_code: ClassVar[str]
    status_reason: ClassVar[str]

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class InvalidRequestError(FieldError, ValueError):
    """A request the servicer rejects before it reaches the engine.

    Args:
        field: the request field at fault, as a dotted path
            (e.g. "sampling_params.n").
        reason: what is wrong with it.
    """

    status_code: ClassVar[str] = "INVALID_ARGUMENT"
    status_reason: ClassVar[str] = "INVALID_ARGUMENT"


ROUTER_ROLE_HINT = (
    "it needs the router role: a router key (--router-api-key, or role=router on its line "
    "of the key file), a --router-tls-subject certificate or an admin key; or serve with "
    "--routing-data-for-every-key (MountOptions.of(routing_data_for_every_key=True))"
)
"""How a caller gets routing data: the message every refusal of it carries."""


class RoutingDataError(FieldError, RuntimeError):
    """A request field only a router may set (KV transfer parameters: they make a
    prefill engine hold blocks, a decode engine connect where the caller says),
    sent by a caller without the router or admin role.

    Args:
        field: the request field.
        reason: why it is refused; by default, the role it needs and how to get it.
    """

    status_code: ClassVar[str] = "PERMISSION_DENIED"
    status_reason: ClassVar[str] = "ROUTER_ROLE_REQUIRED"

    def __init__(self, field: str, reason: str = "") -> None:
        reason = (
            reason or f"KV and encoder-cache transfer parameters are a router's; {ROUTER_ROLE_HINT}"
        )
        super().__init__(field, reason)


class MediaUnavailableError(FieldError, RuntimeError):
    """An image could not be fetched for a reason on the far side (no answer in
    time, connection refused, a 5xx): the same request may succeed later.

    Args:
        field: the request field naming the image.
        reason: what went wrong.
    """

    status_code: ClassVar[str] = "UNAVAILABLE"
    status_reason: ClassVar[str] = "MEDIA_UNAVAILABLE"


class UnsupportedError(FieldError, RuntimeError):
    """The engine lacks a feature this RPC needs (no pooling runner, no profiler).

    Args:
        reason: what is missing and how to enable it.
        field: the request field that needs it, when one does (named in the
            message, as every field error's is); "" when none does.
    """

    status_code: ClassVar[str] = "FAILED_PRECONDITION"
    status_reason: ClassVar[str] = "UNSUPPORTED"

    def __init__(self, reason: str, *, field: str = "") -> None:
        super().__init__(field, reason)
        if not field:  # none to name: the message is the reason alone
            self.args = (reason,)


class UnimplementedFieldError(FieldError, NotImplementedError):
    """A request field this server does not implement: refused, never ignored.

    Args:
        field: the request field, as a dotted path (e.g. "mm_inputs").
        reason: why, and what would serve it instead.
    """

    status_code: ClassVar[str] = "UNIMPLEMENTED"
    status_reason: ClassVar[str] = "FIELD_UNIMPLEMENTED"


class FieldOutOfRangeError(FieldError, LookupError):
    """A request field whose value lies past what this server can serve (no history kept).

    Args:
        field: the request field.
        reason: what range is served.
    """

    status_code: ClassVar[str] = "OUT_OF_RANGE"
    status_reason: ClassVar[str] = "OUT_OF_RANGE"


class NotEnabledError(RuntimeError):
    """The RPC needs an engine feature that is switched off (e.g. KV-cache events)."""

    status_code: ClassVar[str] = "UNIMPLEMENTED"
    status_reason: ClassVar[str] = "NOT_ENABLED"


class TooManySubscribersError(RuntimeError):
    """A streaming subscription past the server's limit on concurrent subscribers."""

    status_code: ClassVar[str] = "RESOURCE_EXHAUSTED"
    status_reason: ClassVar[str] = "TOO_MANY_SUBSCRIBERS"


class BudgetFullError(FieldError, RuntimeError):
    """A request within its own budgets that a budget shared by the whole process
    cannot take now (decoded images in flight): another replica, or this one
    later, may serve it.

    Args:
        field: the request field that needed the budget.
        reason: which budget, and its limit.
    """

    status_code: ClassVar[str] = "RESOURCE_EXHAUSTED"
    status_reason: ClassVar[str] = "BUDGET_FULL"


class TableFullError(RuntimeError):
    """The frontends' shared table of running ids cannot take another (whole, or
    the caller's own share of it): another replica, or this one later, may.
    The message names what is full and its size."""

    status_code: ClassVar[str] = "RESOURCE_EXHAUSTED"
    status_reason: ClassVar[str] = "ID_TABLE_FULL"


class KeylessLimitError(RuntimeError):
    """A call that needs no key (health, reflection, load reports) past the caps that keep such
    calls apart from keyed work; the message names the cap."""

    status_code: ClassVar[str] = "RESOURCE_EXHAUSTED"
    status_reason: ClassVar[str] = "KEYLESS_LIMIT"


class RequestNotSentError(RuntimeError):
    """A call whose request message did not arrive within its read deadline: it held
    slots for nothing. The message names the limit and what sets it."""

    status_code: ClassVar[str] = "DEADLINE_EXCEEDED"
    status_reason: ClassVar[str] = "REQUEST_NOT_SENT"


class EventsLostError(RuntimeError):
    """Events a subscriber needs are gone: past the publisher's replay buffer, or it restarted.

    The subscriber's view can no longer be made whole; it resubscribes from
    the current state.
    """

    status_code: ClassVar[str] = "DATA_LOSS"
    status_reason: ClassVar[str] = "EVENTS_LOST"


class NotFoundError(FieldError, LookupError):
    """A request names something this server does not have (a model, an adapter).

    Args:
        field: the request field naming it.
        reason: what is not there, and what is.
    """

    status_code: ClassVar[str] = "NOT_FOUND"
    status_reason: ClassVar[str] = "NOT_FOUND"


class AlreadyExistsError(FieldError, RuntimeError):
    """A request would create what exists already (an adapter of that name).

    Args:
        field: the request field naming it.
        reason: what exists.
    """

    status_code: ClassVar[str] = "ALREADY_EXISTS"
    status_reason: ClassVar[str] = "ALREADY_EXISTS"


class EngineRefusedError(RuntimeError):
    """The engine refused a control operation in its current state, in its own words.

    vLLM's engine core answers a failed control call (a weight update out of
    order, say) with a bare message; this carries it to the client.
    """

    status_code: ClassVar[str] = "FAILED_PRECONDITION"
    status_reason: ClassVar[str] = "ENGINE_REFUSED"


class RequestIdInUseError(RuntimeError):
    """A Generate or Embed under a request id another caller's running request holds.

    vLLM aborts by the client's request id, every request under it at once: an
    id shared by two callers would let one stop the other's request.
    """

    status_code: ClassVar[str] = "ALREADY_EXISTS"
    status_reason: ClassVar[str] = "REQUEST_ID_IN_USE"
    field = "request_id"


class AuthError(Exception):
    """A verifier's rejection. The message goes to the client: never put a secret in it."""

    status_code: ClassVar[str] = "UNAUTHENTICATED"
    status_reason: ClassVar[str] = "UNAUTHENTICATED"


class Unauthenticated(AuthError):
    """Credentials are missing, malformed or unknown (UNAUTHENTICATED)."""


class PermissionDenied(AuthError):
    """The caller is known but may not call this method (PERMISSION_DENIED)."""

    status_code: ClassVar[str] = "PERMISSION_DENIED"
    status_reason: ClassVar[str] = "PERMISSION_DENIED"


class CheckpointStateError(RuntimeError):
    """A control call the engine's process-checkpoint state forbids (vLLM 0.34+).

    While a checkpoint is prepared or under way, vLLM's engine refuses to
    sleep, wake up or resume; the message names the state and the way out.
    """

    status_code: ClassVar[str] = "FAILED_PRECONDITION"
    status_reason: ClassVar[str] = "CHECKPOINT_IN_PROGRESS"


class TokenShareError(RuntimeError):
    """A request whose prompt would take the prompt tokens waiting for prefill
    past its tenant's share of `--max-queued-prompt-tokens` (or past the pool):
    the message names the tenant, what it holds and its share. Retry later,
    or at another replica."""

    status_code: ClassVar[str] = "RESOURCE_EXHAUSTED"
    status_reason: ClassVar[str] = "TOKEN_SHARE"
