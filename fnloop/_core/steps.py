"""The step as users write it (``Step``), and the one convention the fold calls it by (``Applied``).

A step is any pure function ``(state, batch) -> state``. It may offer more:
a ``donating`` variant allowed to reuse the state's storage, and, with
``steps_per_call = k > 1``, ``steps(state, batches)`` running ``k`` iterations
in one call (and ``donating_steps``). ``adapt`` reads all of that once, when
a run starts, into an ``Applied``: ``apply(state, batches, owned=...)``.
From then on the fold asks the step nothing. ``fnloop.train_step``'s steps
are ``Applied`` themselves.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs

from fnloop._core.state import TrainState

__all__ = ["Applied", "Step", "adapt"]


class Step(Protocol):
    """A pure function ``(state, batch) -> state`` run once per iteration.

    A step may also offer ``donating(state, batch)``: the same function, allowed
    to reuse the storage of ``state``'s tensors. ``run`` calls it only for
    states nobody outside the fold can see.

    It gets the state the ``BEFORE_STEP`` hooks returned; in an iteration
    where none is due, the state the previous iteration ended with.

    A step with ``steps_per_call = k > 1`` also offers ``steps(state,
    batches)``, running ``len(batches)`` iterations from ``state.iteration``
    and returning the state at the last one's index (and may offer
    ``donating_steps``). ``run`` then calls it for each whole call of ``k``
    iterations starting at a multiple of ``k``, single steps elsewhere, and
    refuses hooks that may act inside a call.
    """

    def __call__(self, state: TrainState, batch: Any, /) -> TrainState: ...


class Applied(abc.ABC):
    """A step as the fold calls it: ``apply(state, batches, owned=...)``.

    ``apply`` runs ``len(batches)`` iterations from ``state.iteration``: one,
    or ``per_call`` where a whole call fits, and returns the state at the last
    one's index (the fold advances it). With ``owned``, nobody but the fold
    can see ``state``: the step may write into its tensors. A step that can
    tell the fold more about a failure (it tore the state; it stopped inside a
    call) raises ``fnloop._core.failure.StepFailed``.
    """

    per_call: int = 1
    """How many iterations one call runs where a whole call fits (``steps_per_call``)."""

    donates: bool = False
    """Whether ``apply`` may write into an owned state's tensors (then a failure after it tears that state)."""

    @abc.abstractmethod
    def apply(self, state: TrainState, batches: Sequence[Any], *, owned: bool) -> TrainState:
        """``len(batches)`` iterations from ``state.iteration``; the state at the last one's index."""

    def finish(self) -> None:  # noqa: B027 - a step with nothing to drop needs no override
        """The run is over: drop whatever the step kept of its states (the fold calls it once, at the end)."""


@attrs.frozen(repr=False)
class _Function(Applied):
    """A user's step, with the variants it offers."""

    step: Callable[[TrainState, Any], TrainState]
    donating: Callable[[TrainState, Any], TrainState] | None
    steps: Callable[[TrainState, Sequence[Any]], TrainState] | None
    donating_steps: Callable[[TrainState, Sequence[Any]], TrainState] | None
    per_call: int = 1

    @property
    def donates(self) -> bool:  # type: ignore[override]
        return self.donating is not None or self.donating_steps is not None

    def __repr__(self) -> str:
        return repr(self.step)

    def apply(self, state: TrainState, batches: Sequence[Any], *, owned: bool) -> TrainState:
        if len(batches) == 1:
            one = self.donating if owned and self.donating is not None else self.step
            return one(state, batches[0])
        many = self.donating_steps if owned and self.donating_steps is not None else self.steps
        return many(state, batches)  # type: ignore[misc]


def adapt(step: Step, *, donate: bool) -> Applied:
    """``step`` as the fold calls it; ``donate=False`` leaves out the variants that reuse storage."""
    if isinstance(step, Applied):
        return step  # the fold never passes owned=True where donate is False
    steps = getattr(step, "steps", None)
    k = getattr(step, "steps_per_call", 1)
    several = type(k) is int and k > 1 and callable(steps)
    return _Function(
        step,
        _variant(step, "donating") if donate else None,
        steps if several else None,
        _variant(step, "donating_steps") if donate and several else None,
        k if several else 1,
    )


def _variant(step: object, name: str) -> Any:
    variant = getattr(step, name, None)
    return variant if callable(variant) else None
