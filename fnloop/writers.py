"""Writers: where ``fnloop.hooks.log`` sends the metrics (the console, JSON lines, CSV, TensorBoard, MLflow).

A writer is a small picklable record with three methods, all called at the
edge (inside effects the fold performs), never inside a hook:

* ``start(iteration)`` when a run begins at ``iteration``: drop whatever the
  writer holds for iterations ``>= iteration``, so that a resumed run's log
  reads as one run (the JSON lines file is cut back; TensorBoard gets
  ``purge_step``);
* ``write(line)`` with a ``Line``: the metrics recorded since the previous write;
* ``close()`` when the run ends.

Live objects (TensorBoard's ``SummaryWriter``) are kept in a registry of
this process, keyed by the writer's path; the records themselves hold only
configuration.
"""

from __future__ import annotations

import csv as _csv
import datetime
import io
import json
import logging
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import attrs

from fnloop._atomic import claim_file, write_atomically
from fnloop._atomic import release as release_claim
from fnloop._core.messages import a_path, unwritable
from fnloop._core.metrics import Metrics, Scalar, to_floats
from fnloop._core.population import split_member_metric

__all__ = ["Line", "Writer", "console", "csv", "jsonl", "mlflow", "tensorboard"]

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


def claim(writer: Writer, owner: object = None) -> None:
    """Hold what ``writer`` writes to for ``owner`` in this process, if it says (its ``claim``); see ``release``.

    A writer of files offers ``claim(owner)`` and ``release()``: ``log`` claims
    them, its writers tuple as the owner, before any effect of the run writes,
    so two live runs, or two ``log`` hooks of one process, never share a log
    file (the second is refused with ``fnloop.hooks.DirectoryInUse``).
    """
    take = getattr(writer, "claim", None)
    if callable(take):
        take(owner)


def release(writer: Writer, owner: object = None) -> bool:
    """Give back one ``claim`` of ``writer`` by ``owner``; whether one was (``True`` for a writer of no files)."""
    give = getattr(writer, "release", None)
    return bool(give(owner)) if callable(give) else True


# -- console -------------------------------------------------------------------------------------------


def _visible(logger: logging.Logger) -> None:
    # As detectron2's setup_logger: a user who configured nothing still sees the lines. Once logging is
    # configured (a handler on the root or on "fnloop"), that configuration decides alone.
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[%(asctime)s %(name)s] %(message)s", "%m/%d %H:%M:%S"))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


def _eta(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(seconds)))


@attrs.frozen
class Console:
    """Writes each line through the ``"fnloop"`` logger at INFO; build it with ``console``."""

    def start(self, iteration: int) -> None:
        """Nothing to forget: what was printed stays printed."""

    def write(self, line: Line) -> None:
        """Log one line, as detectron2's ``CommonMetricPrinter`` prints it."""
        if line.resumed:
            return
        logger = logging.getLogger(LOGGER)
        _visible(logger)
        if logger.isEnabledFor(logging.INFO):
            logger.info(format_line(line))

    def close(self) -> None:
        """Nothing to close."""


def _order(name: str) -> int:
    if "loss" in name:
        return 0
    if name == "lr" or name.startswith("lr/"):
        return 2
    return {"time": 3, "data_time": 4, "max_mem": 5}.get(name, 1)


