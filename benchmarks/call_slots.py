"""What the keyed calls' slots and the read deadline cost a unary call: this tree
against another, side by side in one run.

Two serving processes, one per source tree (`--against-src DIR`: an earlier
checkout, e.g. `git worktree add /tmp/before <commit>`), each a grpc.aio
server on loopback serving a stand-in unary handler (no engine) behind the
launcher's stack as that tree builds it: the keyless caps, authentication
with a key, the keyed calls' slots and their read deadline where the tree
has them, the in-flight limit (and each tenant's fair share of it where the
tree has them), the call counted as an engine call. A client in this process sends unary calls
from `--callers` concurrent callers to one server at a time, rotating the
order each round; the serving process's CPU time (user + system, from
/proc) per call is each side's cost, and their ratio per round the change's.
With `--messages N` each call is a server stream of N answers (a Generate's
tokens), so that what each message costs shows too.

    .venv/bin/python benchmarks/call_slots.py --against-src /tmp/before --rounds 10
    .venv/bin/python benchmarks/call_slots.py --against-src /tmp/before --messages 64
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
from pathlib import Path
from typing import Any

import grpc

KEY = "bench-key-0123456789abcdef"
METHOD = "/bench.Keyed/Echo"  # needs a key, as every method but health's and reflection's
STREAM = "/bench.Keyed/Stream"  # the same, answered with as many messages as the request says
SIDES = ("this", "against")


async def _serve() -> None:
    """One serving process: the stack this tree builds around a stand-in handler."""
    from vllm_servicer._registration import register
    from vllm_servicer.interceptors import (
        AuthInterceptor,
        InflightInterceptor,
        KeylessLimitInterceptor,
    )
    from vllm_servicer.interceptors._pipeline import wrapped_handler
    from vllm_servicer.interceptors.api_keys import ApiKeyVerifier

    stack: list[Any] = [KeylessLimitInterceptor(), AuthInterceptor(ApiKeyVerifier([KEY]))]
    try:
        from vllm_servicer.interceptors.call_slots import CallSlotsInterceptor
    except ImportError:  # a tree from before the keyed calls' slots
        pass
    else:
        stack.append(CallSlotsInterceptor(2048))
    # The stand-in method counted as an engine call, so each call also passes the
    # in-flight limit and, where the tree has them, its caller's fair share.
    stack.append(InflightInterceptor(1024, limited=lambda method: True))

    async def echo(request: bytes, context: Any) -> bytes:
        return request

    async def stream(request: bytes, context: Any) -> Any:
        for _ in range(int(request)):
            yield b"x" * 16

    handler = grpc.unary_unary_rpc_method_handler(echo, bytes, bytes)
    streamed = grpc.unary_stream_rpc_method_handler(stream, bytes, bytes)
    server = grpc.aio.server(maximum_concurrent_rpcs=2048 + 128)
    register(
        server,
        "bench.Keyed",
        {
            "Echo": wrapped_handler(stack, METHOD, handler),
            "Stream": wrapped_handler(stack, STREAM, streamed),
        },
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(json.dumps({"port": port, "stack": [type(i).__name__ for i in stack]}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until closed
    await server.stop(None)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _drive(address: str, callers: int, calls: int, messages: int = 0) -> None:
    metadata = (("authorization", f"Bearer {KEY}"),)
    async with grpc.aio.insecure_channel(address) as channel:
        echo = channel.unary_unary(METHOD)
        stream = channel.unary_stream(STREAM)

        async def caller() -> None:
            for _ in range(calls // callers):
                if messages:
                    async for _answer in stream(b"%d" % messages, metadata=metadata):
                        pass
                else:
                    await echo(b"x" * 16, metadata=metadata)

        await asyncio.gather(*(caller() for _ in range(callers)))


Servers = dict[str, tuple[subprocess.Popen[str], str]]


def _start(against_src: str) -> Servers:
    """Each side's serving process and address."""
    here = Path(__file__).resolve().parent.parent / "src"
    trees = {"this": here, "against": Path(against_src).resolve() / "src"}
    servers: Servers = {}
    for side, src in trees.items():
        env = {**os.environ, "PYTHONPATH": str(src)}
        proc = subprocess.Popen(
            [sys.executable, __file__, "--serve"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        said = json.loads(proc.stdout.readline())
        print(f"{side}: {src} {said['stack']}", file=sys.stderr)
        servers[side] = (proc, f"127.0.0.1:{said['port']}")
    return servers


async def _compare(args: argparse.Namespace, servers: Servers) -> None:
    try:
        for _, address in servers.values():  # warm up
            await _drive(address, args.callers, args.calls // 4, args.messages)
        cost: dict[str, list[float]] = {side: [] for side in SIDES}
        for round_ in range(args.rounds):
            order = SIDES if round_ % 2 == 0 else SIDES[::-1]
            for side in order:
                proc, address = servers[side]
                before = _cpu_seconds(proc.pid)
                started = time.perf_counter()
                await _drive(address, args.callers, args.calls, args.messages)
                wall = time.perf_counter() - started
                cost[side].append((_cpu_seconds(proc.pid) - before) / args.calls * 1e6)
                print(f"round {round_} {side}: {cost[side][-1]:.1f} us CPU/call, "
                      f"{args.calls / wall:.0f} calls/s", file=sys.stderr)  # fmt: skip
        ratios = [a / b for a, b in zip(cost["this"], cost["against"], strict=True)]
        print(
            json.dumps(
                {
                    "this_us_per_call": statistics.median(cost["this"]),
                    "against_us_per_call": statistics.median(cost["against"]),
                    "ratio_median": statistics.median(ratios),
                    "ratios": [round(r, 3) for r in ratios],
                }
            )
        )
    finally:
        for proc, _ in servers.values():
            assert proc.stdin is not None
            proc.stdin.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against-src", help="the other tree (a checkout of this project)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--callers", type=int, default=32)
    parser.add_argument("--calls", type=int, default=8000, help="calls per side per round")
    parser.add_argument(
        "--messages", type=int, default=0, help="answers per call, streamed (0: a unary call)"
    )
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(_serve())
        return
    if not args.against_src:
        parser.error("--against-src is required")
    servers = _start(args.against_src)
    try:
        asyncio.run(_compare(args, servers))
    finally:
        for proc, _ in servers.values():
            proc.wait(30)


if __name__ == "__main__":
    main()
