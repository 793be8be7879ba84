"""One wrapper per call for a whole stack of interceptors.

This module alone knows grpc's four handler kinds. Every `CallInterceptor`
that applies to a call runs inside a single wrapper: their hooks are called in
order from one place, Starlette-style, so a streamed message makes one
generator hop however many interceptors there are. An interceptor that must
wrap grpc's behaviour itself (OpenTelemetry's, which `TracingInterceptor`
brings as its `enclosing` interceptor) splits the stack at that point and
wraps everything inside it.

The order of a call:

1. `on_admit` of each interceptor, outermost first, before the request is
   parsed; the first `Refusal` ends the call, and only the interceptors
   outside the refusing one see it (`on_start`, `on_finish`).
2. `on_start` of each, outermost first; an abort there ends the call.
3. The innermost wrapper reads the request and gives it to `on_request`;
   each response message goes to `on_response`. A unary request is read by
   the wrapper, not by grpc (the wrapper is registered as a request stream of
   one message, the same on the wire): a refused call's request is never
   received, inflated nor parsed, whatever encloses the wrapper.
4. The handler's exception, if any, goes through the error layer (an
   `ErrorLayer` turning it into a status) before anything sees the outcome.
5. `on_finish` of each started interceptor, innermost first, with the code.

Two ways in: `Pipeline` is a grpc.aio server interceptor (server-wide; grpc
asks it per call, so admission happens at lookup time), and `Pipeline.wrap`
wraps one method's handler once, for `mount()` (admission happens in the
call). Either way the request is read only after every interceptor of the
stack admitted and started the call, OpenTelemetry's wrapper or a host's own
interceptor between them or not; an interceptor outside the wrapper sees the
method as request-streaming.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from ._base import Call, CallInterceptor, Refusal, ended_code

if TYPE_CHECKING:
    Continuation = Callable[
        [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
    ]

logger = logging.getLogger("vllm_servicer.interceptors")

ErrorLayer = Callable[[Any, Exception, str], Awaitable[Any]]
"""`(context, exception, method)`: aborts the call with the status for the exception."""

_FACTORIES: dict[str, Any] = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


def kind_of(handler: Any) -> str:
    """ "unary_unary", "unary_stream", "stream_unary" or "stream_stream"."""
    if handler.request_streaming:
        return "stream_stream" if handler.response_streaming else "stream_unary"
    return "unary_stream" if handler.response_streaming else "unary_unary"


def behaviour_of(handler: Any) -> Any:
    """The function grpc calls for `handler`."""
    return getattr(handler, kind_of(handler))


def is_async(handler: Any) -> bool:
    """Whether grpc.aio runs `handler` on the event loop (else in its thread pool)."""
    behaviour = behaviour_of(handler)
    return inspect.iscoroutinefunction(behaviour) or inspect.isasyncgenfunction(behaviour)


def rebuild(handler: Any, behaviour: Any, request_deserializer: Any) -> Any:
    """A handler of the kind of `handler` that runs `behaviour`."""
    return _FACTORIES[kind_of(handler)](
        behaviour,
        request_deserializer=request_deserializer,
        response_serializer=handler.response_serializer,
    )


# The kind clients see of each method whose unary request a wrapper reads
# (registered as a stream of one message): what interceptors wrapping it later,
# OpenTelemetry's or a host's included, must still call it. A method's full name
# has one kind.
_DECLARED_KINDS: dict[str, str] = {}


def _rebuilt(
    kind: str, method: str, declared: str, behaviour: Any, request_deserializer: Any, handler: Any
) -> Any:
    """A handler running `behaviour`, registered as `_reading(kind)`, of a
    method whose clients see `declared`."""
    if kind[0] == "u":
        _DECLARED_KINDS[method] = declared
    return _FACTORIES[_reading(kind)](
        behaviour,
        request_deserializer=request_deserializer,
        response_serializer=handler.response_serializer,
    )


def rpc_kind_of(handler: Any, method: str) -> str:
    """The kind of `method` as its clients see it, though a wrapper of this
    module registers a unary request as a stream of one message."""
    return _DECLARED_KINDS.get(method) or kind_of(handler)


class CallDetails(grpc.HandlerCallDetails):
    """The method and metadata of one call, as interceptors receive them."""

    __slots__ = ("invocation_metadata", "method")

    def __init__(self, method: str, invocation_metadata: Any) -> None:
        self.method = method
        self.invocation_metadata = invocation_metadata


class UndecodableRequest:
    """Stands in for a request whose bytes did not parse."""

    __slots__ = ("error", "message_name")

    def __init__(self, message_name: str, error: Exception) -> None:
        self.message_name = message_name
        self.error = error


def tolerant(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """`deserializer`, returning an `UndecodableRequest` instead of raising.

    grpc answers a request its deserializer rejects (invalid UTF-8 in a string
    field, say) with UNKNOWN and a traceback in the log, which tells the client
    nothing; the wrapper answers INVALID_ARGUMENT instead.
    """
    descriptor = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
    name = getattr(descriptor, "full_name", "request")

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:
            return UndecodableRequest(name, exc)

    return parse


def _returning(handler: Any) -> Continuation:
    async def continuation(details: grpc.HandlerCallDetails) -> Any:
        return handler

    return continuation


def _resolve_now(awaitable: Awaitable[Any]) -> Any:
    """The result of a coroutine that finishes without suspending.

    An enclosing interceptor wraps a handler it is handed at once (it awaits
    only our continuation, which returns at once): run it so at mount time.
    """
    coroutine: Any = awaitable
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("an enclosing interceptor suspended while wrapping a handler")


class _Layers:
    """The interceptors of one segment that apply to one method, and their hooks."""

    __slots__ = ("admitting", "interceptors", "request_hooks", "response_hooks")

    def __init__(self, interceptors: Sequence[CallInterceptor]) -> None:
        self.interceptors = tuple(interceptors)
        self.admitting = tuple(i for i in self.interceptors if i.has_admit_hook)
        self.request_hooks = tuple(i for i in self.interceptors if i.has_request_hook)
        self.response_hooks = tuple(i for i in self.interceptors if i.has_response_hook)


class _HookedContext:
    """The real context, with `read` and `write` reported to the hooks."""

    __slots__ = ("_context", "_on_request", "_on_response")

    def __init__(
        self,
        context: Any,
        on_request: Callable[[Any], None] | None,
        on_response: Callable[[Any], None] | None,
    ) -> None:
        self._context = context
        self._on_request = on_request
        self._on_response = on_response

    async def read(self) -> Any:
        message = await self._context.read()
        if self._on_request is not None and message is not grpc.aio.EOF:
            self._on_request(message)
        return message

    async def write(self, message: Any) -> None:
        if self._on_response is not None:
            self._on_response(message)
        await self._context.write(message)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


async def _admit(
    layers: Sequence[CallInterceptor], method: str, metadata: Any, context: Any
) -> tuple[int, Refusal | None]:
    """How many interceptors take part in the call, and the refusal that cut it short."""
    for index, interceptor in enumerate(layers):
        if interceptor.has_admit_hook:
            try:
                await interceptor.on_admit(method, metadata, context)
            except Refusal as refusal:
                return index, refusal
    return len(layers), None


_MISSING = object()
"""What the wrapper reads from a unary call whose client sent no message."""


def _reading(kind: str) -> str:
    """The grpc kind under which a wrapper of a `kind` handler is registered.

    A unary request is read by the wrapper itself, once every interceptor has
    admitted and started the call: grpc then neither receives, inflates nor
    parses the bytes of a call that is refused. On the wire a unary call and a
    request stream of one message are the same.
    """
    return "stream_" + kind.split("_", 1)[1] if kind[0] == "u" else kind


async def _read_one(requests: Any) -> Any:
    """The one message of a unary request, read from grpc's request stream."""
    try:
        return await anext(requests)
    except StopAsyncIteration:
        return _MISSING


