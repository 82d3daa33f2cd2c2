"""Combinator laws: chain identity, associativity, None skipping; where every/on/when/once fire."""

from __future__ import annotations

import pickle

from hypothesis import given
from hypothesis import strategies as st

import fnloop as fl
from fnloop import Phase, TrainState, testing
from fnloop.testing import Tag

hooks = st.builds(Tag, st.sampled_from("abcdef"))


def behaviour(hook, start, max_iter):
    final = fl.run(
        TrainState(max_iter=max_iter, iteration=start),
        lambda s, b: s,
        [None] * (max_iter - start),
        [hook],
        clock=lambda: 0.0,
    )
    return final.extra


@given(hooks)
def test_chain_of_nothing_is_identity_and_of_one_is_that_one(h):
    assert fl.chain() is fl.identity
    assert fl.chain(h) is h
    assert fl.chain(None, h, None) is h
    assert fl.chain(fl.identity, h) is h


@given(hooks, hooks, hooks, testing.bounds())
def test_chain_is_associative(a, b, c, bounds):
    left = fl.chain(fl.chain(a, b), c)
    right = fl.chain(a, fl.chain(b, c))
    assert left == right == fl.chain(a, b, c)
    assert behaviour(left, *bounds) == behaviour(right, *bounds)


@given(st.lists(hooks | st.none(), max_size=6), testing.bounds())
def test_none_is_skipped(hs, bounds):
    assert fl.chain(*hs) == fl.chain(*[h for h in hs if h is not None])
    assert behaviour(fl.chain(*hs), *bounds) == behaviour(fl.chain(*[h for h in hs if h]), *bounds)


@given(st.lists(hooks, min_size=2, max_size=4))
def test_composites_pickle_and_compare_equal(hs):
    for composite in (
        fl.chain(*hs),
        fl.every(3, hs[0]),
        fl.on(Phase.AFTER_STEP, hs[1]),
        fl.once(2, fl.chain(*hs)),
        fl.on({Phase.BEFORE_STEP, Phase.AFTER_TRAIN}, hs[0]),
    ):
        assert pickle.loads(pickle.dumps(composite)) == composite


STEP = (Phase.BEFORE_STEP, Phase.AFTER_STEP)
ENDS = (Phase.BEFORE_TRAIN, Phase.AFTER_TRAIN)


@given(st.integers(1, 7), testing.bounds(max_steps=20))
def test_every_fires_after_each_nth_step_and_at_both_ends(n, bounds):
    start, max_iter = bounds
    got = testing.phase_trace(lambda h: fl.every(n, h), max_iter=max_iter, start=start)
    want = [(p, i) for p, i in testing.expected_trace(start, max_iter) if p in ENDS or (i + 1) % n == 0]
    assert got == want


@given(st.sets(st.sampled_from(list(Phase)), min_size=1), testing.bounds())
def test_on_fires_in_its_phases_only(phases, bounds):
    start, max_iter = bounds
    got = testing.phase_trace(lambda h: fl.on(phases, h), max_iter=max_iter, start=start)
    assert got == [(p, i) for p, i in testing.expected_trace(start, max_iter) if p in phases]


@given(st.integers(1, 4), st.integers(0, 3), testing.bounds())
def test_when_fires_where_its_predicate_holds(m, r, bounds):
    start, max_iter = bounds
    got = testing.phase_trace(
        lambda h: fl.when(lambda s: s.iteration % m == r % m, h), max_iter=max_iter, start=start
    )
    assert got == [(p, i) for p, i in testing.expected_trace(start, max_iter) if i % m == r % m]


@given(st.integers(0, 30), testing.bounds())
def test_once_fires_in_the_step_phases_of_its_iteration(k, bounds):
    start, max_iter = bounds
    got = testing.phase_trace(lambda h: fl.once(k, h), max_iter=max_iter, start=start)
    assert got == ([(Phase.BEFORE_STEP, k), (Phase.AFTER_STEP, k)] if start <= k < max_iter else [])


@given(st.integers(1, 5), st.integers(1, 5), testing.bounds())
def test_every_composes_as_the_least_common_multiple_on_steps(n, m, bounds):
    start, max_iter = bounds
    got = testing.phase_trace(lambda h: fl.every(n, fl.every(m, h)), max_iter=max_iter, start=start)
    want = [
        (p, i)
        for p, i in testing.expected_trace(start, max_iter)
        if p in ENDS or ((i + 1) % n == 0 and (i + 1) % m == 0)
    ]
    assert got == want


@given(testing.pipelines(), testing.states(tensors=False))
def test_generated_pipelines_are_good_hooks(pipeline, state):
    testing.check_hook(fl.chain(*pipeline), state)
