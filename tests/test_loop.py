"""The fold: errors, effects, early stop, clocks, resumable streams."""

from __future__ import annotations

import os
import signal

import attrs
import pytest

import fnloop as fl
from fnloop import Phase, TrainState, testing


def empty_step(state, batch):
    return state


def test_a_run_past_max_iter_is_refused():
    with pytest.raises(
        ValueError,
        match=r"cannot run from iteration 5: it is past max_iter=3. To train further, "
        r"raise max_iter",
    ):
        fl.run(TrainState(max_iter=3, iteration=5), empty_step, [])


def test_a_run_at_max_iter_runs_no_step_but_both_ends():
    assert testing.phase_trace(max_iter=3, start=3) == [(Phase.BEFORE_TRAIN, 3), (Phase.AFTER_TRAIN, 3)]


def test_not_a_state_is_refused():
    with pytest.raises(TypeError, match=r"run\(\) expected a fnloop.TrainState as its first argument, got 3"):
        fl.run(3, empty_step, [])  # type: ignore[arg-type]


def test_a_single_hook_instead_of_a_list_is_refused_with_the_fix():
    with pytest.raises(TypeError, match=r"expected a sequence of hooks, got a single hook .*; pass \[hook\]"):
        fl.run(TrainState(max_iter=1), empty_step, [None], testing.Tag("x"))  # type: ignore[arg-type]


def test_running_out_of_batches_is_a_clear_failure_with_the_state():
    with pytest.raises(
        fl.BatchesExhausted, match=r"the batches ran out at iteration 2 \(max_iter=5\)"
    ) as info:
        fl.run(TrainState(max_iter=5), empty_step, [1, 2])
    assert info.value.state.iteration == 2


def test_a_hook_may_not_move_the_iteration():
    def jump(state, phase):
        return attrs.evolve(state, iteration=state.iteration + 1) if phase is Phase.AFTER_STEP else state

    with pytest.raises(
        RuntimeError, match=r"state.iteration changed from 0 to 1 during iteration 0; only the fold"
    ):
        fl.run(TrainState(max_iter=3), empty_step, [None] * 3, [jump])


def stop_after_two(state, phase):
    if phase is Phase.AFTER_STEP and state.iteration == 1:
        return attrs.evolve(state, max_iter=state.iteration + 1)
    return state


def test_lowering_max_iter_ends_the_run_early_as_a_success():
    seen = []
    final = fl.run(
        TrainState(max_iter=10),
        empty_step,
        [None] * 10,
        [stop_after_two, lambda s, p: (seen.append((p, s.iteration, s.max_iter)), s)[1]],
    )
    assert final.iteration == final.max_iter == 2
    assert seen[-1] == (Phase.AFTER_TRAIN, 2, 2)


def test_effects_run_after_the_whole_phase_on_the_finished_state():
    performed = []

    def save(state, phase):
        if phase is Phase.AFTER_STEP:
            return fl.request(state, lambda s: performed.append((s.iteration, s.extra, s.effects)), "save")
        return state

    def later(state, phase):
        return attrs.evolve(state, extra="seen by the effect") if phase is Phase.AFTER_STEP else state

    final = fl.run(TrainState(max_iter=2), empty_step, [None] * 2, [save, later])
    # Requested in AFTER_STEP of step i: performed with iteration == i + 1, after `later` ran, effects cleared.
    assert performed == [(1, "seen by the effect", ()), (2, "seen by the effect", ())]
    assert final.effects == ()


def test_effects_can_be_turned_off_for_a_dry_replay():
    performed = []
    hook = fl.on(Phase.AFTER_STEP, lambda s, p: fl.request(s, performed.append))
    final = fl.run(TrainState(max_iter=3), empty_step, [None] * 3, [hook], effects=False)
    assert performed == [] and final.effects == ()


