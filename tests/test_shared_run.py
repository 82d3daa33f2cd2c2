"""How a sharded run's survivor tells a dead rank from one still inside the run (``SharedRun.absent``).

A store in memory and a clock the test moves stand in for the job's; the ranks' signs of life are
counters the test bumps (or does not, for a rank that was killed).
"""

from __future__ import annotations

import pytest

from fnloop import _shared_run
from fnloop.distributed import LIFE, SharedRun


class _Store:
    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def add(self, key: str, n: int) -> int:
        now = int(self.values.get(key, b"0")) + n
        self.values[key] = str(now).encode()
        return now

    def get(self, key: str) -> bytes:
        return self.values[key]

    def set(self, key: str, value: str) -> None:
        self.values[key] = value.encode()

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(_shared_run.time, "monotonic", lambda: now[0])
    return now


def _run(store: _Store) -> SharedRun:
    run = SharedRun(store, "job", 0)
    run.close()  # its own beats stop: the test plays every rank's
    return run


def test_a_killed_rank_is_found_dead_never_still_inside_however_late_the_survivor_looks(clock):
    store = _Store()
    store.add("job/alive/1", 5)  # rank 1 beat, then was killed: its count moves no more
    run = _run(store)
    run.ended(7)
    clock[0] += 10 * LIFE  # the survivor's save comes long after its run failed
    assert run.absent([1], 7) is None  # a first look cannot tell: wait
    clock[0] += LIFE / 2
    assert run.absent([1], 7) is None
    clock[0] += LIFE
    assert (
        run.absent([1], 7)
        == f"rank 1 has shown no sign of life for {LIFE:.0f} s (it died, or its machine did)"
    )


def test_a_rank_alive_in_its_step_after_this_ones_ended_is_still_inside_the_run(clock):
    store = _Store()
    run = _run(store)
    run.ended(7)
    said = None
    for _ in range(12):  # rank 1 keeps beating, waiting in a collective, and never says it ended
        store.add("job/alive/1", 1)
        clock[0] += LIFE / 3
        said = run.absent([1], 7) or said
    assert said is not None and "rank 1 is still inside the run" in said and "alive" in said


def test_a_rank_whose_run_ended_where_this_ones_did_is_not_absent(clock):
    store = _Store()
    run = _run(store)
    run.ended(7)
    store.set("job/ended/1", "7")
    for _ in range(12):
        store.add("job/alive/1", 1)
        clock[0] += LIFE / 3
        assert run.absent([1], 7) is None
