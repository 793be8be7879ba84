"""What vllm_servicer.v1's Pooling and Render RPCs cost against vLLM's own HTTP endpoints.

    .venv/bin/python benchmarks/pooling_vs_http.py [--rounds 6] [--concurrency 1 16]
        [--calls 100 320] [--quick] [--pairs NAME ...] [--json PATH]

Two launchers as users run them, each serving gRPC and vLLM's HTTP API
(`--http-port`) from one engine:

- pooling: the tiny cross-encoder (`write_tiny_classifier_model`, one label)
  with the tiny engine flags and `--runner pooling`;
- render: the built-in tiny model.

Pairs, each gRPC RPC against the HTTP route that does the same work on the
same launcher:

- Classify (1 text; 8 texts) against POST /classify;
- Score (1 query x 8 texts) against POST /score;
- Rerank (8 documents, top_n 3) against POST /rerank;
- RenderChat (system + user message, one tool) against POST /tokenize with
  the same messages and tools (vLLM's /v1/chat/completions/render needs
  `--enable-scale-out`, which the launcher's HTTP API does not pass);
- RenderCompletion (one prompt) against POST /tokenize of the prompt.

Texts are unique per call (a call number in each), the same numbers on both
sides. Before timing, each pair is asked once over both and the answers
compared: the same probabilities, scores and order (as float32, what the
proto carries), the same token ids.

One client process (asyncio: aiohttp, or httpx with `--http-client httpx`,
HTTP/1.1 keep-alive with one connection per call in flight; grpc.aio, one
channel), pinned to `--cpu`, every engine thread kept off that core, drives
bursts of `--calls` calls at each concurrency, A B B A in one round and B A A B
in the next. Per burst, the CPU time of the launcher's own process (all its
threads: the asyncio loop, grpc's, uvicorn's; not its EngineCore children,
counted apart) before and after; the HTTP API runs in that same process.
Printed per pair and concurrency: calls/s, latency p50/p99 (over every timed
call), the launcher's CPU per call (medians over rounds), and the per-round
ratios gRPC / HTTP with their range; the A/A noise floor (a side's two bursts
in one round). Exits non-zero when an answer disagreed or a call failed.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import functools
import json
import os
import re
import signal
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# Process, CPU and placement helpers are run.py's, percentiles and pinning
# loadgen.py's, so the figures are taken as the other benchmarks take theirs.
import loadgen  # noqa: E402
import run  # noqa: E402

GRPC, HTTP = "grpc", "http"
# aiohttp's client costs a fifth of httpx's CPU per call: with httpx the client, on its
# one core, set the pace of HTTP bursts at concurrency 16 (about 550 calls/s at most).
HTTP_CLIENTS = ("aiohttp", "httpx")
POOLING, RENDER = "pooling", "render"


@dataclass(frozen=True)
class Pair:
    """One gRPC RPC and the HTTP route it is measured against, on one launcher."""

    name: str
    launcher: str
    grpc_label: str
    http_label: str


PAIRS = (
    Pair("classify-1", POOLING, "Classify (1 text)", "POST /classify"),
    Pair("classify-8", POOLING, "Classify (8 texts)", "POST /classify"),
    Pair("score-8", POOLING, "Score (1 x 8)", "POST /score"),
    Pair("rerank-8", POOLING, "Rerank (8, top 3)", "POST /rerank"),
    Pair("render-chat", RENDER, "RenderChat (1 tool)", "POST /tokenize (chat)"),
    Pair("render-completion", RENDER, "RenderCompletion", "POST /tokenize"),
)
BY_NAME = {pair.name: pair for pair in PAIRS}
LOG_DIR = run.RESULTS / "logs"

# ----- the calls (the client process) ---------------------------------------------------

DOCUMENTS = (
    "The Eiffel Tower is a wrought-iron lattice tower in Paris.",
    "Bananas are rich in potassium and easy to carry.",
    "Paris is the capital and largest city of France.",
    "A compiler turns source code into machine code.",
    "The Seine flows through the centre of Paris.",
    "Photosynthesis turns light into chemical energy.",
    "Lyon is known for its cuisine and silk history.",
    "The Louvre is the most visited museum in the world.",
)
QUERY = "What is there to see in Paris?"
SYSTEM = "You are a helpful assistant. Answer briefly and call a tool when it helps."
TOOL_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "The city, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city"],
}
TOOL = {"name": "get_weather", "description": "The current weather in a city."}
PROMPT = "The quick brown fox jumps over the lazy dog; the dog sleeps on in the afternoon sun."


def texts(n: int, count: int) -> list[str]:
    """`count` documents, each marked with call number `n` (unique per call)."""
    return [f"{DOCUMENTS[i % len(DOCUMENTS)]} ({n}.{i})" for i in range(count)]


def chat_messages(n: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"What is the weather in Paris today? (call {n})"},
    ]


def http_tool(parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {**TOOL, "parameters": parameters}}


class HttpPoster:
    """JSON POSTs over HTTP/1.1 keep-alive, one connection per call in flight."""

    def __init__(self, kind: str, url: str, concurrency: int) -> None:
        self.kind = kind
        if kind == "aiohttp":
            import aiohttp

            self.session = aiohttp.ClientSession(
                base_url=url,
                connector=aiohttp.TCPConnector(limit=concurrency),
                timeout=aiohttp.ClientTimeout(total=120),
            )
        else:
            import httpx

            limits = httpx.Limits(
                max_connections=concurrency, max_keepalive_connections=concurrency
            )
            self.client = httpx.AsyncClient(base_url=url, timeout=120, limits=limits)

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if self.kind == "aiohttp":
            async with self.session.post(path, json=body) as reply:
                if reply.status != 200:
                    raise RuntimeError(f"{path}: HTTP {reply.status}: {(await reply.text())[:300]}")
                return dict(await reply.json())
        answer = await self.client.post(path, json=body)
        if answer.status_code != 200:
            raise RuntimeError(f"{path}: HTTP {answer.status_code}: {answer.text[:300]}")
        return dict(answer.json())

    async def close(self) -> None:
        if self.kind == "aiohttp":
            await self.session.close()
        else:
            await self.client.aclose()


class Calls:
    """Both sides' call for each pair, by call number; and their answers, normalized."""

    def __init__(self, grpc_target: str, http_url: str, concurrency: int, http_client: str) -> None:
        import grpc

        from vllm_servicer.proto import pooling_pb2, pooling_pb2_grpc, render_pb2, render_pb2_grpc

        self.pool_pb, self.render_pb = pooling_pb2, render_pb2
        self.channel = grpc.aio.insecure_channel(grpc_target)
        self.pooling = pooling_pb2_grpc.PoolingStub(self.channel)
        self.render = render_pb2_grpc.RenderStub(self.channel)
        self.http = HttpPoster(http_client, http_url, concurrency)
        self.parameters = json.dumps(TOOL_PARAMETERS)
        self.http_tools = [http_tool(TOOL_PARAMETERS)]

    async def close(self) -> None:
        await self.http.close()
        await self.channel.close()

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self.http.post(path, body)

    def call(self, pair: str, side: str, n: int) -> Awaitable[Any]:
        """Call `n` of `pair` over `side`; awaits the parsed answer."""
        pb, rpb = self.pool_pb, self.render_pb
        if pair in ("classify-1", "classify-8"):
            inputs = texts(n, 1 if pair == "classify-1" else 8)
            if side == GRPC:
                return self.pooling.Classify(pb.ClassifyRequest(input=inputs))
            return self.post("/classify", {"input": inputs})
        if pair == "score-8":
            query = f"{QUERY} ({n})"
            if side == GRPC:
                return self.pooling.Score(pb.ScoreRequest(text_1=query, text_2=texts(n, 8)))
            return self.post("/score", {"text_1": query, "text_2": texts(n, 8)})
        if pair == "rerank-8":
            query = f"{QUERY} ({n})"
            if side == GRPC:
                message = pb.RerankRequest(query=query, documents=texts(n, 8), top_n=3)
                return self.pooling.Rerank(message)
            return self.post("/rerank", {"query": query, "documents": texts(n, 8), "top_n": 3})
        if pair == "render-chat":
            messages = chat_messages(n)
            if side == GRPC:
                tool = rpb.Tool(**TOOL, parameters=self.parameters)
                chat = [rpb.ChatMessage(**m) for m in messages]
                return self.render.RenderChat(rpb.RenderChatRequest(messages=chat, tools=[tool]))
            body = {"messages": messages, "tools": self.http_tools, "add_generation_prompt": True}
            return self.post("/tokenize", body)
        if pair == "render-completion":
            prompt = f"{PROMPT} ({n})"
            if side == GRPC:
                return self.render.RenderCompletion(rpb.RenderCompletionRequest(prompt=[prompt]))
            return self.post("/tokenize", {"prompt": prompt, "add_special_tokens": True})
        raise ValueError(f"no pair {pair!r}")

    async def check(self, pair: str) -> dict[str, Any]:
        """Call 0 of `pair` over both sides; whether the answers agree, and what they were."""
        got_grpc = normalized(pair, await self.call(pair, GRPC, 0))
        got_http = normalized(pair, await self.call(pair, HTTP, 0))
        return {"agree": got_grpc == got_http, GRPC: got_grpc, HTTP: got_http}


