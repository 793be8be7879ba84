"""CallInterceptor over every handler kind, both streaming styles, and both placements.

A small test service of generic handlers (raw bytes, no protos) covers the four
handler kinds, async-generator and `context.write` streaming, `context.read`,
aborts, exceptions, cancels and deadlines; grpc's own health `Watch` is the
real-world `context.write` handler. Each test runs with the interceptor passed
to `grpc.aio.server(interceptors=...)` and with it applied to the service's
handlers the way `mount(..., interceptors=...)` does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import itertools
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from vllm_servicer._registration import HandlerRecorder, register
from vllm_servicer.interceptors import (
    Call,
    CallInterceptor,
    except_methods_of,
    methods_of,
    only_methods,
)
from vllm_servicer.interceptors._pipeline import wrapped_handler

SERVICE = "test.Svc"
OK, CANCELLED, DEADLINE = (
    grpc.StatusCode.OK,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
)
PLACEMENTS = ("server_wide", "mounted")


async def _act(command: bytes, context: Any) -> None:
    """Shared behaviour of every handler, picked by the request's bytes."""
    if command == b"abort":
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad request")
    if command == b"raise":
        raise ValueError("boom")
    if command == b"sleep":
        await asyncio.sleep(30)


async def unary_unary(request: bytes, context: Any) -> bytes:
    await _act(request, context)
    return b"uu:" + request


# Set when unary_stream's generator for a request ends (cleanup ran).
STREAM_ENDED: dict[bytes, asyncio.Event] = {}


_tags = itertools.count()


def _ended(request: bytes) -> asyncio.Event:
    return STREAM_ENDED.setdefault(request, asyncio.Event())


async def unary_stream(request: bytes, context: Any) -> AsyncIterator[bytes]:
    try:
        if request.startswith(b"flood"):
            # Never awaits itself: a client that stops reading leaves grpc awaiting a
            # write, and an end of the call lands there, not inside the handler.
            while True:
                yield b"f" * 4096
        if request.startswith(b"hold-first"):
            await asyncio.sleep(30)  # before the first message
        if request.startswith(b"hold-between"):
            yield b"first"
            await asyncio.sleep(30)  # between two messages
    finally:
        _ended(request).set()
    for i in range(3):
        yield b"us%d" % i
        if i == 0:
            await _act(request, context)


async def unary_stream_write(request: bytes, context: Any) -> None:
    for i in range(3):
        await context.write(b"uw%d" % i)
        if i == 0:
            await _act(request, context)


async def stream_unary(requests: Any, context: Any) -> bytes:
    seen = []
    async for message in requests:
        await _act(message, context)
        seen.append(message)
    return b"+".join(seen)


async def stream_unary_read(requests: Any, context: Any) -> bytes:
    seen = []
    while (message := await context.read()) is not grpc.aio.EOF:
        await _act(message, context)
        seen.append(message)
    return b"+".join(seen)


async def stream_stream(requests: Any, context: Any) -> AsyncIterator[bytes]:
    async for message in requests:
        yield b"ss:" + message
        await _act(message, context)


async def stream_stream_write(requests: Any, context: Any) -> None:
    async for message in requests:
        await context.write(b"sw:" + message)
        await _act(message, context)


HANDLERS = {
    "UnaryUnary": grpc.unary_unary_rpc_method_handler(unary_unary),
    "UnaryStream": grpc.unary_stream_rpc_method_handler(unary_stream),
    "UnaryStreamWrite": grpc.unary_stream_rpc_method_handler(unary_stream_write),
    "StreamUnary": grpc.stream_unary_rpc_method_handler(stream_unary),
    "StreamUnaryRead": grpc.stream_unary_rpc_method_handler(stream_unary_read),
    "StreamStream": grpc.stream_stream_rpc_method_handler(stream_stream),
    "StreamStreamWrite": grpc.stream_stream_rpc_method_handler(stream_stream_write),
}
KINDS = {
    "UnaryUnary": "unary_unary",
    "UnaryStream": "unary_stream",
    "UnaryStreamWrite": "unary_stream",
    "StreamUnary": "stream_unary",
    "StreamUnaryRead": "stream_unary",
    "StreamStream": "stream_stream",
    "StreamStreamWrite": "stream_stream",
}


@dataclasses.dataclass
class Finished:
    method: str
    kind: str
    code: grpc.StatusCode
    requests: int
    responses: int


