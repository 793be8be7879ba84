"""The one way a handler is wrapped: by `mount()`, by `Pipeline` server-wide, by
a `CallInterceptor` alone.

This module alone knows grpc's four handler kinds. `wrap(segments, ...)`
builds a method's handler once, innermost segment first:

- a run of `CallInterceptor`s becomes one wrapper (`_fused`), whose hooks are
  called in order from one place, so a streamed message makes one generator
  hop however many interceptors there are;
- any other grpc.aio server interceptor (OpenTelemetry's, which
  `TracingInterceptor` brings as its `enclosing` one, or a host's own) is
  asked per call what to run around the handler inside it (`_relay`), as a
  server would ask it.

The order of a call, in every wrapper:

1. `on_admit` of each interceptor of the run, outermost first; the first
   `Refusal` ends the call, and only the interceptors outside the refusing
   one see it (`on_start`, `on_finish`).
2. `on_start` of each, outermost first; an abort there ends the call.
3. The innermost wrapper reads the request and gives it to `on_request`;
   each response message goes to `on_response`. A unary request is read by
   that wrapper, not by grpc (it is registered as a request stream of one
   message, the same on the wire): a refused call's request is never
   received, inflated nor parsed, whatever sits between the wrappers. The
   read has the shortest deadline any interceptor of the stack asks for
   (`read_deadline`): a call whose message does not come in time ends
   DEADLINE_EXCEEDED, and its slots come back.
4. The handler's exception, if any, goes through the error layer (an
   `ErrorLayer` turning it into a status) before anything sees the outcome.
5. `on_finish` of each started interceptor, innermost first, with the code.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn, Protocol, TypeAlias

import grpc

from ..context import blame_caller
from ..errors import RequestNotSentError
from ._call import (
    Call,
    ClientWait,
    Context,
    Metadata,
    ReadDeadline,
    Refusal,
    WaitWatch,
    WriteDeadline,
    client_wait_of_this_call,
    ended_code,
    invocation_metadata,
)

if TYPE_CHECKING:
    from types import AsyncGeneratorType

    Handler: TypeAlias = grpc.RpcMethodHandler[Any, Any]
    """A method's handler. Its message types are the method's own: grpc's stubs
    type the handlers of any method so (`method_handlers_generic_handler`)."""

    Continuation: TypeAlias = Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]]
    """What a server interceptor calls for the handler of a call's method."""

    Behaviour: TypeAlias = Callable[..., Any]
    """The function grpc calls for a method, `(request or request iterator, context)`,
    typed as grpc's stubs type it: a response, a coroutine or an async generator, by kind."""

    Responding: TypeAlias = Callable[..., Awaitable[object]]
    """A behaviour answering with one response: `async def`, returning it."""

    Streaming: TypeAlias = Callable[..., Awaitable[object] | AsyncGeneratorType[object, None]]
    """A behaviour streaming its responses: an async generator function, or an
    `async def` writing them through `context.write`."""

    Deserializer: TypeAlias = Callable[[bytes], object]

Requests: TypeAlias = AsyncIterator[object]
"""A call's request messages as grpc hands them to a handler of a client stream."""

MessageHooks: TypeAlias = list[tuple[Callable[[Call, object], None], Call]]
"""`on_request` or `on_response` hooks of one call, each with its `Call`."""

logger = logging.getLogger("vllm_servicer.interceptors")

ErrorLayer = Callable[[Context, Exception, str], Awaitable[object]]
"""`(context, exception, method)`: aborts the call with the status for the exception."""

_FACTORIES: dict[str, Callable[..., Handler]] = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


def kind_of(handler: Handler) -> str:
    """ "unary_unary", "unary_stream", "stream_unary" or "stream_stream"."""
    if handler.request_streaming:
        return "stream_stream" if handler.response_streaming else "stream_unary"
    return "unary_stream" if handler.response_streaming else "unary_unary"


def behaviour_of(handler: Handler) -> Behaviour:
    """The function grpc calls for `handler`."""
    behaviour: Behaviour = getattr(handler, kind_of(handler))
    return behaviour


