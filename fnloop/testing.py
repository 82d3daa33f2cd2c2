"""Hypothesis strategies and checks for testing hooks, fnloop's own and yours.

Needs ``hypothesis`` (``pip install -e ".[dev]"`` from a checkout, or ``pip install hypothesis``). Typical use::

    from hypothesis import given
    from fnloop import testing

    @given(testing.states())
    def test_my_hook_is_a_good_hook(state):
        testing.check_hook(my_hook, state)
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import attrs
import torch
from hypothesis import strategies as st

from fnloop._core.combinators import Hook, every, on, once, when
from fnloop._core.declared import declared
from fnloop._core.metrics import Metrics
from fnloop._core.phase import Phase
from fnloop._core.state import TrainState
from fnloop._core.stateful import stateful
from fnloop._core.tree import first_difference, leaves
from fnloop._measured import CLOCK_METRICS, without_clock
from fnloop._run import run

__all__ = [
    "CLOCK_METRICS",
    "Fail",
    "InjectedFailure",
    "Tag",
    "assert_identical",
    "assert_step_matches_eager",
    "without_clock",
    "bounds",
    "check_hook",
    "counter",
    "expected_trace",
    "metrics",
    "phase_trace",
    "phases",
    "pipelines",
    "recorder",
    "states",
    "trace",
]

Trace = list[tuple[Phase, int]]


def assert_identical(a: Any, b: Any) -> None:
    """Assert two states (or any trees) are identical, bit for bit, naming the first difference.

    Examples:
        >>> assert_identical(TrainState(max_iter=1), TrainState(max_iter=1))
    """
    found = first_difference(a, b)
    if found is not None:
        raise AssertionError(f"states differ at {found}")


def _record(state: TrainState, phase: Phase, log: tuple) -> tuple[TrainState, tuple]:
    return state, (*log, (phase, state.iteration))


def recorder(name: str = "trace") -> Hook:
    """A stateful hook that appends ``(phase, iteration)`` to ``state.hooks[name]`` on every call."""
    return stateful(name, (), _record)


def trace(state: TrainState, name: str = "trace") -> Trace:
    """What the recorder called ``name`` has seen, as a list of ``(phase, iteration)``."""
    return list(state.hooks.get(name, ()))


def _empty_step(state: TrainState, batch: object) -> TrainState:
    return state


def phase_trace(combinator: Callable[[Hook], Hook] | None = None, *, max_iter: int, start: int = 0) -> Trace:
    """The ``(phase, iteration)`` calls that reach a hook wrapped by ``combinator``.

    Runs an empty step from ``start`` to ``max_iter`` with the single hook
    ``combinator(recorder)`` and returns what the recorder saw.

    Examples:
        >>> [(p.name, i) for p, i in phase_trace(max_iter=1)]
        [('BEFORE_TRAIN', 0), ('BEFORE_STEP', 0), ('AFTER_STEP', 0), ('AFTER_TRAIN', 1)]
    """
    hook = recorder("trace")
    wrapped = hook if combinator is None else combinator(hook)
    state = TrainState(max_iter=max_iter, iteration=start)
    final = run(state, _empty_step, [None] * (max_iter - start), [wrapped], clock=lambda: 0.0)
    return trace(final, "trace")


def expected_trace(start: int, max_iter: int) -> Trace:
    """The phase protocol of a successful run from ``start`` to ``max_iter``.

    Examples:
        >>> [(p.name, i) for p, i in expected_trace(2, 3)]
        [('BEFORE_TRAIN', 2), ('BEFORE_STEP', 2), ('AFTER_STEP', 2), ('AFTER_TRAIN', 3)]
    """
    out: Trace = [(Phase.BEFORE_TRAIN, start)]
    for i in range(start, max_iter):
        out += [(Phase.BEFORE_STEP, i), (Phase.AFTER_STEP, i)]
    return [*out, (Phase.AFTER_TRAIN, max_iter)]


@attrs.frozen
class Tag:
    """A hook appending ``(label, phase, iteration)`` to ``state.extra`` (a tuple), to observe order."""

    label: str

    def __call__(self, state: TrainState, phase: Phase, /) -> TrainState:
        return attrs.evolve(state, extra=(*(state.extra or ()), (self.label, phase, state.iteration)))


class InjectedFailure(Exception):
    """The exception ``Fail`` raises by default."""


@attrs.frozen
class Fail:
    """A hook that raises ``error(message)`` at one ``(phase, iteration)`` and passes otherwise."""

    phase: Phase
    iteration: int
    error: type[BaseException] = InjectedFailure

    def __call__(self, state: TrainState, phase: Phase, /) -> TrainState:
        if phase is self.phase and state.iteration == self.iteration:
            raise self.error(f"injected at {phase!r}, iteration {self.iteration}")
        return state


def _count(state: TrainState, phase: Phase, n: int) -> tuple[TrainState, int]:
    return state, n + 1 if phase is Phase.AFTER_STEP else n


def counter(name: str) -> Hook:
    """A stateful hook counting the ``AFTER_STEP`` calls that reach it, in ``state.hooks[name]``."""
    return stateful(name, 0, _count)


def phases() -> st.SearchStrategy[Phase]:
    """Any phase."""
    return st.sampled_from(list(Phase))


@st.composite
def bounds(draw: st.DrawFn, max_steps: int = 12) -> tuple[int, int]:
    """``(start, max_iter)`` with ``0 <= start <= max_iter``, at most ``max_steps`` apart."""
    start = draw(st.integers(0, 50))
    return start, start + draw(st.integers(0, max_steps))


@st.composite
def metrics(draw: st.DrawFn, names: tuple[str, ...] = ("loss", "lr"), window: int = 5) -> Metrics:
    """A metrics record with a few entries, as Python floats and 0-d tensors."""
    m = Metrics(window=window)
    for i in range(draw(st.integers(0, 8))):
        name = draw(st.sampled_from(names))
        value = draw(st.floats(-1e3, 1e3, allow_nan=False, width=32))
        m = m.record(i, {name: torch.tensor(value) if draw(st.booleans()) else value})
    return m


@st.composite
def states(draw: st.DrawFn, tensors: bool = True) -> TrainState:
    """Valid states: ``iteration <= max_iter``, small float tensors, metrics, hook states and extra.

    The clock stopped (``Clock()``), as in a state a checkpoint gives back: the clock is never saved.
    """
    start, max_iter = draw(bounds())
    shapes = st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple)
    params = {}
    if tensors:
        for name in draw(st.lists(st.sampled_from(["w", "b", "fc.weight"]), unique=True, max_size=3)):
            params[name] = torch.randn(draw(shapes), generator=torch.Generator().manual_seed(len(name)))
    return TrainState(
        max_iter=max_iter,
        iteration=start,
        params=params,
        rng=draw(st.integers(0, 2**31)),
        data=draw(st.integers(0, 100)),
        metrics=draw(metrics()),
        hooks=draw(st.dictionaries(st.sampled_from(["a", "b"]), st.integers(0, 9), max_size=2)),
        extra=draw(st.none() | st.tuples(st.integers())),
    )


def _odd(state: TrainState) -> bool:
    return state.iteration % 2 == 1


_WRAPPERS: tuple[Callable[[st.DrawFn, Hook], Hook], ...] = (
    lambda draw, h: h,
    lambda draw, h: every(draw(st.integers(1, 4)), h),
    lambda draw, h: on(draw(phases()), h),
    lambda draw, h: when(_odd, h),
    lambda draw, h: once(draw(st.integers(0, 12)), h),
)


@st.composite
def pipelines(draw: st.DrawFn, max_hooks: int = 5, stateful_hooks: bool = True) -> list[Hook | None]:
    """Lists of hooks: ``Tag``s and counters wrapped in random combinators, with ``None``s among them.

    Counter names are unique, as the fold requires.
    """
    out: list[Hook | None] = []
    for k in range(draw(st.integers(0, max_hooks))):
        kind = draw(st.sampled_from(["tag", "counter", "none"] if stateful_hooks else ["tag", "none"]))
        if kind == "none":
            out.append(None)
            continue
        base = Tag(f"h{k}") if kind == "tag" else counter(f"c{k}")
        out.append(draw(st.sampled_from(_WRAPPERS))(draw, base))
    return out


def _snapshot(state: TrainState) -> list[tuple[str, Any]]:
    return [
        (path, (leaf._version, leaf.clone()) if isinstance(leaf, torch.Tensor) else leaf)
        for path, leaf in leaves(state)
    ]


def check_hook(hook: Hook, state: TrainState, phases: tuple[Phase, ...] = tuple(Phase)) -> None:
    """Assert that ``hook`` behaves as a hook must, in every phase, on ``state``.

    It returns a ``TrainState``; it leaves its input untouched (no field
    rebound, no tensor written in place); it is deterministic; it survives
    ``pickle`` with the same behaviour; and where it declares ``acts_in``, it
    returns its input itself in the other phases.

    Examples:
        >>> check_hook(every(2, Tag("x")), TrainState(max_iter=3))
    """
    restored = pickle.loads(pickle.dumps(hook))  # noqa: S301 - our own bytes, just written
    for phase in phases:
        before = _snapshot(state)
        out = hook(state, phase)
        if type(out) is not TrainState:
            raise AssertionError(f"{hook!r} returned {type(out).__name__} in {phase!r}, not a TrainState")
        after = _snapshot(state)
        for (path, old), (_, new) in zip(before, after):
            tensor = isinstance(old, tuple) and len(old) == 2 and isinstance(old[1], torch.Tensor)
            if tensor and (old[0] != new[0] or first_difference(old[1], new[1]) is not None):
                raise AssertionError(f"{hook!r} wrote into {path} in place in {phase!r}")
        if first_difference(before, after) is not None:
            raise AssertionError(
                f"{hook!r} changed its input in {phase!r}: {first_difference(before, after)}"
            )
        again = hook(state, phase)
        found = first_difference(out, again)
        if found is not None:
            raise AssertionError(f"{hook!r} is not deterministic in {phase!r}: {found}")
        found = first_difference(out, restored(state, phase))
        if found is not None:
            raise AssertionError(f"{hook!r} behaves differently after pickling, in {phase!r}: {found}")
        acts_in = declared(hook).acts_in
        if acts_in is not None and phase not in acts_in and out is not state:
            raise AssertionError(
                f"{hook!r} declares acts_in={sorted(p.name for p in acts_in)} but changed the state "
                f"in {phase!r}; the fold would not call it there. Add the phase to acts_in."
            )


def assert_step_matches_eager(step: Any, state: TrainState, batch: Any, **tolerances: float) -> None:
    """Assert that a compiled step's gradients and update equal its eager run's, parameter by parameter.

    ``fnloop.check_step`` as an assertion for your test suite: the message is
    its table (the parameters off, whose the difference is, and the fix).
    ``tolerances``: ``rtol`` and ``update_rtol``, as ``check_step`` takes them.

    Examples:
        >>> import fnloop as fl
        >>> model = torch.nn.Linear(3, 1)
        >>> step = fl.train_step(model, lambda f, b: f(b).square().mean(), fl.optim.sgd(0.1), backend="graph")
        >>> assert_step_matches_eager(step, fl.init(model, fl.optim.sgd(0.1), seed=0, max_iter=1), torch.ones(2, 3))
    """
    from fnloop._step.check import check_step

    check = check_step(step, state, batch, **tolerances)  # type: ignore[arg-type]
    if not check.ok:
        raise AssertionError(str(check))
