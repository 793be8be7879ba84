"""The engine's work shared by what each tenant brings: tokens, not calls.

A call that brings a 1,800-token prompt and one that brings 16 are not the
same work, yet fair shares of calls (`shares.py`) count them alike: a tenant
inside its share of calls can fill the engine's queue with long prompts, and
every other tenant's first token waits behind them. The rule here is the
Virtual Token Counter's (Sheng et al., "Fairness in Serving Large Language
Models", OSDI 2024), kept as start-time fair queueing tags so that vLLM's own
priority scheduler applies it:

- each tenant has a counter of the work it has been served, in virtual
  tokens: a prompt token costs `PROMPT_TOKEN_PRICE`, an output token
  `OUTPUT_TOKEN_PRICE`, divided by the tenant's weight (a key file's
  `weight=`);
- a request is tagged, when it arrives, at its tenant's counter or at the
  engine's frontier (the tag of the latest request the engine started),
  whichever is later, plus its own prompt's cost; the counter moves to that
  tag, and on by each output token as it is generated;
- vLLM runs the lowest tag first (`--scheduling-policy priority`): a tenant
  that brought little since it was last busy is tagged at the frontier and
  goes ahead of a backlogged tenant's queue, whose tags run ahead of it by
  the work it has queued. Nothing waits while the engine has room: the tags
  order the queue and never hold a request back (work-conserving), and a
  tenant alone is served in arrival order, as before.

A client's own `priority` keeps vLLM's meaning across tenants: it picks a
class (`CLASS_SPAN` virtual tokens apart), and the tags order each class.
With the floor every tenant's priority has (`--min-tenant-priority`, 0 by
default), a tenant can only put its own requests behind.

The counters and the frontier live in a `TagBook`: this process's
(`LocalTagBook`) or the shared memory of the frontend processes of
`--api-server-count` (`frontends.TagRecords`), so that the tags of every
process are on one scale. No grpc and no vLLM here.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

from .shares import FairShares, find_record, record_key

__all__ = [
    "CLASS_SPAN",
    "OUTPUT_TOKEN_PRICE",
    "PROMPT_TOKEN_PRICE",
    "SCHEDULER_NAME",
    "SHARED_HOLD_SECONDS",
    "SHARED_STEP_TOKENS",
    "SHARED_STEP_TOKENS_ENV",
    "TENANT_ARG",
    "FairOrder",
    "LocalTagBook",
    "QueuedPrompts",
    "TagBook",
    "TagRecord",
    "TagRecords",
    "TenantWork",
    "WorkTicket",
    "WorkTotals",
]

PROMPT_TOKEN_PRICE = 1.0
"""A prompt token's cost in virtual tokens: prefill runs many tokens per step."""

OUTPUT_TOKEN_PRICE = 2.0
"""An output token's: one a step per sequence (the VTC paper's prices)."""

CLASS_SPAN = 2**31
"""Virtual tokens between two client priorities: a class ahead outranks every
tag of the classes behind it for 2**31 tokens of the engine's work (about
eight hours of a CPU's prefill, weeks of a GPU's output), after which a
request long queued in a lower class is served before newer ones in a higher
(no class starves for ever). With 32-bit priorities the engine's priority stays
within 64 bits."""


SCHEDULER_NAME = "vllm_servicer.fair_steps.FairStepScheduler"
"""What vLLM's `scheduler_cls` names to load `fair_steps`' scheduler in the engine's process."""

SHARED_STEP_TOKENS_ENV = "VLLM_SERVICER_SHARED_STEP_TOKENS"
"""Where the engine's process reads the shared step's budget (vLLM's configuration
has no field of ours; the launcher's --shared-step-tokens sets it)."""

TENANT_ARG = "vllm_servicer_tenant"
"""The key of a request's `SamplingParams.extra_args` that names its tenant
for the engine's scheduler (`fair_steps`): the key's name, "" for callers
without one and administrators. Set by the mount's engine on every request;
a client's own value is replaced."""

SHARED_STEP_TOKENS = 192
"""A shared step's token budget (`fair_steps`): about 2 ms of prefill of the
tiny model on a 2-core CPU, a small part of a GPU's step. 128 shortened a
light tenant's wait a little more and cost the heavy ones a third of their
prefill while it ran; 256 left the light one's wait at up to twice its own."""

SHARED_HOLD_SECONDS = 0.25
"""How long steps stay short after the last light request (`fair_steps`): a
light tenant's next request is then not stuck behind a long step."""


class TagBook(Protocol):
    """Where the tags' counters live: each tenant's, and the engine's frontier.

    A book shared by processes is read and written under their lock, which
    `FairOrder` holds around each of its steps.
    """

    def frontier(self) -> float:
        """The tag of the latest request the engine started (virtual tokens)."""
        ...

    def advance(self, tag: float) -> None:
        """The engine started a request tagged `tag`: the frontier moves up to it."""
        ...

    def counter(self, name: str) -> float:
        """`name`'s counter: the tag its next request starts from, at least."""
        ...

    def set_counter(self, name: str, value: float) -> None:
        """`name`'s counter is now `value`."""
        ...


