"""What a hook declares about itself, read in this one place: the door where fnloop looks at a hook.

A hook is any callable ``(state, phase) -> state``. It may declare more, with
attributes of these names (the library's hooks and combinators do):

- ``acts_in``: the ``frozenset`` of phases it may change the state in;
- ``acts_at(phase)``: a ``fnloop.Schedule`` of the iterations it may act at
  in that phase, or ``None`` for none;
- ``when_due()``: what the fold calls in its place where its schedule says
  it is due (a combinator whose test the schedule has passed already);
- ``state_names``: the names of the hook states it keeps in ``state.hooks``.

``declared(hook)`` reads them into a ``Declared`` record. Nothing else in
fnloop asks a hook for an attribute: the plan, the combinators, ``stateful``
and ``fnloop.testing`` read the record.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from fnloop._core.phase import Phase

if TYPE_CHECKING:
    from fnloop._core.schedule import Schedule

__all__ = ["Declared", "declared"]


@attrs.frozen
class Declared:
    """A hook's declarations; ``None`` (or no names) where it makes none.

    Attributes:
        acts_in: the phases it may change the state in; ``None``: every phase.
        acts_at: its ``acts_at(phase) -> Schedule | None``; ``None``: it has none.
        when_due: its ``when_due() -> hook``; ``None``: the fold calls the hook itself.
        state_names: the hook states it keeps.
    """

    acts_in: frozenset[Phase] | None
    acts_at: Callable[[Phase], Schedule | None] | None
    when_due: Callable[[], Any] | None
    state_names: tuple[str, ...]


def declared(hook: object) -> Declared:
    """The declarations of ``hook``: its ``acts_in``, ``acts_at``, ``when_due`` and ``state_names``.

    Examples:
        >>> from fnloop import Phase
        >>> class Logs:
        ...     acts_in = frozenset({Phase.AFTER_STEP})
        ...     def __call__(self, state, phase):
        ...         return state
        >>> declared(Logs()).acts_in == {Phase.AFTER_STEP}, declared(print).acts_in
        (True, None)
    """
    acts_in = getattr(hook, "acts_in", None)
    acts_at = getattr(hook, "acts_at", None)
    when_due = getattr(hook, "when_due", None)
    return Declared(
        acts_in if type(acts_in) is frozenset else None,
        acts_at if callable(acts_at) else None,
        when_due if callable(when_due) else None,
        tuple(getattr(hook, "state_names", ())),
    )
