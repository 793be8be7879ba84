"""The fair-share rule (`shares.py`): the arithmetic alone, on each book the
counts can live in (this process's, the frontend processes' shared memory);
the pools that ask it are tested on the wire in their own modules."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from vllm_servicer.frontends import FrontendGroup, TableFullError
from vllm_servicer.shares import FairShares, LocalBook, ShareBook, fair_share


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


Books = Callable[[], ShareBook]


@pytest.fixture(params=["local", "frontends"])
def book(request: pytest.FixtureRequest) -> Iterator[Books]:
    """Makes the book the test's shares keep their counts in."""
    if request.param == "local":
        yield LocalBook
        return
    groups: list[FrontendGroup] = []

    def shared() -> ShareBook:
        groups.append(FrontendGroup(1, capacity=64, share_records=16))
        groups[-1].join(0)
        return groups[-1].share_book()

    yield shared
    for group in groups:
        group.remove_directory()


def test_a_lone_identity_takes_the_whole_pool(book: Books) -> None:
    shares = FairShares(8, book=book())
    for _ in range(8):
        assert shares.refusal("a") is None
        shares.take("a")
    assert shares.held("a") == 8


def test_an_identity_refused_a_slot_halves_the_holders_share_until_its_window_ends(
    book: Books,
) -> None:
    clock = Clock()
    shares = FairShares(8, book=book(), window=10, clock=clock)
    for _ in range(8):
        shares.take("a")
    shares.wants("b")
    message = shares.refusal("a")
    assert message is not None and "'a' holds 8" in message and "share" in message
    assert " is 4;" in message
    # b's first slot is its due whatever a holds; a is held to 4 of 8 meanwhile.
    assert shares.refusal("b") is None
    for _ in range(5):
        shares.give_back("a")
    assert shares.held("a") == 3 and shares.refusal("a") is None
    clock.now = 11  # b has neither slots nor a recent refusal: a alone again
    assert list(shares.wanting().values()) == [1.0]
    assert shares.share("a") == 8


def test_weights_divide_the_pool_and_a_share_is_one_slot_at_least() -> None:
    assert fair_share(8, 3, [3, 1]) == 6
    assert fair_share(8, 1, [3, 1]) == 2
    assert fair_share(8, 1, [1] * 100) == 1
    assert fair_share(8, 5, [5]) == 8


def test_callers_held_to_the_total_only_are_never_refused_nor_counted(book: Books) -> None:
    shares = FairShares(2, book=book())
    shares.take("a")
    shares.take("a")
    shares.wants("b")
    for _ in range(5):
        assert shares.refusal(None) is None
        shares.take(None)
    assert shares.wanting() == {shares.book.key("a"): 1.0, shares.book.key("b"): 1.0}


def test_an_identity_that_leaves_is_forgotten(book: Books) -> None:
    clock = Clock()
    shares = FairShares(4, book=book(), window=1, clock=clock)
    shares.take("a", 2.0)
    shares.wants("b")
    shares.give_back("a")
    clock.now = 2
    assert shares.wanting() == {}


def test_weights_are_read_from_the_book_for_every_identity(book: Books) -> None:
    shares = FairShares(8, book=book())
    for _ in range(6):
        shares.take("heavy", 3.0)
    shares.wants("light", 1.0)
    assert shares.share("light") == 2
    assert shares.refusal("heavy", 3.0) is not None  # 6 held, its share of 8 is 6
    shares.give_back("heavy", 3.0)
    assert shares.refusal("heavy", 3.0) is None


def test_a_slot_given_back_leaves_the_holders_weight_as_it_was(book: Books) -> None:
    shares = FairShares(6, book=book())
    shares.take("heavy", 2.0)
    shares.take("heavy", 2.0)
    shares.give_back("heavy")  # a caller that does not repeat the weight
    shares.wants("light")
    assert shares.share("light") == 2  # ceil(6 * 1 / 3): "heavy" still weighs 2


def test_processes_sharing_a_group_read_one_count() -> None:
    """What one frontend process counts, another's shares see: a tenant's
    share is of the engine's slots, not of each process's."""
    group = FrontendGroup(2, capacity=64, share_records=16)
    try:
        group.join(0)
        # The copy another process receives at its start.
        other = FrontendGroup.__new__(FrontendGroup)
        other.__setstate__(group.__getstate__())
        other.join(1)
        here = FairShares(4, book=group.share_book())
        there = FairShares(4, book=other.share_book())
        for shares in (here, there):
            shares.take("a")
            shares.take("a")
        there.wants("b")
        refusal = here.refusal("a")
        assert refusal is not None and "holds 4" in refusal and "is 2;" in refusal
        assert here.refusal("b") is None
        for shares in (here, there):
            shares.give_back("a")
        assert here.held("a") == there.held("a") == 2
    finally:
        group.remove_directory()


def test_the_groups_records_forget_the_identities_that_only_want_first() -> None:
    """The shared records are fixed: every holder keeps its record, and past
    them the identity whose window ends first is forgotten first."""
    clock = Clock()
    group = FrontendGroup(1, capacity=64, share_records=3)
    try:
        group.join(0)
        shares = FairShares(2, book=group.share_book(), window=10, clock=clock)
        shares.take("holder")
        shares.wants("early")
        clock.now = 1
        shares.wants("late")
        clock.now = 2
        shares.wants("latest")  # the records are full: "early" goes
        assert shares.wanting() == {
            shares.book.key(name): 1.0 for name in ("holder", "late", "latest")
        }
        shares.take("late")
        shares.take("latest")  # three holders, no record left for a fourth
        with pytest.raises(TableFullError):
            shares.take("fourth")
        shares.wants("fourth")  # forgotten at once: it cannot displace a holder
        assert len(shares.wanting()) == 3
    finally:
        group.remove_directory()