def test_the_clock_enters_the_state_at_each_phase_and_times_the_batch():
    # The fold reads the clock at each phase and around fetching each batch.
    ticks = iter(range(100))
    seen = []
    fl.run(
        TrainState(max_iter=2),
        empty_step,
        [None] * 2,
        [lambda s, p: (seen.append((p.name, s.time, s.data_time, s.step_time)), s)[1]],
        clock=lambda: float(next(ticks)) ** 2,
    )
    assert seen == [
        ("BEFORE_TRAIN", 0.0, 0.0, 0.0),
        ("BEFORE_STEP", 1.0, 0.0, 0.0),
        ("AFTER_STEP", 16.0, 9.0 - 4.0, 16.0 - 1.0),
        ("BEFORE_STEP", 25.0, 0.0, 0.0),
        ("AFTER_STEP", 64.0, 49.0 - 36.0, 64.0 - 25.0),
        ("AFTER_TRAIN", 81.0, 0.0, 0.0),
    ]


def ticking():
    ticks = iter(range(1000))
    return lambda: float(next(ticks))


def seeing_step(seen):
    def step(state, batch):
        seen.append(("step", state.iteration, state.time, state.data_time, state.step_time))
        return state

    return step


def test_with_no_hook_due_the_clock_is_read_once_per_iteration():
    # Nobody can see a step phase's clock when no hook is due there: the step gets the
    # state the last iteration ended with, and each iteration reads the clock once.
    seen = []
    states = list(fl.scan(TrainState(max_iter=3), seeing_step(seen), [None] * 3, clock=ticking()))
    assert seen == [("step", 0, 0.0, 0.0, 0.0), ("step", 1, 1.0, 0.0, 0.0), ("step", 2, 2.0, 0.0, 0.0)]
    assert [(s.iteration, s.time) for s in states] == [(1, 1.0), (2, 2.0), (3, 3.0), (3, 4.0)]


def test_an_after_step_hook_alone_still_sees_the_batch_and_the_step_timed():
    seen = []
    hook = fl.on(
        Phase.AFTER_STEP, lambda s, p: (seen.append((p.name, s.time, s.data_time, s.step_time)), s)[1]
    )
    fl.run(TrainState(max_iter=2), seeing_step(seen), [None] * 2, [hook], clock=ticking())
    # BEFORE_TRAIN 0; then per iteration: start, fetching, fetched, the step's end.
    assert seen == [
        ("step", 0, 0.0, 0.0, 0.0),
        ("AFTER_STEP", 4.0, 3.0 - 2.0, 4.0 - 1.0),
        ("step", 1, 4.0, 0.0, 0.0),
        ("AFTER_STEP", 8.0, 7.0 - 6.0, 8.0 - 5.0),
    ]


def test_periodic_hooks_see_the_clock_of_their_own_iteration():
    seen = []
    hook = fl.every(3, lambda s, p: (seen.append((p.name, s.iteration, s.time)), s)[1])
    clock = ticking()
    final = fl.run(TrainState(max_iter=6), empty_step, [None] * 6, [hook], clock=clock)
    assert [x[:2] for x in seen] == [
        ("BEFORE_TRAIN", 0),
        ("BEFORE_STEP", 2),
        ("AFTER_STEP", 2),
        ("BEFORE_STEP", 5),
        ("AFTER_STEP", 5),
        ("AFTER_TRAIN", 6),
    ]
    times = [t for _, _, t in seen]
    assert times == sorted(times) and len(set(times)) == len(times)
    assert final.time == times[-1] == clock() - 1


def test_a_step_that_moves_the_iteration_fails_where_no_hook_is_due():
    def jump(state, batch):
        return attrs.evolve(state, iteration=state.iteration + 2) if state.iteration == 2 else state

    with pytest.raises(RuntimeError, match=r"state.iteration changed from 2 to 4 during iteration 2") as info:
        fl.run(TrainState(max_iter=9), jump, [None] * 9, [fl.every(4, testing.Tag("t"))])
    assert info.value.state.iteration == 2


