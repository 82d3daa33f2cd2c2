"""The console writer: one line per write to the ``"fnloop"`` logger, as detectron2's printer reads."""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import statistics
import sys
from collections.abc import Iterator

import attrs

from fnloop._core.metrics import STEP_STATISTICS, to_floats
from fnloop._core.population import split_member_metric
from fnloop.writers._line import LOGGER, Line

__all__ = ["Console", "console", "format_line"]


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


def _console_handler(handler: logging.Handler) -> bool:
    # tqdm's own test (tqdm.contrib.logging): what a terminal shows, where a bar may be drawn.
    return isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.stderr)


@contextlib.contextmanager
def _above_bars(logger: logging.Logger) -> Iterator[None]:
    """While logging one record: the terminal's handlers of ``logger`` and its ancestors write through ``tqdm.write``.

    ``tqdm.write`` clears every live bar on the terminal, writes the line and
    draws the bars again below it, so a line never lands inside a bar
    (``fnloop.hooks.progress``'s or the user's own); with no bar live it is
    the plain write. Where tqdm was never imported, no bar can be live.
    """
    if "tqdm" not in sys.modules:
        yield
        return
    from tqdm.contrib.logging import logging_redirect_tqdm

    # tqdm's handler takes each redirected logger's terminal handler's stream, format and filters,
    # not its level: a logger whose terminal handlers would all drop the record is left alone.
    loggers: list[logging.Logger] = []
    current: logging.Logger | None = logger
    while current is not None:
        if any(_console_handler(h) and h.level <= logging.INFO for h in current.handlers):
            loggers.append(current)
        current = current.parent if current.propagate else None
    if not loggers:
        yield
        return
    with logging_redirect_tqdm(loggers=loggers):
        yield


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
            with _above_bars(logger):
                logger.info(format_line(line))

    def close(self) -> None:
        """Nothing to close."""


def _order(name: str) -> int:
    if "loss" in name:
        return 0
    if name == "lr" or name.startswith("lr/"):
        return 2
    return {"time": 3, "data_time": 4, "max_mem": 5}.get(name, 1)


_COUNTS = ("skipped", "spikes", "spikes_in_a_row")
"""Running counts: shown as they are now, not as a median."""


def _per_group(name: str, members: int) -> bool:
    """Whether ``name`` is a block's or a parameter's statistic (``grad_norm/layers.0``): files keep those, the console not.

    A population's member metric (``grad_norm/3``, or ``grad_norm/layers.0/3``) is judged by what precedes the member.
    """
    if members:
        found = split_member_metric(name, members)
        if found is not None:
            name = found[0]
    figure, slash, _ = name.partition("/")
    return bool(slash) and figure in STEP_STATISTICS


def format_line(line: Line) -> str:
    """The console's text for ``line``: ``eta: H:MM:SS  iter: N  loss: ...  lr: ...  time: ...``.

    Each metric is shown as the median of its entries recorded since the
    previous write that the metrics window still keeps (a training loss or
    batch accuracy recorded every step: the last ``window`` steps; a
    validation metric recorded once per period: that value), as detectron2
    smooths its losses; ``lr``, ``max_mem`` and the running counts ``skipped``,
    ``spikes`` and ``spikes_in_a_row`` as their newest value. A block's or a
    parameter's statistic (``grad_norm/<group>``, ``train_step(stats=...)``) is
    left to the files. The ETA is the median ``time`` times the
    iterations left; a finished run shows ``eta: 0:00:00``; without any
    ``time`` there is no ETA.

    A population's line (``line.members``) keeps what its members share on
    that first line and shows the members' metrics (``loss/3``) below it as a
    table: a row per member (its index and label), a column per metric. The
    member with the lowest validation loss (``val_loss``, else another
    ``val_...loss``, else the training ``loss``) is marked ``best``. Beyond
    eight members the table shows three rows only: the best, the median and
    the worst member by that loss (by the first metric, lowest to highest,
    where none is a loss). A member with nothing new since the previous write
    (a stopped member) shows ``-``.

    Examples:
        >>> from fnloop import Metrics
        >>> m = Metrics().record(0, {"loss": 2.0, "lr": 0.1}).record(1, {"loss": 1.0, "lr": 0.1, "time": 0.5})
        >>> format_line(Line(2, 10, m, ("loss", "lr", "time")))
        'eta: 0:00:04  iter: 2  loss: 1.5  lr: 1.000e-01  time: 0.5000'
        >>> m = Metrics().record(0, {"loss/0": 0.5, "loss/1": 0.25, "time": 0.5})
        >>> print(format_line(Line(1, 10, m, ("loss/0", "loss/1", "time"), members=("lr=0.1", "lr=0.01"))))
        eta: 0:00:04  iter: 1  time: 0.5000
          member      loss
          0  lr=0.1    0.5
          1  lr=0.01  0.25  best loss
    """
    size = len(line.members)
    names = sorted((n for n in line.names if not _per_group(n, size)), key=lambda n: _order(_metric(n, size)))
    recent = line.recent()

    def value(name: str) -> float:
        # Counts and peaks (a running total, the memory high-water mark) and the lr read as they are now.
        metric = _metric(name, size)
        if _order(metric) in (2, 5) or metric in _COUNTS:
            return recent[name][-1]
        return statistics.median(recent[name])

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
    columns: dict[str, dict[int, float]] = {}
    for name in names:
        found = split_member_metric(name, size) if size else None
        if found is None:
            fields.append(f"{name}: {_shown(name, value(name))}")
        else:
            columns.setdefault(found[0], {})[found[1]] = value(name)
    head = "  ".join(fields)
    if not columns:
        return head
    return "\n".join((head, *_table(columns, line.members)))