def _fused(
    handler: Any,
    method: str,
    layers: _Layers,
    *,
    kind: str | None = None,
    admit_in_call: bool,
    metadata: Any = None,
    refused: tuple[int, Refusal] | None = None,
    errors: ErrorLayer | None = None,
) -> Any:
    """`handler` wrapped by every hook of `layers` and the error layer.

    `kind` is the method's kind as its clients see it (default: `handler`'s).
    When `handler` takes a unary request, the wrapper is the one that reads it
    (see `_reading`), after admission and every `on_start`; around a wrapper
    that reads, a request is a stream of one message, hooked as it is read.
    """
    physical = kind_of(handler)
    kind = kind or rpc_kind_of(handler, method)
    behaviour = behaviour_of(handler)
    reads_request = physical[0] == "u"
    deserializer = handler.request_deserializer
    if reads_request and deserializer is not None:
        deserializer = tolerant(deserializer)
    interceptors = layers.interceptors
    streams_requests = physical[0] == "s"
    streams_responses = kind.endswith("stream")
    response_hooked = bool(layers.response_hooks)
    context_hooked = (streams_requests and bool(layers.request_hooks)) or (
        streams_responses and response_hooked
    )

    async def begin(context: Any, started: list[tuple[CallInterceptor, Call]]) -> Refusal | None:
        """Admit and start the call, filling `started`; the refusal that cut it, if any."""
        call_metadata = metadata if metadata is not None else context.invocation_metadata()
        cut, refusal = len(interceptors), None
        if refused is not None:
            cut, refusal = refused
        elif admit_in_call and layers.admitting:
            cut, refusal = await _admit(interceptors, method, call_metadata, context)
        for interceptor in interceptors[:cut]:
            call = Call(method, kind, call_metadata, context)
            started.append((interceptor, call))  # before on_start: an abort there still ends it
            await interceptor.on_start(call)
        return refusal

    async def prepare(
        request: Any, context: Any, started: list[tuple[CallInterceptor, Call]]
    ) -> tuple[Any, Any]:
        """The request and the context the handler gets."""
        if reads_request:
            request = await _read_one(request)
            if request is _MISSING:
                request = UndecodableRequest(method, ValueError("no request message was sent"))
            if type(request) is UndecodableRequest:
                await _reject_undecodable(context, request, method, errors)
        if layers.request_hooks:
            hooks = [(i.on_request, c) for i, c in started if i.has_request_hook]
            if not streams_requests:
                for hook, call in hooks:
                    hook(call, request)
            else:
                request = _counted(request, hooks)
        if context_hooked:
            context = _hooked(context, started, streams_requests)
        return request, context

    async def fail(context: Any, error: Exception) -> None:
        """Hand `error` to the error layer, which aborts; re-raise what it raises."""
        if errors is None or isinstance(error, grpc.aio.AbortError):
            raise error
        await errors(context, error, method)
        raise error  # pragma: no cover - the error layer aborts

    def finish(started: list[tuple[CallInterceptor, Call]], context: Any, exc: Any) -> None:
        if not started:
            return
        code = ended_code(context, exc, started[0][1].started)
        for interceptor, call in reversed(started):
            interceptor.finish(call, code)

    if not streams_responses:

        async def unary_response(request: Any, context: Any) -> Any:
            exc: BaseException | None = None
            started: list[tuple[CallInterceptor, Call]] = []
            try:
                refusal = await begin(context, started)
                if refusal is not None:
                    await refusal.abort(context, method)
                request, inner = await prepare(request, context, started)
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

        return _rebuilt(physical, method, kind, unary_response, deserializer, handler)

    async def streaming_response(request: Any, context: Any) -> AsyncIterator[Any]:
        exc: BaseException | None = None
        started: list[tuple[CallInterceptor, Call]] = []
        result: Any = None
        try:
            refusal = await begin(context, started)
            if refusal is not None:
                await refusal.abort(context, method)
            request, inner = await prepare(request, context, started)
            try:
                result = behaviour(request, inner)
                if inspect.isasyncgen(result):
                    hooks = None
                    if response_hooked:
                        # Chosen at the first message, once the handler has begun:
                        # a hook may read a record the handler keeps instead.
                        async for message in result:
                            hooks = [
                                (i.on_response, c)
                                for i, c in started
                                if i.has_response_hook and _reads_responses(i, c)
                            ]
                            for hook, call in hooks:
                                hook(call, message)
                            yield message
                            break
                    if hooks:
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
            try:
                if exc is not None and inspect.isasyncgen(result):
                    # Cancelled at our `yield`, the handler's generator is still
                    # suspended at its own: close it now (its cleanup, e.g. an
                    # engine abort, runs before on_finish) rather than at GC.
                    await result.aclose()
            finally:
                finish(started, context, exc)

    return _rebuilt(physical, method, kind, streaming_response, deserializer, handler)


