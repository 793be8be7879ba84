"""A tour of the protocol from Python: every common call once.

    python examples/client_tour.py 127.0.0.1:50051

Streaming and non-streaming Generate, n>1, structured output, Abort of a
running stream, Embed (when the server runs a pooling model), and health.
"""

import argparse
import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from vllm_servicer.proto import vllm_engine_pb2 as pb
from vllm_servicer.proto import vllm_engine_pb2_grpc

PROMPT = pb.TokenizedInput(input_ids=[5, 17, 42, 99, 7])


def generate(request_id, stream=False, **sampling):
    sampling.setdefault("temperature", 0.0)
    return pb.GenerateRequest(
        request_id=request_id,
        tokenized=PROMPT,
        sampling_params=pb.SamplingParams(**sampling),
        stream=stream,
    )


async def main(address: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)

        health = health_pb2_grpc.HealthStub(channel)
        status = await health.Check(health_pb2.HealthCheckRequest(service=""))
        print("health:", health_pb2.HealthCheckResponse.ServingStatus.Name(status.status))

        # Streaming: a chunk per engine step, then a complete.
        tokens = []
        async for r in stub.Generate(generate("tour-stream", stream=True, max_tokens=8)):
            if r.HasField("chunk"):
                tokens += r.chunk.token_ids
            else:
                print("stream:", tokens, r.complete.finish_reason)

        # Non-streaming with n=2: one complete per choice.
        request = generate("tour-n2", n=2, temperature=1.0, seed=1, max_tokens=4)
        async for r in stub.Generate(request):
            print(f"choice {r.complete.index}:", list(r.complete.output_ids))

        # Structured output: the answer is one of the choices.
        request = generate("tour-choice", max_tokens=10)
        request.sampling_params.choice.choices.extend(["yes", "no"])
        async for r in stub.Generate(request):
            print("choice-constrained ids:", list(r.complete.output_ids))

        # Abort a running stream from a second call: it ends with "abort", status OK.
        running = stub.Generate(
            generate("tour-abort", stream=True, max_tokens=400, ignore_eos=True)
        )
        await running.read()
        await stub.Abort(pb.AbortRequest(request_ids=["tour-abort"]))
        while (r := await running.read()) is not grpc.aio.EOF:
            if r.HasField("complete"):
                print("aborted stream:", r.complete.finish_reason)

        # Embed needs a pooling model; a generation server says so.
        try:
            reply = await stub.Embed(pb.EmbedRequest(request_id="tour-embed", tokenized=PROMPT))
            print("embedding dimension:", reply.embedding_dim)
        except grpc.aio.AioRpcError as err:
            print("embed:", err.code().name, "-", err.details())

        info = await stub.GetServerInfo(pb.GetServerInfoRequest())
        print("server:", info.server_type, "active requests:", info.active_requests)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("address", nargs="?", default="127.0.0.1:50051", help="HOST:PORT")
    asyncio.run(main(parser.parse_args().address))
