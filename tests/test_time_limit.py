"""run(max_time=...): the run stops at a boundary once the time is up, saved, and goes on when run again."""

from __future__ import annotations

import datetime
import itertools

import attrs
import pytest
import torch

import fnloop as fl
from fnloop.checkpoint import latest, resume

MAX_ITER = 30


def step(state: fl.TrainState, batch: tuple[torch.Tensor]) -> fl.TrainState:
    w = state.params["w"] * 0.9 + batch[0].mean()
    return fl.record(attrs.evolve(state, params={"w": w}), loss=float(w.sum()))


def start() -> fl.TrainState:
    return fl.TrainState(max_iter=MAX_ITER, params={"w": torch.ones(3)})


def ticks():
    """A clock that advances one second each time the fold reads it: the run's length in reads, not in luck."""
    counter = itertools.count()
    return lambda: float(next(counter))


def batches():
    return fl.data.batches((torch.linspace(0, 1, 64),), batch_size=4, seed=0)


def hooks(directory):
    return [fl.every(7, fl.hooks.checkpoint(directory, keep=None))]


def test_a_run_past_its_time_stops_at_a_boundary_saves_and_returns(tmp_path):
    final = fl.run(start(), step, batches(), hooks(tmp_path), clock=ticks(), max_time=15)
    assert 0 < final.iteration < MAX_ITER and final.max_iter == MAX_ITER
    saved = latest(tmp_path, like=start())
    assert saved.iteration == final.iteration  # saved on the way out, as on SIGTERM
    assert torch.equal(saved.params["w"], final.params["w"]) and saved.max_iter == MAX_ITER


def test_time_slices_run_again_end_as_the_run_straight_through(tmp_path):
    straight = fl.run(start(), step, batches(), hooks(tmp_path / "straight"))
    ends = []
    state = start()
    while state.iteration < MAX_ITER:
        state = fl.run(
            resume(tmp_path / "sliced", like=start()),
            step,
            batches(),
            hooks(tmp_path / "sliced"),
            clock=ticks(),
            max_time=datetime.timedelta(seconds=12),
        )
        ends.append(state.iteration)
    assert len(ends) > 2 and ends == sorted(ends), ends
    assert torch.equal(state.params["w"], straight.params["w"])
    assert state.metrics.history("loss") == straight.metrics.history("loss")


def test_a_run_within_its_time_is_untouched(tmp_path):
    final = fl.run(start(), step, batches(), hooks(tmp_path), clock=ticks(), max_time=10**6)
    assert final.iteration == MAX_ITER


@pytest.mark.parametrize("bad", [0, -1.0, "1h", datetime.timedelta(0)])
def test_max_time_must_be_a_positive_time(bad):
    with pytest.raises(ValueError, match=r"max_time=\.\.\.\) must be a positive number of seconds"):
        fl.run(start(), step, batches(), max_time=bad)
