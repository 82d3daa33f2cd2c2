"""``run`` and ``scan``: a run's front door, where the fold meets the process it runs in.

Everything a run needs from its surroundings is read here, once: the hooks
chained and checked, the step adapted (``fnloop._core.steps``), this
process's rank in a data-parallel run, the signal handlers. The fold itself
(``fnloop._core.fold``) then depends on nothing but its arguments.
"""

from __future__ import annotations

import collections
import datetime
import math
import time as _time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import attrs

from fnloop import distributed
from fnloop._core.checked import checked
from fnloop._core.combinators import Hook, chain
from fnloop._core.fold import BatchesExhausted, Driver, UnclaimedHookState, fold
from fnloop._core.messages import got
from fnloop._core.plan import off_boundaries
from fnloop._core.signals import Preempted, SlowStart, TimeUp, _Deadline, _signals
from fnloop._core.state import Performs, TrainState
from fnloop._core.steps import Step, adapt

__all__ = ["BatchesExhausted", "Preempted", "SlowStart", "Step", "UnclaimedHookState", "run", "scan"]


def _driver(
    state: object,
    step: object,
    hooks: Sequence[Hook | None] | None,
    *,
    clock: Callable[[], float],
    effects: bool,
    debug: bool,
    donate: bool,
) -> Driver:
    """The run's fixed parts, every argument checked."""
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
    applied = adapt(step, donate=donate)  # type: ignore[arg-type]
    _check_boundaries(hook, applied.per_call)
    rank, world = distributed.rank(), distributed.world_size()
    # In a data-parallel run rank 0 alone performs effects, but those requested of every rank.
    perform = (
        Performs.NONE if not effects else Performs.ALL if world <= 1 or rank == 0 else Performs.EVERYWHERE
    )
    return Driver(checked(hook) if debug else hook, applied, clock, perform, donate, rank=rank, world=world)


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
    driver = _driver(state, step, hooks, clock=clock, effects=effects, debug=debug, donate=False)
    return fold(state, batches, driver)


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
    max_time: float | datetime.timedelta | None = None,
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
    * ``max_time``: a time limit for this call (seconds, or a ``timedelta``),
      as Lightning's ``Trainer(max_time=...)``: once it has passed, the run
      stops at the next boundary between two steps as it does on SIGTERM
      (``AFTER_TRAIN`` runs, so a checkpoint hook saves that state), and
      ``run`` returns that state, its ``iteration`` short of ``max_iter``.
      Run the same script again to go on: it resumes there, for another
      ``max_time``. Under ``torchrun`` rank 0's clock decides, and every rank
      stops at the boundary it announces. The limit counts the run's start
      and its first step, a compile included: where those take a quarter of
      it or more, the run warns once (``SlowStart``) after that step;
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
    driver = _driver(state, step, hooks, clock=clock, effects=effects, debug=debug, donate=True)
    seconds = _seconds(max_time)
    with _signals(signals) as stop:
        if seconds is not None:
            stop = _Deadline(stop, clock, seconds)
        # In a data-parallel run rank 0 alone stops on a signal; the other ranks
        # keep the signal from killing them mid-step and go on until rank 0 has
        # stopped between two steps and saved. A rank that stopped first would
        # leave rank 0 waiting in the next step's all-reduce, its state torn and unsaved.
        obeys = stop if driver.world <= 1 or driver.rank == 0 else None
        if driver.world > 1 and (state.shards is not None or seconds is not None):
            # A sharded checkpoint needs every rank's part of one state, and a time limit ends
            # every rank's run: all stop at one boundary, the one rank 0 announces.
            obeys = distributed.AgreedStop(stop, driver.rank)
        driver = attrs.evolve(driver, stop=obeys, donate_input=donate_input)
        try:
            # Drained in C, keeping only the last state: the fold's final one.
            folded = fold(state, batches, driver)
            del state  # the fold's to keep or drop (see fold)
            final: TrainState = collections.deque(folded, maxlen=1)[0]
        except TimeUp as up:
            final = up.state  # type: ignore[attr-defined]
    return final


def _seconds(max_time: object) -> float | None:
    """``run(max_time=...)`` in seconds, or ``None``; refused unless a positive number or timedelta."""
    if max_time is None:
        return None
    seconds = max_time.total_seconds() if isinstance(max_time, datetime.timedelta) else max_time
    if type(seconds) not in (int, float) or not 0 < seconds < math.inf:  # type: ignore[operator]
        raise ValueError(
            f"run(max_time=...) must be a positive finite number of seconds or a datetime.timedelta, such "
            f"as max_time=datetime.timedelta(hours=4); None for no limit ({got(max_time)})."
        )
    return float(seconds)  # type: ignore[arg-type]
