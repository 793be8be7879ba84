"""What vllm.Inference's GenerateStream costs against VllmEngine's Generate, on one server.

    .venv/bin/python benchmarks/protocols.py [--concurrency 1 64] [--rounds 3] [--tokens 64]
        [--json PATH] [--quick] [launcher flags, e.g. --model ...]

One launcher process serves both protocols on one engine
(``python -m vllm_servicer serve --services vllm-engine inference``, the tiny
model unless a ``--model`` flag is given). A load generator in a subprocess,
pinned to one core, drives three cells with the same kind of requests
(token-id prompts unique per request, greedy, a fixed output length with
``ignore_eos``):

- ``engine``: VllmEngine Generate, streaming, token ids out;
- ``inference-ids``: Inference GenerateStream, ``output_token_ids`` on and
  ``output_text`` off (token ids only);
- ``inference-text``: Inference GenerateStream with text deltas (``output_text``
  left at its default, on: the server detokenizes).

Each round drives the cells in an order and then in reverse (A B C C B A),
the order rotating from round to round, so drift cancels and each cell's two
bursts give a noise floor. Per cell: output tokens/s and the serving process's
CPU per output token (utime + stime of the launcher's main process only, not
its engine processes, over each burst), medians over rounds, and each
Inference cell's per-round ratios to the VllmEngine cell. Every request's
output token count is checked; a wrong one makes the run exit non-zero.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# The process, CPU and placement helpers are run.py's (make bench), the prompt and
# timing helpers loadgen.py's, so the figures are taken the same way as theirs.
import loadgen  # noqa: E402
import run  # noqa: E402

from vllm_servicer.proto import inference_pb2 as ipb  # noqa: E402
from vllm_servicer.proto import inference_pb2_grpc, vllm_engine_pb2_grpc  # noqa: E402
from vllm_servicer.proto import vllm_engine_pb2 as epb  # noqa: E402

ENGINE, INFERENCE_IDS, INFERENCE_TEXT = "engine", "inference-ids", "inference-text"
CELLS = (ENGINE, INFERENCE_IDS, INFERENCE_TEXT)
LABELS = {
    ENGINE: "VllmEngine Generate (ids)",
    INFERENCE_IDS: "Inference GenerateStream (ids)",
    INFERENCE_TEXT: "Inference GenerateStream (text)",
}
# Each Inference cell against the VllmEngine cell, per round.
RATIOS = ("cpu_us_per_token", "cpu_us_per_message", "tokens_per_s")
PROMPT_LEN = 8
LOG_DIR = run.RESULTS / "logs"

# ----- the load generator (a subprocess: `protocols.py loadgen`) -------------------


@dataclass
class Stream:
    """What one request's stream brought: (arrival, tokens) per message, and any fault."""

    arrivals: list[tuple[float, int]]
    tokens: int = 0
    text_chars: int = 0
    note: str = ""


async def read_engine(responses: AsyncIterator[Any]) -> Stream:
    """Reads a VllmEngine Generate stream: chunks of token ids, then `complete`."""
    got = Stream([], note="no complete message")
    async for response in responses:
        if response.HasField("chunk"):
            n = len(response.chunk.token_ids)
            got.tokens += n
            got.arrivals.append((time.perf_counter(), n))
        else:
            got.arrivals.append((time.perf_counter(), 0))
            reason = response.complete.finish_reason
            got.note = "" if reason == "length" else f"finish_reason={reason!r}"
    return got


async def read_inference(responses: AsyncIterator[Any], ids: bool) -> Stream:
    """Reads an Inference GenerateStream: PromptInfo, then deltas, the last with FinishInfo.

    With `ids`, the token ids received are counted, else each message's `num_tokens`.
    """
    got = Stream([], note="no finish_info")
    async for response in responses:
        if not response.HasField("outputs"):
            got.arrivals.append((time.perf_counter(), 0))  # the PromptInfo message
            continue
        out = response.outputs
        n = len(out.token_ids) if ids else out.num_tokens
        got.tokens += n
        got.text_chars += len(out.text)
        got.arrivals.append((time.perf_counter(), n))
        if out.HasField("finish_info"):
            info = out.finish_info
            got.note = ""
            if info.finish_reason != ipb.FinishInfo.LENGTH:
                got.note = f"finish_reason={ipb.FinishInfo.FinishReason.Name(info.finish_reason)}"
            elif info.num_output_tokens != got.tokens:
                got.note = f"num_output_tokens={info.num_output_tokens}, counted {got.tokens}"
    return got


