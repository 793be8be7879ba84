"""What Render's DerenderChat costs against vLLM's own HTTP derender route.

    .venv/bin/python benchmarks/derender_vs_http.py [--rounds 6] [--concurrency 16]
        [--calls 320] [--quick] [--json PATH]

One launcher as users run it, serving gRPC and vLLM's HTTP API
(`--http-port`, with `--enable-scale-out` for vLLM's derender routes) from one
engine: the tiny model with `<think>` and `</think>` as tokens of their own,
started with vLLM's parsers (`--reasoning-parser deepseek_r1`,
`--tool-call-parser pythonic --enable-auto-tool-choice`), so that every
derender runs both parsers as a deployment with them does.

The pair: DerenderChat (gRPC) against POST /v1/chat/completions/derender
(HTTP), the same work: a chat (system and user message, one tool) and one
generated sequence (a reasoning section, then a tool call: 40-odd token ids)
after the chat's prompt ids, answered with the reasoning, the content and the
parsed tool call. The user message carries the call number (unique per call,
the same numbers on both sides). Before timing, call 0 is asked over both and
the answers compared: the same reasoning, content and tool call (the finish
reason differs by design: DerenderChat says "tool_calls" after a tool call
the model chose to make, as vLLM's chat completions; vLLM's derender keeps
the generation's "stop").

One client process (asyncio: aiohttp, HTTP/1.1 keep-alive, one connection per
call in flight; grpc.aio, one channel), pinned to `--cpu`, every engine
thread kept off that core, drives bursts of `--calls` calls at each
concurrency (16 in flight by default), A B B A in one round and B A A B in the
next. Per burst, the CPU time of the launcher's own process (all its threads:
the asyncio loop, grpc's, uvicorn's; not its EngineCore child) before and
after: the derender runs there, with no engine step. Printed: calls/s,
latency p50/p99, the launcher's CPU per call (medians over rounds), the
per-round ratios gRPC / HTTP with their range, and the A/A noise floor (a
side's two bursts in one round). Exits non-zero when the answers disagreed or
a call failed.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# The bursts, the launcher's CPU and the summary figures are pooling_vs_http.py's
# (and through it run.py's and loadgen.py's), so the figures are taken alike.
import loadgen  # noqa: E402
import pooling_vs_http as pvh  # noqa: E402
import run  # noqa: E402

GRPC, HTTP = pvh.GRPC, pvh.HTTP
PAIR = "derender-chat"
LABELS = {GRPC: "DerenderChat (reasoning, 1 tool call)", HTTP: "POST /v1/chat/completions/derender"}
GENERATED = '<think>Ask the tool about the weather.</think>[get_weather(city="Paris")]'
SYSTEM = pvh.SYSTEM
TOOL_PARAMETERS = pvh.TOOL_PARAMETERS
TOOL = pvh.TOOL

# ----- the calls (the client process) ---------------------------------------------------


class Calls:
    """Both sides' derender of the same chat and ids, by call number."""

    def __init__(self, grpc_target: str, http_url: str, concurrency: int) -> None:
        import grpc

        from vllm_servicer.proto import render_pb2, render_pb2_grpc

        self.pb = render_pb2
        self.channel = grpc.aio.insecure_channel(grpc_target)
        self.render = render_pb2_grpc.RenderStub(self.channel)
        self.http = pvh.HttpPoster("aiohttp", http_url, concurrency)
        self.tool = render_pb2.Tool(**TOOL, parameters=json.dumps(TOOL_PARAMETERS))
        self.http_tools = [pvh.http_tool(TOOL_PARAMETERS)]
        self.prompt: list[int] = []
        self.generated: list[int] = []

    async def prepare(self) -> None:
        """The prompt's ids (call 0's chat, every call's alike in length) and the
        generated ids, from the launcher's own Render."""
        pb = self.pb
        chat = pb.RenderChatRequest(messages=self.messages(0), tools=[self.tool])
        self.prompt = list((await self.render.RenderChat(chat)).token_ids)
        rendered = await self.render.RenderCompletion(
            pb.RenderCompletionRequest(prompt=[GENERATED], add_special_tokens=False)
        )
        self.generated = list(rendered.prompts[0].token_ids)

    def messages(self, n: int) -> list[Any]:
        return [self.pb.ChatMessage(**m) for m in pvh.chat_messages(n)]

    async def close(self) -> None:
        await self.http.close()
        await self.channel.close()

    def call(self, side: str, n: int) -> Awaitable[Any]:
        """Call `n` over `side`; awaits the parsed answer."""
        if side == GRPC:
            pb = self.pb
            chat = pb.RenderChatRequest(messages=self.messages(n), tools=[self.tool])
            sequence = pb.GeneratedSequence(token_ids=self.generated, finish_reason="stop")
            request = pb.DerenderChatRequest(
                chat=chat, prompt_token_ids=self.prompt, choices=[sequence]
            )
            return self.render.DerenderChat(request)
        body = {
            "generate_response": {
                "request_id": f"r{n}",
                "choices": [{"index": 0, "token_ids": self.generated, "finish_reason": "stop"}],
            },
            "chat_request": {
                "messages": pvh.chat_messages(n),
                "tools": self.http_tools,
                "tool_choice": "auto",
            },
            "prompt_token_ids": self.prompt,
        }
        return self.http.post("/v1/chat/completions/derender", body)

    async def check(self) -> dict[str, Any]:
        """Call 0 over both sides; whether the answers agree, and what they were."""
        got_grpc = normalized(await self.call(GRPC, 0))
        got_http = normalized(await self.call(HTTP, 0))
        return {"agree": got_grpc == got_http and bool(got_grpc[2]), GRPC: got_grpc, HTTP: got_http}


