"""What each interceptor costs the serving process: metrics, in-flight, auth, tracing, the stack.

One grpc.aio server per configuration, all in this process: the bare mount, a
second bare mount (its "cost" is the run's noise floor), the mount with one
interceptor each (`MetricsInterceptor`, `InflightInterceptor` with a limit,
`AuthInterceptor` with an API key, `TracingInterceptor` exporting to the
OpenTelemetry SDK), the launcher's default stack with keys (metrics + auth +
in-flight limit) and its full stack (tracing + metrics + auth + in-flight limit).
Every configuration is wrapped as `mount()` wraps Generate: the error layer,
and the in-flight count `mount()` adds when none is given. The benchmarks' load
generator (`loadgen.py`) in a subprocess, pinned to one core, drives N
concurrent streams of T tokens against one server at a time, rotating the order
every round. The CPU time of this process's event-loop thread (where
interceptors run) per message sent is each configuration's cost; its ratio to
the bare mount's, per round, is the interceptor's share.

    .venv/bin/python benchmarks/interceptor_overhead.py --micro --rounds 12
    .venv/bin/python benchmarks/interceptor_overhead.py --rounds 10

`--micro` serves a stand-in Generate handler (prebuilt messages, no engine) on
the cores the load generator does not use: what is left is grpc's own cost per
message and the interceptors'. Without it the servers mount a real engine (the
tiny model), where engine work adds to the noise; on 2 shared cores single
rounds still swing by tens of percent either way, so read the median and the
second bare mount's figure beside it.

Measure through a real server, not by calling the handler in a loop: between
two messages of a stream the server runs everything else, so per-message code
runs cache-cold and costs several times what a tight loop shows.
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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

API_KEY = "bench-key-0123456789"
# "bare-again" is a second bare mount: its "cost" is the noise floor of the run.
CONFIGS = ("bare", "bare-again", "metrics", "inflight", "auth", "tracing", "stack", "full")


def build_interceptors(name: str) -> tuple[Sequence[Any], Callable[[], None]]:
    """The interceptors of a configuration, and what to call between rounds."""
    from prometheus_client import CollectorRegistry

    from vllm_servicer.interceptors import AuthInterceptor, InflightInterceptor, MetricsInterceptor
    from vllm_servicer.interceptors.api_keys import ApiKeyVerifier

    def nothing() -> None:
        pass

    if name in ("bare", "bare-again"):
        return (), nothing
    if name == "metrics":
        return (MetricsInterceptor(CollectorRegistry()),), nothing
    if name == "inflight":
        return (InflightInterceptor(1024),), nothing
    if name == "auth":
        return (AuthInterceptor(ApiKeyVerifier([API_KEY])),), nothing
    if name == "stack":  # the launcher's order: metrics, auth, the in-flight limit
        return (
            MetricsInterceptor(CollectorRegistry()),
            AuthInterceptor(ApiKeyVerifier([API_KEY])),
            InflightInterceptor(1024),
        ), nothing
    if name in ("tracing", "full"):
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        from vllm_servicer.interceptors.tracing import TracingInterceptor

        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(exporter))
        tracing = TracingInterceptor(provider, model="tiny")
        if name == "tracing":
            return (tracing,), exporter.clear
        return (
            tracing,
            MetricsInterceptor(CollectorRegistry()),
            AuthInterceptor(ApiKeyVerifier([API_KEY])),
            InflightInterceptor(1024),
        ), exporter.clear
    raise ValueError(f"unknown configuration {name!r}; choose from {', '.join(CONFIGS)}")


# ----- the servers (this process) ---------------------------------------------------


def _stand_in_generate(tokens: int) -> Any:
    """A Generate handler streaming `tokens` one-token chunks and a complete, no engine."""
    from vllm_servicer.context import kept_usage
    from vllm_servicer.proto import vllm_engine_pb2 as pb

    chunks = [
        pb.GenerateResponse(
            chunk=pb.GenerateStreamChunk(token_ids=[i + 3], prompt_tokens=8, completion_tokens=1)
        )
        for i in range(tokens)
    ]
    complete = pb.GenerateResponse(
        complete=pb.GenerateComplete(output_ids=[3], finish_reason="length", prompt_tokens=8)
    )

    async def generate(request: Any, context: Any) -> Any:
        # Keeps the usage record the metrics and tracing read, as the servicer does.
        usage = kept_usage()
        if usage is not None:
            usage.prompt_tokens = 8
        for chunk in chunks:
            await asyncio.sleep(0)  # streams interleave, as engine steps make them
            if usage is not None:
                usage.chunk_sent(1)
            yield chunk
        if usage is not None:
            usage.choice_finished(0, "length", 0)
        yield complete

    return grpc.unary_stream_rpc_method_handler(
        generate, pb.GenerateRequest.FromString, pb.GenerateResponse.SerializeToString
    )


async def _serve_and_drive(args: argparse.Namespace) -> None:
    from vllm_servicer import mount
    from vllm_servicer.mounting import engine_pipeline
    from vllm_servicer.proto import SERVICE_NAME
    from vllm_servicer.status import error_layer
    from vllm_servicer.testing.tiny_model import build_tiny_engine

    engine = None
    if args.micro:
        if args.core >= 0 and len(os.sched_getaffinity(0)) > 1:
            os.sched_setaffinity(0, os.sched_getaffinity(0) - {args.core})
    else:
        engine = build_tiny_engine()
        if args.core >= 0:
            # As in run.py: keep the engine's spinning processes off the load generator's core.
            from run import keep_engine_off

            keep_engine_off(os.getpid(), args.core)
    servers: list[Any] = []
    targets: dict[str, str] = {}
    between_rounds: list[Callable[[], None]] = []
    process = None
    try:
        for name in args.configs:
            interceptors, reset = build_interceptors(name)
            between_rounds.append(reset)
            server = grpc.aio.server()
            if engine is not None:
                mount(server, engine, interceptors=interceptors)
            else:
                # The wrapping mount() gives Generate, around the stand-in.
                method = f"/{SERVICE_NAME}/Generate"
                pipeline, _ = engine_pipeline(interceptors)
                handler = pipeline.wrap(method, _stand_in_generate(args.tokens), errors=error_layer)
                server.add_generic_rpc_handlers(
                    (grpc.method_handlers_generic_handler(SERVICE_NAME, {"Generate": handler}),)
                )
            targets[name] = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
            await server.start()
            servers.append(server)
        # The benchmarks' load generator, sending the API key the auth configurations check.
        command = [sys.executable, str(Path(__file__).with_name("loadgen.py")), "--serve-stdin"]
        command += ["--cpu", str(args.core), "--api-key", API_KEY]
        process = await asyncio.create_subprocess_exec(
            *command, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        assert process.stdin is not None and process.stdout is not None

        spec = {
            "concurrency": args.streams,
            "requests": args.streams * args.waves,
            "stream": True,
            "max_tokens": args.tokens,
        }

        async def burst(name: str) -> dict[str, Any]:
            started, started_loop = time.process_time(), time.thread_time()
            ask = json.dumps({**spec, "target": targets[name]}) + "\n"
            process.stdin.write(ask.encode())  # type: ignore[union-attr]
            line = await process.stdout.readline()  # type: ignore[union-attr]
            if not line:
                raise SystemExit("load generator failed")
            result: dict[str, Any] = json.loads(line)
            if result["errors"]:
                raise SystemExit(f"{name}: {result['errors']} bad calls: {result['error_samples']}")
            # The interceptors run on the event loop's thread; the process total
            # also holds grpc's and vLLM's own threads, which add noise.
            loop_cpu = time.thread_time() - started_loop
            result["cpu_ms_per_1k"] = (
                (time.process_time() - started) / result["output_tokens"] * 1e6
            )
            result["loop_us_per_message"] = loop_cpu / result["messages"] * 1e6
            return result

        for name in args.configs:  # warm-up: connections, first-call paths
            await burst(name)
        rounds: list[dict[str, dict[str, float]]] = []
        names = list(args.configs)
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            if r % 2:
                order.reverse()
            results = {name: await burst(name) for name in order}
            rounds.append(results)
            for reset in between_rounds:
                reset()
            print(
                f"round {r}: "
                + "  ".join(f"{n} {results[n]['loop_us_per_message']:.0f}" for n in names)
                + "  (event-loop CPU-us per message)",
                flush=True,
            )
        _report(names, rounds, args)
    finally:
        if process is not None and process.returncode is None:
            process.stdin.close()  # type: ignore[union-attr]
            await process.wait()
        for server in servers:
            await server.stop(None)
        if engine is not None:
            engine.shutdown()


def _report(names: list[str], rounds: list[dict[str, dict[str, float]]], args: Any) -> None:
    print(
        f"\n{args.waves} x {args.streams} streams x {args.tokens} tokens per burst, "
        f"{len(rounds)} rounds. Event-loop "
        "thread CPU per message (where the interceptors run) and serving-process CPU per 1k "
        "tokens; cost = median over rounds of (configuration / bare) loop CPU per message - 1"
    )
    print(
        f"{'configuration':<14}{'tok/s':>8}{'loop us/msg':>12}{'ms/1k tok':>11}"
        f"{'cost':>9}{'[min..max]':>18}"
    )
    for name in names:
        tps = statistics.median(r[name]["tokens_per_s"] for r in rounds)
        per_message = statistics.median(r[name]["loop_us_per_message"] for r in rounds)
        per_1k = statistics.median(r[name]["cpu_ms_per_1k"] for r in rounds)
        line = f"{name:<14}{tps:>8.0f}{per_message:>12.1f}{per_1k:>11.1f}"
        if name == "bare":
            print(line)
            continue
        costs = [
            r[name]["loop_us_per_message"] / r["bare"]["loop_us_per_message"] - 1 for r in rounds
        ]
        spread = f"{min(costs):+.1%}..{max(costs):+.1%}"
        print(f"{line}{statistics.median(costs):>+9.1%}{spread:>18}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument(
        "--waves", type=int, default=None, help="bursts of streams per measurement (default 4, 1)"
    )
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--core", type=int, default=1, help="load generator's core (-1: none)")
    parser.add_argument(
        "--micro",
        action="store_true",
        help="a stand-in Generate handler instead of the engine: the interceptors' cost alone",
    )
    args = parser.parse_args()
    if "bare" not in args.configs:
        args.configs.insert(0, "bare")
    if args.waves is None:
        args.waves = 4 if args.micro else 1
    try:
        import uvloop  # the loop the launcher serves on, when installed
    except ImportError:
        asyncio.run(_serve_and_drive(args))
    else:
        uvloop.run(_serve_and_drive(args))


if __name__ == "__main__":
    main()
