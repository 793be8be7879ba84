"""Per-request budgets: how much one call may make this server spend.

The message size bounds what a request weighs on the wire, not what it
costs: an 11 KB PNG decodes to a 268 MB image, `n=10000` runs ten thousand
sequences, a 300 KB JSON schema compiles for seconds, an Abort of a million
ids holds a frontend for seconds. Each such cost has a budget here, checked
before any engine work; a request past one is refused with INVALID_ARGUMENT
naming the field and the limit, and a budget shared by the whole process
(decoded media in flight) with RESOURCE_EXHAUSTED while it is full.

`RequestBudgets` is what `MountOptions(budgets=...)` takes; each field is also a
launcher flag of the same name (`max_n` is `--max-n`), declared here once.
The checks are plain functions of grpc-free values, so each protocol's
servicer calls them on what its own messages carry.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any, ClassVar

from .errors import InvalidRequestError
from .flags import flag, flag_name

# vLLM's own cap (VLLM_MAX_N_SEQUENCES) is 16,384: n=10,000 passes it and
# runs for seconds. 128 is more than sampling-based search asks for (best-of
# and self-consistency use a few dozen) and half vLLM's default max_num_seqs
# on a GPU, so one request cannot fill the scheduler's batch alone.
DEFAULT_MAX_N = 128
# Structured-output constraints compile in the serving process (xgrammar),
# seconds per 100 KB for adversarial schemas, and differing ones miss the
# cache. 64 KiB holds the large tool-call schemas seen in practice.
DEFAULT_MAX_CONSTRAINT_BYTES = 64 * 1024
# A router aborts the streams it drops, a few at a time; a drain, all of one
# process's (bounded by --max-inflight, 1024 by default).
DEFAULT_MAX_ABORT_IDS = 1024
# The texts one Classify, Score or Rerank carries, each its own engine request
# (a rerank's candidate documents): a router's page of candidates is tens to
# hundreds; more belongs in several calls, which the in-flight limit counts.
DEFAULT_MAX_POOLING_INPUTS = 256
# The characters one pooling call gives the tokenizer, a Score's or Rerank's
# query once per text it is paired with (vLLM tokenizes each pair whole, on
# one thread every caller shares, at about a second per few MB): a page of 256
# candidates of 8,000 characters with its query, with room to spare.
DEFAULT_MAX_POOLING_CHARS = 4 * 1024 * 1024
# What one render lays out: messages, content parts, tool calls and tools of a
# chat, or prompts of a completion. Long agent conversations run to hundreds
# of messages; each item costs the template and the tokenizer on the serving
# process, with no engine step to bound it.
DEFAULT_MAX_RENDER_ITEMS = 2048
# What one render lays out in characters, every prompt or message together:
# vLLM tokenizes on one thread every caller shares (about a second per MB),
# so the sum, not only each prompt, must be bounded. A million-token context
# is about 4 MB of text: the longest one render can usefully fill.
DEFAULT_MAX_RENDER_CHARS = 4 * 1024 * 1024
# Token ids one derender turns into text: every choice's generated ids, the
# prompt ids it seeds from (a reasoning parser rescans them whole) and the
# logprob candidates, each decoded on the serving process with no engine step
# to bound it. vLLM checks each sequence against the context but not their
# sum over many choices; a 128K context with a few choices and logprobs fits.
DEFAULT_MAX_DERENDER_TOKENS = 1 << 20
# Chunks one streamed derender answers. With a tool-call or reasoning parser
# vLLM rebuilds the parser on every chunk and replays every earlier chunk
# through it (its stream state cannot hold a parser), so a stream's cost grows
# with the square of its chunks, not with its tokens: a sequence sent a token
# at a time costs thousands of times what it costs in a few chunks. An engine
# streaming every step of a 4K-token answer sends 4,096; a router with longer
# answers sends several tokens a chunk (or raises the budget).
DEFAULT_MAX_DERENDER_CHUNKS = 4096
# Tokens a streamed chat derender's chunks make vLLM replay, all together.
# With a tool-call or reasoning parser vLLM rebuilds the parser on every chunk
# and replays the whole sequence so far through it (detokenized, one parser
# step per earlier chunk), so chunk k of a sequence sent a token at a time
# costs k tokens of work and the stream sum(1..n), about n²/2. The chunk
# budget bounds that for one-token chunks only: chunks of several tokens, each
# within the context, would replay up to 4,096 times the context (4,096
# chunks of 32 tokens fill a 128K context and replay 268 M). This budget
# bounds the replay whatever the chunks, at what the chunk budget admits a
# token a chunk: sum(1..4096) = 8,390,656 tokens, a 4K-token answer streamed
# at every engine step; a 16K-token answer in chunks of 32 takes half of it.
# Measured with vLLM's pythonic and hermes parsers inside a tool call, a
# replayed token takes 20-30 µs of the tokenizer thread on an idle 2-core
# CPU, about 100 µs on a loaded one: a stream at the budget holds that thread
# for 3 to 14 minutes.
# Where tenants stream long answers, have their routers send several tokens a
# chunk (n tokens in chunks of c replay about n²/2c) and lower the budget.
DEFAULT_MAX_DERENDER_WORK = DEFAULT_MAX_DERENDER_CHUNKS * (DEFAULT_MAX_DERENDER_CHUNKS + 1) // 2
# vLLM's priority (with --scheduling-policy priority) runs lower values first:
# a tenant asking for less than another's default (0) jumps that tenant's
# queue. A tenant's requests may ask for this floor or above (only to wait
# longer, by default); routers and administrators for any.
DEFAULT_MIN_TENANT_PRIORITY = 0
# vLLM's request priority is a 32-bit integer on every protocol.
_MIN_PRIORITY = -(2**31)
_MAX_PRIORITY = 2**31 - 1
# Stop strings: vLLM matches every one against every new token's text on the
# serving event loop (1 M of them, 11 MB, stalled every other stream and the
# health Check for 5.6 s). OpenAI's API takes 4; routers and agent frameworks
# send a few dozen (turn markers, tool-call tags). 64 strings of 16 KiB in
# all leave room for those and keep the per-token scan to microseconds.
DEFAULT_MAX_STOP_STRINGS = 64
DEFAULT_MAX_STOP_BYTES = 16 * 1024
# Request ids: routers send UUIDs (36 characters) or a few joined; vLLM copies
# an id per engine request (a pooling call's per text) and to the engine core.
MAX_REQUEST_ID_CHARS = 1024
# Pillow's own decompression-bomb threshold: one such image per request.
DEFAULT_MAX_REQUEST_MEDIA_PIXELS = 89_478_485
# That many pixels decoded in a one-byte mode and converted to RGB (PIL keeps
# RGB at 4 bytes a pixel) take about 450 MB; 1 GiB leaves room for wider modes.
DEFAULT_MAX_REQUEST_MEDIA_BYTES = 1 << 30
# Four requests at the per-request budget, or hundreds of megapixel photos.
DEFAULT_MAX_MEDIA_BYTES_IN_FLIGHT = 4 << 30
# Preprocessed tensors through shared memory: a large image's pixel_values in
# float32 for a model that tiles it are tens of MB; inline ones are bounded by
# the message size instead.
DEFAULT_MAX_REQUEST_SHM_BYTES = 1 << 30

# C0 and C1 control characters and DEL: an id carrying one could reach key
# spaces built with such separators ("\0"), and breaks every log line it is in.
_CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _budget(default: int, help_text: str) -> Any:
    """A `RequestBudgets` field: its flag's help shows the default."""
    return flag(default, help=f"{help_text} (default {default})", type=int)


