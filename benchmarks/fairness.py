"""A light tenant's first tokens while a heavy tenant floods the engine with long prompts.

    .venv/bin/python benchmarks/fairness.py [--seconds 20] [--against-src OTHER_TREE]
        [--launcher-flag=--api-server-count=2] [--http] [--json]

Starts the launcher (from this tree, then from OTHER_TREE's `src/` when given)
with three keys: A and B of weight 1, C of weight 3, `--max-inflight 16` and
`--max-model-len 2048`, then runs four phases of `--seconds` each:

1. B alone: 2 streams, one after another on each, of 16-token prompts and 16
   tokens out;
2. B as in 1 while A keeps 8 calls busy with 1,843-token prompts (unique, so
   the prefix cache saves nothing) and 1-4 tokens out;
3. B while C (weight 3) keeps 12 calls busy the same way;
4. A alone, 8 calls as in 2: the prompt tokens a tenant alone gets.

Prints per phase B's time to first token (p50 and p99), B's tokens/s, the
flooding tenant's prompt tokens/s and its refusals, and the ratios that the
fairness promises bound: B's p50 under each flood against B's alone (at most
2), and A alone against the other tree's (within 10%). `--http` sends B's and
the flood's requests to the HTTP API's /v1/completions instead of gRPC.

`--alternate N` measures A alone only, with both trees' launchers up at once:
N rounds of one phase each in A B B A order (drift cancels), then the median
prompt tokens/s of each and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx

from vllm_servicer.proto import vllm_engine_pb2 as pb
from vllm_servicer.proto import vllm_engine_pb2_grpc
from vllm_servicer.testing.tiny_model import (
    TINY_ENGINE_KWARGS,
    ensure_tiny_model,
    tiny_engine_flags,
)

ROOT = Path(__file__).resolve().parent.parent
KEYS = {"A": "fairness-key-a-0123456789abcdef", "B": "fairness-key-b-0123456789abcdef"}
KEYS["C"] = "fairness-key-c-0123456789abcdef"
KEY_FILE = f"a: {KEYS['A']}\nb: {KEYS['B']}\nc: {KEYS['C']} weight=3\n"
LONG_PROMPT = 1843
SHORT_PROMPT = 16
VOCAB = 300  # the tiny model's vocabulary is a little larger
_ids = itertools.count()


@dataclass
class Tally:
    """What one tenant's calls got during a phase."""

    first_tokens: list[float] = field(default_factory=list)
    tokens_out: int = 0
    prompt_tokens: int = 0
    refused: int = 0
    failed: list[str] = field(default_factory=list)


def start_launcher(
    src: Path, work: Path, flags: list[str]
) -> tuple[subprocess.Popen[bytes], str, str]:
    """The launcher from `src`; returns it, its gRPC address and its HTTP URL."""
    keys = work / "keys"
    keys.write_text(KEY_FILE)
    log = work / "launcher.log"
    settings = {**TINY_ENGINE_KWARGS, "max_model_len": 2048}
    env = {**os.environ, "PYTHONPATH": str(src), "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
    cmd = [sys.executable, "-m", "vllm_servicer", "serve", str(ensure_tiny_model())]
    cmd += ["--host", "127.0.0.1", "--port", "0", "--http-port", "0", "--drain-grace", "0"]
    cmd += ["--api-key-file", str(keys), "--max-inflight", "16", *tiny_engine_flags(settings)]
    cmd += flags
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"launcher from {src} ended early; see {log}")
        text = log.read_text(errors="replace")
        grpc_at = re.search(r"listening on (\S+:\d+)", text)
        http_at = re.search(r"http on (http://\S+:\d+)", text)
        if grpc_at and http_at:
            return proc, grpc_at.group(1), http_at.group(1)
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"launcher from {src} did not start; see {log}")


def _prompt(length: int) -> list[int]:
    return [random.randrange(3, VOCAB) for _ in range(length)]


async def _grpc_call(
    stub: vllm_engine_pb2_grpc.VllmEngineStub, key: str, prompt: list[int], out: int, tally: Tally
) -> None:
    request = pb.GenerateRequest(
        request_id=f"fairness-{next(_ids)}",
        tokenized=pb.TokenizedInput(input_ids=prompt),
        sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True),
        stream=True,
    )
    started, first = time.perf_counter(), None
    try:
        async for message in stub.Generate(request, metadata=(("authorization", f"Bearer {key}"),)):
            if message.HasField("chunk") and message.chunk.token_ids:
                if first is None:
                    first = time.perf_counter() - started
                tally.tokens_out += len(message.chunk.token_ids)
    except grpc.aio.AioRpcError as err:
        if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            tally.refused += 1
            await asyncio.sleep(0.05)
            return
        tally.failed.append(f"{err.code().name}: {err.details()}")
        return
    if first is not None:
        tally.first_tokens.append(first)
        tally.prompt_tokens += len(prompt)