class ProtocolClient:
    """Both protocols' stubs on one channel each to the one server, kept open."""

    def __init__(self, target: str) -> None:
        import grpc

        options = [
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
            # Polled while the server starts: retry every second, not after
            # gRPC's default backoff (up to two minutes).
            ("grpc.initial_reconnect_backoff_ms", 500),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        self._channels = [grpc.aio.insecure_channel(target, options=options) for _ in range(2)]
        self.engine = vllm_engine_pb2_grpc.VllmEngineStub(self._channels[0])
        self.inference = inference_pb2_grpc.InferenceStub(self._channels[1])
        self._burst = 0

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()

    async def health(self) -> bool:
        try:
            reply = await self.engine.HealthCheck(epb.HealthCheckRequest(), timeout=2.0)
        except Exception:
            return False
        return bool(reply.healthy)

    def call(self, cell: str, request_id: str, tokens: int) -> AsyncIterator[Any]:
        """Starts one streaming request of `cell` and returns its responses."""
        prompt = loadgen.make_prompt(PROMPT_LEN)
        if cell == ENGINE:
            return self.engine.Generate(  # type: ignore[no-any-return]
                epb.GenerateRequest(
                    request_id=request_id,
                    tokenized=epb.TokenizedInput(input_ids=prompt),
                    sampling_params=epb.SamplingParams(
                        temperature=0.0, max_tokens=tokens, ignore_eos=True
                    ),
                    stream=True,
                )
            )
        # Text deltas: output_text left unset, which means on. Omitted temperature
        # is greedy in this protocol.
        if cell == INFERENCE_TEXT:
            response = ipb.ResponseOptions()
        else:
            response = ipb.ResponseOptions(output_token_ids=True, output_text=False)
        return self.inference.GenerateStream(  # type: ignore[no-any-return]
            ipb.GenerateRequest(
                request_id=request_id,
                token_ids=ipb.TokenIds(ids=prompt),
                stopping=ipb.StoppingCriteria(max_new_tokens=tokens, ignore_eos=True),
                response=response,
            )
        )

    async def burst(self, cell: str, spec: loadgen.BurstSpec) -> dict[str, Any]:
        """`spec.requests` requests of `cell`, `spec.concurrency` at a time; its summary."""
        self._burst += 1
        numbers = iter(range(spec.requests))
        rec = loadgen.Recorder(expected_tokens=spec.max_tokens)
        text_chars = 0

        async def worker() -> None:
            nonlocal text_chars
            for i in numbers:
                sent = time.perf_counter()
                try:
                    responses = self.call(cell, f"p{self._burst}-{i}", spec.max_tokens)
                    if cell == ENGINE:
                        got = await read_engine(responses)
                    else:
                        got = await read_inference(responses, ids=cell == INFERENCE_IDS)
                except Exception as exc:  # counted, never fatal to the burst
                    got = Stream([], note=f"{type(exc).__name__}: {exc}"[:200])
                text_chars += got.text_chars
                rec.request_done(sent, got.arrivals, got.tokens, got.note)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(spec.concurrency, spec.requests))))
        result = loadgen.summarize(spec, rec, time.perf_counter() - started)
        return result | {"cell": cell, "requests": spec.requests, "text_chars": text_chars}


async def serve_stdin(target: str) -> None:
    """One JSON command per line on stdin, one JSON reply per line on stdout."""
    client = ProtocolClient(target)
    async for command in loadgen.stdin_commands():
        if command["op"] == "health":
            reply: dict[str, Any] = {"healthy": await client.health()}
        else:
            spec = loadgen.BurstSpec.from_dict(command)
            reply = await client.burst(command["cell"], spec)
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
    await client.close()


def loadgen_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="protocols.py loadgen")
    parser.add_argument("--target", required=True)
    parser.add_argument("--cpu", type=int, default=1, help="core to pin to (-1: no pinning)")
    args = parser.parse_args(argv)
    loadgen.pin_to_cpu(args.cpu)
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve_stdin(args.target))
    else:
        uvloop.run(serve_stdin(args.target))
    return 0


# ----- the driver ---------------------------------------------------------------------


