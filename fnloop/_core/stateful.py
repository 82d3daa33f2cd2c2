"""``stateful``: a hook whose memory lives in ``state.hooks[name]``, so checkpoints hold it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from fnloop._core.combinators import Hook, check_hook
from fnloop._core.declared import declared
from fnloop._core.messages import describe, non_empty_str
from fnloop._core.phase import Phase
from fnloop._core.state import TrainState, Unclaimed, unchecked

__all__ = ["EachMember", "Stateful", "recall", "remember", "stateful"]

_ABSENT: Any = object()


@attrs.frozen
class EachMember:
    """A hook's starting memory that a population's state keeps once per member: a tuple of ``init``.

    Given as ``stateful``'s ``init``: a single run's memory starts as
    ``init``, a population's as ``(init,) * members`` (and a checkpoint's is
    checked against that), so the hook can act for each member on its own.
    """

    init: Any

    def start(self, state: TrainState) -> Any:
        """The starting memory for ``state``."""
        population = state.population
        return self.init if population is None else (self.init,) * population.size


def recall(state: TrainState, name: str, init: Any, like: Any = _ABSENT) -> Any:
    """The memory a hook keeps under ``name``: ``init`` when there is none.

    A memory read from a checkpoint before its hook was known (``Unclaimed``)
    is built like ``like`` (by default ``init``) and checked against it. Every
    memoryful hook of the library reads its memory through here.
    """
    if type(init) is EachMember:
        init = init.start(state)
        like = init if like is _ABSENT else like
    memory = state.hooks.get(name, _ABSENT)
    if memory is _ABSENT:
        return init
    if type(memory) is Unclaimed:
        return memory.claim(init if like is _ABSENT else like)
    return memory


def remember(state: TrainState, name: str, memory: Any) -> TrainState:
    """``state`` with ``memory`` kept under ``name``; ``state`` itself when it keeps that already."""
    hooks = state.hooks
    if hooks.get(name, _ABSENT) is memory:
        return state
    # A dict's copy() is a few times faster than {**hooks}; `hooks` stays a
    # str-keyed mapping, so the validators need not run again.
    hooks = hooks.copy() if type(hooks) is dict else dict(hooks)
    hooks[name] = memory
    return unchecked(state, hooks=hooks)


@attrs.frozen(repr=False)
class Stateful:
    """A hook with memory kept in ``state.hooks[name]``; build it with ``stateful``."""

    name: str = attrs.field(validator=non_empty_str)
    init: Any
    update: Callable[[TrainState, Phase, Any], tuple[TrainState, Any]]
    # The update's own acts_in, read once: this hook runs every step of many runs.
    _acts: frozenset[Phase] | None = attrs.field(init=False, eq=False, repr=False)

    @_acts.default
    def _declared(self) -> frozenset[Phase] | None:
        return declared(self.update).acts_in

    def __call__(self, state: TrainState, phase: Phase, /) -> TrainState:
        acts_in = self._acts
        if acts_in is not None and phase not in acts_in:
            return state  # the update says it changes nothing here: its memory is not even stored
        memory = recall(state, self.name, self.init)
        result = self.update(state, phase, memory)
        if type(result) is not tuple or len(result) != 2 or type(result[0]) is not TrainState:
            raise TypeError(
                f"stateful hook {self.name!r} ({describe(self.update)}) returned {result!r:.80} in "
                f"{phase!r}; its update must return a pair (state, memory), state a TrainState."
            )
        new, new_memory = result
        return remember(new, self.name, new_memory)

    @property
    def acts_in(self) -> frozenset[Phase] | None:
        """The phases the update declares it acts in (its own ``acts_in``), or ``None``: every phase."""
        return self._acts

    @property
    def state_names(self) -> tuple[str, ...]:
        return (self.name,)

    def __repr__(self) -> str:
        return f"stateful({self.name!r}, {describe(self.update)})"


def stateful(
    name: str, init: Any, update: Callable[[TrainState, Phase, Any], tuple[TrainState, Any]]
) -> Hook:
    """A hook whose memory is kept in ``state.hooks[name]``, so checkpoints hold it.

    ``update(state, phase, memory) -> (state, memory)`` sees ``init`` the first
    time (and after a resume from a checkpoint that holds no state for
    ``name``). The name must be unique among the hooks of a run; ``chain`` and
    ``run`` refuse a clash rather than lose a state. An ``update`` with an
    ``acts_in`` attribute (a frozenset of phases) declares that it changes
    nothing in the other phases: the hook returns its input there without
    calling it, and the fold's plan knows it, as for a hook's own ``acts_in``.

    Raises:
        ValueError: ``name`` is empty or not a str.

    Examples:
        >>> def count(state, phase, n):
        ...     return state, n + (phase is Phase.AFTER_STEP)
        >>> from fnloop import run
        >>> run(TrainState(max_iter=3), lambda s, b: s, [None] * 3, [stateful("steps", 0, count)]).hooks
        {'steps': 3}
    """
    check_hook(update, "stateful()")
    return Stateful(name, init, update)
