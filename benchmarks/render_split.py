"""Where the launcher's CPU goes per Render call: grpc's floor, each interceptor, the handler.

    .venv/bin/python benchmarks/render_split.py [--rounds 5] [--calls 320]
        [--concurrency 16] [--profile PATH]

One process serves the built-in tiny model's engine, as the launcher starts
it (`serve`'s own engine, server options and interceptor stack, uvloop), on
several grpc.aio servers at once, each one configuration:

- `floor`: a bare grpc.aio server, a stand-in handler (a prebuilt reply), no
  interceptor, no wrapper: what a grpc.aio unary call costs by itself;
  `floor-stream-read`: the same registered as a request stream whose one
  message the handler reads (as `mount()` registers a unary method);
- `mount`: the stand-in mounted by `mount()` with no interceptor (its error
  layer, in-flight count, load reports and unknown-field parser);
- `stack`: the stand-in behind the launcher's default stack (keyless limits,
  metrics, call slots, in-flight limit); `stack-no-X`: that stack without X;
- `handler`: the real `RenderServicer` on a bare server (no wrapper);
- `launcher`, `launcher-again`: the real servicer behind the launcher's
  stack, as `serve` mounts it; the second is the run's A/A noise;
- `direct`: the real handler awaited in this process, no gRPC at all.

A client process pinned to `--cpu` drives bursts of `--calls` RenderChat or
RenderCompletion calls (the requests of `pooling_vs_http.py`, unique per
call), `--concurrency` in flight, against one configuration at a time, the
order rotated every round. The CPU of this process (every thread; the
engine's processes apart) over a burst, per call, is each configuration's
cost: medians over rounds. `--profile PATH` then runs one burst of each
RPC against `launcher` under cProfile (the event loop's thread) and writes
the top functions there.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import loadgen  # noqa: E402
import pooling_vs_http as pvh  # noqa: E402

RPCS = ("chat", "completion")


# ----- the client process -----------------------------------------------------------------


def chat_request(rpb: Any, n: int) -> Any:
    tool = rpb.Tool(**pvh.TOOL, parameters=json.dumps(pvh.TOOL_PARAMETERS))
    chat = [rpb.ChatMessage(**m) for m in pvh.chat_messages(n)]
    return rpb.RenderChatRequest(messages=chat, tools=[tool])


def completion_request(rpb: Any, n: int) -> Any:
    return rpb.RenderCompletionRequest(prompt=[f"{pvh.PROMPT} ({n})"])


def _chat_call(stub: Any, rpb: Any, n: int) -> Any:
    return stub.RenderChat(chat_request(rpb, n))


def _completion_call(stub: Any, rpb: Any, n: int) -> Any:
    return stub.RenderCompletion(completion_request(rpb, n))


async def client_session(concurrency: int) -> None:
    import grpc

    from vllm_servicer.proto import render_pb2 as rpb
    from vllm_servicer.proto import render_pb2_grpc

    stubs: dict[str, Any] = {}
    async for command in loadgen.stdin_commands():
        target = command["target"]
        if target not in stubs:
            stubs[target] = render_pb2_grpc.RenderStub(grpc.aio.insecure_channel(target))
        stub = stubs[target]
        if command["rpc"] == "chat":
            call = functools.partial(_chat_call, stub, rpb)
        else:
            call = functools.partial(_completion_call, stub, rpb)
        result = await pvh.burst(call, command["concurrency"], command["calls"])
        result.pop("latencies_ms")
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()


def client_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="render_split.py client")
    parser.add_argument("--cpu", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args(argv)
    loadgen.pin_to_cpu(args.cpu)
    import uvloop

    uvloop.run(client_session(args.concurrency))
    return 0


# ----- the serving process ----------------------------------------------------------------


def standin_class(base: Any, chat_reply: Any, completion_reply: Any) -> Any:
    class StandIn(base):  # type: ignore[misc, valid-type]
        async def RenderChat(self, request: Any, context: Any) -> Any:
            return chat_reply

        async def RenderCompletion(self, request: Any, context: Any) -> Any:
            return completion_reply

    return StandIn


class Servers:
    """The configurations, each a started grpc.aio server on loopback."""

    def __init__(self, args: Any, engine: Any) -> None:
        self.args = args
        self.engine = engine
        self.targets: dict[str, str] = {}
        self.servers: list[Any] = []

    def stack(self, without: str = "") -> list[Any]:
        """The launcher's default stack (`build_interceptors` with the HTTP API), less one."""
        from prometheus_client import CollectorRegistry

        from vllm_servicer.engine import served_model_name
        from vllm_servicer.interceptors import InflightInterceptor, MetricsInterceptor
        from vllm_servicer.interceptors.call_slots import CallSlotsInterceptor
        from vllm_servicer.interceptors.keyless import KeylessLimitInterceptor

        a = self.args
        layers = {
            "keyless": lambda: KeylessLimitInterceptor(a.keyless),
            "metrics": lambda: MetricsInterceptor(
                CollectorRegistry(), model_name=served_model_name(self.engine)
            ),
            "callslots": lambda: CallSlotsInterceptor(
                a.slots.max_concurrent_rpcs or None, read_timeout=a.slots.request_read_timeout
            ),
            "inflight": lambda: InflightInterceptor(
                a.slots.max_inflight or None, fair_shares=not a.slots.no_fair_shares
            ),
        }
        return [make() for name, make in layers.items() if name != without]

    async def add(self, name: str, interceptors: list[Any] | None, servicer: Any) -> None:
        """`servicer` (a class built from the mount's state) mounted with `interceptors`,
        or registered bare (None)."""
        import grpc

        from vllm_servicer import mounting
        from vllm_servicer.options import server_options
        from vllm_servicer.proto import RENDER_SERVICE, render_pb2_grpc
        from vllm_servicer.servicer.state import MountState

        a = self.args
        server = grpc.aio.server(
            maximum_concurrent_rpcs=a.keyless.grpc_cap(a.slots.max_concurrent_rpcs or None),
            options=server_options(
                a.server.max_message_bytes,
                max_connection_age=a.server.max_connection_age,
                request_compression=a.server.allow_request_compression,
            ),
        )
        if interceptors is None:
            state = MountState.build(self.engine, a.options)
            render_pb2_grpc.add_RenderServicer_to_server(servicer(state), server)
        else:
            original = mounting._PROTOCOLS[RENDER_SERVICE]
            mounting._PROTOCOLS[RENDER_SERVICE] = original._replace(
                build=lambda state, _: servicer(state)
            )
            try:
                mounting.mount(server, self.engine, a.options, interceptors=interceptors)
            finally:
                mounting._PROTOCOLS[RENDER_SERVICE] = original
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self.servers.append(server)
        self.targets[name] = f"127.0.0.1:{port}"


