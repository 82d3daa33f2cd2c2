"""The log hook: at each firing, write the metrics recorded since the previous write."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import ClassVar

import attrs

from fnloop._core.messages import got, non_empty_str
from fnloop._core.phase import Phase
from fnloop._core.state import TrainState, request
from fnloop._core.stateful import recall, remember
from fnloop.writers import Line, Writer, claim, release, since
from fnloop.writers._line import WritesTo

__all__ = ["Log", "LogState", "log"]

_BEFORE_TRAIN = Phase.BEFORE_TRAIN
_AFTER_STEP = Phase.AFTER_STEP
_AFTER_TRAIN = Phase.AFTER_TRAIN


@attrs.frozen
class LogState:
    """What the log has written: entries recorded at indices below ``done``.

    ``line`` is the iteration of the last line requested (-1: none yet) and
    ``start`` the first index that line covered, so a resumed run can write
    that line again where the crash lost it.
    """

    done: int = 0
    line: int = -1
    start: int = 0


@attrs.frozen
class _Write:
    """The effect of one firing: write what was recorded at ``first`` or later, then maybe close."""

    writers: tuple[Writer, ...]
    first: int
    end: bool

    def __call__(self, state: TrainState) -> None:
        # Decided here, not in the hook: an AFTER_TRAIN hook placed after `log` (an evaluation)
        # records its metrics before the fold performs this, and the last line must hold them.
        try:
            with _holding(self.writers):  # a run refused its files at BEFORE_TRAIN writes nothing
                try:
                    names = since(state.metrics, self.first)
                    if names:
                        line = Line(
                            state.iteration,
                            state.max_iter,
                            state.metrics,
                            names,
                            first=self.first,
                            members=_members(state),
                        )
                        for writer in self.writers:
                            writer.write(line)
                finally:
                    if self.end:
                        for writer in self.writers:
                            writer.close()
        finally:
            if self.end:
                for writer in self.writers:
                    release(writer, self.writers)  # the claim of BEFORE_TRAIN, if it was this log's


def _members(state: TrainState) -> tuple[str, ...]:
    return () if state.population is None else state.population.labels


@attrs.frozen
class _Claim:
    """The claim of ``BEFORE_TRAIN``: the files the writers write, held until the run's last write."""

    writers: tuple[Writer, ...]

    def __call__(self, state: TrainState) -> None:
        for writer in self.writers:
            claim(writer, self.writers)


@contextlib.contextmanager
def _holding(writers: tuple[Writer, ...]) -> Iterator[None]:
    """The writers' files held for the block: refused (``DirectoryInUse``) if another live run holds one."""
    taken: list[Writer] = []
    try:
        for writer in writers:
            claim(writer, writers)
            taken.append(writer)
        yield
    finally:
        for writer in taken:
            release(writer, writers)


@attrs.frozen
class _Start:
    """The effect of ``BEFORE_TRAIN``: writers drop what lies at or past the run's first iteration.

    When the state says a line was written at that very iteration (the
    checkpoint was taken in the same phase), it is written again from the
    state's metrics, which are those it was first written from.
    """

    writers: tuple[Writer, ...]
    again: int | None

    def __call__(self, state: TrainState) -> None:
        with _holding(self.writers):
            for writer in self.writers:
                writer.start(state.iteration)
            if self.again is None:
                return
            names = since(state.metrics, self.again)
            if names:
                line = Line(
                    state.iteration,
                    state.max_iter,
                    state.metrics,
                    names,
                    resumed=True,
                    first=self.again,
                    members=_members(state),
                )
                for writer in self.writers:
                    writer.write(line)


def _writers(instance: object, attribute: attrs.Attribute, value: tuple[object, ...]) -> None:
    if not value:
        raise ValueError(
            "log() needs at least one writer (got none); for example "
            "log(fnloop.writers.console(), fnloop.writers.jsonl('run/metrics.jsonl'))."
        )
    for writer in value:
        if not isinstance(writer, Writer):
            raise TypeError(
                f"log() expected writers with start, write and close methods, such as "
                f"fnloop.writers.console() ({got(writer)})."
            )
    seen: dict[str, object] = {}
    for writer in value:
        target = writer.target if isinstance(writer, WritesTo) else None
        if not isinstance(target, str):
            continue
        where = os.path.abspath(target)
        if where in seen:
            raise ValueError(
                f"log(): two writers, {seen[where]!r} and {writer!r}, write to {where}: every line would "
                "be written twice. Give each writer its own path."
            )
        seen[where] = writer


