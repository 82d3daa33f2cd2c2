"""The warnings of the hooks that watch a metric: it was never recorded, or a value was not finite."""

from __future__ import annotations

import math
import warnings

import attrs

from fnloop._core.state import TrainState

__all__ = ["MetricNeverRecorded", "NonFiniteMetric", "WarnNonFinite", "never_recorded"]


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


class NonFiniteMetric(UserWarning):
    """A watched metric had a value that is not finite (NaN, inf or -inf); it never counts as the best.

    ``best_checkpoint`` and ``early_stop`` warn with it, naming the metric and
    the iteration, each time they meet such a value: a NaN loss or an
    unbeatable ``-inf`` would otherwise stop the run, or keep no best, in silence.
    """


@attrs.frozen
class WarnNonFinite:
    """The effect warning that ``metric`` was ``value`` at ``iteration``; a value, so states compare equal."""

    hook: str
    metric: str
    iteration: int
    value: float = attrs.field(eq=False)

    def __call__(self, state: TrainState) -> None:
        what = "improves nothing" if math.isnan(self.value) else "is never taken for the best"
        warnings.warn(
            f"{self.hook}: the metric {self.metric!r} is {self.value} at iteration {self.iteration}; a "
            f"non-finite value {what} (a diverged loss or an evaluation that divided by zero?).",
            NonFiniteMetric,
            stacklevel=2,
        )
