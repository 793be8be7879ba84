"""This launcher behind the SMG gateway against vLLM's gRPC server behind the same gateway.

    .venv/bin/python benchmarks/gateway.py [--rounds 4] [--concurrency 64] [--servers ...]
        [--input-tokens 100] [--output-tokens 100] [--json PATH] [--quick] [engine flags]

The setting vLLM's PR for its gRPC server measured (+37% over HTTP): an OpenAI
chat-completions load generator driving the SMG gateway (PyPI ``smg``, the
``sgl-model-gateway`` router, ``smg launch``) with ``grpc://`` workers, the
gateway applying the chat template, tokenizing and detokenizing, the worker
generating token ids.

Servers, each with the same engine flags and model (the tiny model unless a
``--model`` flag is given), all started at once and left up (an idle engine
costs about no CPU), each driven alone in turn:

- ``ours``: ``python -m vllm_servicer serve`` behind its own gateway;
- ``vllm-grpc``: vLLM's gRPC server (``vllm.entrypoints.launchers.grpc_server``,
  as ``seed.py`` and ``run.py`` start it) behind its own gateway;
- ``vllm-http``: vLLM's OpenAI HTTP server, driven directly (no gateway).

The gateway runs from its own venv (``build/venv-smg``, made with ``pip install
smg`` when missing, so the project's venv is untouched). The load generator
(``gateway.py loadgen``, aiohttp, pinned to one core like ``run.py``'s, every
engine thread kept off that core) streams ``/v1/chat/completions`` with
``stream_options.include_usage``: one user message of about ``--input-tokens``
tokens once templated (unique per request: no prefix-cache hits),
``max_tokens`` = ``min_tokens`` = ``--output-tokens`` with ``ignore_eos``. A
request counts when it got HTTP 200, ``finish_reason`` ``length`` and
``usage.completion_tokens`` equal to the ask; any other is an error and the
run exits non-zero. TTFT is the time to the first chunk with content.

Rounds go A B B A, then B A A B (three servers: A B C C B A, rotating), so
drift cancels; each server's two bursts in a round are its A/A pair, the noise
floor printed beside the A/B ratio. Also per burst: CPU seconds of the serving
process, its engine processes and the gateway (its process's user + system
CPU, all threads, per output token, with the per-round ratio ours / vLLM gRPC
and each side's A/A), and the TCP segments and bytes the server sent its
gateway per output token (``ss``). JSON in ``results/gateway-<time>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# Process handling, CPU accounting and engine placement are run.py's; pinning
# loadgen.py's, reading flags seed.py's.
import loadgen  # noqa: E402
import run  # noqa: E402
from seed import flag_value  # noqa: E402

OURS, VLLM_GRPC, VLLM_HTTP = "ours", "vllm-grpc", "vllm-http"
SERVERS = (OURS, VLLM_GRPC, VLLM_HTTP)
LABELS = {
    OURS: "vllm-servicer behind smg",
    VLLM_GRPC: "vLLM grpc_server behind smg",
    VLLM_HTTP: "vLLM OpenAI HTTP, direct",
}
BEHIND_GATEWAY = (OURS, VLLM_GRPC)
SMG_VENV = run.ROOT / "build" / "venv-smg"
SMG_PACKAGE = "smg"
SMG_REQUIREMENT = "smg==1.13.0"  # the release measured in docs/benchmarks.md
# Per-round ratios printed and kept: (numerator, denominator).
PAIRS = ((OURS, VLLM_GRPC), (VLLM_GRPC, VLLM_HTTP), (OURS, VLLM_HTTP))
# Words prompts are made of; each request's prompt is a fresh random draw.
WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
    "november oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee "
    "zulu red green blue yellow black white orange purple monday tuesday wednesday "
    "river mountain forest desert ocean island valley canyon meadow glacier"
).split()


# ----- the load generator (a subprocess: `gateway.py loadgen`) ---------------------


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


class ChatLoad:
    """Streams chat completions at OpenAI endpoints; one aiohttp session, kept open."""

    def __init__(self, model: str, tokenizer: str) -> None:
        from transformers import AutoTokenizer

        self.model = model
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self.rng = random.Random(0)
        self.session: Any = None
        self.burst_no = 0

    async def open(self) -> None:
        import aiohttp

        # One connection per request in flight, as an HTTP/1.1 client has.
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=600)
        self.session = aiohttp.ClientSession(connector=connector, timeout=timeout)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    def content_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt(self, tag: str, tokens: int) -> str:
        """A message of `tokens` tokens (by this tokenizer, give or take one),
        starting with `tag` so that no two requests share a prefix past the template."""
        words = [tag]
        while self.content_tokens(" ".join(words)) < tokens:
            words.append(self.rng.choice(WORDS))
        while len(words) > 1 and self.content_tokens(" ".join(words)) > tokens:
            words.pop()
        return " ".join(words)

    def body(self, content: str, max_tokens: int) -> dict[str, Any]:
        return {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "min_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    async def one(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        """One streamed request: its timings, usage and any fault."""
        sent = time.perf_counter()
        got: dict[str, Any] = {"ttft": None, "chunks": 0, "tokens": 0, "prompt_tokens": 0}
        finish, usage, done, note = None, None, False, ""
        try:
            async with self.session.post(url + "/v1/chat/completions", json=body) as response:
                if response.status != 200:
                    text = (await response.text())[:200]
                    return got | {"note": f"HTTP {response.status}: {text}"}
                buffer = b""
                async for data in response.content.iter_any():
                    buffer += data
                    while b"\n\n" in buffer:
                        event, buffer = buffer.split(b"\n\n", 1)
                        for line in event.splitlines():
                            if not line.startswith(b"data:"):
                                continue
                            payload = line[5:].strip()
                            if payload == b"[DONE]":
                                done = True
                                continue
                            message = json.loads(payload)
                            if "error" in message:
                                note = f"error event: {str(message['error'])[:200]}"
                            if message.get("usage"):
                                usage = message["usage"]
                            for choice in message.get("choices") or ():
                                if (choice.get("delta") or {}).get("content"):
                                    got["chunks"] += 1
                                    if got["ttft"] is None:
                                        got["ttft"] = time.perf_counter() - sent
                                if choice.get("finish_reason"):
                                    finish = choice["finish_reason"]
        except Exception as exc:  # counted, never fatal to the burst
            return got | {"note": f"{type(exc).__name__}: {exc}"[:200]}
        if usage is not None:
            got["tokens"] = usage.get("completion_tokens", 0)
            got["prompt_tokens"] = usage.get("prompt_tokens", 0)
        if not note:
            if not done:
                note = "no [DONE]"
            elif usage is None:
                note = "no usage chunk"
            elif finish != "length":
                note = f"finish_reason={finish!r}"
            elif got["tokens"] != body["max_tokens"]:
                note = f"completion_tokens={got['tokens']}, asked {body['max_tokens']}"
            elif got["ttft"] is None:
                note = "no content"
        return got | {"note": note, "latency": time.perf_counter() - sent}

    async def burst(self, spec: dict[str, Any]) -> dict[str, Any]:
        """`requests` requests, `concurrency` at a time, at `url`; the burst's figures."""
        self.burst_no += 1
        count, max_tokens = spec["requests"], spec["output_tokens"]
        # Built before the clock starts: tokenizing prompts is the client's own work.
        content = spec["input_tokens"] - spec.get("template_tokens", 0)
        tag = f"{self.burst_no}x"
        bodies = [self.body(self.prompt(f"{tag}{i}", content), max_tokens) for i in range(count)]
        queue = iter(bodies)
        results: list[dict[str, Any]] = []

        async def worker() -> None:
            for body in queue:
                results.append(await self.one(spec["url"], body))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(spec["concurrency"], count))))
        wall = time.perf_counter() - started
        ok = [r for r in results if not r["note"]]
        bad = [r["note"] for r in results if r["note"]]
        tokens = sum(r["tokens"] for r in results)
        ttfts = [r["ttft"] * 1000 for r in ok if r["ttft"] is not None]
        latencies = [r["latency"] * 1000 for r in ok]

        def ms(values: list[float], q: float) -> float | None:
            value = percentile(values, q)
            return None if value is None else round(value, 1)

        prompt_tokens = [r["prompt_tokens"] for r in ok]
        return {
            "requests": count,
            "ok": len(ok),
            "errors": len(bad),
            "error_samples": sorted(set(bad))[:3],
            "output_tokens": tokens,
            "content_chunks": sum(r["chunks"] for r in results),
            "prompt_tokens_mean": round(statistics.mean(prompt_tokens), 1) if ok else None,
            "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 1) if wall else 0.0,
            "ttft_p50_ms": ms(ttfts, 0.5),
            "ttft_p90_ms": ms(ttfts, 0.9),
            "latency_p50_ms": ms(latencies, 0.5),
        }

    async def probe(self, url: str) -> dict[str, Any]:
        """One short request: whether it works, and the template's own tokens."""
        content = "probe " + self.rng.choice(WORDS)
        result = await self.one(url, self.body(content, 2))
        overhead = result["prompt_tokens"] - self.content_tokens(content)
        return {"ok": not result["note"], "note": result["note"], "template_tokens": overhead}


