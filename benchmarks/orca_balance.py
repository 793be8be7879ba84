"""What the ORCA load reports buy and cost: gRPC's balancer split between a busy and an
idle launcher, and the serving process's cost per call of the trailer.

The split: two launchers as users run them (the tiny model, `--max-num-seqs 16`,
metrics on), one kept busy by long streams (vllm.Inference GenerateStream, 480
tokens each, restarted as they end). For each policy a grpcio channel over
both addresses sends short Generates (2 tokens) for a warm-up, then a counted
burst; which launcher served each call is read from the launchers' own
`grpc_server_handled_total`. Policies: `round_robin`, `weighted_round_robin`
weighing by the per-call trailers, and by out-of-band reports
(`enableOobLoadReport`).

The cost: one tiny engine in this process, mounted twice, with load reports
and without (`MountOptions.of(load_reports=...)`); the benchmarks' load generator
(`loadgen.py`, in a subprocess pinned to one core) sends bursts of unary
1-token Generates to each in turn, the order swapped every round. Reported
per configuration: calls per second and the CPU time of this process's event
loop thread (where the interceptors run) per call, medians over rounds.
`--micro` serves a stand-in Generate (one prebuilt answer, no engine) instead,
which leaves grpc's own cost per call and the trailer's.

    .venv/bin/python benchmarks/orca_balance.py
    .venv/bin/python benchmarks/orca_balance.py --quick --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc

POLICIES = (
    ("round_robin", False),
    ("weighted_round_robin", False),
    ("weighted_round_robin", True),
)
WRR = {"blackoutPeriod": "0s", "weightUpdatePeriod": "0.1s", "weightExpirationPeriod": "3s"}


# ----- the split -------------------------------------------------------------------


def start_launcher(log: Path) -> tuple[subprocess.Popen[bytes], str, str]:
    """A launcher on loopback with metrics; it, its address and its metrics URL."""
    cmd = [sys.executable, "-m", "vllm_servicer", "serve", "--port", "0", "--metrics-port", "0"]
    cmd += ["--max-num-seqs", "16"]
    # Keys or tracing from this shell would change what the launchers serve.
    drop = ("OTEL_", "VLLM_API_KEY", "VLLM_SERVICER_ADMIN_API_KEY")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    out = log.open("wb")
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    return proc, *_announced(proc, log)


def _announced(proc: subprocess.Popen[bytes], log: Path) -> tuple[str, str]:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        address = re.search(r"listening on (\S+:\d+)", text)
        metrics = re.search(r"metrics on (http://\S+/metrics)", text)
        if address and metrics:
            return address.group(1), metrics.group(1)
        if proc.poll() is not None:
            raise SystemExit(f"a launcher ended early; see {log}")
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"a launcher did not start; see {log}")


def generates_handled(metrics_url: str) -> float:
    """VllmEngine Generate calls a launcher answered, from its metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(metrics_url, timeout=30).read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "grpc_server_handled_total"
        and sample.labels.get("grpc_service") == "vllm.grpc.engine.VllmEngine"
        and sample.labels.get("grpc_method") == "Generate"
    )


async def keep_busy(address: str, streams: int, stop: asyncio.Event) -> None:
    """`streams` long streams on `address`, each restarted as it ends, until `stop`."""
    from vllm_servicer.proto import inference_pb2, inference_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)

        async def stream(i: int) -> None:
            message = inference_pb2.GenerateRequest(
                token_ids=inference_pb2.TokenIds(ids=[3 + i] * 8),
                stopping=inference_pb2.StoppingCriteria(max_new_tokens=480, ignore_eos=True),
            )
            while not stop.is_set():
                async for _ in stub.GenerateStream(message):
                    if stop.is_set():
                        break

        await asyncio.gather(*(stream(i) for i in range(streams)))


def service_config(policy: str, oob: bool) -> str:
    config: dict[str, Any] = {}
    if policy == "weighted_round_robin":
        config = dict(WRR)
        if oob:
            config |= {"enableOobLoadReport": True, "oobReportingPeriod": "1s"}
    return json.dumps({"loadBalancingConfig": [{policy: config}]})