def micros_per(seconds: float, count: int) -> float | None:
    return round(seconds / count * 1e6, 1) if count else None


@dataclass
class Burst:
    """One measured burst and the serving process's CPU over it."""

    cell: str
    concurrency: int
    round: int
    position: int
    result: dict[str, Any]
    server_cpu_s: float
    engine_cpu_s: float

    def to_json(self) -> dict[str, Any]:
        tokens, messages = self.result["output_tokens"], self.result["messages"]
        return {
            "cell": self.cell,
            "concurrency": self.concurrency,
            "round": self.round,
            "position": self.position,
            "server_cpu_s": round(self.server_cpu_s, 3),
            "engine_cpu_s": round(self.engine_cpu_s, 3),
            "server_cpu_us_per_token": micros_per(self.server_cpu_s, tokens),
            "server_cpu_us_per_message": micros_per(self.server_cpu_s, messages),
            **self.result,
        }


def round_order(rnd: int) -> list[str]:
    """The cells rotated by `rnd`, then the same in reverse: A B C C B A, B C A A C B, ..."""
    k = rnd % len(CELLS)
    order = list(CELLS[k:] + CELLS[:k])
    return order + order[::-1]


def requests_for(concurrency: int, asked: int | None) -> int:
    """Requests per burst: two waves (16 to 256) unless asked, never under the concurrency."""
    return max(concurrency, asked or max(16, min(2 * concurrency, 256)))


