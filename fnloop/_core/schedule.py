"""When a hook can act in the step phases, as a value the fold plans with.

A ``Schedule`` is a set of iterations: every ``period``-th from ``offset``
on, or one iteration alone. A hook may declare ``acts_at(phase)``, the
iterations outside which it returns its input unchanged in step phase
``phase`` (``None``: none at all). The library's combinators declare
theirs from the hook they wrap (``every(10, h)`` acts at most where ``h``
does and where 10 divides the completed steps), and so can a user's own.
``fnloop._core.plan`` composes what the hooks of a run declare and calls
only the hooks due. A declaration may claim more iterations than the hook
acts in, never fewer: the run must be the same as calling every hook.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from fnloop._core.declared import declared
from fnloop._core.messages import non_negative_int
from fnloop._core.phase import Phase

__all__ = ["Schedule", "scheduled"]


@attrs.frozen
class Schedule:
    """The iterations ``i`` of a step phase in which a hook may change the state.

    With ``period > 0``: those with ``i + 1 >= offset`` and ``(i + 1 - offset)
    % period == 0``, counting completed steps as ``every`` does. With
    ``period == 0``: iteration ``offset - 1`` alone. Build one with
    ``Schedule.always()``, ``Schedule.every(n)`` or ``Schedule.at(i)``.

    Examples:
        >>> s = Schedule.every(3)
        >>> [i for i in range(9) if s.fires(i)]
        [2, 5, 8]
        >>> Schedule.every(2).both(Schedule.every(3)) == Schedule.every(6)
        True
        >>> Schedule.at(4).both(Schedule.every(5)) == Schedule.at(4)
        True
    """

    period: int = attrs.field(validator=non_negative_int)
    offset: int = attrs.field(default=0, validator=non_negative_int)

    @classmethod
    def always(cls) -> Schedule:
        """Every iteration."""
        return _ALWAYS

    @classmethod
    def every(cls, n: int) -> Schedule:
        """Iterations ``n-1, 2n-1, ...``: after every ``n``-th completed step."""
        return cls(n, 0)

    @classmethod
    def at(cls, iteration: int) -> Schedule:
        """``iteration`` alone."""
        return cls(0, iteration + 1)

    @staticmethod
    def of(hook: Any, phase: Phase) -> Schedule | None:
        """When ``hook`` may act in step phase ``phase``: what it declares, or every iteration.

        A combinator's own ``acts_at`` builds on the schedule of the hook it wraps with this.
        """
        return scheduled(hook, phase)

    def fires(self, iteration: int) -> bool:
        """Whether ``iteration`` is in the schedule."""
        done = iteration + 1
        if self.period == 0:
            return done == self.offset
        return done >= self.offset and (done - self.offset) % self.period == 0

    def both(self, other: Schedule | None) -> Schedule | None:
        """The iterations in both (``None``: no iteration)."""
        if other is None:
            return None
        if self.period == 0 or other.period == 0:  # a single iteration: in the other schedule or not
            single, rest = (self, other) if self.period == 0 else (other, self)
            return single if rest.fires(single.offset - 1) else None
        # Both periodic: d = offset (mod period) for each, from the later start; none if no d is.
        p, a, q, b = self.period, self.offset, other.period, other.offset
        shared = math.gcd(p, q)
        if (a - b) % shared:
            return None
        first = max(a, b)
        d = a + -(-(first - a) // p) * p if first > a else a
        for _ in range(q // shared):
            if (d - b) % q == 0:
                return Schedule(p // shared * q, d)
            d += p
        raise AssertionError("unreachable: a solution exists when the offsets agree modulo the gcd")

    def after(self, iteration: int) -> float:
        """The first iteration after ``iteration`` in the schedule (``math.inf``: none)."""
        if self.period == 0:
            return self.offset - 1 if self.offset - 1 > iteration else math.inf
        start = max(iteration + 2, self.offset)  # completed steps after the next iteration, or later
        return start + (-(start - self.offset)) % self.period - 1


_ALWAYS = Schedule(1, 0)


def scheduled(hook: Any, phase: Phase) -> Schedule | None:
    """When ``hook`` may change the state in step phase ``phase``, as it declares (always, if it does not).

    A hook declares it with a ``acts_at(phase)`` method, or with ``acts_in``,
    the frozenset of phases it may act in at all.
    """
    says = declared(hook)
    if says.acts_at is not None:
        schedule = says.acts_at(phase)
        if schedule is not None and type(schedule) is not Schedule:
            raise TypeError(
                f"{hook!r:.80}.acts_at({phase!r}) returned {schedule!r:.80}; a hook's schedule is a "
                "fnloop.Schedule, or None for a phase it never acts in."
            )
        return schedule
    if says.acts_in is not None and phase not in says.acts_in:
        return None  # the hook says it returns its input unchanged here
    return _ALWAYS
