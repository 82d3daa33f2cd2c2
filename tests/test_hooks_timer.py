"""The timer hook, driven by a fake clock: what it records, when, and across a resume."""

from __future__ import annotations

import pickle

import attrs
import pytest

import fnloop as fl
from fnloop import Phase, TrainState, testing
from fnloop.hooks import TimerState, timer


class Clock:
    """A clock that moves only when the batches or the step move it."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


FETCH = 0.25
STEP = 1.0


def batches(clock: Clock, n: int):
    for i in range(n):
        clock.now += FETCH
        yield i


def stepping(clock: Clock):
    def step(state: TrainState, batch: object) -> TrainState:
        clock.now += STEP
        return fl.record(state, loss=float(batch))

    return step


def times(state: TrainState, name: str) -> list[tuple[int, float]]:
    return list(state.metrics.history(name))


def test_records_iteration_and_data_time_after_warmup():
    clock = Clock()
    final = fl.run(TrainState(max_iter=6), stepping(clock), batches(clock, 6), [timer(warmup=2)], clock=clock)
    assert times(final, "time") == [(i, FETCH + STEP) for i in range(2, 6)]
    assert times(final, "data_time") == [(i, FETCH) for i in range(2, 6)]
    assert final.hooks["timer"] == TimerState(start=0)


def test_warmup_zero_times_the_first_iteration_from_before_train():
    clock = Clock()
    final = fl.run(TrainState(max_iter=2), stepping(clock), batches(clock, 2), [timer(warmup=0)], clock=clock)
    assert times(final, "time") == [(0, FETCH + STEP), (1, FETCH + STEP)]


def test_time_runs_from_before_step_to_after_step():
    clock = Clock()

    def slow(seconds, phase, at):
        def hook(state, p):
            if p is phase and state.iteration == at:
                return fl.request(state, lambda s: setattr(clock, "now", clock.now + seconds), "slow")
            return state

        return hook

    # A BEFORE_STEP effect is part of its iteration; an AFTER_STEP one (a write, a checkpoint) is not.
    hooks = [timer(warmup=0), slow(10.0, Phase.AFTER_STEP, 1), slow(100.0, Phase.BEFORE_STEP, 3)]
    final = fl.run(TrainState(max_iter=5), stepping(clock), batches(clock, 5), hooks, clock=clock)
    assert [t for _, t in times(final, "time")] == [1.25, 1.25, 1.25, 101.25, 1.25]


# These resume with a generator of the remaining batches, which the fold cannot tell from a restarted one.
@pytest.mark.filterwarnings("ignore::fnloop.data.DataRestarts")
def test_a_resumed_run_skips_its_own_warmup_again():
    clock = Clock()
    hooks = [timer(warmup=2)]
    half = fl.run(TrainState(max_iter=4), stepping(clock), batches(clock, 4), hooks, clock=clock)
    resumed = attrs.evolve(half, max_iter=8)
    final = fl.run(resumed, stepping(clock), batches(clock, 4), hooks, clock=clock)
    assert [i for i, _ in times(final, "time")] == [2, 3, 6, 7]
    assert final.hooks["timer"].start == 4


@pytest.mark.filterwarnings("ignore::fnloop.data.DataRestarts")
def test_resume_from_a_checkpoint_claims_the_saved_timer_state(tmp_path):
    clock = Clock()
    hooks = [timer(warmup=1), fl.every(3, fl.hooks.checkpoint(tmp_path))]
    fl.run(TrainState(max_iter=3), stepping(clock), batches(clock, 3), hooks, clock=clock)
    loaded = fl.checkpoint.latest(tmp_path, like=TrainState(max_iter=3))
    assert type(loaded.hooks["timer"]) is fl.Unclaimed
    final = fl.run(attrs.evolve(loaded, max_iter=6), stepping(clock), batches(clock, 3), hooks, clock=clock)
    assert [i for i, _ in times(final, "time")] == [1, 2, 4, 5]
    assert final.hooks["timer"].start == 3


def test_records_python_floats_only():
    clock = Clock()
    final = fl.run(TrainState(max_iter=3), stepping(clock), batches(clock, 3), [timer(warmup=0)], clock=clock)
    assert all(type(v) is float for name in ("time", "data_time") for _, v in times(final, name))


@pytest.mark.parametrize("window", [1, 4, 50])
def test_keeps_the_metrics_window_as_record_does(window):
    clock = Clock()
    state = TrainState(max_iter=30, metrics=fl.Metrics(window=window))
    final = fl.run(state, stepping(clock), batches(clock, 30), [timer(warmup=0)], clock=clock)
    assert [i for i, _ in times(final, "time")] == list(range(30))[-window:]
    expected = fl.Metrics(window=window)
    for i in range(30):
        expected = expected.record(i, {"loss": float(i), "time": FETCH + STEP, "data_time": FETCH})
    testing.assert_identical(final.metrics, expected)


def test_is_a_good_hook():
    state = TrainState(max_iter=5, iteration=2, clock=fl.Clock(time=3.0))
    testing.check_hook(timer(), state)
    started = timer(warmup=0)(state, Phase.BEFORE_TRAIN)
    testing.check_hook(timer(warmup=0), attrs.evolve(started, clock=fl.Clock(time=4.5)))
    assert pickle.loads(pickle.dumps(timer(warmup=5, name="t"))) == timer(warmup=5, name="t")


def test_composes_and_refuses_a_second_timer_of_the_same_name():
    assert fl.state_names(fl.chain(timer(), timer(name="other"))) == ("timer", "other")
    with pytest.raises(ValueError, match="two hooks keep their state under the name 'timer'"):
        fl.chain(timer(), timer())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"warmup": -1}, r"'warmup' must be a non-negative int \(got -1 that is an int\)"),
        ({"warmup": 1.5}, r"'warmup' must be a non-negative int \(got 1.5 that is a float\)"),
        ({"name": ""}, r"'name' must be a non-empty str \(got '' that is a str\)"),
    ],
)
def test_refuses_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        timer(**kwargs)