class Driver:
    """Starts the launcher and the load generator, runs the bursts, stops both."""

    def __init__(self, args: argparse.Namespace, extra: list[str], stamp: str) -> None:
        self.args = args
        self.extra = extra
        self.stamp = stamp
        self.bursts: list[Burst] = []
        self.procs = run.ProcessGroup(f"{stamp}-protocols-")
        self.server: run.Managed | None = None
        self.loadgen: run.LineChannel | None = None

    log = staticmethod(run.log)

    def start(self) -> None:
        """The launcher (both protocols, one engine) and the load generator, until healthy."""
        port = run.free_port()
        cmd = [sys.executable, "-m", "vllm_servicer", "serve", "--host", "127.0.0.1"]
        cmd += ["--port", str(port), "--services", "vllm-engine", "inference"]
        cmd += ["--drain-grace", "0", *self.extra]
        self.server = self.procs.add("server", cmd)
        self.log(f"starting the launcher on port {port} (log: {self.server.log_path})")
        self.server.start()
        target = f"127.0.0.1:{port}"
        lg = self.procs.add(
            "loadgen",
            [sys.executable, __file__, "loadgen", "--target", target, "--cpu", str(self.args.cpu)],
        )
        lg.start(stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.loadgen = run.LineChannel(lg)
        self.wait_ready()
        if self.args.cpu >= 0:
            moved = run.keep_engine_off(self.server.pid, self.args.cpu)
            self.log(f"{moved} engine threads moved off core {self.args.cpu}")

    def wait_ready(self) -> None:
        assert self.server is not None and self.loadgen is not None
        started = time.monotonic()
        while not self.loadgen.ask({"op": "health"})["healthy"]:
            if not self.server.alive():
                raise RuntimeError(f"the launcher exited; see {self.server.log_path}")
            if time.monotonic() - started > self.args.start_timeout:
                raise RuntimeError(f"not healthy after {self.args.start_timeout} s")
            time.sleep(1.0)
        self.log(f"launcher ready after {time.monotonic() - started:.0f} s")

    def ask(self, cell: str, concurrency: int, requests: int) -> dict[str, Any]:
        assert self.loadgen is not None
        spec = {"op": "burst", "cell": cell, "concurrency": concurrency, "requests": requests}
        spec |= {"prompt_len": PROMPT_LEN, "max_tokens": self.args.tokens, "stream": True}
        return self.loadgen.ask(spec)

    def burst(self, cell: str, concurrency: int, rnd: int, pos: int) -> Burst:
        assert self.server is not None
        requests = requests_for(concurrency, self.args.requests)
        before = run.CpuSnapshot.take(self.server.pid)
        result = self.ask(cell, concurrency, requests)
        after = run.CpuSnapshot.take(self.server.pid)
        b = Burst(
            cell,
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
        self.log("warming up")
        for cell in CELLS:  # first-call costs (detokenizer, code paths) off the clock
            self.ask(cell, 16, 32)
        for rnd in range(self.args.rounds):
            for concurrency in self.args.concurrency:
                line = []
                for pos, cell in enumerate(round_order(rnd)):
                    b = self.burst(cell, concurrency, rnd, pos)
                    line.append(f"{cell} {b.result['tokens_per_s']:.0f}")
                    time.sleep(self.args.pause)
                self.log(f"round {rnd} c={concurrency}: " + ", ".join(line) + " tok/s")


# ----- summary ------------------------------------------------------------------------


def per_round(bursts: list[Burst]) -> dict[str, float]:
    """One cell's bursts of one round pooled: tok/s, serving CPU µs per token and message."""

    def total(key: str) -> float:
        return float(sum(b.result[key] for b in bursts))

    def rate(amount: float, count: float) -> float:
        return amount / count if count else 0.0

    tokens, messages = total("output_tokens"), total("messages")
    cpu_us = sum(b.server_cpu_s for b in bursts) * 1e6
    return {
        "tokens_per_s": rate(tokens, total("wall_s")),
        "cpu_us_per_token": rate(cpu_us, tokens),
        "cpu_us_per_message": rate(cpu_us, messages),
        "engine_cpu_us_per_token": rate(sum(b.engine_cpu_s for b in bursts) * 1e6, tokens),
        "messages_per_request": rate(messages, total("requests")),
    }


def aa_ratios(bursts: list[Burst], metric: str) -> list[float]:
    """A cell's later / earlier burst in each round, for `metric`: the noise floor."""
    out = []
    for rnd in sorted({b.round for b in bursts}):
        pair = sorted((b for b in bursts if b.round == rnd), key=lambda b: b.position)
        if len(pair) != 2:
            continue
        first, second = (per_round([b])[metric] for b in pair)
        if first:
            out.append(second / first)
    return out


def median_and_range(values: list[float]) -> dict[str, Any]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "rounds": [round(v, 4) for v in values],
    }


def summarize(bursts: list[Burst], concurrencies: list[int]) -> dict[str, Any]:
    """Per concurrency and cell: medians over rounds, and per-round ratios to `engine`."""
    out: dict[str, Any] = {}
    for c in concurrencies:
        rounds = sorted({b.round for b in bursts if b.concurrency == c})
        table: dict[str, dict[str, list[float]]] = {}
        for cell in CELLS:
            mine = [b for b in bursts if b.concurrency == c and b.cell == cell]
            figures = [per_round([b for b in mine if b.round == r]) for r in rounds]
            table[cell] = {k: [f[k] for f in figures] for k in figures[0]}
            for metric in ("tokens_per_s", "cpu_us_per_token"):
                table[cell][f"aa_{metric}"] = aa_ratios(mine, metric)
        entry: dict[str, Any] = {}
        for cell, columns in table.items():
            entry[cell] = {k: median_and_range(v) for k, v in columns.items() if v}
            if cell == ENGINE:
                continue
            for metric in RATIOS:
                pairs = zip(columns[metric], table[ENGINE][metric], strict=True)
                ratios = [a / b for a, b in pairs]
                entry[cell][f"ratio_{metric}"] = median_and_range(ratios)
        out[f"c{c}"] = entry
    return out


def check(bursts: list[Burst]) -> list[str]:
    """What went wrong: wrong token counts, and cells that did not send what they claim."""
    problems = []
    for b in bursts:
        r = b.result
        where = f"{b.cell} c={b.concurrency} round {b.round}"
        if r["errors"]:
            problems.append(f"{where}: {r['errors']} bad requests, e.g. {r['error_samples'][:1]}")
        if (b.cell == INFERENCE_TEXT) != (r["text_chars"] > 0):
            problems.append(f"{where}: {r['text_chars']} characters of text came back")
    return problems


def print_table(summary: dict[str, Any]) -> None:
    print(
        "\nMedians over rounds [min-max]. CPU: the launcher's main process only, "
        "not its engine processes."
    )
    print(
        f"{'conc':<6}{'cell':<33}{'tok/s':>19}{'CPU us/token':>21}{'CPU us/msg':>21}{'msg/req':>9}"
    )
    for key, entry in summary.items():
        for cell in CELLS:
            e = entry[cell]
            print(
                f"{key:<6}{LABELS[cell]:<33}{span(e['tokens_per_s'], '.0f'):>19}"
                f"{span(e['cpu_us_per_token'], '.1f'):>21}"
                f"{span(e['cpu_us_per_message'], '.1f'):>21}"
                f"{e['messages_per_request']['median']:>9.1f}"
            )
    print("\nRatios to VllmEngine Generate, per round: median [min-max]")
    print(f"{'conc':<6}{'cell':<33}{'CPU/token':>19}{'CPU/msg':>19}{'tok/s':>19}")
    for key, entry in summary.items():
        for cell in CELLS[1:]:
            e = entry[cell]
            ratios = "".join(f"{span(e[f'ratio_{m}'], '.2f'):>19}" for m in RATIOS)
            print(f"{key:<6}{LABELS[cell]:<33}{ratios}")
    for metric, name in (("tokens_per_s", "tok/s"), ("cpu_us_per_token", "CPU/token")):
        floor = [
            v
            for entry in summary.values()
            for e in entry.values()
            for v in e.get(f"aa_{metric}", {}).get("rounds", [])
        ]
        if floor:
            print(
                f"A/A noise floor, {name} (a cell's two bursts in one round): "
                f"{min(floor):.2f}-{max(floor):.2f} over {len(floor)} pairs"
            )


def span(figure: dict[str, Any], spec: str) -> str:
    return (
        f"{format(figure['median'], spec)} "
        f"[{format(figure['min'], spec)}-{format(figure['max'], spec)}]"
    )


# ----- entry point ----------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Unknown flags pass through to the launcher (e.g. vLLM engine flags). "
        "`protocols.py loadgen --target HOST:PORT` is the load generator it starts.",
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[64])
    p.add_argument("--rounds", type=int, default=3, help="rounds of A B C C B A (default 3)")
    p.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    p.add_argument(
        "--requests",
        type=int,
        default=None,
        help="requests per burst (default: 2x concurrency, 16 to 256)",
    )
    p.add_argument("--quick", action="store_true", help="concurrency 16, 1 round, 32 tokens")
    p.add_argument(
        "--json",
        type=Path,
        help="write the results here (default: benchmarks/results/protocols-<time>.json)",
    )
    p.add_argument(
        "--cpu",
        type=int,
        default=1,
        help="core the load generator is pinned to, and engine processes kept off (-1: none)",
    )
    p.add_argument("--pause", type=float, default=0.2, help="seconds between bursts")
    p.add_argument("--start-timeout", type=float, default=600.0)
    return p


