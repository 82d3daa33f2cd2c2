"""The state record: defaults, validators, helpers."""

from __future__ import annotations

import attrs
import pytest
import torch

import fnloop as fl
from fnloop import Metrics, TrainState


def test_defaults():
    s = TrainState(max_iter=5)
    assert (s.iteration, s.max_iter, s.params, s.buffers, s.opt_state) == (0, 5, {}, {}, None)
    assert (s.rng, s.data, s.hooks, s.extra, s.time, s.effects) == (0, 0, {}, None, 0.0, ())
    assert s.metrics == Metrics()


def test_fields_are_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        TrainState(5)  # type: ignore[misc]
    s = TrainState(max_iter=5)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        s.iteration = 3  # type: ignore[misc]


@pytest.mark.parametrize("field", ["iteration", "max_iter", "rng"])
@pytest.mark.parametrize("bad", [-1, 1.0, "3", True, None])
def test_int_fields_refuse_bad_values_on_construction_and_evolve(field, bad):
    kwargs = {"max_iter": 3, field: bad}
    with pytest.raises(ValueError, match=rf"'{field}' must be a non-negative int \(got .* that is an? "):
        TrainState(**kwargs)
    with pytest.raises(ValueError, match=rf"'{field}' must be a non-negative int"):
        attrs.evolve(TrainState(max_iter=3), **{field: bad})


def test_iteration_message_reads_like_attrs():
    with pytest.raises(
        ValueError, match=r"^'iteration' must be a non-negative int \(got -1 that is an int\)\.$"
    ):
        TrainState(max_iter=3, iteration=-1)


@pytest.mark.parametrize(
    ("field", "bad", "match"),
    [
        ("params", [torch.zeros(1)], r"'params' must be a mapping from name to tensor"),
        ("buffers", 3, r"'buffers' must be a mapping from name to tensor"),
        ("hooks", {1: 2}, r"'hooks' must be a mapping keyed by hook name \(str\)"),
        ("clock", 1.0, r"'clock' must be a fnloop.Clock \(got 1.0 that is a float\)"),
        ("effects", [], r"'effects' must be a tuple of fnloop.Effect"),
        ("metrics", {}, r"'metrics' must be a fnloop\.Metrics \(got \{\} that is a dict\)"),
    ],
)
def test_other_validators(field, bad, match):
    with pytest.raises((TypeError, ValueError), match=match):
        attrs.evolve(TrainState(max_iter=1), **{field: bad})


def test_the_state_validates_its_clocks_readings():
    with pytest.raises(TypeError, match=r"'clock.time' must be a float \(got 'now' that is a str\)"):
        TrainState(max_iter=1, clock=fl.Clock(time="now"))


def test_the_clock_fields_read_through_the_state():
    state = TrainState(max_iter=1, clock=fl.Clock(time=1.0, data_time=2.0, step_time=3.0))
    assert (state.time, state.data_time, state.step_time) == (1.0, 2.0, 3.0)


@pytest.mark.parametrize("bad", [0, -2, 1.5])
def test_metrics_window_validator(bad):
    with pytest.raises(ValueError, match=r"'window' must be a positive int"):
        Metrics(window=bad)


def test_record_keeps_tensors_as_tensors():
    loss = torch.tensor(0.25)
    s = fl.record(TrainState(max_iter=1), loss=loss)
    assert s.metrics.latest("loss")[1] is loss
    assert s.metrics.latest_float("loss") == (0, 0.25)


def test_unknown_metric_names_what_is_recorded():
    m = Metrics().record(0, {"loss": 1.0})
    with pytest.raises(
        KeyError, match=r"no metric named 'acc' has been recorded; recorded names: \['loss'\]"
    ):
        m.latest("acc")


def test_merge_refuses_different_windows():
    a = Metrics(window=3).record(0, {"x": 1.0})
    b = Metrics(window=4).record(0, {"x": 1.0})
    with pytest.raises(ValueError, match=r"cannot merge metrics with window 3 and window 4"):
        a.merge(b)


def test_hook_state_helpers():
    s = fl.with_hook_state(TrainState(max_iter=1), "timer", 3)
    assert fl.hook_state(s, "timer") == 3
    assert fl.hook_state(s, "other", None) is None
    with pytest.raises(KeyError, match=r"no hook state named 'other'; states present: \['timer'\]"):
        fl.hook_state(s, "other")


def test_request_appends_effects():
    s = fl.request(fl.request(TrainState(max_iter=1), print, "a"), print, "b")
    assert [e.label for e in s.effects] == ["a", "b"]
