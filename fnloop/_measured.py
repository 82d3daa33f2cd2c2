"""What the machine measured into a state (its clock, its memory): left out when two runs are compared."""

from __future__ import annotations

from typing import Any

import attrs

from fnloop._core.metrics import Metrics
from fnloop._core.state import Clock, TrainState, Unclaimed

__all__ = ["CLOCK_METRICS", "without_clock"]

CLOCK_METRICS = ("time", "data_time", "max_mem", "samples_per_s", "tokens_per_s", "mfu", "hook_time")
"""Metrics the machine measured: off the fold's clock (``fnloop.hooks.timer``, ``fnloop.hooks.throughput``) and its memory (``fnloop.hooks.memory``)."""


def without_clock(state: TrainState) -> TrainState:
    """``state`` without what the machine measured into it (clock, memory): for comparing two runs, not two machines.

    ``state.clock`` becomes ``Clock()``; the metrics ``CLOCK_METRICS`` names (the timer's, the
    throughput's and ``max_mem``) and the timer's and throughput's hook states are left out.
    Everything else, the run itself, stays; a resumed run equals an uninterrupted one under this view.

    Examples:
        >>> from fnloop.testing import assert_identical
        >>> a = attrs.evolve(TrainState(max_iter=1), clock=Clock(time=1.0))
        >>> assert_identical(without_clock(a), without_clock(TrainState(max_iter=1)))
    """
    metrics = {k: v for k, v in state.metrics.series.items() if k not in CLOCK_METRICS}
    hooks = {k: v for k, v in state.hooks.items() if not _clocked(v)}
    return attrs.evolve(
        state,
        clock=Clock(),
        hooks=hooks,
        metrics=Metrics(window=state.metrics.window, series=metrics),
    )


def _clocked(value: Any) -> bool:
    """Whether a hook's state is a clock's: a timer's or a throughput meter's."""
    from fnloop.checkpoint._codec import type_name
    from fnloop.hooks import ThroughputState, TimerState

    clocked = (TimerState, ThroughputState)
    # Loaded without its hook, such a state is still data, named by the record's type.
    if type(value) is Unclaimed:
        return getattr(value.data, "type", None) in {type_name(t) for t in clocked}
    return type(value) in clocked
