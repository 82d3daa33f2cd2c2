"""Which hooks can act at a step phase of an iteration, known before the run from the combinators.

``every(n, h)`` returns its state unchanged at the step phases of iterations
it does not fire at, ``on(phases, h)`` in the phases it does not list, and
``once(k, h)`` everywhere but iteration ``k``. These combinators are values
with known periods, so the fold can tell in advance which hooks cannot act at
an iteration and not call them: with twenty ``every(10, ...)`` hooks, nine
iterations in ten call none of them. A hook may also declare ``acts_in``, the
frozenset of phases outside which it returns its input unchanged (the
library's timer acts in ``BEFORE_TRAIN`` and ``AFTER_STEP`` only). Any other
hook (``when``, ``stateful``, a function) may act anywhere and is always called. The hooks that are called
are called in registration order, so the run is the same, bit for bit, as
calling the whole chain (``property_tests/test_plan_laws.py`` checks it).

A due hook is called without the ``on``/``every``/``once`` around it: the
schedule already passed their tests, which read only the phase and
``state.iteration`` (and a hook that moves ``state.iteration`` fails the run).
"""

from __future__ import annotations

import math

from fnloop._core.combinators import Chain, Every, Hook, On, Once, identity, returned
from fnloop._core.phase import Phase
from fnloop._core.state import TrainState

__all__ = ["Due", "call", "plan", "schedule"]

_STEP_PHASES = (Phase.BEFORE_STEP, Phase.AFTER_STEP)

Firing = tuple[int, int]
Schedule = Firing | None
"""When a hook can act in a step phase: ``(period, offset)`` for the iterations ``i`` with
``(i + 1 - offset) % period == 0`` and ``i + 1 >= offset``; ``None`` for never.
``(1, 0)`` is always; ``once(k)`` is ``(0, k + 1)``: iteration ``k`` alone."""

_ALWAYS: Schedule = (1, 0)


def _both(a: Schedule, b: Schedule) -> Schedule:
    """The schedule of iterations in both ``a`` and ``b``."""
    if a is None or b is None:
        return None
    p, q = a[0], b[0]
    if p == 0 or q == 0:  # a single iteration: in the other schedule or not
        single, other = (a, b) if p == 0 else (b, a)
        return single if _fires(other, single[1] - 1) else None
    # Both periodic from 0 (the only periodic offsets the combinators make): every lcm.
    return (math.lcm(p, q), 0)


def _fires(schedule: Schedule, iteration: int) -> bool:
    if schedule is None:
        return False
    period, offset = schedule
    done = iteration + 1
    if period == 0:
        return done == offset
    return done >= offset and (done - offset) % period == 0


def schedule(hook: Hook, phase: Phase) -> Schedule:
    """When ``hook`` can change the state in step phase ``phase`` (conservative: ``(1, 0)`` if unknown)."""
    kind = type(hook)
    if kind is On:
        return schedule(hook.hook, phase) if phase in hook.phases else None  # type: ignore[attr-defined]
    if kind is Every:
        return _both((hook.n, 0), schedule(hook.hook, phase))  # type: ignore[attr-defined]
    if kind is Once:
        return _both((0, hook.iteration + 1), schedule(hook.hook, phase))  # type: ignore[attr-defined]
    acts_in = getattr(hook, "acts_in", None)
    if type(acts_in) is frozenset and phase not in acts_in:
        return None  # the hook says it returns its input unchanged here
    return _ALWAYS


class Due:
    """The hooks to call in one step phase, by iteration; build them with ``plan``.

    Each entry is a pair ``(callable, hook)``: what to call, and ``hook`` as
    registered, which errors name. The callable is ``hook`` without the
    ``on``/``every``/``once`` wrappers whose tests the schedule has already
    passed. ``quiet`` are the
    entries called at an iteration where no periodic hook fires, and ``next``
    the first iteration, from the last one asked about, where one may: before
    it, the fold takes ``quiet`` with one comparison. So a ``Due`` is asked
    about iterations in increasing order, as the fold runs them.
    """

    def __init__(self, entries: list[tuple[Hook, Firing]]) -> None:
        self.entries = [((_unwrapped(h), h), s) for h, s in entries]
        self.quiet: tuple[tuple[Hook, Hook], ...] = tuple(e for e, s in self.entries if s == _ALWAYS)
        # One test per distinct schedule, not per hook: twenty every(10, ...) share one.
        self.schedules = tuple(dict.fromkeys(s for _, s in entries if s != _ALWAYS))
        self.next: float = -1
        self._due: dict[tuple[Firing, ...], tuple[tuple[Hook, Hook], ...]] = {}

    def __call__(self, iteration: int) -> tuple[tuple[Hook, Hook], ...]:
        """The entries to call at ``iteration``; the other hooks would return the state unchanged."""
        if iteration < self.next:
            return self.quiet
        schedules = self.schedules
        self.next = min((_after(s, iteration) for s in schedules), default=math.inf)
        firing = tuple(s for s in schedules if _fires(s, iteration))
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


_KEPT = 64
"""How many firing combinations a ``Due`` remembers (``once`` hooks make ones that never recur)."""

_TESTED = (On, Every, Once)


def _unwrapped(hook: Hook) -> Hook:
    """``hook`` without its outer ``on``/``every``/``once``: where the plan calls it, their tests pass."""
    while type(hook) in _TESTED:
        hook = hook.hook  # type: ignore[attr-defined]
    return hook


def plan(hook: Hook, phase: Phase) -> Due:
    """Which hooks of ``hook`` (a chain, or one hook) to call in step phase ``phase``, by iteration."""
    hooks = () if hook is identity else hook.hooks if type(hook) is Chain else (hook,)  # type: ignore[attr-defined]
    return Due([(h, s) for h in hooks if (s := schedule(h, phase)) is not None])


def _after(schedule: Firing, iteration: int) -> float:
    """The first iteration after ``iteration`` at which ``schedule`` fires (inf: none)."""
    period, offset = schedule
    if period == 0:
        return offset - 1 if offset - 1 > iteration else math.inf
    done = iteration + 2  # completed steps after the next iteration
    start = max(done, offset)
    return start + (-(start - offset)) % period - 1


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


def _first_inside(firing: Firing, phase: Phase, steps: int) -> int | None:
    period, offset = firing
    first = max(offset - 1, 0) if period == 0 else offset - 1 + (period if offset == 0 else 0)
    # The iterations it fires at, modulo `steps`, repeat after `steps` firings.
    for m in range(1 if period == 0 else steps):
        iteration = first + m * period
        boundary = iteration % steps == 0 if phase is Phase.BEFORE_STEP else (iteration + 1) % steps == 0
        if not boundary:
            return iteration
    return None
