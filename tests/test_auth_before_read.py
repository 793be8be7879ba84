"""A call refused by its credentials is refused before its request is parsed.

grpc.aio deserializes a unary request before any handler or hook runs; an
authentication decided inside the handler therefore comes after the parse, and
a client without a key could make the server parse near-limit messages at
will. These tests count deserializer invocations, for every handler kind and
both placements (`grpc.aio.server(interceptors=...)` and the wrapping that
`mount(..., interceptors=...)` applies), and check that an undecodable request
gets a proper status whatever interceptors run before authentication.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc
import pytest
from google.protobuf import message_factory
from support import bearer

from vllm_servicer import SERVICE_NAME, mount, server_options
from vllm_servicer._registration import register
from vllm_servicer.interceptors._base import CallInterceptor as CallInterceptorBase
from vllm_servicer.interceptors._base import all_methods
from vllm_servicer.interceptors._pipeline import wrapped_handler
from vllm_servicer.interceptors.api_keys import ApiKeyVerifier
from vllm_servicer.interceptors.auth import AuthInterceptor
from vllm_servicer.interceptors.tracing import TracingInterceptor
from vllm_servicer.proto import vllm_engine_pb2 as pb

KEY = "tenant-0123456789abcdefABCDEF"
SERVICE = "test.Counted"
PLACEMENTS = ("server_wide", "mounted")
# Not a protobuf message: a field tag whose varint never ends.
GARBAGE = b"\xff\xff\xff"


parsed: collections.Counter[str] = collections.Counter()


def counting(name: str) -> Callable[[bytes], bytes]:
    def deserialize(data: bytes) -> bytes:
        parsed[name] += 1
        return data

    return deserialize


async def unary_unary(request: bytes, context: Any) -> bytes:
    return b"ok"


async def unary_stream(request: bytes, context: Any) -> AsyncIterator[bytes]:
    yield b"ok"


async def stream_unary(requests: Any, context: Any) -> bytes:
    async for _ in requests:
        pass
    return b"ok"


async def stream_stream(requests: Any, context: Any) -> AsyncIterator[bytes]:
    async for message in requests:
        yield message


HANDLERS = {
    "UnaryUnary": grpc.unary_unary_rpc_method_handler(unary_unary, counting("UnaryUnary")),
    "UnaryStream": grpc.unary_stream_rpc_method_handler(unary_stream, counting("UnaryStream")),
    "StreamUnary": grpc.stream_unary_rpc_method_handler(stream_unary, counting("StreamUnary")),
    "StreamStream": grpc.stream_stream_rpc_method_handler(stream_stream, counting("StreamStream")),
}


async def _start(server: grpc.aio.Server) -> str:
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return f"127.0.0.1:{port}"


def _serve_host_service(placement: str, interceptors: list[Any]) -> grpc.aio.Server:
    if placement == "server_wide":
        server = grpc.aio.server(interceptors=interceptors)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, HANDLERS),))
        return server
    server = grpc.aio.server()
    wrapped = {
        name: wrapped_handler(interceptors, f"/{SERVICE}/{name}", handler)
        for name, handler in HANDLERS.items()
    }
    register(server, SERVICE, wrapped)
    return server


async def _call(channel: grpc.aio.Channel, name: str, metadata: Any) -> None:
    method = f"/{SERVICE}/{name}"
    if name == "UnaryUnary":
        await channel.unary_unary(method)(b"x", metadata=metadata)
    elif name == "UnaryStream":
        [m async for m in channel.unary_stream(method)(b"x", metadata=metadata)]
    elif name == "StreamUnary":
        await channel.stream_unary(method)(_late_messages(), metadata=metadata)
    else:
        [m async for m in channel.stream_stream(method)(_late_messages(), metadata=metadata)]


async def _late_messages() -> AsyncIterator[bytes]:
    """Two messages, sent after a refusal would have come: a client whose send
    loses the race with the server's status gets INTERNAL from its own grpc."""
    await asyncio.sleep(0.3)
    yield b"x"
    yield b"y"


def _engine_request_classes() -> Iterator[tuple[str, Any]]:
    service = pb.DESCRIPTOR.services_by_name["VllmEngine"]
    for method in service.methods:
        yield method.name, message_factory.GetMessageClass(method.input_type)


