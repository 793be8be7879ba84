"""The fair-share rule (`shares.py`): the arithmetic alone; the pools that ask it
are tested on the wire in their own modules."""

from __future__ import annotations

from vllm_servicer.shares import FairShares, fair_share


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_lone_identity_takes_the_whole_pool() -> None:
    shares = FairShares(8)
    for _ in range(8):
        assert shares.refusal("a") is None
        shares.take("a")
    assert shares.held("a") == 8


def test_an_identity_refused_a_slot_halves_the_holders_share_until_its_window_ends() -> None:
    clock = Clock()
    shares = FairShares(8, window=10, clock=clock)
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
    assert shares.wanting() == {"a": 1.0}
    assert shares.share("a") == 8


def test_weights_divide_the_pool_and_a_share_is_one_slot_at_least() -> None:
    assert fair_share(8, 3, [3, 1]) == 6
    assert fair_share(8, 1, [3, 1]) == 2
    assert fair_share(8, 1, [1] * 100) == 1
    assert fair_share(8, 5, [5]) == 8


def test_callers_held_to_the_total_only_are_never_refused_nor_counted() -> None:
    shares = FairShares(2)
    shares.take("a")
    shares.take("a")
    shares.wants("b")
    for _ in range(5):
        assert shares.refusal(None) is None
        shares.take(None)
    assert shares.wanting() == {"a": 1.0, "b": 1.0}


def test_an_identity_that_leaves_is_forgotten() -> None:
    clock = Clock()
    shares = FairShares(4, window=1, clock=clock)
    shares.take("a", 2.0)
    shares.wants("b")
    shares.give_back("a")
    clock.now = 2
    assert shares.wanting() == {}