async def _http_call(
    http: httpx.AsyncClient, key: str, prompt: list[int], out: int, tally: Tally
) -> None:
    body = {"prompt": prompt, "max_tokens": out, "stream": True}
    body.update(temperature=0.0, ignore_eos=True)
    started, first = time.perf_counter(), None
    headers = {"authorization": f"Bearer {key}"}
    async with http.stream("POST", "/v1/completions", json=body, headers=headers) as answer:
        if answer.status_code in (429, 503):
            tally.refused += 1
            await asyncio.sleep(0.05)
            return
        if answer.status_code != 200:
            tally.failed.append(f"{answer.status_code}: {(await answer.aread())[:200]!r}")
            return
        async for line in answer.aiter_lines():
            if line.startswith("data: {") and first is None:
                first = time.perf_counter() - started
            if line.startswith("data: {"):
                tally.tokens_out += 1
    if first is not None:
        tally.first_tokens.append(first)
        tally.prompt_tokens += len(prompt)


async def _loop(
    call: Any, key: str, length: int, outs: tuple[int, int], until: float, tally: Tally
) -> None:
    while time.monotonic() < until:
        await call(key, _prompt(length), random.randint(*outs), tally)


async def phase(
    address: str, http_url: str, seconds: float, light: bool, heavy: str | None, use_http: bool
) -> dict[str, Tally]:
    """One phase: B's two streams when `light`, and `heavy`'s flood when given."""
    async with contextlib.AsyncExitStack() as stack:
        if use_http:
            http = await stack.enter_async_context(
                httpx.AsyncClient(base_url=http_url, timeout=120)
            )
            call: Any = lambda key, prompt, out, tally: _http_call(http, key, prompt, out, tally)  # noqa: E731
        else:
            options = [("grpc.max_send_message_length", 64 << 20)]
            channels = [
                await stack.enter_async_context(grpc.aio.insecure_channel(address, options=options))
                for _ in range(2)
            ]
            stubs = [vllm_engine_pb2_grpc.VllmEngineStub(c) for c in channels]
            call = lambda key, prompt, out, tally: _grpc_call(  # noqa: E731
                stubs[0 if key == KEYS["B"] else 1], key, prompt, out, tally
            )
        tallies: dict[str, Tally] = {}
        loops = []
        until = time.monotonic() + seconds
        if heavy is not None:
            tallies[heavy] = Tally()
            width = 12 if heavy == "C" else 8
            loops += [
                _loop(call, KEYS[heavy], LONG_PROMPT, (1, 4), until, tallies[heavy])
                for _ in range(width)
            ]
        if light:
            tallies["B"] = Tally()
            if heavy is not None:  # B comes once the flood is under way
                await asyncio.sleep(min(2.0, seconds / 5))
            loops += [
                _loop(call, KEYS["B"], SHORT_PROMPT, (16, 16), until, tallies["B"])
                for _ in range(2)
            ]
        started = time.monotonic()
        await asyncio.gather(*loops)
        for tally in tallies.values():
            tally.elapsed = time.monotonic() - started  # type: ignore[attr-defined]
        return tallies


