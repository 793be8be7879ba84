"""Helpers shared by the tests: requests, engine probes, response digests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from vllm_servicer import mount
from vllm_servicer.proto import vllm_engine_pb2 as pb
from vllm_servicer.testing.tiny_model import build_tiny_engine


def build_engine(model_dir: Path, **overrides: Any) -> Any:
    """A real AsyncLLM on a tiny model directory."""
    return build_tiny_engine(model_dir, **overrides)


def unfinished(engine: Any) -> int:
    """Requests the engine still holds (vLLM 0.32: the output processor's count)."""
    return int(engine.output_processor.get_num_unfinished_requests())


async def wait_until_idle(engine: Any, timeout: float = 10.0) -> int:
    """Poll until the engine holds no request; return what is left at the timeout."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while unfinished(engine) and loop.time() < deadline:  # noqa: ASYNC110 - the engine has no event to wait on
        await asyncio.sleep(0.05)
    return unfinished(engine)


_ids = iter(range(1, 1_000_000))


def request(
    prompt: list[int] | str = (5, 17, 42, 99, 7, 63, 21, 88),  # type: ignore[assignment]
    *,
    stream: bool = False,
    request_id: str | None = None,
    **sampling: Any,
) -> pb.GenerateRequest:
    """A GenerateRequest; greedy (temperature 0) unless told otherwise."""
    sampling.setdefault("temperature", 0.0)
    sampling.setdefault("max_tokens", 8)
    choice = sampling.pop("choice", None)
    params = pb.SamplingParams(**sampling)
    if choice is not None:
        params.choice.choices.extend(choice)
    rid = request_id or f"test-{next(_ids)}"
    if isinstance(prompt, str):
        return pb.GenerateRequest(
            request_id=rid, text=prompt, sampling_params=params, stream=stream
        )
    return pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(input_ids=list(prompt)),
        sampling_params=params,
        stream=stream,
    )


async def collect(call: Any) -> list[Any]:
    return [message async for message in call]


def completes(messages: list[Any]) -> dict[int, Any]:
    """The `complete` message of each choice index."""
    return {
        m.complete.index: m.complete for m in messages if m.WhichOneof("response") == "complete"
    }


def streamed_tokens(messages: list[Any]) -> dict[int, list[int]]:
    """Tokens accumulated from the chunks of each choice index."""
    out: dict[int, list[int]] = {}
    for m in messages:
        if m.WhichOneof("response") == "chunk":
            out.setdefault(m.chunk.index, []).extend(m.chunk.token_ids)
    return out


@contextlib.asynccontextmanager
async def mounted_channel(engine: Any, **mount_options: Any) -> AsyncIterator[grpc.aio.Channel]:
    """`engine` mounted on a server of its own on loopback, and a channel to it."""
    server = grpc.aio.server()
    mounted = mount(server, engine, **mount_options)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel
    finally:
        if mounted.health is not None:
            await mounted.health.close()  # a Watch stream would hold the stop to its grace
        await server.stop(None)