class LocalTagBook:
    """A `TagBook` in this process's memory.

    A counter at or behind the frontier says no more than the frontier does,
    so such counters are forgotten: the book holds the tenants with work
    queued ahead of the frontier only.
    """

    def __init__(self) -> None:
        self._frontier = 0.0
        self._counters: dict[str, float] = {}

    def frontier(self) -> float:
        return self._frontier

    def advance(self, tag: float) -> None:
        if tag <= self._frontier:
            return
        self._frontier = tag
        if len(self._counters) > 64:
            self._counters = {k: v for k, v in self._counters.items() if v > tag}

    def counter(self, name: str) -> float:
        return self._counters.get(name, 0.0)

    def set_counter(self, name: str, value: float) -> None:
        self._counters[name] = value


class TagRecord(ctypes.Structure):
    """One tenant's counter in shared memory (`TagRecords`)."""

    _fields_ = [("key", ctypes.c_uint64), ("counter", ctypes.c_double)]


def _tag_key(name: str) -> int:
    return record_key(name, b"fair-tags")


class TagRecords:
    """A `TagBook` in the shared memory of the frontend processes
    (`frontends.FrontendGroup.tag_book`): the frontier, and one record per
    tenant whose counter runs ahead of it, kept at the front of a fixed array.

    When the array is full, the counter nearest the frontier is forgotten
    first: its tenant's next request starts from the frontier, a little early.
    Callers hold the group's lock around every method.
    """

    def __init__(self, records: Any, used: Any, frontier: Any) -> None:
        self._records = records
        self._used = used
        self._frontier = frontier

    def frontier(self) -> float:
        return float(self._frontier.value)

    def advance(self, tag: float) -> None:
        if tag <= self._frontier.value:
            return
        self._frontier.value = tag
        records, used = self._records, self._used
        i = 0
        while i < used.value:
            if records[i].counter <= tag:
                used.value -= 1
                records[i] = records[used.value]
            else:
                i += 1

    def counter(self, name: str) -> float:
        record = find_record(self._records, self._used, _tag_key(name))
        return 0.0 if record is None else float(record.counter)

    def set_counter(self, name: str, value: float) -> None:
        key = _tag_key(name)
        record = find_record(self._records, self._used, key)
        if record is None:
            records, used = self._records, self._used
            if used.value == len(records):
                nearest = min(range(used.value), key=lambda i: records[i].counter)
                record = records[nearest]
            else:
                record = records[used.value]
                used.value += 1
            record.key = key
        record.counter = value


@dataclasses.dataclass(slots=True)
class WorkTicket:
    """One request's place in the fair order.

    Attributes:
        name: the tenant it is counted against ("" for callers without one).
        weight: the tenant's weight.
        start: the tag it started from (the frontier moves to it once it runs).
        priority: the engine's priority for it (lower runs first).
    """

    name: str
    weight: float
    start: float
    priority: int


class FairOrder:
    """Tags the engine's requests by the work their tenants have been served.

    Args:
        book: where the counters live (default: this process's).
        locked: the lock a shared book is read under (a context manager factory).
    """

    def __init__(
        self,
        book: TagBook | None = None,
        locked: Callable[[], contextlib.AbstractContextManager[object]] | None = None,
    ) -> None:
        self.book: TagBook = LocalTagBook() if book is None else book
        self._locked = locked if locked is not None else contextlib.nullcontext

    def admit(
        self, name: str | None, weight: float, prompt_tokens: int, client_priority: int = 0
    ) -> WorkTicket:
        """A request of `prompt_tokens` from `name` (None: a caller without a tenant), tagged."""
        key = name or ""
        weight = weight if weight > 0 else 1.0
        # 32 bits, as every way in checks: a class stays within the engine's 64.
        client_priority = max(-(2**31), min(client_priority, 2**31 - 1))
        with self._locked():
            book = self.book
            start = max(book.counter(key), book.frontier())
            tag = start + prompt_tokens * PROMPT_TOKEN_PRICE / weight
            book.set_counter(key, tag)
        return WorkTicket(key, weight, start, client_priority * CLASS_SPAN + int(tag))

    def started(self, ticket: WorkTicket) -> None:
        """The engine gave the request's first output: the frontier reaches its start."""
        with self._locked():
            self.book.advance(ticket.start)

    def served(self, ticket: WorkTicket, output_tokens: int, prompt_correction: int = 0) -> None:
        """The engine generated `output_tokens` more for the request; and its
        prompt cost `prompt_correction` tokens more than it was charged (less,
        negative: tokens the prefix cache served, an estimate above the real
        count, a request that ended before its prefill ran). Its tenant's
        counter moves by the difference, never back behind the frontier."""
        cost = output_tokens * OUTPUT_TOKEN_PRICE + prompt_correction * PROMPT_TOKEN_PRICE
        if not cost:
            return
        with self._locked():
            book = self.book
            if cost > 0:
                counter = max(book.counter(ticket.name), book.frontier())
            else:
                counter = book.counter(ticket.name)
            book.set_counter(ticket.name, max(counter + cost / ticket.weight, book.frontier()))


