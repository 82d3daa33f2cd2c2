"""The fold: drive a step and hooks from ``state.iteration`` to ``state.max_iter``."""

from __future__ import annotations

import collections
import sys
import time as _time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

from fnloop._core.combinators import Hook, chain, checked, returned, state_names
from fnloop._core.messages import a_type
from fnloop._core.phase import Phase
from fnloop._core.plan import call, off_boundaries, plan
from fnloop._core.signals import Preempted, _interruption, _signals, _Stop
from fnloop._core.state import Effect, TrainState, Unclaimed, advanced, replace, timed, with_field
from fnloop._core.stream import stream as _stream

__all__ = ["BatchesExhausted", "Preempted", "Step", "UnclaimedHookState", "run", "scan"]

_refs = sys.getrefcount
_SOLE = 2 if sys.implementation.name == "cpython" else -1
"""``_refs(x)`` when a local ``x`` is the only reference (the call's argument is the other).

The fold then times and advances ``x`` in place (``owned=True``): nobody can see it change.
Elsewhere than CPython, never."""

_BEFORE_TRAIN = Phase.BEFORE_TRAIN
_BEFORE_STEP = Phase.BEFORE_STEP
_AFTER_STEP = Phase.AFTER_STEP
_AFTER_TRAIN = Phase.AFTER_TRAIN


class Step(Protocol):
    """A pure function ``(state, batch) -> state`` run once per iteration.

    A step may also offer ``donating(state, batch)``: the same function, allowed
    to reuse the storage of ``state``'s tensors. ``run`` calls it only for
    states nobody outside the fold can see.

    It gets the state the ``BEFORE_STEP`` hooks returned; in an iteration
    where none is due, the state the previous iteration ended with.

    A step with ``steps_per_call = k > 1`` also offers ``steps(state,
    batches)``, running ``len(batches)`` iterations from ``state.iteration``
    and returning the state at the last one's index (and may offer
    ``donating_steps``). ``run`` then calls it for each whole call of ``k``
    iterations starting at a multiple of ``k``, single steps elsewhere, and
    refuses hooks that may act inside a call.
    """

    def __call__(self, state: TrainState, batch: Any, /) -> TrainState: ...


class BatchesExhausted(RuntimeError):
    """The batch iterable ended before ``max_iter`` was reached."""


_TORN = (
    "fnloop: this failed while the state was being updated in place (donation: in the step, or "
    "in an AFTER_STEP hook right after it), so no consistent state is left in memory and "
    "exc.state is None; AFTER_TRAIN ran without "
    "performing effects, so no checkpoint of a half-updated state was written. Resume from the "
    "last checkpoint, or use train_step(..., donate=False) to keep the previous state intact."
)


def _name_rank(exc: BaseException) -> None:
    from fnloop.distributed import rank, world_size

    size = world_size()
    if size > 1 and not isinstance(exc, (SystemExit, KeyboardInterrupt)):
        exc.add_note(f"fnloop: raised on rank {rank()} of {size}.")


def _start(state: object, step: object, hooks: Sequence[Hook | None] | None, debug: bool = False) -> Hook:
    if type(state) is not TrainState:
        raise TypeError(
            f"run() expected a fnloop.TrainState as its first argument, got {state!r:.80} "
            f"(a {type(state).__name__}). Build one with fnloop.TrainState(max_iter=...) or fnloop.init(...)."
        )
    if not callable(step):
        raise TypeError(
            f"the step must be a callable (state, batch) -> state, got {step!r:.80} "
            f"(a {type(step).__name__}). Build one with fnloop.train_step(model, loss_fn, optimizer)."
        )
    if state.iteration > state.max_iter:
        raise ValueError(
            f"cannot run from iteration {state.iteration}: it is past max_iter={state.max_iter}. "
            "To train further, raise max_iter: attrs.evolve(state, max_iter=...)."
        )
    if hooks is None:
        hooks = ()
    if callable(hooks) and not isinstance(hooks, Sequence):
        raise TypeError(f"run() expected a sequence of hooks, got a single hook {hooks!r:.80}; pass [hook].")
    hook = chain(*hooks)
    _check_boundaries(hook, _steps_per_call(step))
    return checked(hook) if debug else hook