@pytest.mark.parametrize("placement", PLACEMENTS)
async def test_refused_engine_calls_are_never_parsed(
    placement: str, engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: collections.Counter[str] = collections.Counter()
    for _, cls in _engine_request_classes():

        def spy(data: bytes, cls: Any = cls, parse: Any = cls.FromString) -> Any:
            seen[cls.DESCRIPTOR.name] += 1
            return parse(data)

        # Generated code reads FromString when the service is added: patch first.
        monkeypatch.setattr(cls, "FromString", spy)
    auth = AuthInterceptor(ApiKeyVerifier([KEY]))
    server = grpc.aio.server(interceptors=[auth] if placement == "server_wide" else None)
    mounted = mount(server, engine, interceptors=[auth] if placement == "mounted" else ())
    address = await _start(server)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            for name, _ in _engine_request_classes():
                streaming = name in ("Generate", "GetTokenizer", "SubscribeKvEvents")
                kind = channel.unary_stream if streaming else channel.unary_unary
                call = kind(f"/{SERVICE_NAME}/{name}")
                for payload in (b"", GARBAGE):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        reply = call(payload)
                        if streaming:
                            [m async for m in reply]
                        else:
                            await reply
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
            assert sum(seen.values()) == 0, seen
            # Accepted calls are parsed as before; bytes that do not parse are the
            # client's mistake (INVALID_ARGUMENT), not a server error.
            reply = await channel.unary_unary(f"/{SERVICE_NAME}/HealthCheck")(
                b"", metadata=bearer(KEY)
            )
            assert seen["HealthCheckRequest"] == 1 and reply is not None
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await channel.unary_unary(f"/{SERVICE_NAME}/GetModelInfo")(
                    GARBAGE, metadata=bearer(KEY)
                )
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await mounted.health.close()
        await server.stop(None)


@pytest.mark.parametrize("placement", PLACEMENTS)
async def test_undecodable_request_with_tracing_before_auth_gets_a_proper_code(
    placement: str, engine: Any
) -> None:
    from opentelemetry.sdk.trace import TracerProvider

    # The launcher's order: tracing outermost, authentication inside it.
    stack = [TracingInterceptor(TracerProvider()), AuthInterceptor(ApiKeyVerifier([KEY]))]
    server = grpc.aio.server(interceptors=stack if placement == "server_wide" else None)
    mounted = mount(server, engine, interceptors=stack if placement == "mounted" else ())
    address = await _start(server)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            generate = channel.unary_stream(f"/{SERVICE_NAME}/Generate")
            embed = channel.unary_unary(f"/{SERVICE_NAME}/Embed")
            for metadata, code in (
                ((), grpc.StatusCode.UNAUTHENTICATED),
                (bearer(KEY), grpc.StatusCode.INVALID_ARGUMENT),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    [m async for m in generate(GARBAGE, metadata=metadata)]
                assert err.value.code() == code, err.value.details()
                assert "class" not in (err.value.details() or "")
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await embed(GARBAGE, metadata=metadata)
                assert err.value.code() == code, err.value.details()
            # A good request is still traced and served.
            request = pb.GenerateRequest(
                request_id="traced",
                tokenized=pb.TokenizedInput(input_ids=[5, 17, 42]),
                sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=2),
            )
            replies = [
                pb.GenerateResponse.FromString(m)
                async for m in generate(request.SerializeToString(), metadata=bearer(KEY))
            ]
            assert replies[-1].complete.finish_reason == "length"
    finally:
        await mounted.health.close()
        await server.stop(None)


class HostInterceptor(grpc.aio.ServerInterceptor):
    """A host's own interceptor, as hosts write them: it wraps every behaviour."""

    def __init__(self) -> None:
        self.calls = 0

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        kind = ("stream" if handler.request_streaming else "unary") + "_"
        kind += "stream" if handler.response_streaming else "unary"
        inner = getattr(handler, kind)

        async def unary(request: Any, context: Any) -> Any:
            self.calls += 1
            return await inner(request, context)

        async def streaming(request: Any, context: Any) -> AsyncIterator[Any]:
            self.calls += 1
            async for message in inner(request, context):
                yield message

        factory = getattr(grpc, f"{kind}_rpc_method_handler")
        return factory(
            streaming if handler.response_streaming else unary,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def _stack(names: str) -> list[Any]:
    """Interceptors outermost first, in the launcher's order: "host,tracing,metrics,auth,limit"."""
    from opentelemetry.sdk.trace import TracerProvider
    from prometheus_client import CollectorRegistry

    from vllm_servicer.interceptors import InflightInterceptor, MetricsInterceptor

    made = {
        "host": HostInterceptor,
        "tracing": lambda: TracingInterceptor(TracerProvider()),
        "metrics": lambda: MetricsInterceptor(CollectorRegistry()),
        "auth": lambda: AuthInterceptor(ApiKeyVerifier([KEY]), methods=all_methods),
        "limit": lambda: InflightInterceptor(1024, limited=all_methods),
    }
    return [made[name]() for name in names.split(",")]


# Placements: grpc's own chain of server-wide interceptors; the stack mounted
# (wrapped per method); the stack mounted under a host's server-wide interceptor.
MATRIX_PLACEMENTS = ("server_wide", "mounted", "mounted_under_host")
STACKS = (
    "auth",
    "metrics,auth,limit",
    "tracing,auth",
    "tracing,metrics,auth,limit",  # the launcher's with OTEL_* set and a metrics port
    "auth,tracing,metrics",  # OpenTelemetry's wrapper inside the refusing interceptor
    "metrics,tracing,auth",  # hooks on both sides of OpenTelemetry's wrapper
    "host,auth",
    "host,tracing,metrics,auth,limit",
)


def _serve_stack(placement: str, stack: list[Any]) -> grpc.aio.Server:
    if placement == "server_wide":
        return _serve_host_service(placement, stack)
    server = grpc.aio.server(interceptors=[HostInterceptor()] if placement != "mounted" else None)
    wrapped = {
        name: wrapped_handler(stack, f"/{SERVICE}/{name}", handler)
        for name, handler in HANDLERS.items()
    }
    register(server, SERVICE, wrapped)
    return server


@pytest.mark.parametrize("stack_names", STACKS)
@pytest.mark.parametrize("placement", MATRIX_PLACEMENTS)
@pytest.mark.parametrize("name", list(HANDLERS))
async def test_no_stack_reads_a_refused_request(
    placement: str, name: str, stack_names: str
) -> None:
    stack = _stack(stack_names)
    server = _serve_stack(placement, stack)
    address = await _start(server)
    parsed.clear()
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            for metadata in ((), bearer("unknown-0123456789abcdef")):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _call(channel, name, metadata)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, err.value.details()
            assert parsed[name] == 0
            await _call(channel, name, bearer(KEY))
            assert parsed[name] >= 1
    finally:
        await server.stop(None)
    hosts = [i for i in stack if isinstance(i, HostInterceptor)]
    assert all(host.calls == 3 for host in hosts)  # the host's wrapper saw every call


@pytest.mark.parametrize("placement", MATRIX_PLACEMENTS)
@pytest.mark.parametrize("stack_names", ["auth", "tracing,metrics,auth,limit"])
async def test_a_refused_gzip_request_is_never_inflated(placement: str, stack_names: str) -> None:
    # 16 MiB of zeros gzip to a few KiB. Refused, it is never received, so
    # grpc never inflates it: UNAUTHENTICATED, not the RESOURCE_EXHAUSTED of
    # the receive limit that an admitted one meets while grpc inflates it.
    stack = _stack(stack_names)
    options = [("grpc.max_receive_message_length", 1 << 20)]
    if placement == "server_wide":
        server = grpc.aio.server(interceptors=stack, options=options)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, HANDLERS),))
    else:
        host = [HostInterceptor()] if placement != "mounted" else None
        server = grpc.aio.server(interceptors=host, options=options)
        register(
            server,
            SERVICE,
            {n: wrapped_handler(stack, f"/{SERVICE}/{n}", h) for n, h in HANDLERS.items()},
        )
    address = await _start(server)
    parsed.clear()
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            call = channel.unary_unary(f"/{SERVICE}/UnaryUnary")
            gzip = grpc.Compression.Gzip
            for metadata, code in (
                ((), grpc.StatusCode.UNAUTHENTICATED),
                (bearer(KEY), grpc.StatusCode.RESOURCE_EXHAUSTED),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call(bytes(16 << 20), metadata=metadata, compression=gzip)
                assert err.value.code() == code, err.value.details()
            assert parsed["UnaryUnary"] == 0
    finally:
        await server.stop(None)


@pytest.mark.parametrize("placement", MATRIX_PLACEMENTS)
async def test_a_unary_call_without_its_message_is_invalid_argument(placement: str) -> None:
    # A unary method is read by the wrapper: a client that half-closes without
    # sending the message is told so, rather than left to grpc.
    server = _serve_stack(placement, _stack("auth"))
    address = await _start(server)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            call = channel.stream_unary(f"/{SERVICE}/UnaryUnary")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(iter(()), metadata=bearer(KEY))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
            assert "no request message" in (err.value.details() or "")
    finally:
        await server.stop(None)


@pytest.mark.parametrize("allowed", [False, True], ids=["default", "allowed"])
async def test_server_options_refuse_compressed_requests_unless_allowed(allowed: bool) -> None:
    # Refused by grpc's core at the request's headers: nothing is inflated,
    # for a method that needs no key as for one that does.
    server = grpc.aio.server(options=server_options(request_compression=allowed))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, HANDLERS),))
    address = await _start(server)
    parsed.clear()
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            call = channel.unary_unary(f"/{SERVICE}/UnaryUnary")
            plain = await call(b"x" * 1000)
            assert plain == b"ok"
            if allowed:
                assert await call(b"x" * 1000, compression=grpc.Compression.Gzip) == b"ok"
                assert parsed["UnaryUnary"] == 2
            else:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call(b"x" * 1000, compression=grpc.Compression.Gzip)
                assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
                assert "gzip" in (err.value.details() or ""), err.value.details()
                assert parsed["UnaryUnary"] == 1
    finally:
        await server.stop(None)


