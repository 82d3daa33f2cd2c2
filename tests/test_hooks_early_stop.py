"""early_stop: what counts, when the run ends, what it records, what survives a resume."""

from __future__ import annotations

import math
import warnings

import attrs
import pytest
import torch

import fnloop as fl
from fnloop import Phase, TrainState, testing
from fnloop.hooks import EarlyStopState, MetricNeverRecorded, early_stop, evaluate
from fnloop.hooks import _early_stop as module


def replaying(values, every=1, name="val_loss"):
    """A step recording ``values[k]`` under ``name`` at every ``every``-th step (k counts recordings)."""

    def step(state, batch):
        i = state.iteration
        if (i + 1) % every:
            return state
        return fl.record(state, **{name: values[(i + 1) // every - 1]})

    return step


def go(values, hooks, *, every=1, max_iter=None, state=None):
    n = max_iter or len(values) * every
    return fl.run(state or TrainState(max_iter=n), replaying(values, every), [None] * n, hooks)


def test_the_run_ends_after_patience_values_without_improvement():
    final = go([3.0, 2.0, 2.5, 2.2, 1.0, 0.5], [early_stop("val_loss", patience=2)])
    assert (final.iteration, final.max_iter) == (4, 4)
    assert final.hooks["early_stop:val_loss"] == EarlyStopState(2.0, 1, 3, 2, 3)


def test_an_improvement_resets_the_count():
    final = go([3.0, 3.5, 2.0, 2.5, 1.0, 1.5], [early_stop("val_loss", patience=2)])
    assert final.iteration == 6  # never two bad values in a row
    assert final.hooks["early_stop:val_loss"] == EarlyStopState(1.0, 4, 5, 1, -1)


def test_mode_max():
    final = go([0.1, 0.5, 0.4, 0.45, 0.9], [early_stop("val_loss", patience=2, mode="max")])
    assert final.iteration == 4
    assert final.hooks["early_stop:val_loss"].best == 0.5


def test_an_improvement_must_beat_the_best_by_more_than_min_delta():
    values = [1.0, 0.95, 0.91, 0.5]
    assert go(values, [early_stop("val_loss", patience=2, min_delta=0.1)]).iteration == 3
    assert go(values, [early_stop("val_loss", patience=2, min_delta=0.01)]).iteration == 4


@pytest.mark.parametrize("values", [[math.nan, math.nan, 1.0], [1.0, math.nan, math.nan, 0.1]])
def test_nan_never_counts_as_an_improvement(values):
    with pytest.warns(fl.hooks.NonFiniteMetric, match=r"'val_loss' is nan"):
        final = go(values, [early_stop("val_loss", patience=2)])
    memory = final.hooks["early_stop:val_loss"]
    assert memory.stopped_at >= 0 and final.iteration < len(values)
    assert not math.isnan(memory.best)


def test_tensor_values_count_like_numbers():
    values = [torch.tensor(v) for v in [3.0, 2.0, 2.5, 2.2, 1.0]]
    assert go(values, [early_stop("val_loss", patience=2)]).iteration == 4


def test_a_value_is_counted_once_however_often_the_hook_runs():
    # Recorded at every 5th step (4, 9, 14, ...); the hook runs at every step.
    final = go([3.0, 2.0, 2.5, 2.2, 1.0], [early_stop("val_loss", patience=2)], every=5)
    assert final.iteration == 20  # stops at step 19, after the 4th value
    assert final.hooks["early_stop:val_loss"] == EarlyStopState(2.0, 9, 19, 2, 19)


def test_wrapped_in_every_it_counts_every_value_recorded_since():
    final = go([3.0, 2.0, 2.5, 2.2, 1.0, 0.5], [fl.every(4, early_stop("val_loss", patience=2))], max_iter=6)
    assert final.iteration == 4  # it looks at step 3 and sees values 0..3
    assert final.hooks["early_stop:val_loss"] == EarlyStopState(2.0, 1, 3, 2, 3)


def test_placed_before_the_recording_hook_it_sees_values_a_step_later():
    losses = [3.0, 2.0, 2.5, 2.2, 1.0]

    def fn(state):
        return {"val_loss": losses[state.iteration // 2]}

    after = [fl.every(2, evaluate(fn)), early_stop("val_loss", patience=2)]
    before = [early_stop("val_loss", patience=2), fl.every(2, evaluate(fn))]
    nothing = lambda s, b: s  # noqa: E731
    assert fl.run(TrainState(max_iter=10), nothing, [None] * 10, after).iteration == 8
    assert fl.run(TrainState(max_iter=10), nothing, [None] * 10, before).iteration == 9


def test_a_stop_is_a_success_the_end_of_run_hooks_see(tmp_path):
    def fn(state):
        return {"val_loss": [3.0, 2.0, 2.5, 2.2, 1.0][state.iteration // 2]}

    hooks = [
        fl.every(2, evaluate(fn)),
        early_stop("val_loss", patience=2),
        fl.every(3, evaluate(lambda s: {"n": float(s.iteration)}, name="other")),
        fl.every(100, fl.hooks.checkpoint(tmp_path)),
    ]
    final = fl.run(TrainState(max_iter=100), lambda s, b: s, [None] * 100, hooks)
    assert (final.iteration, final.max_iter) == (8, 8)
    assert [i for i, _ in final.metrics.history("n")] == [2, 5, 8]  # evaluated at the end, as a success
    assert [p.name for p in fl.checkpoint.checkpoints(tmp_path)] == ["ckpt-00000008.safetensors"]


def test_the_count_survives_a_resume(tmp_path):
    values = [3.0, 2.0, 2.5, 2.4, 2.3, 2.2, 1.0, 1.5, 1.4, 1.3]

    def hooks(folder):
        return [early_stop("val_loss", patience=3), fl.every(4, fl.hooks.checkpoint(folder, keep=None))]

    whole = fl.run(TrainState(max_iter=10), replaying(values), range(10), hooks(tmp_path), clock=lambda: 0.0)
    assert whole.iteration == 5
    middle = fl.checkpoint.load(fl.checkpoint.path_for(tmp_path, 4), like=TrainState(max_iter=10))
    assert fl.hook_state(middle, "early_stop:val_loss", EarlyStopState(math.inf)).bad == 2
    resumed = fl.run(middle, replaying(values), range(4, 10), hooks(tmp_path / "b"), clock=lambda: 0.0)
    testing.assert_identical(resumed, whole)


def test_a_metric_never_recorded_warns_at_the_end_naming_what_was_recorded():
    step = lambda s, b: fl.record(s, loss=1.0)  # noqa: E731
    with pytest.warns(
        MetricNeverRecorded,
        match=r"the metric 'val_loss' was never recorded in this run \(recorded: \['loss'\]\)",
    ):
        fl.run(TrainState(max_iter=3), step, [None] * 3, [early_stop("val_loss", patience=2)])


def test_no_warning_after_a_failure_or_when_the_metric_was_recorded():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        go([1.0, 2.0], [early_stop("val_loss", patience=5)])
        with pytest.raises(testing.InjectedFailure):
            fl.run(
                TrainState(max_iter=3),
                lambda s, b: s,
                [None] * 3,
                [early_stop("val_loss", patience=2), testing.Fail(Phase.AFTER_STEP, 1)],
            )


def test_values_are_read_only_in_steps_that_recorded_new_ones(monkeypatch):
    reads = []
    real = module.to_floats

    def counting(values):
        values = list(values)
        reads.append(len(values))
        return real(values)

    monkeypatch.setattr(module, "to_floats", counting)
    values = [torch.tensor(v) for v in [3.0, 2.0, 1.0, 0.5]]
    go(values, [early_stop("val_loss", patience=2)], every=5)
    assert reads == [1, 1, 1, 1]  # 4 reads in 20 steps


@pytest.mark.parametrize("phase", list(Phase))
def test_early_stop_is_a_good_hook(phase):
    state = fl.record(TrainState(max_iter=9, iteration=3), val_loss=torch.tensor(2.0))
    stale = attrs.evolve(state, hooks={"early_stop:val_loss": EarlyStopState(1.0, 1, 2, 4)})
    for s in [state, stale, TrainState(max_iter=3, iteration=3)]:
        testing.check_hook(early_stop("val_loss", patience=3), s, (phase,))


def test_it_names_its_configuration():
    hook = early_stop("acc", patience=3, mode="max", min_delta=0.01, name="es")
    assert repr(hook) == "stateful('es', early_stop('acc', patience=3, mode='max', min_delta=0.01))"
    assert fl.state_names(hook) == ("es",)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"patience": 0}, ValueError, r"'patience' must be a positive int \(got 0 that is an int\)"),
        ({"patience": 1.5}, ValueError, r"'patience' must be a positive int \(got 1.5 that is a float\)"),
        ({"patience": 2, "mode": "low"}, ValueError, r"'mode' must be 'min' or 'max' \(got 'low'\)"),
        ({"patience": 2, "min_delta": -0.1}, ValueError, r"'min_delta' must be a float >= 0 \(got -0.1"),
        ({"patience": 2, "min_delta": math.nan}, ValueError, r"'min_delta' must be a float >= 0 \(got nan"),
    ],
)
def test_bad_arguments_are_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        early_stop("val_loss", **kwargs)
    with pytest.raises(TypeError, match=r"'metric' must be a metric name"):
        early_stop("", patience=2)


def test_a_stopped_run_stays_stopped_when_resumed_under_its_original_max_iter(tmp_path):
    # The saved state's max_iter was lowered by the stop; the template still says 20.
    values = [3.0, 2.0, 2.5, 2.6, 2.7, 1.0, 0.5] + [0.1] * 20

    def step(state, batch):
        return fl.record(state, val=values[state.iteration])

    template = TrainState(max_iter=20)
    hooks = [early_stop("val", patience=3), fl.hooks.checkpoint(tmp_path, keep=None)]
    batches = fl.data.resumable([None] * 20)
    stopped = fl.run(template, step, batches, hooks)
    assert stopped.iteration == stopped.max_iter == 5
    with pytest.warns(fl.checkpoint.RunChanged):
        resumed = fl.checkpoint.resume(tmp_path, like=template)
    assert resumed.max_iter == 20
    final = fl.run(resumed, step, batches, hooks)
    assert final.iteration == final.max_iter == 5  # ended at once: no value 1.0 ever seen


@pytest.mark.parametrize("bad", [math.nan, -math.inf])
def test_a_non_finite_value_never_becomes_the_best_and_says_so(bad):
    # -inf became an unbeatable best; NaN throughout ended the run in silence.
    values = [1.0, bad, 0.5]

    def step(state, batch):
        return fl.record(state, val=values[state.iteration])

    hook = fl.hooks.early_stop("val", patience=5)
    with pytest.warns(fl.hooks.NonFiniteMetric, match=rf"early_stop\('val'.*'val' is {bad} at iteration 1"):
        final = fl.run(fl.TrainState(max_iter=3), step, [None] * 3, [hook])
    memory = final.hooks[fl.state_names(hook)[0]]
    assert (memory.best, memory.best_iteration) == (0.5, 2)
