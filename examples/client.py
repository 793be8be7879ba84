"""Call a vllm-servicer (or any vLLM gRPC) server: stream tokens for a prompt.

python examples/client.py 127.0.0.1:50051 "Hello, world"
"""

import asyncio
import sys

import grpc

from vllm_servicer.proto import vllm_engine_pb2 as pb
from vllm_servicer.proto import vllm_engine_pb2_grpc


async def main(address: str, prompt: str, max_tokens: int = 16) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        info = await stub.GetModelInfo(pb.GetModelInfoRequest())
        print("model:", info.served_model_name, flush=True)
        request = pb.GenerateRequest(
            request_id="example-1",
            text=prompt,
            stream=True,
            sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens),
        )
        async for response in stub.Generate(request, timeout=60):
            if response.HasField("chunk"):
                print("tokens:", list(response.chunk.token_ids), flush=True)
            else:
                print("finish_reason:", response.complete.finish_reason, flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "Hello, world"))
