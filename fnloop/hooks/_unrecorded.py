"""The warning for a hook that watched a metric the run never recorded, shared by the hooks that watch one."""

from __future__ import annotations

from fnloop._core.state import TrainState

__all__ = ["MetricNeverRecorded", "never_recorded"]


class MetricNeverRecorded(UserWarning):
    """A hook watched a metric that the run never recorded; the message names it and the recorded ones.

    ``best_checkpoint`` and ``early_stop`` warn with it at the end of a
    successful run: a misspelt name (``"losss"``) or a missing ``evaluate``
    would otherwise leave them doing nothing, in silence.
    """


def never_recorded(caller: str, metric: str, state: TrainState) -> str:
    """The message of ``MetricNeverRecorded``: the metric, the metrics recorded, and the likely fixes."""
    recorded = sorted(state.metrics.series)
    return (
        f"{caller}: the metric {metric!r} was never recorded in this run (recorded: {recorded}), so "
        "nothing was done with it. Check its spelling against the names your loss_fn, step or "
        "evaluate() records, and that the hook recording it runs before this one in the list."
    )