async def split(
    launchers: list[tuple[str, str]], policy: str, oob: bool, args: argparse.Namespace
) -> dict[str, Any]:
    """How many of `args.calls` short Generates each launcher served under `policy`."""
    from vllm_servicer.proto import vllm_engine_pb2 as pb
    from vllm_servicer.proto import vllm_engine_pb2_grpc

    target = "ipv4:" + ",".join(address for address, _ in launchers)
    options = [
        ("grpc.service_config", service_config(policy, oob)),
        ("grpc.use_local_subchannel_pool", 1),
    ]
    message = pb.GenerateRequest(
        tokenized=pb.TokenizedInput(input_ids=[5, 17, 42, 99]),
        sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=2),
    )
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)

        async def calls(n: int) -> None:
            for _ in range(n):
                async for _ in stub.Generate(message):
                    pass

        started = time.monotonic()
        while time.monotonic() - started < args.warm_up:
            await asyncio.gather(*(calls(4) for _ in range(args.concurrency)))
        urls = [url for _, url in launchers]
        before = [await asyncio.to_thread(generates_handled, url) for url in urls]
        started = time.monotonic()
        per_worker = args.calls // args.concurrency
        await asyncio.gather(*(calls(per_worker) for _ in range(args.concurrency)))
        seconds = time.monotonic() - started
        after = [await asyncio.to_thread(generates_handled, url) for url in urls]
    busy, idle = (round(a - b) for a, b in zip(after, before, strict=True))
    name = policy + (" (out of band)" if oob else " (per call)" if "weighted" in policy else "")
    return {"policy": name, "busy": busy, "idle": idle, "seconds": round(seconds, 2)}


async def measure_split(args: argparse.Namespace) -> list[dict[str, Any]]:
    logs = Path(tempfile.mkdtemp(prefix="orca-balance-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        started = [
            await asyncio.to_thread(start_launcher, logs / f"launcher-{i}.log") for i in (0, 1)
        ]
        procs = [proc for proc, _, _ in started]
        launchers = [(address, url) for _, address, url in started]
        stop = asyncio.Event()
        load = asyncio.ensure_future(keep_busy(launchers[0][0], args.busy_streams, stop))
        await asyncio.sleep(2)
        rows = []
        try:
            for policy, oob in POLICIES:
                rows.append(await split(launchers, policy, oob, args))
                row = rows[-1]
                share = row["idle"] / max(1, row["busy"] + row["idle"])
                print(
                    f"{row['policy']:<36} busy {row['busy']:>4}  idle {row['idle']:>4}"
                    f"  ({share:.0%} to the idle one, {row['seconds']:.1f} s)",
                    flush=True,
                )
        finally:
            stop.set()
            load.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await load
        return rows
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


# ----- the cost --------------------------------------------------------------------


def _stand_in_generate() -> Any:
    """A Generate answering one prebuilt complete message, no engine."""
    from vllm_servicer.proto import vllm_engine_pb2 as pb

    complete = pb.GenerateResponse(
        complete=pb.GenerateComplete(output_ids=[3], finish_reason="length", prompt_tokens=8)
    )

    async def generate(request: Any, context: Any) -> Any:
        yield complete

    return grpc.unary_stream_rpc_method_handler(
        generate, pb.GenerateRequest.FromString, pb.GenerateResponse.SerializeToString
    )


def _cost_server(engine: Any, reports: bool) -> grpc.aio.Server:
    """A server for the cost bursts: the engine mounted, or the stand-in Generate
    behind the pipeline `mount()` builds; load reports on or off."""
    from vllm_servicer import MountOptions, mount
    from vllm_servicer.interceptors import LoadReportInterceptor
    from vllm_servicer.load_reports.report import CallRates, EngineLoad, LoadReporter
    from vllm_servicer.mounting import engine_pipeline
    from vllm_servicer.proto import SERVICE_NAME
    from vllm_servicer.status import error_layer

    server = grpc.aio.server()
    if engine is not None:
        mount(server, engine, MountOptions.of(load_reports=reports))
        return server
    reporter = LoadReporter(lambda: EngineLoad(1, 0, 16, 0.01), CallRates())
    pipeline, _ = engine_pipeline(
        [], load_reports=LoadReportInterceptor(reporter) if reports else None
    )
    method = f"/{SERVICE_NAME}/Generate"
    handler = pipeline.wrap(method, _stand_in_generate(), errors=error_layer)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, {"Generate": handler}),)
    )
    return server


def _cost_rows(rounds: list[dict[str, dict[str, float]]]) -> list[dict[str, Any]]:
    """The rounds' medians, per setting, and what load reports add per call."""
    rows = []
    for name in ("off", "on"):
        rows.append(
            {
                "load_reports": name,
                "calls_per_s": statistics.median(r[name]["calls_per_s"] for r in rounds),
                "loop_us_per_call": statistics.median(r[name]["loop_us"] for r in rounds),
            }
        )
    extra = [r["on"]["loop_us"] - r["off"]["loop_us"] for r in rounds]
    rows[1]["extra_loop_us_per_call"] = statistics.median(extra)
    return rows