def _f32(value: float) -> float:
    """`value` as the float32 the proto carries (vLLM's JSON has the same number as a double)."""
    return float(struct.unpack("f", struct.pack("f", value))[0])


def normalized(pair: str, answer: Any) -> Any:
    """An answer of either side as comparable data: float32 numbers, indices, token ids."""
    if isinstance(answer, dict):  # HTTP
        if pair.startswith("classify"):
            return [(d["index"], d["label"], [_f32(p) for p in d["probs"]]) for d in answer["data"]]
        if pair == "score-8":
            return [(d["index"], _f32(d["score"])) for d in answer["data"]]
        if pair == "rerank-8":
            return [(d["index"], _f32(d["relevance_score"])) for d in answer["results"]]
        return list(answer["tokens"])
    if pair.startswith("classify"):
        return [(r.index, r.label, list(r.probs)) for r in answer.results]
    if pair == "score-8":
        return [(r.index, r.score) for r in answer.results]
    if pair == "rerank-8":
        return [(r.index, r.relevance_score) for r in answer.results]
    if pair == "render-chat":
        return list(answer.token_ids)
    return list(answer.prompts[0].token_ids)


async def burst(
    call: Callable[[int], Awaitable[Any]], concurrency: int, calls: int
) -> dict[str, Any]:
    """`calls` calls, `concurrency` in flight; wall time, latencies and failures."""
    numbers = iter(range(1, calls + 1))
    latencies: list[float] = []
    errors: list[str] = []

    async def worker() -> None:
        for n in numbers:
            started = time.perf_counter()
            try:
                await call(n)
            except Exception as exc:  # noqa: BLE001 - counted and reported, the burst goes on
                errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")
                continue
            latencies.append(time.perf_counter() - started)

    cpu = time.process_time()
    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, calls))))
    wall = time.perf_counter() - started
    return {
        "calls": calls,
        "wall_s": wall,
        "client_cpu_s": time.process_time() - cpu,
        "latencies_ms": [round(s * 1000, 3) for s in latencies],
        "errors": len(errors),
        "error_samples": errors[:3],
    }


