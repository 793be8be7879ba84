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

from vllm_servicer import SERVICE_NAME, mount
from vllm_servicer._registration import register
from vllm_servicer.interceptors._base import all_methods
from vllm_servicer.interceptors._pipeline import wrapped_handler
from vllm_servicer.interceptors.auth import ApiKeyVerifier, AuthInterceptor
from vllm_servicer.interceptors.tracing import TracingInterceptor
from vllm_servicer.proto import vllm_engine_pb2 as pb

KEY = "tenant-0123456789abcdefABCDEF"
SERVICE = "test.Counted"
PLACEMENTS = ("server_wide", "mounted")
# Not a protobuf message: a field tag whose varint never ends.
GARBAGE = b"\xff\xff\xff"


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


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


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("name", list(HANDLERS))
async def test_refused_call_never_deserializes_its_request(placement: str, name: str) -> None:
    auth = AuthInterceptor(ApiKeyVerifier([KEY]), methods=all_methods)
    server = _serve_host_service(placement, [auth])
    address = await _start(server)
    parsed.clear()
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            for metadata in ((), bearer("unknown-0123456789abcdef")):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _call(channel, name, metadata)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert parsed[name] == 0
            await _call(channel, name, bearer(KEY))
            assert parsed[name] >= 1
    finally:
        await server.stop(None)


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


@pytest.mark.parametrize("placement", PLACEMENTS)
async def test_compressed_request_is_bounded_after_inflation_and_never_parsed(
    placement: str,
) -> None:
    # 16 MiB of zeros gzip to a few KiB: grpc stops inflating at the receive
    # limit, before any handler, key or no key.
    auth = AuthInterceptor(ApiKeyVerifier([KEY]), methods=all_methods)
    server_options = [("grpc.max_receive_message_length", 1 << 20)]
    if placement == "server_wide":
        server = grpc.aio.server(interceptors=[auth], options=server_options)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, HANDLERS),))
    else:
        server = grpc.aio.server(options=server_options)
        register(
            server,
            SERVICE,
            {n: wrapped_handler([auth], f"/{SERVICE}/{n}", h) for n, h in HANDLERS.items()},
        )
    address = await _start(server)
    parsed.clear()
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            call = channel.unary_unary(f"/{SERVICE}/UnaryUnary")
            for metadata in ((), bearer(KEY)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    gzip = grpc.Compression.Gzip
                    await call(bytes(16 << 20), metadata=metadata, compression=gzip)
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert parsed["UnaryUnary"] == 0
    finally:
        await server.stop(None)