def _reads_responses(interceptor: CallInterceptor, call: Call) -> bool:
    try:
        return interceptor.reads_responses(call)
    except Exception:
        # Bookkeeping must never change how the call ends: give it the messages.
        logger.exception("reads_responses of %s failed", type(interceptor).__name__)
        return True


async def _counted(requests: Any, hooks: list[tuple[Any, Call]]) -> AsyncIterator[Any]:
    async for message in requests:
        for hook, call in hooks:
            hook(call, message)
        yield message


def _hooked(
    context: Any, started: list[tuple[CallInterceptor, Call]], streams_requests: bool
) -> _HookedContext:
    request_hooks = [(i.on_request, c) for i, c in started if i.has_request_hook]
    response_hooks = [(i.on_response, c) for i, c in started if i.has_response_hook]

    def on_request(message: Any) -> None:
        for hook, call in request_hooks:
            hook(call, message)

    def on_response(message: Any) -> None:
        for hook, call in response_hooks:
            hook(call, message)

    return _HookedContext(
        context,
        on_request if streams_requests and request_hooks else None,
        on_response if response_hooks else None,
    )


async def _reject_undecodable(
    context: Any, request: UndecodableRequest, method: str, errors: ErrorLayer | None
) -> None:
    reason = f"not a valid {request.message_name}: {request.error}"
    if errors is not None:
        from ..errors import InvalidRequestError

        await errors(context, InvalidRequestError("request", reason), method)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: {reason}")


