"""The fold: one iteration body, driven from ``state.iteration`` to ``state.max_iter``.

A run is ``BEFORE_TRAIN``, then units of iterations, then ``AFTER_TRAIN``. A
unit is one iteration, or ``k`` for a step of ``k`` steps per call where a
whole call fits: the ``BEFORE_STEP`` hooks of its first iteration, its
batches, one call of the step, the ``AFTER_STEP`` hooks of its last, and the
state advanced past it. The hooks called are those the plan says are due
(``fnloop._core.plan``); the run is bit for bit the one that calls every
hook in every phase (``plain_scan`` in ``property_tests/test_plan_laws.py``).

The fold changes no state in place: each phase's result is a new record.
It owns the states it builds, so it tells the step, through ``owned``, which
ones nobody else can see (after the first iteration of ``run``; never in
``scan``, whose states are yielded), except a state that an effect in the
background still reads (``fnloop._core.background``). Such an effect's
failure is raised as the next unit begins, and the run waits for it before
``AFTER_TRAIN``. Failures are handled in ``fnloop._core.failure``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import attrs

from fnloop._core.background import BackgroundFailed, Job, Writer
from fnloop._core.combinators import Hook, returned, state_names
from fnloop._core.failure import Last, StepFailed, ended_by
from fnloop._core.memory import hand_back_freed
from fnloop._core.messages import a_type
from fnloop._core.phase import Phase
from fnloop._core.plan import Plan, call
from fnloop._core.signals import _TIME_UP, _interruption, _Stop
from fnloop._core.state import Effect, Performs, TrainState, Unclaimed, reading, unchecked
from fnloop._core.steps import Applied
from fnloop._core.stream import stream as _stream

__all__ = ["BatchesExhausted", "Driver", "UnclaimedHookState", "fold"]

_BEFORE_TRAIN = Phase.BEFORE_TRAIN
_BEFORE_STEP = Phase.BEFORE_STEP
_AFTER_STEP = Phase.AFTER_STEP
_AFTER_TRAIN = Phase.AFTER_TRAIN


class BatchesExhausted(RuntimeError):
    """The batch iterable ended before ``max_iter`` was reached."""


class UnclaimedHookState(UserWarning):
    """A hook state from a checkpoint that no hook of the run owns; it is dropped."""


@attrs.frozen
class Driver:
    """Everything a fold needs besides the state and the batches, fixed when the run starts.

    Args:
        hook: the run's hooks, chained.
        step: the step, adapted (``fnloop._core.steps.adapt``).
        clock: read into ``state.clock`` where a hook is due, and once per unit.
        perform: which of the effects phases request this process performs.
        donate: let the step write into the states the fold owns.
        donate_input: the caller gave the input state up: the first step may write into it too.
        stop: set by the signal handlers; the fold stops between two units when it is.
        rank: this process's rank, for messages.
        world: how many processes run together.
        writer: the run's writer thread, which effects hand work to (``fnloop._core.background``).
    """

    hook: Hook
    step: Applied
    clock: Callable[[], float]
    perform: Performs
    donate: bool = False
    donate_input: bool = False
    stop: _Stop | None = None
    rank: int = 0
    world: int = 1
    writer: Writer = attrs.field(factory=Writer, eq=False)
    donates: bool = attrs.field(init=False)
    """Whether the step may write into an owned state (read once: ``step.donates``)."""

    @donates.default
    def _donates(self) -> bool:
        return self.step.donates


def fold(state: TrainState, batches: Iterable[Any], driver: Driver) -> Iterator[TrainState]:
    """Yield the state after each unit of iterations, then the final one, after ``AFTER_TRAIN``."""
    folded = _fold(state, batches, driver)
    # The fold keeps only the states it threads: the one it was given lives on after the first
    # step only where its caller keeps it (fl.run(fl.init(...), ...) keeps none, so its
    # parameters and optimizer state are freed then, not held beside their copy to the end).
    del state
    try:
        yield from folded
    finally:
        # What the step kept of this run's states goes with the run: a step is often held in a
        # reference cycle, and what it keeps would otherwise live until the interpreter's teardown.
        driver.step.finish()
        if driver.stop is not None:
            driver.stop.close()


def _fold(state: TrainState, batches: Iterable[Any], driver: Driver) -> Iterator[TrainState]:
    hook, clock = driver.hook, driver.clock
    last = Last(state)
    try:
        # The step phases call only the hooks that can act there (see fnloop/_core/plan.py).
        due = Plan(hook)
        state = _drop_unclaimed(state, hook)
        state = _phase(hook, _at(state, clock()), _BEFORE_TRAIN, driver)
        _check_max_iter(state, _BEFORE_TRAIN.name, state.iteration)
        last.state = state
        source = _Source(batches, state)
        owned = driver.donate and driver.donate_input
        k, stop = driver.step.per_call, driver.stop
        while state.iteration < state.max_iter:
            i = state.iteration
            # All k iterations of a call where a whole one fits, else one.
            n = k if k > 1 and i % k == 0 and i + k <= state.max_iter else 1
            state = last.state = _unit(driver, due, state, source, n, owned, last)
            last.torn = False
            if not owned and driver.donate:  # the given state, copied, is its caller's or gone
                hand_back_freed()
            owned = driver.donate  # from here on the fold threads states nobody else holds
            yield state
            if stop is not None:
                _check_stop(stop, state)
        _check_stop(stop, state)
        driver.writer.wait()  # the run ends with its effects done; one that failed fails the run
    except BaseException as exc:
        if driver.stop is not None:  # first: other ranks waiting on this one learn where it ended
            driver.stop.ended(None if last.torn else last.state.iteration)
        _waited(exc, driver.writer)
        end = lambda s, perform: _phase(hook, s, _AFTER_TRAIN, attrs.evolve(driver, perform=perform))  # noqa: E731
        ended_by(exc, last, end, perform=driver.perform, clock=clock, rank=driver.rank, world=driver.world)
        raise
    try:
        final = _phase(hook, _at(state, clock()), _AFTER_TRAIN, driver)
    except BaseException as exc:
        exc.state = state  # type: ignore[attr-defined]
        raise
    yield final


def _unit(
    driver: Driver, due: Plan, state: TrainState, source: _Source, n: int, owned: bool, last: Last
) -> TrainState:
    """``n`` iterations from ``state``: hooks before, batches, one step call, hooks after, advanced."""
    clock, step, writer = driver.clock, driver.step, driver.writer
    writer.check()  # an effect that failed off the training path is raised here
    i = state.iteration
    end = i + n - 1
    before, after = due(i, end)
    # The clock is read where a hook can see what it measures: with no hook due
    # before the step, the step gets the state the last unit ended with; with
    # none due after it, nobody sees the unit's step_time and data_time.
    start = clock() if before or after else 0.0
    if before:
        began = _at(state, start)
        state = _settled(call(before, began, _BEFORE_STEP), began, driver)
        _check_max_iter(state, _BEFORE_STEP.name, end + 1)
    fetching = clock() if after else 0.0
    batches, cursors = source.take(n, state)
    fetched = clock() if after else 0.0
    if owned and driver.donates and writer.reading(state):
        owned = False  # a save in flight reads these tensors: the step copies instead
    failure: StepFailed | None = None
    try:
        new = step.apply(state, batches, owned=owned)
    except StepFailed as failed:
        failure = failed
    if failure is not None:  # raised outside the handler: the step's error keeps its own context
        raise _failed_in_step(failure, state, cursors, last, clock)
    last.torn = owned and driver.donates  # the last state may share tensors the step overwrote
    if type(new) is not TrainState:
        raise TypeError(
            f"step {step!r:.80} returned {new!r:.80} ({a_type(new)}) at iteration {i}; "
            "a step must return a TrainState."
        )
    if new.iteration != end:
        raise _moved(end, new.iteration)
    now = clock()
    if after:
        # Per iteration: a call's times are shared out over its steps.
        measured = reading(now, (fetched - fetching) / n, (now - start) / n)
        began = unchecked(new, clock=measured)
        ended = call(after, began, _AFTER_STEP)
        if ended.iteration != end:
            raise _moved(end, ended.iteration)
    else:
        # Nothing was measured: no hook was due to see it.
        began = ended = unchecked(new, clock=reading(now)) if new.effects else new
    _check_max_iter(ended, _AFTER_STEP.name if after else "the step", end + 1)
    time = ended.time if after else now
    advanced = unchecked(ended, iteration=end + 1, data=cursors[-1], clock=reading(time), effects=())
    # The unit is done and its state whole: an effect only reads it, so one that fails (a save, a
    # log write) leaves this state, not a torn one, as the run's last consistent state.
    last.state, last.torn = advanced, False
    if ended.effects and driver.perform is not Performs.NONE:
        _perform(ended.effects, began, advanced, driver)
    return advanced


def _waited(exc: BaseException, writer: Writer) -> None:
    """A run that failed waits for its effect in flight before ``AFTER_TRAIN``; a failure there becomes a note."""
    try:
        writer.wait()
    except BackgroundFailed as also:
        exc.add_note(f"fnloop: then an effect in the background failed too: {also}")


def _failed_in_step(
    failure: StepFailed, state: TrainState, cursors: Sequence[Any], last: Last, clock: Callable[[], float]
) -> BaseException:
    """The step's own exception, with what it says of the state it leaves noted in ``last``."""
    last.torn = failure.torn
    reached = failure.reached
    if reached is not None:
        # Stopped at a step inside the call (NonFiniteLoss): the state before that step.
        at, i = reached.iteration, state.iteration
        cursor = cursors[at - i - 1] if at > i else state.data
        last.state = unchecked(reached, data=cursor, clock=reading(clock()), effects=())
    return failure.error