async def serve_stdin(load: ChatLoad) -> None:
    """One JSON command per line on stdin, one JSON reply per line on stdout."""
    await load.open()
    async for command in loadgen.stdin_commands():
        if command["op"] == "probe":
            reply = await load.probe(command["url"])
        else:
            reply = await load.burst(command)
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
    await load.close()


def loadgen_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="gateway.py loadgen")
    parser.add_argument("--model", required=True, help="the model name requests carry")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--cpu", type=int, default=1, help="core to pin to (-1: no pinning)")
    args = parser.parse_args(argv)
    loadgen.pin_to_cpu(args.cpu)
    load = ChatLoad(args.model, args.tokenizer)
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve_stdin(load))
    else:
        uvloop.run(serve_stdin(load))
    return 0


# ----- the gateway's venv ------------------------------------------------------------


def smg_binary(venv: Path) -> Path:
    return venv / "bin" / "smg"


def ensure_smg(venv: Path, install: bool = True) -> str | None:
    """None when `venv` has a working `smg` (installed there if missing), else why not."""
    binary = smg_binary(venv)
    if not binary.exists() and install:
        run.log(f"installing {SMG_PACKAGE} into {venv} (its own venv; the project's is untouched)")
        steps = [
            [sys.executable, "-m", "venv", str(venv)],
            [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", SMG_REQUIREMENT],
        ]
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
                return f"`{' '.join(step)}` failed: {' / '.join(tail)}"
    if not binary.exists():
        return f"no {binary}: `python -m venv {venv} && {venv}/bin/pip install {SMG_REQUIREMENT}`"
    done = subprocess.run([str(binary), "launch", "--help"], capture_output=True, timeout=120)
    if done.returncode != 0 or b"--worker-urls" not in done.stdout:
        return f"`{binary} launch --help` does not work: {done.stderr.decode()[-300:]}"
    return None


def smg_version(venv: Path) -> str | None:
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "show", SMG_PACKAGE],
        capture_output=True,
        text=True,
    )
    for line in done.stdout.splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    return None


