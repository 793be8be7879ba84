"""The exceptions this package raises for a request it will not serve.

Each names the request field at fault where there is one. `status.py` maps
them (and vLLM's own) to gRPC status codes; this module knows nothing of gRPC,
so any layer can raise them.
"""

from __future__ import annotations


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


class MediaUnavailableError(RuntimeError):
    """An image could not be fetched for a reason on the far side (no answer in
    time, connection refused, a 5xx): the same request may succeed later.

    Args:
        field: the request field naming the image.
        reason: what went wrong.
    """

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class UnsupportedError(RuntimeError):
    """The engine lacks a feature this RPC needs (no pooling runner, no profiler).

    Args:
        message: what is missing and how to enable it.
        field: the request field that needs it, when one does (named in the message).
    """

    def __init__(self, message: str, *, field: str = "") -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


class UnimplementedFieldError(NotImplementedError):
    """A request field this server does not implement: refused, never ignored.

    Args:
        field: the request field, as a dotted path (e.g. "mm_inputs").
        reason: why, and what would serve it instead.
    """

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class FieldOutOfRangeError(LookupError):
    """A request field whose value lies past what this server can serve (no history kept).

    Args:
        field: the request field.
        reason: what range is served.
    """

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class NotEnabledError(RuntimeError):
    """The RPC needs an engine feature that is switched off (e.g. KV-cache events)."""


class TooManySubscribersError(RuntimeError):
    """A streaming subscription past the server's limit on concurrent subscribers."""


class EventsLostError(RuntimeError):
    """Events a subscriber needs are gone: past the publisher's replay buffer, or it restarted.

    The subscriber's view can no longer be made whole; it resubscribes from
    the current state.
    """
