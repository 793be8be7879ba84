"""vLLM's gRPC protocol beside an HTTP app that already holds an AsyncLLM.

    python examples/grpc_beside_http.py HTTP_PORT GRPC_ADDRESS MODEL

Here the HTTP app is vLLM's own OpenAI-compatible one, built with vLLM's
builders; `add_grpc()` works the same for any Starlette or FastAPI app: the
gRPC server starts and stops with the app's lifespan, on the same event loop
and the same engine.
"""

import asyncio
import contextlib
import sys

import grpc

from vllm_servicer import mount, server_options


def add_grpc(app, engine, address: str) -> None:
    """Serve VllmEngine (plus health and reflection) on `address` while `app` runs."""
    app_lifespan = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server = grpc.aio.server(options=server_options())
        mounted = mount(server, engine)
        server.add_insecure_port(address)
        await server.start()
        try:
            async with app_lifespan(app) as state:
                yield state
        finally:
            await mounted.health.start_draining()
            await server.stop(5)  # calls in flight get 5 s

    app.router.lifespan_context = lifespan


async def main(http_port: int, grpc_address: str, model: str) -> None:
    import uvicorn
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.engine.async_llm import AsyncLLM

    from vllm_servicer.vllm_releases import make_arg_parser  # where this vLLM keeps it

    # The arguments `vllm serve` would take; extra flags pass through.
    args = make_arg_parser(FlexibleArgumentParser()).parse_args([model, *sys.argv[4:]])

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs.from_cli_args(args))
    try:
        tasks = await engine.get_supported_tasks()
        app = build_app(args, tasks, engine.model_config)
        await init_app_state(engine, app.state, args, tasks)
        add_grpc(app, engine, grpc_address)
        print(f"http on {http_port}, grpc on {grpc_address}", flush=True)
        await uvicorn.Server(uvicorn.Config(app, port=http_port)).serve()
    finally:
        engine.shutdown()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), sys.argv[2], sys.argv[3]))
