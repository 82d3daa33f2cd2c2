"""The fold calls only the hooks that can act at a step phase: the run is the same, bit for bit.

The reference is the fold calling the whole chain in every phase (its ``plan``
replaced by one that lists every hook always). Hook lists are drawn with
combinators nested up to three deep, so ``every(2, once(3, on(AFTER_STEP, h)))``
and the like are covered, and a stateful counter and a ``when`` among them.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

import fnloop as fl
import fnloop._core.loop
from fnloop import Phase, TrainState, testing
from fnloop._core.plan import _after, _fires, plan, schedule
from fnloop.testing import Tag


class Unplanned:
    """The plain fold: every hook of the chain is called in every step phase."""

    def __init__(self, hook, phase):
        self.quiet = (hook,)
        self.next = float("inf")

    def __call__(self, iteration):
        return self.quiet


class Declared:
    """A hook that acts in AFTER_STEP only, and says so."""

    acts_in = frozenset({Phase.AFTER_STEP})

    def __init__(self, label):
        self.tag = Tag(label)

    def __call__(self, state, phase):
        return self.tag(state, phase) if phase is Phase.AFTER_STEP else state


def _key(hook):
    # Hooks differ in repr, and stateful ones in name (the fold refuses a clash).
    return fl.state_names(hook) or (repr(hook),)


def _odd(state):
    return state.iteration % 2 == 1


@st.composite
def nested(draw, depth=3):
    k = draw(st.integers(0, 10**6))
    hook = draw(st.sampled_from([Tag(f"t{k}"), testing.counter(f"c{k}"), Declared(f"d{k}")]))
    for _ in range(draw(st.integers(0, depth))):
        kind = draw(st.sampled_from(["every", "on", "once", "when"]))
        if kind == "every":
            hook = fl.every(draw(st.integers(1, 5)), hook)
        elif kind == "on":
            hook = fl.on(draw(st.sets(st.sampled_from(list(Phase)), min_size=1)), hook)
        elif kind == "once":
            hook = fl.once(draw(st.integers(0, 12)), hook)
        else:
            hook = fl.when(_odd, hook)
    return hook


def run(start, max_iter, hooks):
    state = TrainState(max_iter=max_iter, iteration=start)
    return fl.run(state, lambda s, b: s, [None] * (max_iter - start), hooks, clock=lambda: 0.0)


@given(testing.bounds(max_steps=16), st.lists(nested(), max_size=6, unique_by=_key))
def test_the_planned_fold_equals_calling_every_hook(bounds, hooks):
    start, max_iter = bounds
    planned = run(start, max_iter, hooks)
    original = fnloop._core.loop.plan
    fnloop._core.loop.plan = Unplanned
    try:
        plain = run(start, max_iter, hooks)
    finally:
        fnloop._core.loop.plan = original
    testing.assert_identical(planned, plain)


@given(st.lists(nested(), min_size=1, max_size=4, unique_by=_key), st.integers(0, 40))
def test_a_hook_left_out_would_have_changed_nothing(hooks, iteration):
    state = TrainState(max_iter=100, iteration=iteration)
    for phase in (Phase.BEFORE_STEP, Phase.AFTER_STEP):
        due = plan(fl.chain(*hooks), phase)(iteration)
        for hook in fl.chain(*hooks).hooks if len(hooks) > 1 else hooks:
            if hook not in due:
                assert hook(state, phase) is state, (hook, phase, iteration)


@given(st.integers(1, 7), st.integers(0, 50))
def test_after_is_the_next_firing_iteration(period, iteration):
    expected = next(j for j in range(iteration + 1, iteration + 2 * period + 2) if (j + 1) % period == 0)
    assert _after((period, 0), iteration) == expected
    once = (0, 20)  # iteration 19
    assert _after(once, iteration) == (19 if iteration < 19 else math.inf)
    assert _fires(once, 19) and not _fires(once, 18)


def test_schedules_of_the_combinators():
    h = Tag("h")
    assert schedule(h, Phase.AFTER_STEP) == (1, 0)
    assert schedule(fl.every(4, h), Phase.AFTER_STEP) == (4, 0)
    assert schedule(fl.on(Phase.BEFORE_STEP, h), Phase.AFTER_STEP) is None
    assert schedule(fl.every(4, fl.every(6, h)), Phase.AFTER_STEP) == (12, 0)
    assert schedule(fl.every(4, fl.once(7, h)), Phase.BEFORE_STEP) == (0, 8)
    assert schedule(fl.every(4, fl.once(6, h)), Phase.BEFORE_STEP) is None
    assert schedule(fl.when(_odd, fl.every(4, h)), Phase.AFTER_STEP) == (1, 0)  # unknown: always


@pytest.mark.parametrize("n", [1, 3, 10])
def test_twenty_periodic_hooks_are_called_only_where_they_fire(n):
    due = plan(fl.chain(*[fl.every(10, Tag(f"h{k}")) for k in range(20)], Tag("always")), Phase.AFTER_STEP)
    calls = [len(due(i)) for i in range(0, 30, n)]
    assert calls == [21 if (i + 1) % 10 == 0 else 1 for i in range(0, 30, n)]


def test_a_hook_declaring_its_phases_is_not_called_in_the_others():
    hook = Declared("d")
    assert schedule(hook, Phase.BEFORE_STEP) is None
    assert schedule(hook, Phase.AFTER_STEP) == (1, 0)
    assert schedule(fl.every(3, hook), Phase.BEFORE_STEP) is None
    testing.check_hook(hook, TrainState(max_iter=3))


class Liar(Declared):
    def __call__(self, state, phase):
        return self.tag(state, phase)  # acts in every phase, says AFTER_STEP only


def test_check_hook_catches_a_false_declaration():
    with pytest.raises(AssertionError, match=r"declares acts_in=\['AFTER_STEP'\] but changed the state"):
        testing.check_hook(Liar("l"), TrainState(max_iter=3))
