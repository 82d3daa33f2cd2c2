"""Ending a run when a metric stops improving."""

from __future__ import annotations

import math
import warnings
from typing import Any, ClassVar

import attrs

from fnloop._core.combinators import Hook
from fnloop._core.messages import got
from fnloop._core.metrics import to_floats
from fnloop._core.phase import Phase
from fnloop._core.population import member_metric
from fnloop._core.state import TrainState, request
from fnloop._core.stateful import EachMember, stateful
from fnloop.hooks._unrecorded import MetricNeverRecorded, WarnNonFinite, never_recorded

__all__ = ["EarlyStopState", "early_stop"]


@attrs.frozen
class _Warn:
    """The effect warning that ``metric`` was never recorded; a value, so states compare equal."""

    hook: str
    metric: str

    def __call__(self, state: TrainState) -> None:
        warnings.warn(never_recorded(self.hook, self.metric, state), MetricNeverRecorded, stacklevel=2)


@attrs.frozen
class EarlyStopState:
    """Why a run stopped, or how close it is: the best value, when, and the values since without improvement.

    Attributes:
        best: the best value seen (``inf`` / ``-inf`` before any).
        best_iteration: the metric index it was recorded at (-1: none yet).
        seen: the index of the newest entry looked at (-1: none yet).
        bad: values in a row that did not improve on ``best`` by more than ``min_delta``.
        stopped_at: the step after which the run was ended (-1: not stopped).
    """

    best: float
    best_iteration: int = -1
    seen: int = -1
    bad: int = 0
    stopped_at: int = -1


def _patience(value: object) -> int:
    if type(value) is not int or value < 1:
        raise ValueError(
            f"early_stop() 'patience' must be a positive int ({got(value)}): the number of new "
            "values in a row without improvement after which the run ends."
        )
    return value


def _min_delta(value: object) -> float:
    if type(value) not in (int, float) or not value >= 0:  # type: ignore[operator]
        raise ValueError(
            f"early_stop() 'min_delta' must be a float >= 0 ({got(value)}): how much a value must "
            "beat the best by to count as an improvement."
        )
    return float(value)  # type: ignore[arg-type]


@attrs.frozen(repr=False)
class _EarlyStop:
    acts_in: ClassVar[frozenset[Phase]] = frozenset({Phase.BEFORE_TRAIN, Phase.AFTER_STEP, Phase.AFTER_TRAIN})
    """The phases the update changes anything in: the hook is not called in the others."""

    metric: str
    patience: int
    mode: str
    min_delta: float
    name: str

    def __call__(self, state: TrainState, phase: Phase, memory: Any) -> tuple[TrainState, Any]:
        # `memory`: an EarlyStopState, or a population's tuple of them (one per member).
        if phase is Phase.BEFORE_TRAIN and state.population is not None:
            if min(state.population.stopped) >= 0:  # a population whose every member stopped stays stopped
                return attrs.evolve(state, max_iter=state.iteration), memory
            return state, memory
        if phase is Phase.BEFORE_TRAIN and 0 <= memory.stopped_at < state.iteration:
            # A stopped run stays stopped: resumed under a template with the original max_iter
            # (fnloop.checkpoint.resume), it ends at once instead of training on.
            return attrs.evolve(state, max_iter=state.iteration), memory
        if phase is Phase.AFTER_TRAIN:
            names = state.metrics.series
            never = (
                all(m.seen < 0 for m in memory) and member_metric(self.metric, 0) not in names
                if state.population is not None
                else memory.seen < 0 and self.metric not in names
            )
            if never and state.iteration == state.max_iter:
                return request(
                    state, _Warn(repr(self), self.metric), f"warn: {self.metric} never recorded"
                ), memory
            return state, memory
        if state.population is not None:
            return self._members(state, phase, memory)
        if phase is not Phase.AFTER_STEP or self.metric not in state.metrics.series:
            return state, memory
        state, memory = self._looked(state, memory, self.metric)
        if memory.bad < self.patience:
            return state, memory
        # Ends the run after this step, as a success: AFTER_TRAIN sees iteration == max_iter.
        stopped = attrs.evolve(state, max_iter=min(state.max_iter, state.iteration + 1))
        return stopped, attrs.evolve(memory, stopped_at=state.iteration)

    def _members(
        self, state: TrainState, phase: Phase, memory: tuple[EarlyStopState, ...]
    ) -> tuple[TrainState, tuple[EarlyStopState, ...]]:
        """A population's: each member stops on its own metric (``val_loss/3``); the run ends once all have."""
        population = state.population
        assert population is not None
        if phase is not Phase.AFTER_STEP:
            return state, memory
        stopped, memories = list(population.stopped), list(memory)
        for m, alive in enumerate(population.training):
            name = member_metric(self.metric, m)
            if not alive or name not in state.metrics.series:
                continue
            state, memories[m] = self._looked(state, memories[m], name)
            if memories[m].bad >= self.patience:  # this member's tensors stop changing after this step
                stopped[m] = state.iteration + 1
                memories[m] = attrs.evolve(memories[m], stopped_at=state.iteration)
        if stopped != list(population.stopped):
            state = attrs.evolve(state, population=attrs.evolve(population, stopped=tuple(stopped)))
            if min(stopped) >= 0:  # every member has stopped: the run ends after this step
                state = attrs.evolve(state, max_iter=min(state.max_iter, state.iteration + 1))
        return state, tuple(memories)

    def _looked(
        self, state: TrainState, memory: EarlyStopState, metric: str
    ) -> tuple[TrainState, EarlyStopState]:
        """``memory`` with the values of ``metric`` recorded since it last looked counted."""
        history = state.metrics.history(metric)
        if history[-1][0] <= memory.seen:
            # Nothing new: no host sync in this step.
            return state, memory
        new = [(i, v) for i, v in history if i > memory.seen]
        for (i, _), value in zip(new, to_floats(v for _, v in new)):
            memory = self._count(memory, i, value)
            if not math.isfinite(value):
                state = request(state, WarnNonFinite(repr(self), metric, i, value), "warn: not finite")
        return state, memory

    def _count(self, memory: EarlyStopState, index: int, value: float) -> EarlyStopState:
        if self.mode == "min":
            better = value < memory.best - self.min_delta
        else:
            better = value > memory.best + self.min_delta
        if better and math.isfinite(value):  # NaN compares false; -inf would be a best never beaten
            return EarlyStopState(value, index, index, 0, memory.stopped_at)
        return attrs.evolve(memory, seen=index, bad=memory.bad + 1)

    def __repr__(self) -> str:
        return (
            f"early_stop({self.metric!r}, patience={self.patience}, mode={self.mode!r}, "
            f"min_delta={self.min_delta!r})"
        )


