"""What a writer is given and how it is held: ``Line``, the ``Writer`` protocol, ``claim`` and ``release``."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

import attrs

from fnloop._core.messages import a_path, unwritable
from fnloop._core.metrics import Metrics, Scalar, to_floats

__all__ = ["Claims", "Line", "Writer", "WritesTo", "claim", "release", "since"]

LOGGER = "fnloop"
"""The name of the ``logging`` logger the console writer writes to."""

ITERATION_NAMED = (
    "{writer}: a metric is named 'iteration', the name of the {column} that holds each {row}'s iteration: "
    "it would overwrite it, and a resumed run, which cuts the file back by that {column}, would then "
    "drop the earlier {row}s. Record the metric under another name (fnloop.record(state, "
    "steps_seen=...)), or log it with another writer."
)
"""Why the file writers refuse a metric named ``iteration``."""

FOREIGN_CSV = (
    "fnloop.writers.csv({path!r}): the run appends to this CSV file, but its first column is {first!r}, "
    "not 'iteration': fnloop.writers.csv did not write it, so its rows have no iteration to cut the "
    "file back by when a run resumes, and the new rows would not match its columns. Give the writer "
    "another path, or move the file away."
)
"""Why ``csv`` refuses to resume over a CSV file it did not write."""


@attrs.frozen
class Line:
    """What one write is about: the metrics recorded since the previous write.

    Args:
        iteration: completed steps when written (``state.iteration`` as the effect runs).
        max_iter: the run's ``max_iter``, for the ETA.
        metrics: the run's metrics record; values are converted only by the writer.
        names: the metrics with an entry recorded since the previous write.
        resumed: rewritten by a resumed run to restore what ``start`` dropped;
            a stream writer (the console) skips it.
        first: the first metrics index this write covers: entries recorded at
            ``first`` or later are new since the previous write.
        members: a population's member labels (``state.population.labels``),
            whose metrics are named ``<name>/<member>``; empty for a single run.
    """

    iteration: int
    max_iter: int
    metrics: Metrics
    names: tuple[str, ...]
    resumed: bool = False
    first: int = 0
    members: tuple[str, ...] = ()
    _recent: dict[str, list[float]] = attrs.field(init=False, factory=dict, eq=False, repr=False)

    def recent(self) -> dict[str, list[float]]:
        """Each name's values recorded at ``first`` or later, oldest first, as floats.

        A name the line holds has its newest entry there, so its list ends with
        the newest value. Converted once per line, with one host sync for all
        tensors, however many writers read it.
        """
        if not self._recent and self.names:
            series, first = self.metrics.series, self.first
            wanted: list[Scalar] = []
            spans = []
            for name in self.names:
                entries = series[name]
                recent = [v for i, v in entries if i >= first] or [entries[-1][1]]
                spans.append((name, len(wanted), len(wanted) + len(recent)))
                wanted.extend(recent)
            floats = to_floats(wanted)
            self._recent.update((name, floats[lo:hi]) for name, lo, hi in spans)
        return self._recent

    def values(self) -> dict[str, float]:
        """The newest value of each name, as floats (one host sync for all tensors)."""
        return {name: values[-1] for name, values in self.recent().items()}


def since(metrics: Metrics, first: int) -> tuple[str, ...]:
    """The names whose newest entry was recorded at index ``first`` or later."""
    return tuple(name for name, entries in metrics.series.items() if entries and entries[-1][0] >= first)


@runtime_checkable
class Writer(Protocol):
    """Something ``fnloop.hooks.log`` writes to: ``start``, ``write`` and ``close``, called at the edge."""

    def start(self, iteration: int) -> None:
        """A run begins at ``iteration``: forget what was written for ``iteration`` and later."""

    def write(self, line: Line) -> None:
        """Write ``line``."""

    def close(self) -> None:
        """The run ended: release what ``write`` opened."""


@runtime_checkable
class Claims(Protocol):
    """A writer of something two runs must not share (a file, a directory, a tracked run): it claims it.

    ``log`` claims it, its writers tuple as the owner, before any effect of
    the run writes, so two live runs, or two ``log`` hooks of one process,
    never share a log file (the second is refused with
    ``fnloop.hooks.DirectoryInUse``), and releases it as the run ends. The
    file writers, ``tensorboard`` and ``mlflow`` (a named run) claim.
    """

    def claim(self, owner: object = None, /) -> None:
        """Hold what the writer writes to for ``owner`` in this process; refused while another holds it."""

    def release(self, owner: object = None, /) -> bool:
        """Give back one ``claim`` by ``owner``; whether one was."""


@runtime_checkable
class WritesTo(Protocol):
    """A writer that says where it writes: ``target``, a path (a file or a directory), or ``None``.

    ``log`` refuses two of its writers with one ``target``: every line would be
    written twice. The file writers and ``tensorboard`` say it.
    """

    @property
    def target(self) -> str | None:
        """The path it writes to, or ``None``."""


def claim(writer: Writer, owner: object = None) -> None:
    """Hold what ``writer`` writes to for ``owner`` in this process, if it claims (``Claims``); see ``release``."""
    if isinstance(writer, Claims):
        writer.claim(owner)


def release(writer: Writer, owner: object = None) -> bool:
    """Give back one ``claim`` of ``writer`` by ``owner``; whether one was (``True`` for a writer that claims nothing)."""
    return bool(writer.release(owner)) if isinstance(writer, Claims) else True


def _jsonl_path(value: object) -> str:
    return a_path(value, where="fnloop.writers.jsonl()")


def _csv_path(value: object) -> str:
    return a_path(value, where="fnloop.writers.csv()")


def _logdir(value: object) -> str:
    return a_path(value, "logdir", where="fnloop.writers.tensorboard()")


def _writable(writer: str, path: str, *, directory: bool) -> None:
    """Refuse ``path`` when the writer is built if the run could not write it when it logs."""
    why = unwritable(Path(path), directory=directory)
    if why is not None:
        kind = "a directory" if directory else "a file"
        raise ValueError(
            f"fnloop.writers.{writer}({path!r}): cannot write {kind} there: {why}. Give a path the run "
            "may create or write to."
        )
