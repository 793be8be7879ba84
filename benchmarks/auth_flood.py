"""An authenticated stream's gaps between chunks while clients with no key flood the server.

    .venv/bin/python benchmarks/auth_flood.py [--against-src OTHER_TREE] [--rate 8]
        [--gzip] [--method health] [--tracing] [--launcher-flag=--allow-request-compression]
        [--server ADDRESS --server-pid PID]

Starts the launcher with an API key (from this tree, and from OTHER_TREE's
`src/` when given), then for each: streams `--tokens` tokens with the key and
records the time between consecutive chunks, first on a quiet server, then
while a second process sends Generate requests without a key, each of
`--payload-mib` MiB (one-byte token ids, the cheapest bytes to send and among
the dearest to parse), from `--flooders` connections at `--rate` calls a second
at most: the same offered load for every server. Every flood call must be
refused; what differs is what a refusal costs the server, shown by the
serving process's CPU time per flood call and by the authenticated stream's
gaps. Prints one line per tree and phase (`--json`: one object).

`--gzip` sends each flood request gzip-compressed, as a client that wants the
server to inflate it would: compressed once, then sent over raw HTTP/2 (h2)
so that the flood costs its own process next to nothing. `--method health`
floods `grpc.health.v1.Health/Check`, which needs no key. `--tracing` starts
the launcher with `OTEL_EXPORTER_OTLP_ENDPOINT` set (to a closed local port).
`--server` measures a launcher the caller started (with this script's key),
so that several floods can share one start.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import run  # benchmarks/run.py, beside this script

from vllm_servicer.proto import vllm_engine_pb2 as pb
from vllm_servicer.proto import vllm_engine_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent

KEY = "flood-bench-key"
GENERATE = "/vllm.grpc.engine.VllmEngine/Generate"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"


def start_launcher(
    src: Path, log: Path, *, tracing: bool = False, flags: tuple[str, ...] = ()
) -> tuple[subprocess.Popen[bytes], str]:
    """The launcher from `src`, with an API key; returns it and its address."""
    env = {**os.environ, "PYTHONPATH": str(src), "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
    if tracing:
        # Spans are made and batched as in production; their export fails.
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = "http://127.0.0.1:9"
    cmd = [sys.executable, "-m", "vllm_servicer", "serve", "--host", "127.0.0.1", "--port", "0"]
    cmd += ["--api-key", KEY, "--drain-grace", "0", "--max-model-len", "4096", *flags]
    out = log.open("wb")
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"launcher from {src} ended early; see {log}")
        if m := re.search(r"listening on (\S+:\d+)", log.read_text(errors="replace")):
            return proc, m.group(1)
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"launcher from {src} did not start; see {log}")


async def stream_gaps(address: str, tokens: int) -> tuple[list[float], int]:
    """Seconds between consecutive chunks of one authenticated streaming Generate,
    and the tokens it brought."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        request = pb.GenerateRequest(
            request_id=f"flood-bench-{time.monotonic_ns()}",
            tokenized=pb.TokenizedInput(input_ids=[5, 17, 42, 99, 7, 63, 21, 88]),
            sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True),
            stream=True,
        )
        metadata = (("authorization", f"Bearer {KEY}"),)
        gaps, last, received = [], None, 0
        async for message in stub.Generate(request, metadata=metadata):
            now = time.perf_counter()
            if message.HasField("chunk"):
                received += len(message.chunk.token_ids)
                if last is not None:
                    gaps.append(now - last)
                last = now
        return gaps, received


