"""Load generator for vLLM's gRPC protocol (`vllm.grpc.engine.VllmEngine`).

Uses the reference stubs (`smg_grpc_proto.generated`), so the same client drives
any server of the protocol. Every request asks for a fixed number of tokens
(`max_tokens`, `ignore_eos`, greedy), so every server does the same work, and
every request's token count is checked.

Two ways to run it:

- one burst: ``python benchmarks/loadgen.py --target 127.0.0.1:50051 -c 64 -n 256``
  prints one JSON result;
- ``--serve-stdin``: reads one JSON burst spec per line on stdin and writes one
  JSON result per line on stdout (what ``benchmarks/run.py`` does, so channels
  stay open between bursts).

The metric helpers (`Recorder`, `summarize`, `make_prompt`) are shared with the
in-process ceiling (``benchmarks/ceiling.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

VOCAB_LOW = 3  # skips <pad>, <s>, </s> of the tiny model
VOCAB_HIGH = 300  # below the tiny model's vocabulary size (~320)


@dataclass
class BurstSpec:
    """One burst: `requests` requests, `concurrency` in flight at a time."""

    concurrency: int
    requests: int
    stream: bool = True
    prompt_len: int = 8
    max_tokens: int = 64
    target: str = ""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BurstSpec:
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in data.items() if k in names})


_prompt_counter = 0


def make_prompt(length: int, vocab_high: int = VOCAB_HIGH) -> list[int]:
    """A prompt of `length` token ids, unique per call (so no prefix-cache hits).

    The first two ids encode a process-wide counter; the rest is a fixed
    pseudo-random sequence.
    """
    global _prompt_counter
    span = vocab_high - VOCAB_LOW
    n = _prompt_counter
    _prompt_counter += 1
    head = [VOCAB_LOW + n % span, VOCAB_LOW + (n // span) % span]
    body = [VOCAB_LOW + (i * 7919 + 13) % span for i in range(max(0, length - 2))]
    return (head + body)[:length]


@dataclass
class Recorder:
    """Timings of the requests of one burst."""

    expected_tokens: int
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    tokens: int = 0
    messages: int = 0
    bad: list[str] = field(default_factory=list)

    def request_done(
        self, sent: float, arrivals: list[tuple[float, int]], total_tokens: int, note: str = ""
    ) -> None:
        """Records one request: send time, (arrival time, tokens) per message, token count."""
        self.messages += len(arrivals)
        self.tokens += total_tokens
        if total_tokens != self.expected_tokens or note:
            self.bad.append(note or f"got {total_tokens} tokens, expected {self.expected_tokens}")
        timed = [(t, n) for t, n in arrivals if n]
        if timed:
            self.ttft.append(timed[0][0] - sent)
        if arrivals:
            self.latency.append(arrivals[-1][0] - sent)
        for (before, _), (t, n) in zip(timed, timed[1:], strict=False):
            gap = (t - before) / n  # a message of n tokens counts as n gaps
            self.itl.extend([gap] * n)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(spec: BurstSpec, rec: Recorder, wall: float) -> dict[str, Any]:
    """The JSON result of one burst (times in milliseconds)."""

    def ms(values: list[float], q: float) -> float | None:
        p = _percentile(values, q)
        return None if p is None else round(p * 1000, 3)

    return {
        "spec": spec.__dict__,
        "wall_s": round(wall, 4),
        "output_tokens": rec.tokens,
        "messages": rec.messages,
        "tokens_per_s": round(rec.tokens / wall, 1) if wall > 0 else 0.0,
        "ttft_p50_ms": ms(rec.ttft, 50),
        "ttft_p90_ms": ms(rec.ttft, 90),
        "ttft_p99_ms": ms(rec.ttft, 99),
        "itl_p50_ms": ms(rec.itl, 50),
        "itl_p90_ms": ms(rec.itl, 90),
        "itl_p99_ms": ms(rec.itl, 99),
        "latency_p50_ms": ms(rec.latency, 50),
        "errors": len(rec.bad),
        "error_samples": rec.bad[:3],
    }


class Client:
    """Drives servers with the reference stubs; `connections` channels per target
    (each its own TCP connection), kept open, the burst's workers spread over them."""

    def __init__(self, api_key: str | None = None, connections: int = 1) -> None:
        self._connections = max(1, connections)
        from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

        self._pb = vllm_engine_pb2
        self._grpc = vllm_engine_pb2_grpc
        self._stubs: dict[str, Any] = {}
        self._channels: list[Any] = []
        self._burst = 0
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None

    def _stub(self, target: str, worker: int = 0) -> Any:
        import grpc

        key = f"{target}#{worker % self._connections}"
        stub = self._stubs.get(key)
        if stub is None:
            options = [
                ("grpc.max_receive_message_length", 64 * 1024 * 1024),
                # Polled while the server starts: retry the connection every second,
                # not after gRPC's default backoff (up to two minutes).
                ("grpc.initial_reconnect_backoff_ms", 500),
                ("grpc.max_reconnect_backoff_ms", 1000),
                # A connection of its own: channels to one target share one by default.
                ("grpc.use_local_subchannel_pool", 1),
            ]
            channel = grpc.aio.insecure_channel(target, options=options)
            self._channels.append(channel)
            stub = self._stubs[key] = self._grpc.VllmEngineStub(channel)
        return stub

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()

    async def health(self, target: str, timeout: float = 2.0) -> bool:
        """True once the server answers HealthCheck with healthy=True."""
        try:
            reply = await self._stub(target).HealthCheck(
                self._pb.HealthCheckRequest(), timeout=timeout, metadata=self._metadata
            )
        except Exception:
            return False
        return bool(reply.healthy)

    async def run(self, spec: BurstSpec) -> dict[str, Any]:
        """Runs one burst and returns its summary."""
        pb = self._pb
        self._burst += 1
        tag = f"b{os.getpid()}-{self._burst}"
        requests = [
            pb.GenerateRequest(
                request_id=f"{tag}-{i}",
                tokenized=pb.TokenizedInput(input_ids=make_prompt(spec.prompt_len)),
                sampling_params=pb.SamplingParams(
                    temperature=0.0, max_tokens=spec.max_tokens, ignore_eos=True
                ),
                stream=spec.stream,
            )
            for i in range(spec.requests)
        ]
        rec = Recorder(expected_tokens=spec.max_tokens)
        clock = time.perf_counter
        queue = iter(requests)

        async def worker(index: int) -> None:
            stub = self._stub(spec.target, index)
            for request in queue:
                arrivals: list[tuple[float, int]] = []
                total = 0
                note = ""
                sent = clock()
                try:
                    async for response in stub.Generate(request, metadata=self._metadata):
                        if response.HasField("chunk"):
                            n = len(response.chunk.token_ids)
                            total += n
                            arrivals.append((clock(), n))
                        else:
                            complete = response.complete
                            if not spec.stream:
                                n = len(complete.output_ids)
                                total += n
                                arrivals.append((clock(), n))
                            if complete.finish_reason != "length":
                                note = f"finish_reason={complete.finish_reason!r}"
                except Exception as exc:  # counted, never fatal to the burst
                    note = f"{type(exc).__name__}: {exc}"[:200]
                rec.request_done(sent, arrivals, total, note)

        started = clock()
        await asyncio.gather(*(worker(i) for i in range(min(spec.concurrency, spec.requests))))
        return summarize(spec, rec, clock() - started)