def _metric(name: str, members: int) -> str:
    """The metric a name shows: ``loss`` for member 3's ``loss/3``, the name itself for any other."""
    found = split_member_metric(name, members) if members else None
    return name if found is None else found[0]


def _shown(metric: str, value: float) -> str:
    kind = _order(metric)
    if kind == 2:
        return f"{value:.3e}"
    if kind in (3, 4):
        return f"{value:.4f}"
    if kind == 5:
        return f"{value:.0f}M"
    return f"{value:.4g}"


_ROWS = 8
"""Up to this many members, the console's table shows each; beyond, the best, the median and the worst."""


def _ranking(columns: dict[str, dict[int, float]]) -> tuple[str, bool]:
    """The metric the members are ranked by, and whether it is a loss (the lowest is the best)."""
    losses = [name for name in columns if "loss" in name]
    for preferred in (
        [n for n in losses if n == "val_loss"],
        [n for n in losses if n.startswith("val")],
        [n for n in losses if n == "loss"],
        losses,
    ):
        if preferred:
            return preferred[0], True
    return next(iter(columns)), False


def _table(columns: dict[str, dict[int, float]], labels: tuple[str, ...]) -> list[str]:
    """The lines of the members' table: a header, then a row per member shown."""
    by, is_loss = _ranking(columns)
    ranked = sorted(columns[by], key=lambda m: (math.isnan(columns[by][m]), columns[by][m], m))
    marks: dict[int, str] = {}
    if len(labels) <= _ROWS:
        rows = list(range(len(labels)))
        if is_loss:
            marks[ranked[0]] = f"best {by}"
        title = ""
    else:
        words = ("best", "median", "worst") if is_loss else ("lowest", "median", "highest")
        for word, m in zip(words, (ranked[0], ranked[(len(ranked) - 1) // 2], ranked[-1])):
            marks.setdefault(m, f"{word} {by}")
        rows = list(marks)
        title = f"{len(rows)} of {len(labels)} members"
    digits = len(str(len(labels) - 1))
    table = [["member", *columns, title]]
    for m in rows:
        cells = [_shown(name, values[m]) if m in values else "-" for name, values in columns.items()]
        table.append([f"{m:>{digits}}  {labels[m]}", *cells, marks.get(m, "")])
    widths = [max(len(row[i]) for row in table) for i in range(len(columns) + 1)]
    return [
        "  "
        + "  ".join(
            [row[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(row[1:-1], widths[1:])), row[-1]]
        ).rstrip()
        for row in table
    ]


def console() -> Console:
    """A writer logging one line per write to the ``"fnloop"`` logger at INFO.

    The line reads as detectron2's ``CommonMetricPrinter``'s: ``eta: H:MM:SS
    iter: N  loss: ...  lr: ...  time: ...  data_time: ...  max_mem: ...M``
    (see ``format_line``); a population's is that line and a table of its
    members below it, in the same record. So that the lines are seen even where nobody
    configured ``logging``: if neither the ``"fnloop"`` logger nor the root
    logger has a handler at the first write, it gives ``"fnloop"`` a handler
    writing to stderr and level INFO (as ``logging.basicConfig`` would, for
    fnloop alone). Configure ``logging`` yourself to decide otherwise.

    Where tqdm is loaded, a record goes to stderr or stdout through
    ``tqdm.write`` (tqdm's ``logging_redirect_tqdm``, around that one record):
    a live bar (``fnloop.hooks.progress()``'s) is cleared, the line printed on
    a line of its own, and the bar drawn again below it. With no bar live that
    is the plain write. A handler that writes to a file is left alone.

    Examples:
        >>> import fnloop as fl
        >>> hook = fl.every(20, fl.hooks.log(console()))
    """
    return Console()
