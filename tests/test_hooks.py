"""Combinators: repr, pickling, equality, errors."""

from __future__ import annotations

import pickle

import pytest

import fnloop as fl
from fnloop import Phase, TrainState, testing
from fnloop.testing import Tag


def named_hook(state, phase):
    return state


def is_odd(state):
    return state.iteration % 2 == 1


def test_reprs_read_like_the_code_that_built_them():
    assert repr(fl.chain(named_hook, Tag("a"))) == "chain(named_hook, Tag(label='a'))"
    assert repr(fl.every(10, named_hook)) == "every(10, named_hook)"
    assert repr(fl.on(Phase.AFTER_STEP, named_hook)) == "on(Phase.AFTER_STEP, named_hook)"
    assert repr(fl.on([Phase.AFTER_TRAIN, Phase.BEFORE_TRAIN], named_hook)) == (
        "on({Phase.BEFORE_TRAIN, Phase.AFTER_TRAIN}, named_hook)"
    )
    assert repr(fl.when(is_odd, named_hook)) == "when(is_odd, named_hook)"
    assert repr(fl.once(3, named_hook)) == "once(3, named_hook)"
    assert repr(testing.counter("n")) == "stateful('n', _count)"
    assert repr(fl.every(5, fl.chain(named_hook, fl.on(Phase.BEFORE_STEP, named_hook)))) == (
        "every(5, chain(named_hook, on(Phase.BEFORE_STEP, named_hook)))"
    )


@pytest.mark.parametrize(
    "hook",
    [
        fl.chain(named_hook, Tag("a"), None),
        fl.every(3, named_hook),
        fl.on(Phase.AFTER_STEP, Tag("b")),
        fl.when(is_odd, named_hook),
        fl.once(2, named_hook),
        testing.counter("n"),
        fl.every(2, fl.chain(testing.counter("a"), testing.counter("b"))),
    ],
    ids=repr,
)
def test_composites_pickle_compare_and_behave_as_hooks(hook):
    restored = pickle.loads(pickle.dumps(hook))
    assert restored == hook
    assert repr(restored) == repr(hook)
    for i in range(4):
        testing.check_hook(hook, TrainState(max_iter=5, iteration=i))


def test_every_one_is_the_hook_itself():
    assert fl.every(1, named_hook) is named_hook


def returns_none(state, phase):
    return None


def returns_int(state, phase):
    return 3


def test_a_hook_returning_none_is_named():
    with pytest.raises(
        TypeError,
        match=r"hook returns_none returned None \(a NoneType\) in Phase.BEFORE_TRAIN; "
        r"a hook must return a TrainState \(did it forget to `return state`\?\)",
    ):
        fl.run(TrainState(max_iter=1), lambda s, b: s, [None], [returns_none])


@pytest.mark.parametrize("where", [0, 1, 2])
def test_a_hook_returning_something_else_is_named_in_any_phase_and_position(where):
    hooks: list = [named_hook, Tag("x")]
    hooks.insert(where, fl.on(Phase.AFTER_STEP, returns_int))
    with pytest.raises(
        TypeError,
        match=r"hook (on\(Phase.AFTER_STEP, )?returns_int\)? returned 3 \(a int\) in "
        r"Phase.AFTER_STEP",
    ):
        fl.run(TrainState(max_iter=1), lambda s, b: s, [None], hooks)


def test_a_step_returning_something_else_is_named():
    with pytest.raises(
        TypeError,
        match=r"step .* returned \(1, 2\) \(a tuple\) at iteration 0; a step must "
        r"return a TrainState",
    ):
        fl.run(TrainState(max_iter=1), lambda s, b: (1, 2), [None])


def test_state_name_clash_is_refused_when_hooks_are_put_together():
    with pytest.raises(
        ValueError, match=r"two hooks keep their state under the name 'n'.*pass a different name="
    ):
        fl.chain(testing.counter("n"), fl.every(5, testing.counter("n")))
    with pytest.raises(ValueError, match=r"two hooks keep their state under the name 'n'"):
        fl.run(TrainState(max_iter=1), lambda s, b: s, [None], [testing.counter("n"), testing.counter("n")])


def test_different_names_keep_both_states():
    final = fl.run(
        TrainState(max_iter=4),
        lambda s, b: s,
        [None] * 4,
        [testing.counter("a"), fl.every(2, testing.counter("b"))],
    )
    assert final.hooks == {"a": 4, "b": 2}


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: fl.every(0, named_hook), r"'n' must be a positive int \(got 0 that is an int\)"),
        (lambda: fl.every(2.5, named_hook), r"'n' must be a positive int \(got 2.5 that is a float\)"),
        (lambda: fl.once(-1, named_hook), r"'iteration' must be a non-negative int"),
        (lambda: fl.on("after", named_hook), r"on\(\) expected a Phase or a collection of Phases"),
        (lambda: fl.on(Phase.AFTER_STEP, 3), r"on\(\) expected a hook, a callable \(state, phase\) -> state"),
        (lambda: fl.chain(named_hook, "x"), r"chain\(\) expected a hook.*got 'x' \(a str\)"),
        (lambda: fl.when(True, named_hook), r"when\(\) predicate: expected a hook"),
        (lambda: fl.stateful("", 0, named_hook), r"'name' must be a non-empty str"),
    ],
)
def test_combinator_errors(build, match):
    with pytest.raises((TypeError, ValueError), match=match):
        build()


def test_stateful_update_must_return_a_pair():
    bad = fl.stateful("x", 0, lambda s, p, m: s)
    with pytest.raises(TypeError, match=r"stateful hook 'x' .* must return a pair \(state, memory\)"):
        bad(TrainState(max_iter=1), Phase.BEFORE_TRAIN)


def test_stateful_installs_its_initial_state_once_called():
    hook = fl.stateful("x", 7, lambda s, p, m: (s, m))
    assert hook(TrainState(max_iter=1), Phase.BEFORE_TRAIN).hooks == {"x": 7}