def format_line(line: Line) -> str:
    """The console's text for ``line``: ``eta: H:MM:SS  iter: N  loss: ...  lr: ...  time: ...``.

    Each metric is shown as the median of its entries recorded since the
    previous write that the metrics window still keeps (a training loss or
    batch accuracy recorded every step: the last ``window`` steps; a
    validation metric recorded once per period: that value), as detectron2
    smooths its losses; ``lr``, ``max_mem`` and ``skipped`` (a rate, a peak
    and a running count) as their newest value. The ETA is the median ``time`` times the
    iterations left; a finished run shows ``eta: 0:00:00``; without any
    ``time`` there is no ETA.

    Examples:
        >>> m = Metrics().record(0, {"loss": 2.0, "lr": 0.1}).record(1, {"loss": 1.0, "lr": 0.1, "time": 0.5})
        >>> format_line(Line(2, 10, m, ("loss", "lr", "time")))
        'eta: 0:00:04  iter: 2  loss: 1.5  lr: 1.000e-01  time: 0.5000'
    """
    names = sorted(line.names, key=_order)
    recent = line.recent()
    # Counts and peaks (a running total, the memory high-water mark) and the lr read as they are now.
    windowed = {n for n in names if _order(n) not in (2, 5) and n != "skipped"}

    def value(name: str) -> float:
        return statistics.median(recent[name]) if name in windowed else recent[name][-1]

    times = recent.get("time")
    if times is None and "time" in line.metrics.series:
        times = to_floats([line.metrics.latest("time")[1]])  # no time since the previous write: the newest

    fields = []
    left = max(line.max_iter - line.iteration, 0)
    if left == 0:
        fields.append("eta: 0:00:00")
    elif times:
        fields.append(f"eta: {_eta(statistics.median(times) * left)}")
    fields.append(f"iter: {line.iteration}")
    for name in names:
        kind = _order(name)
        if kind == 2:
            fields.append(f"{name}: {value(name):.3e}")
        elif kind in (3, 4):
            fields.append(f"{name}: {value(name):.4f}")
        elif kind == 5:
            fields.append(f"{name}: {value(name):.0f}M")
        else:
            fields.append(f"{name}: {value(name):.4g}")
    return "  ".join(fields)


def console() -> Console:
    """A writer logging one line per write to the ``"fnloop"`` logger at INFO.

    The line reads as detectron2's ``CommonMetricPrinter``'s: ``eta: H:MM:SS
    iter: N  loss: ...  lr: ...  time: ...  data_time: ...  max_mem: ...M``
    (see ``format_line``). So that the lines are seen even where nobody
    configured ``logging``: if neither the ``"fnloop"`` logger nor the root
    logger has a handler at the first write, it gives ``"fnloop"`` a handler
    writing to stderr and level INFO (as ``logging.basicConfig`` would, for
    fnloop alone). Configure ``logging`` yourself to decide otherwise.

    Examples:
        >>> import fnloop as fl
        >>> hook = fl.every(20, fl.hooks.log(console()))
    """
    return Console()


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


# -- JSON lines ----------------------------------------------------------------------------------------


def _json(value: Any) -> Any:
    if type(value) is float and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return value


def _iteration(text: str) -> int | None:
    try:
        entry = json.loads(text)
    except ValueError:
        return None  # a line torn by a crash mid-write
    iteration = entry.get("iteration") if isinstance(entry, dict) else None
    return iteration if type(iteration) is int else None


class _OneFile:
    """A writer of the one file ``path``, held while a run writes it (``claim``/``release``)."""

    path: str

    def claim(self, owner: object = None) -> None:
        """Hold the file for ``owner``: another live run or owner writing it is refused (``DirectoryInUse``)."""
        claim_file(Path(self.path), owner)

    def release(self, owner: object = None) -> bool:
        """Give back one ``claim`` by ``owner``; whether one was."""
        return release_claim(Path(self.path), owner)


_FILES: dict[tuple[int, str], Any] = {}
"""(process id, path) -> the JSON lines file open for appending; a forked child opens its own."""


@attrs.frozen
class Jsonl(_OneFile):
    """Appends one JSON object per line to ``path``; build it with ``jsonl``."""

    path: str = attrs.field(converter=_jsonl_path)

    def start(self, iteration: int) -> None:
        """Cut the file back to the lines of iterations before ``iteration``, atomically."""
        self.close()
        path = Path(self.path)
        try:
            old = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return
        lines = old.splitlines(keepends=True)
        kept = [
            text
            for text in lines
            if text.endswith("\n") and (i := _iteration(text)) is not None and i < iteration
        ]
        if len(kept) == len(lines):
            return
        data = "".join(kept).encode("utf-8")
        write_atomically(path, lambda fd: os.write(fd, data))

    def write(self, line: Line) -> None:
        """Append ``{"iteration": N, name: value, ...}`` (the newest value of each name) and flush."""
        if "iteration" in line.names:
            raise ValueError(
                ITERATION_NAMED.format(
                    writer=f"fnloop.writers.jsonl({self.path!r})", column="key", row="line"
                )
            )
        # Strict JSON: a non-finite value is written as the string Python's float() reads back.
        entry: dict[str, Any] = {
            "iteration": line.iteration,
            **{k: _json(v) for k, v in line.values().items()},
        }
        key = (os.getpid(), self.path)
        file = _FILES.get(key)
        if file is None:
            path = Path(self.path)
            path.parent.mkdir(parents=True, exist_ok=True)
            file = _FILES[key] = path.open("a", encoding="utf-8")
        file.write(json.dumps(entry) + "\n")
        file.flush()  # the line is the operating system's now: a crash of this process keeps it

    def close(self) -> None:
        """Close the file, if this process has it open."""
        file = _FILES.pop((os.getpid(), self.path), None)
        if file is not None:
            file.close()