def test_effects_a_step_requests_are_performed_where_no_hook_is_due():
    performed = []

    def step(state, batch):
        return fl.request(state, lambda s: performed.append(s.iteration))

    final = fl.run(TrainState(max_iter=3), step, [None] * 3, [fl.every(2, testing.Tag("t"))])
    assert performed == [1, 2, 3] and final.effects == ()


def test_a_step_returning_something_else_is_named_where_no_hook_is_due():
    def step(state, batch):
        return state if state.iteration < 2 else None

    with pytest.raises(
        TypeError, match=r"returned None \(a NoneType\) at iteration 2; a step must return a TrainState"
    ):
        fl.run(TrainState(max_iter=4), step, [None] * 4)


def test_the_clock_of_an_iteration_is_not_saved(tmp_path):
    state = attrs.evolve(TrainState(max_iter=1), clock=fl.Clock(data_time=1.5, step_time=2.5))
    fl.save(state, tmp_path / "s.safetensors")
    loaded = fl.load(tmp_path / "s.safetensors", like=TrainState(max_iter=1))
    assert (loaded.data_time, loaded.step_time) == (0.0, 0.0)


class Stream:
    """A resumable stream of ints: batch k is k."""

    def iter_from(self, cursor):
        k = cursor
        while True:
            yield k, k + 1
            k += 1


def test_a_resumable_stream_continues_from_the_cursor_in_the_state():
    got = []
    step = lambda s, b: (got.append(b), s)[1]  # noqa: E731
    first = fl.run(TrainState(max_iter=3), step, Stream())
    assert first.data == 3
    fl.run(attrs.evolve(first, max_iter=5), step, Stream())
    assert got == [0, 1, 2, 3, 4]


def test_after_train_failure_during_a_failure_keeps_the_original():
    def broken_end(state, phase):
        if phase is Phase.AFTER_TRAIN:
            raise OSError("disk full")
        return state

    def step(state, batch):
        raise ZeroDivisionError("loss")

    with pytest.raises(ZeroDivisionError) as info:
        fl.run(TrainState(max_iter=2), step, [None] * 2, [broken_end])
    assert "AFTER_TRAIN hooks then also failed: OSError: disk full" in info.value.__notes__[0]


def test_closing_a_scan_early_runs_after_train():
    seen = []
    hook = fl.on(Phase.AFTER_TRAIN, lambda s, p: (seen.append(s.iteration), s)[1])
    states = fl.scan(TrainState(max_iter=10), empty_step, [None] * 10, [hook])
    next(states), next(states)
    states.close()
    assert seen == [2]


def test_donating_variant_is_used_only_for_states_the_fold_owns():
    calls = []

    class Step:
        def __call__(self, state, batch):
            calls.append(("plain", state.iteration))
            return state

        def donating(self, state, batch):
            calls.append(("donating", state.iteration))
            return state

    fl.run(TrainState(max_iter=3), Step(), [None] * 3)
    assert calls == [("plain", 0), ("donating", 1), ("donating", 2)]
    calls.clear()
    list(fl.scan(TrainState(max_iter=3), Step(), [None] * 3))
    assert calls == [("plain", 0), ("plain", 1), ("plain", 2)]


def _as_is(data, like, where):
    if type(data) is not type(like):
        raise ValueError(f"{where}: expected {type(like).__name__}, got {type(data).__name__}")
    return data


def test_unclaimed_hook_states_are_claimed_by_their_hook_or_dropped_with_a_warning():
    loaded = TrainState(
        max_iter=2,
        hooks={
            "count": fl.Unclaimed(5, _as_is, "ckpt-1.safetensors: hooks['count']"),
            "gone": fl.Unclaimed(1, _as_is, "ckpt-1.safetensors: hooks['gone']"),
        },
    )
    with pytest.warns(
        fl.UnclaimedHookState,
        match=r"the hook state 'gone' \(ckpt-1.safetensors: hooks\['gone'\]\) "
        r"belongs to no hook of this run; it is dropped",
    ):
        final = fl.run(loaded, empty_step, [None] * 2, [testing.counter("count")])
    assert final.hooks == {"count": 7}


