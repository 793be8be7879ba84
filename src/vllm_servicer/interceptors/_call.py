"""One call as the hooks see it, how it ended, the refusal that ends it early,
and its waits on its client: how long each request message may take to
arrive, and each response message to be taken."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeAlias, cast

import grpc

logger = logging.getLogger("vllm_servicer.interceptors")

Context: TypeAlias = grpc.aio.ServicerContext[object, object]
"""A call's ServicerContext, as a wrapper or hook of any method sees it."""

Metadata: TypeAlias = tuple[tuple[str, str | bytes], ...]
"""A call's invocation metadata: its (key, value) pairs."""


def invocation_metadata(context: Context) -> Metadata:
    """The call's invocation metadata, as grpc.aio's server gives it."""
    # Typed `grpc.aio.Metadata | None` by the stubs; the server's is a tuple of pairs.
    return cast(Metadata, context.invocation_metadata())


# A cancel this close to the deadline is the deadline (see ended_code): a
# fixed allowance plus a share of the call's age, since the server learns its
# deadline only when the call arrives, later than the client started its timer.
_DEADLINE_SLACK_S = 0.25
_DEADLINE_SLACK_SHARE = 0.1


class Call:
    """One RPC as the hooks see it.

    Attributes:
        method: "/package.Service/Method".
        service: "package.Service".
        name: "Method".
        kind: "unary_unary", "unary_stream", "stream_unary" or "stream_stream".
        metadata: the invocation metadata, a tuple of (key, value) pairs.
        context: the call's ServicerContext.
        started: time.perf_counter() when the call reached the handler wrapper.
        code: how the call ended (None until just before on_finish).
        state: free per-call slot for the interceptor (None until it sets one).
    """

    __slots__ = (
        "code",
        "context",
        "kind",
        "metadata",
        "method",
        "name",
        "service",
        "started",
        "state",
    )

    def __init__(self, method: str, kind: str, metadata: Metadata, context: Context) -> None:
        self.method = method
        service, _, name = method[1:].rpartition("/")
        self.service = service
        self.name = name
        self.kind = kind
        self.metadata = metadata
        self.context = context
        self.started = time.perf_counter()
        self.code: grpc.StatusCode | None = None
        self.state: Any = None


def ended_code(context: Context, exc: BaseException | None, started: float) -> grpc.StatusCode:
    if exc is None:
        code = context.code()
        # A handler may set a code without raising (context.set_code).
        return code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.OK
    if isinstance(exc, grpc.aio.AbortError):
        code = context.code()
        return code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        # grpc cancels the handler task both for a client cancel and at the
        # deadline; only the time left tells them apart. The client's own timer
        # usually fires first and its cancel arrives a transit time before ours.
        # A cancel that lands while grpc awaits a write leaves the response
        # generators suspended: they are closed (GeneratorExit), not cancelled.
        remaining = context.time_remaining()
        slack = _DEADLINE_SLACK_S + _DEADLINE_SLACK_SHARE * (time.perf_counter() - started)
        if remaining is not None and remaining <= slack:
            return grpc.StatusCode.DEADLINE_EXCEEDED
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN


class Refusal(Exception):
    """Raised by `on_admit` to refuse a call before its request is read.

    Args:
        code: the status the call ends with.
        details: the status message.
        log: called with the call's context when the refusal is sent (to log it).
    """

    def __init__(
        self, code: grpc.StatusCode, details: str, log: Callable[[Context], None] | None = None
    ) -> None:
        super().__init__(details)
        self.code = code
        self.details = details
        self.log = log

    async def abort(self, context: Context, method: str) -> None:
        if self.log is not None:
            self.log(context)
        await context.abort(self.code, self.details)


@dataclass(frozen=True)
class ReadDeadline:
    """How long a call may wait for each request message once it has started.

    A call that sends its headers and never its message (or a client stream
    that stops sending) holds every slot the interceptors gave it (in flight,
    call slots, keyless slots) for nothing; past the deadline it ends with
    DEADLINE_EXCEEDED and gives them back.

    Attributes:
        seconds: the wait, from the moment the wrapper starts reading.
        limit: what sets it, as the refusal names it (a flag, a field).
    """

    seconds: float
    limit: str

    def message(self) -> str:
        """The refusal's text."""
        return (
            f"request message not received in time: the limit ({self.limit}) is "
            f"{self.seconds:g} s for each message; send the message with the call, and each "
            "message of a stream within it"
        )


@dataclass(frozen=True)
class WriteDeadline:
    """How long a streamed response message may wait for its client to take it.

    A client that stops reading, or grants no HTTP/2 flow-control window,
    leaves grpc's write of the next message pending for ever, and the call
    with every slot it holds; past the deadline the call ends and gives them back.

    Attributes:
        seconds: the wait, from the moment the wrapper hands grpc the message.
        limit: what sets it, as the log and the refusal name it (a flag).
    """

    seconds: float
    limit: str

    def message(self) -> str:
        """Why the call ended."""
        return (
            f"response message not taken in time: the limit ({self.limit}) is "
            f"{self.seconds:g} s for the client to take each message; read the stream"
        )