async def serve_stdin(
    targets: dict[str, tuple[str, str]], concurrency: int, http_client: str
) -> None:
    """One JSON command per line on stdin, one JSON reply per line on stdout."""
    clients = {name: Calls(*target, concurrency, http_client) for name, target in targets.items()}
    async for command in loadgen.stdin_commands():
        client = clients[BY_NAME[command["pair"]].launcher]
        if command["op"] == "check":
            reply = await client.check(command["pair"])
        else:
            call = functools.partial(client.call, command["pair"], command["side"])
            reply = await burst(call, command["concurrency"], command["calls"])
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
    for client in clients.values():
        await client.close()


def client_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="pooling_vs_http.py client")
    parser.add_argument("--pooling", nargs=2, metavar=("GRPC", "HTTP_URL"))
    parser.add_argument("--render", nargs=2, metavar=("GRPC", "HTTP_URL"))
    parser.add_argument("--concurrency", type=int, required=True, help="the most in flight")
    parser.add_argument("--cpu", type=int, default=1, help="core to pin to (-1: no pinning)")
    parser.add_argument("--http-client", choices=HTTP_CLIENTS, default=HTTP_CLIENTS[0])
    args = parser.parse_args(argv)
    loadgen.pin_to_cpu(args.cpu)
    targets: dict[str, tuple[str, str]] = {
        kind: (target[0], target[1])
        for kind, target in ((POOLING, args.pooling), (RENDER, args.render))
        if target is not None
    }
    session = serve_stdin(targets, args.concurrency, args.http_client)
    try:
        import uvloop
    except ImportError:
        asyncio.run(session)
    else:
        uvloop.run(session)
    return 0