class _Enclosing:
    """An interceptor that must wrap the run of CallInterceptors after it (OpenTelemetry's)."""

    __slots__ = ("interceptor", "owner")

    def __init__(self, interceptor: grpc.aio.ServerInterceptor, owner: CallInterceptor) -> None:
        self.interceptor = interceptor
        self.owner = owner  # the CallInterceptor that brought it: it applies where the owner does


Segment = list[CallInterceptor] | _Enclosing | grpc.aio.ServerInterceptor


def _segments(interceptors: Sequence[grpc.aio.ServerInterceptor]) -> list[Segment]:
    """Runs of CallInterceptors (each to be fused), with other interceptors between them.

    A CallInterceptor with an `enclosing` interceptor starts a run of its own,
    preceded by that interceptor.
    """
    segments: list[Segment] = []
    for interceptor in interceptors:
        if isinstance(interceptor, Pipeline):
            segments.extend(_segments(interceptor.interceptors))
        elif isinstance(interceptor, CallInterceptor):
            enclosing = interceptor.enclosing
            if enclosing is not None:
                segments.append(_Enclosing(enclosing, interceptor))
            last = segments[-1] if segments else None
            if enclosing is not None or not isinstance(last, list):
                segments.append([interceptor])
            else:
                last.append(interceptor)
        else:
            segments.append(interceptor)
    return segments