class Recorder(CallInterceptor):
    """Records every hook; rejects the methods in `reject` from on_start."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.reject: set[str] = set()
        self.reset()

    def reset(self) -> None:
        self.started: list[str] = []
        self.any_started = asyncio.Event()
        self.finished: list[Finished] = []
        self.reject.clear()

    async def on_start(self, call: Call) -> None:
        assert call.method == f"/{call.service}/{call.name}"
        self.started.append(call.method)
        self.any_started.set()
        call.state = [0, 0]
        if call.name in self.reject:
            await call.context.abort(grpc.StatusCode.PERMISSION_DENIED, "rejected")

    def on_request(self, call: Call, message: Any) -> None:
        call.state[0] += 1

    def on_response(self, call: Call, message: Any) -> None:
        call.state[1] += 1

    def on_finish(self, call: Call) -> None:
        assert call.code is not None
        self.finished.append(Finished(call.method, call.kind, call.code, *call.state))

    async def finish_of(self, name: str, timeout: float = 5.0) -> Finished:
        """The recorded end of the (single) call to `name`, once it happened."""
        method = f"/{SERVICE}/{name}" if not name.startswith("/") else name
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            found = [f for f in self.finished if f.method == method]
            if found:
                assert len(found) == 1, found
                return found[0]
            await asyncio.sleep(0.01)
        raise AssertionError(f"no on_finish for {method}: {self.finished}")


@dataclasses.dataclass
class Running:
    channel: grpc.aio.Channel
    recorder: Recorder
    health: Any


async def _serve(placement: str) -> tuple[grpc.aio.Server, Running, str]:
    recorder = Recorder()
    health_servicer = health.aio.HealthServicer()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    if placement == "server_wide":
        server = grpc.aio.server(interceptors=[recorder])
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, HANDLERS),))
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    else:
        server = grpc.aio.server()
        records = HandlerRecorder()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, records)
        records.services[SERVICE] = dict(HANDLERS)
        for service, handlers in records.services.items():
            wrapped = {
                name: wrapped_handler([recorder], f"/{service}/{name}", handler)
                for name, handler in handlers.items()
            }
            register(server, service, wrapped)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return server, Running(channel, recorder, health_servicer), placement


@pytest.fixture(scope="module")
async def servers() -> AsyncIterator[dict[str, Running]]:
    started = [await _serve(p) for p in PLACEMENTS]
    yield {placement: running for _, running, placement in started}
    for server, running, _ in started:
        await running.channel.close()
        await server.stop(None)


@pytest.fixture(params=PLACEMENTS)
def svc(request: pytest.FixtureRequest, servers: dict[str, Running]) -> Running:
    running = servers[request.param]
    running.recorder.reset()
    return running


def _callable(channel: grpc.aio.Channel, name: str) -> Any:
    method = f"/{SERVICE}/{name}"
    kind = KINDS[name]
    return getattr(channel, kind)(method)


async def _requests(*messages: bytes) -> AsyncIterator[bytes]:
    for message in messages:
        yield message


async def _forever() -> AsyncIterator[bytes]:
    await asyncio.Event().wait()
    yield b""  # pragma: no cover


async def _invoke(svc: Running, name: str, *messages: bytes, **kwargs: Any) -> Any:
    """Call `name` with `messages` (one for unary-request kinds); all responses."""
    rpc = _callable(svc.channel, name)
    kind = KINDS[name]
    arg: Any = messages[0] if kind.startswith("unary") else _requests(*messages)
    call = rpc(arg, **kwargs)
    if kind.endswith("stream"):
        return [m async for m in call]
    return await call


# ----- success and message counts ----------------------------------------------

SUCCESS = {
    "UnaryUnary": ((b"ok",), b"uu:ok", 1, 1),
    "UnaryStream": ((b"ok",), [b"us0", b"us1", b"us2"], 1, 3),
    "UnaryStreamWrite": ((b"ok",), [b"uw0", b"uw1", b"uw2"], 1, 3),
    "StreamUnary": ((b"a", b"b", b"c"), b"a+b+c", 3, 1),
    "StreamUnaryRead": ((b"a", b"b", b"c", b"d"), b"a+b+c+d", 4, 1),
    "StreamStream": ((b"a", b"b"), [b"ss:a", b"ss:b"], 2, 2),
    "StreamStreamWrite": ((b"a", b"b", b"c"), [b"sw:a", b"sw:b", b"sw:c"], 3, 3),
}


@pytest.mark.parametrize("name", list(SUCCESS))
async def test_success_counts_messages(svc: Running, name: str) -> None:
    messages, expected, n_requests, n_responses = SUCCESS[name]
    assert await _invoke(svc, name, *messages) == expected
    finished = await svc.recorder.finish_of(name)
    assert finished == Finished(f"/{SERVICE}/{name}", KINDS[name], OK, n_requests, n_responses)
    assert svc.recorder.started == [f"/{SERVICE}/{name}"]


# ----- how calls end -----------------------------------------------------------


@pytest.mark.parametrize("name", list(HANDLERS))
async def test_abort_in_handler_is_seen_with_its_code(svc: Running, name: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _invoke(svc, name, b"abort")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "bad request"
    finished = await svc.recorder.finish_of(name)
    assert finished.code == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("name", list(HANDLERS))
async def test_exception_is_unknown(svc: Running, name: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _invoke(svc, name, b"raise")
    assert err.value.code() == grpc.StatusCode.UNKNOWN
    assert (await svc.recorder.finish_of(name)).code == grpc.StatusCode.UNKNOWN


@pytest.mark.parametrize("name", list(HANDLERS))
async def test_deadline(svc: Running, name: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _invoke(svc, name, b"sleep", timeout=0.3)
    assert err.value.code() == DEADLINE
    assert (await svc.recorder.finish_of(name)).code == DEADLINE


@pytest.mark.parametrize("name", list(HANDLERS))
async def test_client_cancel(svc: Running, name: str) -> None:
    task = asyncio.ensure_future(_invoke(svc, name, b"sleep"))
    await asyncio.wait_for(svc.recorder.any_started.wait(), 5)
    await asyncio.sleep(0.1)  # into the handler's sleep
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (await svc.recorder.finish_of(name)).code == CANCELLED


async def test_deadline_while_grpc_awaits_a_write(svc: Running) -> None:
    call = _callable(svc.channel, "UnaryStream")(b"flood", timeout=0.5)
    await call.read()  # then read no more: flow control blocks the server's writes
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.sleep(1.0)
        await call.read()
    assert err.value.code() == DEADLINE
    assert (await svc.recorder.finish_of("UnaryStream")).code == DEADLINE


async def test_client_cancel_while_grpc_awaits_a_write(svc: Running) -> None:
    call = _callable(svc.channel, "UnaryStream")(b"flood")
    await call.read()
    await asyncio.sleep(0.3)  # the server fills the flow-control window and waits
    call.cancel()
    assert (await svc.recorder.finish_of("UnaryStream")).code == CANCELLED


CANCEL_POINTS = {
    "before_first_message": (b"hold-first", 0),
    "between_messages": (b"hold-between", 1),
    "during_blocked_write": (b"flood", 1),
}


@pytest.mark.parametrize("point", list(CANCEL_POINTS))
async def test_client_cancel_counts_once_and_ends_the_handler_at_once(
    svc: Running, point: str
) -> None:
    """Wherever a cancel lands, the call ends as CANCELLED once and its handler stops.

    The garbage collector is off: nothing may wait for it to close a handler
    that grpc left suspended (its cleanup, e.g. the engine abort, would wait too).
    """
    command, reads = CANCEL_POINTS[point]
    gc.disable()
    try:
        for i in range(10):
            svc.recorder.reset()
            tag = command + b"-%d" % next(_tags)
            call = _callable(svc.channel, "UnaryStream")(tag)
            for _ in range(reads):
                await call.read()
            await asyncio.wait_for(svc.recorder.any_started.wait(), 5)
            await asyncio.sleep(0.2)  # the server settles where the point says
            assert not _ended(tag).is_set()
            call.cancel()
            # With the collector off no timeout is "at garbage collection": a
            # generous one only absorbs a loaded machine.
            finished = await svc.recorder.finish_of("UnaryStream", timeout=10.0)
            assert finished.code == CANCELLED, (i, finished)
            try:
                await asyncio.wait_for(_ended(tag).wait(), 10.0)
            except TimeoutError:
                raise AssertionError(f"call {i}: the handler was left running") from None
            await asyncio.sleep(0.05)
            assert len(svc.recorder.finished) == 1, svc.recorder.finished
    finally:
        gc.enable()


# ----- rejection in on_start --------------------------------------------------


@pytest.mark.parametrize("name", list(HANDLERS))
async def test_reject_in_on_start_without_waiting_for_a_message(svc: Running, name: str) -> None:
    svc.recorder.reject.add(name)
    rpc = _callable(svc.channel, name)
    # Streaming-request kinds send nothing: the rejection must not wait for a message.
    call = rpc(b"ok" if KINDS[name].startswith("unary") else _forever())

    async def outcome() -> None:
        if KINDS[name].endswith("stream"):
            async for _ in call:
                pass
        else:
            await call

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(outcome(), timeout=5)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finished = await svc.recorder.finish_of(name)
    assert (finished.code, finished.requests, finished.responses) == (
        grpc.StatusCode.PERMISSION_DENIED,
        0,
        0,
    )


# ----- unknown methods and grpc's own health Watch -------------------------------


async def test_unknown_method_is_unimplemented(svc: Running) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await svc.channel.unary_unary(f"/{SERVICE}/Nope")(b"x")
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    await asyncio.sleep(0.05)
    assert svc.recorder.started == [] and svc.recorder.finished == []


async def test_interceptor_returning_none_is_unimplemented_when_applied() -> None:
    class Hide(grpc.aio.ServerInterceptor):
        async def intercept_service(self, continuation: Any, details: Any) -> Any:
            return None

    server = grpc.aio.server()
    handler = wrapped_handler([Hide()], f"/{SERVICE}/UnaryUnary", HANDLERS["UnaryUnary"])
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, {"UnaryUnary": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await channel.unary_unary(f"/{SERVICE}/UnaryUnary")(b"ok")
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await server.stop(None)


async def test_health_watch_through_the_interceptor(svc: Running) -> None:
    stub = health_pb2_grpc.HealthStub(svc.channel)
    call = stub.Watch(health_pb2.HealthCheckRequest(service=""))
    first = await call.read()
    assert first.status == health_pb2.HealthCheckResponse.SERVING
    await svc.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    second = await call.read()
    assert second.status == health_pb2.HealthCheckResponse.NOT_SERVING
    await svc.health.set("", health_pb2.HealthCheckResponse.SERVING)
    assert (await call.read()).status == health_pb2.HealthCheckResponse.SERVING
    call.cancel()
    finished = await svc.recorder.finish_of("/grpc.health.v1.Health/Watch")
    assert (finished.kind, finished.code, finished.requests, finished.responses) == (
        "unary_stream",
        CANCELLED,
        1,
        3,
    )
    reply = await stub.Check(health_pb2.HealthCheckRequest(service=""))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


# ----- filters ---------------------------------------------------------------


def test_method_filters() -> None:
    m = "/a.B/C"
    assert methods_of("a.B")(m) and not methods_of("a.Bx")(m) and not methods_of("a")(m)
    assert not except_methods_of("a.B")(m) and except_methods_of("x.Y")(m)
    assert only_methods("/a.B/C", "/x.Y/Z")(m) and not only_methods("/a.B/D")(m)


async def test_filtered_out_methods_pass_through_untouched() -> None:
    recorder = Recorder(methods=except_methods_of(SERVICE))
    server = grpc.aio.server(interceptors=[recorder])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, HANDLERS),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert await channel.unary_unary(f"/{SERVICE}/UnaryUnary")(b"ok") == b"uu:ok"
        assert recorder.started == [] and recorder.finished == []
    finally:
        await server.stop(None)


async def test_hooks_not_overridden_leave_messages_alone(svc: Running) -> None:
    """A subclass with only on_finish gets the handler's own request iterator."""
    seen: list[Any] = []

    class FinishOnly(CallInterceptor):
        def on_finish(self, call: Call) -> None:
            seen.append(call.code)

    async def check(requests: Any, context: Any) -> bytes:
        # Not re-wrapped: grpc's own iterator and context reach the handler.
        return type(context).__name__.encode()

    handler = wrapped_handler(
        [FinishOnly()], f"/{SERVICE}/S", grpc.stream_unary_rpc_method_handler(check)
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, {"S": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            name = await channel.stream_unary(f"/{SERVICE}/S")(_requests(b"a"))
        assert b"Hooked" not in name
        assert seen == [OK]
    finally:
        await server.stop(None)