def with_deserializer(handler: Handler, deserializer: Deserializer | None) -> Handler:
    """`handler` (grpc's method-handler tuple) parsing its requests with `deserializer`."""
    return _FACTORIES[kind_of(handler)](
        behaviour_of(handler),
        request_deserializer=deserializer,
        response_serializer=handler.response_serializer,
    )


def is_async(handler: Handler) -> bool:
    """Whether grpc.aio runs `handler` on the event loop (else in its thread pool)."""
    behaviour = behaviour_of(handler)
    return inspect.iscoroutinefunction(behaviour) or inspect.isasyncgenfunction(behaviour)


# The kind clients see of each method whose unary request a wrapper reads
# (registered as a stream of one message): what interceptors wrapping it later,
# OpenTelemetry's or a host's included, must still call it. A method's full name
# has one kind.
_DECLARED_KINDS: dict[str, str] = {}


def rpc_kind_of(handler: Handler, method: str) -> str:
    """The kind of `method` as its clients see it, though a wrapper of this
    module registers a unary request as a stream of one message."""
    return _DECLARED_KINDS.get(method) or kind_of(handler)


def _reading(kind: str) -> str:
    """The grpc kind under which a wrapper of a `kind` handler is registered.

    A unary request is read by the wrapper itself, once every interceptor has
    admitted and started the call: grpc then neither receives, inflates nor
    parses the bytes of a call that is refused.
    """
    return "stream_" + kind.split("_", 1)[1] if kind[0] == "u" else kind


def _registered(
    kind: str,
    method: str,
    declared: str,
    behaviour: Callable[..., object],
    inner: Handler,
    deserializer: Deserializer | None,
) -> Handler:
    """A handler running `behaviour` around a `kind` handler `inner` of `method`,
    registered as `_reading(kind)`; its clients see `declared`."""
    if kind[0] == "u":
        _DECLARED_KINDS[method] = declared
    return _FACTORIES[_reading(kind)](
        behaviour,
        request_deserializer=deserializer,
        response_serializer=inner.response_serializer,
    )


class CallDetails(grpc.HandlerCallDetails):
    """The method and metadata of one call, as interceptors receive them."""

    __slots__ = ("invocation_metadata", "method")

    def __init__(self, method: str, invocation_metadata: Metadata) -> None:
        self.method = method
        self.invocation_metadata = invocation_metadata


class UndecodableRequest:
    """Stands in for a request whose bytes did not parse."""

    __slots__ = ("error", "message_name")

    def __init__(self, message_name: str, error: Exception) -> None:
        self.message_name = message_name
        self.error = error


def tolerant(deserializer: Deserializer) -> Deserializer:
    """`deserializer`, returning an `UndecodableRequest` instead of raising.

    grpc answers a request its deserializer rejects (invalid UTF-8 in a string
    field, say) with UNKNOWN and a traceback in the log, which tells the client
    nothing; the wrapper answers INVALID_ARGUMENT instead.
    """
    descriptor = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
    name = getattr(descriptor, "full_name", "request")

    def parse(data: bytes) -> object:
        try:
            return deserializer(data)
        except Exception as exc:
            return UndecodableRequest(name, exc)

    return parse


_MISSING = object()
"""What the wrapper reads from a unary call whose client sent no message."""


async def _read_one(requests: Requests) -> object:
    """The one message of a unary request, read from grpc's request stream."""
    try:
        return await anext(requests)
    except StopAsyncIteration:
        return _MISSING


class _WaitWatch(WaitWatch):
    """A `WaitWatch` that also reads a request message within its deadline."""

    __slots__ = ()

    async def read(self, requests: Requests, wait: ClientWait | None) -> object:
        """`_read_one` within the deadline, or until `wait` is cut short.

        Raises:
            RequestNotSentError: the message did not come in time.
        """
        if wait is None:
            if self.deadline is None:
                return await _read_one(requests)
            wait = ClientWait()
        elif wait.cut:
            raise RequestNotSentError(wait.reason)
        self.begin(wait)
        try:
            return await _read_one(requests)
        except asyncio.CancelledError:
            if wait.expired and wait.task is not None and wait.task.uncancel() == 0:
                deadline = self.deadline
                reason = wait.reason or (deadline.message() if deadline is not None else "")
                raise RequestNotSentError(reason) from None
            raise
        finally:
            self.end(wait)


