"""The pipeline: one wrapper per call for a whole interceptor stack.

Through a real grpc.aio server on loopback, a stack of CallInterceptors runs
from one wrapper: the handler's generator is driven by exactly one frame of
the pipeline however many interceptors there are (counted on the stack while
the handler runs), both when `mount` wraps the handlers and server-wide as one
`Pipeline`. The hooks run in stack order, a refusal cuts the stack where it is
raised, and the error layer turns what a handler raises into the status.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from vllm_servicer._registration import register
from vllm_servicer.interceptors import Call, CallInterceptor, Pipeline, Refusal
from vllm_servicer.interceptors._pipeline import wrapped_handler
from vllm_servicer.interceptors._wrapping import _relay

SERVICE = "test.Pipe"
STREAM = f"/{SERVICE}/Stream"
UNARY = f"/{SERVICE}/Unary"
INTERCEPTORS = "/vllm_servicer/interceptors/"


def _pipeline_frames() -> int:
    """Frames of the interceptors package between the running handler and grpc."""
    frame = sys._getframe(1)
    count = 0
    while frame is not None:
        if INTERCEPTORS in frame.f_code.co_filename:
            count += 1
        frame = frame.f_back  # type: ignore[assignment]
    return count


async def stream(request: bytes, context: Any) -> AsyncIterator[bytes]:
    if request == b"raise":
        raise LookupError("no such thing")
    for _ in range(3):
        yield b"%d" % _pipeline_frames()


async def unary(request: bytes, context: Any) -> bytes:
    return b"%d" % _pipeline_frames()


HANDLERS = {
    "Stream": grpc.unary_stream_rpc_method_handler(stream),
    "Unary": grpc.unary_unary_rpc_method_handler(unary),
}


class Recording(CallInterceptor):
    """Writes every hook it sees into a shared journal."""

    def __init__(self, name: str, journal: list[str], refuse: bool = False) -> None:
        super().__init__()
        self.name = name
        self.journal = journal
        self.refuse = refuse
        self.finished = asyncio.Event()

    async def on_admit(self, method: str, metadata: Any, context: Any) -> None:
        self.journal.append(f"admit {self.name}")
        if self.refuse and ("refuse", "yes") in tuple(metadata or ()):
            raise Refusal(grpc.StatusCode.PERMISSION_DENIED, f"{self.name} says no")

    async def on_start(self, call: Call) -> None:
        self.journal.append(f"start {self.name}")

    def on_request(self, call: Call, message: Any) -> None:
        self.journal.append(f"request {self.name}")

    def on_response(self, call: Call, message: Any) -> None:
        self.journal.append(f"response {self.name}")

    def on_finish(self, call: Call) -> None:
        assert call.code is not None
        self.journal.append(f"finish {self.name} {call.code.name}")
        self.finished.set()


async def _finished(interceptor: Recording) -> None:
    """Waits for `interceptor`'s on_finish: an aborted call's status reaches the
    client before the handler's task resumes from sending it and finishes."""
    await asyncio.wait_for(interceptor.finished.wait(), timeout=10)


async def _mapped(context: Any, exc: Exception, method: str) -> None:
    await context.abort(grpc.StatusCode.NOT_FOUND, f"{method}: {exc}")


async def _serve(placement: str, stack: list[CallInterceptor]) -> tuple[grpc.aio.Server, str]:
    if placement == "server_wide":
        server = grpc.aio.server(interceptors=[Pipeline(stack)])
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, HANDLERS),))
    else:
        server = grpc.aio.server()
        wrapped = {
            name: wrapped_handler(stack, f"/{SERVICE}/{name}", handler, errors=_mapped)
            for name, handler in HANDLERS.items()
        }
        register(server, SERVICE, wrapped)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@pytest.mark.parametrize("placement", ["mounted", "server_wide"])
@pytest.mark.parametrize("depth", [1, 4])
async def test_a_stack_of_any_depth_is_one_wrapper(placement: str, depth: int) -> None:
    journal: list[str] = []
    stack = [Recording(str(i), journal) for i in range(depth)]
    server, address = await _serve(placement, stack)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            streamed = [m async for m in channel.unary_stream(STREAM)(b"go")]
            single = await channel.unary_unary(UNARY)(b"go")
    finally:
        await server.stop(None)
    assert streamed == [b"1"] * 3, "a streamed message passes one pipeline frame"
    assert single == b"1"
    # Every interceptor still saw every message.
    for i in range(depth):
        assert journal.count(f"response {i}") == 3 + 1


@pytest.mark.parametrize("placement", ["mounted", "server_wide"])
async def test_hooks_run_in_stack_order_and_finish_innermost_first(placement: str) -> None:
    journal: list[str] = []
    stack = [Recording("outer", journal), Recording("inner", journal)]
    server, address = await _serve(placement, stack)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            assert len([m async for m in channel.unary_stream(STREAM)(b"go")]) == 3
    finally:
        await server.stop(None)
    assert journal[:6] == [
        "admit outer",
        "admit inner",
        "start outer",
        "start inner",
        "request outer",
        "request inner",
    ]
    assert journal[-2:] == ["finish inner OK", "finish outer OK"]