class ClientWait:
    """One call's wait on its client: for a request message, or for the client to
    take a response message. The wrapper marks each wait, its deadline or an
    interceptor may end it.

    A call holds its slots while it moves; one that waits on its client does
    nothing with them. The pools (`CallSlotsInterceptor`, `InflightInterceptor`,
    `KeylessLimitInterceptor`) read these waits to give the slot of a call that
    does not move to a call that would: `cut_short` ends the wait now, as the
    deadline would.

    Attributes:
        task: the call's task (ending the wait cancels it).
        since: the loop time the current wait began; None while not waiting.
        expired: whether the wait was ended (the task cancelled for it).
        cut: whether an interceptor ended it (`cut_short`).
        reason: why it was cut short ("" for the deadline).
    """

    __slots__ = ("cut", "expired", "reason", "since", "task")

    def __init__(self) -> None:
        self.task = asyncio.current_task()
        self.since: float | None = None
        self.expired = False
        self.cut = False
        self.reason = ""

    def waited(self, now: float) -> float:
        """Seconds the current wait has lasted at loop time `now` (0: not waiting)."""
        since = self.since
        return 0.0 if since is None else now - since

    def expire(self) -> None:
        """End the wait now: its task is cancelled; a read turns that into
        DEADLINE_EXCEEDED (`Task.uncancel` tells it from a client's cancel)."""
        if self.expired or self.task is None:
            return
        self.expired = True
        self.task.cancel()

    def cut_short(self, reason: str) -> None:
        """End the wait now (or as soon as the next one begins); the call names `reason`."""
        self.cut = True
        self.reason = reason
        if self.since is not None:
            self.expire()


_client_wait: contextvars.ContextVar[ClientWait | None] = contextvars.ContextVar(
    "vllm_servicer_client_wait", default=None
)


def client_wait() -> ClientWait:
    """For an interceptor's `on_start`: the current call's wait on its client,
    which the wrapper marks and honours (grpc.aio runs each call in a task);
    the same object for every interceptor of the call."""
    found = _client_wait.get()
    if found is not None and found.task is asyncio.current_task():
        return found
    wait = ClientWait()
    _client_wait.set(wait)
    return wait


def client_wait_of_this_call() -> ClientWait | None:
    """For the wrapper: the wait an interceptor asked for in this call, if any."""
    wait = _client_wait.get()
    if wait is None or wait.task is not asyncio.current_task():
        return None
    return wait


class WaitWatch:
    """The calls of one method waiting on their client (for a request message, or
    for a response message to be taken), oldest first, and one timer for the oldest.

    Every call of a method has the same deadline, so they expire in the order
    they began waiting: a wait costs an entry in an ordered dict, not a timer
    of its own (a timer per call cost a unary call 8% more CPU). Without a
    deadline a wait is only marked, for a pool that may take its slot back.
    """

    __slots__ = ("_deadline", "_loop", "_timer", "_waiting")

    def __init__(self, deadline: ReadDeadline | WriteDeadline | None) -> None:
        self._deadline = deadline
        self._waiting: dict[ClientWait, None] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def begin(self, wait: ClientWait) -> None:
        """`wait` waits on its client from now until `end`, its deadline at most."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        wait.since = now
        if self._deadline is None:
            return
        if loop is not self._loop:  # a new loop (a test's): the old timer and waits are gone
            self._loop, self._timer = loop, None
            self._waiting.clear()
        expires = now + self._deadline.seconds
        self._waiting[wait] = None
        if self._timer is None:
            self._timer = loop.call_at(expires, self._expire)

    @property
    def deadline(self) -> ReadDeadline | WriteDeadline | None:
        """What ends a wait (None: only marked)."""
        return self._deadline

    def end(self, wait: ClientWait) -> None:
        """`wait`'s client answered (or the call ended)."""
        wait.since = None
        self._waiting.pop(wait, None)

    def _expire(self) -> None:
        """End every wait past its deadline; the timer moves to the next one."""
        self._timer = None
        loop = self._loop
        assert loop is not None
        now = loop.time()
        seconds = self._deadline.seconds if self._deadline is not None else 0.0
        waiting = self._waiting
        while waiting:
            wait = next(iter(waiting))
            # A wait here began (`begin`) and has not ended (`end` takes it out).
            expires = (wait.since or now) + seconds
            if expires > now:
                self._timer = loop.call_at(expires, self._expire)
                return
            del waiting[wait]
            if isinstance(self._deadline, WriteDeadline):
                logger.info("%s", self._deadline.message())
            wait.expire()
