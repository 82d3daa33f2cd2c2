"""The fold's laws: phase protocol, hook order, iteration invariants, failure semantics."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fnloop as fl
from fnloop import Phase, TrainState, testing
from fnloop.testing import Fail, InjectedFailure, Tag


def empty_step(state, batch):
    return state


def run_hooks(start, max_iter, hooks, **kw):
    state = TrainState(max_iter=max_iter, iteration=start)
    return fl.run(state, empty_step, [None] * (max_iter - start), hooks, clock=lambda: 0.0, **kw)


@given(testing.bounds())
def test_phase_trace_is_the_protocol(b):
    start, max_iter = b
    assert testing.phase_trace(max_iter=max_iter, start=start) == testing.expected_trace(start, max_iter)


@given(testing.bounds(), st.integers(1, 6))
def test_hooks_run_in_registration_order_in_every_phase(b, n):
    start, max_iter = b
    final = run_hooks(start, max_iter, [Tag(f"h{k}") for k in range(n)])
    seen = final.extra or ()
    expected = [(f"h{k}", p, i) for p, i in testing.expected_trace(start, max_iter) for k in range(n)]
    assert list(seen) == expected


@given(testing.bounds(), testing.pipelines())
def test_none_entries_are_ignored(b, hooks):
    start, max_iter = b
    with_none = run_hooks(start, max_iter, hooks)
    without = run_hooks(start, max_iter, [h for h in hooks if h is not None])
    testing.assert_identical(with_none, without)


@attrs.frozen
class Witness:
    """Checks the iteration invariant from inside the run."""

    def __call__(self, state, phase, /):
        seen = (*(state.extra or ()), (phase, state.iteration))
        return attrs.evolve(state, extra=seen)


def recording_step(state, batch):
    return attrs.evolve(state, extra=(*(state.extra or ()), ("step", state.iteration)))


@given(testing.bounds())
def test_iteration_is_the_current_index_through_the_step(b):
    start, max_iter = b
    state = TrainState(max_iter=max_iter, iteration=start)
    final = fl.run(state, recording_step, [None] * (max_iter - start), [Witness()])
    seen = list(final.extra or ())
    steps = [x for x in seen if x[0] == "step"]
    assert steps == [("step", i) for i in range(start, max_iter)]
    per_iteration = [x for x in seen if x[0] in (Phase.BEFORE_STEP, "step", Phase.AFTER_STEP)]
    for k in range(0, len(per_iteration), 3):
        assert {x[1] for x in per_iteration[k : k + 3]} == {start + k // 3}
    assert seen[-1] == (Phase.AFTER_TRAIN, max_iter)
    assert final.iteration == max_iter


failures = st.tuples(
    st.sampled_from([Phase.BEFORE_TRAIN, Phase.BEFORE_STEP, "step", Phase.AFTER_STEP]), st.integers(0, 12)
)


class StepFailure(ValueError):
    pass


@given(testing.bounds(), failures, st.integers(0, 3), st.sampled_from([InjectedFailure, KeyboardInterrupt]))
def test_failure_runs_after_train_and_reraises_with_last_consistent_state(b, where, position, error):
    start, max_iter = b
    phase, at = where
    at = start if phase is Phase.BEFORE_TRAIN else start + at % max(1, max_iter - start)
    hooks: list = [testing.recorder("trace"), testing.counter("count"), Tag("t")]
    if phase == "step":

        def step(state, batch):
            if state.iteration == at:
                raise error("step failed")
            return state
    else:
        step = empty_step
        hooks.insert(position % 4, Fail(phase, at, error))
    state = TrainState(max_iter=max_iter, iteration=start)
    fails = phase is Phase.BEFORE_TRAIN or at < max_iter
    seen_at_end = []

    def spy(s, p):
        if p is Phase.AFTER_TRAIN:
            seen_at_end.append(s)
        return s

    if not fails:
        final = fl.run(state, step, [None] * (max_iter - start), [*hooks, spy])
        assert final.iteration == max_iter
        return
    # The reference: the same run, cut before the failing iteration, without the failure.
    without_failure = [h for h in hooks if not isinstance(h, Fail)]
    reference = list(fl.scan(state, empty_step, [None] * (max_iter - start), without_failure))[:-1]
    with pytest.raises(error) as info:
        fl.run(state, step, [None] * (max_iter - start), [*hooks, spy])
    assert type(info.value) is error
    last = info.value.state
    assert len(seen_at_end) == 1
    assert seen_at_end[0].iteration == last.iteration
    if phase is Phase.BEFORE_TRAIN:
        assert last.iteration == start
        assert testing.trace(last) == []
    else:
        assert last.iteration == at < max_iter
        consistent = reference[at - start - 1] if at > start else None
        if consistent is None:
            assert testing.trace(last) == [(Phase.BEFORE_TRAIN, start)]
        else:
            testing.assert_identical(
                attrs.evolve(last, clock=fl.Clock()), attrs.evolve(consistent, clock=fl.Clock())
            )


def test_the_original_traceback_survives():
    def step(state, batch):
        raise StepFailure("boom")

    with pytest.raises(StepFailure, match="boom") as info:
        fl.run(TrainState(max_iter=2), step, [None, None])
    frames = [f.name for f in info.traceback]
    assert frames[-1] == "step"


@given(testing.bounds(), testing.pipelines())
def test_run_is_the_last_of_scan(b, hooks):
    start, max_iter = b
    state = TrainState(max_iter=max_iter, iteration=start)
    batches = [None] * (max_iter - start)
    states = list(fl.scan(state, recording_step, batches, hooks, clock=lambda: 0.0))
    assert [s.iteration for s in states] == [*range(start + 1, max_iter + 1), max_iter]
    testing.assert_identical(states[-1], fl.run(state, recording_step, batches, hooks, clock=lambda: 0.0))


@given(testing.bounds(), st.integers(0, 12), testing.pipelines())
def test_splitting_a_run_equals_the_whole_run(b, k, hooks):
    """run(k) then run(rest) = run(all), but for the one extra AFTER_TRAIN/BEFORE_TRAIN at the split."""
    start, max_iter = b
    split = start + k % (max_iter - start + 1)
    hooks = [testing.recorder("trace"), *hooks]
    state = TrainState(max_iter=max_iter, iteration=start)
    clock = lambda: 0.0  # noqa: E731
    whole = fl.run(state, recording_step, [None] * (max_iter - start), hooks, clock=clock)
    first = fl.run(
        attrs.evolve(state, max_iter=split), recording_step, [None] * (split - start), hooks, clock=clock
    )
    second = fl.run(
        attrs.evolve(first, max_iter=max_iter),
        recording_step,
        [None] * (max_iter - split),
        hooks,
        clock=clock,
    )
    expected = testing.expected_trace(start, max_iter)
    cut = 1 + 2 * (split - start)
    expected = [*expected[:cut], (Phase.AFTER_TRAIN, split), (Phase.BEFORE_TRAIN, split), *expected[cut:]]
    assert testing.trace(second) == expected
    step_calls = [x for x in (second.extra or ()) if x[0] == "step"]
    assert step_calls == [x for x in (whole.extra or ()) if x[0] == "step"]
    assert second.iteration == whole.iteration == max_iter
    # Counters see AFTER_STEP only, so they agree exactly with the unsplit run.
    for name in whole.hooks:
        if name.startswith("c"):
            assert second.hooks[name] == whole.hooks[name]


@given(testing.states())
def test_the_input_state_is_never_changed(state):
    before = list(testing._snapshot(state))
    tensors = {k: (v, v._version) for k, v in state.params.items()}

    def step(s, batch):
        return fl.record(attrs.evolve(s, params={k: v + 1 for k, v in s.params.items()}), loss=1.0)

    hooks = [testing.counter("n"), Tag("x"), fl.every(2, testing.recorder("r"))]
    fl.run(state, step, [None] * (state.max_iter - state.iteration), hooks)
    list(fl.scan(state, step, [None] * (state.max_iter - state.iteration), hooks))
    assert testing._snapshot(state) is not before
    assert all(v._version == version and state.params[k] is v for k, (v, version) in tensors.items())
    assert fl._core.tree.first_difference(before, testing._snapshot(state)) is None


def test_input_tensors_are_not_written():
    w = torch.zeros(3)
    state = TrainState(max_iter=3, params={"w": w})

    def step(s, batch):
        return attrs.evolve(s, params={"w": s.params["w"] + 1})

    final = fl.run(state, step, [None] * 3)
    assert torch.equal(w, torch.zeros(3)) and w._version == 0
    assert torch.equal(final.params["w"], torch.full((3,), 3.0))


@given(
    testing.bounds(),
    st.integers(0, 12),
    st.integers(2, 5),
    st.sampled_from([InjectedFailure, KeyboardInterrupt]),
)
def test_a_failure_where_no_hook_is_due_keeps_the_last_consistent_state(b, at, period, error):
    """As above, with periodic hooks only, so the failing step may fall in an iteration where none is due."""
    start, max_iter = b
    if max_iter == start:
        return
    at = start + at % (max_iter - start)

    def step(state, batch):
        if state.iteration == at:
            raise error("step failed")
        return recording_step(state, batch)

    hooks = [fl.every(period, testing.counter("c")), fl.every(period, Tag("t"))]
    state = TrainState(max_iter=max_iter, iteration=start)
    batches = [None] * (max_iter - start)
    reference = [state, *fl.scan(state, recording_step, batches, hooks, clock=lambda: 0.0)]
    seen_at_end = []

    def spy(s, p):
        if p is Phase.AFTER_TRAIN:
            seen_at_end.append(s)
        return s

    with pytest.raises(error) as info:
        fl.run(state, step, batches, [*hooks, fl.on(Phase.AFTER_TRAIN, spy)], clock=lambda: 0.0)
    last = info.value.state
    assert last.iteration == at and len(seen_at_end) == 1 and seen_at_end[0].iteration == at
    if at > start:  # the input state has not been through BEFORE_TRAIN
        testing.assert_identical(last, reference[at - start])
