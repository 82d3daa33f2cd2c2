"""The profile hook: ``torch.profiler`` over a window of iterations, written as a chrome trace."""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from typing import Any, ClassVar

import attrs
import torch

from fnloop._core.messages import a_path, non_negative_int, positive_int, unwritable
from fnloop._core.phase import Phase
from fnloop._core.state import TrainState, request

__all__ = ["Profile", "profile"]

_PROFILERS: dict[tuple[int, str, int], Any] = {}
"""(process id, directory, first iteration) -> the running profiler."""


def _a_directory(value: object) -> str:
    return a_path(value, "directory")


@attrs.frozen
class _Start:
    directory: str
    start: int

    def __call__(self, state: TrainState) -> None:
        key = (os.getpid(), self.directory, self.start)
        if key in _PROFILERS:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profiler = torch.profiler.profile(activities=activities)
        profiler.start()
        _PROFILERS[key] = profiler


@attrs.frozen
class _Stop:
    directory: str
    start: int

    def __call__(self, state: TrainState) -> None:
        profiler = _PROFILERS.pop((os.getpid(), self.directory, self.start), None)
        if profiler is None:
            return
        profiler.stop()
        path = trace_path(self.directory, self.start)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Exported under a temporary name, then renamed: a reader never sees half a trace.
        temp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            profiler.export_chrome_trace(os.fspath(temp))
            os.replace(temp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                temp.unlink()


def trace_path(directory: str | os.PathLike[str], start: int) -> Path:
    """Where ``profile(directory, start=start, ...)`` writes its trace: ``directory/trace-<start>.json``."""
    return Path(directory) / f"trace-{start}.json"


@attrs.frozen(repr=False)
class Profile:
    """Profile iterations ``[start, start + steps)``; build it with ``profile``."""

    acts_in: ClassVar[frozenset[Phase]] = frozenset({Phase.BEFORE_STEP, Phase.AFTER_STEP, Phase.AFTER_TRAIN})
    """The phases it may change the state in; the fold does not call it in the others."""

    directory: str = attrs.field(converter=_a_directory)
    start: int = attrs.field(validator=non_negative_int)
    steps: int = attrs.field(validator=positive_int)

    def __call__(self, state: TrainState, phase: Phase, /) -> TrainState:
        if phase is Phase.BEFORE_STEP:
            if state.iteration == self.start:
                return request(state, _Start(self.directory, self.start), f"profile from {self.start}")
            return state
        if phase is Phase.AFTER_STEP:
            if state.iteration == self.start + self.steps - 1:
                return request(state, _Stop(self.directory, self.start), f"profile trace {self.start}")
            return state
        if phase is Phase.AFTER_TRAIN:
            return request(state, _Stop(self.directory, self.start), f"profile trace {self.start}")
        return state

    def __repr__(self) -> str:
        return f"profile({self.directory!r}, start={self.start}, steps={self.steps})"


def profile(directory: str | os.PathLike[str], *, start: int, steps: int) -> Profile:
    """A hook profiling iterations ``[start, start + steps)`` with ``torch.profiler``.

    An effect at ``BEFORE_STEP`` of ``start`` starts the profiler (CPU, and
    CUDA where there is a GPU); one at ``AFTER_STEP`` of ``start + steps - 1``,
    or at ``AFTER_TRAIN`` if the run ends first, stops it and writes a chrome
    trace to ``directory/trace-<start>.json`` (open it in Perfetto or
    ``chrome://tracing``). The window covers the steps and the hooks between
    them, and the effects of ``BEFORE_STEP``. A run resumed past ``start``
    profiles nothing. Pick ``start`` after the compile (a few iterations in).

    Args:
        directory: where the trace goes (created if missing).
        start: the first iteration profiled.
        steps: how many iterations.

    Returns:
        The hook.

    Raises:
        ValueError: ``start`` negative or ``steps`` not positive, or ``directory``
            cannot be made or written into (checked now, not when the trace is due).
        TypeError: ``directory`` is not a path.

    Examples:
        >>> import json, tempfile, fnloop as fl
        >>> folder = tempfile.mkdtemp()
        >>> final = fl.run(fl.TrainState(max_iter=3), lambda s, b: s, [None] * 3, [profile(folder, start=1, steps=1)])
        >>> "traceEvents" in json.loads(trace_path(folder, 1).read_text())
        True
    """
    hook = Profile(directory, start, steps)
    _check_writable(Path(hook.directory))
    return hook


def _check_writable(directory: Path) -> None:
    """Refuse ``directory`` now if the trace could not be written there when it is due."""
    why = unwritable(directory, directory=True)
    if why is not None:
        raise ValueError(
            f"profile(): cannot write into {directory}: {why}. Give a directory the run may create or write to."
        )
