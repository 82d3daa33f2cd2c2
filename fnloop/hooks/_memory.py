"""The memory hook: peak memory as the metric ``max_mem`` (MiB)."""

from __future__ import annotations

import sys
from typing import ClassVar

import attrs
import torch

from fnloop._core.phase import Phase
from fnloop._core.state import TrainState

__all__ = ["Memory", "memory", "peak_mib"]

_MIB = 2**20


def peak_mib(state: TrainState) -> float:
    """Peak memory in MiB: CUDA's peak allocation on the device of the state's params, else peak RSS.

    On CPU it is this process's peak resident set: on Linux ``VmHWM`` from
    ``/proc/self/status`` (``getrusage``'s ``ru_maxrss`` there keeps the
    parent's peak across ``exec``, so a script started from a large process
    reported that process's memory); elsewhere ``ru_maxrss`` (bytes on macOS);
    where neither is available (Windows), 0.0. Neither reading waits for the
    device.

    Examples:
        >>> peak_mib(TrainState(max_iter=1)) > 0
        True
    """
    first = next(iter(state.params.values()), None)
    if first is not None and first.is_cuda:
        return torch.cuda.max_memory_allocated(first.device) / _MIB
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    try:
        import resource
    except ImportError:
        return 0.0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / _MIB if sys.platform == "darwin" else peak / 1024


@attrs.frozen(repr=False)
class Memory:
    """Record ``max_mem`` after a step; build it with ``memory``."""

    acts_in: ClassVar[frozenset[Phase]] = frozenset({Phase.AFTER_STEP})
    """The phases it may change the state in; the fold does not call it in the others."""

    def __call__(self, state: TrainState, phase: Phase, /) -> TrainState:
        if phase is not Phase.AFTER_STEP:
            return state
        metrics = state.metrics.record(state.iteration, {"max_mem": peak_mib(state)})
        return attrs.evolve(state, metrics=metrics)

    def __repr__(self) -> str:
        return "memory()"


def memory() -> Memory:
    """A hook recording peak memory as ``max_mem`` (MiB, a float) at ``AFTER_STEP``.

    CUDA's ``max_memory_allocated`` when the state's params live on a GPU,
    the process's peak RSS otherwise (see ``peak_mib``). Recorded under the
    step's index, like the other metrics; the console writer shows it as
    ``max_mem: ...M``. Usually ``every(n, memory())``: it costs a system call.

    Examples:
        >>> import fnloop as fl
        >>> final = fl.run(fl.TrainState(max_iter=2), lambda s, b: s, [None] * 2, [fl.every(2, memory())])
        >>> [i for i, _ in final.metrics.history("max_mem")]
        [1]
    """
    return Memory()