# ----- the driver -----------------------------------------------------------------------


def launcher_flags(kind: str) -> list[str]:
    """What each launcher serves beyond its ports: the cross-encoder, or the tiny model."""
    if kind == RENDER:
        return []
    from vllm_servicer.testing.tiny_model import (
        default_classifier_model_dir,
        tiny_engine_flags,
        write_tiny_classifier_model,
    )

    model = write_tiny_classifier_model(default_classifier_model_dir())
    return ["--model", str(model), *tiny_engine_flags(), "--runner", "pooling"]


def announced(server: run.Managed, timeout: float) -> tuple[str, str]:
    """The gRPC address and HTTP URL a launcher printed once it served."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = server.log_path.read_text(errors="replace")
        address = re.search(r"vllm-servicer listening on (\S+:\d+)", text)
        url = re.search(r"vllm-servicer http on (http://\S+:\d+)", text)
        if address and url:
            return address[1], url[1]
        if not server.alive():
            raise RuntimeError(f"the {server.name} launcher exited; see {server.log_path}")
        time.sleep(0.5)
    raise RuntimeError(f"the {server.name} launcher did not serve in {timeout:.0f} s")


@dataclass
class Burst:
    """One measured burst and the launcher's CPU over it."""

    pair: str
    side: str
    concurrency: int
    round: int
    position: int
    result: dict[str, Any]
    launcher_cpu_s: float
    engine_cpu_s: float

    def to_json(self) -> dict[str, Any]:
        r = self.result
        return {
            "pair": self.pair,
            "side": self.side,
            "concurrency": self.concurrency,
            "round": self.round,
            "position": self.position,
            "launcher_cpu_s": round(self.launcher_cpu_s, 4),
            "engine_cpu_s": round(self.engine_cpu_s, 4),
            "calls": r["calls"],
            "wall_s": round(r["wall_s"], 4),
            "client_cpu_s": round(r["client_cpu_s"], 4),
            "latency_p50_ms": loadgen._percentile(r["latencies_ms"], 50),
            "latency_p99_ms": loadgen._percentile(r["latencies_ms"], 99),
            "errors": r["errors"],
            "error_samples": r["error_samples"],
        }


def round_order(rnd: int) -> list[str]:
    """A B B A in even rounds, B A A B in odd ones."""
    return [GRPC, HTTP, HTTP, GRPC] if rnd % 2 == 0 else [HTTP, GRPC, GRPC, HTTP]