def early_stop(
    metric: str, *, patience: int, mode: str = "min", min_delta: float = 0.0, name: str | None = None
) -> Hook:
    """A hook ending the run once ``metric`` stopped improving for ``patience`` values in a row.

    At ``AFTER_STEP`` it reads the values of ``metric`` recorded since it
    last looked (so place it after the hook that records them, such as
    ``evaluate``), and counts each: one that beats the best so far by more
    than ``min_delta`` (lower for ``mode="min"``, higher for ``"max"``) is
    the new best and resets the count; any other, NaN included, adds one.
    When the count reaches ``patience`` it lowers ``max_iter`` to the next
    iteration, so the run ends after the current step as a success:
    ``AFTER_TRAIN`` runs, a final checkpoint and a final evaluation happen.
    Reading the values syncs with the device, but only in steps that recorded
    new ones; wrapped in ``every(n, ...)`` it looks less often and still
    counts every value recorded since (those still in the metrics window).

    On a population's state (``fnloop.population``) each member stops on its
    own values (``val_loss/3`` for member 3): once it has waited ``patience``
    values, its tensors stop changing after the current step (its entry in
    ``state.population.stopped`` is set) while the others train on, and the
    run ends when every member has stopped. The memory is then a tuple of
    ``EarlyStopState``, one per member.

    Its memory (``state.hooks[name]``, an ``EarlyStopState``) says why the run
    stopped and survives a resume. A run it stopped stays stopped: resumed
    (say by ``fnloop.checkpoint.resume`` under the template's larger
    ``max_iter``), it ends at ``BEFORE_TRAIN``; to train on, give the hook
    another ``name`` (a fresh state). If a successful run never recorded
    ``metric``, it warns (``MetricNeverRecorded``) at ``AFTER_TRAIN``.

    Args:
        metric: the name of a recorded metric.
        patience: values in a row without improvement that end the run.
        mode: ``"min"`` or ``"max"``.
        min_delta: the margin a value must beat the best by.
        name: where the hook keeps its state (default ``"early_stop:<metric>"``).

    Raises:
        ValueError: a bad ``patience``, ``mode`` or ``min_delta``.

    Examples:
        >>> import fnloop as fl
        >>> losses = [3.0, 2.0, 2.5, 2.2, 1.0, 0.5]
        >>> step = lambda s, b: fl.record(s, val_loss=losses[s.iteration])
        >>> final = fl.run(fl.TrainState(max_iter=6), step, [None] * 6, [early_stop("val_loss", patience=2)])
        >>> final.iteration, final.hooks["early_stop:val_loss"]
        (4, EarlyStopState(best=2.0, best_iteration=1, seen=3, bad=2, stopped_at=3))
    """
    if type(metric) is not str or not metric:
        raise TypeError(f"early_stop() 'metric' must be a metric name, a non-empty str ({got(metric)}).")
    if mode not in ("min", "max"):
        raise ValueError(f"early_stop() 'mode' must be 'min' or 'max' (got {mode!r}).")
    start = EarlyStopState(math.inf if mode == "min" else -math.inf)
    update = _EarlyStop(
        metric, _patience(patience), mode, _min_delta(min_delta), name or f"early_stop:{metric}"
    )
    return stateful(update.name, EachMember(start), update)
