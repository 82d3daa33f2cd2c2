"""Metrics merge laws: associative, with the empty record as identity; recording is merging."""

from __future__ import annotations

import statistics

import torch
from hypothesis import given
from hypothesis import strategies as st

from fnloop import Metrics, testing
from fnloop._core.tree import first_difference


def _same(a: Metrics, b: Metrics) -> bool:
    return first_difference(a, b) is None


@given(testing.metrics(), testing.metrics(), testing.metrics())
def test_merge_is_associative(a, b, c):
    assert _same(a.merge(b).merge(c), a.merge(b.merge(c)))


@given(testing.metrics())
def test_the_empty_record_is_the_identity(m):
    empty = Metrics(window=m.window)
    assert _same(empty.merge(m), m)
    assert _same(m.merge(empty), m)
    assert _same(Metrics(window=99).merge(m), m)


@given(testing.metrics(), st.integers(0, 20), st.floats(-10, 10))
def test_recording_is_merging_a_single_entry(m, i, v):
    assert _same(m.record(i, {"loss": v}), m.merge(Metrics(window=m.window).record(i, {"loss": v})))


@given(testing.metrics(window=3))
def test_window_bounds_every_series(m):
    assert all(len(entries) <= 3 for entries in m.series.values())


@given(st.lists(st.floats(-100, 100, allow_nan=False, width=32), min_size=1, max_size=10))
def test_smoothing_matches_plain_python(values):
    m = Metrics(window=10)
    for i, v in enumerate(values):
        m = m.record(i, {"x": torch.tensor(v) if i % 2 else v})
    assert m.median("x") == statistics.median([float(torch.tensor(v)) for v in values])
    assert abs(m.mean("x", window=3) - statistics.fmean([float(torch.tensor(v)) for v in values][-3:])) < 1e-9
    assert m.latest("x")[0] == len(values) - 1


@given(
    testing.metrics(names=("loss", "time", "data_time")),
    st.integers(0, 20),
    st.floats(0, 10),
    st.floats(0, 10),
)
def test_recording_a_pair_is_recording_both(m, i, a, b):
    pair = m.record_pair(i, "time", a, "data_time", b)
    assert first_difference(pair, m.record(i, {"time": a, "data_time": b})) is None
    assert pair.window == m.window


@given(
    testing.metrics(names=("loss", "lr")),
    st.integers(0, 20),
    st.integers(0, 12).flatmap(
        lambda n: st.dictionaries(
            st.sampled_from(["loss", "lr", "skipped"]), st.lists(st.floats(-5, 5), min_size=n, max_size=n)
        )
    ),
)
def test_recording_steps_is_recording_each_iteration(m, first, columns):
    one_by_one = m
    for j in range(max((len(c) for c in columns.values()), default=0)):
        one_by_one = one_by_one.record(first + j, {name: column[j] for name, column in columns.items()})
    steps = m.record_steps(first, columns)
    assert first_difference(steps, one_by_one) is None
    assert steps.window == m.window