def jsonl(path: str | os.PathLike[str]) -> Jsonl:
    """A writer appending one JSON object per line to ``path`` (open from its first write to the run's end).

    Each line holds ``"iteration"`` (the completed steps when written) and the
    newest value, as a float, of each metric recorded since the previous line;
    ``json.loads`` reads each line. A run that starts at iteration ``k`` first
    cuts the file back to the lines of iterations before ``k`` (atomically), so
    a log resumed after a crash has no repeated or abandoned iterations; a run
    starting at 0 therefore starts the file afresh.

    A metric named ``iteration`` is refused when it is written: it would
    overwrite the iteration of its line.

    Raises:
        TypeError: ``path`` is not a path.
        ValueError: ``path`` is empty, holds a NUL byte, is a directory, or
            lies under a file or in a directory the run cannot write.

    Examples:
        >>> import json, os, tempfile, fnloop as fl
        >>> path = os.path.join(tempfile.mkdtemp(), "metrics.jsonl")
        >>> step = lambda s, b: fl.record(s, loss=1.0 / (s.iteration + 1))
        >>> final = fl.run(fl.TrainState(max_iter=5), step, [None] * 5, [fl.every(2, fl.hooks.log(jsonl(path)))])
        >>> [json.loads(text) for text in Path(path).read_text().splitlines()]
        [{'iteration': 2, 'loss': 0.5}, {'iteration': 4, 'loss': 0.25}, {'iteration': 5, 'loss': 0.2}]
    """
    writer = Jsonl(path)
    _writable("jsonl", writer.path, directory=False)
    return writer


# -- CSV ------------------------------------------------------------------------------------------------


_TABLES: dict[tuple[int, str], tuple[Any, list[str]]] = {}
"""(process id, path) -> the CSV file open for appending and its columns."""