def _print_cost(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    kind = "a stand-in Generate (no engine)" if args.micro else "the tiny engine"
    print(
        f"\ncost: unary 1-token Generates on {kind}, {args.cost_requests} per burst, "
        f"{args.cost_concurrency} in flight, {args.rounds} rounds (medians)"
    )
    print(f"{'load reports':<14}{'calls/s':>10}{'loop us/call':>14}{'extra':>10}")
    for row in rows:
        extra_us = row.get("extra_loop_us_per_call")
        print(
            f"{row['load_reports']:<14}{row['calls_per_s']:>10.0f}"
            f"{row['loop_us_per_call']:>14.1f}"
            + (f"{extra_us:>+10.1f}" if extra_us is not None else "")
        )


async def measure_cost(args: argparse.Namespace) -> list[dict[str, Any]]:
    engine = None
    if not args.micro:
        from vllm_servicer.testing.tiny_model import build_tiny_engine

        engine = build_tiny_engine()
        if args.core >= 0:
            from run import keep_engine_off  # benchmarks/run.py, beside this script

            keep_engine_off(os.getpid(), args.core)
    elif args.core >= 0 and len(os.sched_getaffinity(0)) > 1:
        os.sched_setaffinity(0, os.sched_getaffinity(0) - {args.core})
    servers, targets = [], {}
    process = None
    try:
        for name, reports in (("off", False), ("on", True)):
            server = _cost_server(engine, reports)
            targets[name] = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
            await server.start()
            servers.append(server)
        command = [sys.executable, str(Path(__file__).with_name("loadgen.py")), "--serve-stdin"]
        process = await asyncio.create_subprocess_exec(
            *command, "--cpu", str(args.core), stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        spec = {
            "concurrency": args.cost_concurrency,
            "requests": args.cost_requests,
            "stream": False,
            "max_tokens": 1,
        }

        async def burst(name: str) -> dict[str, float]:
            assert process is not None and process.stdin and process.stdout
            started_loop = time.thread_time()
            process.stdin.write((json.dumps({**spec, "target": targets[name]}) + "\n").encode())
            line = await process.stdout.readline()
            if not line:
                raise SystemExit("load generator failed")
            result = json.loads(line)
            if result["errors"]:
                raise SystemExit(f"{name}: {result['errors']} bad calls: {result['error_samples']}")
            loop_us = (time.thread_time() - started_loop) / args.cost_requests * 1e6
            return {"calls_per_s": args.cost_requests / result["wall_s"], "loop_us": loop_us}

        for name in targets:  # warm-up: connections, first-call paths
            await burst(name)
        rounds: list[dict[str, dict[str, float]]] = []
        for r in range(args.rounds):
            order = ["off", "on"] if r % 2 == 0 else ["on", "off"]
            rounds.append({name: await burst(name) for name in order})
        rows = _cost_rows(rounds)
        _print_cost(args, rows)
        return rows
    finally:
        if process is not None and process.returncode is None:
            assert process.stdin is not None
            process.stdin.close()
            await process.wait()
        for server in servers:
            await server.stop(None)
        if engine is not None:
            engine.shutdown()


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {}
    if not args.skip_split:
        print(
            f"split of {args.calls} short Generates ({args.concurrency} in flight) between a "
            f"launcher busy with {args.busy_streams} long streams and an idle one:",
            flush=True,
        )
        result["split"] = await measure_split(args)
    if not args.skip_cost:
        result["cost"] = await measure_cost(args)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=400, help="short calls counted per policy")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--busy-streams", type=int, default=8)
    parser.add_argument("--warm-up", type=float, default=3.0, help="seconds before counting")
    parser.add_argument("--rounds", type=int, default=8, help="cost: rounds of on and off")
    parser.add_argument("--cost-requests", type=int, default=400, help="cost: calls per burst")
    parser.add_argument("--cost-concurrency", type=int, default=8)
    parser.add_argument("--core", type=int, default=1, help="load generator's core (-1: none)")
    parser.add_argument("--micro", action="store_true", help="cost: a stand-in Generate")
    parser.add_argument("--skip-split", action="store_true")
    parser.add_argument("--skip-cost", action="store_true")
    parser.add_argument("--quick", action="store_true", help="a brief run: fewer calls, rounds")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args()
    if args.quick:
        args.calls, args.rounds, args.cost_requests, args.warm_up = 100, 2, 100, 2.0
    result = asyncio.run(main_async(args))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
