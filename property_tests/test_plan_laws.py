"""The fold calls only the hooks that can act at a step phase: the run is the same, bit for bit.

The reference is a plain fold written here from the documented protocol: it
calls the whole chain in every phase and performs the effects each phase asks
for. Hook lists are drawn with combinators nested up to three deep, so
``every(2, once(3, on(AFTER_STEP, h)))`` and the like are covered, with
stateful hooks, ``when``, hooks declaring ``acts_in`` and hooks requesting
effects among them. Both runs must end in the same state, yield the same
states, and perform the same effects on the same states in the same order.
"""

from __future__ import annotations

import functools
import math

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fnloop as fl
from fnloop import Phase, TrainState, testing
from fnloop._core.plan import off_boundaries, plan
from fnloop.testing import Tag

PERFORMED: list = []


def _note(label, start, state):
    PERFORMED.append((label, start, state.iteration, state.extra, dict(state.hooks), state.effects))


@attrs.frozen
class Ask:
    """A hook requesting an effect wherever it is called; performing it notes the state it got."""

    label: str
    start: bool

    def __call__(self, state, phase):
        return fl.request(
            state, functools.partial(_note, f"{self.label}:{phase.name}", self.start), start=self.start
        )


def _remember(state, phase, memory):
    return state, (*memory, (phase.name, state.iteration))


def plain_scan(state, step, batches, hooks):
    """The documented protocol, every hook called in every phase; yields as ``fnloop.scan`` does."""
    hook = fl.chain(*hooks)
    clock = 0.0

    def phase(began, p, ended=lambda s: s):
        s = hook(began, p)
        effects, s = s.effects, ended(attrs.evolve(s, effects=()))
        for e in effects:
            e.perform(attrs.evolve(began, effects=()) if e.start else s)
        return s

    state = phase(attrs.evolve(state, clock=fl.Clock(time=clock)), Phase.BEFORE_TRAIN)
    batches = iter(batches)
    while state.iteration < state.max_iter:
        i = state.iteration
        state = phase(attrs.evolve(state, clock=fl.Clock(time=clock)), Phase.BEFORE_STEP)
        cursor = state.data
        state = step(state, next(batches))
        state = phase(
            attrs.evolve(state, clock=fl.Clock(time=clock)),
            Phase.AFTER_STEP,
            lambda s: attrs.evolve(s, iteration=i + 1, data=cursor, clock=fl.Clock(time=s.time)),  # noqa: B023
        )
        yield state
    yield phase(attrs.evolve(state, clock=fl.Clock(time=clock)), Phase.AFTER_TRAIN)


class Declared:
    """A hook that acts in AFTER_STEP only, and says so."""

    acts_in = frozenset({Phase.AFTER_STEP})

    def __init__(self, label):
        self.tag = Tag(label)

    def __call__(self, state, phase):
        return self.tag(state, phase) if phase is Phase.AFTER_STEP else state


@attrs.frozen
class RememberAfterStep:
    """A stateful update that acts in AFTER_STEP only, and says so."""

    acts_in = frozenset({Phase.AFTER_STEP})

    def __call__(self, state, phase, memory):
        return (state, (*memory, state.iteration)) if phase is Phase.AFTER_STEP else (state, memory)


S = fl.Schedule
schedule = S.of


@attrs.frozen
class EveryFrom:
    """A user's combinator: ``hook`` in the step phases every ``n`` completed steps from ``start`` on.

    It declares its schedule as the library's combinators do, so the fold can skip it.
    """

    n: int
    start: int
    hook: object

    def __call__(self, state, phase):
        done = state.iteration + 1
        step_phase = phase in (Phase.BEFORE_STEP, Phase.AFTER_STEP)
        if step_phase and (done < self.start or (done - self.start) % self.n):
            return state
        return self.hook(state, phase)

    def acts_at(self, phase):
        return S(self.n, self.start).both(S.of(self.hook, phase))

    @property
    def state_names(self):
        return fl.state_names(self.hook)


def _key(hook):
    # Hooks differ in repr, and stateful ones in name (the fold refuses a clash).
    return fl.state_names(hook) or (repr(hook),)


def _odd(state):
    return state.iteration % 2 == 1


