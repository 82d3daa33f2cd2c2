"""The progress hook: a tqdm bar over the run, on a terminal only."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import attrs

from fnloop._messages import got
from fnloop._phase import Phase
from fnloop._state import Effect, TrainState, replace, request

__all__ = ["Progress", "progress"]

_AFTER_STEP = Phase.AFTER_STEP
_BEFORE_TRAIN = Phase.BEFORE_TRAIN
_AFTER_TRAIN = Phase.AFTER_TRAIN

_BARS: dict[tuple[int, str], Any] = {}
"""(process id, hook name) -> the open tqdm bar; a forked child opens its own."""

TQDM_MISSING = (
    "fnloop.hooks.progress() needs the tqdm package, which is not installed. "
    'Install it with: pip install "fnloop[progress]"'
)


def _require_tqdm() -> Any:
    try:
        import tqdm
    except ImportError as exc:
        raise ImportError(TQDM_MISSING) from exc
    return tqdm


def _terminal() -> bool:
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty is not None and isatty())


@attrs.frozen
class _Open:
    name: str
    mininterval: float

    def __call__(self, state: TrainState) -> None:
        _Close(self.name)(state)
        if not _terminal():
            return
        tqdm = _require_tqdm()
        _BARS[(os.getpid(), self.name)] = tqdm.tqdm(
            total=state.max_iter,
            initial=state.iteration,
            file=sys.stderr,
            mininterval=self.mininterval,
            dynamic_ncols=True,
            unit="it",
        )


@attrs.frozen
class _Tick:
    name: str

    def __call__(self, state: TrainState) -> None:
        bar = _BARS.get((os.getpid(), self.name))
        if bar is None:
            return
        # tqdm's own test, first the count (cheap), then the clock: below both it would only count,
        # so the bar is told only when it may redraw, and the loss (a host sync) read only then.
        if (
            state.iteration - bar.last_print_n < bar.miniters
            or time.time() - bar.last_print_t < bar.mininterval
        ):
            return
        if "loss" in state.metrics.series:
            bar.set_postfix_str(f"loss: {state.metrics.latest_float('loss')[1]:.4g}", refresh=False)
        bar.update(state.iteration - bar.n)


@attrs.frozen
class _Close:
    name: str

    def __call__(self, state: TrainState) -> None:
        bar = _BARS.pop((os.getpid(), self.name), None)
        if bar is not None:
            bar.update(state.iteration - bar.n)  # the ticks since its last redraw
            bar.close()


def _name(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if type(value) is not str or not value:
        raise ValueError(f"'{attribute.name}' must be a non-empty str ({got(value)}).")


def _seconds(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if type(value) not in (int, float) or not value >= 0:  # type: ignore[operator]
        raise ValueError(f"'{attribute.name}' must be a non-negative number of seconds ({got(value)}).")


@attrs.frozen(repr=False)
class Progress:
    """A tqdm bar over the run; build it with ``progress``."""

    name: str = attrs.field(validator=_name)
    mininterval: float = attrs.field(validator=_seconds)
    tick: Effect = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        # Built once: the hook runs every step and only appends it.
        object.__setattr__(self, "tick", Effect(_Tick(self.name), f"{self.name}: advance the bar"))

    def __call__(self, state: TrainState, phase: Phase, /) -> TrainState:
        if phase is _AFTER_STEP:
            return replace(state, effects=(*state.effects, self.tick))
        if phase is _BEFORE_TRAIN:
            return request(state, _Open(self.name, self.mininterval), f"{self.name}: open the bar")
        if phase is _AFTER_TRAIN:
            return request(state, _Close(self.name), f"{self.name}: close the bar")
        return state

    def __repr__(self) -> str:
        return f"progress(name={self.name!r}, mininterval={self.mininterval!r})"


def progress(*, name: str = "progress", mininterval: float = 0.1) -> Progress:
    """A hook showing a tqdm bar over ``max_iter``, with the loss in its postfix, on a terminal.

    The bar opens at ``BEFORE_TRAIN`` (starting at the run's first iteration,
    so a resumed run's bar and ETA are right), advances after every step and
    closes at ``AFTER_TRAIN``, all as effects. It is shown only when stderr is
    a terminal; otherwise there is no bar at all (logs and CI output stay
    clean). tqdm draws at most every ``mininterval`` seconds and shows the
    rate and ETA itself; the loss (a host sync) is read only when it draws.
    The hook keeps no state: the bar is a live object of the process.

    >>> import fnloop as fl
    >>> final = fl.run(fl.TrainState(max_iter=3), lambda s, b: s, [None] * 3, [progress()])

    Args:
        name: tells bars of several progress hooks apart.
        mininterval: the least seconds between two redraws.

    Returns:
        The hook.

    Raises:
        ImportError: tqdm is not installed (``pip install "fnloop[progress]"``).
        ValueError: ``name`` is empty, or ``mininterval`` is negative.
    """
    _require_tqdm()
    return Progress(name, mininterval)
