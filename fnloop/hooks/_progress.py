"""The progress hook: a tqdm bar over the run, on a terminal only."""

from __future__ import annotations

import os
import sys
from typing import Any, ClassVar

import attrs

from fnloop._core.messages import got, non_empty_str
from fnloop._core.phase import Phase
from fnloop._core.state import Effect, TrainState, request, unchecked

__all__ = ["Progress", "progress"]

_AFTER_STEP = Phase.AFTER_STEP
_BEFORE_TRAIN = Phase.BEFORE_TRAIN
_AFTER_TRAIN = Phase.AFTER_TRAIN

_BARS: dict[tuple[int, str], Any] = {}
"""(process id, hook name) -> the open tqdm bar; a forked child opens its own."""

TQDM_MISSING = (
    "fnloop.hooks.progress() needs the tqdm package, which is not installed. "
    'Install it with: pip install tqdm (from a checkout of fnloop: pip install -e ".[progress]")'
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
            # The hook decides when to draw (see Progress); tqdm draws when told.
            mininterval=0,
            miniters=1,
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
        series = state.metrics.series
        shown = []
        if "loss" in series:  # a host sync, as often as the bar is drawn
            shown.append(f"loss: {state.metrics.latest_float('loss')[1]:.4g}")
        if "tokens_per_s" in series:  # throughput's floats: no sync
            shown.append(f"tok/s: {state.metrics.latest_float('tokens_per_s')[1]:.4g}")
        if "mfu" in series:
            shown.append(f"mfu: {100 * state.metrics.latest_float('mfu')[1]:.1f}%")
        if shown:
            bar.set_postfix_str("  ".join(shown), refresh=False)
        bar.update(state.iteration - bar.n)


@attrs.frozen
class _Close:
    name: str

    def __call__(self, state: TrainState) -> None:
        bar = _BARS.pop((os.getpid(), self.name), None)
        if bar is not None:
            # The ticks since its last redraw, counted without drawing: `close` draws the final bar once.
            bar.n = state.iteration
            bar.close()


def _seconds(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if type(value) not in (int, float) or not value >= 0:  # type: ignore[operator]
        raise ValueError(f"'{attribute.name}' must be a non-negative number of seconds ({got(value)}).")


@attrs.frozen(repr=False)
class Progress:
    """A tqdm bar over the run; build it with ``progress``."""

    acts_in: ClassVar[frozenset[Phase]] = frozenset({Phase.BEFORE_TRAIN, Phase.AFTER_STEP, Phase.AFTER_TRAIN})
    """The phases it may change the state in; the fold does not call it in the others."""

    name: str = attrs.field(validator=non_empty_str)
    mininterval: float = attrs.field(validator=_seconds)
    tick: Effect = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        # Built once: the hook runs every step and only appends it.
        object.__setattr__(self, "tick", Effect(_Tick(self.name), f"{self.name}: advance the bar"))

    def __call__(self, state: TrainState, phase: Phase, /) -> TrainState:
        if phase is _AFTER_STEP:
            # Draw when this iteration crossed a multiple of `mininterval` on the fold's clock: a
            # pure function of the state, so steps in between cost one comparison and no effect.
            every, now = self.mininterval, state.time
            if every and now // every == (now - state.step_time) // every:
                return state
            return unchecked(state, effects=(*state.effects, self.tick))
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
    so a resumed run's bar and ETA are right), is drawn again after a step
    during which the fold's clock crossed a multiple of ``mininterval``
    (about every ``mininterval`` seconds, decided from ``state.time`` and
    ``state.step_time`` alone) and closes at ``AFTER_TRAIN``, all as effects.
    Steps in between cost one comparison. It is shown only when stderr is a
    terminal; otherwise there is no bar at all (logs and CI output stay
    clean). tqdm shows the rate and ETA itself; the loss (a host sync) is read
    only when the bar is drawn. The hook keeps no state: the bar is a live
    object of the process. The console writer's lines (``fnloop.writers.console``)
    are printed above the live bar, which is drawn again below them, and the
    finished bar stays on the screen once.

    Args:
        name: tells bars of several progress hooks apart.
        mininterval: about how many seconds between two redraws (0: after every step).

    Returns:
        The hook.

    Raises:
        ImportError: tqdm is not installed (``pip install tqdm``).
        ValueError: ``name`` is empty, or ``mininterval`` is negative.

    Examples:
        >>> import fnloop as fl
        >>> final = fl.run(fl.TrainState(max_iter=3), lambda s, b: s, [None] * 3, [progress()])
    """
    _require_tqdm()
    return Progress(name, mininterval)
