"""The best checkpoint: the state saved when a metric reaches its best (each member of a population as its own run).

``Best``, the hook's memory, keeps this module: a checkpoint names the
module of every record it holds, and resumes look it up there. The
periodic checkpoint hook is in ``_saving.py``, and re-exported here.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import warnings
from pathlib import Path
from typing import Any, ClassVar

import attrs

from fnloop._atomic import DirectoryInUse, claim, holding, release
from fnloop._core.background import BackgroundFailed
from fnloop._core.combinators import Hook
from fnloop._core.messages import got
from fnloop._core.phase import Phase
from fnloop._core.population import member_metric
from fnloop._core.state import TrainState, request
from fnloop._core.stateful import EachMember, stateful
from fnloop._population import member as population_member
from fnloop.checkpoint import save
from fnloop.checkpoint._sharded import parts_of
from fnloop.hooks._saving import _a_part, _directory, _Do, _sharded, checkpoint
from fnloop.hooks._unrecorded import MetricNeverRecorded, WarnNonFinite, never_recorded

__all__ = [
    "BackgroundFailed",
    "Best",
    "DirectoryInUse",
    "TopK",
    "MetricNeverRecorded",
    "best_checkpoint",
    "checkpoint",
]


@attrs.frozen
class Best:
    """The best value of a metric so far, and the iteration it was recorded at (-1: none yet)."""

    value: float
    iteration: int = -1


@attrs.frozen
class TopK:
    """The ``k`` best values of a metric so far, best first, and the iterations they were recorded at.

    Slots not filled yet hold the worst value there is (``inf`` for
    ``mode="min"``) at iteration -1. Fixed in length, so that a checkpoint's
    memory is checked against the hook's as any other.
    """

    values: tuple[float, ...]
    iterations: tuple[int, ...]

    @property
    def kept(self) -> tuple[Best, ...]:
        """The values kept so far, best first."""
        return tuple(Best(v, i) for v, i in zip(self.values, self.iterations) if i >= 0)


def _improves(mode: str, new: float, old: float) -> bool:
    return new < old if mode == "min" else new > old


_TOP = re.compile(r"top-\d{8,}\.safetensors")


def _top_name(iteration: int) -> str:
    """The file of the state whose step ``iteration`` recorded a top value: named, as a checkpoint is,
    by the steps done (``iteration + 1``)."""
    return f"top-{iteration + 1:08d}.safetensors"


_MOST = 1_000
"""The most best states kept: their values and iterations are held in the state, in every checkpoint."""


def best_checkpoint(
    directory: str | os.PathLike[str],
    metric: str,
    mode: str = "min",
    *,
    k: int = 1,
    name: str | None = None,
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

    With ``k > 1`` it also keeps the ``k`` best states, as Lightning's
    ``ModelCheckpoint(save_top_k=k)`` does: ``directory/top-<steps>.safetensors``
    for each of them (named by the steps done, as ``checkpoint``'s files are) (``best.safetensors`` is still the best one), deleting
    the file of one that drops out. The memory is then a ``TopK`` (values
    and iterations, best first), in the state as the single best is: a
    resumed run keeps the same ``k``. When the run starts, files of
    ``top-`` states that its memory does not hold are removed: those an
    interrupted attempt wrote after the checkpoint it resumes from, which
    the resumed run writes again as it gets there.

    On a population's state (``fnloop.population``) it keeps each member's
    best on that member's own values (``val_loss/3``): member ``m``'s best is
    saved as the plain state of its own run (``fnloop.member``) into
    ``directory/member-<m>/best.safetensors``, and the memory is a tuple of
    ``Best``, one per member.

    Args:
        directory: where ``best.safetensors`` goes.
        metric: the name of a recorded metric.
        mode: ``"min"`` or ``"max"``.
        k: how many of the best states to keep, 1 to 1,000 (1: ``best.safetensors`` alone).
        name: the hook state's name (default ``"best:<metric>"``).

    Raises:
        TypeError: ``metric`` is not a str.
        ValueError: ``metric`` or ``name`` is empty, ``mode`` is neither
            ``"min"`` nor ``"max"``, ``k`` is not a positive int, or
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
    if type(metric) is not str or not metric:
        raise (TypeError if type(metric) is not str else ValueError)(
            f"best_checkpoint() metric must be the name of a metric the step records, such as 'loss' "
            f"or 'val/loss' ({got(metric)})."
        )
    if name is not None and (type(name) is not str or not name):
        raise ValueError(f"best_checkpoint() name must be a non-empty str or None ({got(name)}).")
    if mode not in ("min", "max"):
        raise ValueError(f"best_checkpoint() mode must be 'min' or 'max' (got {mode!r}).")
    if type(k) is not int or not 1 <= k <= _MOST:
        raise ValueError(
            f"best_checkpoint() k must be an int from 1 to {_MOST:,}: how many best states to keep "
            f"({got(k)}). The memory of the k best is in the state, in every checkpoint; to keep every "
            "state, use fnloop.hooks.checkpoint(directory, keep=None)."
        )
    folder = _directory("best_checkpoint()", directory)
    update = _BestUpdate(os.fspath(folder), metric, mode, os.fspath(directory), k)
    worst = math.inf if mode == "min" else -math.inf
    start: Best | TopK = Best(worst) if k == 1 else TopK((worst,) * k, (-1,) * k)
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
    k: int = 1

    def __call__(self, state: TrainState, phase: Phase, best: Any) -> tuple[TrainState, Any]:
        # `best`: a Best, or a population's tuple of them (one per member).
        if phase is Phase.BEFORE_TRAIN:
            state = request(state, _Do(self, _BestUpdate.claim), f"hold {self.directory}", claim=True)
            if self.k > 1:  # the top- files of states the memory does not hold go
                tops = best if state.population is not None else (best,)
                members = (None,) if state.population is None else tuple(range(len(tops)))
                kept = tuple(tuple(b.iteration for b in top.kept) for top in tops)
                state = request(state, _Prune(self, members, kept), f"prune {self.directory}")
            return state, best
        if phase is Phase.AFTER_TRAIN:
            # Warn only after success: a run that failed early may not have reached its first evaluation.
            bests = best if state.population is not None else (best,)
            never = [(b.iteration < 0) if type(b) is Best else not b.kept for b in bests]
            ended = state.iteration == state.max_iter and all(never)
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
        self, state: TrainState, best: Any, metric: str, member: int | None
    ) -> tuple[TrainState, Any]:
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
        if type(best) is TopK:
            return self._top(state, best, value, iteration, member)
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

    def _top(
        self, state: TrainState, top: TopK, value: float, iteration: int, member: int | None
    ) -> tuple[TrainState, TopK]:
        """``top`` with ``value`` among the k best, if it is; the effect saving it and dropping the one out."""
        if not _improves(self.mode, value, top.values[-1]):  # a tie with the k-th keeps the earlier
            return state, top
        at = next(j for j, v in enumerate(top.values) if _improves(self.mode, value, v))
        values = (*top.values[:at], value, *top.values[at:-1])
        iterations = (*top.iterations[:at], iteration, *top.iterations[at:-1])
        out = top.iterations[-1]
        save = _SaveTop(self, member, iteration, at == 0, out)
        where = self.directory if member is None else f"{self.directory}/member-{member}"
        return request(
            state, save, f"top {self.k} {self.metric} into {where}", everywhere=_sharded(state)
        ), TopK(values, iterations)

    def claim(self, state: TrainState) -> None:
        claim(Path(self.directory))

    def save_top(self, state: TrainState, member: int | None, iteration: int, best: bool, out: int) -> None:
        """Save ``state`` as ``top-<iteration>`` (and as ``best`` if it is), and remove ``top-<out>``."""
        if _a_part(state):  # another rank's part of a sharded checkpoint: rank 0 holds the directory
            save(state, Path(self.directory) / _top_name(iteration))
            if best:
                save(state, Path(self.directory) / "best.safetensors")
            return
        with holding(Path(self.directory)):
            folder = Path(self.directory)
            if member is not None:
                folder = folder / f"member-{member}"
                folder.mkdir(exist_ok=True)
                state = population_member(state, member)
            save(state, folder / _top_name(iteration))
            if best:
                save(state, folder / "best.safetensors")
            if out >= 0:
                _remove(folder / _top_name(out))

    def prune(self, members: tuple[int | None, ...], kept: tuple[tuple[int, ...], ...]) -> None:
        """Remove the ``top-`` files of each member's folder that ``kept`` does not name."""
        with holding(Path(self.directory)):
            for member, iterations in zip(members, kept):
                folder = Path(self.directory) if member is None else Path(self.directory) / f"member-{member}"
                names = {_top_name(i) for i in iterations}
                for path in folder.glob("top-*.safetensors"):
                    if _TOP.fullmatch(path.name) and path.name not in names:
                        _remove(path)

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
        k = f", k={self.k}" if self.k != 1 else ""
        return f"best_checkpoint({self.given!r}, {self.metric!r}, {self.mode!r}{k})"


def _remove(path: Path) -> None:
    """Remove the file of a state that left the top k; gone already (a resumed run removes it again) is fine."""
    for file in (path, *parts_of(path)):  # a sharded checkpoint's parts beside its index
        with contextlib.suppress(FileNotFoundError):
            file.unlink()


@attrs.frozen
class _SaveTop:
    """The effect saving a state that entered the top k, and removing the one that left it."""

    hook: _BestUpdate
    member: int | None
    iteration: int
    best: bool
    out: int

    def __call__(self, state: TrainState) -> None:
        self.hook.save_top(state, self.member, self.iteration, self.best, self.out)


@attrs.frozen
class _Prune:
    """The effect removing the ``top-`` files a run's memory does not hold, as it starts."""

    hook: _BestUpdate
    members: tuple[int | None, ...]
    kept: tuple[tuple[int, ...], ...]

    def __call__(self, state: TrainState) -> None:
        self.hook.prune(self.members, self.kept)


@attrs.frozen
class _SaveMember:
    """The effect saving member ``member`` of a population as its own run, into ``member-<m>/best.safetensors``."""

    hook: _BestUpdate
    member: int

    def __call__(self, state: TrainState) -> None:
        self.hook.save_member(state, self.member)