class QueuedPrompts:
    """Prompt tokens admitted to the engine whose prefill has not yet run, and
    each tenant's share of their limit (`--max-queued-prompt-tokens`).

    A request's prompt counts from its admission to its first output. A
    tenant alone is never refused: the engine is its own while no one else
    wants it (`--max-inflight` bounds its calls). Once others want the
    tokens (they hold some, or were refused within the last seconds), each
    tenant is held to its weighted share of the limit (`shares.FairShares`,
    in tokens), so a flood of long prompts is refused (RESOURCE_EXHAUSTED,
    with a retry hint) before it queues further ahead of another's work. A
    request is admitted when its tenant holds none, whatever its length (a
    share is one request at least). Callers without a tenant (no key, an
    administrator) are counted and never refused: there is no one to be
    fair to among them.

    Args:
        limit: the pool's size in tokens; None: counted, never refused.
        shares: the tenants' shares of it (None: no shares, the total only).
        total: where the pool's total lives (an object with an int `value`:
            a ctypes value shared by the frontend processes, or this process's).
        locked: the lock a shared total and book are read under.
    """

    def __init__(
        self,
        limit: int | None,
        shares: FairShares | None = None,
        total: Any = None,
        locked: Callable[[], contextlib.AbstractContextManager[object]] | None = None,
    ) -> None:
        if limit is not None and limit < 1:
            raise ValueError(f"--max-queued-prompt-tokens must be at least 1, got {limit}")
        self.limit = limit
        self._shares = shares
        self._total = total if total is not None else _Count()
        self._locked = locked if locked is not None else contextlib.nullcontext

    @property
    def total(self) -> int:
        """Prompt tokens waiting for their prefill now, every tenant's."""
        return int(self._total.value)

    def held(self, name: str) -> int:
        """Prompt tokens of `name`'s waiting for their prefill now."""
        return 0 if self._shares is None else self._shares.held(name)

    def refusal(self, name: str | None, weight: float, tokens: int) -> str | None:
        """The refusal's text for `tokens` more of `name`'s, or None; counts nothing."""
        with self._locked():
            return self._refusal(name, weight, tokens)

    def take(self, name: str | None, weight: float, tokens: int) -> str | None:
        """`tokens` taken for `name`'s request; the refusal's text (and nothing
        taken) when they are past the pool or `name`'s share of it."""
        with self._locked():
            refusal = self._refusal(name, weight, tokens)
            if refusal is not None:
                if self._shares is not None:
                    self._shares.wants(name, weight)
                return refusal
            if self._shares is not None:  # first: a full shared book raises here
                self._shares.take(name, weight, tokens)
            self._total.value = int(self._total.value) + tokens
        return None

    def _refusal(self, name: str | None, weight: float, tokens: int) -> str | None:
        shares = self._shares
        if self.limit is None or shares is None or name is None:
            return None
        # A tenant alone is never refused (the engine is its own while no one
        # else wants it); once others want the tokens, its share binds.
        if shares.share(name, weight) >= self.limit:
            return None
        return shares.refusal(name, weight, "the prompt tokens waiting for prefill", tokens)

    def give_back(self, name: str | None, weight: float, tokens: int) -> None:
        """`name`'s request's prefill ran (or it ended first): its tokens leave the pool."""
        with self._locked():
            self._total.value = max(0, int(self._total.value) - tokens)
            if self._shares is not None:
                self._shares.give_back(name, weight, tokens)


class _Count:
    value = 0


@dataclasses.dataclass(slots=True)
class TenantWork:
    """What one tenant brought and was refused, in tokens (the per-tenant metrics)."""

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    output_tokens: int = 0
    refused_prompt_tokens: int = 0
    refused_requests: int = 0


class WorkTotals:
    """Each tenant's `TenantWork` in this process, by name ("" for callers without one).

    Bounded as the tenants are: a tenant is a key's name, and an operator's
    key file lists them.

    Attributes:
        mirror: also told of each count (tenant, `TenantWork` field, amount):
            counters that Prometheus's multiprocess mode merges across the
            frontend processes of `--api-server-count` (`tenant_metrics`).
    """

    def __init__(self) -> None:
        self.by_tenant: dict[str, TenantWork] = {}
        self.mirror: Callable[[str, str, int], None] | None = None

    def of(self, name: str) -> TenantWork:
        work = self.by_tenant.get(name)
        if work is None:
            work = self.by_tenant[name] = TenantWork()
        return work

    def add(self, name: str, field: str, amount: int) -> None:
        """`amount` more of `field` (a `TenantWork` field) for tenant `name`."""
        if not amount:
            return
        work = self.of(name)
        setattr(work, field, getattr(work, field) + amount)
        if self.mirror is not None:
            self.mirror(name, field, amount)
