"""What the fold does when an iteration fails: name the state left, run ``AFTER_TRAIN``, re-raise.

A failure in the fold leaves one of two situations. Either the last
consistent state (the input, the state after ``BEFORE_TRAIN``, or the state
after the last completed iteration) is intact: it rides on the exception as
``exc.state`` and ``AFTER_TRAIN`` runs with it, so a checkpoint hook saves it.
Or a step was writing into that state's tensors (donation) when it failed, or
it had written and an ``AFTER_STEP`` hook then raised before the iteration
was done: the state is *torn*, no consistent state is left in memory,
``exc.state`` is ``None`` and ``AFTER_TRAIN`` runs without performing
effects, so nothing half-updated is ever written over the last good
checkpoint. An effect that fails (a save, a log write, a save in the
background found failed at the next hand-over) never tears a state: effects
run once the iteration is done and only read its state, which is then the
last consistent one.

A step reports what the fold cannot see from outside by raising
``StepFailed``: whether it tore the state, and, for a call of several steps
stopped inside (``NonFiniteLoss``), the state it reached. The fold unwraps
it: the caller only ever sees the step's own exception.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fnloop._core.state import Performs, TrainState, reading, unchecked

__all__ = ["Last", "StepFailed", "TORN", "ended_by", "unwrapped"]

TORN = (
    "fnloop: this failed while the state was being updated in place (donation: in the step, or "
    "in an AFTER_STEP hook right after it, before the iteration was done), so no consistent state "
    "is left in memory and "
    "exc.state is None; AFTER_TRAIN ran without "
    "performing effects, so no checkpoint of a half-updated state was written. Resume from the "
    "last checkpoint, or use train_step(..., donate=False) to keep the previous state intact."
)


class StepFailed(BaseException):
    """A step's exception, with what the fold needs to know about the state it leaves.

    Raised only by a step's private ``apply`` (``fnloop._core.steps``) and
    caught only by the fold, which re-raises ``error`` itself.

    Args:
        error: the exception the step raised.
        torn: the step had written into the state's tensors when it failed.
        reached: for several steps in one call, the state before the step that
            failed (its ``iteration`` that step's index), as single steps would
            have left it; ``None`` when the call failed as a whole.
    """

    def __init__(
        self, error: BaseException, *, torn: bool = False, reached: TrainState | None = None
    ) -> None:
        super().__init__(error)
        self.error = error
        self.torn = torn
        self.reached = reached


def unwrapped(call: Callable[..., TrainState], *args: Any, **kwargs: Any) -> TrainState:
    """``call(*args, **kwargs)``, raising the step's own exception in place of a ``StepFailed``.

    For a step's public entry points, called by a user rather than the fold.
    """
    try:
        return call(*args, **kwargs)
    except StepFailed as failed:
        error = failed.error
    # Raised outside the handler: the error keeps its own traceback and context.
    raise error


class Last:
    """The last consistent state of a fold and whether it is torn: what a failure leaves."""

    __slots__ = ("state", "torn")

    def __init__(self, state: TrainState) -> None:
        self.state = state
        self.torn = False


def ended_by(
    exc: BaseException,
    last: Last,
    after_train: Callable[[TrainState, Performs], object],
    *,
    perform: Performs,
    clock: Callable[[], float],
    rank: int = 0,
    world: int = 1,
) -> None:
    """A run ended by ``exc``: note what is left on it, run ``after_train(state, perform)``; the caller re-raises.

    ``exc.state`` is the last consistent state, or ``None`` when it is torn;
    then ``AFTER_TRAIN`` still runs, but nothing it asks for is performed (no
    checkpoint of a half-updated state). A failure of ``AFTER_TRAIN`` itself
    becomes a note: the original exception wins.
    """
    if world > 1 and not isinstance(exc, (SystemExit, KeyboardInterrupt)):
        exc.add_note(f"fnloop: raised on rank {rank} of {world}.")
    torn = last.torn
    if torn:
        exc.add_note(TORN)
    exc.state = None if torn else last.state  # type: ignore[attr-defined]
    try:
        after_train(unchecked(last.state, clock=reading(clock())), Performs.NONE if torn else perform)
    except BaseException as also:  # noqa: BLE001 - the original exception must win
        if also is not exc:
            exc.add_note(f"AFTER_TRAIN hooks then also failed: {type(also).__name__}: {also}")