async def _each_in_time(requests: Requests, watch: _WaitWatch, wait: ClientWait) -> Requests:
    """A client stream's messages, each within the read deadline."""
    while True:
        try:
            message = await watch.read(requests, wait)
        except RequestNotSentError:
            blame_caller()  # its client stopped sending: no failure of the server's
            raise
        if message is _MISSING:
            return
        yield message


class Deadlines(NamedTuple):
    """How long a call of one method may wait on its client, each way (None: as
    long as it likes): the shortest any interceptor of the stack asks for."""

    read: ReadDeadline | None
    write: WriteDeadline | None


def _deadlines(segments: Sequence[Segment], method: str) -> Deadlines:
    """The shortest read and write deadlines any interceptor of `segments` asks for `method`."""
    interceptors = [i for s in segments if isinstance(s, Layers) for i in s.interceptors]
    reads = [r for i in interceptors if (r := i.read_deadline(method)) is not None]
    writes = [w for i in interceptors if (w := i.write_deadline(method)) is not None]
    return Deadlines(
        min(reads, key=lambda d: d.seconds) if reads else None,
        min(writes, key=lambda d: d.seconds) if writes else None,
    )


class Hooks(Protocol):
    """What the wrapper uses of an interceptor of a run (a `CallInterceptor`):
    its hooks, which of them it overrides, and its questions."""

    has_admit_hook: bool
    has_request_hook: bool
    has_response_hook: bool
    fails_closed: bool

    async def on_admit(self, method: str, metadata: Metadata, context: Context) -> None: ...
    async def on_start(self, call: Call) -> None: ...
    def on_request(self, call: Call, message: object) -> None: ...
    def on_response(self, call: Call, message: object) -> None: ...
    def reads_responses(self, call: Call) -> bool: ...
    def finish(self, call: Call, code: grpc.StatusCode) -> None: ...
    def read_deadline(self, method: str) -> ReadDeadline | None: ...
    def write_deadline(self, method: str) -> WriteDeadline | None: ...


class Layers:
    """The `CallInterceptor`s of one run that apply to one method, and their hooks."""

    __slots__ = ("interceptors", "request_hooks", "response_hooks")

    def __init__(self, interceptors: Sequence[Hooks]) -> None:
        self.interceptors = tuple(interceptors)
        self.request_hooks = tuple(i for i in self.interceptors if i.has_request_hook)
        self.response_hooks = tuple(i for i in self.interceptors if i.has_response_hook)


Segment = Layers | grpc.aio.ServerInterceptor
"""A run of CallInterceptors fused into one wrapper, or an interceptor asked per call."""


def wrap(
    segments: Sequence[Segment], method: str, handler: Handler, *, errors: ErrorLayer | None = None
) -> Handler:
    """`handler` of `method` with `segments` (outermost first) around it, built once.

    `errors` maps the handler's exceptions to statuses (the innermost wrapper
    hands them to it). A sync handler, which grpc runs in its thread pool where
    no hook can run, passes through untouched, unless an interceptor that must
    not let a call through unchecked (authentication) applies: then it is refused.
    """
    if not is_async(handler):
        return _sync_handler(handler, method, segments)
    if not segments and errors is None:
        return handler
    kind = rpc_kind_of(handler, method)
    innermost = segments[-1] if segments else None
    if not isinstance(innermost, Layers):
        # The innermost wrapper reads the request and maps errors: a fused one.
        innermost = Layers(())
        segments = [*segments, innermost]
    deadlines = _deadlines(segments, method)
    wrapped = _fused(handler, method, kind, innermost, errors, deadlines)
    for segment in reversed(segments[:-1]):
        if isinstance(segment, Layers):
            wrapped = _fused(wrapped, method, kind, segment, None, _NO_DEADLINES)
        else:
            wrapped = _relay(segment, wrapped, method, kind)
    return wrapped


