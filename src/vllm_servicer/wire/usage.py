"""What one engine call asked for and sent: the request's summary, tokens,
their times, finish reasons.

The servicer states what the request asks for (`RequestSummary`, in no
protocol's terms) as its handler begins, and tracing reads that instead of
the request message. The Generate handler keeps this record as it sends, from the plain integers it
builds each message from. The metrics and tracing interceptors read it when
they report (metrics once a second while the call runs, both at its end)
instead of each reading every message back: a protobuf field read allocates,
and a hook per message per interceptor cost more than relaying the message.

A handler that keeps no record (another implementation of the protocol) is
read from its messages instead (`read_message`), at that higher cost.

Pure data: no grpc, no vLLM, no protocol module.
"""

from __future__ import annotations

import dataclasses
from time import perf_counter
from typing import Any


@dataclasses.dataclass(frozen=True, slots=True)
class RequestSummary:
    """What one engine request asks for, whichever protocol carried it.

    Attributes:
        operation: the GenAI operation: "text_completion" or "embeddings".
        request_id: the request id as the client sent it ("": none).
        max_tokens: the most output tokens per choice; None: not set.
        temperature: None: not set.
        top_p: None: not set (1).
        n: the choices asked for.
    """

    operation: str
    request_id: str = ""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1


class GenerationUsage:
    """One engine call's record: its request's summary and the running totals of its responses."""

    __slots__ = (
        "embedding_dim",
        "finish_reasons",
        "first_token_at",
        "kept",
        "owner",
        "last_token_at",
        "messages",
        "output_tokens",
        "prompt_tokens",
        "request",
        "streamed",
        "tokens_after_first",
    )

    def __init__(self, owner: object = None) -> None:
        self.owner = owner  # the task of the call it belongs to
        self.kept = False  # the handler keeps it; else it is read from the messages
        self.request: RequestSummary | None = None  # None: the handler stated none
        self.prompt_tokens = -1  # -1: not known yet
        self.output_tokens = 0
        self.messages = 0
        self.streamed = False  # chunks were sent: the completes repeat their tokens
        # time.perf_counter() when the first message with output tokens left
        # (0.0: none yet) and the last; the tokens sent after the first one.
        self.first_token_at = 0.0
        self.last_token_at = 0.0
        self.tokens_after_first = 0
        self.finish_reasons: dict[int, str] = {}  # choice index -> finish_reason
        self.embedding_dim = 0  # Embed: the vector's size (0: none sent)

    def chunk_sent(self, tokens: int) -> None:
        """A streamed chunk with `tokens` new output tokens left."""
        self.messages += 1
        self.streamed = True
        if tokens:
            now = perf_counter()
            if self.first_token_at:
                self.tokens_after_first += tokens
            else:
                self.first_token_at = now
            self.last_token_at = now
            self.output_tokens += tokens

    def choice_finished(self, index: int, reason: str, tokens: int) -> None:
        """A choice's complete message left, carrying `tokens` output tokens.

        Streamed, those repeat the last chunk's (counted then); not streamed,
        they are all of the choice's.
        """
        self.messages += 1
        self.finish_reasons[index] = reason
        if tokens and not self.streamed:
            now = perf_counter()
            if not self.first_token_at:
                self.first_token_at = now
            self.last_token_at = now
            self.output_tokens += tokens


class UsageReader:
    """One interceptor's view of a Generate call's usage.

    The handler's record when it keeps one; else a record of the reader's
    own, filled from the messages (`read`): two readers of one call never
    fill the same record twice.
    """

    __slots__ = ("own", "usage")

    def __init__(self, usage: GenerationUsage) -> None:
        self.usage = usage  # the call's shared record (`context.shared_usage()`)
        self.own = False

    @property
    def reads_messages(self) -> bool:
        """Whether the messages must be read: the handler keeps no record."""
        return not self.usage.kept

    def read(self, message: Any) -> None:
        """A response message, read only when the handler keeps no record."""
        if self.usage.kept:
            return
        if not self.own:
            self.usage = GenerationUsage()
            self.own = True
        read_message(self.usage, message)


def read_message(usage: GenerationUsage, message: Any) -> None:
    """Fold one GenerateResponse into `usage` (for a handler that keeps no record)."""
    kind = message.WhichOneof("response")
    if kind is None:  # neither: still a message sent
        usage.messages += 1
    elif kind == "chunk":
        chunk = message.chunk
        if usage.prompt_tokens < 0:
            usage.prompt_tokens = chunk.prompt_tokens
        usage.chunk_sent(len(chunk.token_ids))
    elif kind == "complete":
        done = message.complete
        if usage.prompt_tokens < 0:
            usage.prompt_tokens = done.prompt_tokens
        usage.choice_finished(done.index, done.finish_reason, len(done.output_ids))