def _steps_per_call(step: object) -> int:
    steps = getattr(step, "steps_per_call", 1)
    return steps if type(steps) is int and steps > 1 and callable(getattr(step, "steps", None)) else 1


def _check_boundaries(hook: Hook, steps: int) -> None:
    if steps == 1:
        return
    inside = off_boundaries(hook, steps)
    if inside is None:
        return
    registered, phase, iteration = inside
    first = iteration - iteration % steps
    raise ValueError(
        f"steps_per_call={steps}: the hook {registered!r:.120} may act in {phase.name} of iteration "
        f"{iteration}, inside a call (iterations {first} to {first + steps - 1} run as one). With "
        f"several steps per call, hooks act only at call boundaries: BEFORE_STEP of iterations 0, "
        f"{steps}, {2 * steps}, ... and AFTER_STEP of iterations {steps - 1}, {2 * steps - 1}, .... "
        f"Run it every multiple of {steps} (fl.every({steps}, hook); a function hook in AFTER_STEP "
        f"only: fl.on(fl.Phase.AFTER_STEP, fl.every({steps}, hook))), or use steps_per_call=1."
    )


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
    return replace(state, hooks={n: v for n, v in state.hooks.items() if n not in stray})


class UnclaimedHookState(UserWarning):
    """A hook state from a checkpoint that no hook of the run owns; it is dropped."""


def _performs(effects: bool) -> bool:
    """Whether this process performs effects: asked for, and rank 0 of a data-parallel run."""
    from fnloop.distributed import rank, world_size

    if world_size() > 1 and rank() != 0:
        return False
    return effects


def _decides_stops() -> bool:
    """Whether this process stops on SIGTERM/SIGINT itself: rank 0 alone in a data-parallel run."""
    from fnloop.distributed import rank, world_size

    return world_size() <= 1 or rank() == 0


def _perform(effects: tuple[Effect, ...], began: TrainState, ended: TrainState) -> None:
    for effect in effects:
        effect.perform(replace(began, effects=()) if effect.start else ended)


def _settled(ended: TrainState, began: TrainState, perform: bool) -> TrainState:
    """``ended``, a phase's result, with the effects it requested cleared and, if ``perform``, performed."""
    effects = ended.effects
    if not effects:
        return ended
    ended = replace(ended, effects=())
    if perform:
        _perform(effects, began, ended)
    return ended


def _phase(hook: Hook, state: TrainState, phase: Phase, perform: bool) -> TrainState:
    new = hook(state, phase)
    if type(new) is not TrainState:
        raise returned(hook, phase, new)
    return _settled(new, state, perform)


def _before_step(due: Any, state: TrainState, start: float, perform: bool) -> TrainState:
    """The ``BEFORE_STEP`` hooks ``due`` on ``state`` at time ``start``, their effects performed."""
    began = with_field(state, "time", start)
    return _settled(call(due, began, _BEFORE_STEP), began, perform)


def _next(stream: Iterator[Any], resumable: bool, i: int, state: TrainState) -> tuple[Any, Any]:
    """The batch for iteration ``i`` and the stream's cursor after it (``state.data`` if not resumable)."""
    try:
        batch = next(stream)
    except StopIteration:
        raise _exhausted(i, state.max_iter) from None
    return batch if resumable else (batch, state.data)


def _take(stream: Iterator[Any], resumable: bool, n: int, i: int, state: TrainState) -> tuple[list, list]:
    """The next ``n`` batches, for iterations ``i ..``, and the stream's cursor after each."""
    batches, cursors = [], []
    for j in range(n):
        batch, cursor = _next(stream, resumable, i + j, state)
        batches.append(batch)
        cursors.append(cursor)
    return batches, cursors


def _exhausted(i: int, max_iter: int) -> BatchesExhausted:
    return BatchesExhausted(
        f"the batches ran out at iteration {i} (max_iter={max_iter}). "
        "The fold takes one batch per iteration: give at least max_iter - "
        "iteration batches, or a stream that cycles, such as fnloop.data.batches(...)."
    )