@st.composite
def nested(draw, depth=3):
    k = draw(st.integers(0, 10**6))
    hook = draw(
        st.sampled_from(
            [
                Tag(f"t{k}"),
                testing.counter(f"c{k}"),
                fl.stateful(f"s{k}", (), _remember),
                Declared(f"d{k}"),
                fl.stateful(f"r{k}", (), RememberAfterStep()),
                Ask(f"a{k}", False),
                Ask(f"a{k}", True),
            ]
        )
    )
    for _ in range(draw(st.integers(0, depth))):
        kind = draw(st.sampled_from(["every", "on", "once", "when", "from"]))
        if kind == "from":
            hook = EveryFrom(draw(st.integers(1, 4)), draw(st.integers(0, 6)), hook)
        elif kind == "every":
            hook = fl.every(draw(st.integers(1, 5)), hook)
        elif kind == "on":
            hook = fl.on(draw(st.sets(st.sampled_from(list(Phase)), min_size=1)), hook)
        elif kind == "once":
            hook = fl.once(draw(st.integers(0, 12)), hook)
        else:
            hook = fl.when(_odd, hook)
    return hook


def recording_step(state, batch):
    return attrs.evolve(state, extra=(*(state.extra or ()), ("step", state.iteration)))


def both(start, max_iter, hooks):
    """(states, effects) of the fold and of the plain reference, on the same run."""
    state = TrainState(max_iter=max_iter, iteration=start)
    batches = [None] * (max_iter - start)
    runs = []
    for fold in (functools.partial(fl.scan, clock=lambda: 0.0), plain_scan):
        PERFORMED.clear()
        runs.append((list(fold(state, recording_step, batches, hooks)), list(PERFORMED)))
    return runs


@given(testing.bounds(max_steps=16), st.lists(nested(), max_size=6, unique_by=_key))
def test_the_planned_fold_equals_calling_every_hook(bounds, hooks):
    (planned, planned_effects), (plain, plain_effects) = both(*bounds, hooks)
    testing.assert_identical(planned, plain)
    assert planned_effects == plain_effects


@given(testing.bounds(max_steps=16), st.lists(nested(), max_size=6, unique_by=_key))
def test_run_equals_the_plain_fold(bounds, hooks):
    start, max_iter = bounds
    (_, _), (plain, plain_effects) = both(start, max_iter, hooks)
    PERFORMED.clear()
    state = TrainState(max_iter=max_iter, iteration=start)
    final = fl.run(state, recording_step, [None] * (max_iter - start), hooks, clock=lambda: 0.0)
    testing.assert_identical(final, plain[-1])
    assert plain_effects == PERFORMED


def test_twenty_periodic_stateful_hooks_end_as_when_all_are_called():
    hooks = [fl.every(10, fl.on(Phase.AFTER_STEP, fl.stateful(f"h{k}", (), _remember))) for k in range(20)]
    (planned, _), (plain, _) = both(3, 45, [*hooks, Ask("a", False)])
    testing.assert_identical(planned, plain)
    assert planned[-1].hooks["h0"] == tuple(("AFTER_STEP", i) for i in range(9, 45, 10))


@given(st.lists(nested(), min_size=1, max_size=4, unique_by=_key), st.integers(0, 40))
def test_a_hook_left_out_would_have_changed_nothing(hooks, iteration):
    state = TrainState(max_iter=100, iteration=iteration)
    for phase in (Phase.BEFORE_STEP, Phase.AFTER_STEP):
        due = plan(fl.chain(*hooks), phase).hooks(iteration)
        for hook in fl.chain(*hooks).hooks if len(hooks) > 1 else hooks:
            if hook not in due:
                assert hook(state, phase) is state, (hook, phase, iteration)


@given(st.integers(1, 7), st.integers(0, 50))
def test_after_is_the_next_firing_iteration(period, iteration):
    expected = next(j for j in range(iteration + 1, iteration + 2 * period + 2) if (j + 1) % period == 0)
    assert S.every(period).after(iteration) == expected
    once = S.at(19)
    assert once.after(iteration) == (19 if iteration < 19 else math.inf)
    assert once.fires(19) and not once.fires(18)


@given(st.integers(1, 6), st.integers(0, 8), st.integers(1, 6), st.integers(0, 8), st.integers(0, 60))
def test_both_is_the_intersection(p, a, q, b, iteration):
    one, other = S(p, a), S(q, b)
    met = one.both(other)
    assert (met is not None and met.fires(iteration)) == (one.fires(iteration) and other.fires(iteration))
    assert met == other.both(one)


