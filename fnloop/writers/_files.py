"""The file writers: JSON lines (``jsonl``) and CSV (``csv``), each cut back to the iteration a resumed run starts at."""

from __future__ import annotations

import csv as _csv
import io
import json
import math
import os
from pathlib import Path
from typing import Any

import attrs

from fnloop._atomic import claim_file, write_atomically
from fnloop._atomic import release as release_claim
from fnloop.writers._line import FOREIGN_CSV, ITERATION_NAMED, Line, _csv_path, _jsonl_path, _writable

__all__ = ["Csv", "Jsonl", "csv", "jsonl"]


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

    @property
    def target(self) -> str:
        """The file it writes."""
        return self.path

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