def report(args: argparse.Namespace, driver: Driver, problems: list[str]) -> dict[str, Any]:
    summary = summarize(driver.bursts, args.concurrency)
    return {
        "stamp": driver.stamp,
        "argv": sys.argv[1:],
        "cells": {cell: LABELS[cell] for cell in CELLS},
        "concurrency": args.concurrency,
        "rounds": args.rounds,
        "tokens": args.tokens,
        "prompt_len": PROMPT_LEN,
        "launcher_flags": driver.extra,
        "environment": run.environment(),
        # Every request's output token count was compared with `tokens`.
        "token_counts_checked": True,
        "requests_checked": sum(b.result["requests"] for b in driver.bursts),
        "bad_requests": sum(b.result["errors"] for b in driver.bursts),
        "problems": problems,
        "summary": summary,
        "bursts": [b.to_json() for b in driver.bursts],
    }


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["loadgen"]:
        return loadgen_main(argv[1:])
    args, extra = build_parser().parse_known_args(argv)
    if args.quick:
        args.concurrency, args.rounds, args.tokens = [16], 1, 32
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    driver = Driver(args, extra, dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
    started = time.monotonic()
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        driver.start()
        driver.run_rounds()
    except KeyboardInterrupt:
        driver.log("interrupted; stopping every process started")
        return 130
    finally:
        driver.procs.stop_all()
        signal.signal(signal.SIGTERM, previous)
    problems = check(driver.bursts)
    data = report(args, driver, problems)
    print_table(data["summary"])
    print(
        f"\n{data['requests_checked']} requests, each checked for {args.tokens} output tokens: "
        f"{data['bad_requests']} wrong ({time.monotonic() - started:.0f} s in all)"
    )
    for problem in problems:
        print("PROBLEM:", problem)
    out = args.json or run.RESULTS / f"protocols-{driver.stamp}.json"
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"results: {out}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
