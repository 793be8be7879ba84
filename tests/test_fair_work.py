"""The fair order's tags and the prompt tokens' shares, by the rule (no engine).

`fair_work.FairOrder` tags each request by the work its tenant has been
served; vLLM's priority scheduler runs the lowest tag first. What the rule
promises: a tenant alone keeps arrival order; a light tenant arriving while a
heavy one has a queue goes ahead of that queue; a weight of 3 makes a
tenant's work cost a third; a client's priority is a class across tenants;
output tokens and cached prompt tokens move the counter. The same in the
frontend processes' shared memory (`TagRecords`). `QueuedPrompts` holds
prompt tokens waiting for prefill to a limit, and each tenant to its share
while others want them.
"""

from __future__ import annotations

import pytest

from vllm_servicer.fair_work import (
    CLASS_SPAN,
    OUTPUT_TOKEN_PRICE,
    FairOrder,
    QueuedPrompts,
)
from vllm_servicer.frontends import FrontendGroup
from vllm_servicer.servicer.tenant_engine import prompt_tokens
from vllm_servicer.shares import FairShares


def _orders() -> list[FairOrder]:
    group = FrontendGroup(2, share_records=8)
    return [FairOrder(), FairOrder(group.tag_book, group.locked)]


@pytest.fixture(params=["local", "shared"])
def order(request: pytest.FixtureRequest) -> FairOrder:
    return _orders()[0 if request.param == "local" else 1]


def test_a_tenant_alone_keeps_arrival_order(order: FairOrder) -> None:
    tickets = [order.admit("a", 1.0, length) for length in (1800, 16, 900, 16)]
    priorities = [t.priority for t in tickets]
    assert priorities == sorted(priorities) and len(set(priorities)) == 4


def test_a_light_tenant_goes_ahead_of_a_heavy_tenants_queue(order: FairOrder) -> None:
    flood = [order.admit("a", 1.0, 1800) for _ in range(8)]
    order.started(flood[0])  # the engine runs A's first
    light = order.admit("b", 1.0, 16)
    assert light.priority < flood[1].priority, "B's request queued behind A's second"
    # Served in turn: B's next after A's whole queue only once B has had as much.
    assert order.admit("b", 1.0, 16).priority < flood[2].priority


def test_a_tenant_of_weight_three_pays_a_third(order: FairOrder) -> None:
    light, heavy = order.admit("one", 1.0, 3000), order.admit("three", 3.0, 3000)
    assert heavy.priority == pytest.approx(light.priority / 3, abs=1)


def test_output_tokens_move_the_counter_and_cached_tokens_give_back(order: FairOrder) -> None:
    first = order.admit("a", 1.0, 100)
    order.served(first, output_tokens=50)
    second = order.admit("a", 1.0, 100)
    assert second.priority == first.priority + 50 * OUTPUT_TOKEN_PRICE + 100
    order.served(second, output_tokens=0, prompt_correction=-100)  # all of it cached
    assert order.admit("a", 1.0, 0).priority == second.priority - 100


def test_a_refund_never_takes_a_counter_behind_the_frontier(order: FairOrder) -> None:
    ticket = order.admit("a", 1.0, 100)
    order.started(order.admit("b", 1.0, 5000))
    order.served(ticket, 0, prompt_correction=-10_000)  # more than was ever charged
    assert order.admit("a", 1.0, 0).priority >= order.book.frontier()


def test_a_clients_priority_stays_within_32_bits(order: FairOrder) -> None:
    ticket = order.admit("a", 1.0, 16, client_priority=2**40)
    assert ticket.priority < 2**63 and ticket.priority == (2**31 - 1) * CLASS_SPAN + 16


def test_a_clients_priority_is_a_class_across_tenants(order: FairOrder) -> None:
    flood = [order.admit("a", 1.0, 1800) for _ in range(4)]
    later = order.admit("b", 1.0, 16, client_priority=1)
    assert later.priority > flood[-1].priority  # a class behind every tag of class 0
    assert order.admit("b", 1.0, 16, client_priority=-1).priority < 0
    assert later.priority - CLASS_SPAN < flood[1].priority