async def flood(
    address: str, payload: bytes, stop: asyncio.Event, codes: list[Any], interval: float
) -> None:
    """Send `payload` as a Generate request without a key, one every `interval` s at most."""
    options = [("grpc.max_send_message_length", len(payload) + 1024)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        call = channel.unary_stream(GENERATE)  # raw bytes: no client-side serializing
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            started = loop.time()
            try:
                async for _ in call(payload, timeout=30):
                    pass
                codes.append(grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as err:
                codes.append(err.code())
            # A fixed offered load, the same for every server measured.
            await asyncio.sleep(max(0.0, interval - (loop.time() - started)))


def grpc_frame(message: bytes, compressed: bool) -> bytes:
    """`message` as one length-prefixed gRPC message."""
    return bytes([int(compressed)]) + len(message).to_bytes(4, "big") + message


def h2_call(sock: socket.socket, conn: Any, path: str, body: bytes, authority: str) -> str:
    """One gRPC call over raw HTTP/2 with a gzip-compressed body; its grpc-status."""
    import h2.events

    stream = conn.get_next_available_stream_id()
    headers = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", authority),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        ("grpc-encoding", "gzip"),
        ("grpc-accept-encoding", "identity,gzip"),
    ]
    conn.send_headers(stream, headers)
    sent, status = 0, ""
    while True:
        while sent < len(body) and status == "":
            room = min(conn.local_flow_control_window(stream), conn.max_outbound_frame_size)
            if room <= 0:
                break
            chunk = body[sent : sent + room]
            sent += len(chunk)
            conn.send_data(stream, chunk, end_stream=sent == len(body))
        sock.sendall(conn.data_to_send())
        data = sock.recv(65536)
        if not data:
            return status or "closed"
        for event in conn.receive_data(data):
            if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                if event.stream_id == stream:
                    found = dict((k.decode(), v.decode()) for k, v in event.headers)
                    status = found.get("grpc-status", status)
            elif isinstance(event, h2.events.DataReceived):
                conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            if isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset)):
                if event.stream_id == stream:
                    sock.sendall(conn.data_to_send())
                    return status or "reset"


def gzip_flood(address: str, path: str, body: bytes, seconds: float, interval: float) -> list[str]:
    """gzip calls on one raw HTTP/2 connection, one every `interval` s at most (a thread)."""
    import h2.config
    import h2.connection

    host, port = address.rsplit(":", 1)
    codes: list[str] = []
    with socket.create_connection((host, int(port))) as sock:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        sock.sendall(conn.data_to_send())
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            started = time.monotonic()
            codes.append(h2_call(sock, conn, path, body, address))
            time.sleep(max(0.0, interval - (time.monotonic() - started)))
    return codes


def row(label: str, gaps: list[float], refused: str) -> str:
    ms = sorted(g * 1000 for g in gaps) or [float("nan")]
    p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))]
    return (
        f"{label:<34} {len(gaps) + 1:>6} {statistics.median(ms):>9.1f} {p99:>9.1f} "
        f"{ms[-1]:>9.1f}  {refused}"
    )


# gRPC status codes by number, as HTTP/2 trailers carry them.
_CODES = {str(code.value[0]): code.name for code in grpc.StatusCode}


async def flood_process(
    address: str, flooders: int, payload_mib: int, seconds: float, rate: float, args: Any
) -> None:
    """The flood, run in a process of its own (`--flood`): prints calls made and refused."""
    interval = flooders / rate
    path = HEALTH_CHECK if args.method == "health" else GENERATE
    if args.method == "health":
        # Zeros: an unknown field 0 is no valid message, but the bytes inflate first.
        payload = bytes(payload_mib * 1024 * 1024 - 64)
    else:
        ids = [1] * (payload_mib * 1024 * 1024 - 64)
        payload = pb.GenerateRequest(
            request_id="flood", tokenized=pb.TokenizedInput(input_ids=ids)
        ).SerializeToString()
    if args.gzip:
        body = grpc_frame(gzip.compress(payload, 6), compressed=True)
        print("flooding", flush=True)
        results = await asyncio.gather(
            *(
                asyncio.to_thread(gzip_flood, address, path, body, seconds, interval)
                for _ in range(flooders)
            )
        )
        names = [_CODES.get(code, code) for codes in results for code in codes]
        counts = {name: names.count(name) for name in sorted(set(names))}
        refused = len(names) - counts.get("OK", 0)
        print(f"{refused}/{len(names)} refused {json.dumps(counts)}", flush=True)
        return
    stop, codes = asyncio.Event(), []
    tasks = [
        asyncio.ensure_future(flood(address, payload, stop, codes, interval))
        for _ in range(flooders)
    ]
    print("flooding", flush=True)
    await asyncio.sleep(seconds)
    stop.set()
    await asyncio.gather(*tasks)
    counts = {c.name: codes.count(c) for c in set(codes)}
    refused = len(codes) - counts.get("OK", 0)
    print(f"{refused}/{len(codes)} refused {json.dumps(counts)}", flush=True)