class _Source:
    """The batch stream: the next batches and the stream's cursor after each."""

    def __init__(self, batches: Iterable[Any], state: TrainState) -> None:
        self.stream, self.resumable = _stream(batches, state)

    def take(self, n: int, state: TrainState) -> tuple[list[Any], list[Any]]:
        """``n`` batches for the iterations from ``state.iteration``; cursors ``state.data`` if not resumable."""
        batches, cursors = [], []
        for j in range(n):
            try:
                batch = next(self.stream)
            except StopIteration:
                raise BatchesExhausted(
                    f"the batches ran out at iteration {state.iteration + j} (max_iter={state.max_iter}). "
                    "The fold takes one batch per iteration: give at least max_iter - "
                    "iteration batches, or a stream that cycles, such as fnloop.data.batches(...)."
                ) from None
            if self.resumable:
                batch, cursor = batch
            else:
                cursor = state.data
            batches.append(batch)
            cursors.append(cursor)
        return batches, cursors


def _check_max_iter(state: TrainState, where: str, done: int) -> None:
    """A hook may lower ``max_iter`` to end the run early, but not below the steps done by then."""
    if state.max_iter < done:
        raise ValueError(
            f"max_iter was lowered to {state.max_iter} in {where} of iteration {state.iteration}, "
            f"below the {done} steps the run has done at the end of this iteration (or call of several "
            "steps): the run would end with iteration > "
            f"max_iter. To end the run as soon as it can, set max_iter={done}."
        )


