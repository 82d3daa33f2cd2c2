"""Ending a run that keeps spiking: ``stop_on_spikes`` reads what ``fnloop.optim.skip_spikes`` records."""

from __future__ import annotations

from typing import ClassVar

import attrs

from fnloop._core.messages import got
from fnloop._core.metrics import to_floats
from fnloop._core.phase import Phase
from fnloop._core.state import TrainState

__all__ = ["SpikesInARow", "StopOnSpikes", "stop_on_spikes"]

_METRIC = "spikes_in_a_row"


class SpikesInARow(RuntimeError):
    """A run skipped more loss spikes in a row than ``stop_on_spikes`` allows."""


@attrs.frozen(repr=False)
class StopOnSpikes:
    """Raise ``SpikesInARow`` after ``n`` skipped steps in a row; build it with ``stop_on_spikes``."""

    acts_in: ClassVar[frozenset[Phase]] = frozenset({Phase.BEFORE_TRAIN, Phase.AFTER_STEP})
    """Where it looks: it reads the metrics, never changes the state, and raises."""

    n: int

    def __call__(self, state: TrainState, phase: Phase, /) -> TrainState:
        if phase is Phase.BEFORE_TRAIN:
            _check_skips(state, self)
            return state
        if phase is not Phase.AFTER_STEP:
            return state
        series = state.metrics.series
        # A population's members record theirs as spikes_in_a_row/<member>.
        names = [k for k in series if k == _METRIC or k.startswith(_METRIC + "/")]
        newest = [series[name][-1] for name in names]
        for name, (i, _), value in zip(names, newest, to_floats(v for _, v in newest)):  # one host read
            if value >= self.n:
                raise SpikesInARow(
                    f"step {i}: {int(value)} steps in a row were skipped as spikes ({name}), "
                    f"stop_on_spikes({self.n}) allows fewer. The run's last checkpoint holds the "
                    "state before them (a skipped step changes no parameter). Look at the data "
                    "those steps read and the learning rate; resume from that checkpoint with a "
                    "lower rate, or raise skip_spikes' threshold if these were no spikes."
                )
        return state

    def __repr__(self) -> str:
        return f"stop_on_spikes({self.n})"


def _check_skips(state: TrainState, hook: StopOnSpikes) -> None:
    """Refuse a run whose optimizer skips no spikes: the hook would watch a count that never moves."""
    from torch.utils import _pytree as pytree

    from fnloop.optim._spikes import SpikeState

    if not state.params:  # a state without a model (a simulation, a hook's test): nothing to watch yet
        return
    found = pytree.tree_leaves(state.opt_state, is_leaf=lambda x: isinstance(x, SpikeState))
    if not any(isinstance(x, SpikeState) for x in found):
        raise ValueError(
            f"{hook!r} in a run whose optimizer skips no spikes: it reads the count that "
            "fnloop.optim.skip_spikes records, so it could never stop this run. Wrap the optimizer, "
            "in both fnloop.init and train_step: fl.optim.skip_spikes(fl.optim.adamw(...)) "
            "(see docs/watching.md); or leave the hook out."
        )


def stop_on_spikes(n: int) -> StopOnSpikes:
    """A hook ending the run with ``SpikesInARow`` once ``n`` steps in a row were skipped as spikes.

    It reads the newest value of the metric ``spikes_in_a_row`` that
    ``fnloop.optim.skip_spikes`` records (one host read per call), so run it
    every step (a streak that ends between two of its calls is not seen). A
    run whose optimizer is not wrapped in ``skip_spikes`` is refused as it
    starts: the hook could never fire there.

    Args:
        n: how many skipped steps in a row end the run; positive.

    Examples:
        >>> import fnloop as fl
        >>> hooks = [fl.hooks.stop_on_spikes(5)]
    """
    if type(n) is not int or n < 1:
        raise ValueError(f"stop_on_spikes(n) must be a positive int ({got(n)}).")
    return StopOnSpikes(n)
