"""The usage record of a Generate call, kept by the handler or read from its messages."""

from __future__ import annotations

import asyncio

from vllm_servicer import context
from vllm_servicer.proto import vllm_engine_pb2 as pb
from vllm_servicer.wire import usage


def _chunk(*tokens: int) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        chunk=pb.GenerateStreamChunk(
            token_ids=tokens, prompt_tokens=5, completion_tokens=len(tokens)
        )
    )


def _complete(reason: str, *tokens: int, index: int = 0) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        complete=pb.GenerateComplete(
            output_ids=tokens, finish_reason=reason, prompt_tokens=5, index=index
        )
    )


def test_a_stream_counts_its_chunks_tokens_and_not_the_completes_repeat() -> None:
    record = usage.GenerationUsage()
    for message in (_chunk(1), _chunk(), _chunk(2, 3), _complete("length", 2, 3)):
        usage.read_message(record, message)
    assert record.prompt_tokens == 5
    assert record.output_tokens == 3
    assert record.messages == 4
    assert record.streamed
    assert record.tokens_after_first == 2
    assert 0 < record.first_token_at <= record.last_token_at
    assert record.finish_reasons == {0: "length"}


def test_a_unary_generate_counts_each_choices_complete() -> None:
    record = usage.GenerationUsage()
    usage.read_message(record, _complete("stop", 1, 2, index=1))
    usage.read_message(record, _complete("length", 3, 4, 5, index=0))
    assert record.output_tokens == 5
    assert not record.streamed
    assert record.tokens_after_first == 0  # no time per token without a stream
    assert record.first_token_at > 0
    assert record.finish_reasons == {0: "length", 1: "stop"}


def test_a_chunk_without_tokens_sets_no_first_token_time() -> None:
    record = usage.GenerationUsage()
    record.chunk_sent(0)
    assert record.messages == 1 and record.first_token_at == 0.0


async def test_each_call_has_its_own_record_shared_by_its_readers_and_handler() -> None:
    async def one_call() -> tuple[usage.GenerationUsage, usage.GenerationUsage | None]:
        first = context.shared_usage()
        assert context.shared_usage() is first  # a second reader of the same call
        await asyncio.sleep(0)  # the other call runs meanwhile
        return first, context.kept_usage()

    (a, a_kept), (b, b_kept) = await asyncio.gather(
        asyncio.create_task(one_call()), asyncio.create_task(one_call())
    )
    assert a is not b
    assert a_kept is a and b_kept is b and a.kept and b.kept


async def test_the_handler_keeps_nothing_when_nothing_reads() -> None:
    async def call() -> usage.GenerationUsage | None:
        return context.kept_usage()

    assert await asyncio.create_task(call()) is None


async def test_a_record_copied_into_another_tasks_context_is_not_its_own() -> None:
    # A task's context starts as a copy of its creator's: a record there
    # belongs to the creator's call, not to the new one.
    outer = context.shared_usage()

    async def inner() -> tuple[usage.GenerationUsage | None, usage.GenerationUsage]:
        kept = context.kept_usage()
        return kept, context.shared_usage()

    kept, own = await asyncio.create_task(inner())
    assert kept is None and not outer.kept
    assert own is not outer