def normalized(answer: Any) -> list[Any]:
    """An answer of either side: reasoning, content, tool calls (name, arguments)."""
    if isinstance(answer, dict):  # HTTP
        message = answer["choices"][0]["message"]
        calls = [
            [c["function"]["name"], json.loads(c["function"]["arguments"])]
            for c in message.get("tool_calls") or ()
        ]
        return [message.get("reasoning"), message.get("content"), calls]
    choice = answer.choices[0]
    return [
        choice.reasoning if choice.HasField("reasoning") else None,
        choice.content if choice.HasField("content") else None,
        [[c.name, json.loads(c.arguments)] for c in choice.tool_calls],
    ]


async def serve_stdin(target: tuple[str, str], concurrency: int) -> None:
    """One JSON command per line on stdin, one JSON reply per line on stdout."""
    client = Calls(*target, concurrency)
    await client.prepare()
    async for command in loadgen.stdin_commands():
        if command["op"] == "check":
            reply = await client.check()
        else:
            call = functools.partial(client.call, command["side"])
            reply = await pvh.burst(call, command["concurrency"], command["calls"])
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
    await client.close()


def client_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="derender_vs_http.py client")
    parser.add_argument("--target", nargs=2, metavar=("GRPC", "HTTP_URL"), required=True)
    parser.add_argument("--concurrency", type=int, required=True, help="the most in flight")
    parser.add_argument("--cpu", type=int, default=1, help="core to pin to (-1: no pinning)")
    args = parser.parse_args(argv)
    loadgen.pin_to_cpu(args.cpu)
    session = serve_stdin((args.target[0], args.target[1]), args.concurrency)
    try:
        import uvloop
    except ImportError:
        asyncio.run(session)
    else:
        uvloop.run(session)
    return 0


# ----- the driver -----------------------------------------------------------------------


def thinking_model(directory: Path) -> Path:
    """The tiny model with `<think>` and `</think>` as tokens of their own (what
    the reasoning parser looks for), written beside the tiny model, no download."""
    from transformers import AutoTokenizer

    from vllm_servicer.testing.tiny_model import ensure_tiny_model

    if (directory / "config.json").exists():
        return directory
    staging = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(ensure_tiny_model(), staging)
    tokenizer = AutoTokenizer.from_pretrained(staging)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    tokenizer.save_pretrained(staging)
    config = json.loads((staging / "config.json").read_text())
    config["vocab_size"] = len(tokenizer)
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    staging.rename(directory)
    return directory


def launcher_flags() -> list[str]:
    from vllm_servicer.testing.tiny_model import default_model_dir, tiny_engine_flags

    model = thinking_model(default_model_dir().with_name("tiny-llama-thinking"))
    flags = ["--model", str(model), *tiny_engine_flags(), "--enable-scale-out"]
    flags += ["--reasoning-parser", "deepseek_r1"]
    return flags + ["--tool-call-parser", "pythonic", "--enable-auto-tool-choice"]