@pytest.mark.parametrize("placement", MATRIX_PLACEMENTS)
async def test_a_call_over_the_in_flight_limit_is_refused_unread(placement: str) -> None:
    # The limit refuses from its count alone (on_start), before the request is read.
    from vllm_servicer.interceptors import InflightInterceptor

    stack = [*_stack("tracing,auth"), InflightInterceptor(1, limited=all_methods)]
    server = _serve_stack(placement, stack)
    address = await _start(server)
    parsed.clear()
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            held_open: asyncio.Queue[bytes | None] = asyncio.Queue()

            async def requests() -> AsyncIterator[bytes]:
                while (message := await held_open.get()) is not None:
                    yield message

            holder = channel.stream_stream(f"/{SERVICE}/StreamStream")(
                requests(), metadata=bearer(KEY)
            )
            await held_open.put(b"x")
            assert await holder.read() == b"x"  # the one slot is taken
            parsed.clear()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await channel.unary_unary(f"/{SERVICE}/UnaryUnary")(b"y", metadata=bearer(KEY))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert parsed["UnaryUnary"] == 0
            await held_open.put(None)
            assert await holder.read() is grpc.aio.EOF
            assert await holder.code() == grpc.StatusCode.OK
            assert await channel.unary_unary(f"/{SERVICE}/UnaryUnary")(b"y", metadata=bearer(KEY))
            assert parsed["UnaryUnary"] == 1
    finally:
        await server.stop(None)


class KindRecorder(CallInterceptorBase):
    """Records the kind of each call it starts, as metrics labels it."""

    def __init__(self) -> None:
        super().__init__()
        self.kinds: dict[str, str] = {}

    async def on_start(self, call: Any) -> None:
        self.kinds[call.name] = call.kind


@pytest.mark.parametrize("placement", MATRIX_PLACEMENTS)
@pytest.mark.parametrize("stack_names", ["auth", "tracing,auth", "host,tracing,auth"])
async def test_interceptors_see_each_method_s_own_kind(placement: str, stack_names: str) -> None:
    # The wrapper reads a unary request as a stream of one message; the hooks,
    # and so the metrics' grpc_type, still see the method's declared kind.
    outer, inner = KindRecorder(), KindRecorder()
    stack = [outer, *_stack(stack_names), inner]
    server = _serve_stack(placement, stack)
    address = await _start(server)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            for name in HANDLERS:
                await _call(channel, name, bearer(KEY))
    finally:
        await server.stop(None)
    declared = {
        "UnaryUnary": "unary_unary",
        "UnaryStream": "unary_stream",
        "StreamUnary": "stream_unary",
        "StreamStream": "stream_stream",
    }
    assert outer.kinds == inner.kinds == declared