def _not_a_state(step: object, new: object, i: int) -> TypeError:
    return TypeError(
        f"step {step!r:.80} returned {new!r:.80} ({a_type(new)}) at iteration {i}; "
        "a step must return a TrainState."
    )


def _moved(i: int, iteration: int) -> RuntimeError:
    return RuntimeError(
        f"state.iteration changed from {i} to {iteration} during iteration {i}; "
        "only the fold advances it. To end a run early, lower max_iter instead."
    )


def _fold(
    state: TrainState,
    step: Step,
    batches: Iterable[Any],
    hook: Hook,
    clock: Callable[[], float],
    perform: bool,
    donate: bool,
    stop: _Stop | None = None,
    donate_input: bool = False,
) -> Iterator[TrainState]:
    # `last` is the last consistent state: the input, then the state after
    # BEFORE_TRAIN, then the state after each completed iteration. Between a
    # donating step and the next such state, `last` shares tensors the step
    # overwrote: a failure there leaves no consistent state in memory.
    last = state
    mixed = False
    try:
        # The step phases call only the hooks that can act there (see fnloop/_core/plan.py).
        before_step, after_step = plan(hook, _BEFORE_STEP), plan(hook, _AFTER_STEP)
        before_quiet, after_quiet = before_step.quiet, after_step.quiet
        before_next = after_next = quiet_until = -1.0
        state = _drop_unclaimed(state, hook)
        state = last = _phase(hook, replace(state, time=clock()), _BEFORE_TRAIN, perform)
        stream, resumable = _stream(batches, state)
        donating = getattr(step, "donating", None) if donate else None
        apply = donating if donating is not None and donate_input else step
        # Several steps per call (train_step(..., steps_per_call=k)): whole calls where they fit.
        k = _steps_per_call(step)
        many: Any = step.steps if k > 1 else None  # type: ignore[attr-defined]
        donating_many = getattr(step, "donating_steps", None) if k > 1 and donate else None
        apply_many: Any = donating_many if donating_many is not None and donate_input else many
        start = fetching = fetched = 0.0
        while state.iteration < state.max_iter:
            i = state.iteration
            if i < quiet_until and (k == 1 or i % k or i + k > state.max_iter):
                # No hook can act in this iteration: the batch, the step, one
                # new state. The step gets the state the last iteration ended
                # with, and the clock is read once, for the state this one ends with.
                # (`_next`, written out: this is the path a bare run takes every step.)
                try:
                    batch = next(stream)
                except StopIteration:
                    raise _exhausted(i, state.max_iter) from None
                if resumable:
                    batch, cursor = batch
                else:
                    cursor = state.data
                new = apply(state, batch)
                mixed = apply is donating
                if type(new) is not TrainState:
                    raise _not_a_state(step, new, i)
                if new.iteration != i:
                    raise _moved(i, new.iteration)
                now = clock()
                # In place when nobody else holds the step's result (its effects need it as it is).
                # (Counted before the call: an argument being passed is one more reference.)
                owned = _refs(new) == _SOLE and not new.effects
                state = last = advanced(new, i + 1, cursor, now, owned)
                mixed = False
                if new.effects and perform:
                    # A step asked for effects with no hook due: nothing was measured.
                    _perform(new.effects, timed(new, now, 0.0, 0.0), state)
            else:
                # Iterations i .. end in one call: all k of a call where a whole one
                # fits, else one. Hooks act before the first and after the last
                # (for several steps per call, nowhere else: checked before the run).
                n = k if k > 1 and i % k == 0 and i + k <= state.max_iter else 1
                end = i + n - 1
                if i < before_next:
                    before = before_quiet
                else:
                    before = before_step(i)
                    before_next = before_step.next
                if end < after_next:
                    after = after_quiet
                else:
                    after = after_step(end)
                    after_next = after_step.next
                if not before_quiet and not after_quiet:
                    quiet_until = min(before_next, after_next)
                # The clock is read where a hook can see what it measures: with
                # no hook due before the step, the step gets the state the last
                # iteration ended with; with none due after it, nobody sees the
                # iteration's step_time and data_time.
                if before or after:
                    start = clock()
                if before:
                    state = _before_step(before, state, start, perform)
                if after:
                    fetching = clock()
                if n == 1:
                    batch, cursor = _next(stream, resumable, i, state)
                else:
                    batch, cursors = _take(stream, resumable, n, i, state)
                    cursor = cursors[-1]
                if after:
                    fetched = clock()
                if n == 1:
                    new = apply(state, batch)
                    mixed = apply is donating
                else:
                    try:
                        new = apply_many(state, batch)
                    except BaseException as exc:
                        # Stopped at a step inside the call (NonFiniteLoss): the state before that step.
                        reached = getattr(exc, "reached", None)
                        if type(reached) is TrainState:
                            at = reached.iteration
                            last = advanced(
                                reached, at, cursors[at - i - 1] if at > i else state.data, clock()
                            )
                        raise
                    mixed = apply_many is donating_many
                if type(new) is not TrainState:
                    raise _not_a_state(step, new, i)
                if new.iteration != end:
                    raise _moved(end, new.iteration)
                now = clock()
                if after:
                    # Per iteration: a call's times are shared out over its steps.
                    # In place when nobody else holds the step's result.
                    owned = _refs(new) == _SOLE
                    began = timed(new, now, (fetched - fetching) / n, (now - start) / n, owned)
                    state = call(after, began, _AFTER_STEP)
                else:
                    # Nothing was measured: no hook was due to see it.
                    began = state = timed(new, now, 0.0, 0.0) if new.effects else new
                if state.iteration != end:
                    raise _moved(end, state.iteration)
                requested = state.effects
                # In place when the hooks built a state nobody else holds (not `began` itself).
                owned = _refs(state) == _SOLE
                state = last = advanced(state, end + 1, cursor, state.time if after else now, owned)
                mixed = False
                if requested and perform:
                    _perform(requested, began, state)
            if donating is not None:
                # From here on the fold threads states no caller holds.
                apply = donating
            if donating_many is not None:
                apply_many = donating_many
            yield state
            if stop is not None and stop.signum is not None:
                raise _interruption(stop.signum)
        if stop is not None and stop.signum is not None:
            raise _interruption(stop.signum)
    except BaseException as exc:
        _name_rank(exc)
        torn = mixed or getattr(exc, "torn", False)
        if torn:
            # The state was being overwritten in place when this failed (in the
            # step, or in an AFTER_STEP hook after a donating step): the last
            # consistent state is gone from memory. AFTER_TRAIN still runs, but
            # nothing it asks for is performed (no checkpoint of a mixed state).
            exc.add_note(_TORN)
        at_end = replace(last, time=clock())
        exc.state = None if torn else last  # type: ignore[attr-defined]
        try:
            _phase(hook, at_end, _AFTER_TRAIN, perform and not torn)
        except BaseException as also:  # noqa: BLE001 - the original exception must win
            if also is not exc:
                exc.add_note(f"AFTER_TRAIN hooks then also failed: {type(also).__name__}: {also}")
        raise
    try:
        final = _phase(hook, replace(state, time=clock()), _AFTER_TRAIN, perform)
    except BaseException as exc:
        exc.state = state  # type: ignore[attr-defined]
        raise
    yield final