# ----- the driver ---------------------------------------------------------------------


def model_of(flags: Sequence[str]) -> tuple[str, str]:
    """The --model and --tokenizer in `flags` (the tokenizer defaults to the model)."""

    model = flag_value(flags, "--model")
    assert model is not None, "engine_flags always names the model"
    return model, flag_value(flags, "--tokenizer") or model


def http_ok(url: str, body: dict[str, Any] | None = None, timeout: float = 5.0) -> bool:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def grpc_healthy(target: str) -> bool:
    import grpc
    from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        try:
            reply = vllm_engine_pb2_grpc.VllmEngineStub(channel).HealthCheck(
                vllm_engine_pb2.HealthCheckRequest(), timeout=2.0
            )
        except grpc.RpcError:
            return False
    return bool(reply.healthy)


@dataclass
class Side:
    """One server, its gateway when it has one, and the URL the load generator drives."""

    name: str
    server: run.Managed
    gateway: run.Managed | None = None
    url: str = ""
    template_tokens: int = 0


def tcp_sent(port: int) -> tuple[int, int] | None:
    """TCP data segments and bytes sent so far from local `port`, summed over its
    established connections (`ss -ti`); None where `ss` is missing. Behind a
    gateway that is the gateway's one long-lived connection, so two readings give
    exact deltas."""
    try:
        done = subprocess.run(
            ["ss", "-tinH", "state", "established", f"sport = :{port}"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    segments = sum(int(v) for v in re.findall(r"\bdata_segs_out:(\d+)", done.stdout))
    sent = sum(int(v) for v in re.findall(r"\bbytes_sent:(\d+)", done.stdout))
    return segments, sent


@dataclass
class Burst:
    server: str
    round: int
    position: int
    result: dict[str, Any]
    server_cpu_s: float
    engine_cpu_s: float
    gateway_cpu_s: float | None
    # Sent by the server to its gateway over the burst (`tcp_sent`); None direct.
    tcp_segments: int | None = None
    tcp_bytes: int | None = None

    def to_json(self) -> dict[str, Any]:
        tokens = self.result["output_tokens"]

        def per_token_us(cpu: float | None) -> float | None:
            return round(cpu / tokens * 1e6, 1) if tokens and cpu is not None else None

        def per_token(count: int | None, digits: int) -> float | None:
            return round(count / tokens, digits) if tokens and count is not None else None

        return {
            "server": self.server,
            "round": self.round,
            "position": self.position,
            "server_cpu_us_per_token": per_token_us(self.server_cpu_s),
            "engine_cpu_us_per_token": per_token_us(self.engine_cpu_s),
            "gateway_cpu_us_per_token": per_token_us(self.gateway_cpu_s),
            "gateway_cpu_s": None if self.gateway_cpu_s is None else round(self.gateway_cpu_s, 4),
            "tcp_segments_per_token": per_token(self.tcp_segments, 3),
            "tcp_bytes_per_token": per_token(self.tcp_bytes, 1),
            **self.result,
        }


def round_order(servers: Sequence[str], rnd: int) -> list[str]:
    """A B B A, B A A B, ...; three: A B C C B A, B C A A C B, ..."""
    if len(servers) == 2:
        order = list(servers) if rnd % 2 == 0 else list(servers[::-1])
    else:
        k = rnd % len(servers)
        order = list(servers[k:]) + list(servers[:k])
    return order + order[::-1]


@dataclass
class Driver:
    args: argparse.Namespace
    flags: list[str]
    extra: list[str]
    stamp: str
    sides: dict[str, Side] = field(default_factory=dict)
    bursts: list[Burst] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    loadgen: run.LineChannel | None = None

    def __post_init__(self) -> None:
        self.procs = run.ProcessGroup(f"{self.stamp}-gateway-")

    log = staticmethod(run.log)

    def server_cmd(self, name: str, port: int) -> list[str]:
        host = ["--host", "127.0.0.1", "--port", str(port)]
        if name == OURS:
            # The same flags, spelled out, as the others get.
            ours = [sys.executable, "-m", "vllm_servicer", "serve", *host, "--drain-grace", "0"]
            return ours + self.flags
        module = {
            VLLM_GRPC: "vllm.entrypoints.launchers.grpc_server",
            VLLM_HTTP: "vllm.entrypoints.openai.api_server",
        }[name]
        return [sys.executable, "-m", module, *host, *self.flags]

    def start(self) -> None:
        model, tokenizer = model_of(self.flags)
        lg = self.procs.add(
            "loadgen",
            [sys.executable, __file__, "loadgen", "--model", model, "--tokenizer", tokenizer]
            + ["--cpu", str(self.args.loadgen_cpu)],
        )
        lg.start(stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.loadgen = run.LineChannel(lg)
        for name in self.args.servers:
            port = run.free_port()
            m = self.procs.add(name, self.server_cmd(name, port))
            m.port = port
            self.log(f"starting {LABELS[name]} on port {port} (log: {m.log_path})")
            m.start()
            self.sides[name] = Side(name, m, url=f"http://127.0.0.1:{port}")
        self.wait_servers()
        for side in self.sides.values():
            if side.name in BEHIND_GATEWAY:
                self.start_gateway(side, model)
        self.wait_gateways()
        for side in self.sides.values():
            if self.args.loadgen_cpu >= 0:
                moved = run.keep_engine_off(side.server.pid, self.args.loadgen_cpu)
                self.log(
                    f"{side.name}: {moved} engine threads moved off core {self.args.loadgen_cpu}"
                )

    def wait_servers(self) -> None:
        started, waiting = time.monotonic(), dict(self.sides)
        while waiting:
            for name, side in list(waiting.items()):
                m = side.server
                if name == VLLM_HTTP:
                    ready = http_ok(f"{side.url}/health")
                else:
                    ready = grpc_healthy(f"127.0.0.1:{m.port}")
                if ready:
                    self.log(
                        f"{LABELS[name]}: server ready after {time.monotonic() - started:.0f} s"
                    )
                    del waiting[name]
                elif not m.alive():
                    raise RuntimeError(f"{name} exited during start-up; see {m.log_path}")
            if time.monotonic() - started > self.args.start_timeout:
                raise RuntimeError(
                    f"not healthy after {self.args.start_timeout} s: {list(waiting)}"
                )
            if waiting:
                time.sleep(1.0)

    def start_gateway(self, side: Side, model: str) -> None:
        port, metrics = run.free_port(), run.free_port()
        cmd = [str(smg_binary(self.args.smg_venv)), "launch", "--host", "127.0.0.1"]
        cmd += ["--port", str(port), "--prometheus-port", str(metrics)]
        cmd += ["--prometheus-host", "127.0.0.1"]
        cmd += ["--worker-urls", f"grpc://127.0.0.1:{side.server.port}"]
        cmd += ["--model-path", model, "--log-level", "warn", *self.args.gateway_args]
        m = self.procs.add(f"smg-{side.name}", cmd)
        m.port = port
        self.log(f"starting the gateway for {side.name} on port {port} (log: {m.log_path})")
        # No colour codes in its log.
        m.start(env={**os.environ, "NO_COLOR": "1", "RUST_LOG_STYLE": "never"})
        side.gateway = m
        side.url = f"http://127.0.0.1:{port}"

    def wait_gateways(self) -> None:
        """Until a short chat request works through every side (the gateway has
        registered its worker), then each side's template tokens from it."""
        assert self.loadgen is not None
        started, waiting = time.monotonic(), dict(self.sides)
        while waiting:
            for name, side in list(waiting.items()):
                reply = self.loadgen.ask({"op": "probe", "url": side.url})
                if reply["ok"]:
                    side.template_tokens = reply["template_tokens"]
                    self.log(
                        f"{LABELS[name]}: chat ready after {time.monotonic() - started:.0f} s "
                        f"(the template adds {side.template_tokens} tokens)"
                    )
                    del waiting[name]
                elif side.gateway is not None and not side.gateway.alive():
                    raise RuntimeError(f"the gateway exited; see {side.gateway.log_path}")
            if time.monotonic() - started > self.args.start_timeout:
                raise RuntimeError(
                    f"no chat through {list(waiting)} after {self.args.start_timeout} s"
                )
            if waiting:
                time.sleep(1.0)

    def ask(
        self, side: Side, concurrency: int, requests: int, output_tokens: int
    ) -> dict[str, Any]:
        assert self.loadgen is not None
        return self.loadgen.ask(
            {
                "op": "burst",
                "url": side.url,
                "concurrency": concurrency,
                "requests": requests,
                "input_tokens": self.args.input_tokens,
                "template_tokens": side.template_tokens,
                "output_tokens": output_tokens,
            }
        )

    def burst(self, name: str, rnd: int, pos: int) -> Burst:
        side = self.sides[name]
        gateway_pid = side.gateway.pid if side.gateway is not None else None

        def gateway_cpu() -> float | None:
            # User + system CPU of the gateway's process, all its threads (smg runs
            # its Rust router inside the Python process `smg launch` starts), and of
            # any child, read from the process's CPU clock (/proc's utime + stime,
            # to the nanosecond rather than the 10 ms tick).
            if gateway_pid is None:
                return None
            return run.cpu_seconds(gateway_pid) + sum(
                run.cpu_seconds(p) for p in run.descendants(gateway_pid)
            )

        port = side.server.port
        wire_before = tcp_sent(port)
        before, gw_before = run.CpuSnapshot.take(side.server.pid), gateway_cpu()
        result = self.ask(side, self.args.concurrency, self.args.requests, self.args.output_tokens)
        after, gw_after = run.CpuSnapshot.take(side.server.pid), gateway_cpu()
        wire_after = tcp_sent(port)
        if result["errors"]:
            self.problems.append(
                f"{name} round {rnd}: {result['errors']} of {result['requests']} requests bad, "
                f"e.g. {result['error_samples'][:1]}"
            )
        gw = None if gw_before is None or gw_after is None else gw_after - gw_before
        b = Burst(
            name, rnd, pos, result, after.server - before.server, after.engine - before.engine, gw
        )
        if wire_before is not None and wire_after is not None and name in BEHIND_GATEWAY:
            # Only the gateway's connection is open there (the load generator's
            # come and go on vLLM's HTTP port, so that side has none).
            b.tcp_segments = wire_after[0] - wire_before[0]
            b.tcp_bytes = wire_after[1] - wire_before[1]
        self.bursts.append(b)
        return b

    def run_rounds(self) -> None:
        self.log("warming up (one short burst per side)")
        for side in self.sides.values():
            warm = self.ask(
                side, min(16, self.args.concurrency), 32, min(16, self.args.output_tokens)
            )
            if warm["errors"]:
                self.problems.append(f"{side.name} warm-up: {warm['error_samples'][:1]}")
            time.sleep(self.args.pause)
        for rnd in range(self.args.rounds):
            line = []
            for pos, name in enumerate(round_order(self.args.servers, rnd)):
                b = self.burst(name, rnd, pos)
                line.append(f"{name} {b.result['tokens_per_s']:.0f}")
                time.sleep(self.args.pause)
            self.log(f"round {rnd}: " + ", ".join(line) + f" tok/s; load {os.getloadavg()[0]:.1f}")


# ----- summary ------------------------------------------------------------------------


def pooled(bursts: list[Burst]) -> dict[str, float | None]:
    """One server's bursts pooled: tok/s over their wall time, mean TTFT percentiles,
    the gateway's CPU seconds over their tokens (None without a gateway)."""
    wall = sum(b.result["wall_s"] for b in bursts)
    tokens = sum(b.result["output_tokens"] for b in bursts)
    gateway = [b.gateway_cpu_s for b in bursts]
    gateway_per_token = (
        sum(g for g in gateway if g is not None) / tokens
        if tokens and gateway and None not in gateway
        else None
    )

    def mean(key: str) -> float | None:
        values = [b.result[key] for b in bursts if b.result[key] is not None]
        return statistics.mean(values) if values else None

    return {
        "tokens_per_s": tokens / wall if wall else 0.0,
        "ttft_p50_ms": mean("ttft_p50_ms"),
        "gateway_cpu_per_token": gateway_per_token,
    }


def median_range(values: list[float]) -> dict[str, Any] | None:
    if not values:
        return None
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
        "rounds": [round(v, 3) for v in values],
    }


def summarize(bursts: list[Burst], servers: Sequence[str]) -> dict[str, Any]:
    rounds = sorted({b.round for b in bursts})

    def of(name: str, rnd: int | None = None) -> list[Burst]:
        return [b for b in bursts if b.server == name and (rnd is None or b.round == rnd)]

    per_server: dict[str, Any] = {}
    for name in servers:
        mine = of(name)
        if not mine:
            continue

        def med(key: str, mine: list[Burst] = mine, digits: int = 1) -> float | None:
            values = [b.to_json()[key] for b in mine if b.to_json()[key] is not None]
            return round(statistics.median(values), digits) if values else None

        def med3(key: str, mine: list[Burst] = mine) -> float | None:
            return med(key, mine, 3)

        aa, gateway_aa = [], []
        for rnd in rounds:
            pair = sorted(of(name, rnd), key=lambda b: b.position)
            if len(pair) == 2 and pair[0].result["tokens_per_s"]:
                aa.append(pair[1].result["tokens_per_s"] / pair[0].result["tokens_per_s"])
            gw_pair = [b.to_json()["gateway_cpu_us_per_token"] for b in pair]
            if len(pair) == 2 and gw_pair[0] and gw_pair[1]:
                gateway_aa.append(gw_pair[1] / gw_pair[0])
        per_server[name] = {
            "label": LABELS[name],
            "tokens_per_s": med("tokens_per_s"),
            "ttft_p50_ms": med("ttft_p50_ms"),
            "ttft_p90_ms": med("ttft_p90_ms"),
            "latency_p50_ms": med("latency_p50_ms"),
            "prompt_tokens_mean": med("prompt_tokens_mean"),
            "server_cpu_us_per_token": med("server_cpu_us_per_token"),
            "engine_cpu_us_per_token": med("engine_cpu_us_per_token"),
            "gateway_cpu_us_per_token": med("gateway_cpu_us_per_token"),
            "tcp_segments_per_token": med3("tcp_segments_per_token"),
            "tcp_bytes_per_token": med("tcp_bytes_per_token"),
            "requests": sum(b.result["requests"] for b in mine),
            "requests_ok": sum(b.result["ok"] for b in mine),
            "aa": median_range(aa),
            # The same server's two bursts in a round: the noise floor of the
            # gateway's CPU per token, beside the ours/vLLM ratio.
            "gateway_cpu_aa": median_range(gateway_aa),
        }
    ratios: dict[str, Any] = {}
    for a, b in PAIRS:
        if a not in per_server or b not in per_server:
            continue
        tok, ttft, gw = [], [], []
        for rnd in rounds:
            pa, pb = pooled(of(a, rnd)), pooled(of(b, rnd))
            if pb["tokens_per_s"]:
                tok.append(float(pa["tokens_per_s"] or 0) / float(pb["tokens_per_s"]))
            if pa["ttft_p50_ms"] and pb["ttft_p50_ms"]:
                ttft.append(float(pa["ttft_p50_ms"]) / float(pb["ttft_p50_ms"]))
            if pa["gateway_cpu_per_token"] and pb["gateway_cpu_per_token"]:
                gw.append(float(pa["gateway_cpu_per_token"]) / float(pb["gateway_cpu_per_token"]))
        ratios[f"{a}/{b}"] = {
            "tokens_per_s": median_range(tok),
            "ttft_p50": median_range(ttft),
            # The gateway's CPU per output token, ours over theirs (both behind one).
            "gateway_cpu_per_token": median_range(gw),
        }
    return {"servers": per_server, "ratios": ratios}


def fmt(value: Any, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def print_summary(summary: dict[str, Any]) -> None:
    print()
    head = f"{'server':<30} {'tok/s':>7} {'TTFT p50':>9} {'p90':>7} {'in tok':>7} "
    head += f"{'srv us/tok':>10} {'eng us/tok':>10} {'smg us/tok':>10} {'segs/tok':>8} "
    head += f"{'B/tok':>6} {'ok':>9}  A/A tok/s  A/A smg"
    print(head)
    for figures in summary["servers"].values():
        aa = figures["aa"]
        aa_text = f"{aa['min']:.2f}-{aa['max']:.2f}" if aa else "-"
        gaa = figures["gateway_cpu_aa"]
        aa_text = f"{aa_text:<10} " + (f"{gaa['min']:.2f}-{gaa['max']:.2f}" if gaa else "-")
        print(
            f"{figures['label']:<30} {fmt(figures['tokens_per_s']):>7} "
            f"{fmt(figures['ttft_p50_ms']):>9} {fmt(figures['ttft_p90_ms']):>7} "
            f"{fmt(figures['prompt_tokens_mean']):>7} "
            f"{fmt(figures['server_cpu_us_per_token']):>10} "
            f"{fmt(figures['engine_cpu_us_per_token']):>10} "
            f"{fmt(figures['gateway_cpu_us_per_token'], '.1f'):>10} "
            f"{fmt(figures['tcp_segments_per_token'], '.3f'):>8} "
            f"{fmt(figures['tcp_bytes_per_token'], '.1f'):>6} "
            f"{figures['requests_ok']:>4}/{figures['requests']:<4}  {aa_text}"
        )
    print()
    for pair, r in summary["ratios"].items():
        tok, ttft = r["tokens_per_s"], r["ttft_p50"]
        if tok is None:
            continue
        rounds = " ".join(f"{v:.2f}" for v in tok["rounds"])
        line = f"{pair:<22} tok/s ratio {tok['median']:.2f} [{tok['min']:.2f}-{tok['max']:.2f}]"
        line += f" (rounds: {rounds})"
        if ttft is not None:
            line += f"; TTFT p50 ratio {ttft['median']:.2f}"
        gw = r["gateway_cpu_per_token"]
        if gw is not None:
            line += f"; gateway CPU/token ratio {gw['median']:.2f}"
            line += f" [{gw['min']:.2f}-{gw['max']:.2f}]"
        print(line)


# ----- main ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="Options it does not know are engine flags for every server.",
    )
    p.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=None, help="per burst (default 2 x C)")
    p.add_argument("--input-tokens", type=int, default=100, help="prompt tokens, templated")
    p.add_argument("--output-tokens", type=int, default=100)
    p.add_argument("--pause", type=float, default=1.5, help="seconds between bursts")
    p.add_argument("--loadgen-cpu", type=int, default=1, help="-1: leave it unpinned")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--smg-venv", type=Path, default=SMG_VENV)
    p.add_argument("--no-install", action="store_true", help="never pip install smg")
    p.add_argument(
        "--gateway-args", default="", help='more `smg launch` flags, e.g. "--policy round_robin"'
    )
    p.add_argument("--check-smg", action="store_true", help="install/check smg, then exit")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument(
        "--quick",
        action="store_true",
        help="a brief run: ours and vllm-grpc, C=16, 32 requests of 32 tokens, one round",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["loadgen"]:
        return loadgen_main(argv[1:])
    args, extra = build_parser().parse_known_args(argv)
    args.gateway_args = args.gateway_args.split()
    problem = ensure_smg(args.smg_venv, install=not args.no_install)
    if args.check_smg:
        print(json.dumps({"smg": problem is None, "problem": problem}))
        return 0 if problem is None else 3
    if problem:
        print(f"the SMG gateway is not available: {problem}", file=sys.stderr)
        return 3
    if args.quick:
        args.servers = [s for s in args.servers if s != VLLM_HTTP] or [OURS, VLLM_GRPC]
        args.rounds, args.concurrency, args.output_tokens = 1, 16, 32
        args.requests = args.requests or 32
    args.requests = args.requests or 2 * args.concurrency
    if VLLM_GRPC in args.servers and (reason := run.check_reference_server()):
        print(reason, file=sys.stderr)
        return 2
    flags = run.engine_flags(extra)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    (run.RESULTS / "logs").mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()
    print(
        f"servers: {', '.join(args.servers)}; C={args.concurrency}, {args.requests} requests "
        f"per burst, ~{args.input_tokens} tokens in, {args.output_tokens} out (ignore_eos), "
        f"{args.rounds} rounds; smg {smg_version(args.smg_venv)}; load {load_start[0]:.1f}",
        flush=True,
    )
    print(f"engine flags: {' '.join(flags)}", flush=True)
    driver = Driver(args, flags, extra, stamp)
    try:
        driver.start()
        driver.run_rounds()
    finally:
        driver.procs.stop_all()
    summary = summarize(driver.bursts, args.servers)
    print_summary(summary)
    for note in driver.problems:
        print(f"PROBLEM: {note}")
    out = args.json or run.RESULTS / f"gateway-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "engine_flags": flags,
        "smg": smg_version(args.smg_venv),
        "loadavg_at_start": load_start,
        "environment": run.environment(),
        "problems": driver.problems,
        "summary": summary,
        "bursts": [b.to_json() for b in driver.bursts],
    }
    out.write_text(json.dumps(data, indent=1))
    print(f"\nJSON: {out}; load average at end {os.getloadavg()[0]:.1f}")
    return 1 if driver.problems else 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
