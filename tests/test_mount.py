"""mount() into a host's own server: its services, interceptors and options stay intact."""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from support import collect, completes, request, serving

from vllm_servicer import SERVICE_NAME, MountError, MountOptions, mount
from vllm_servicer.engine import missing_members
from vllm_servicer.proto import vllm_engine_pb2 as pb
from vllm_servicer.proto import vllm_engine_pb2_grpc
from vllm_servicer.serve.http_guard import GuardedEngine

# The host's own service: grpc's standard health service stands in for "any
# service the host already had", registered under a name of the host's choosing
# would need its own proto; a generic handler keeps the test self-contained.
HOST_METHOD = "/host.Echo/Say"


def _host_echo_handler() -> grpc.GenericRpcHandler:
    async def say(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        return b"host:" + request

    return grpc.method_handlers_generic_handler(
        "host.Echo", {"Say": grpc.unary_unary_rpc_method_handler(say)}
    )


class RecordingInterceptor(grpc.aio.ServerInterceptor):
    """A host interceptor that records every method it sees."""

    def __init__(self) -> None:
        self.methods: list[str] = []

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        self.methods.append(details.method)
        return await continuation(details)


@pytest.fixture(scope="module")
async def host(engine: Any) -> AsyncIterator[tuple[grpc.aio.Channel, RecordingInterceptor, str]]:
    interceptor = RecordingInterceptor()
    server = grpc.aio.server(
        interceptors=[interceptor], options=[("grpc.max_receive_message_length", 1 << 20)]
    )
    server.add_generic_rpc_handlers((_host_echo_handler(),))
    async with serving(engine, server=server) as served:
        yield served.channel, interceptor, served.address


async def test_host_service_and_vllm_service_both_answer(host: Any) -> None:
    channel, interceptor, _ = host
    echo = channel.unary_unary(HOST_METHOD)
    assert await echo(b"hi") == b"host:hi"
    stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    messages = await collect(stub.Generate(request(max_tokens=3, ignore_eos=True)))
    assert len(completes(messages)[0].output_ids) == 3
    # The host's server-wide interceptor saw both.
    assert HOST_METHOD in interceptor.methods
    assert f"/{SERVICE_NAME}/Generate" in interceptor.methods


async def test_host_options_still_apply(host: Any) -> None:
    channel, _, _ = host
    echo = channel.unary_unary(HOST_METHOD)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await echo(b"x" * (2 << 20))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_health_service(host: Any) -> None:
    channel, _, _ = host
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", SERVICE_NAME):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_reflection_lists_and_resolves_every_service(host: Any) -> None:
    _, _, address = host

    def resolve_all() -> tuple[set[str], set[str], bool]:
        # grpcio-reflection's own client is synchronous: run it off the event loop.
        with grpc.insecure_channel(address) as sync_channel:
            database = ProtoReflectionDescriptorDatabase(sync_channel)
            services = set(database.get_services())
            pool = descriptor_pool.DescriptorPool(database)
            service = pool.FindServiceByName(SERVICE_NAME)
            for method in service.methods:  # every input and output type resolves
                assert method.input_type.full_name and method.output_type.full_name
            common = bool(pool.FindMessageTypeByName("smg.grpc.common.KvEventBatch").fields)
            return services, {m.name for m in service.methods}, common

    services, methods, common_resolves = await asyncio.to_thread(resolve_all)
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= services
    assert {"Generate", "Embed", "HealthCheck", "Abort", "GetModelInfo", "GetLoads"} <= methods
    assert common_resolves


async def test_reflection_reveals_nothing_but_the_mounted_services(host: Any) -> None:
    """Reflection needs no credentials: the rest of the process's descriptors stay unseen."""
    _, _, address = host
    # In this process's default pool (the error details module loaded it), not served.
    hidden = "google.rpc.BadRequest"
    assert descriptor_pool.Default().FindMessageTypeByName(hidden)

    def lookups() -> tuple[bool, bool, bool]:
        with grpc.insecure_channel(address) as sync_channel:
            database = ProtoReflectionDescriptorDatabase(sync_channel)
            pool = descriptor_pool.DescriptorPool(database)

            def found(find: Any, name: str) -> bool:
                try:
                    find(name)
                except KeyError:
                    return False
                return True

            return (
                found(pool.FindServiceByName, SERVICE_NAME),
                found(pool.FindMessageTypeByName, hidden),
                found(pool.FindFileByName, "google/rpc/error_details.proto"),
            )

    served, by_symbol, by_file = await asyncio.to_thread(lookups)
    assert served and not by_symbol and not by_file


async def test_mount_after_start_is_an_error(engine: Any) -> None:
    server = grpc.aio.server()
    server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        with pytest.raises(MountError, match="before server.start"):
            mount(server, engine)
    finally:
        await server.stop(None)


async def test_an_engine_lacking_members_is_refused_at_mount_naming_them(engine: Any) -> None:
    # The protocol declares nothing that vLLM's AsyncLLM lacks.
    assert missing_members(engine) == []

    class HalfAnEngine:
        errored = False
        model_config = engine.model_config

    server = grpc.aio.server()
    with pytest.raises(TypeError, match=r"HalfAnEngine has no abort, encode, engine_core, ") as err:
        mount(server, HalfAnEngine())  # type: ignore[arg-type]
    assert "errored" not in str(err.value) and "model_config" not in str(err.value)
    await server.stop(None)


async def test_every_way_in_runs_on_the_one_tenant_engine(engine: Any) -> None:
    """The gRPC call frame, vLLM's handlers (Pooling, Render) and the HTTP API
    keep tenancy's promises through the same object, built once per mount."""
    server = grpc.aio.server()
    mounted = mount(server, engine, MountOptions.of(shared_prefix_cache=True))
    try:
        tenant = mounted.state.tenant
        assert mounted.state.steps.tenant is tenant
        assert mounted.state.handlers.claiming.tenant is tenant
        assert mounted.guard.tenant is tenant
        assert GuardedEngine(engine, mounted.guard, authenticated=True).tenant is tenant
        assert tenant.running is mounted.state.running
        # The suite's engine runs in arrival order (fcfs): a request's priority
        # is the client's own, as vLLM would take it, not a fair-order tag.
        assert engine.vllm_config.scheduler_config.policy == "fcfs"
        assert tenant.ordered is False
    finally:
        await server.stop(None)


async def test_switches_leave_services_out(engine: Any) -> None:
    async with serving(
        engine, health=False, reflection_service=False, load_reports=False
    ) as served:
        assert served.mounted.health is None
        assert served.mounted.load_reports is None
        assert served.mounted.state.load_reporter is None
        # The inference protocols, pooling and rendering by default; vllm.Control
        # only when asked.
        assert served.mounted.service_names == (
            SERVICE_NAME,
            "vllm.Inference",
            "vllm_servicer.v1.Pooling",
            "vllm_servicer.v1.Render",
        )
        assert served.mounted.pooling is not None and served.mounted.render is not None
        channel = served.channel
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        reply = await vllm_engine_pb2_grpc.VllmEngineStub(channel).HealthCheck(
            pb.HealthCheckRequest()
        )
        assert reply.healthy


async def test_mount_level_interceptors_see_only_mounted_services(engine: Any) -> None:
    interceptor = RecordingInterceptor()
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((_host_echo_handler(),))
    async with serving(engine, server=server, interceptors=[interceptor]) as served:
        channel = served.channel
        assert await channel.unary_unary(HOST_METHOD)(b"x") == b"host:x"
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        await stub.HealthCheck(pb.HealthCheckRequest())
        messages = await collect(stub.Generate(request(max_tokens=2, stream=True)))
        assert completes(messages)
        # health Watch is a context.write-style stream: it must still stream.
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        first = await watch.read()
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
        assert interceptor.methods == [
            f"/{SERVICE_NAME}/HealthCheck",
            f"/{SERVICE_NAME}/Generate",
            "/grpc.health.v1.Health/Watch",
        ]


async def test_options_come_as_one_object(engine: Any) -> None:
    server = grpc.aio.server()
    options = MountOptions.of(health=False, load_reports=False, services=(SERVICE_NAME,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mounted = mount(server, engine, options)
    assert mounted.options is options
    assert mounted.health is None and mounted.load_reports is None
    assert mounted.service_names == (SERVICE_NAME, "grpc.reflection.v1alpha.ServerReflection")
    await server.stop(None)


async def test_the_keyword_form_still_mounts_and_names_its_replacement(engine: Any) -> None:
    # mount()'s keywords before MountOptions: kept for a release, with a warning
    # that names the new form and points at the caller's line.
    server = grpc.aio.server()
    with pytest.warns(DeprecationWarning) as caught:
        mounted = mount(server, engine, health=False, load_reports=False, budgets=None)
    [warning] = caught.list
    assert str(warning.message).startswith(
        "mount(server, engine, health=..., load_reports=..., budgets=...) is deprecated: pass "
        "mount(server, engine, MountOptions.of(health=..., load_reports=..., budgets=...))"
    )
    assert warning.filename == __file__
    assert mounted.options == MountOptions.of(health=False, load_reports=False)
    assert mounted.health is None and mounted.load_reports is None
    await server.stop(None)


async def test_options_are_taken_one_way_and_checked_once(engine: Any) -> None:
    server = grpc.aio.server()
    with pytest.raises(TypeError, match="not both"):
        mount(server, engine, MountOptions(), health=False)
    with pytest.raises(TypeError, match="unexpected keyword argument 'helth'"):
        mount(server, engine, helth=False)
    with pytest.raises(ValueError, match="services must be some of"):
        MountOptions.of(services=("vllm.Nothing",))
    with (
        pytest.raises(ValueError, match="services must be some of"),
        pytest.warns(DeprecationWarning),
    ):
        mount(server, engine, services=())
    await server.stop(None)