class HandlerCache:
    """The wrapped handler of each method, built once for the handler grpc looks up.

    Server-wide, grpc hands an interceptor the method's handler on every call;
    it is the same object call after call unless an interceptor inside
    returns a new one each time, and then it is wrapped anew.
    """

    __slots__ = ("_wrapped",)

    def __init__(self) -> None:
        self._wrapped: dict[str, tuple[Handler, Handler]] = {}

    def get(
        self, method: str, handler: Handler, build: Callable[[str, Handler], Handler]
    ) -> Handler:
        """`build(method, handler)`, or what it returned for this same handler."""
        found = self._wrapped.get(method)
        if found is not None and found[0] is handler:
            return found[1]
        wrapped = build(method, handler)
        if found is not None or len(self._wrapped) < 4096:  # method names come from clients
            self._wrapped[method] = (handler, wrapped)
        return wrapped


class _HookedContext:
    """The real context, with `read` and `write` reported to the hooks."""

    __slots__ = ("_context", "_on_request", "_on_response")

    def __init__(
        self,
        context: Context,
        on_request: Callable[[object], None] | None,
        on_response: Callable[[object], None] | None,
    ) -> None:
        self._context = context
        self._on_request = on_request
        self._on_response = on_response

    async def read(self) -> object:
        message = await self._context.read()
        if self._on_request is not None and message is not grpc.aio.EOF:
            self._on_request(message)
        return message

    async def write(self, message: object) -> None:
        if self._on_response is not None:
            self._on_response(message)
        await self._context.write(message)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


async def _admit(
    layers: Sequence[Hooks], method: str, metadata: Metadata, context: Context
) -> tuple[int, Refusal | None]:
    """How many interceptors take part in the call, and the refusal that cut it short."""
    for index, interceptor in enumerate(layers):
        if interceptor.has_admit_hook:
            try:
                await interceptor.on_admit(method, metadata, context)
            except Refusal as refusal:
                return index, refusal
    return len(layers), None


def _fused(
    handler: Handler,
    method: str,
    kind: str,
    layers: Layers,
    errors: ErrorLayer | None,
    deadlines: Deadlines,
) -> Handler:
    """`handler` wrapped by every hook of `layers` and the error layer.

    `kind` is the method's kind as its clients see it. When `handler` takes a
    unary request, this wrapper reads it, after admission and every `on_start`,
    within the read deadline when there is one; around a wrapper that reads, a
    request is a stream of one message, hooked as it is read. A client
    stream's every message comes within the read deadline, and a streamed
    response's every message is taken within the write deadline.
    """
    physical = kind_of(handler)
    deserializer = handler.request_deserializer
    if physical[0] == "u" and deserializer is not None:
        deserializer = tolerant(deserializer)
    steps = _steps(physical, method, kind, layers, errors, deadlines.read)
    wrapper: Callable[[Requests, Context], object]
    if kind.endswith("stream"):
        wrapper = _streaming_response(
            behaviour_of(handler), steps, bool(layers.response_hooks), deadlines.write
        )
    else:
        wrapper = _unary_response(behaviour_of(handler), steps, bool(layers.response_hooks))
    return _registered(physical, method, kind, wrapper, handler, deserializer)


_NO_DEADLINES = Deadlines(None, None)

Started = list[tuple[Hooks, Call]]
"""The interceptors that started a call, outermost first, each with its `Call`."""


class _Steps(NamedTuple):
    """The steps every fused wrapper of one method takes, built once (`_steps`)."""

    begin: Callable[[Context, Started], Awaitable[None]]
    prepare: Callable[
        [Requests, Context, Started], Awaitable[tuple[object, Context | _HookedContext]]
    ]
    fail: Callable[[Context, Exception], Awaitable[None]]
    finish: Callable[[Started, Context, BaseException | None], None]


