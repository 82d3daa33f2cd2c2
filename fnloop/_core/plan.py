"""Which hooks can act at a step phase of an iteration, known before the run from what hooks declare.

Each hook of a run declares when it may change the state in a step phase
(``fnloop._core.schedule``): ``every(n, h)`` where ``n`` divides the
completed steps and ``h`` may act, ``on(phases, h)`` in the phases it lists,
``once(k, h)`` at iteration ``k``, ``when(pred, h)`` at most where ``h`` may,
a hook with ``acts_in`` in those phases, a user's combinator where its own
``acts_at(phase)`` says; any other hook everywhere. So the fold can tell in
advance which hooks cannot act at an iteration and not call them: with
twenty ``every(10, ...)`` hooks, nine iterations in ten call none of them.
The hooks that are called are called in registration order, so the run is
the same, bit for bit, as calling the whole chain
(``property_tests/test_plan_laws.py`` checks it).

A due hook is called as its ``when_due()`` says: ``on``/``every``/``once`` give the
hook they wrap, since the schedule already passed their tests, which read
only the phase and ``state.iteration`` (and a hook that moves
``state.iteration`` fails the run).
"""

from __future__ import annotations

import math
from typing import Any

from fnloop._core.combinators import Chain, Hook, identity, returned
from fnloop._core.declared import declared
from fnloop._core.phase import Phase
from fnloop._core.schedule import Schedule, scheduled
from fnloop._core.state import TrainState

__all__ = ["Due", "Plan", "call", "off_boundaries", "plan"]

_STEP_PHASES = (Phase.BEFORE_STEP, Phase.AFTER_STEP)
_ALWAYS = Schedule.always()

_KEPT = 64
"""How many firing combinations a ``Due`` remembers (``once`` hooks make ones that never recur)."""


class Due:
    """The hooks to call in one step phase, by iteration; build them with ``plan``.

    Each entry is a pair ``(callable, hook)``: what to call (the hook's
    ``when_due()`` form), and ``hook`` as registered, which errors name. ``quiet``
    are the entries called at an iteration where no periodic hook fires, and
    ``next`` the first iteration, from the last one asked about, where one
    may: before it, the fold takes ``quiet`` with one comparison. So a ``Due``
    is asked about iterations in increasing order, as the fold runs them.
    """

    def __init__(self, entries: list[tuple[Hook, Schedule]]) -> None:
        self.entries = [((_due(h), h), s) for h, s in entries]
        self.quiet: tuple[tuple[Hook, Hook], ...] = tuple(e for e, s in self.entries if s == _ALWAYS)
        # One test per distinct schedule, not per hook: twenty every(10, ...) share one.
        self.schedules = tuple(dict.fromkeys(s for _, s in entries if s != _ALWAYS))
        self.next: float = -1
        self._due: dict[tuple[Schedule, ...], tuple[tuple[Hook, Hook], ...]] = {}

    def __call__(self, iteration: int) -> tuple[tuple[Hook, Hook], ...]:
        """The entries to call at ``iteration``; the other hooks would return the state unchanged."""
        if iteration < self.next:
            return self.quiet
        schedules = self.schedules
        self.next = min((s.after(iteration) for s in schedules), default=math.inf)
        firing = tuple(s for s in schedules if s.fires(iteration))
        if not firing:
            return self.quiet
        due = self._due.get(firing)
        if due is None:
            due = tuple(e for e, s in self.entries if s == _ALWAYS or s in firing)
            if len(self._due) < _KEPT:
                self._due[firing] = due
        return due

    def hooks(self, iteration: int) -> tuple[Hook, ...]:
        """The hooks, as registered, that the fold calls at ``iteration``."""
        return tuple(hook for _, hook in self(iteration))


class Plan:
    """The hooks due in the two step phases of a unit of iterations: ``BEFORE_STEP`` of its first, ``AFTER_STEP`` of its last."""

    def __init__(self, hook: Hook) -> None:
        self.before, self.after = plan(hook, Phase.BEFORE_STEP), plan(hook, Phase.AFTER_STEP)
        self.quiet = (self.before.quiet, self.after.quiet)

    def __call__(
        self, first: int, last: int
    ) -> tuple[tuple[tuple[Hook, Hook], ...], tuple[tuple[Hook, Hook], ...]]:
        """The entries due before iteration ``first`` and after iteration ``last`` (in increasing order)."""
        before, after = self.before, self.after
        if first < before.next and last < after.next:
            return self.quiet
        return before(first), after(last)


def _due(hook: Any) -> Hook:
    """What to call for ``hook`` where its schedule says it may act (its ``when_due()``, or itself)."""
    due = declared(hook).when_due
    return hook if due is None else due()


def plan(hook: Hook, phase: Phase) -> Due:
    """Which hooks of ``hook`` (a chain, or one hook) to call in step phase ``phase``, by iteration."""
    hooks = () if hook is identity else hook.hooks if type(hook) is Chain else (hook,)  # type: ignore[attr-defined]
    return Due([(h, s) for h in hooks if (s := scheduled(h, phase)) is not None])


def call(due: tuple[tuple[Hook, Hook], ...], state: TrainState, phase: Phase) -> TrainState:
    """The entries ``due`` run in order on ``state`` in ``phase``, each checked to return a ``TrainState``."""
    for hook, registered in due:
        new = hook(state, phase)
        if type(new) is not TrainState:
            raise returned(registered, phase, new)
        state = new
    return state


def off_boundaries(hook: Hook, steps: int) -> tuple[Hook, Phase, int] | None:
    """The first hook of ``hook`` that may act inside a call of ``steps`` iterations, or ``None``.

    A call runs iterations ``c*steps .. c*steps + steps - 1`` together, so a
    hook may act only in ``BEFORE_STEP`` of its first and ``AFTER_STEP`` of its
    last. Returns ``(hook as registered, phase, the first iteration where it may
    act off them)``.
    """
    for phase in _STEP_PHASES:
        for (_, registered), firing in plan(hook, phase).entries:
            inside = _first_inside(firing, phase, steps)
            if inside is not None:
                return registered, phase, inside
    return None


def _first_inside(firing: Schedule, phase: Phase, steps: int) -> int | None:
    period, offset = firing.period, firing.offset
    first = max(offset - 1, 0) if period == 0 else offset - 1 + (period if offset == 0 else 0)
    # The iterations it fires at, modulo `steps`, repeat after `steps` firings.
    for m in range(1 if period == 0 else steps):
        iteration = first + m * period
        boundary = iteration % steps == 0 if phase is Phase.BEFORE_STEP else (iteration + 1) % steps == 0
        if not boundary:
            return iteration
    return None
