"""Where a serving process's CPU goes: vLLM's frontend, this package, grpc and the event loop.

Two samplers, each optional, over one process for a few seconds while it serves:

- ``perf record`` (on-CPU samples, native code and the kernel included) split by
  the library each sample is in: the Python interpreter, grpc's core, the
  kernel (sendmsg, the poller's epoll and wake-ups), the C library, the
  tokenizers (vLLM's detokenizing), protobuf, the event loop;
- ``py-spy`` (Python frames) split by the innermost frame of a known owner:
  this package (its wire conversion, servicers, interceptors), vLLM (its
  detokenizer, output processor, stats, engine client), grpc's Python, other.
  Samples with no Python frame of their own (the event loop in native code,
  waiting or in grpc's core) are counted apart, as perf shows them.

py-spy samples wall-clock time, so a thread that the kernel preempted inside a
system call counts there; perf's split is the one that measures CPU.

    python benchmarks/profile_split.py PID [SECONDS]
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

# perf: library -> owner, first match wins.
LIBRARIES = (
    ("libpython", "Python interpreter (this package's, vLLM's and grpc's Python)"),
    ("cygrpc", "grpc core and its Cython layer"),
    ("kernel", "kernel (sendmsg/recv, epoll, wake-ups, scheduling)"),
    ("libc", "C library (malloc/free, syscall stubs)"),
    ("tokenizers", "tokenizers (vLLM's detokenizing)"),
    ("_message", "protobuf (building, serializing messages)"),
    ("loop.cpython", "event loop (uvloop)"),
    ("_asyncio", "event loop (asyncio tasks, futures)"),
    ("zmq", "ZeroMQ (to and from the engine core)"),
    ("_core.cpython", "msgspec (engine outputs decoded)"),
)

# py-spy: the path of a frame -> owner, first match wins.
OWNERS = (
    ("vllm_servicer/wire/", "ours: wire conversion"),
    ("vllm_servicer/servicer/", "ours: servicers and the stream loop"),
    ("vllm_servicer/interceptors/", "ours: interceptors and the call wrapper"),
    ("vllm_servicer/serve/", "event loop (the launcher's run loop)"),
    ("vllm_servicer/", "ours: other"),
    ("vllm/v1/engine/detokenizer", "vLLM: detokenizing"),
    ("vllm/v1/engine/output_processor", "vLLM: output processing (RequestOutput)"),
    ("vllm/outputs", "vLLM: output processing (RequestOutput)"),
    ("vllm/v1/metrics", "vLLM: stats"),
    ("prometheus_client/", "vLLM: stats"),
    ("vllm/v1/engine/async_llm", "vLLM: AsyncLLM (generate, output handler)"),
    ("vllm/v1/engine/core_client", "vLLM: engine client (ZeroMQ, msgpack)"),
    ("vllm/v1/serial_utils", "vLLM: engine client (ZeroMQ, msgpack)"),
    ("zmq/", "vLLM: engine client (ZeroMQ, msgpack)"),
    ("vllm/", "vLLM: request set-up (sampling params, inputs)"),
    ("grpc/", "grpc: Python"),
)
NATIVE_LEAVES = ("Runner.run", "run_until_done", "Thread.run", "_bootstrap_inner")


def perf_split(pid: int, seconds: float) -> dict[str, float] | None:
    """Percent of on-CPU samples per owner, or None where perf cannot sample."""
    perf = shutil.which("perf")
    if perf is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        data = str(Path(tmp) / "perf.data")
        record = [perf, "record", "-F", "499", "-p", str(pid), "-o", data, "--", "sleep"]
        done = subprocess.run([*record, str(seconds)], capture_output=True, text=True)
        if done.returncode != 0:
            return None
        report = subprocess.run(
            [perf, "report", "-i", data, "--no-children", "-s", "dso", "--stdio", "-g", "none"],
            capture_output=True,
            text=True,
        )
    shares: Counter[str] = Counter()
    for line in report.stdout.splitlines():
        found = re.match(r"\s*([\d.]+)%\s+(\S+)", line)
        if found:
            dso = found[2]
            owner = next((o for key, o in LIBRARIES if key in dso), "other native code")
            shares[owner] += float(found[1])
    return dict(shares.most_common())


def owner_of(frame: str) -> str | None:
    path = frame.rpartition("(")[2]
    return next((o for key, o in OWNERS if key in path), None)


def pyspy_split(pid: int, seconds: float, py_spy: str) -> dict[str, float] | None:
    """Percent of py-spy's samples per owner (see the module's docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "raw.txt"
        command = [py_spy, "record", "-p", str(pid), "-d", str(int(seconds)), "-r", "200"]
        command += ["-f", "raw", "--nonblocking", "-o", str(raw)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0 or not raw.exists():
            return None
        lines = raw.read_text().splitlines()
    shares: Counter[str] = Counter()
    total = 0
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames, n = stack.split(";"), int(count)
        total += n
        if frames[-1].startswith(NATIVE_LEAVES):
            shares["no Python frame: native code under the event loop or grpc's poller"] += n
            continue
        owner = next((o for f in reversed(frames) if (o := owner_of(f))), "other Python")
        shares[owner] += n
    return {k: 100 * v / total for k, v in shares.most_common()} if total else None


def print_split(title: str, shares: dict[str, float] | None, missing: str) -> None:
    print(f"\n{title}")
    if shares is None:
        print(f"  ({missing})")
        return
    for owner, share in shares.items():
        if share >= 0.5:
            print(f"  {share:5.1f}%  {owner}")


def profile(
    pid: int,
    seconds: float,
    py_spy: str | None,
    under_load: Callable[[], Any] = contextlib.nullcontext,
) -> dict[str, dict[str, float] | None]:
    """Both splits, one sampler after the other, each for `seconds` inside `under_load()`."""
    with under_load():
        perf = perf_split(pid, seconds)
    with under_load():
        spy = pyspy_split(pid, seconds, py_spy) if py_spy else None
    print_split("perf: on-CPU samples by library", perf, "perf is not installed or may not sample")
    print_split("py-spy: samples by the innermost Python frame's owner", spy, "py-spy not found")
    return {"perf": perf, "py_spy": spy}


def main() -> int:
    pid = int(sys.argv[1])
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 10.0
    profile(pid, seconds, shutil.which("py-spy"))  # the caller keeps the process busy
    return 0


if __name__ == "__main__":
    sys.exit(main())