async def floor_server(
    chat_reply: Any, completion_reply: Any, *, stream_read: bool = False, by_context: bool = False
) -> tuple[Any, str]:
    """A bare server answering the prebuilt replies; `stream_read`: registered as
    a request stream whose one message the handler reads, as `mount()`'s
    wrapper registers a unary method."""
    import grpc

    from vllm_servicer.proto import render_pb2 as rpb

    async def chat(request: Any, context: Any) -> Any:
        if stream_read:
            await (context.read() if by_context else anext(request))
        return chat_reply

    async def completion(request: Any, context: Any) -> Any:
        if stream_read:
            await (context.read() if by_context else anext(request))
        return completion_reply

    factory = (
        grpc.stream_unary_rpc_method_handler if stream_read else grpc.unary_unary_rpc_method_handler
    )
    handlers = {
        "RenderChat": factory(
            chat,
            request_deserializer=rpb.RenderChatRequest.FromString,
            response_serializer=rpb.RenderedPrompt.SerializeToString,
        ),
        "RenderCompletion": factory(
            completion,
            request_deserializer=rpb.RenderCompletionRequest.FromString,
            response_serializer=rpb.RenderCompletionResponse.SerializeToString,
        ),
    }
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("vllm_servicer.v1.Render", handlers),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def thread_times() -> dict[int, tuple[str, float]]:
    """Each thread of this process: its name (grouped: digits dropped) and CPU seconds."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[str, float]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")].rstrip("0123456789_-")
        name = "loop" if int(tid) == os.getpid() else f"{name}:{tid}"
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(tid)] = (name or "?", (int(fields[11]) + int(fields[12])) / tick)
    return out


async def direct_burst(servicer: Any, rpc: str, concurrency: int, calls: int) -> None:
    from vllm_servicer.proto import render_pb2 as rpb

    numbers = iter(range(1, calls + 1))
    build = chat_request if rpc == "chat" else completion_request
    method = servicer.RenderChat if rpc == "chat" else servicer.RenderCompletion

    async def worker() -> None:
        for n in numbers:
            await method(build(rpb, n), None)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def serve_and_measure(opts: argparse.Namespace) -> int:
    from vllm_servicer.proto import render_pb2 as rpb
    from vllm_servicer.serve.args import parse_args
    from vllm_servicer.serve.launcher import _start_engine, settle_process_for_serving
    from vllm_servicer.servicer.render import RenderServicer
    from vllm_servicer.servicer.state import MountState

    args = parse_args(["serve", "--host", "127.0.0.1", "--port", "0", "--http-port", "0"])
    engine = _start_engine(args)
    settle_process_for_serving()
    direct = RenderServicer(MountState.build(engine, args.options))
    chat_reply = await direct.RenderChat(chat_request(rpb, 0), None)
    completion_reply = await direct.RenderCompletion(completion_request(rpb, 0), None)
    standin = standin_class(RenderServicer, chat_reply, completion_reply)

    servers = Servers(args, engine)
    floor, servers.targets["floor"] = await floor_server(chat_reply, completion_reply)
    floor_read, servers.targets["floor-stream-read"] = await floor_server(
        chat_reply, completion_reply, stream_read=True
    )
    floor_ctx, servers.targets["floor-context-read"] = await floor_server(
        chat_reply, completion_reply, stream_read=True, by_context=True
    )
    await servers.add("mount", [], standin)
    await servers.add("stack", servers.stack(), standin)
    for name in ("keyless", "metrics", "callslots", "inflight"):
        await servers.add(f"stack-no-{name}", servers.stack(without=name), standin)
    await servers.add("handler", None, RenderServicer)
    from vllm_servicer.interceptors.keyless import KeylessLimitInterceptor
    from vllm_servicer.serve.stack import build_interceptors

    for name in ("launcher", "launcher-again"):
        if name == "launcher":
            interceptors, _ = build_interceptors(args, None, model="")
        else:  # the global registry holds the first one's series
            interceptors = servers.stack()[1:]
        await servers.add(
            name, [KeylessLimitInterceptor(args.keyless), *interceptors], RenderServicer
        )
    configs = [c for c in [*servers.targets, "direct"] if not opts.only or c in opts.only]

    cmd = [sys.executable, __file__, "client", "--cpu", str(opts.cpu)]
    cmd += ["--concurrency", str(opts.concurrency)]
    client = subprocess.Popen(  # noqa: ASYNC220 - once, before anything is measured
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert client.stdin is not None and client.stdout is not None
    loop = asyncio.get_running_loop()

    async def ask(command: dict[str, Any]) -> dict[str, Any]:
        client.stdin.write(json.dumps(command) + "\n")  # type: ignore[union-attr]
        client.stdin.flush()  # type: ignore[union-attr]
        line = await loop.run_in_executor(None, client.stdout.readline)  # type: ignore[union-attr]
        return dict(json.loads(line))

    threads: dict[tuple[str, str], dict[str, float]] = {}

    async def one(config: str, rpc: str, calls: int) -> float:
        """CPU µs per call of this process over one burst."""
        tbefore = thread_times()
        before = time.process_time()
        if config == "direct":
            await direct_burst(direct, rpc, opts.concurrency, calls)
        else:
            command = {"target": servers.targets[config], "rpc": rpc}
            result = await ask({**command, "concurrency": opts.concurrency, "calls": calls})
            if result["errors"]:
                raise RuntimeError(f"{config} {rpc}: {result['error_samples']}")
        spent = (time.process_time() - before) / calls * 1e6
        tafter = thread_times()
        split = threads.setdefault((config, rpc), {})
        for tid, (name, cpu) in tafter.items():
            was = tbefore.get(tid, (name, 0.0))[1]
            split[name] = split.get(name, 0.0) + (cpu - was) / calls * 1e6
        return spent

    for config in configs:  # warm up: connections, first-call paths
        for rpc in RPCS:
            await one(config, rpc, 2 * opts.concurrency)
    threads.clear()
    figures: dict[tuple[str, str], list[float]] = {}
    for rnd in range(opts.rounds):
        shift = rnd % len(configs)
        order = configs[shift:] + configs[:shift]
        if rnd % 2:
            order.reverse()
        for config in order:
            for rpc in RPCS:
                us = await one(config, rpc, opts.calls)
                figures.setdefault((config, rpc), []).append(us)
                await asyncio.sleep(opts.pause)
        print(f"round {rnd} done", file=sys.stderr, flush=True)

    print(
        f"\nCPU of the serving process, µs per call, {opts.concurrency} in flight, "
        f"{opts.calls} calls a burst, median [min-max] over {opts.rounds} rounds"
    )
    print(f"{'config':<20}" + "".join(f"{rpc:>26}" for rpc in RPCS))
    summary: dict[str, Any] = {}
    for config in configs:
        row = f"{config:<20}"
        for rpc in RPCS:
            v = figures[(config, rpc)]
            summary.setdefault(config, {})[rpc] = v
            row += f"{statistics.median(v):>10.0f} [{min(v):.0f}-{max(v):.0f}]".rjust(26)
        print(row)
    print("\nBy thread (µs per call, summed over rounds / rounds), threads above 5 µs:")
    for (config, rpc), split in threads.items():
        parts = ", ".join(
            f"{name} {v / opts.rounds:.0f}"
            for name, v in sorted(split.items(), key=lambda kv: -kv[1])
            if v / opts.rounds > 5
        )
        print(f"{config:<20}{rpc:<11}{parts}")
    if opts.json:
        opts.json.write_text(json.dumps(summary, indent=1) + "\n")

    if opts.profile:
        out = io.StringIO()
        for rpc in RPCS:
            profiler = cProfile.Profile()
            profiler.enable()
            await one(opts.profile_config, rpc, opts.calls)
            profiler.disable()
            profiler.dump_stats(f"{opts.profile}.{rpc}.prof")
            stats = pstats.Stats(profiler, stream=out)
            out.write(f"\n===== {rpc}: cumulative =====\n")
            stats.sort_stats("cumulative").print_stats(60)
            out.write(f"\n===== {rpc}: tottime =====\n")
            stats.sort_stats("tottime").print_stats(45)
        opts.profile.write_text(out.getvalue())
        print(f"profile: {opts.profile}")

    client.stdin.close()
    client.wait(timeout=10)
    for server in [floor, floor_read, floor_ctx, *servers.servers]:
        await server.stop(0)
    engine.shutdown()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["client"]:
        return client_main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=320)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--cpu", type=int, default=1, help="core the client is pinned to (-1: none)")
    p.add_argument("--pause", type=float, default=0.05)
    p.add_argument("--json", type=Path)
    p.add_argument("--profile", type=Path, help="write a cProfile of one configuration here")
    p.add_argument("--profile-config", default="launcher", help="the one profiled")
    p.add_argument("--only", nargs="+", help="measure only these configurations")
    opts = p.parse_args(argv)
    import uvloop

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return uvloop.run(serve_and_measure(opts))


if __name__ == "__main__":
    sys.exit(main())