class Pipeline(grpc.aio.ServerInterceptor):
    """A stack of interceptors run as one: one wrapper per call for each run of
    `CallInterceptor`s, however long.

    Pass it to `grpc.aio.server(interceptors=[Pipeline([...])])` to fuse a
    server-wide stack; `mount(..., interceptors=[...])` fuses its stack itself.
    Any other grpc.aio server interceptor in the list keeps its place.

    Args:
        interceptors: outermost first.
    """

    def __init__(self, interceptors: Sequence[grpc.aio.ServerInterceptor]) -> None:
        self.interceptors = tuple(interceptors)
        self._segments = _segments(self.interceptors)
        self._applying: dict[str, list[_Layers | _Enclosing | grpc.aio.ServerInterceptor]] = {}

    @property
    def fully_fused(self) -> bool:
        """Whether every interceptor is a CallInterceptor (or the enclosing one of one)."""
        return all(isinstance(s, (list, _Enclosing)) for s in self._segments)

    def _for(self, method: str) -> list[_Layers | _Enclosing | grpc.aio.ServerInterceptor]:
        """The segments, each run cut down to the interceptors that apply to `method`."""
        cached = self._applying.get(method)
        if cached is not None:
            return cached
        chosen: list[_Layers | _Enclosing | grpc.aio.ServerInterceptor] = []
        for segment in self._segments:
            if isinstance(segment, list):
                applying = [i for i in segment if i.applies_to(method)]
                if applying:
                    chosen.append(_Layers(applying))
            elif not isinstance(segment, _Enclosing) or segment.owner.applies_to(method):
                chosen.append(segment)
        if len(self._applying) < 4096:  # method names come from clients
            self._applying[method] = chosen
        return chosen

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        segments = self._for(handler_call_details.method)
        if not segments:
            return await continuation(handler_call_details)
        handler, _ = await _resolve(segments, continuation, handler_call_details)
        return handler  # type: ignore[no-any-return]

    def wrap(
        self, method: str, handler: Any, *, errors: ErrorLayer | None = None
    ) -> grpc.RpcMethodHandler[Any, Any]:
        """`handler` of `method` wrapped once for every call (what `mount()` registers).

        Needs a `fully_fused` pipeline. Admission runs in the call, before the
        innermost wrapper reads the request; `errors` maps the handler's exceptions.
        """
        if not self.fully_fused:
            raise ValueError("wrap() needs CallInterceptors only; use it as an interceptor")
        segments = self._for(method)
        if not is_async(handler):
            return _sync_handler(handler, method, segments)  # type: ignore[no-any-return]
        kind = rpc_kind_of(handler, method)
        wrapped = handler
        innermost = True
        for segment in reversed(segments):
            if isinstance(segment, _Layers):
                # Every segment admits in the call: only the innermost reads
                # the request, after all of them (OpenTelemetry's span between).
                wrapped = _fused(
                    wrapped,
                    method,
                    segment,
                    kind=kind,
                    admit_in_call=True,
                    errors=errors if innermost else None,
                )
                innermost = False
            else:
                assert isinstance(segment, _Enclosing)
                details = CallDetails(method, ())
                wrapped = _resolve_now(
                    segment.interceptor.intercept_service(_returning(wrapped), details)
                )
        if innermost:  # no interceptor applies: the error layer and the parser alone
            if errors is None:
                return handler  # type: ignore[no-any-return]
            wrapped = _fused(wrapped, method, _Layers(()), admit_in_call=True, errors=errors)
        return wrapped  # type: ignore[no-any-return]


async def _resolve(
    segments: list[_Layers | _Enclosing | grpc.aio.ServerInterceptor],
    continuation: Continuation,
    details: grpc.HandlerCallDetails,
) -> tuple[Any, str | None]:
    """The handler for one call (server-wide), and the method's kind as clients see it."""
    segment, rest = segments[0], segments[1:]
    kind: str | None = None

    async def inner(d: grpc.HandlerCallDetails) -> Any:
        nonlocal kind
        if rest:
            handler, kind = await _resolve(rest, continuation, d)
            return handler
        handler = await continuation(d)
        kind = rpc_kind_of(handler, d.method) if handler is not None else None
        return handler

    if isinstance(segment, _Enclosing):
        handler = await inner(details)
        if handler is None or not is_async(handler):
            return handler, kind  # it would run a sync handler on the event loop
        return await segment.interceptor.intercept_service(_returning(handler), details), kind
    if not isinstance(segment, _Layers):
        return await segment.intercept_service(inner, details), kind
    # Admitted while grpc looks the handler up, outermost first, before any
    # inner interceptor is asked.
    refused = None
    if segment.admitting:
        method, metadata = details.method, details.invocation_metadata
        cut, refusal = await _admit(segment.interceptors, method, metadata, None)
        if refusal is not None:
            refused = (cut, refusal)
    handler = await inner(details)
    if handler is None:
        return None, kind
    if not is_async(handler):
        return _sync_handler(handler, details.method, [segment]), kind
    wrapped = _fused(
        handler,
        details.method,
        segment,
        kind=kind,
        admit_in_call=False,
        metadata=details.invocation_metadata,
        refused=refused,
    )
    return wrapped, kind


