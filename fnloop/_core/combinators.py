"""Hooks, ``(state, phase) -> state``, and the combinators that compose them."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Protocol, runtime_checkable

import attrs

from fnloop._core.declared import declared
from fnloop._core.messages import describe, non_negative_int, positive_int
from fnloop._core.phase import Phase
from fnloop._core.schedule import Schedule, scheduled
from fnloop._core.state import TrainState

__all__ = [
    "Hook",
    "chain",
    "check_hook",
    "every",
    "identity",
    "on",
    "once",
    "returned",
    "state_names",
    "when",
]

_BEFORE_TRAIN = Phase.BEFORE_TRAIN
_AFTER_TRAIN = Phase.AFTER_TRAIN
_BEFORE_STEP = Phase.BEFORE_STEP
_AFTER_STEP = Phase.AFTER_STEP


@runtime_checkable
class Hook(Protocol):
    """A pure function ``(state, phase) -> state``.

    A hook returns the state unchanged for the phases it ignores. It never
    mutates the state it is given; it returns a new one (``attrs.evolve``).
    Memory it needs between calls lives in ``state.hooks[name]`` (see
    ``stateful``), so it is checkpointed with the rest of the run.

    A hook object may declare ``acts_in``, a ``frozenset`` of the phases it
    may change the state in, or ``acts_at(phase)``, a ``fnloop.Schedule`` of
    the iterations it may act in (``None``: none) for each step phase; the
    fold then does not call it elsewhere (a saving for hooks run every step).
    A combinator whose schedule already tests what its own call would may
    also offer ``when_due()``: what the fold calls in its place where it is due.
    ``fnloop.testing.check_hook`` checks that an ``acts_in`` holds.
    """

    def __call__(self, state: TrainState, phase: Phase, /) -> TrainState: ...


def identity(state: TrainState, phase: Phase, /) -> TrainState:
    """The hook that changes nothing; ``chain()`` returns it.

    Examples:
        >>> s = TrainState(max_iter=1)
        >>> identity(s, Phase.BEFORE_TRAIN) is s
        True
    """
    return state


def returned(hook: object, phase: Phase, got: object) -> TypeError:
    """The error for a hook that returned something other than a ``TrainState``."""
    hint = " (did it forget to `return state`?)" if got is None else ""
    return TypeError(
        f"hook {describe(hook)} returned {got!r:.80} (a {type(got).__name__}) in {phase!r}; "
        f"a hook must return a TrainState{hint}. Return the state it was given for phases "
        "it ignores, and a new one (attrs.evolve) where it changes something."
    )


def state_names(hook: object) -> tuple[str, ...]:
    """The names of the hook states that ``hook`` (and any hook inside it) keeps.

    Examples:
        >>> from fnloop import stateful
        >>> state_names(chain(stateful("a", 0, lambda s, p, m: (s, m)), identity))
        ('a',)
    """
    return declared(hook).state_names


def _check_unique(hooks: tuple[object, ...]) -> None:
    seen: dict[str, object] = {}
    for hook in hooks:
        for name in state_names(hook):
            if name in seen:
                raise ValueError(
                    f"two hooks keep their state under the name {name!r}: {seen[name]!r} and "
                    f"{hook!r}. Each stateful hook needs a unique name, or one of the two states "
                    "would be lost; pass a different name= to one of them."
                )
            seen[name] = hook


def check_hook(hook: object, where: str) -> None:
    if not callable(hook):
        raise TypeError(
            f"{where} expected a hook, a callable (state, phase) -> state, "
            f"but got {hook!r:.80} (a {type(hook).__name__})."
        )


class _Wrapper:
    """A combinator around one ``hook``: it keeps the state names of the hook it wraps.

    It acts at most where the hook it wraps may (``schedule``); where it is
    due, the fold calls it whole, unless it is one whose test the schedule
    has passed already (``due``).
    """

    hook: Hook

    @property
    def state_names(self) -> tuple[str, ...]:
        return state_names(self.hook)

    def acts_at(self, phase: Phase) -> Schedule | None:
        """Where this may act in step phase ``phase``: at most where the hook it wraps may."""
        return scheduled(self.hook, phase)


class _Tested(_Wrapper):
    """A combinator whose own test reads only the phase and ``state.iteration``, as its schedule does."""

    def when_due(self) -> Hook:
        """Where the schedule says this fires, its test passes: the fold calls the hook inside."""
        inner = declared(self.hook).when_due
        return self.hook if inner is None else inner()


@attrs.frozen(repr=False)
class Chain:
    """Several hooks run in order as one; build it with ``chain``."""

    hooks: tuple[Hook, ...]

    def __call__(self, state: TrainState, phase: Phase, /) -> TrainState:
        for hook in self.hooks:
            new = hook(state, phase)
            if type(new) is not TrainState:
                raise returned(hook, phase, new)
            state = new
        return state

    @property
    def state_names(self) -> tuple[str, ...]:
        return tuple(n for h in self.hooks for n in state_names(h))

    def acts_at(self, phase: Phase) -> Schedule | None:
        """Where any of the hooks may act (every iteration where theirs differ, none if none may)."""
        found = {scheduled(h, phase) for h in self.hooks} - {None}
        if not found:
            return None
        return found.pop() if len(found) == 1 else Schedule.always()

    def __repr__(self) -> str:
        return f"chain({', '.join(describe(h) for h in self.hooks)})"


def chain(*hooks: Hook | None) -> Hook:
    """One hook running ``hooks`` in the order given, in every phase.

    ``None`` entries are skipped, nested chains are flattened, ``chain()`` is
    ``identity`` and ``chain(h)`` is ``h``, so ``chain`` is associative and
    ``chain(chain(a, b), c) == chain(a, chain(b, c))``.

    Raises:
        TypeError: an entry is not callable.
        ValueError: two hooks keep their state under the same name.

    Examples:
        >>> def tick(state, phase):
        ...     return attrs.evolve(state, extra=(state.extra or 0) + 1)
        >>> chain(tick, None, tick)(TrainState(max_iter=1), Phase.BEFORE_STEP).extra
        2
        >>> chain() is identity
        True
    """
    flat: list[Hook] = []
    for hook in hooks:
        if hook is None or hook is identity:
            continue
        check_hook(hook, "chain()")
        if isinstance(hook, Chain):
            flat.extend(hook.hooks)
        else:
            flat.append(hook)
    if not flat:
        return identity
    if len(flat) == 1:
        return flat[0]
    _check_unique(tuple(flat))
    return Chain(tuple(flat))


def _phases(value: Phase | Collection[Phase]) -> frozenset[Phase]:
    phases = frozenset([value] if isinstance(value, Phase) else value)
    if not phases or not all(isinstance(p, Phase) for p in phases):
        raise TypeError(
            f"on() expected a Phase or a collection of Phases (got {value!r}); "
            "for example on(Phase.AFTER_STEP, hook)."
        )
    return phases


@attrs.frozen(repr=False)
class On(_Tested):
    """``hook`` run in the given phases only; build it with ``on``."""

    phases: frozenset[Phase]
    hook: Hook

    def acts_at(self, phase: Phase) -> Schedule | None:
        return scheduled(self.hook, phase) if phase in self.phases else None

    def __call__(self, state: TrainState, phase: Phase, /) -> TrainState:
        if phase not in self.phases:
            return state
        return self.hook(state, phase)

    def __repr__(self) -> str:
        phases = sorted(self.phases, key=lambda p: p.value)
        shown = repr(phases[0]) if len(phases) == 1 else "{" + ", ".join(map(repr, phases)) + "}"
        return f"on({shown}, {describe(self.hook)})"


def on(phase: Phase | Collection[Phase], hook: Hook) -> Hook:
    """``hook`` run in ``phase`` (one phase or several) and skipped in the others.

    Examples:
        >>> from fnloop import testing
        >>> trace = testing.phase_trace(lambda h: on(Phase.AFTER_STEP, h), max_iter=2)
        >>> [(p.name, i) for p, i in trace]
        [('AFTER_STEP', 0), ('AFTER_STEP', 1)]
    """
    check_hook(hook, "on()")
    return On(_phases(phase), hook)


@attrs.frozen(repr=False)
class Every(_Tested):
    """``hook`` run after every ``n``-th step; build it with ``every``."""

    n: int = attrs.field(validator=positive_int)
    hook: Hook

    def acts_at(self, phase: Phase) -> Schedule | None:
        return Schedule.every(self.n).both(scheduled(self.hook, phase))

    def __call__(self, state: TrainState, phase: Phase, /) -> TrainState:
        if (state.iteration + 1) % self.n and phase is not _BEFORE_TRAIN and phase is not _AFTER_TRAIN:
            return state
        return self.hook(state, phase)

    def __repr__(self) -> str:
        return f"every({self.n}, {describe(self.hook)})"


def every(n: int, hook: Hook) -> Hook:
    """``hook`` run at ``BEFORE_STEP``/``AFTER_STEP`` of iterations ``n-1, 2n-1, ...``.

    That is after every ``n``-th completed step, as detectron2's periodic
    hooks do. ``BEFORE_TRAIN`` and ``AFTER_TRAIN`` always reach ``hook``, so
    ``every(200, checkpoint(...))`` also saves when the run ends and a periodic
    writer flushes at the end. ``every(1, h)`` is ``h``.

    Examples:
        >>> from fnloop import testing
        >>> trace = testing.phase_trace(lambda h: every(3, on(Phase.AFTER_STEP, h)), max_iter=6)
        >>> [i for _, i in trace]
        [2, 5]
    """
    check_hook(hook, "every()")
    periodic = Every(n, hook)
    return hook if n == 1 else periodic


@attrs.frozen(repr=False)
class When(_Wrapper):
    """``hook`` run where ``pred(state)`` holds; build it with ``when``."""

    pred: Callable[[TrainState], bool]
    hook: Hook

    def __call__(self, state: TrainState, phase: Phase, /) -> TrainState:
        if not self.pred(state):
            return state
        return self.hook(state, phase)

    def __repr__(self) -> str:
        return f"when({describe(self.pred)}, {describe(self.hook)})"


def when(pred: Callable[[TrainState], bool], hook: Hook) -> Hook:
    """``hook`` run in every phase where ``pred(state)`` is true.

    Examples:
        >>> from fnloop import testing
        >>> odd = lambda h: when(lambda s: s.iteration % 2 == 1, on(Phase.BEFORE_STEP, h))
        >>> [i for _, i in testing.phase_trace(odd, max_iter=4)]
        [1, 3]
    """
    check_hook(pred, "when() predicate:")
    check_hook(hook, "when()")
    return When(pred, hook)


@attrs.frozen(repr=False)
class Once(_Tested):
    """``hook`` run in the step phases of one iteration; build it with ``once``."""

    iteration: int = attrs.field(validator=non_negative_int)
    hook: Hook

    def acts_at(self, phase: Phase) -> Schedule | None:
        return Schedule.at(self.iteration).both(scheduled(self.hook, phase))

    def __call__(self, state: TrainState, phase: Phase, /) -> TrainState:
        if state.iteration != self.iteration or phase is _BEFORE_TRAIN or phase is _AFTER_TRAIN:
            return state
        return self.hook(state, phase)

    def __repr__(self) -> str:
        return f"once({self.iteration}, {describe(self.hook)})"


def once(iteration: int, hook: Hook) -> Hook:
    """``hook`` run at ``BEFORE_STEP`` and ``AFTER_STEP`` of ``iteration`` only.

    ``BEFORE_TRAIN`` and ``AFTER_TRAIN`` do not reach it; combine with ``on``
    to pick one of the two step phases.

    Examples:
        >>> from fnloop import testing
        >>> [(p.name, i) for p, i in testing.phase_trace(lambda h: once(1, h), max_iter=3)]
        [('BEFORE_STEP', 1), ('AFTER_STEP', 1)]
    """
    check_hook(hook, "once()")
    return Once(iteration, hook)