async def measure(
    label: str, address: str, pid: int, args: argparse.Namespace
) -> tuple[list[str], dict[str, Any]]:
    await stream_gaps(address, args.tokens)  # warm-up: the first long stream runs slower
    quiet, _ = await stream_gaps(address, args.tokens)
    # The flood comes from another process: in this one it would starve the
    # measuring client's own reads, not the server.
    flooder = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        "--flood",
        address,
        "--flooders",
        str(args.flooders),
        "--payload-mib",
        str(args.payload_mib),
        "--seconds",
        str(args.seconds),
        "--rate",
        str(args.rate),
        "--method",
        args.method,
        *(["--gzip"] if args.gzip else []),
        stdout=asyncio.subprocess.PIPE,
    )
    assert flooder.stdout is not None
    await flooder.stdout.readline()  # "flooding"
    cpu_before = run.cpu_seconds(pid)
    await asyncio.sleep(2.0)  # the flood is under way
    flooded, flooded_tokens = await stream_gaps(address, args.tokens)
    refused = (await flooder.stdout.read()).decode().strip()
    cpu = run.cpu_seconds(pid) - cpu_before
    await flooder.wait()
    calls = int(refused.split("/")[1].split()[0]) or 1
    flood_cost = f"{refused}, server CPU {1000 * cpu / calls:.1f} ms per flood call"
    figures = {
        "label": label,
        "quiet_max_gap_ms": 1000 * max(quiet),
        "flooded_max_gap_ms": 1000 * max(flooded),
        "flooded_chunks": len(flooded) + 1,
        "flooded_tokens": flooded_tokens,
        "flood_calls": calls,
        "flood_codes": json.loads(refused.split(" ", 2)[2]),
        "cpu_ms_per_flood_call": 1000 * cpu / calls,
    }
    lines = [row(f"{label}, quiet", quiet, "-"), row(f"{label}, flooded", flooded, flood_cost)]
    return lines, figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against-src", type=Path, help="another source tree to measure too")
    parser.add_argument("--flooders", type=int, default=8)
    parser.add_argument("--payload-mib", type=int, default=30, help="below the 32 MiB limit")
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--seconds", type=float, default=15.0, help="how long the flood lasts")
    parser.add_argument("--rate", type=float, default=8.0, help="flood calls per second, at most")
    parser.add_argument("--gzip", action="store_true", help="gzip-compressed flood requests")
    parser.add_argument("--method", choices=["generate", "health"], default="generate")
    parser.add_argument("--tracing", action="store_true", help="the launcher with OTEL_* set")
    parser.add_argument(
        "--launcher-flag", action="append", default=[], help="a flag for the launcher (repeat)"
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument(
        "--server",
        metavar="ADDRESS",
        help=f"measure a launcher already serving at ADDRESS, started with --api-key {KEY} "
        "(its flags and environment are then the caller's), instead of starting one",
    )
    parser.add_argument("--server-pid", type=int, help="that launcher's pid (its CPU time)")
    parser.add_argument("--flood", metavar="ADDRESS", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.flood:
        asyncio.run(
            flood_process(
                args.flood, args.flooders, args.payload_mib, args.seconds, args.rate, args
            )
        )
        return 0
    if args.server:
        if args.server_pid is None:
            parser.error("--server needs --server-pid")
        _, figure = asyncio.run(measure("given server", args.server, args.server_pid, args))
        print(json.dumps([figure]) if args.json else json.dumps(figure, indent=1))
        return 0

    trees = [("this tree", ROOT / "src")]
    if args.against_src:
        trees.append((f"before ({args.against_src})", args.against_src.resolve() / "src"))
    results = ROOT / "benchmarks" / "results"
    results.mkdir(parents=True, exist_ok=True)
    lines, figures = [], []
    for i, (label, src) in enumerate(trees):
        log = results / f"auth-flood-{i}.log"
        proc, address = start_launcher(
            src, log, tracing=args.tracing, flags=tuple(args.launcher_flag)
        )
        try:
            measured, figure = asyncio.run(measure(label, address, proc.pid, args))
            lines += measured
            figures.append(figure)
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    if args.json:
        print(json.dumps(figures))
        return 0
    compressed = "gzip-compressed " if args.gzip else ""
    print(
        f"{args.flooders} clients without a key, {compressed}{args.payload_mib} MiB "
        f"{args.method} requests, at most {args.rate:g} a second; an authenticated stream of "
        f"{args.tokens} tokens; tracing {'on' if args.tracing else 'off'}"
    )
    print(f"{'server, phase':<34} {'chunks':>6} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9}  flood")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
