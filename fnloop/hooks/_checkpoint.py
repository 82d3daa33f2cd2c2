"""The best checkpoint: the state saved when a metric reaches its best (each member of a population as its own run).

``Best``, the hook's memory, keeps this module: a checkpoint names the
module of every record it holds, and resumes look it up there. The
periodic checkpoint hook is in ``_saving.py``, and re-exported here.
"""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path
from typing import Any, ClassVar

import attrs

from fnloop._atomic import DirectoryInUse, claim, holding, release
from fnloop._core.background import BackgroundFailed
from fnloop._core.combinators import Hook
from fnloop._core.phase import Phase
from fnloop._core.population import member_metric
from fnloop._core.state import TrainState, request
from fnloop._core.stateful import EachMember, stateful
from fnloop._population import member as population_member
from fnloop.checkpoint import save
from fnloop.hooks._saving import _a_part, _directory, _Do, _sharded, checkpoint
from fnloop.hooks._unrecorded import MetricNeverRecorded, WarnNonFinite, never_recorded

__all__ = [
    "BackgroundFailed",
    "Best",
    "DirectoryInUse",
    "MetricNeverRecorded",
    "best_checkpoint",
    "checkpoint",
]


@attrs.frozen
class Best:
    """The best value of a metric so far, and the iteration it was recorded at (-1: none yet)."""

    value: float
    iteration: int = -1


def _improves(mode: str, new: float, old: float) -> bool:
    return new < old if mode == "min" else new > old


def best_checkpoint(
    directory: str | os.PathLike[str], metric: str, mode: str = "min", *, name: str | None = None
) -> Hook:
    """A hook keeping ``directory/best.safetensors``: the state where ``metric`` was best.

    At ``AFTER_STEP`` it looks at ``metric``; when a new value was recorded in
    this step and beats the best so far (lower for ``mode="min"``, higher for
    ``"max"``), it saves the state. The best value lives in the state
    (``state.hooks[name]``, a ``Best``), so it survives a resume: a resumed
    run does not overwrite a better checkpoint with a worse one. Reading the
    value syncs with the device, but only in steps that recorded it. Like
    ``checkpoint``, it holds ``directory`` for the run; a run that ends with
    ``metric`` never recorded warns (``MetricNeverRecorded``), naming the
    metrics that were.

    On a population's state (``fnloop.population``) it keeps each member's
    best on that member's own values (``val_loss/3``): member ``m``'s best is
    saved as the plain state of its own run (``fnloop.member``) into
    ``directory/member-<m>/best.safetensors``, and the memory is a tuple of
    ``Best``, one per member.

    Args:
        directory: where ``best.safetensors`` goes.
        metric: the name of a recorded metric.
        mode: ``"min"`` or ``"max"``.
        name: the hook state's name (default ``"best:<metric>"``).

    Raises:
        ValueError: ``mode`` is neither ``"min"`` nor ``"max"``, or
            ``directory`` is an existing file.
        DirectoryInUse: (from ``run``, before the first step) another process
            holds ``directory``.

    Examples:
        >>> import tempfile, fnloop as fl
        >>> losses = [3.0, 1.0, 2.0]
        >>> step = lambda s, b: fl.record(s, val=losses[s.iteration])
        >>> final = fl.run(fl.TrainState(max_iter=3), step, [None] * 3, [best_checkpoint(tempfile.mkdtemp(), "val")])
        >>> final.hooks["best:val"]
        Best(value=1.0, iteration=1)
    """
    if mode not in ("min", "max"):
        raise ValueError(f"best_checkpoint() mode must be 'min' or 'max' (got {mode!r}).")
    folder = _directory("best_checkpoint()", directory)
    update = _BestUpdate(os.fspath(folder), metric, mode, os.fspath(directory))
    start = Best(math.inf if mode == "min" else -math.inf)
    return stateful(name or f"best:{metric}", EachMember(start), update)


