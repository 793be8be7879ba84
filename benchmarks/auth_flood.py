"""An authenticated stream's gaps between chunks while clients with no key flood the server.

    .venv/bin/python benchmarks/auth_flood.py [--against-src OTHER_TREE] [--rate 8]

Starts the launcher with an API key (from this tree, and from OTHER_TREE's
`src/` when given), then for each: streams `--tokens` tokens with the key and
records the time between consecutive chunks, first on a quiet server, then
while a second process sends Generate requests without a key, each of
`--payload-mib` MiB (one-byte token ids, the cheapest bytes to send and among
the dearest to parse), from `--flooders` connections at `--rate` calls a second
at most: the same offered load for every server. Every flood call must be
refused UNAUTHENTICATED; what differs is what a refusal costs the server,
shown by the serving process's CPU time per flood call and by the
authenticated stream's gaps. Prints one line per tree and phase.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc

from vllm_servicer.proto import vllm_engine_pb2 as pb
from vllm_servicer.proto import vllm_engine_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent

KEY = "flood-bench-key"
GENERATE = "/vllm.grpc.engine.VllmEngine/Generate"


def start_launcher(src: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """The launcher from `src`, with an API key; returns it and its address."""
    env = {**os.environ, "PYTHONPATH": str(src), "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
    cmd = [sys.executable, "-m", "vllm_servicer", "serve", "--host", "127.0.0.1", "--port", "0"]
    cmd += ["--api-key", KEY, "--drain-grace", "0", "--max-model-len", "4096"]
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


async def stream_gaps(address: str, tokens: int) -> list[float]:
    """Seconds between consecutive chunks of one authenticated streaming Generate."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        request = pb.GenerateRequest(
            request_id=f"flood-bench-{time.monotonic_ns()}",
            tokenized=pb.TokenizedInput(input_ids=[5, 17, 42, 99, 7, 63, 21, 88]),
            sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True),
            stream=True,
        )
        metadata = (("authorization", f"Bearer {KEY}"),)
        gaps, last = [], None
        async for message in stub.Generate(request, metadata=metadata):
            now = time.perf_counter()
            if message.HasField("chunk"):
                if last is not None:
                    gaps.append(now - last)
                last = now
        return gaps


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


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of one process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def row(label: str, gaps: list[float], refused: str) -> str:
    ms = sorted(g * 1000 for g in gaps) or [float("nan")]
    p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))]
    return (
        f"{label:<34} {len(gaps) + 1:>6} {statistics.median(ms):>9.1f} {p99:>9.1f} "
        f"{ms[-1]:>9.1f}  {refused}"
    )


async def flood_process(
    address: str, flooders: int, payload_mib: int, seconds: float, rate: float
) -> None:
    """The flood, run in a process of its own (`--flood`): prints calls made and refused."""
    ids = [1] * (payload_mib * 1024 * 1024 - 64)
    payload = pb.GenerateRequest(
        request_id="flood", tokenized=pb.TokenizedInput(input_ids=ids)
    ).SerializeToString()
    stop, codes = asyncio.Event(), []
    interval = flooders / rate
    tasks = [
        asyncio.ensure_future(flood(address, payload, stop, codes, interval))
        for _ in range(flooders)
    ]
    print("flooding", flush=True)
    await asyncio.sleep(seconds)
    stop.set()
    await asyncio.gather(*tasks)
    refused = sum(c is grpc.StatusCode.UNAUTHENTICATED for c in codes)
    print(f"{refused}/{len(codes)} UNAUTHENTICATED", flush=True)


async def measure(label: str, address: str, pid: int, args: argparse.Namespace) -> list[str]:
    await stream_gaps(address, args.tokens)  # warm-up: the first long stream runs slower
    quiet = await stream_gaps(address, args.tokens)
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
        stdout=asyncio.subprocess.PIPE,
    )
    assert flooder.stdout is not None
    await flooder.stdout.readline()  # "flooding"
    cpu_before = cpu_seconds(pid)
    await asyncio.sleep(2.0)  # the flood is under way
    flooded = await stream_gaps(address, args.tokens)
    refused = (await flooder.stdout.read()).decode().strip()
    cpu = cpu_seconds(pid) - cpu_before
    await flooder.wait()
    calls = int(refused.split("/")[1].split()[0]) or 1
    flood_cost = f"{refused}, server CPU {1000 * cpu / calls:.1f} ms per flood call"
    return [row(f"{label}, quiet", quiet, "-"), row(f"{label}, flooded", flooded, flood_cost)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against-src", type=Path, help="another source tree to measure too")
    parser.add_argument("--flooders", type=int, default=8)
    parser.add_argument("--payload-mib", type=int, default=30, help="below the 32 MiB limit")
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--seconds", type=float, default=15.0, help="how long the flood lasts")
    parser.add_argument("--rate", type=float, default=8.0, help="flood calls per second, at most")
    parser.add_argument("--flood", metavar="ADDRESS", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.flood:
        asyncio.run(
            flood_process(args.flood, args.flooders, args.payload_mib, args.seconds, args.rate)
        )
        return 0

    trees = [("this tree", ROOT / "src")]
    if args.against_src:
        trees.append((f"before ({args.against_src})", args.against_src.resolve() / "src"))
    results = ROOT / "benchmarks" / "results"
    results.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, (label, src) in enumerate(trees):
        proc, address = start_launcher(src, results / f"auth-flood-{i}.log")
        try:
            lines += asyncio.run(measure(label, address, proc.pid, args))
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    print(
        f"{args.flooders} clients without a key, {args.payload_mib} MiB requests, at most "
        f"{args.rate:g} a second; an authenticated stream of {args.tokens} tokens"
    )
    print(f"{'server, phase':<34} {'chunks':>6} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9}  flood")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