def _table(path: Path) -> tuple[list[str], list[list[str]]]:
    """The columns and the whole rows of the CSV file ``path`` (a row torn by a crash is left out)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return [], []
    lines = text.splitlines(keepends=True)
    whole = [line for line in lines if line.endswith("\n")]
    rows = list(_csv.reader(whole))
    if not rows:
        return [], []
    return rows[0], [row for row in rows[1:] if row and row[0].isdigit()]


def _rewrite(path: Path, columns: list[str], rows: list[list[str]]) -> None:
    """Write ``columns`` and ``rows`` to ``path`` atomically, each row padded to the columns."""
    out = io.StringIO()
    table = _csv.writer(out, lineterminator="\n")
    table.writerow(columns)
    table.writerows(row + [""] * (len(columns) - len(row)) for row in rows)
    data = out.getvalue().encode("utf-8")
    write_atomically(path, lambda fd: os.write(fd, data))


@attrs.frozen
class Csv(_OneFile):
    """Appends one row per write to the CSV file ``path``; build it with ``fnloop.writers.csv``."""

    path: str = attrs.field(converter=_csv_path)

    def start(self, iteration: int) -> None:
        """Cut the file back to the rows of iterations before ``iteration``, atomically."""
        self.close()
        path = Path(self.path)
        if not path.exists():
            return
        columns, rows = _table(path)
        if iteration > 0:
            self._check_columns(columns)
        kept = [row for row in rows if int(row[0]) < iteration]
        if not kept:  # a run from the start: a table of its own, columns and all
            path.unlink()
        elif len(kept) != len(rows) or not path.read_text(encoding="utf-8").endswith("\n"):
            _rewrite(path, columns, kept)

    def write(self, line: Line) -> None:
        """Append ``iteration`` and the newest value of each metric; a new metric adds a column (the
        file is then written again, atomically, the earlier rows' cells of it left empty)."""
        if "iteration" in line.names:
            raise ValueError(
                ITERATION_NAMED.format(
                    writer=f"fnloop.writers.csv({self.path!r})", column="column", row="row"
                )
            )
        values = line.values()
        key = (os.getpid(), self.path)
        path = Path(self.path)
        if key not in _TABLES:
            path.parent.mkdir(parents=True, exist_ok=True)
            columns, _ = _table(path)
            self._check_columns(columns)
            _TABLES[key] = (None, columns)
        file, columns = _TABLES[key]
        new = [name for name in values if name not in columns]
        if new or not columns:
            if file is not None:
                file.close()
            _, rows = _table(path)
            columns = (columns or ["iteration"]) + new
            _rewrite(path, columns, rows)
            file = None
        if file is None:
            file = path.open("a", encoding="utf-8", newline="")
        _TABLES[key] = (file, columns)
        row = {"iteration": str(line.iteration), **{k: repr(v) for k, v in values.items()}}
        _csv.writer(file, lineterminator="\n").writerow([row.get(name, "") for name in columns])
        file.flush()  # the row is the operating system's now: a crash of this process keeps it

    def _check_columns(self, columns: list[str]) -> None:
        """Refuse to add rows to a CSV file that does not begin with the iteration column."""
        if columns and columns[0] != "iteration":
            raise ValueError(FOREIGN_CSV.format(path=self.path, first=columns[0]))

    def close(self) -> None:
        """Close the file, if this process has it open."""
        file, _ = _TABLES.pop((os.getpid(), self.path), (None, None))
        if file is not None:
            file.close()


def csv(path: str | os.PathLike[str]) -> Csv:
    """A writer of one CSV row per write to ``path``: ``iteration``, then a column per metric.

    Columns grow as metrics appear: a metric first recorded later (a
    validation loss) adds a column, and the file is written again with it
    (atomically; earlier rows leave it empty). Values are Python's ``repr``
    of the float (``nan`` and ``inf`` included), which ``float()`` and
    pandas read back. A run that starts at iteration ``k`` first cuts the file
    back to the rows of iterations before ``k``, as ``jsonl`` does, so a
    resumed run's table has no repeated or abandoned rows; a run starting at 0
    starts the file afresh, columns and all.

    A metric named ``iteration`` is refused when it is written (it would
    overwrite the iteration column), and so is a resumed run over a CSV file
    whose first column is not ``iteration`` (a file this writer did not write).

    Raises:
        TypeError: ``path`` is not a path.
        ValueError: ``path`` is empty, holds a NUL byte, is a directory, or
            lies under a file or in a directory the run cannot write.

    Examples:
        >>> import os, tempfile, fnloop as fl
        >>> path = os.path.join(tempfile.mkdtemp(), "metrics.csv")
        >>> def step(state, batch):
        ...     state = fl.record(state, loss=1.0 / (state.iteration + 1))
        ...     return fl.record(state, val=0.5) if state.iteration == 2 else state
        >>> final = fl.run(fl.TrainState(max_iter=4), step, [None] * 4, [fl.hooks.log(csv(path))])
        >>> print(Path(path).read_text(), end="")
        iteration,loss,val
        1,1.0,
        2,0.5,
        3,0.3333333333333333,0.5
        4,0.25,
    """
    writer = Csv(path)
    _writable("csv", writer.path, directory=False)
    return writer


# -- TensorBoard ---------------------------------------------------------------------------------------

_LIVE: dict[tuple[int, str], Any] = {}
"""(process id, logdir) -> the open SummaryWriter; a forked child opens its own."""

TENSORBOARD_MISSING = (
    "fnloop.writers.tensorboard() needs the tensorboard package, which is not installed. "
    'Install it with: pip install "fnloop[tensorboard]"'
)


def _require_tensorboard() -> None:
    try:
        import tensorboard  # noqa: F401
    except ImportError as exc:
        raise ImportError(TENSORBOARD_MISSING) from exc


def _summary_writer(logdir: str, purge_step: int | None) -> Any:
    _require_tensorboard()
    from torch.utils.tensorboard import SummaryWriter

    _after_older_files(logdir)
    return SummaryWriter(logdir, purge_step=purge_step)


def _after_older_files(logdir: str) -> None:
    """Wait, if need be, until a new event file's name sorts after every one already in ``logdir``.

    TensorBoard reads a directory's event files in the order of their names,
    ``events.out.tfevents.<seconds>.<host>.<pid>.<n>``, and a purge applies to
    the files before it. Two files of one second sort by ``n``, a counter of the
    process, as text: the tenth writer a process opens (``...10``) sorts before
    the ninth, and a resumed run's purge would come first. A file of the second
    before sorts first, so a writer opened in a second that already has a file
    waits for the next one (at most a second, and only then).
    """
    try:
        names = os.listdir(logdir)
    except OSError:
        return
    prefix = f"events.out.tfevents.{int(time.time()):010d}."
    while any(name.startswith(prefix) for name in names):
        time.sleep(0.05)
        prefix = f"events.out.tfevents.{int(time.time()):010d}."


@attrs.frozen
class Tensorboard:
    """Writes scalars to TensorBoard event files in ``logdir``; build it with ``tensorboard``."""

    logdir: str = attrs.field(converter=_logdir)

    def claim(self, owner: object = None) -> None:
        """Hold the log directory for ``owner``: another live run or owner writing it is refused."""
        claim_file(Path(self.logdir), owner)

    def release(self, owner: object = None) -> bool:
        """Give back one ``claim`` by ``owner``; whether one was."""
        return release_claim(Path(self.logdir), owner)

    def start(self, iteration: int) -> None:
        """Open the event file with ``purge_step=iteration``: TensorBoard hides older events from there on."""
        self.close()
        _LIVE[(os.getpid(), self.logdir)] = _summary_writer(self.logdir, iteration)
        _STARTS[(os.getpid(), self.logdir)] = iteration

    def write(self, line: Line) -> None:
        """Add each value as a scalar named as its metric, at step ``line.iteration``; flush.

        A population member's metric (``loss/3``) goes, named as the metric
        (``loss``), into the member's own directory (``member-3 lr=0.001``):
        TensorBoard draws one curve per member in one chart.
        """
        used = []
        for name, value in line.values().items():
            split = split_member_metric(name, len(line.members)) if line.members else None
            where = "" if split is None else _member_dir(split[1], line.members[split[1]])
            writer = self._writer(where)
            writer.add_scalar(name if split is None else split[0], value, line.iteration)
            if writer not in used:
                used.append(writer)
        for writer in used:
            writer.flush()

    def _writer(self, member: str) -> Any:
        logdir = os.path.join(self.logdir, member) if member else self.logdir
        key = (os.getpid(), logdir)
        writer = _LIVE.get(key)
        if writer is None:
            writer = _LIVE[key] = _summary_writer(logdir, _STARTS.get((os.getpid(), self.logdir)))
        return writer

    def close(self) -> None:
        """Close the event files, if this process has them open."""
        pid = os.getpid()
        for key in [
            k for k in _LIVE if k[0] == pid and (k[1] == self.logdir or os.path.dirname(k[1]) == self.logdir)
        ]:
            _LIVE.pop(key).close()


_STARTS: dict[tuple[int, str], int] = {}
"""(process id, logdir) -> the iteration the run started from: a member's file opened later purges from it too."""


def _member_dir(member: int, label: str) -> str:
    """The directory of member ``member``'s events: its index and label, as TensorBoard names the curve."""
    return f"member-{member} {label}".replace(os.sep, "_")


def tensorboard(logdir: str | os.PathLike[str]) -> Tensorboard:
    """A writer of TensorBoard event files in ``logdir``, through ``torch.utils.tensorboard``.

    Scalar tags are the metric names; the step is the line's iteration (the
    same number as the JSON line's). The ``SummaryWriter`` is opened when the
    run starts, with ``purge_step`` set to the run's first iteration, so that a
    resumed run hides the events the crashed one wrote past its checkpoint; it
    is flushed after each write and closed when the run ends. A population's
    member metrics (``loss/3``) are written as ``loss`` into one directory per
    member, ``logdir/member-3 <label>``, so one chart shows every member's curve.

    Raises:
        ImportError: tensorboard is not installed (``pip install "fnloop[tensorboard]"``).
        TypeError: ``logdir`` is not a path.
        ValueError: ``logdir`` is empty, holds a NUL byte, is a file, or lies
            under a file or in a directory the run cannot write.

    Examples:
        >>> import tempfile, fnloop as fl
        >>> hook = fl.every(20, fl.hooks.log(tensorboard(tempfile.mkdtemp())))
    """
    _require_tensorboard()
    writer = Tensorboard(logdir)
    _writable("tensorboard", writer.logdir, directory=True)
    return writer


from fnloop._trackers import mlflow  # noqa: E402 - the trackers' writers, beside the files'