def test_the_shared_book_is_one_scale_for_every_process() -> None:
    group = FrontendGroup(2, share_records=8)
    one, two = FairOrder(group.tag_book, group.locked), FairOrder(group.tag_book, group.locked)
    flood = [one.admit("a", 1.0, 1800) for _ in range(4)]
    one.started(flood[0])
    assert two.admit("b", 1.0, 16).priority < flood[1].priority
    assert two.admit("a", 1.0, 16).priority > flood[-1].priority  # A's queue seen from two


def test_a_full_shared_book_forgets_the_counter_nearest_the_frontier() -> None:
    group = FrontendGroup(1, share_records=2)
    order = FairOrder(group.tag_book, group.locked)
    for name, length in (("a", 100), ("b", 5000), ("c", 9000)):
        order.admit(name, 1.0, length)
    assert group.tag_book.counter("a") == 0.0  # forgotten: starts at the frontier
    assert group.tag_book.counter("c") == 9000.0


def test_a_tenant_alone_is_never_refused_and_held_to_its_share_once_others_want() -> None:
    queued = QueuedPrompts(4000, FairShares(4000))
    for _ in range(4):  # alone: past the limit, the engine is its own
        assert queued.take("a", 1.0, 1800) is None
    assert queued.total == 7200
    # B holds none: admitted whatever the pool holds (a share is one request at least).
    assert queued.take("b", 1.0, 1000) is None
    # Now B wants the pool too: A, past its share of 2,000, is refused its next.
    refusal = queued.take("a", 1.0, 100)
    assert refusal is not None, "A was admitted past its share while B wants the tokens"
    assert refusal == (
        "tenant 'a' holds 7200 of the prompt tokens waiting for prefill, its share while "
        "2 tenants want them is 2000; retry later"
    )
    assert queued.take("b", 1.0, 500) is None  # B within its share
    for _ in range(3):
        queued.give_back("a", 1.0, 1800)
    assert queued.take("a", 1.0, 100) is None  # A back within its share (1,800 + 100)
    # Callers without a tenant are counted, never refused.
    assert queued.take(None, 1.0, 100_000) is None
    for name, tokens in (("a", 1800), ("a", 100), ("b", 1000), ("b", 500), (None, 100_000)):
        queued.give_back(name, 1.0, tokens)
    assert queued.total == 0 and queued.held("a") == 0 and queued.held("b") == 0


def test_waiting_prompts_without_a_limit_are_counted_never_refused() -> None:
    queued = QueuedPrompts(None, FairShares(1))
    for _ in range(100):
        assert queued.take("a", 1.0, 100_000) is None
    assert queued.total == 10_000_000


def test_the_shared_waiting_prompts_are_every_processes() -> None:
    group = FrontendGroup(2, share_records=8)

    def book() -> QueuedPrompts:
        shares = FairShares(4000, book=group.token_book)
        return QueuedPrompts(4000, shares, group.queued_prompt_tokens, group.locked)

    one, two = book(), book()
    assert one.take("a", 1.0, 3000) is None
    assert two.total == 3000 and two.held("a") == 3000
    assert two.take("b", 1.0, 100) is None  # B, in the other process, wants them too
    assert one.take("a", 1.0, 1800) is not None
    two.give_back("b", 1.0, 100)
    one.give_back("a", 1.0, 3000)
    assert two.take("a", 1.0, 1800) is None


@pytest.mark.parametrize(
    ("prompt", "tokens"),
    [
        ({"prompt_token_ids": list(range(37))}, 37),
        ({"prompt": "x" * 400}, 100),
        ("y" * 8, 2),
        ({"encoder_prompt": {"prompt_token_ids": [1, 2, 3]}, "decoder_prompt": None}, 3),
        ({"prompt_token_ids": []}, 1),
        (object(), 1),
    ],
)
def test_a_prompts_tokens_as_the_engine_gets_it(prompt: object, tokens: int) -> None:
    assert prompt_tokens(prompt) == tokens