@attrs.frozen(repr=False)
class _BestUpdate:
    """``best_checkpoint``'s update: plain data, so the hook pickles and its requests compare equal."""

    acts_in: ClassVar[frozenset[Phase]] = frozenset({Phase.BEFORE_TRAIN, Phase.AFTER_STEP, Phase.AFTER_TRAIN})
    """The phases the update changes anything in: the hook is not called in the others."""

    directory: str
    metric: str
    mode: str
    given: str  # the directory as given, for the repr

    def __call__(self, state: TrainState, phase: Phase, best: Any) -> tuple[TrainState, Any]:
        # `best`: a Best, or a population's tuple of them (one per member).
        if phase is Phase.BEFORE_TRAIN:
            return request(state, _Do(self, _BestUpdate.claim), f"hold {self.directory}", claim=True), best
        if phase is Phase.AFTER_TRAIN:
            # Warn only after success: a run that failed early may not have reached its first evaluation.
            bests = best if state.population is not None else (best,)
            ended = state.iteration == state.max_iter and all(b.iteration < 0 for b in bests)
            return request(
                state,
                _Do(self, _BestUpdate.finish if ended else _BestUpdate.release),
                f"release {self.directory}",
            ), best
        if phase is not Phase.AFTER_STEP:
            return state, best
        if state.population is not None:  # each member's best: its own metric, its own file
            bests = list(best)
            for m, alive in enumerate(state.population.training):
                if alive:
                    state, bests[m] = self._looked(state, bests[m], member_metric(self.metric, m), m)
            return state, tuple(bests)
        return self._looked(state, best, self.metric, None)

    def _looked(
        self, state: TrainState, best: Best, metric: str, member: int | None
    ) -> tuple[TrainState, Best]:
        if metric not in state.metrics.series:
            return state, best
        # The index first, the value (a host sync) only for a value recorded in this step.
        if state.metrics.latest(metric)[0] != state.iteration:
            return state, best
        iteration, value = state.metrics.latest_float(metric)
        if not math.isfinite(value):  # never the best: -inf would be one never beaten
            return request(
                state, WarnNonFinite(repr(self), metric, iteration, value), "warn: not finite"
            ), best
        if not _improves(self.mode, value, best.value):
            return state, best
        if member is not None:
            return request(state, _SaveMember(self, member), f"best {metric} into {self.directory}"), Best(
                value, iteration
            )
        return request(
            state,
            _Do(self, _BestUpdate.save),
            f"best {self.metric} into {self.directory}",
            everywhere=_sharded(state),
        ), Best(value, iteration)

    def claim(self, state: TrainState) -> None:
        claim(Path(self.directory))

    def save(self, state: TrainState) -> None:
        if _a_part(state):  # another rank's part of a sharded checkpoint: rank 0 holds the directory
            save(state, Path(self.directory) / "best.safetensors")
            return
        with holding(Path(self.directory)):
            save(state, Path(self.directory) / "best.safetensors")

    def save_member(self, state: TrainState, m: int) -> None:
        folder = Path(self.directory) / f"member-{m}"
        with holding(Path(self.directory)):
            folder.mkdir(exist_ok=True)
            save(population_member(state, m), folder / "best.safetensors")

    def release(self, state: TrainState) -> None:
        release(Path(self.directory))

    def finish(self, state: TrainState) -> None:
        release(Path(self.directory))
        population = state.population
        looked_for = self.metric if population is None else member_metric(self.metric, 0)
        if looked_for not in state.metrics.series:
            message = never_recorded("best_checkpoint()", looked_for, state)
            warnings.warn(message, MetricNeverRecorded, stacklevel=2)

    def __repr__(self) -> str:
        return f"best_checkpoint({self.given!r}, {self.metric!r}, {self.mode!r})"


@attrs.frozen
class _SaveMember:
    """The effect saving member ``member`` of a population as its own run, into ``member-<m>/best.safetensors``."""

    hook: _BestUpdate
    member: int

    def __call__(self, state: TrainState) -> None:
        self.hook.save_member(state, self.member)
