"""A stack of interceptors run as one: what `mount()` wraps its services with,
and what a host passes to `grpc.aio.server(interceptors=[Pipeline([...])])`.

The stack is cut into segments once: each run of `CallInterceptor`s is fused
into one wrapper, and any other interceptor keeps its place between them (a
`CallInterceptor` with an `enclosing` interceptor, OpenTelemetry's span,
starts a run of its own behind it). Mounted or server-wide, a method's handler
is wrapped the same way (`_wrapping.wrap`), once per handler, so admission
always runs in the call, before the request is read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import grpc

from ._base import CallInterceptor
from ._wrapping import ErrorLayer, HandlerCache, Layers, Segment, wrap

if TYPE_CHECKING:
    from ._wrapping import Continuation, Handler


class _Enclosing:
    """An interceptor that must wrap the run of CallInterceptors after it (OpenTelemetry's)."""

    __slots__ = ("interceptor", "owner")

    def __init__(self, interceptor: grpc.aio.ServerInterceptor, owner: CallInterceptor) -> None:
        self.interceptor = interceptor
        self.owner = owner  # the CallInterceptor that brought it: it applies where the owner does


_Run = list[CallInterceptor] | _Enclosing | grpc.aio.ServerInterceptor


def _runs(interceptors: Sequence[grpc.aio.ServerInterceptor]) -> list[_Run]:
    """Runs of CallInterceptors, with other interceptors between them.

    A CallInterceptor with an `enclosing` interceptor starts a run of its own,
    preceded by that interceptor.
    """
    runs: list[_Run] = []
    for interceptor in interceptors:
        if isinstance(interceptor, Pipeline):
            runs.extend(_runs(interceptor.interceptors))
        elif isinstance(interceptor, CallInterceptor):
            enclosing = interceptor.enclosing
            if enclosing is not None:
                runs.append(_Enclosing(enclosing, interceptor))
            last = runs[-1] if runs else None
            if enclosing is not None or not isinstance(last, list):
                runs.append([interceptor])
            else:
                last.append(interceptor)
        else:
            runs.append(interceptor)
    return runs


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
        self._runs = _runs(self.interceptors)
        self._segments: dict[str, list[Segment]] = {}
        self._handlers = HandlerCache()

    def segments_for(self, method: str) -> list[Segment]:
        """The segments that apply to `method`, outermost first."""
        cached = self._segments.get(method)
        if cached is not None:
            return cached
        chosen: list[Segment] = []
        for run in self._runs:
            if isinstance(run, list):
                applying = [i for i in run if i.applies_to(method)]
                if applying:
                    chosen.append(Layers(applying))
            elif isinstance(run, _Enclosing):
                if run.owner.applies_to(method):
                    chosen.append(run.interceptor)
            else:
                chosen.append(run)
        if len(self._segments) < 4096:  # method names come from clients
            self._segments[method] = chosen
        return chosen

    def wrap(self, method: str, handler: Handler, *, errors: ErrorLayer | None = None) -> Handler:
        """`handler` of `method` wrapped by the stack, for every call (what `mount()` registers).

        `errors` maps the handler's exceptions to statuses.
        """
        return wrap(self.segments_for(method), method, handler, errors=errors)

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> Handler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return self._handlers.get(handler_call_details.method, handler, self.wrap)


def wrapped_handler(
    interceptors: Sequence[grpc.aio.ServerInterceptor] | Pipeline,
    method: str,
    handler: Handler,
    *,
    errors: ErrorLayer | None = None,
) -> Handler:
    """`handler` of `method` with `interceptors` (outermost first) around it, as `mount()` wraps."""
    pipeline = interceptors if isinstance(interceptors, Pipeline) else Pipeline(interceptors)
    return pipeline.wrap(method, handler, errors=errors)
