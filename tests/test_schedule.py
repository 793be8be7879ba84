"""`make test`'s schedule (support/schedule.py): its tables name modules that exist,
and the work it hands out first is the heaviest."""

from __future__ import annotations

from pathlib import Path

from support.schedule import GROUPS, SHARED_ENGINES, STARTS, cost

TESTS = Path(__file__).resolve().parent


def test_every_module_the_tables_name_exists() -> None:
    named = set(STARTS).union(*SHARED_ENGINES.values())
    assert not {m for m in named if not (TESTS / m).is_file()}


def test_modules_linked_by_any_shared_engine_are_one_group() -> None:
    # test_reference_servicer.py uses the vision engine and the KV-echo engine.
    assert GROUPS["test_images.py"] == GROUPS["test_inference.py"]
    assert GROUPS["test_bad_input.py"] != GROUPS["test_images.py"]
    assert "tests/test_drain.py" not in GROUPS and "test_drain.py" not in GROUPS


def test_a_module_of_engine_starts_outweighs_many_quick_tests() -> None:
    assert cost("tests/test_drain.py", 9) > cost("tests/test_auth_before_read.py", 123)
    assert cost(GROUPS["test_images.py"], 100) > cost("tests/test_convert.py", 100)