def test_schedules_of_the_combinators():
    h = Tag("h")
    assert schedule(h, Phase.AFTER_STEP) == S(1, 0)
    assert schedule(fl.every(4, h), Phase.AFTER_STEP) == S(4, 0)
    assert schedule(fl.on(Phase.BEFORE_STEP, h), Phase.AFTER_STEP) is None
    assert schedule(fl.every(4, fl.every(6, h)), Phase.AFTER_STEP) == S(12, 0)
    assert schedule(fl.every(4, fl.once(7, h)), Phase.BEFORE_STEP) == S(0, 8)
    assert schedule(fl.every(4, fl.once(6, h)), Phase.BEFORE_STEP) is None
    # `when` acts at most where its hook may; its predicate is tested where it is called.
    assert schedule(fl.when(_odd, fl.every(4, h)), Phase.AFTER_STEP) == S(4, 0)
    assert schedule(fl.when(_odd, fl.on(Phase.AFTER_TRAIN, h)), Phase.AFTER_STEP) is None


def test_a_users_combinator_is_scheduled_from_what_it_declares():
    hook = EveryFrom(3, 5, Tag("h"))
    assert schedule(hook, Phase.AFTER_STEP) == S(3, 5)
    due = plan(fl.chain(hook, Tag("always")), Phase.AFTER_STEP)
    called = [i for i in range(20) if hook in due.hooks(i)]
    assert called == [4, 7, 10, 13, 16, 19]
    trace = testing.phase_trace(lambda h: EveryFrom(3, 5, fl.on(Phase.AFTER_STEP, h)), max_iter=12)
    assert [i for _, i in trace] == [4, 7, 10]


def test_a_hook_holding_a_learning_rate_schedule_is_not_taken_for_a_declaration():
    @attrs.frozen
    class LogsTheRate:
        schedule: object = fl.optim.cosine(0.1, 10)

        def __call__(self, state, phase):
            return state

    assert schedule(LogsTheRate(), Phase.AFTER_STEP) == S(1, 0)
    fl.run(TrainState(max_iter=2), lambda s, b: s, [None] * 2, [LogsTheRate()])


def test_a_schedule_of_another_type_is_refused():
    class Wrong:
        def __call__(self, state, phase):
            return state

        def acts_at(self, phase):
            return (1, 0)

    with pytest.raises(TypeError, match=r"acts_at\(Phase.BEFORE_STEP\) returned \(1, 0\); a hook's schedule"):
        fl.run(TrainState(max_iter=1), lambda s, b: s, [None], [Wrong()])


@pytest.mark.parametrize("n", [1, 3, 10])
def test_twenty_periodic_hooks_are_called_only_where_they_fire(n):
    due = plan(fl.chain(*[fl.every(10, Tag(f"h{k}")) for k in range(20)], Tag("always")), Phase.AFTER_STEP)
    calls = [len(due(i)) for i in range(0, 30, n)]
    assert calls == [21 if (i + 1) % 10 == 0 else 1 for i in range(0, 30, n)]


def test_a_stateful_hook_takes_the_phases_its_update_declares():
    hook = fl.stateful("r", (), RememberAfterStep())
    assert hook.acts_in == frozenset({Phase.AFTER_STEP})
    assert schedule(hook, Phase.BEFORE_STEP) is None
    assert schedule(fl.every(4, hook), Phase.AFTER_STEP) == S(4, 0)
    state = TrainState(max_iter=3)
    assert hook(state, Phase.BEFORE_TRAIN) is state  # not even its first memory is stored there
    testing.check_hook(hook, state)


def test_a_hook_declaring_its_phases_is_not_called_in_the_others():
    hook = Declared("d")
    assert schedule(hook, Phase.BEFORE_STEP) is None
    assert schedule(hook, Phase.AFTER_STEP) == S(1, 0)
    assert schedule(fl.every(3, hook), Phase.BEFORE_STEP) is None
    testing.check_hook(hook, TrainState(max_iter=3))


class Liar(Declared):
    def __call__(self, state, phase):
        return self.tag(state, phase)  # acts in every phase, says AFTER_STEP only