@dataclasses.dataclass(frozen=True)
class RequestBudgets:
    """What one request may cost, and decoded media the whole process may hold.

    Each field is the launcher flag of the same name (`--max-n`), with its help.

    Attributes:
        max_n: most sequences one VllmEngine Generate asks for (`sampling_params.n`),
            or one HTTP API request (`n`).
        max_constraint_bytes: largest structured-output constraint (JSON
            schema, regex, grammar, structural tag, all choices together), in bytes.
        max_abort_ids: most request ids one Abort names.
        max_request_media_pixels: most pixels of all one request's images together.
        max_request_media_bytes: most bytes one request's images take decoded.
        max_media_bytes_in_flight: most bytes of decoded images the process
            holds for the requests running, all together.
        max_request_shm_bytes: most bytes one request's tensors declare
            through shared memory.
        max_pooling_inputs: most texts one Classify, Score or Rerank carries
            (each is an engine request).
        max_pooling_chars: most characters one Classify, Score or Rerank gives
            the tokenizer, a query counted once per text it is paired with.
        max_render_items: most messages, content parts, tool calls and tools
            one RenderChat lays out, or prompts one RenderCompletion renders.
        max_render_chars: most characters one RenderChat or RenderCompletion
            gives the template and the tokenizer, all its prompts or messages together.
        max_derender_tokens: most token ids one DerenderChat or DerenderCompletion
            carries, or one DerenderChatStream or DerenderCompletionStream in all
            its chunks: generated ids, prompt ids and logprob candidates together.
        max_derender_chunks: most chunks one DerenderChatStream or
            DerenderCompletionStream answers.
        max_derender_work: most tokens one DerenderChatStream's chunks make
            vLLM replay in all: with a parser each chunk replays the sequence
            so far, without one it decodes its own tokens only.
        min_tenant_priority: the lowest `priority` a tenant's request may ask
            for (vLLM runs lower first); a key of the key file may have its own
            (`min_priority=`). Routers' and administrators' are not bounded.
            At most 0: a request that asks for none runs at 0.
        max_stop_strings: most stop strings one generation carries, on every
            protocol and vLLM's HTTP API.
        max_stop_bytes: most bytes of one generation's stop strings together.

    Raises:
        ValueError: a budget below 1, a priority floor outside -2**31..0, or a
            per-request media budget above the process's.
    """

    FLAG_TITLE: ClassVar[str] = (
        "vllm-servicer: per-request budgets (refused before any engine work)"
    )

    max_n: int = _budget(
        DEFAULT_MAX_N,
        "most sequences one Generate may ask for (sampling_params.n; the HTTP API's n)",
    )
    max_constraint_bytes: int = _budget(
        DEFAULT_MAX_CONSTRAINT_BYTES,
        "largest structured-output constraint in bytes (JSON schema, regex, grammar, "
        "structural tag, all choices together)",
    )
    max_abort_ids: int = _budget(
        DEFAULT_MAX_ABORT_IDS,
        "most request ids one Abort may name",
    )
    max_request_media_pixels: int = _budget(
        DEFAULT_MAX_REQUEST_MEDIA_PIXELS,
        "most pixels of all one request's images together",
    )
    max_request_media_bytes: int = _budget(
        DEFAULT_MAX_REQUEST_MEDIA_BYTES,
        "most bytes one request's images may take decoded",
    )
    max_media_bytes_in_flight: int = _budget(
        DEFAULT_MAX_MEDIA_BYTES_IN_FLIGHT,
        "most bytes of decoded images this process holds for the requests running; "
        "past it a request with images gets RESOURCE_EXHAUSTED",
    )
    max_request_shm_bytes: int = _budget(
        DEFAULT_MAX_REQUEST_SHM_BYTES,
        "most bytes one request's tensors may name in shared memory",
    )

    max_pooling_inputs: int = _budget(
        DEFAULT_MAX_POOLING_INPUTS,
        "most texts one Classify, Score or Rerank may carry (inputs, text_2, documents)",
    )

    max_pooling_chars: int = _budget(
        DEFAULT_MAX_POOLING_CHARS,
        "most characters one Classify, Score or Rerank gives the tokenizer, a query "
        "counted once per text it is paired with",
    )

    max_render_items: int = _budget(
        DEFAULT_MAX_RENDER_ITEMS,
        "most messages, content parts, tool calls and tools one RenderChat lays out "
        "(prompts of one RenderCompletion)",
    )

    max_render_chars: int = _budget(
        DEFAULT_MAX_RENDER_CHARS,
        "most characters one RenderChat or RenderCompletion gives the tokenizer, all its "
        "messages or prompts together",
    )

    max_derender_tokens: int = _budget(
        DEFAULT_MAX_DERENDER_TOKENS,
        "most token ids one DerenderChat or DerenderCompletion turns into text, or one "
        "DerenderChatStream or DerenderCompletionStream in all its chunks: generated ids, "
        "prompt ids and logprob candidates together",
    )

    max_derender_chunks: int = _budget(
        DEFAULT_MAX_DERENDER_CHUNKS,
        "most chunks one DerenderChatStream or DerenderCompletionStream answers (with a "
        "parser vLLM replays every earlier chunk on each one)",
    )

    max_derender_work: int = _budget(
        DEFAULT_MAX_DERENDER_WORK,
        "most tokens one DerenderChatStream's chunks make vLLM replay in all (with a "
        "parser each chunk replays the sequence so far: n one-token chunks replay "
        "n(n+1)/2)",
    )

    min_tenant_priority: int = _budget(
        DEFAULT_MIN_TENANT_PRIORITY,
        "lowest priority a tenant's request may ask for (lower runs first with "
        "--scheduling-policy priority; at most 0; a key file's min_priority= sets a key's "
        "own; routers and admins are not bounded)",
    )

    max_stop_strings: int = _budget(
        DEFAULT_MAX_STOP_STRINGS,
        "most stop strings one generation may carry (every protocol and the HTTP API's stop)",
    )

    max_stop_bytes: int = _budget(
        DEFAULT_MAX_STOP_BYTES,
        "most bytes of one generation's stop strings together",
    )

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "min_tenant_priority":
                check_priority_floor(flag_name(field.name), value)
            elif not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag_name(field.name)} must be at least 1, got {value!r}")
        if self.max_request_media_bytes > self.max_media_bytes_in_flight:
            raise ValueError(
                "--max-request-media-bytes must not exceed --max-media-bytes-in-flight: "
                "a request that large could never be served"
            )

    def check_n(self, field: str, n: int) -> None:
        """Refuse a request for more sequences than `max_n`."""
        if n > self.max_n:
            raise InvalidRequestError(
                field, f"{n} sequences, more than this server's budget of {self.max_n} (--max-n)"
            )

    def check_constraint(self, field: str, size: int) -> None:
        """Refuse a structured-output constraint of more than `max_constraint_bytes`."""
        if size > self.max_constraint_bytes:
            raise InvalidRequestError(
                field,
                f"{size} bytes, more than this server's budget of {self.max_constraint_bytes} "
                "bytes for a structured-output constraint (--max-constraint-bytes)",
            )

    def check_pooling_inputs(self, field: str, count: int) -> None:
        """Refuse a pooling call of more texts than `max_pooling_inputs`."""
        if count > self.max_pooling_inputs:
            raise InvalidRequestError(
                field,
                f"{count} texts, more than this server's budget of {self.max_pooling_inputs} "
                "per call (--max-pooling-inputs); send them in several calls",
            )

    def check_pooling_chars(self, field: str, count: int) -> None:
        """Refuse a pooling call that gives the tokenizer more than `max_pooling_chars`."""
        if count > self.max_pooling_chars:
            raise InvalidRequestError(
                field,
                f"{count} characters to tokenize (a query once per text), more than this "
                f"server's budget of {self.max_pooling_chars} per call (--max-pooling-chars); "
                "send fewer or shorter texts, or truncate them",
            )

    def check_render_items(self, field: str, count: int) -> None:
        """Refuse a render of more items than `max_render_items`."""
        if count > self.max_render_items:
            raise InvalidRequestError(
                field,
                f"{count} items to render, more than this server's budget of "
                f"{self.max_render_items} per call (--max-render-items)",
            )

    def check_render_chars(self, field: str, count: int) -> None:
        """Refuse a render that gives the tokenizer more than `max_render_chars`."""
        if count > self.max_render_chars:
            raise InvalidRequestError(
                field,
                f"{count} characters to render, more than this server's budget of "
                f"{self.max_render_chars} per call (--max-render-chars); send fewer or "
                "shorter prompts",
            )

    def check_derender_tokens(self, field: str, count: int) -> None:
        """Refuse a derender of more token ids than `max_derender_tokens`."""
        if count > self.max_derender_tokens:
            raise InvalidRequestError(
                field,
                f"{count} token ids to derender, more than this server's budget of "
                f"{self.max_derender_tokens} per call (--max-derender-tokens)",
            )

    def check_derender_chunks(self, field: str, count: int) -> None:
        """Refuse a derender stream's chunk past `max_derender_chunks`."""
        if count > self.max_derender_chunks:
            raise InvalidRequestError(
                field,
                f"chunk {count} of a derender stream, more than this server's budget of "
                f"{self.max_derender_chunks} per stream (--max-derender-chunks); send "
                "several token ids a chunk",
            )

    def check_derender_work(self, field: str, work: int) -> None:
        """Refuse a derender stream's chunk that takes its replayed tokens past
        `max_derender_work`."""
        if work > self.max_derender_work:
            raise InvalidRequestError(
                field,
                f"this chunk takes the tokens the stream's chunks replay to {work}, more than "
                f"this server's budget of {self.max_derender_work} per stream "
                "(--max-derender-work); with a parser each chunk replays the sequence so far: "
                "send several token ids a chunk",
            )

    def check_priority(self, field: str, priority: int, floor: int | None) -> None:
        """Refuse a `priority` below `floor` (None: any), the caller's
        (`context.priority_floor`), naming the flag that sets it; and, whoever
        asks, one outside 32 bits (vLLM's HTTP models take any integer, and
        the fair order's classes must stay within the engine's 64 bits)."""
        if not _MIN_PRIORITY <= priority <= _MAX_PRIORITY:
            raise InvalidRequestError(
                field, f"{priority} is outside {_MIN_PRIORITY}..{_MAX_PRIORITY} (32 bits)"
            )
        if floor is not None and priority < floor:
            raise InvalidRequestError(
                field,
                f"{priority} is below {floor}, the lowest this key may ask for "
                "(--min-tenant-priority, or min_priority= on the key's line of the key file): "
                "lower runs first, ahead of other tenants' requests",
            )

    def check_stop(self, field: str, stop: Sequence[str]) -> None:
        """Refuse more stop strings than `max_stop_strings`, or more than
        `max_stop_bytes` of them together (the count first: it is free)."""
        if len(stop) > self.max_stop_strings:
            raise InvalidRequestError(
                field,
                f"{len(stop)} stop strings, more than this server's budget of "
                f"{self.max_stop_strings} per request (--max-stop-strings)",
            )
        size = encoded_size(*stop)
        if size > self.max_stop_bytes:
            raise InvalidRequestError(
                field,
                f"{size} bytes of stop strings, more than this server's budget of "
                f"{self.max_stop_bytes} per request (--max-stop-bytes)",
            )

    def check_abort_ids(self, field: str, ids: Sequence[str]) -> None:
        """Refuse an Abort of more than `max_abort_ids` ids, or of an id no request can have."""
        if len(ids) > self.max_abort_ids:
            raise InvalidRequestError(
                field,
                f"{len(ids)} ids, more than this server's budget of {self.max_abort_ids} per "
                "Abort (--max-abort-ids); send them in several calls",
            )
        for index, request_id in enumerate(ids):
            check_request_id(f"{field}[{index}]", request_id)


