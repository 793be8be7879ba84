"""The hooks every interceptor of this package is built from.

A `CallInterceptor` supplies only its own logic, through hooks; the wrapper
(`_wrapping.py`) owns the gRPC details (the four handler kinds, their
serializers, async-generator and `context.write` streaming, how a call ended)
and calls the hooks of every interceptor of a call from one place:

- `on_admit(method, metadata, context)`: before the request is read; raise
  `Refusal` to refuse the call (authentication): the interceptors inside
  the refusing one never see it.
- `on_start(call)`: before the handler runs and before any request message is
  read; may `await call.context.abort(...)` to reject the call (the handler
  then never runs).
- `on_request(call, message)`: each request message (unary, iterated or `context.read()`).
- `on_response(call, message)`: each response message, either streaming style;
  for a handler that streams by `yield`, only when `reads_responses(call)`
  said yes at the first one (a hook may read a record the handler keeps
  instead, see `vllm_servicer.wire.usage`).
- `on_finish(call)`: exactly once per call that started, with `call.code` set:
  OK, the aborted code, CANCELLED (client cancel), DEADLINE_EXCEEDED or UNKNOWN.

Before any call, `mount()` tells each interceptor of its stack what the mount
keeps that an interceptor may read (the in-flight count, the load reports):
`on_mount(mount)`, with a `MountContext`.

And two questions, asked once per method when its handler is wrapped:
`read_deadline(method)`, how long a started call may wait for each request
message, and `write_deadline(method)`, how long each streamed response
message may wait for the client to take it (for each, the shortest any
interceptor of the stack asks for holds).

A hook that a subclass does not override is never called. However many
interceptors a call has, each streamed message makes one generator hop through
the wrapper, not one per interceptor.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import grpc

from ._call import Call, Context, Metadata, ReadDeadline, WriteDeadline
from ._wrapping import HandlerCache, Layers, Segment, wrap

if TYPE_CHECKING:
    from ..load_reports.report import LoadReporter
    from ._wrapping import Continuation, Handler

logger = logging.getLogger("vllm_servicer.interceptors")

MethodFilter = Callable[[str], bool]
"""A predicate on the full method name, "/package.Service/Method"."""


def all_methods(method: str) -> bool:
    """The default filter: every method."""
    return True


def methods_of(*services: str) -> MethodFilter:
    """A filter matching every method of the named services (full names)."""
    prefixes = tuple(f"/{s}/" for s in services)
    return lambda method: method.startswith(prefixes)


def except_methods_of(*services: str) -> MethodFilter:
    """A filter matching every method except those of the named services."""
    inner = methods_of(*services)
    return lambda method: not inner(method)


def only_methods(*methods: str) -> MethodFilter:
    """A filter matching exactly the named methods ("/package.Service/Method")."""
    names = frozenset(methods)
    return names.__contains__


class InflightCount(Protocol):
    """What the interceptors of a mount read of its in-flight count (an
    `InflightInterceptor`)."""

    @property
    def limited_total(self) -> int:
        """Limited calls in flight, in this process."""


@dataclasses.dataclass(frozen=True)
class MountContext:
    """What `mount()` keeps that the interceptors of its stack may read (`on_mount`).

    Attributes:
        inflight: the count of engine calls in flight that GetServerInfo, a
            limit and a drain read (the stack's `InflightInterceptor`).
        load_reporter: the engine's load as balancers read it (ORCA), or
            None when the mount sends no load reports.
    """

    inflight: InflightCount
    load_reporter: LoadReporter | None = None


class CallInterceptor(grpc.aio.ServerInterceptor):
    """Base class: a grpc.aio server interceptor built from per-call hooks.

    Works both server-wide (`grpc.aio.server(interceptors=[...])`, better as
    one `Pipeline([...])` for a stack) and for the services `mount(...,
    interceptors=[...])` adds. Handlers written as plain (sync) functions,
    which grpc.aio runs in its thread pool, pass through without hooks (or are
    refused, by an interceptor that `fails_closed`).

    Args:
        methods: which methods the interceptor applies to (default: all); the
            rest pass through untouched.
    """

    enclosing: grpc.aio.ServerInterceptor | None = None
    """An interceptor that must wrap this one's hooks (tracing's span), or None."""

    fails_closed = False
    """Whether a call this interceptor cannot check (a sync handler) is refused."""

    def __init__(self, *, methods: MethodFilter = all_methods) -> None:
        self._applies = methods
        self._applies_cache: dict[str, bool] = {}
        own = type(self)
        self.has_admit_hook = own.on_admit is not CallInterceptor.on_admit
        self.has_request_hook = own.on_request is not CallInterceptor.on_request
        self.has_response_hook = own.on_response is not CallInterceptor.on_response
        self._handlers = HandlerCache()

    # ----- hooks --------------------------------------------------------------

    def on_mount(self, mount: MountContext) -> None:
        """Once per `mount()` whose stack holds this interceptor, before any call:
        what the mount keeps that this interceptor may read (default: nothing)."""

    async def on_admit(self, method: str, metadata: Metadata, context: Context) -> None:
        """Before the request is parsed; raise `Refusal` to refuse the call."""

    async def on_start(self, call: Call) -> None:
        """Before the handler; abort through `call.context` to reject the call."""

    def on_request(self, call: Call, message: object) -> None:
        """Each request message."""

    def on_response(self, call: Call, message: object) -> None:
        """Each response message."""

    def reads_responses(self, call: Call) -> bool:
        """Whether `on_response` sees the messages of `call` (default: yes).

        Asked once, at the call's first response message (the handler has
        begun by then), by a handler that streams by `yield`.
        """
        return True

    def on_finish(self, call: Call) -> None:
        """Once per started call, after it ended; `call.code` says how."""

    def read_deadline(self, method: str) -> ReadDeadline | None:
        """How long a call of `method` this interceptor holds a slot for may wait
        for each request message: its unary one, each of a client stream (None:
        as long as it likes).

        Asked once per method, when its handler is wrapped.
        """
        return None

    def write_deadline(self, method: str) -> WriteDeadline | None:
        """How long a streamed response message of a call of `method` this
        interceptor holds a slot for may wait for the client to take it (None:
        as long as it likes).

        Asked once per method, when its handler is wrapped.
        """
        return None

    # ----- plumbing -----------------------------------------------------------

    def applies_to(self, method: str) -> bool:
        """Whether this interceptor runs for `method` ("/package.Service/Method")."""
        cached = self._applies_cache.get(method)
        if cached is None:
            # Unknown method names come from clients: bound the cache.
            cached = bool(self._applies(method))
            if len(self._applies_cache) < 4096:
                self._applies_cache[method] = cached
        return cached

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> Handler | None:
        # Alone (server-wide, not in a Pipeline): wrapped as a pipeline of one.
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return self._handlers.get(handler_call_details.method, handler, self._wrap_alone)

    def _wrap_alone(self, method: str, handler: Handler) -> Handler:
        segments: list[Segment] = []
        if self.applies_to(method):
            if self.enclosing is not None:
                segments.append(self.enclosing)
            segments.append(Layers((self,)))
        return wrap(segments, method, handler)

    def finish(self, call: Call, code: grpc.StatusCode) -> None:
        """Record how `call` ended and run `on_finish`, once."""
        if call.code is not None:
            return
        call.code = code
        try:
            self.on_finish(call)
        except Exception:
            # Bookkeeping must never change how the call ends.
            logger.exception("on_finish of %s failed for %s", type(self).__name__, call.method)
