"""Mount vLLM's gRPC protocol on your own grpc.aio server."""

import asyncio
import sys

import grpc
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.v1.engine.async_llm import AsyncLLM

from vllm_servicer import mount, server_options


async def main(address: str, engine_args: AsyncEngineArgs) -> None:
    engine = AsyncLLM.from_engine_args(engine_args)
    try:
        server = grpc.aio.server(options=server_options())
        # Your own services go here as usual, e.g.:
        # my_service_pb2_grpc.add_MyServiceServicer_to_server(MyService(), server)
        mount(server, engine)  # VllmEngine, vllm.Inference, Pooling, Render, health...
        server.add_insecure_port(address)  # raises if the address is taken
        await server.start()
        print("serving on", address, flush=True)
        await server.wait_for_termination()
    finally:
        # The engine runs in processes of its own: stop them on every way out.
        engine.shutdown()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], AsyncEngineArgs(model=sys.argv[2])))
