"""The TensorBoard writer: one scalar per metric, a population's members each in a run directory of their own."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import attrs

from fnloop._atomic import claim_file
from fnloop._atomic import release as release_claim
from fnloop._core.population import split_member_metric
from fnloop.writers._line import Line, _logdir, _writable

__all__ = ["Tensorboard", "tensorboard"]

_LIVE: dict[tuple[int, str], Any] = {}
"""(process id, logdir) -> the open SummaryWriter; a forked child opens its own."""

TENSORBOARD_MISSING = (
    "fnloop.writers.tensorboard() needs the tensorboard package, which is not installed. "
    'Install it with: pip install tensorboard (from a checkout of fnloop: pip install -e ".[tensorboard]")'
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

    @property
    def target(self) -> str:
        """The directory it writes its event files into."""
        return self.logdir

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
        ImportError: tensorboard is not installed (``pip install tensorboard``).
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