def _steps(
    physical: str,
    method: str,
    kind: str,
    layers: Layers,
    errors: ErrorLayer | None,
    deadline: ReadDeadline | None,
) -> _Steps:
    """The steps of the fused wrapper of a `physical` handler of `method` (whose
    clients see `kind`): the same for a unary and a streamed response."""
    reads_request = physical[0] == "u"
    interceptors = layers.interceptors
    watch = _WaitWatch(deadline)
    streams_requests = physical[0] == "s"
    streams_responses = kind.endswith("stream")
    response_hooked = bool(layers.response_hooks)
    context_hooked = (streams_requests and bool(layers.request_hooks)) or (
        streams_responses and response_hooked
    )

    async def begin(context: Context, started: Started) -> None:
        """Admit and start the call, filling `started`; abort if it is refused."""
        metadata = invocation_metadata(context)
        cut, refusal = await _admit(interceptors, method, metadata, context)
        for interceptor in interceptors[:cut]:
            call = Call(method, kind, metadata, context)
            started.append((interceptor, call))  # before on_start: an abort there still ends it
            await interceptor.on_start(call)
        if refusal is not None:
            await refusal.abort(context, method)

    async def prepare(
        requests: Requests, context: Context, started: Started
    ) -> tuple[object, Context | _HookedContext]:
        """The request (a message, or a client stream's messages) and the context
        the handler gets."""
        request: object
        if reads_request:
            try:
                request = await watch.read(requests, client_wait_of_this_call())
            except RequestNotSentError as error:
                await _reject_unsent(context, error, method, errors)
                raise  # aborted above; never reached
            if request is _MISSING or type(request) is UndecodableRequest:
                await _refuse_request(context, request, method, errors)
            if layers.request_hooks:
                for hook, call in _request_hooks(started):
                    hook(call, request)
        else:
            wait = client_wait_of_this_call()
            if wait is not None or deadline is not None:
                requests = _each_in_time(requests, watch, wait or ClientWait())
            if layers.request_hooks:
                requests = _counted(requests, _request_hooks(started))
            request = requests
        if context_hooked:
            return request, _hooked(context, started, streams_requests)
        return request, context

    async def fail(context: Context, error: Exception) -> None:
        """Hand `error` to the error layer, which aborts; re-raise what it raises."""
        if type(error) is RequestNotSentError:  # a client stream's message came too late
            await _reject_unsent(context, error, method, errors)
        if errors is None or isinstance(error, grpc.aio.AbortError):
            raise error
        await errors(context, error, method)
        raise error  # pragma: no cover - the error layer aborts

    def finish(started: Started, context: Context, exc: BaseException | None) -> None:
        """`on_finish` of each started interceptor, innermost first, with the code."""
        if not started:
            return
        code = ended_code(context, exc, started[0][1].started)
        for interceptor, call in reversed(started):
            interceptor.finish(call, code)

    return _Steps(begin, prepare, fail, finish)


async def _refuse_request(
    context: Context, request: object, method: str, errors: ErrorLayer | None
) -> NoReturn:
    """Abort a call whose one request message did not come, or did not parse."""
    if not isinstance(request, UndecodableRequest):  # no message came
        request = UndecodableRequest(method, ValueError("no request message was sent"))
    await _reject_undecodable(context, request, method, errors)


def _request_hooks(started: Started) -> MessageHooks:
    """The `on_request` hooks of the interceptors that started the call."""
    return [(i.on_request, c) for i, c in started if i.has_request_hook]


def _response_hooks(started: Started) -> MessageHooks:
    """The `on_response` hooks of the interceptors that read the call's streamed
    responses. Chosen at the first message, once the handler has begun: a hook
    may read a record the handler keeps instead."""
    return [
        (i.on_response, c) for i, c in started if i.has_response_hook and _reads_responses(i, c)
    ]


def _response_wait(deadline: WriteDeadline | None) -> ClientWait | None:
    """The call's wait on its client to take each response message: marked when a
    pool may take its slot back, or a deadline ends the wait (None: neither)."""
    wait = client_wait_of_this_call()
    if wait is None and deadline is not None:
        wait = ClientWait()
    return wait