def check_request_id(field: str, request_id: str, what: str = "request id") -> None:
    """Refuse a request id (or another id a client chooses, a `what`) with a
    control character (NUL, newline, ...) in it, or longer than `MAX_REQUEST_ID_CHARS`.

    Every id a client names that vLLM copies into its engine requests or their
    KV events meets the same rule: a session id goes into the event of every
    block the request stores, a router's cache salt and media uuids into the
    blocks' keys.
    """
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError(
            field,
            f"{len(request_id)} characters, more than the {MAX_REQUEST_ID_CHARS} a {what} may have",
        )
    found = _CONTROL_CHARACTERS.search(request_id)
    if found is not None:
        raise InvalidRequestError(
            field,
            f"has the control character {found.group()!r} at position {found.start()}; "
            f"{what}s take printable characters only",
        )


def check_priority_floor(where: str, floor: object) -> int:
    """`floor` as a priority floor (an int from -2**31 to 0), else ValueError naming `where`.

    Above 0, a request that asks for no priority (0) would be below it.
    """
    if not isinstance(floor, int) or isinstance(floor, bool) or not _MIN_PRIORITY <= floor <= 0:
        raise ValueError(f"{where} must be an integer from {_MIN_PRIORITY} to 0, got {floor!r}")
    return floor


def encoded_size(*texts: str) -> int:
    """The UTF-8 size of `texts` together, as they came on the wire."""
    return sum(len(text.encode()) for text in texts)
