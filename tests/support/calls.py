"""What a test sends and reads: GenerateRequests, and the messages a call answered with."""

from __future__ import annotations

import asyncio
import itertools
import random
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from vllm_servicer.proto import vllm_engine_pb2 as pb

DetailT = TypeVar("DetailT", bound=Message)

_ids = itertools.count(1)


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


def unique_prompt(length: int) -> list[int]:
    """`length` random token ids: prompts that share no prefix-cache block."""
    return [random.randrange(3, 300) for _ in range(length)]


async def collect(call: Any) -> list[Any]:
    """Every message of a streaming call."""
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


async def next_kv_event(call: Any, kind: str, timeout: float = 20.0) -> tuple[Any, Any]:
    """The next (batch, event) of the given kind ("stored", "removed", "cleared")
    a SubscribeKvEvents stream carries."""

    async def scan() -> tuple[Any, Any]:
        while True:
            batch = await call.read()
            assert batch is not grpc.aio.EOF
            for event in batch.events:
                if event.WhichOneof("data") == kind:
                    return batch, event

    return await asyncio.wait_for(scan(), timeout)


# ----- a refusal's details ------------------------------------------------------------


def status_of(err: grpc.aio.AioRpcError) -> status_pb2.Status:
    """The google.rpc.Status a failed call carries in its trailers."""
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None, "no google.rpc.Status in the trailers"
    return status


def detail(status: status_pb2.Status, kind: type[DetailT]) -> DetailT | None:
    """The detail of `kind` (ErrorInfo, BadRequest, RetryInfo, ...) in `status`, if any."""
    for packed in status.details:
        if packed.Is(kind.DESCRIPTOR):
            found = kind()
            packed.Unpack(found)
            return found
    return None


def error_info(err: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo:
    """The ErrorInfo of a failed call (its reason, domain and metadata); it must have one."""
    info = detail(status_of(err), error_details_pb2.ErrorInfo)
    assert info is not None, "no ErrorInfo in the status details"
    return info