class Driver:
    """Starts the launcher and the client, checks the answers, runs the rounds, stops all."""

    def __init__(self, args: argparse.Namespace, stamp: str) -> None:
        self.args = args
        self.stamp = stamp
        self.procs = run.ProcessGroup(f"{stamp}-derender-vs-http-")
        self.server: run.Managed | None = None
        self.flags: list[str] = []
        self.client: run.LineChannel | None = None
        self.bursts: list[pvh.Burst] = []
        self.agreement: dict[str, Any] = {}

    log = staticmethod(run.log)

    def start(self) -> None:
        # Keys or tracing from this shell would change what the launcher serves.
        drop = ("OTEL_", "VLLM_API_KEY", "VLLM_SERVICER_ADMIN_API_KEY")
        env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
        self.flags = launcher_flags()
        cmd = [sys.executable, "-m", "vllm_servicer", "serve", "--host", "127.0.0.1"]
        cmd += ["--port", "0", "--http-port", "0", "--drain-grace", "0", *self.flags]
        self.server = self.procs.add("derender", cmd)
        self.server.start(env=env)
        self.log(f"starting the launcher (log: {self.server.log_path})")
        started = time.monotonic()
        address, url = pvh.announced(self.server, self.args.start_timeout)
        self.log(f"gRPC {address}, HTTP {url}, serving after {time.monotonic() - started:.0f} s")
        if self.args.cpu >= 0:
            moved = run.keep_engine_off(self.server.pid, self.args.cpu)
            self.log(f"{moved} engine threads moved off core {self.args.cpu}")
        cmd = [sys.executable, __file__, "client", "--cpu", str(self.args.cpu)]
        cmd += ["--concurrency", str(max(self.args.concurrency)), "--target", address, url]
        client = self.procs.add("client", cmd)
        client.start(stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.client = run.LineChannel(client)

    def ask(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.client is not None
        return self.client.ask(command)

    def check(self) -> None:
        self.agreement[PAIR] = self.ask({"op": "check"})
        verdict = "agree" if self.agreement[PAIR]["agree"] else "DISAGREE"
        self.log(f"{PAIR}: gRPC and HTTP answers {verdict}")

    def calls_for(self, concurrency: int) -> int:
        index = self.args.concurrency.index(concurrency)
        return int(self.args.calls[min(index, len(self.args.calls) - 1)])

    def burst(self, side: str, concurrency: int, rnd: int, pos: int) -> pvh.Burst:
        assert self.server is not None
        before = run.CpuSnapshot.take(self.server.pid)
        result = self.ask(
            {
                "op": "burst",
                "side": side,
                "concurrency": concurrency,
                "calls": self.calls_for(concurrency),
            }
        )
        after = run.CpuSnapshot.take(self.server.pid)
        b = pvh.Burst(
            PAIR,
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

    def run_rounds(self) -> None:
        self.log("warming up")  # connections, first-call paths, off the clock
        for side in (GRPC, HTTP):
            for concurrency in self.args.concurrency:
                self.ask(
                    {
                        "op": "burst",
                        "side": side,
                        "concurrency": concurrency,
                        "calls": 2 * concurrency,
                    }
                )
        for rnd in range(self.args.rounds):
            line = []
            for concurrency in self.args.concurrency:
                for pos, side in enumerate(pvh.round_order(rnd)):
                    b = self.burst(side, concurrency, rnd, pos)
                    cpu = b.launcher_cpu_s / b.result["calls"] * 1e6
                    line.append(
                        f"{side} {b.result['calls'] / b.result['wall_s']:.0f}/s {cpu:.0f}us"
                    )
                    time.sleep(self.args.pause)
                line[-4:] = [f"c{concurrency}: " + " ".join(line[-4:])]
            self.log(f"round {rnd} {PAIR}: " + ", ".join(line))


def summarize(bursts: list[pvh.Burst], concurrencies: list[int]) -> dict[str, Any]:
    """Per concurrency: each side's figures (medians over rounds), ratios gRPC / HTTP."""
    out: dict[str, Any] = {}
    for c in concurrencies:
        mine = [b for b in bursts if b.concurrency == c]
        rounds = sorted({b.round for b in mine})
        entry: dict[str, Any] = {}
        per_round: dict[str, list[dict[str, float]]] = {}
        for side in (GRPC, HTTP):
            ours = [b for b in mine if b.side == side]
            per_round[side] = [pvh.pooled([b for b in ours if b.round == r]) for r in rounds]
            for figures, r in zip(per_round[side], rounds, strict=True):
                latencies = [x for b in ours if b.round == r for x in b.result["latencies_ms"]]
                figures["latency_p50_ms"] = loadgen._percentile(latencies, 50) or 0.0
            every = [x for b in ours for x in b.result["latencies_ms"]]
            entry[side] = {
                k: pvh.median_and_range([f[k] for f in per_round[side]]) for k in per_round[side][0]
            }
            entry[side]["latency_p50_ms_all"] = loadgen._percentile(every, 50)
            entry[side]["latency_p99_ms_all"] = loadgen._percentile(every, 99)
            entry[side]["calls"] = sum(b.result["calls"] for b in ours)
            entry[side]["aa_launcher_cpu_us_per_call"] = pvh.aa_ratios(ours)
        entry["ratio_grpc_over_http"] = {
            k: pvh.median_and_range(
                [g[k] / h[k] for g, h in zip(per_round[GRPC], per_round[HTTP], strict=True)]
            )
            for k in pvh.RATIOS
        }
        out[f"c{c}"] = entry
    return out


def print_table(summary: dict[str, Any], rounds: int) -> None:
    print(
        f"\nMedians over {rounds} rounds [min-max]; latency over every timed call. "
        "CPU: the launcher's own process (not its engine process), µs per call."
    )
    print(f"{'':<40}{'conc':>5}{'calls/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'CPU us/call':>20}")
    for key, entry in summary.items():
        for side in (GRPC, HTTP):
            e = entry[side]
            print(
                f"{LABELS[side]:<40}{key[1:]:>5}{e['calls_per_s']['median']:>9.0f}"
                f"{e['latency_p50_ms_all']:>9.2f}{e['latency_p99_ms_all']:>9.2f}"
                f"{pvh.span(e['launcher_cpu_us_per_call'], '.0f'):>20}"
            )
    print("\nRatios gRPC / HTTP per round: median [min-max]")
    print(f"{'conc':>5}{'CPU/call':>22}{'calls/s':>22}{'p50':>22}")
    for key, entry in summary.items():
        r = entry["ratio_grpc_over_http"]
        print(
            f"{key[1:]:>5}{pvh.span(r['launcher_cpu_us_per_call'], '.2f'):>22}"
            f"{pvh.span(r['calls_per_s'], '.2f'):>22}{pvh.span(r['latency_p50_ms'], '.2f'):>22}"
        )
    floor = [
        v
        for entry in summary.values()
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
            where = f"{b.side} c={b.concurrency} round {b.round}"
            problems.append(
                f"{where}: {b.result['errors']} failed, e.g. {b.result['error_samples'][:1]}"
            )
    return problems


# ----- entry point ----------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="`derender_vs_http.py client ...` is the client process it starts.",
    )
    p.add_argument("--rounds", type=int, default=6, help="rounds of A B B A / B A A B")
    p.add_argument("--concurrency", type=int, nargs="+", default=[16])
    p.add_argument(
        "--calls", type=int, nargs="+", default=[320], help="calls per burst, per concurrency"
    )
    p.add_argument("--quick", action="store_true", help="1 round, 48 calls per burst")
    p.add_argument(
        "--json",
        type=Path,
        help="write the results here (default: benchmarks/results/derender-vs-http-<time>.json)",
    )
    p.add_argument(
        "--cpu",
        type=int,
        default=1,
        help="core the client is pinned to, and engine threads kept off (-1: none)",
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
        args.rounds, args.calls = 1, [48]
    pvh.LOG_DIR.mkdir(parents=True, exist_ok=True)
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
        "pair": {PAIR: LABELS},
        "launcher_flags": driver.flags,
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
    out = args.json or run.RESULTS / f"derender-vs-http-{driver.stamp}.json"
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"results: {out}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
