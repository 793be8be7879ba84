"""The frontend processes' shared state (`frontends.py`), without an engine.

The table is checked against a dictionary over thousands of random claims and
releases in a table small enough that probes wrap and deletions shift
entries back; then two real spawned processes contend for one id and one
in-flight limit through the same shared memory.
"""

from __future__ import annotations

import multiprocessing
import random

import pytest

from vllm_servicer.frontends import FrontendGroup, SharedTable, TableFullError, key_hash


def test_the_table_agrees_with_a_dict_through_wrapping_probes_and_removals() -> None:
    group = FrontendGroup(1, capacity=64)
    table: SharedTable = group._table
    model: dict[int, tuple[int, int]] = {}
    rng = random.Random(7)
    # Keys crowded onto a few home slots, so that probe chains are long and wrap.
    keys = [k for k in (key_hash(f"id-{i}") for i in range(5000)) if k & 63 in (0, 1, 62, 63)]
    keys = keys[:48]
    for step in range(20_000):
        key = rng.choice(keys)
        if rng.random() < 0.5 and len(model) < 48:
            value = rng.randrange(1, 1 << 20)
            table.put(key, 5, value)
            model[key] = (5, value)
        else:
            table.put(key, 5, 0)
            model.pop(key, None)
        if step % 97 == 0:
            assert {k: table.get(k) for k in keys if table.get(k) is not None} == model


def test_a_full_table_refuses_rather_than_loops() -> None:
    group = FrontendGroup(1, capacity=4)
    table: SharedTable = group._table
    for i in range(table.limit):
        table.put(key_hash(f"k{i}"), 1, 1)
    with pytest.raises(TableFullError):
        table.put(key_hash("one more"), 1, 1)


def test_claims_belong_to_their_owner_and_name_the_processes_running_them() -> None:
    group = FrontendGroup(3)
    group.join(0)
    assert group.claim("r1", "alice")
    assert not group.claim("r1", "bob")
    group.join(2)  # the same shared state, seen as process 2
    assert group.claim("r1", "alice")
    group.join(1)
    assert group.running_elsewhere("r1", "alice") == [0, 2]
    assert group.running_elsewhere("r1", "bob") == []  # another caller's: invisible
    assert group.running_elsewhere("r1", None) == [0, 2]  # an administrator's: any
    group.join(0)
    group.release("r1")
    group.join(1)
    assert group.running_elsewhere("r1", "alice") == [2]
    group.join(2)
    group.release("r1")
    assert group.running_elsewhere("r1", None) == []
    assert group.claim("r1", "bob")  # free again


def _contend(group: FrontendGroup, index: int, limit: int, start: object, results: object) -> None:
    group.join(index)
    start.wait()  # type: ignore[attr-defined]
    admitted = 0
    for _ in range(200):
        with group.locked():
            if group.inflight < limit:
                group.add_inflight(1)
                admitted += 1
    won = group.claim("contended", f"caller-{index}")
    results.put((index, admitted, won))  # type: ignore[attr-defined]


def test_two_processes_share_one_limit_and_one_owner_per_id() -> None:
    ctx = multiprocessing.get_context("spawn")
    group = FrontendGroup(2)
    start, results = ctx.Event(), ctx.Queue()
    processes = [ctx.Process(target=_contend, args=(group, i, 150, start, results)) for i in (0, 1)]
    for process in processes:
        process.start()
    start.set()
    outcomes = sorted(results.get(timeout=60) for _ in processes)
    for process in processes:
        process.join(30)
    assert sum(admitted for _, admitted, _ in outcomes) == 150
    assert group.inflight == 150
    assert sorted(won for _, _, won in outcomes) == [False, True]
