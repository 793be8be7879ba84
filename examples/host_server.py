"""A host application's own gRPC server, with vLLM's protocol mounted beside its service.

    python examples/host_server.py 127.0.0.1:50051 /path/to/model

The host has a service of its own (a tiny echo service) and a server-wide
interceptor of its own (it logs every call); vllm-servicer adds VllmEngine,
health and reflection, with metrics and API-key auth on its services only.
"""

import asyncio
import logging
import sys

import grpc
from prometheus_client import CollectorRegistry

from vllm_servicer import AuthInterceptor, MetricsInterceptor, mount, server_options
from vllm_servicer.engine import served_model_name
from vllm_servicer.interceptors import ApiKeyVerifier, start_metrics_server

log = logging.getLogger("host")


class AccessLog(grpc.aio.ServerInterceptor):
    """The host's own interceptor: it sees every call on the server."""

    def __init__(self) -> None:
        self.methods: list[str] = []

    async def intercept_service(self, continuation, handler_call_details):
        self.methods.append(handler_call_details.method)
        log.info("call %s", handler_call_details.method)
        return await continuation(handler_call_details)


async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return b"echo:" + request


ECHO_SERVICE = grpc.method_handlers_generic_handler(
    "host.Echo", {"Say": grpc.unary_unary_rpc_method_handler(echo)}
)


def build_server(engine, api_keys: list[str], registry: CollectorRegistry):
    """The host's server with its own service, and vLLM's protocol mounted."""
    access_log = AccessLog()
    server = grpc.aio.server(interceptors=[access_log], options=server_options())
    server.add_generic_rpc_handlers((ECHO_SERVICE,))
    metrics = MetricsInterceptor(registry=registry, model_name=served_model_name(engine))
    auth = AuthInterceptor(ApiKeyVerifier(api_keys))
    mounted = mount(server, engine, interceptors=[metrics, auth])
    return server, mounted, access_log


async def main(address: str, model: str) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model))
    registry = CollectorRegistry()
    server, _, _ = build_server(engine, api_keys=["change-me"], registry=registry)
    server.add_insecure_port(address)
    start_metrics_server(9090, registry=registry)
    await server.start()
    try:
        await server.wait_for_termination()
    finally:
        engine.shutdown()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    asyncio.run(main(sys.argv[1], sys.argv[2]))