class Driver:
    """Starts both launchers and the client, checks the answers, runs the rounds, stops all."""

    def __init__(self, args: argparse.Namespace, stamp: str) -> None:
        self.args = args
        self.stamp = stamp
        self.procs = run.ProcessGroup(f"{stamp}-pooling-vs-http-")
        self.servers: dict[str, run.Managed] = {}
        self.addresses: dict[str, tuple[str, str]] = {}
        self.flags: dict[str, list[str]] = {}
        self.client: run.LineChannel | None = None
        self.bursts: list[Burst] = []
        self.agreement: dict[str, Any] = {}
        self.pairs = [BY_NAME[name] for name in args.pairs]
        # Only the launchers the pairs asked for run.
        self.kinds = [k for k in (POOLING, RENDER) if any(p.launcher == k for p in self.pairs)]

    log = staticmethod(run.log)

    def start(self) -> None:
        # Keys or tracing from this shell would change what the launchers serve.
        drop = ("OTEL_", "VLLM_API_KEY", "VLLM_SERVICER_ADMIN_API_KEY")
        env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
        for kind in self.kinds:  # both start at once; an idle one costs about nothing
            self.flags[kind] = launcher_flags(kind)
            cmd = [sys.executable, "-m", "vllm_servicer", "serve", "--host", "127.0.0.1"]
            cmd += ["--port", "0", "--http-port", "0", "--drain-grace", "0", *self.flags[kind]]
            server = self.servers[kind] = self.procs.add(kind, cmd)
            server.start(env=env)
            self.log(f"starting the {kind} launcher (log: {server.log_path})")
        started = time.monotonic()
        for kind, server in self.servers.items():
            self.addresses[kind] = announced(server, self.args.start_timeout)
            self.log(f"{kind}: gRPC {self.addresses[kind][0]}, HTTP {self.addresses[kind][1]}")
        self.log(f"launchers serving after {time.monotonic() - started:.0f} s")
        if self.args.cpu >= 0:
            moved = sum(run.keep_engine_off(s.pid, self.args.cpu) for s in self.servers.values())
            self.log(f"{moved} engine threads moved off core {self.args.cpu}")
        cmd = [sys.executable, __file__, "client", "--cpu", str(self.args.cpu)]
        cmd += ["--concurrency", str(max(self.args.concurrency))]
        cmd += ["--http-client", self.args.http_client]
        for kind in self.kinds:
            cmd += [f"--{kind}", *self.addresses[kind]]
        client = self.procs.add("client", cmd)
        client.start(stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.client = run.LineChannel(client)

    def ask(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.client is not None
        return self.client.ask(command)

    def check(self) -> None:
        for pair in self.pairs:
            self.agreement[pair.name] = self.ask({"op": "check", "pair": pair.name})
            verdict = "agree" if self.agreement[pair.name]["agree"] else "DISAGREE"
            self.log(f"{pair.name}: gRPC and HTTP answers {verdict}")

    def burst(self, pair: Pair, side: str, concurrency: int, rnd: int, pos: int) -> Burst:
        server = self.servers[pair.launcher]
        before = run.CpuSnapshot.take(server.pid)
        result = self.ask(
            {
                "op": "burst",
                "pair": pair.name,
                "side": side,
                "concurrency": concurrency,
                "calls": self.calls_for(concurrency),
            }
        )
        after = run.CpuSnapshot.take(server.pid)
        b = Burst(
            pair.name,
            side,
            concurrency,
            rnd,
            pos,
            result,
            after.server - before.server,
            after.engine - before.engine,
        )
        self.bursts.append(b)
        return b

    def calls_for(self, concurrency: int) -> int:
        index = self.args.concurrency.index(concurrency)
        return int(self.args.calls[min(index, len(self.args.calls) - 1)])

    def run_rounds(self) -> None:
        self.log("warming up")  # connections, first-call paths, off the clock
        for pair in self.pairs:
            for side in (GRPC, HTTP):
                for concurrency in self.args.concurrency:
                    self.ask(
                        {
                            "op": "burst",
                            "pair": pair.name,
                            "side": side,
                            "concurrency": concurrency,
                            "calls": 2 * concurrency,
                        }
                    )
        for rnd in range(self.args.rounds):
            for pair in self.pairs:
                line = []
                for concurrency in self.args.concurrency:
                    for pos, side in enumerate(round_order(rnd)):
                        b = self.burst(pair, side, concurrency, rnd, pos)
                        line.append(f"{side} {b.result['calls'] / b.result['wall_s']:.0f}")
                        time.sleep(self.args.pause)
                    line[-4:] = [f"c{concurrency}: " + " ".join(line[-4:])]
                self.log(f"round {rnd} {pair.name}: " + ", ".join(line) + " calls/s")


# ----- summary --------------------------------------------------------------------------


def pooled(bursts: list[Burst]) -> dict[str, float]:
    """Bursts of one side pooled: calls/s, the launcher's, engine's and client's CPU µs per call."""
    calls = sum(b.result["calls"] for b in bursts)
    wall = sum(b.result["wall_s"] for b in bursts)
    return {
        "calls_per_s": calls / wall,
        "launcher_cpu_us_per_call": sum(b.launcher_cpu_s for b in bursts) / calls * 1e6,
        "engine_cpu_us_per_call": sum(b.engine_cpu_s for b in bursts) / calls * 1e6,
        "client_cpu_us_per_call": sum(b.result["client_cpu_s"] for b in bursts) / calls * 1e6,
    }


def median_and_range(values: list[float]) -> dict[str, Any]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "rounds": [round(v, 4) for v in values],
    }


RATIOS = ("calls_per_s", "launcher_cpu_us_per_call", "latency_p50_ms")


def summarize(bursts: list[Burst], concurrencies: list[int]) -> dict[str, Any]:
    """Per pair and concurrency: each side's figures (medians over rounds), ratios gRPC / HTTP."""
    out: dict[str, Any] = {}
    for pair in PAIRS:
        if not any(b.pair == pair.name for b in bursts):
            continue
        out[pair.name] = {}
        for c in concurrencies:
            mine = [b for b in bursts if b.pair == pair.name and b.concurrency == c]
            rounds = sorted({b.round for b in mine})
            entry: dict[str, Any] = {}
            per_round: dict[str, list[dict[str, float]]] = {}
            for side in (GRPC, HTTP):
                ours = [b for b in mine if b.side == side]
                per_round[side] = [pooled([b for b in ours if b.round == r]) for r in rounds]
                for figures, r in zip(per_round[side], rounds, strict=True):
                    latencies = [x for b in ours if b.round == r for x in b.result["latencies_ms"]]
                    figures["latency_p50_ms"] = loadgen._percentile(latencies, 50) or 0.0
                every = [x for b in ours for x in b.result["latencies_ms"]]
                entry[side] = {
                    k: median_and_range([f[k] for f in per_round[side]]) for k in per_round[side][0]
                }
                entry[side]["latency_p50_ms_all"] = loadgen._percentile(every, 50)
                entry[side]["latency_p99_ms_all"] = loadgen._percentile(every, 99)
                entry[side]["calls"] = sum(b.result["calls"] for b in ours)
                entry[side]["aa_launcher_cpu_us_per_call"] = aa_ratios(ours)
            entry["ratio_grpc_over_http"] = {
                k: median_and_range(
                    [g[k] / h[k] for g, h in zip(per_round[GRPC], per_round[HTTP], strict=True)]
                )
                for k in RATIOS
            }
            out[pair.name][f"c{c}"] = entry
    return out


def aa_ratios(bursts: list[Burst]) -> list[float]:
    """One side's later / earlier burst in each round, CPU per call: the noise floor."""
    out = []
    for rnd in sorted({b.round for b in bursts}):
        two = sorted((b for b in bursts if b.round == rnd), key=lambda b: b.position)
        if len(two) == 2 and two[0].launcher_cpu_s > 0:
            first, second = (pooled([b])["launcher_cpu_us_per_call"] for b in two)
            out.append(round(second / first, 4))
    return out


def span(figure: dict[str, Any], spec: str) -> str:
    return (
        f"{format(figure['median'], spec)} "
        f"[{format(figure['min'], spec)}-{format(figure['max'], spec)}]"
    )


def print_table(summary: dict[str, Any], rounds: int) -> None:
    print(
        f"\nMedians over {rounds} rounds [min-max]; latency over every timed call. "
        "CPU: the launcher's own process (not its engine processes), µs per call."
    )
    head = f"{'pair':<34}{'conc':>5}{'calls/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'CPU us/call':>13}"
    print(head)
    for pair in PAIRS:
        for key, entry in summary.get(pair.name, {}).items():
            for side, label in ((GRPC, pair.grpc_label), (HTTP, pair.http_label)):
                e = entry[side]
                print(
                    f"{label:<34}{key[1:]:>5}{e['calls_per_s']['median']:>9.0f}"
                    f"{e['latency_p50_ms_all']:>9.2f}{e['latency_p99_ms_all']:>9.2f}"
                    f"{e['launcher_cpu_us_per_call']['median']:>13.0f}"
                )
    print("\nRatios gRPC / HTTP per round: median [min-max]")
    print(f"{'pair':<20}{'conc':>5}{'CPU/call':>22}{'calls/s':>22}{'p50':>22}")
    for pair in PAIRS:
        for key, entry in summary.get(pair.name, {}).items():
            r = entry["ratio_grpc_over_http"]
            print(
                f"{pair.name:<20}{key[1:]:>5}{span(r['launcher_cpu_us_per_call'], '.2f'):>22}"
                f"{span(r['calls_per_s'], '.2f'):>22}{span(r['latency_p50_ms'], '.2f'):>22}"
            )
    floor = [
        v
        for entries in summary.values()
        for entry in entries.values()
        for side in (GRPC, HTTP)
        for v in entry[side]["aa_launcher_cpu_us_per_call"]
    ]
    if floor:
        print(
            f"A/A noise floor, CPU/call (a side's two bursts in one round): "
            f"{min(floor):.2f}-{max(floor):.2f} over {len(floor)} pairs"
        )


def problems_of(driver: Driver) -> list[str]:
    problems = [
        f"{name}: gRPC answered {a[GRPC]!r:.200}, HTTP {a[HTTP]!r:.200}"
        for name, a in driver.agreement.items()
        if not a["agree"]
    ]
    for b in driver.bursts:
        if b.result["errors"]:
            where = f"{b.pair} {b.side} c={b.concurrency} round {b.round}"
            problems.append(
                f"{where}: {b.result['errors']} failed, e.g. {b.result['error_samples'][:1]}"
            )
    return problems


# ----- entry point ----------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="`pooling_vs_http.py client ...` is the client process it starts.",
    )
    p.add_argument("--rounds", type=int, default=6, help="rounds of A B B A / B A A B")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument(
        "--calls", type=int, nargs="+", default=[100, 320], help="calls per burst, per concurrency"
    )
    p.add_argument("--quick", action="store_true", help="1 round, 12 and 48 calls per burst")
    p.add_argument(
        "--pairs",
        nargs="+",
        choices=[pair.name for pair in PAIRS],
        default=[pair.name for pair in PAIRS],
        help="the pairs to measure (default all); only their launchers start",
    )
    p.add_argument(
        "--json",
        type=Path,
        help="write the results here (default: benchmarks/results/pooling-vs-http-<time>.json)",
    )
    p.add_argument(
        "--cpu",
        type=int,
        default=1,
        help="core the client is pinned to, and engine threads kept off (-1: none)",
    )
    p.add_argument(
        "--http-client",
        choices=HTTP_CLIENTS,
        default=HTTP_CLIENTS[0],
        help="the client's HTTP library (default aiohttp)",
    )
    p.add_argument("--pause", type=float, default=0.1, help="seconds between bursts")
    p.add_argument("--start-timeout", type=float, default=600.0)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["client"]:
        return client_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.quick:
        args.rounds, args.calls = 1, [12, 48]
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    driver = Driver(args, dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
    started = time.monotonic()
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        driver.start()
        driver.check()
        driver.run_rounds()
    except KeyboardInterrupt:
        driver.log("interrupted; stopping every process started")
        return 130
    finally:
        driver.procs.stop_all()
        signal.signal(signal.SIGTERM, previous)
    summary = summarize(driver.bursts, args.concurrency)
    problems = problems_of(driver)
    data = {
        "stamp": driver.stamp,
        "argv": sys.argv[1:],
        "pairs": {p.name: {GRPC: p.grpc_label, HTTP: p.http_label} for p in driver.pairs},
        "launcher_flags": driver.flags,
        "http_client": args.http_client,
        "rounds": args.rounds,
        "concurrency": args.concurrency,
        "calls_per_burst": {f"c{c}": driver.calls_for(c) for c in args.concurrency},
        "environment": run.environment(),
        "agreement": driver.agreement,
        "all_agree": all(a["agree"] for a in driver.agreement.values()),
        "problems": problems,
        "seconds": round(time.monotonic() - started, 1),
        "summary": summary,
        "bursts": [b.to_json() for b in driver.bursts],
    }
    print_table(summary, args.rounds)
    print(f"\n{time.monotonic() - started:.0f} s in all")
    for problem in problems:
        print("PROBLEM:", problem)
    out = args.json or run.RESULTS / f"pooling-vs-http-{driver.stamp}.json"
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"results: {out}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
