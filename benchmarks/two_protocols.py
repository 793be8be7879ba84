"""Tokens/s over gRPC and vLLM's HTTP API from one engine, each alone and both at once.

    python benchmarks/two_protocols.py [--concurrency 32] [--requests 64] [--rounds 3]

Starts `python -m vllm_servicer serve --port 0 --http-port 0` (the tiny model
unless `-- --model ...` flags follow), then runs alternating bursts of
streaming requests (prompt 8 tokens, 64 new tokens each, greedy,
`ignore_eos`): all over gRPC, all over HTTP (`/v1/completions`, raw SSE
through httpx), and half over each at once, at the same total concurrency.
Prints the median tokens/s of each. The client runs pinned to the core the
engine leaves free; on a 2-core machine it is itself a large share of the
work, so compare the rows with each other rather than with other tables.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from loadgen import make_prompt  # noqa: E402

from vllm_servicer.proto import vllm_engine_pb2 as pb  # noqa: E402
from vllm_servicer.proto import vllm_engine_pb2_grpc  # noqa: E402

MAX_TOKENS = 64


async def _grpc_one(stub: Any, n: int) -> int:
    request = pb.GenerateRequest(
        request_id=f"bench-{n}",
        tokenized=pb.TokenizedInput(input_ids=make_prompt(8)),
        sampling_params=pb.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
        stream=True,
    )
    tokens = 0
    async for message in stub.Generate(request):
        if message.HasField("chunk"):
            tokens += len(message.chunk.token_ids)
    return tokens


async def _http_one(http: httpx.AsyncClient, model: str) -> int:
    body = {
        "model": model,
        "prompt": make_prompt(8),
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    tokens = 0
    async with http.stream("POST", "/v1/completions", json=body) as reply:
        async for line in reply.aiter_lines():
            if line.startswith("data: {"):
                tokens += len(json.loads(line[6:])["choices"][0].get("token_ids") or [])
    return tokens


async def _burst(calls: list[Any], concurrency: int) -> tuple[int, float]:
    """Run the call factories `concurrency` at a time; return (tokens, seconds)."""
    slots = asyncio.Semaphore(concurrency)

    async def run(call: Any) -> int:
        async with slots:
            return int(await call())

    started = time.perf_counter()
    counts = await asyncio.gather(*(run(c) for c in calls))
    return sum(counts), time.perf_counter() - started


async def measure(grpc_address: str, http_url: str, args: argparse.Namespace) -> dict[str, Any]:
    async with (
        grpc.aio.insecure_channel(grpc_address) as channel,
        httpx.AsyncClient(
            base_url=http_url,
            timeout=120,
            limits=httpx.Limits(max_connections=args.concurrency),
        ) as http,
    ):
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        counter = iter(range(10**9))

        def over_grpc() -> Any:
            return lambda: _grpc_one(stub, next(counter))

        def over_http() -> Any:
            return lambda: _http_one(http, model)

        c, n = args.concurrency, args.requests
        results: dict[str, list[float]] = {
            k: [] for k in ("grpc alone", "http alone", "both: grpc", "both: http", "both: total")
        }
        await _burst([over_grpc() for _ in range(8)] + [over_http() for _ in range(8)], 16)
        for _ in range(args.rounds):
            tokens, seconds = await _burst([over_grpc() for _ in range(n)], c)
            results["grpc alone"].append(tokens / seconds)
            tokens, seconds = await _burst([over_http() for _ in range(n)], c)
            results["http alone"].append(tokens / seconds)
            # Half the requests over each, at the same total concurrency.
            started = time.perf_counter()
            (g, g_s), (h, h_s) = await asyncio.gather(
                _burst([over_grpc() for _ in range(n // 2)], c // 2),
                _burst([over_http() for _ in range(n // 2)], c // 2),
            )
            total_s = time.perf_counter() - started
            results["both: grpc"].append(g / g_s)
            results["both: http"].append(h / h_s)
            results["both: total"].append((g + h) / total_s)
        return results


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=64, help="requests per burst")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("serve_flags", nargs="*", help="extra launcher flags (after --)")
    args = parser.parse_args()

    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "vllm_servicer",
        "serve",
        "--port",
        "0",
        "--http-port",
        "0",
        *args.serve_flags,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert proc.stdout is not None
    try:
        found: dict[str, str] = {}
        while len(found) < 2:
            line = (await proc.stdout.readline()).decode()
            if not line:
                raise SystemExit("the launcher ended before it served")
            if m := re.search(r"listening on (\S+:\d+)", line):
                found["grpc"] = m.group(1)
            if m := re.search(r"http on (http://\S+:\d+)", line):
                found["http"] = m.group(1)

        async def discard() -> None:
            while await proc.stdout.readline():  # type: ignore[union-attr]
                pass

        reader = asyncio.ensure_future(discard())
        if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
            os.sched_setaffinity(0, {1})  # vLLM's CPU worker takes core 0
        results = await measure(found["grpc"], found["http"], args)
        print(
            f"streaming, prompt 8, {MAX_TOKENS} new tokens, concurrency {args.concurrency} "
            f"in total, {args.requests} requests per burst, median of {args.rounds} rounds"
        )
        for name, values in results.items():
            low, high = min(values), max(values)
            print(f"{name:<12} {statistics.median(values):8.0f} tok/s  ({low:.0f}-{high:.0f})")
        reader.cancel()
        return 0
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.wait(), 60)


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