def _unary_response(
    behaviour: Responding, steps: _Steps, response_hooked: bool
) -> Callable[[Requests, Context], Awaitable[object]]:
    """The fused wrapper of a handler returning one response: `behaviour` within `steps`."""
    begin, prepare, fail, finish = steps

    async def unary_response(requests: Requests, context: Context) -> object:
        exc: BaseException | None = None
        started: Started = []
        try:
            await begin(context, started)
            request, inner = await prepare(requests, context, started)
            try:
                response = await behaviour(request, inner)
            except Exception as error:
                await fail(context, error)
            if response_hooked and response is not None:
                for interceptor, call in started:
                    if interceptor.has_response_hook:
                        interceptor.on_response(call, response)
            return response
        except BaseException as error:
            exc = error
            raise
        finally:
            finish(started, context, exc)

    return unary_response


def _streaming_response(
    behaviour: Streaming, steps: _Steps, response_hooked: bool, deadline: WriteDeadline | None
) -> Callable[[Requests, Context], AsyncIterator[object]]:
    """The fused wrapper of a handler streaming its responses, by `yield` or by
    `context.write`: `behaviour` within `steps`, each message yielded taken by
    the client within `deadline` when there is one."""
    begin, prepare, fail, finish = steps
    watch = _WaitWatch(deadline)

    async def streaming_response(requests: Requests, context: Context) -> AsyncIterator[object]:
        exc: BaseException | None = None
        started: Started = []
        result: Awaitable[object] | AsyncGeneratorType[object, None] | None = None
        wait: ClientWait | None = None
        try:
            await begin(context, started)
            request, inner = await prepare(requests, context, started)
            wait = _response_wait(deadline)
            try:
                result = behaviour(request, inner)
                if inspect.isasyncgen(result):
                    hooks = None
                    if response_hooked:
                        async for message in result:
                            hooks = _response_hooks(started)
                            for hook, call in hooks:
                                hook(call, message)
                            if wait is None:
                                yield message
                            else:
                                watch.begin(wait)
                                yield message
                                watch.end(wait)
                            break
                    if wait is not None:
                        # grpc resumes this generator once it has sent the message:
                        # a client that takes none leaves it suspended here.
                        begin_write, end_write = watch.begin, watch.end
                        async for message in result:
                            if hooks:
                                for hook, call in hooks:
                                    hook(call, message)
                            begin_write(wait)
                            yield message
                            end_write(wait)
                    elif hooks:
                        async for message in result:
                            for hook, call in hooks:
                                hook(call, message)
                            yield message
                    else:
                        async for message in result:
                            yield message
                else:
                    await result  # a context.write-style handler
            except Exception as error:
                await fail(context, error)
        except BaseException as error:
            exc = error
            raise
        finally:
            if wait is not None:
                watch.end(wait)
            try:
                if exc is not None and inspect.isasyncgen(result):
                    # Cancelled at our `yield`, the handler's generator is still
                    # suspended at its own: close it now (its cleanup, e.g. an
                    # engine abort, runs before on_finish) rather than at GC.
                    await result.aclose()
            finally:
                finish(started, context, exc)

    return streaming_response


def _returning(handler: Handler) -> Continuation:
    async def continuation(details: grpc.HandlerCallDetails) -> Handler:
        return handler

    return continuation