@pytest.mark.parametrize("placement", ["mounted", "server_wide"])
async def test_a_refusal_ends_the_call_for_the_interceptors_inside_it(placement: str) -> None:
    journal: list[str] = []
    stack = [
        Recording("outer", journal),
        Recording("auth", journal, refuse=True),
        Recording("inner", journal),
    ]
    server, address = await _serve(placement, stack)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            call = channel.unary_stream(STREAM)(b"go", metadata=(("refuse", "yes"),))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                _ = [m async for m in call]
        await _finished(stack[0])
    finally:
        await server.stop(None)
    assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED
    assert refused.value.details() == "auth says no"
    # The refusing interceptor and those inside it never start; no request is read.
    assert journal == [
        "admit outer",
        "admit auth",
        "start outer",
        "finish outer PERMISSION_DENIED",
    ]


async def test_the_error_layer_maps_what_a_handler_raises() -> None:
    journal: list[str] = []
    only = Recording("only", journal)
    server, address = await _serve("mounted", [only])
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                _ = [m async for m in channel.unary_stream(STREAM)(b"raise")]
        await _finished(only)
    finally:
        await server.stop(None)
    assert failed.value.code() is grpc.StatusCode.NOT_FOUND
    assert failed.value.details() == f"{STREAM}: no such thing"
    # The interceptors see the mapped code, not UNKNOWN.
    assert journal[-1] == "finish only NOT_FOUND"


class Declining(Recording):
    """Reads no responses of a call once its first message shows the handler began."""

    def reads_responses(self, call: Call) -> bool:
        self.journal.append(f"asked {self.name}")
        return False


@pytest.mark.parametrize("placement", ["mounted", "server_wide"])
async def test_an_interceptor_may_decline_a_calls_responses(placement: str) -> None:
    journal: list[str] = []
    stack = [Recording("reader", journal), Declining("decliner", journal)]
    server, address = await _serve(placement, stack)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            streamed = [m async for m in channel.unary_stream(STREAM)(b"go")]
    finally:
        await server.stop(None)
    assert streamed == [b"1"] * 3, "still one pipeline frame"
    assert journal.count("asked decliner") == 1, "asked once per call"
    assert journal.count("response reader") == 3
    assert journal.count("response decliner") == 0
    assert journal[-2:] == ["finish decliner OK", "finish reader OK"]


def test_each_interceptor_of_a_mount_learns_the_mount_through_one_hook() -> None:
    from vllm_servicer.interceptors import MountContext
    from vllm_servicer.mounting import engine_pipeline

    class Learning(CallInterceptor):
        def __init__(self) -> None:
            super().__init__()
            self.mounts: list[MountContext] = []

        def on_mount(self, mount: MountContext) -> None:
            self.mounts.append(mount)

    outer, nested = Learning(), Learning()

    # A nested Pipeline's interceptors learn it too; a plain grpc.aio one is passed by.
    class Plain(grpc.aio.ServerInterceptor):
        async def intercept_service(self, continuation: Any, details: Any) -> Any:
            return await continuation(details)

    plain = Plain()
    _, inflight = engine_pipeline([outer, Pipeline([nested]), plain])
    assert outer.mounts == nested.mounts == [MountContext(inflight, None)]


class _LikeOpenTelemetry(grpc.aio.ServerInterceptor):
    """Wraps a stream as OpenTelemetry's server interceptor does: iterates the
    handler's generator and never closes it (GC does, later)."""

    def __init__(self, journal: list[str]) -> None:
        self.journal = journal

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        behaviour = handler.stream_stream

        async def spanning(requests: Any, context: Any) -> AsyncIterator[bytes]:
            try:
                async for message in behaviour(requests, context):
                    yield message
            finally:
                self.journal.append("enclosing ended")  # the span ends here

        return handler._replace(stream_stream=spanning)


class _Context:
    def invocation_metadata(self) -> tuple[()]:
        return ()


async def test_a_stream_closed_at_its_yield_closes_what_the_enclosing_wrapper_wraps_first() -> None:
    """grpc leaves a stream cancelled while it writes to GC, which closes the
    outermost generator: the layer inside an enclosing interceptor (where the
    call's code is set on its span) must end before that interceptor's own."""
    journal: list[str] = []

    async def inner(requests: Any, context: Any) -> AsyncIterator[bytes]:
        try:
            yield b"1"
            yield b"2"
        finally:
            journal.append("inner ended")  # the call's code set here

    relayed = _relay(
        _LikeOpenTelemetry(journal),
        grpc.stream_stream_rpc_method_handler(inner),
        STREAM,
        "stream_stream",
    )
    stream = relayed.stream_stream(iter(()), _Context())
    assert await stream.__anext__() == b"1"
    await stream.aclose()  # what GC does to the generator grpc was writing from
    assert journal == ["inner ended", "enclosing ended"]
