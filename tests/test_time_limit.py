"""run(max_time=...): the run stops at a boundary once the time is up, saved, and goes on when run again."""

from __future__ import annotations

import datetime
import itertools
import math

import attrs
import pytest
import torch

import fnloop as fl
from fnloop.checkpoint import latest, resume

MAX_ITER = 30

# The clocks here tick once a read, so a run's start takes a good share of its limit and warns so
# (SlowStart: a compile counts against max_time); its own test is below.
pytestmark = pytest.mark.filterwarnings("ignore::fnloop.SlowStart")


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


@pytest.mark.parametrize("bad", [0, -1.0, "1h", datetime.timedelta(0), math.inf, math.nan, True])
def test_max_time_must_be_a_positive_time(bad):
    with pytest.raises(ValueError, match=r"max_time=\.\.\.\) must be a positive finite number of seconds"):
        fl.run(start(), step, batches(), max_time=bad)


# -- under a launch of 2 ranks: rank 0's clock decides, every rank stops at its boundary --------------


def _sliced(directory: str, max_time: float | None) -> list[tuple[int, list[float]]]:
    """A data-parallel run of ``tests/launch_jobs.py``'s MLP, resumed from ``directory``, for ``max_time``.

    Rank 1's clock never moves: if it did not obey rank 0's stop, it would wait in the next all-reduce.
    """
    from tests import launch_jobs as jobs

    fl.distributed.setup(timeout=datetime.timedelta(seconds=20))  # a rank left waiting fails, not hangs
    net = jobs.model()
    optimizer = fl.optim.adamw(1e-2)
    template = fl.init(net, optimizer, seed=0, max_iter=24)
    step = fl.train_step(net, jobs.loss_fn, optimizer, compile=False)
    state = resume(directory, like=template)
    clock = ticks() if fl.distributed.rank() == 0 else (lambda: 0.0)
    batches = fl.data.batches(jobs.data(), batch_size=8, seed=0)
    hooks = [fl.every(5, fl.hooks.checkpoint(directory, keep=None))]
    final = fl.run(state, step, batches, hooks, clock=clock, max_time=max_time)
    return fl.distributed.gather_object((final.iteration, final.params["0.weight"].flatten().tolist()))


def test_under_two_ranks_every_rank_stops_where_rank_zero_says_and_the_slices_end_as_straight(tmp_path):
    straight = fl.distributed.launch(_sliced, str(tmp_path / "straight"), None, nprocs=2, start_method="fork")
    assert [it for it, _ in straight] == [24, 24]
    ends = []
    while not ends or ends[-1] < 24:
        ranks = fl.distributed.launch(_sliced, str(tmp_path / "sliced"), 20.0, nprocs=2, start_method="fork")
        assert ranks[0] == ranks[1]  # the same boundary, the same state
        ends.append(ranks[0][0])
        newest = fl.checkpoint.checkpoints(tmp_path / "sliced")[0]
        assert newest.name == f"ckpt-{ends[-1]:08d}.safetensors"  # saved where it stopped
    assert len(ends) > 1 and ends[-1] == 24, ends
    assert ranks == straight


def test_a_run_whose_time_is_up_as_it_ends_ends_as_any_other(tmp_path):
    done = []

    def last_step_takes_long(state, batch):
        if state.iteration == MAX_ITER - 1:
            done.append(True)
        return step(state, batch)

    ended = fl.on(fl.Phase.AFTER_TRAIN, lambda s, phase: fl.record(s, ended=1.0))
    clock = lambda: 1e9 if done else 0.0  # noqa: E731
    final = fl.run(start(), last_step_takes_long, batches(), [ended], clock=clock, max_time=10)
    assert final.iteration == MAX_ITER
    assert "ended" in final.metrics.series  # AFTER_TRAIN's changes are in what run returns


@pytest.mark.filterwarnings("error::fnloop.SlowStart")
def test_a_start_that_takes_a_large_share_of_the_limit_warns_once_after_the_first_step(tmp_path):
    # A compile counts against the limit: a first step taking most of it stops the run after that step,
    # before any later hook's turn (an evaluation every 5 steps, say), and the user is told why.
    reads = iter([0.0, 0.0, 0.0, 50.0, *range(51, 400)])  # the first step (a compile) takes 50 s
    with pytest.warns(fl.SlowStart, match=r"max_time=60\): .* took 50.0 s, 83% of its time limit") as caught:
        final = fl.run(
            start(), step, batches(), hooks(tmp_path), clock=lambda: float(next(reads)), max_time=60
        )
    assert len(caught) == 1 and 0 < final.iteration < MAX_ITER
    reads = iter([0.0, 0.0, 0.0, 70.0, *range(71, 400)])
    with pytest.warns(fl.SlowStart, match=r"the run stops after its first step"):
        stopped = fl.run(start(), step, batches(), clock=lambda: float(next(reads)), max_time=60)
    assert stopped.iteration == 1
    fl.run(start(), step, batches(), clock=ticks(), max_time=10**6)  # a quick start warns nothing