def test_check_hook_catches_a_false_declaration():
    with pytest.raises(AssertionError, match=r"declares acts_in=\['AFTER_STEP'\] but changed the state"):
        testing.check_hook(Liar("l"), TrainState(max_iter=3))


def test_a_due_hook_is_called_without_the_wrappers_its_schedule_has_passed():
    inner = Tag("h")
    outer = fl.every(10, fl.on(Phase.AFTER_STEP, fl.once(19, inner)))
    due = plan(fl.chain(outer, fl.when(_odd, inner)), Phase.AFTER_STEP)
    assert due(9) == ((fl.when(_odd, inner), fl.when(_odd, inner)),)  # when() decides at run time
    assert due(19) == ((inner, outer), (fl.when(_odd, inner), fl.when(_odd, inner)))
    again = plan(fl.chain(outer, fl.when(_odd, inner)), Phase.AFTER_STEP)  # a plan is asked in order
    assert again.hooks(19) == (outer, fl.when(_odd, inner))


def test_an_unwrapped_hook_that_returns_no_state_is_named_as_registered():
    def forgetful(state, phase):
        return None if phase is Phase.BEFORE_STEP else state

    with pytest.raises(
        TypeError, match=r"hook every\(3, \S*forgetful\) returned None .* in Phase.BEFORE_STEP"
    ):
        fl.run(TrainState(max_iter=4), lambda s, b: s, [None] * 4, [fl.every(3, forgetful)])


# --------------------------------------------------------------------------- several steps per call


@given(st.lists(nested(), max_size=5, unique_by=_key), st.integers(2, 4))
def test_off_boundaries_finds_a_hook_exactly_when_one_may_act_inside_a_call(hooks, k):
    hook = fl.chain(*hooks)
    boundary = {Phase.BEFORE_STEP: lambda i: i % k == 0, Phase.AFTER_STEP: lambda i: (i + 1) % k == 0}
    inside = {
        phase: [i for i in range(130) if plan(hook, phase).hooks(i) and not boundary[phase](i)]
        for phase in boundary
    }
    found = off_boundaries(hook, k)
    assert (found is None) == (not inside[Phase.BEFORE_STEP] and not inside[Phase.AFTER_STEP])
    if found is not None:
        registered, phase, iteration = found
        assert iteration in inside[phase]
        due = plan(hook, phase)
        assert registered in due.hooks(iteration)


@attrs.frozen
class Several:
    """A step of ``steps_per_call`` iterations per call, made of single recording steps."""

    steps_per_call: int

    def __call__(self, state, batch):
        return recording_step(state, batch)

    def steps(self, state, batches):
        first = state.iteration
        for j, batch in enumerate(batches):
            state = recording_step(attrs.evolve(state, iteration=first + j), batch)
        return state


@st.composite
def at_boundaries(draw, k):
    """A hook that acts only at the boundaries of calls of ``k`` steps."""
    hook = draw(nested(depth=1))
    if draw(st.booleans()):
        return fl.on(Phase.AFTER_STEP, fl.every(k * draw(st.integers(1, 3)), hook))
    return fl.on(Phase.BEFORE_STEP, fl.once(k * draw(st.integers(0, 4)), hook))


@given(
    testing.bounds(max_steps=20),
    st.integers(2, 4).flatmap(
        lambda k: st.tuples(st.just(k), st.lists(at_boundaries(k), max_size=5, unique_by=_key))
    ),
)
def test_a_run_of_several_steps_per_call_equals_the_plain_fold(bounds, k_hooks):
    k, hooks = k_hooks
    start, max_iter = bounds
    (_, _), (plain, plain_effects) = both(start, max_iter, hooks)
    PERFORMED.clear()
    state = TrainState(max_iter=max_iter, iteration=start)
    final = fl.run(state, Several(k), [None] * (max_iter - start), hooks, clock=lambda: 0.0)
    testing.assert_identical(final, plain[-1])
    assert plain_effects == PERFORMED


def test_a_hook_acting_inside_a_call_is_refused():
    with pytest.raises(ValueError, match=r"steps_per_call=4: the hook every\(6, .*AFTER_STEP of iteration 5"):
        fl.run(TrainState(max_iter=8), Several(4), [None] * 8, [fl.every(6, Declared("d"))])
