"""The timer hook: seconds per iteration and seconds spent waiting for data, as metrics."""

from __future__ import annotations

from typing import ClassVar

import attrs

from fnloop._core.messages import non_empty_str, non_negative_int
from fnloop._core.phase import Phase
from fnloop._core.state import TrainState, unchecked
from fnloop._core.stateful import recall, remember

__all__ = ["Timer", "TimerState", "timer"]

_AFTER_STEP = Phase.AFTER_STEP
_BEFORE_TRAIN = Phase.BEFORE_TRAIN


@attrs.frozen
class TimerState:
    """The first iteration of the current run: its warm-up is counted from there."""

    start: int


@attrs.frozen(repr=False)
class Timer:
    """Record ``time`` and ``data_time`` after every step; build it with ``timer``."""

    acts_in: ClassVar[frozenset[Phase]] = frozenset({Phase.BEFORE_TRAIN, Phase.AFTER_STEP})
    """The phases it may change the state in; the fold does not call it in the others."""

    warmup: int = attrs.field(validator=non_negative_int)
    name: str = attrs.field(validator=non_empty_str)

    def __call__(self, state: TrainState, phase: Phase, /) -> TrainState:
        if phase is _AFTER_STEP:
            memory = state.hooks.get(self.name)
            if type(memory) is not TimerState:
                # No BEFORE_TRAIN reached this timer (a hook called by hand): this step is a run's first.
                memory = recall(state, self.name, TimerState(state.iteration))
            iteration = state.iteration
            if iteration < memory.start + self.warmup:
                return state
            # The fold measured the iteration: no memory of ours changes from step to step.
            metrics = state.metrics.record_pair(
                iteration, "time", state.step_time, "data_time", state.data_time
            )
            return unchecked(state, metrics=metrics)
        if phase is _BEFORE_TRAIN:
            # Each run (a resumed one too) counts its warm-up from its own first iteration.
            return remember(state, self.name, TimerState(state.iteration))
        return state

    @property
    def state_names(self) -> tuple[str, ...]:
        return (self.name,)

    def __repr__(self) -> str:
        return f"timer(warmup={self.warmup}, name={self.name!r})"


def timer(*, warmup: int = 3, name: str = "timer") -> Timer:
    """A hook recording ``time`` and ``data_time`` (seconds) at ``AFTER_STEP`` of every step.

    ``time`` is ``state.step_time``, the seconds from the start of the
    iteration's ``BEFORE_STEP`` to the start of its ``AFTER_STEP`` (its
    ``BEFORE_STEP`` hooks, the wait for data and the step), as detectron2's
    ``IterationTimer`` measures from ``before_step`` to ``after_step``. The
    ``AFTER_STEP`` hooks and their effects (writes, checkpoints, evaluations)
    are not in it; they come every n steps, and the console's ETA is the
    median ``time`` times the iterations left. ``data_time`` is
    ``state.data_time``, the seconds the fold waited for this step's batch.
    Both are Python floats the fold measured, recorded under the step's index
    ``state.iteration``: no tensor, no host sync, and no hook state that
    changes from step to step.

    The first ``warmup`` iterations of each run (where ``torch.compile``
    traces and caches warm up) are not recorded, as detectron2's
    ``IterationTimer`` does; a resumed run counts them again from its own first
    iteration, which ``BEFORE_TRAIN`` keeps in ``state.hooks[name]`` (a
    ``TimerState``). Time comes from the fold's clock: pass ``clock=`` to
    ``fnloop.run`` to drive it by hand.

    Args:
        warmup: iterations at the start of each run that record nothing.
        name: where the hook keeps its ``TimerState`` in ``state.hooks``.

    Returns:
        The hook.

    Raises:
        ValueError: ``warmup`` is not a non-negative int, or ``name`` is empty.

    Examples:
        >>> import fnloop as fl
        >>> ticks = iter(range(100))
        >>> final = fl.run(fl.TrainState(max_iter=4), lambda s, b: s, [None] * 4, [timer(warmup=1)],
        ...                clock=lambda: float(next(ticks)))
        >>> [i for i, _ in final.metrics.history("time")]
        [1, 2, 3]
    """
    return Timer(warmup, name)