def _moved(i: int, iteration: int) -> RuntimeError:
    return RuntimeError(
        f"state.iteration changed from {i} to {iteration} during iteration {i}; "
        "only the fold advances it. To end a run early, lower max_iter instead."
    )


def _check_stop(stop: _Stop | None, state: TrainState) -> None:
    signum = None if stop is None else stop.at(state.iteration)
    if signum == _TIME_UP and state.iteration >= state.max_iter:
        return  # a run done when its time is up ends as any other: nothing is cut short
    if signum is not None:
        raise _interruption(signum)


def _at(state: TrainState, time: float) -> TrainState:
    """``state`` at the start of a phase: the clock's time, nothing measured."""
    return unchecked(state, clock=reading(time))


def _phase(hook: Hook, state: TrainState, phase: Phase, driver: Driver) -> TrainState:
    """``hook`` in ``phase``, checked, the effects this process performs (``driver.perform``) performed."""
    new = hook(state, phase)
    if type(new) is not TrainState:
        raise returned(hook, phase, new)
    return _settled(new, state, driver)


def _settled(ended: TrainState, began: TrainState, driver: Driver) -> TrainState:
    """``ended``, a phase's result, with the effects it requested cleared, those this process performs performed."""
    effects = ended.effects
    if not effects:
        return ended
    ended = unchecked(ended, effects=())
    if driver.perform is not Performs.NONE:
        _perform(effects, began, ended, driver)
    return ended


def _perform(effects: tuple[Effect, ...], began: TrainState, ended: TrainState, driver: Driver) -> None:
    """Each effect this process performs, with its state, the claims first: a run refused one writes nothing.

    An effect that returns a ``Job`` hands it to the run's writer thread.
    """
    effects = tuple(e for e in effects if driver.perform(e))
    if any(effect.claim for effect in effects):
        effects = (*(e for e in effects if e.claim), *(e for e in effects if not e.claim))
    for effect in effects:
        job = effect.perform(unchecked(began, effects=()) if effect.start else ended)
        if type(job) is Job:
            driver.writer.submit(job)


def _drop_unclaimed(state: TrainState, hook: Hook) -> TrainState:
    owned = set(state_names(hook))
    stray = [n for n, v in state.hooks.items() if type(v) is Unclaimed and n not in owned]
    if not stray:
        return state
    for name in stray:
        warnings.warn(
            f"the hook state {name!r} ({state.hooks[name].where}) belongs to no hook of this run; "
            "it is dropped. If a hook was renamed, give it its old name= to keep its state.",
            UnclaimedHookState,
            stacklevel=4,
        )
    return attrs.evolve(state, hooks={n: v for n, v in state.hooks.items() if n not in stray})