def scan(
    state: TrainState,
    step: Step,
    batches: Iterable[Any],
    hooks: Sequence[Hook | None] | None = (),
    *,
    clock: Callable[[], float] = _time.perf_counter,
    effects: bool = True,
    debug: bool = False,
) -> Iterator[TrainState]:
    """Lazily run ``step`` and ``hooks``, yielding the state after each iteration.

    (After each call, for a step of several steps per call: ``train_step(...,
    steps_per_call=k)``.)

    After the iterations it yields once more: the final state, after
    ``AFTER_TRAIN``. So ``list(scan(...))[-1]`` is what ``run`` returns. Every
    yielded state stays valid; nothing is reused in place. Closing the
    iterator early runs ``AFTER_TRAIN`` with the last yielded state.

    Args:
        state: where to start; iterations ``state.iteration .. state.max_iter - 1`` run.
        step: ``(state, batch) -> state``.
        batches: any iterable, one batch taken per iteration; a resumable
            stream (``fnloop.data.batches``) continues from ``state.data``.
        hooks: hooks (or ``None``s) run in this order in every phase.
        clock: the driver's clock, read into ``state.time`` at each phase a
            hook is due in, and once per iteration for the state it ends with.
        effects: perform requested effects (``False`` for a dry replay); in a
            data-parallel run (``torchrun``) rank 0 alone performs them.
        debug: guard every hook with ``fnloop.checked``: a hook that writes
            into a tensor of the state in place fails, naming the hook.

    Raises:
        TypeError: ``state`` is not a TrainState, or a hook/step returns something else.
        ValueError: ``state.iteration > state.max_iter``, or two hooks share a state name.
        BatchesExhausted: ``batches`` ended early.

    Examples:
        >>> from fnloop import TrainState
        >>> [s.iteration for s in scan(TrainState(max_iter=2), lambda s, b: s, [0, 1])]
        [1, 2, 2]
    """
    hook = _start(state, step, hooks, debug)
    return _fold(state, step, batches, hook, clock, _performs(effects), donate=False)


