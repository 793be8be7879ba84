"""The load generator of ``benchmarks/seed.py``: gRPC and HTTP bursts, one JSON line each.

    python benchmarks/seed_client.py [--cpu N]

Reads one JSON command per line on stdin and writes one JSON reply per line on
stdout, as ``loadgen.py --serve-stdin`` does (it is that loop). The target
names the protocol:

- ``HOST:PORT``: vLLM's gRPC protocol (``vllm.grpc.engine.VllmEngine``), driven
  by ``loadgen.Client`` with the reference stubs;
- ``http://HOST:PORT``: vLLM's OpenAI HTTP API, ``/v1/completions`` with
  ``stream: true``, token-id prompts and ``return_token_ids``.

Both send the same requests (``loadgen.make_prompt`` prompts, greedy,
``max_tokens`` with ``ignore_eos``), check every request's output token count
and finish reason, and time them with ``loadgen.Recorder``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import loadgen  # noqa: E402

_burst_summary = loadgen.summarize


def summarize(spec: loadgen.BurstSpec, rec: loadgen.Recorder, wall: float) -> dict[str, Any]:
    """loadgen's burst summary plus TTFT p90 and spread, requests/s and what was checked."""

    def ms(seconds: float | None) -> float | None:
        return None if seconds is None else round(seconds * 1000, 3)

    spread = statistics.pstdev(rec.ttft) if len(rec.ttft) > 1 else 0.0 if rec.ttft else None
    return _burst_summary(spec, rec, wall) | {
        "requests": spec.requests,
        "requests_per_s": round(spec.requests / wall, 3) if wall > 0 else 0.0,
        "ttft_p90_ms": ms(loadgen._percentile(rec.ttft, 90)),
        "ttft_std_ms": ms(spread),
        # Every request's count went through Recorder.request_done; these failed it.
        "checked_requests": spec.requests,
        "expected_tokens_per_request": rec.expected_tokens,
    }


# loadgen.Client.run summarises through this module-level name: replacing it adds
# the figures above to the gRPC bursts without a second copy of the gRPC client.
loadgen.summarize = summarize


class HttpClient:
    """Streams ``/v1/completions`` from vLLM's OpenAI server; one session, kept open."""

    def __init__(self) -> None:
        self._session: Any = None
        self._models: dict[str, str] = {}

    def session(self) -> Any:
        import aiohttp

        if self._session is None:
            # No pool limit: the burst's concurrency is the only limit on connections.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=None, sock_read=600),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def health(self, target: str) -> bool:
        """True once /health answers 200 and /v1/models names the model served."""
        try:
            async with self.session().get(f"{target}/health") as reply:
                if reply.status != 200:
                    return False
            async with self.session().get(f"{target}/v1/models") as reply:
                self._models[target] = (await reply.json())["data"][0]["id"]
        except Exception:
            return False
        return True

    def body(self, spec: loadgen.BurstSpec, model: str) -> dict[str, Any]:
        return {
            "model": model,
            "prompt": loadgen.make_prompt(spec.prompt_len),
            "max_tokens": spec.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
            "stream_options": {"include_usage": True},
        }

    async def one(self, spec: loadgen.BurstSpec, model: str, rec: loadgen.Recorder) -> None:
        """One streamed request: arrivals per event with tokens, its count and finish checked."""
        arrivals: list[tuple[float, int]] = []
        total, finish, note = 0, None, ""
        sent = time.perf_counter()
        try:
            url = f"{spec.target}/v1/completions"
            async with self.session().post(url, json=self.body(spec, model)) as reply:
                if reply.status != 200:
                    note = f"HTTP {reply.status}: {(await reply.text())[:150]}"
                async for raw in reply.content:
                    if not raw.startswith(b"data: {"):
                        continue  # blank separators and "data: [DONE]"
                    event = json.loads(raw[6:])
                    for choice in event.get("choices") or ():
                        n = len(choice.get("token_ids") or ())
                        if n:
                            total += n
                            arrivals.append((time.perf_counter(), n))
                        finish = choice.get("finish_reason") or finish
                    usage = event.get("usage")
                    if usage and usage["completion_tokens"] != total:
                        note = f"usage says {usage['completion_tokens']} tokens, got {total} ids"
        except Exception as exc:  # counted, never fatal to the burst
            note = f"{type(exc).__name__}: {exc}"[:200]
        if not note and finish != "length":
            note = f"finish_reason={finish!r}"
        rec.request_done(sent, arrivals, total, note)

    async def run(self, spec: loadgen.BurstSpec) -> dict[str, Any]:
        """Runs one burst, `spec.concurrency` requests in flight, and returns its summary."""
        model = self._models.get(spec.target)
        if model is None and not await self.health(spec.target):
            raise RuntimeError(f"{spec.target} is not serving")
        model = self._models[spec.target]
        rec = loadgen.Recorder(expected_tokens=spec.max_tokens)
        queue = iter(range(spec.requests))

        async def worker() -> None:
            for _ in queue:
                await self.one(spec, model, rec)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(spec.concurrency, spec.requests))))
        return summarize(spec, rec, time.perf_counter() - started)


class Client:
    """loadgen's gRPC client and the HTTP client behind one face, chosen by the target."""

    def __init__(self, grpc_connections: int = 1) -> None:
        self.grpc = loadgen.Client(connections=grpc_connections)
        self.http = HttpClient()

    def _for(self, target: str) -> Any:
        return self.http if target.startswith("http://") else self.grpc

    async def health(self, target: str) -> bool:
        return bool(await self._for(target).health(target))

    async def run(self, spec: loadgen.BurstSpec) -> dict[str, Any]:
        return dict(await self._for(spec.target).run(spec))

    async def close(self) -> None:
        await self.grpc.close()
        await self.http.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", type=int, default=-1, help="core to pin to (-1: no pinning)")
    parser.add_argument(
        "--grpc-connections", type=int, default=1, help="gRPC connections per server"
    )
    args = parser.parse_args()
    loadgen.pin_to_cpu(args.cpu)
    # loadgen's stdin loop only asks its client for health(target), run(spec) and close().
    serve: Any = loadgen._serve_stdin(Client(args.grpc_connections))  # type: ignore[arg-type]
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve)
    else:
        uvloop.run(serve)


if __name__ == "__main__":
    main()