def test_a_claimed_state_is_checked_against_the_hooks_initial_state():
    loaded = TrainState(max_iter=2, hooks={"count": fl.Unclaimed("five", _as_is, "f: hooks['count']")})
    with pytest.raises(ValueError, match=r"f: hooks\['count'\]: expected int, got str"):
        fl.run(loaded, empty_step, [None] * 2, [testing.counter("count")])


def signalling_step(signum, at, times=1):
    def step(state, batch):
        if state.iteration == at:
            for _ in range(times):
                os.kill(os.getpid(), signum)
        return attrs.evolve(state, extra=(state.extra or 0) + 1)

    return step


def test_sigterm_finishes_the_step_runs_after_train_and_never_looks_like_success():
    seen = []
    end = fl.on(Phase.AFTER_TRAIN, lambda s, p: (seen.append(s.iteration), s)[1])
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(fl.Preempted) as info:
        fl.run(TrainState(max_iter=10), signalling_step(signal.SIGTERM, 3), [None] * 10, [end])
    assert info.value.code == 128 + signal.SIGTERM
    assert "stopped by SIGTERM after the current step" in str(info.value)
    assert info.value.state.iteration == 4 and info.value.state.extra == 4  # step 3 finished
    assert seen == [4]
    assert signal.getsignal(signal.SIGTERM) is before


def test_sigint_raises_keyboard_interrupt_with_the_state():
    with pytest.raises(KeyboardInterrupt) as info:
        fl.run(TrainState(max_iter=10), signalling_step(signal.SIGINT, 0), [None] * 10)
    assert info.value.state.iteration == 1


def test_a_second_sigint_still_waits_for_the_end_of_the_step():
    with pytest.raises(KeyboardInterrupt) as info:
        fl.run(TrainState(max_iter=10), signalling_step(signal.SIGINT, 2, times=2), [None] * 10)
    assert info.value.state.iteration == 3  # step 2 finished


def test_a_third_sigint_stops_at_once():
    with pytest.raises(KeyboardInterrupt) as info:
        fl.run(TrainState(max_iter=10), signalling_step(signal.SIGINT, 2, times=3), [None] * 10)
    assert info.value.state.iteration == 2  # the step itself was cut: the last consistent state


def test_signals_can_be_left_alone():
    handler_seen = []
    previous = signal.signal(signal.SIGTERM, lambda *a: handler_seen.append(1))
    try:
        final = fl.run(TrainState(max_iter=5), signalling_step(signal.SIGTERM, 1), [None] * 5, signals=False)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert final.iteration == 5 and handler_seen == [1]


def _fields(state):
    return (state.iteration, state.time, state.data_time, state.step_time, state.effects, state.data)


@pytest.mark.parametrize("hooked", [False, True])
@pytest.mark.parametrize("keep", [False, True])
def test_states_anyone_holds_are_never_changed_by_the_fold(hooked, keep):
    # The fold builds a new record for each phase's result: a state the step, a hook or the caller
    # kept never changes, however it was reached.
    kept: list = []

    def step(state, batch):
        new = fl.record(state, x=float(batch))
        if keep:
            kept.append((new, _fields(new)))
        return new

    def hook(state, phase):
        kept.append((state, _fields(state)))
        new = fl.record(state, y=1.0)
        if keep:
            kept.append((new, _fields(new)))
        return new

    hooks = [fl.on(Phase.AFTER_STEP, hook)] if hooked else []
    yielded = [
        (s, _fields(s)) for s in fl.scan(TrainState(max_iter=4), step, range(4), hooks, clock=ticking())
    ]
    assert kept or not (hooked or keep)
    for state, fields in [*kept, *yielded]:
        assert _fields(state) == fields
    assert [s.iteration for s, _ in yielded] == [1, 2, 3, 4, 4]