def _sync_handler(handler: Any, method: str, segments: list[Any]) -> Any:
    """A plain (sync) handler, which grpc runs in its thread pool, where no hook can run.

    It passes through untouched, unless an interceptor that applies must not
    let a call through unchecked (authentication): then it is refused.
    """
    for segment in segments:
        if isinstance(segment, _Layers) and any(i.fails_closed for i in segment.interceptors):
            logger.error("%s has a sync handler, which cannot be checked: refused", method)
            refusal = Refusal(grpc.StatusCode.UNIMPLEMENTED, "method cannot be authenticated")
            return _fused(
                _placeholder(handler),
                method,
                _Layers(()),
                admit_in_call=False,
                refused=(0, refusal),
            )
    return handler


def _placeholder(handler: Any) -> Any:
    """An async handler of the kind of `handler`, for a call refused before it runs."""

    async def never(request: Any, context: Any) -> None:  # pragma: no cover - refused first
        raise AssertionError("a refused call ran")

    async def never_stream(request: Any, context: Any) -> AsyncIterator[Any]:  # pragma: no cover
        raise AssertionError("a refused call ran")
        yield

    behaviour = never_stream if handler.response_streaming else never
    return rebuild(handler, behaviour, handler.request_deserializer)


def wrapped_handler(
    interceptors: Sequence[grpc.aio.ServerInterceptor] | Pipeline,
    method: str,
    handler: Any,
    *,
    errors: ErrorLayer | None = None,
) -> Any:
    """`handler` of `method` with `interceptors` (outermost first) around it, as `mount()` wraps.

    One wrapper per call when every interceptor is a CallInterceptor; else the
    chain is asked per call (`relayed`).
    """
    pipeline = pipeline_of(interceptors)
    if pipeline.fully_fused:
        return pipeline.wrap(method, handler, errors=errors)
    return relayed(pipeline, method, handler, errors=errors)


def relayed(
    pipeline: Pipeline, method: str, handler: Any, *, errors: ErrorLayer | None = None
) -> Any:
    """`handler` behind a pipeline that holds other interceptors than CallInterceptors.

    Such an interceptor may return another handler per call, so the chain is
    asked per call, as a server would ask it, and the wrapper relays what the
    handler it returned does. The request is read by the innermost wrapper, as
    in `wrap`: every interceptor of the chain sees a unary request as a stream
    of one message, and a refused call's request is never read.
    """
    if not is_async(handler):
        return _sync_handler(handler, method, pipeline._for(method))
    kind = rpc_kind_of(handler, method)
    base = _fused(handler, method, _Layers(()), kind=kind, admit_in_call=True, errors=errors)

    async def resolve(context: Any) -> Any:
        details = CallDetails(method, context.invocation_metadata())
        resolved = await pipeline.intercept_service(_returning(base), details)
        if resolved is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"method {method} not found")
        return resolved

    async def request_of(resolved: Any, requests: Any, context: Any) -> Any:
        if resolved.request_streaming or kind[0] == "s":
            return requests
        # An interceptor put a unary handler of its own in place of ours.
        request = await _read_one(requests)
        if request is _MISSING or type(request) is UndecodableRequest:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request could not be parsed")
        return request

    if not kind.endswith("stream"):

        async def unary_response(requests: Any, context: Any) -> Any:
            resolved = await resolve(context)
            request = await request_of(resolved, requests, context)
            return await behaviour_of(resolved)(request, context)

        return _rebuilt(kind, method, kind, unary_response, base.request_deserializer, base)

    async def streaming_response(requests: Any, context: Any) -> AsyncIterator[Any]:
        resolved = await resolve(context)
        request = await request_of(resolved, requests, context)
        result = behaviour_of(resolved)(request, context)
        if inspect.isasyncgen(result):
            try:
                async for message in result:
                    yield message
            except BaseException:
                await result.aclose()  # cancelled at our `yield`: close it now, not at GC
                raise
        else:
            await result

    return _rebuilt(kind, method, kind, streaming_response, base.request_deserializer, base)


def pipeline_of(interceptors: Sequence[grpc.aio.ServerInterceptor] | Pipeline) -> Pipeline:
    """`interceptors` as one Pipeline (itself, when it is one)."""
    if isinstance(interceptors, Pipeline):
        return interceptors
    if len(interceptors) == 1 and isinstance(interceptors[0], Pipeline):
        return interceptors[0]
    return Pipeline(interceptors)
