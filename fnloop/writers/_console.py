"""The console writer: one line per write to the ``"fnloop"`` logger, as detectron2's printer reads."""

from __future__ import annotations

import datetime
import logging
import statistics

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

    Examples:
        >>> from fnloop import Metrics
        >>> m = Metrics().record(0, {"loss": 2.0, "lr": 0.1}).record(1, {"loss": 1.0, "lr": 0.1, "time": 0.5})
        >>> format_line(Line(2, 10, m, ("loss", "lr", "time")))
        'eta: 0:00:04  iter: 2  loss: 1.5  lr: 1.000e-01  time: 0.5000'
    """
    names = sorted((n for n in line.names if not _per_group(n, len(line.members))), key=_order)
    recent = line.recent()
    # Counts and peaks (a running total, the memory high-water mark) and the lr read as they are now.
    windowed = {n for n in names if _order(n) not in (2, 5) and n not in _COUNTS}

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