def _ms(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return 1000 * values[min(len(values) - 1, int(q * len(values)))]


def summary(tallies: dict[str, Tally], seconds: float) -> dict[str, Any]:
    row: dict[str, Any] = {}
    b = tallies.get("B")
    if b is not None:
        row.update(
            b_ttft_p50_ms=_ms(b.first_tokens, 0.5),
            b_ttft_p99_ms=_ms(b.first_tokens, 0.99),
            b_tokens_per_s=b.tokens_out / seconds,
            b_requests=len(b.first_tokens),
            b_refused=b.refused,
        )
    for name in ("A", "C"):
        if name in tallies:
            t = tallies[name]
            row.update(
                heavy=name,
                heavy_prompt_tokens_per_s=t.prompt_tokens / seconds,
                heavy_refused=t.refused,
            )
    row["failed"] = [f for t in tallies.values() for f in t.failed][:5]
    return row


async def measure(address: str, http_url: str, seconds: float, use_http: bool) -> dict[str, Any]:
    # A warm-up, so that the first phase does not pay for the engine's first steps.
    await phase(address, http_url, 3, True, "A", use_http)
    rows = {}
    for label, light, heavy in (
        ("B alone", True, None),
        ("B + A", True, "A"),
        ("B + C", True, "C"),
        ("A alone", False, "A"),
    ):
        rows[label] = summary(
            await phase(address, http_url, seconds, light, heavy, use_http), seconds
        )
    alone = rows["B alone"]["b_ttft_p50_ms"]
    for label in ("B + A", "B + C"):
        rows[label]["b_ttft_p50_ratio"] = rows[label]["b_ttft_p50_ms"] / alone
    return rows


def print_rows(tree: str, rows: dict[str, Any]) -> None:
    print(f"\n{tree}")
    print(
        f"{'phase':<9} {'B TTFT p50':>11} {'p99':>8} {'x alone':>8} {'B tok/s':>8} "
        f"{'flood prompt tok/s':>19} {'refused':>8}"
    )
    for label, row in rows.items():
        p50 = f"{row['b_ttft_p50_ms']:.0f} ms" if "b_ttft_p50_ms" in row else "-"
        p99 = f"{row['b_ttft_p99_ms']:.0f}" if "b_ttft_p99_ms" in row else "-"
        ratio = f"{row['b_ttft_p50_ratio']:.1f}" if "b_ttft_p50_ratio" in row else "-"
        tok = f"{row['b_tokens_per_s']:.0f}" if "b_tokens_per_s" in row else "-"
        heavy = (
            f"{row['heavy_prompt_tokens_per_s']:,.0f}"
            if "heavy_prompt_tokens_per_s" in row
            else "-"
        )
        refused = str(row.get("heavy_refused", "-"))
        print(f"{label:<9} {p50:>11} {p99:>8} {ratio:>8} {tok:>8} {heavy:>19} {refused:>8}")
        if row["failed"]:
            print(f"          failed: {row['failed']}")


async def alternate(
    servers: dict[str, tuple[str, str]], seconds: float, rounds: int
) -> dict[str, list[float]]:
    """A alone on each tree's launcher in turn (A B B A ...): prompt tokens/s per phase."""
    names = list(servers)
    rates: dict[str, list[float]] = {name: [] for name in names}
    for address, http_url in servers.values():  # each engine warmed first
        await phase(address, http_url, 3, False, "A", False)
    for round_ in range(rounds):
        order = names if round_ % 2 == 0 else names[::-1]
        for name in order:
            await asyncio.sleep(1.5)  # the other engine's spinning ends first
            address, http_url = servers[name]
            tallies = await phase(address, http_url, seconds, False, "A", False)
            rates[name].append(tallies["A"].prompt_tokens / seconds)
    return rates


def run_alternating(
    trees: dict[str, Path], flags: dict[str, list[str]], seconds: float, rounds: int
) -> None:
    with contextlib.ExitStack() as stack:
        servers = {}
        for tree, src in trees.items():
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fairness-")))
            proc, address, http_url = start_launcher(src, work, flags[tree])
            stack.callback(_stop, proc)
            servers[tree] = (address, http_url)
        rates = asyncio.run(alternate(servers, seconds, rounds))
    for tree, values in rates.items():
        print(
            f"{tree:<10} A alone prompt tok/s: median {statistics.median(values):,.0f}  "
            f"({', '.join(f'{v:,.0f}' for v in values)})"
        )
    ours, theirs = (statistics.median(v) for v in rates.values())
    print(f"ratio this tree / against: {ours / theirs:.3f}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(60)
    if proc.poll() is None:
        proc.kill()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=20.0, help="each phase's length")
    parser.add_argument(
        "--against-src", help="another checkout of this project, measured after this one"
    )
    parser.add_argument(
        "--launcher-flag", action="append", default=[], help="a flag for both launchers"
    )
    parser.add_argument(
        "--this-tree-flag",
        action="append",
        default=[],
        help="a flag for this tree's launcher only (a setting the other tree lacks)",
    )
    parser.add_argument("--http", action="store_true", help="over the HTTP API instead of gRPC")
    parser.add_argument("--json", action="store_true", help="one JSON object on the last line")
    parser.add_argument(
        "--alternate", type=int, metavar="N", help="A alone only, both trees up, N rounds"
    )
    args = parser.parse_args()
    random.seed(0)
    trees = {"this tree": ROOT / "src"}
    if args.against_src:
        trees["against"] = Path(args.against_src).resolve() / "src"
    flags = {
        tree: [*args.launcher_flag, *(args.this_tree_flag if tree == "this tree" else [])]
        for tree in trees
    }
    if args.alternate:
        if len(trees) != 2:
            parser.error("--alternate needs --against-src")
        run_alternating(trees, flags, args.seconds, args.alternate)
        return 0
    results = {}
    for tree, src in trees.items():
        with tempfile.TemporaryDirectory(prefix="fairness-") as work:
            proc, address, http_url = start_launcher(src, Path(work), flags[tree])
            try:
                results[tree] = asyncio.run(measure(address, http_url, args.seconds, args.http))
            finally:
                _stop(proc)
        print_rows(f"{tree} ({src})", results[tree])
    if "against" in results:
        ours = results["this tree"]["A alone"]["heavy_prompt_tokens_per_s"]
        theirs = results["against"]["A alone"]["heavy_prompt_tokens_per_s"]
        print(f"\nA alone, prompt tokens/s, this tree / against: {ours / theirs:.2f}")
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