def _with_behaviour(handler: Handler, kind: str, behaviour: Callable[..., object]) -> Handler:
    """A `kind` handler like `handler` (grpc's method-handler tuple), running `behaviour`."""
    return _FACTORIES[kind](
        behaviour,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _relay(
    interceptor: grpc.aio.ServerInterceptor, inner: Handler, method: str, kind: str
) -> Handler:
    """`inner` behind an interceptor that is not a CallInterceptor, asked per call.

    Such an interceptor may return another handler per call, so it is asked
    per call, as a server would ask it, and the wrapper relays what the
    handler it returned does. `inner` reads the request itself: the
    interceptor sees a unary request as a stream of one message.
    """

    async def resolve(context: Context, handler: Handler = inner) -> Handler:
        details = CallDetails(method, invocation_metadata(context))
        resolved = await interceptor.intercept_service(_returning(handler), details)
        if resolved is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"method {method} not found")
        return resolved

    async def request_of(resolved: Handler, requests: Requests, context: Context) -> object:
        if resolved.request_streaming or kind[0] == "s":
            return requests
        # An interceptor put a unary handler of its own in place of ours.
        request = await _read_one(requests)
        if request is _MISSING or type(request) is UndecodableRequest:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request could not be parsed")
        return request

    if not kind.endswith("stream"):

        async def unary_response(requests: Requests, context: Context) -> object:
            resolved = await resolve(context)
            request = await request_of(resolved, requests, context)
            return await behaviour_of(resolved)(request, context)

        return _registered(kind, method, kind, unary_response, inner, inner.request_deserializer)

    inner_kind = kind_of(inner)
    inner_behaviour = behaviour_of(inner)

    async def streaming_response(requests: Requests, context: Context) -> AsyncIterator[object]:
        opened: list[object] = []

        def opening(request: object, context: Context) -> object:
            result = inner_behaviour(request, context)
            opened.append(result)
            return result

        resolved = await resolve(context, _with_behaviour(inner, inner_kind, opening))
        request = await request_of(resolved, requests, context)
        result = behaviour_of(resolved)(request, context)
        if inspect.isasyncgen(result):
            try:
                async for message in result:
                    yield message
            except BaseException:
                # Cancelled at our `yield`: close it now, not at GC. The wrapper
                # `inner` gave the interceptor first: OpenTelemetry's leaves it to GC,
                # so its span would end before `inner`'s hooks set the call's code.
                for opened_result in opened:
                    if inspect.isasyncgen(opened_result):
                        await opened_result.aclose()
                await result.aclose()
                raise
        else:
            await result

    return _registered(kind, method, kind, streaming_response, inner, inner.request_deserializer)


def _reads_responses(interceptor: Hooks, call: Call) -> bool:
    try:
        return interceptor.reads_responses(call)
    except Exception:
        # Bookkeeping must never change how the call ends: give it the messages.
        logger.exception("reads_responses of %s failed", type(interceptor).__name__)
        return True


async def _counted(requests: Requests, hooks: MessageHooks) -> Requests:
    async for message in requests:
        for hook, call in hooks:
            hook(call, message)
        yield message


def _hooked(context: Context, started: Started, streams_requests: bool) -> _HookedContext:
    request_hooks = _request_hooks(started)
    response_hooks = [(i.on_response, c) for i, c in started if i.has_response_hook]

    def on_request(message: object) -> None:
        for hook, call in request_hooks:
            hook(call, message)

    def on_response(message: object) -> None:
        for hook, call in response_hooks:
            hook(call, message)

    return _HookedContext(
        context,
        on_request if streams_requests and request_hooks else None,
        on_response if response_hooks else None,
    )


async def _reject_undecodable(
    context: Context, request: UndecodableRequest, method: str, errors: ErrorLayer | None
) -> NoReturn:
    from ..errors import FieldError, InvalidRequestError

    # A parser that names the field at fault (one the schema lacks) is passed on as it is.
    error = request.error
    if not isinstance(error, FieldError):
        error = InvalidRequestError("request", f"not a valid {request.message_name}: {error}")
    if errors is not None:
        await errors(context, error, method)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))


async def _reject_unsent(
    context: Context, error: RequestNotSentError, method: str, errors: ErrorLayer | None
) -> NoReturn:
    blame_caller()  # its client never sent the message: no failure of the server's
    if errors is not None:
        await errors(context, error, method)
    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(error))


def _sync_handler(handler: Handler, method: str, segments: Sequence[Segment]) -> Handler:
    """A plain (sync) handler: passed through, or refused where authentication applies."""
    for segment in segments:
        if isinstance(segment, Layers) and any(i.fails_closed for i in segment.interceptors):
            logger.error("%s has a sync handler, which cannot be checked: refused", method)
            return _refusing(handler, method)
    return handler


def _refusing(handler: Handler, method: str) -> Handler:
    """An async handler of the kind of `handler` that refuses every call, unread."""
    details = "method cannot be authenticated"

    async def refuse(requests: Requests, context: Context) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, details)

    async def refuse_stream(requests: Requests, context: Context) -> AsyncIterator[object]:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, details)
        yield  # pragma: no cover - makes this an async generator

    behaviour = refuse_stream if handler.response_streaming else refuse
    kind = kind_of(handler)
    return _registered(kind, method, kind, behaviour, handler, handler.request_deserializer)