def run(
    state: TrainState,
    step: Step,
    batches: Iterable[Any],
    hooks: Sequence[Hook | None] | None = (),
    *,
    clock: Callable[[], float] = _time.perf_counter,
    effects: bool = True,
    debug: bool = False,
    signals: bool = True,
    donate_input: bool = False,
) -> TrainState:
    """Run ``step`` and ``hooks`` from ``state.iteration`` to ``state.max_iter``.

    Phases: ``BEFORE_TRAIN``; then per iteration ``BEFORE_STEP``, the step,
    ``AFTER_STEP``; then ``AFTER_TRAIN``. Hooks run in registration order in
    every phase. ``state.iteration`` is the current index during the step
    phases and reaches ``max_iter`` only after success, which is how an
    ``AFTER_TRAIN`` hook tells success from failure.

    On an exception ``AFTER_TRAIN`` still runs, with the last consistent state
    (the state after the last completed iteration); then the original
    exception propagates unchanged, carrying that state as ``exc.state``.

    SIGTERM and SIGINT (preemption, Ctrl-C) during ``run`` let the current
    step finish, then run ``AFTER_TRAIN`` (where a checkpoint hook saves the
    last consistent state) and raise ``Preempted`` (SIGTERM) or
    ``KeyboardInterrupt`` (SIGINT), carrying that state as ``exc.state``.
    Further signals also wait for the end of the step; a third Ctrl-C stops at
    once (then, with donation, no consistent state is left: ``exc.state`` is
    ``None``).

    Args: as ``scan``, and

    * ``signals``: handle SIGTERM/SIGINT as above (main thread only; the
      handlers are removed when ``run`` returns);
    * ``donate_input``: the caller gives ``state`` up, as JAX's
      ``donate_argnums`` does: its tensors may be overwritten from the first
      step on, which saves one copy of params and optimizer state. Without it
      the step's ``donating`` variant, where it offers one, is used from the
      second iteration, once the fold owns the state it threads.

    Returns:
        The final state, after ``AFTER_TRAIN``.

    Examples:
        >>> from fnloop import TrainState, record
        >>> final = run(TrainState(max_iter=3), lambda s, b: record(s, x=b), [1.0, 2.0, 3.0])
        >>> final.iteration, final.metrics.latest("x")
        (3, (2, 3.0))
    """
    hook = _start(state, step, hooks, debug)
    with _signals(signals) as stop:
        # In a data-parallel run rank 0 alone stops on a signal; the other ranks
        # keep the signal from killing them mid-step and go on until rank 0 has
        # stopped between two steps and saved. A rank that stopped first would
        # leave rank 0 waiting in the next step's all-reduce, its state torn and unsaved.
        obeys = stop if _decides_stops() else None
        fold = _fold(state, step, batches, hook, clock, _performs(effects), True, obeys, donate_input)
        # Only the fold (and the caller, if it kept it) holds the input now.
        del state
        # Drained in C, keeping only the last state: the fold's final one.
        final: TrainState = collections.deque(fold, maxlen=1)[0]
    return final