@attrs.frozen(repr=False)
class Log:
    """Write metrics to ``writers``; build it with ``log``."""

    acts_in: ClassVar[frozenset[Phase]] = frozenset({Phase.BEFORE_TRAIN, Phase.AFTER_STEP, Phase.AFTER_TRAIN})
    """The phases it may change the state in; the fold does not call it in the others."""

    writers: tuple[Writer, ...] = attrs.field(validator=_writers)
    name: str = attrs.field(validator=non_empty_str)

    def __call__(self, state: TrainState, phase: Phase, /) -> TrainState:
        if phase is _AFTER_STEP:
            memory = self._memory(state)
            k = state.iteration + 1
            state = request(state, _Write(self.writers, memory.done, False), self._label(k))
            return remember(state, self.name, LogState(k, k, memory.done))
        if phase is _BEFORE_TRAIN:
            memory = self._memory(state)
            again = memory.start if memory.line == state.iteration else None
            state = request(state, _Claim(self.writers), f"{self.name}: hold its files", claim=True)
            return request(state, _Start(self.writers, again), f"{self.name}: start writers")
        if phase is _AFTER_TRAIN:
            memory = self._memory(state)
            k = state.iteration
            state = request(state, _Write(self.writers, memory.done, True), self._label(k))
            # A run continued from here records its first step at index k: it is not written yet.
            # If the line at k was already written, this write adds to it: a resume rewrites both.
            start = memory.start if memory.line == k else memory.done
            return remember(state, self.name, LogState(k, k, start))
        return state

    def _memory(self, state: TrainState) -> LogState:
        memory = recall(state, self.name, LogState())
        return memory if type(memory) is LogState else LogState()

    def _label(self, iteration: int) -> str:
        return f"{self.name}: write iteration {iteration}"

    @property
    def state_names(self) -> tuple[str, ...]:
        return (self.name,)

    def __repr__(self) -> str:
        return f"log({', '.join(map(repr, self.writers))}, name={self.name!r})"


def log(*writers: Writer, name: str = "log") -> Log:
    """A hook writing the metrics recorded since its previous write, usually ``every(n, log(...))``.

    * ``AFTER_STEP`` of step ``i``: it requests one write, performed once every
      hook of the phase has run, of each metric with an entry recorded since
      the previous write, as a line at iteration ``i + 1`` (the completed
      steps). Entries carry the index of the step that recorded them (``i``).
    * ``AFTER_TRAIN`` (which ``every`` lets through): one more write, unless
      nothing was recorded since the last one; whether anything was is decided
      as the write is performed, so an evaluation placed after ``log`` in the
      hook list is in the last line. Then the writers are closed.
    * ``BEFORE_TRAIN``: each writer drops what it holds for the run's first
      iteration ``k`` and later (the JSON lines file is cut back; TensorBoard
      gets ``purge_step=k``), and a line the state says was written at ``k`` is
      written again. So after a crash and a resume the log reads as one run.

    What was written is a ``LogState`` in ``state.hooks[name]``, saved with
    checkpoints. Values are converted to floats (a host sync) only when a line
    is written, never in a step that writes nothing.

    Args:
        writers: where to write (``fnloop.writers.console()``, ``jsonl(path)``,
            ``tensorboard(logdir)``, or your own ``fnloop.writers.Writer``).
        name: where the hook keeps its ``LogState`` in ``state.hooks``.

    Returns:
        The hook.

    Raises:
        ValueError: no writer given, or ``name`` empty.
        TypeError: a writer lacks ``start``, ``write`` or ``close``.

    Examples:
        >>> import fnloop as fl
        >>> lines = []
        >>> class Keep:
        ...     def start(self, iteration): pass
        ...     def write(self, line): lines.append((line.iteration, line.values()))
        ...     def close(self): pass
        >>> step = lambda s, b: fl.record(s, loss=float(s.iteration))
        >>> final = fl.run(fl.TrainState(max_iter=5), step, [None] * 5, [fl.every(2, log(Keep()))])
        >>> lines
        [(2, {'loss': 1.0}), (4, {'loss': 3.0}), (5, {'loss': 4.0})]
    """
    return Log(writers, name)