def pin_to_cpu(cpu: int) -> bool:
    """Pins this process to one core when it exists; returns whether it did."""
    if cpu < 0 or not hasattr(os, "sched_setaffinity"):
        return False
    if cpu not in os.sched_getaffinity(0):
        return False
    os.sched_setaffinity(0, {cpu})
    return True


async def stdin_commands() -> AsyncIterator[dict[str, Any]]:
    """The JSON commands a driving process writes to this one's stdin, one a line."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        yield json.loads(line)


async def _serve_stdin(client: Client) -> None:
    async for command in stdin_commands():
        op = command.get("op", "burst")
        if op == "quit":
            break
        if op == "health":
            reply: dict[str, Any] = {"healthy": await client.health(command["target"])}
        else:
            reply = await client.run(BurstSpec.from_dict(command))
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
    await client.close()


async def _main(args: argparse.Namespace) -> None:
    client = Client(args.api_key)
    if args.serve_stdin:
        await _serve_stdin(client)
        return
    spec = BurstSpec(
        concurrency=args.concurrency,
        requests=args.requests,
        stream=not args.no_stream,
        prompt_len=args.prompt_len,
        max_tokens=args.max_tokens,
        target=args.target,
    )
    try:
        print(json.dumps(await client.run(spec), indent=2))
    finally:
        await client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve-stdin", action="store_true", help="JSON bursts on stdin")
    parser.add_argument("--target", default="127.0.0.1:50051")
    parser.add_argument("-c", "--concurrency", type=int, default=64)
    parser.add_argument("-n", "--requests", type=int, default=256)
    parser.add_argument("--no-stream", action="store_true")
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--cpu", type=int, default=1, help="core to pin to (-1: no pinning)")
    parser.add_argument("--api-key", help="sent as `authorization: Bearer <key>` on every call")
    args = parser.parse_args()
    pin_to_cpu(args.cpu)
    try:
        import uvloop
    except ImportError:
        asyncio.run(_main(args))
    else:
        uvloop.run(_main(args))


if __name__ == "__main__":
    main()
