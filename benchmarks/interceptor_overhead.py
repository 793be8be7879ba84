"""What metrics and in-flight counting cost in streaming throughput.

One engine on the built-in tiny model, two grpc.aio servers in this process:
the bare mount, and the mount with `MetricsInterceptor` + `InflightInterceptor`.
A load generator in a subprocess, pinned to one core, drives N concurrent
streams of T tokens (ignore_eos) against each server in turn, alternating the
order every round, and prints tokens/s per round, the medians and the ratio.

    .venv/bin/python benchmarks/interceptor_overhead.py --rounds 6

`--micro` measures the same interceptors without engine or network: the CPU
time per streamed GenerateResponse spent in the interceptor path, which is
what end-to-end numbers on a busy machine cannot resolve below a few percent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import grpc


async def _one_round(address: str, streams: int, tokens: int, tag: str) -> float:
    from vllm_servicer.proto import vllm_engine_pb2 as pb
    from vllm_servicer.proto import vllm_engine_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)

        async def one(i: int) -> int:
            request = pb.GenerateRequest(
                request_id=f"{tag}-{i}",
                tokenized=pb.TokenizedInput(input_ids=[5, 17, 42, 99, 7, 63, 21, 88]),
                sampling_params=pb.SamplingParams(
                    temperature=0.0, max_tokens=tokens, ignore_eos=True
                ),
                stream=True,
            )
            received = 0
            async for message in stub.Generate(request):
                if message.HasField("chunk"):
                    received += len(message.chunk.token_ids)
            return received

        started = time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(streams)))
        elapsed = time.perf_counter() - started
    assert sum(counts) == streams * tokens, counts
    return sum(counts) / elapsed


async def _client(args: argparse.Namespace) -> None:
    if hasattr(os, "sched_setaffinity") and os.cpu_count() and os.cpu_count() > 1:  # type: ignore[operator]
        os.sched_setaffinity(0, {args.core})
    targets = {"bare": args.bare, "intercepted": args.intercepted}
    await _one_round(args.bare, args.streams, args.tokens, "warm-a")
    await _one_round(args.intercepted, args.streams, args.tokens, "warm-b")
    for r in range(args.rounds):
        order = ("bare", "intercepted") if r % 2 == 0 else ("intercepted", "bare")
        result: dict[str, Any] = {"round": r}
        for name in order:
            result[name] = await _one_round(
                targets[name], args.streams, args.tokens, f"r{r}-{name}"
            )
        print(json.dumps(result), flush=True)


async def _serve_and_drive(args: argparse.Namespace) -> None:
    from prometheus_client import CollectorRegistry

    from vllm_servicer import mount
    from vllm_servicer.interceptors import InflightInterceptor, MetricsInterceptor
    from vllm_servicer.tiny_model import build_tiny_engine

    engine = build_tiny_engine()
    servers = []
    addresses = []
    try:
        for interceptors in ((), (MetricsInterceptor(CollectorRegistry()), InflightInterceptor())):
            server = grpc.aio.server()
            mount(server, engine, interceptors=interceptors)
            addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
            await server.start()
            servers.append(server)
        command = [
            sys.executable,
            __file__,
            "--client",
            f"--bare={addresses[0]}",
            f"--intercepted={addresses[1]}",
            f"--rounds={args.rounds}",
            f"--streams={args.streams}",
            f"--tokens={args.tokens}",
            f"--core={args.core}",
        ]
        process = await asyncio.create_subprocess_exec(*command, stdout=subprocess.PIPE)
        assert process.stdout is not None
        rounds = []
        while line := await process.stdout.readline():
            result = json.loads(line)
            rounds.append(result)
            print(
                f"round {result['round']}: bare {result['bare']:8.0f} tok/s   "
                f"intercepted {result['intercepted']:8.0f} tok/s   "
                f"ratio {result['intercepted'] / result['bare']:.3f}",
                flush=True,
            )
        if await process.wait() != 0:
            raise SystemExit("load generator failed")
        bare = statistics.median(r["bare"] for r in rounds)
        intercepted = statistics.median(r["intercepted"] for r in rounds)
        ratios = statistics.median(r["intercepted"] / r["bare"] for r in rounds)
        print(
            f"median: bare {bare:.0f} tok/s, intercepted {intercepted:.0f} tok/s, "
            f"ratio of medians {intercepted / bare:.3f}, median of per-round ratios {ratios:.3f}"
        )
    finally:
        for server in servers:
            await server.stop(None)
        engine.shutdown()


def _micro(messages: int = 1000, calls: int = 200) -> None:
    from prometheus_client import CollectorRegistry

    from vllm_servicer.interceptors import InflightInterceptor, MetricsInterceptor
    from vllm_servicer.interceptors._apply import apply_interceptors
    from vllm_servicer.proto import SERVICE_NAME
    from vllm_servicer.proto import vllm_engine_pb2 as pb

    chunks = [
        pb.GenerateResponse(chunk=pb.GenerateStreamChunk(token_ids=[i], prompt_tokens=8))
        for i in range(messages)
    ]
    complete = pb.GenerateResponse(
        complete=pb.GenerateComplete(output_ids=[1], finish_reason="length", prompt_tokens=8)
    )

    async def generate(request: Any, context: Any) -> Any:
        for chunk in chunks:
            yield chunk
        yield complete

    class Context:
        def invocation_metadata(self) -> tuple[()]:
            return ()

        def code(self) -> None:
            return None

        def time_remaining(self) -> None:
            return None

    handler = grpc.unary_stream_rpc_method_handler(generate)
    method = f"/{SERVICE_NAME}/Generate"
    wrapped = apply_interceptors(
        [MetricsInterceptor(CollectorRegistry()), InflightInterceptor()], method, handler
    ).unary_stream
    bare = apply_interceptors([], method, handler).unary_stream

    async def run(behaviour: Any) -> float:
        started = time.process_time()
        for _ in range(calls):
            async for _message in behaviour(None, Context()):
                pass
        return (time.process_time() - started) / (calls * (messages + 1))

    async def both() -> None:
        await run(bare), await run(wrapped)  # warm up
        costs = {name: [] for name in ("bare", "intercepted")}  # type: dict[str, list[float]]
        for _ in range(5):
            costs["bare"].append(await run(bare))
            costs["intercepted"].append(await run(wrapped))
        b = statistics.median(costs["bare"]) * 1e6
        i = statistics.median(costs["intercepted"]) * 1e6
        print(
            f"per message: handler path {b:.2f} us, with metrics+inflight {i:.2f} us, "
            f"interceptor cost {i - b:.2f} us/message "
            f"(= {(i - b) * 1e-6 * 10000:.1%} of one core at 10k messages/s)"
        )

    asyncio.run(both())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--core", type=int, default=1, help="the core the load generator uses")
    parser.add_argument("--micro", action="store_true", help="the in-process cost per message")
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--bare", help=argparse.SUPPRESS)
    parser.add_argument("--intercepted", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.micro:
        _micro()
        return
    asyncio.run(_client(args) if args.client else _serve_and_drive(args))


if __name__ == "__main__":
    main()
