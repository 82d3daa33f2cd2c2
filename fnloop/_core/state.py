"""The trainer state: one frozen record that is the whole run."""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import attrs
import torch

from fnloop._core.config import plain
from fnloop._core.messages import got, non_negative_int
from fnloop._core.metrics import Metrics, Scalar
from fnloop._core.population import Population
from fnloop._core.shards import Shards
from fnloop._core.tensor_parallel import TensorParallel

_new = object.__new__
_set = object.__setattr__

__all__ = [
    "Clock",
    "Effect",
    "Performs",
    "TrainState",
    "Unclaimed",
    "hook_state",
    "reading",
    "record",
    "request",
    "unchecked",
    "with_hook_state",
]


def _tensor_mapping(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, Mapping):
        raise TypeError(f"'{attribute.name}' must be a mapping from name to tensor ({got(value)}).")
    for name, tensor in value.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"'{attribute.name}'[{name!r}] must be a tensor ({got(tensor)}); wrap a number "
                "with torch.tensor(...)."
            )


def _metrics(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, Metrics):
        raise TypeError(
            f"'{attribute.name}' must be a fnloop.Metrics ({got(value)}); record values with "
            "fnloop.record(state, name=value), or start from fnloop.Metrics()."
        )


def _str_mapping(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, Mapping) or not all(type(k) is str for k in value):
        raise TypeError(f"'{attribute.name}' must be a mapping keyed by hook name (str) ({got(value)}).")


def _clock(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if type(value) is not Clock:
        raise TypeError(
            f"'{attribute.name}' must be a fnloop.Clock ({got(value)}); the fold sets it, "
            "a state built by hand starts from Clock()."
        )
    for name, reading in zip(Clock._fields, value):
        if type(reading) not in (int, float):
            raise TypeError(f"'clock.{name}' must be a float ({got(reading)}).")


def _shards(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if value is not None and type(value) is not Shards:
        raise TypeError(
            f"'{attribute.name}' must be a fnloop.Shards or None ({got(value)}); fnloop.init(..., "
            "shard=...) builds a sharded state."
        )


def _tensor(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if value is not None and type(value) is not TensorParallel:
        raise TypeError(
            f"'{attribute.name}' must be a fnloop.TensorParallel or None ({got(value)}); "
            "fnloop.init(..., tensor=...) builds a tensor-parallel state."
        )


def _population(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if value is not None and type(value) is not Population:
        raise TypeError(
            f"'{attribute.name}' must be a fnloop.Population or None ({got(value)}); "
            "fnloop.population(...) builds a population's state."
        )


def _effects(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if type(value) is not tuple or not all(isinstance(e, Effect) for e in value):
        raise TypeError(
            f"'{attribute.name}' must be a tuple of fnloop.Effect (got {value!r:.80}); "
            "request effects with fnloop.request(state, perform)."
        )


@attrs.frozen
class Effect:
    """Something to do outside the pure world once a phase is over.

    A hook that needs I/O returns the state with an ``Effect`` requested
    (``fnloop.request``) instead of writing itself. The fold calls
    ``perform(state)`` after every hook of that phase has run, with the state
    as it stands then (effects cleared), so what is written is the whole
    phase's result wherever the requesting hook sits in the chain. With
    ``start=True`` it gets the state as the phase began instead: at
    ``AFTER_TRAIN``, the last consistent state, before any hook's end-of-run
    changes. With ``claim=True`` it takes something the run will write to (a
    checkpoint directory, a log file): a phase's claims are performed before
    its other effects, so a run refused one writes nothing at all.

    Args:
        perform: called once with the state. What it returns is ignored, but
            for a ``Job`` (``fnloop._core.background``): the fold hands that
            to the run's writer thread.
        label: a name for messages.
        start: perform with the state the phase began with.
        claim: perform before the phase's other effects.
        everywhere: perform on every rank of a data-parallel run, not on
            rank 0 alone (a sharded checkpoint, whose every rank writes its part).
    """

    perform: Callable[[TrainState], object]
    label: str = ""
    start: bool = False
    claim: bool = False
    everywhere: bool = False


class Performs(enum.Enum):
    """Which of the effects a run requests this process performs."""

    ALL = "all"
    """Every effect: a single process, or rank 0 of a data-parallel run."""
    EVERYWHERE = "everywhere"
    """The effects requested of every rank (``Effect.everywhere``) only: another rank than 0."""
    NONE = "none"
    """None: effects turned off (a dry replay), or the end of a run whose state is torn."""

    def __call__(self, effect: Effect) -> bool:
        """Whether this process performs ``effect``."""
        return self is Performs.ALL or (self is Performs.EVERYWHERE and effect.everywhere)


@attrs.frozen
class Unclaimed:
    """A hook state read from a checkpoint, waiting for its hook to give it a type.

    A checkpoint is loaded with a ``like`` template built from code, but the
    hooks that will run are not known then. So a saved hook state that
    ``like.hooks`` does not describe is kept as plain data in an ``Unclaimed``.
    When the run starts, the hook that owns the name claims it
    (``claim(template)`` checks it against the hook's initial state and builds
    it); one that no hook owns is dropped with a warning, as the seed trainer
    does for an unknown hook.

    Args:
        data: the decoded tree (containers, numbers, strings, tensors).
        decode: ``decode(data, like, where) -> value``, strict about structure.
        where: where the data came from, for messages (file and entry).
        shards: the layout of the sharded checkpoint it was read from (``None``
            for a checkpoint of a whole state). Read from another layout, a hook
            state that holds chunks of the parameters (an EMA of a ``full``
            state) holds rank 0's alone; its hook can refuse it.
    """

    data: Any
    decode: Callable[[Any, Any, str], Any] = attrs.field(repr=False)
    where: str = attrs.field(eq=False)
    shards: Shards | None = attrs.field(default=None, eq=False, repr=False)

    def claim(self, like: Any) -> Any:
        """The value, built and checked against the template ``like``."""
        return self.decode(self.data, like, self.where)


class Clock(NamedTuple):
    """What the fold's clock read for the current phase: no part of the run, never saved.

    A state checks its clock's readings when it is built (``TrainState(...)``,
    ``attrs.evolve``).

    Args:
        time: the clock at the start of the current phase, in seconds.
        data_time: the seconds the fold waited for the current batch, for the
            ``AFTER_STEP`` hooks (a timer records it); 0 in other phases.
        step_time: the seconds from the start of this iteration's
            ``BEFORE_STEP`` to the start of its ``AFTER_STEP``: its
            ``BEFORE_STEP`` hooks and effects, the wait for the batch and the
            step. Set for ``AFTER_STEP``, 0 elsewhere.

    Examples:
        >>> Clock(time=2.0).time, Clock().step_time
        (2.0, 0.0)
    """

    time: float = 0.0
    data_time: float = 0.0
    step_time: float = 0.0


_STOPPED = Clock()
_tuple = tuple.__new__


def reading(time: float, data_time: float = 0.0, step_time: float = 0.0) -> Clock:
    """A ``Clock`` of the fold's own readings (floats from its clock), built without the keyword parsing."""
    return _tuple(Clock, (time, data_time, step_time))


# Not slotted: `unchecked` copies a state by its __dict__, a tenth of the cost of attrs.evolve.
@attrs.frozen(kw_only=True, slots=False)
class TrainState:
    """The whole run as a value.

    Fields are keyword-only and validated on construction and on every
    ``attrs.evolve``. Only ``max_iter`` is required, so a state needs no model:
    ``TrainState(max_iter=10)`` can be driven by any pure step.

    Args:
        max_iter: the run ends when ``iteration`` reaches it. Lowering it from
            a hook ends the run early, as a success; below the steps done by the
            end of the current iteration, the fold refuses it.
        iteration: the index of the current step during ``BEFORE_STEP``, the step
            and ``AFTER_STEP``; the number of completed steps otherwise.
        params: parameter name -> tensor (as ``model.named_parameters()``).
        buffers: buffer name -> tensor (as ``model.named_buffers()``).
        opt_state: the optimizer's state, a pytree of tensors.
        rng: the run's seed; the step's randomness is a function of
            ``(rng, iteration)``.
        data: the cursor of the batch stream: how many batches a resumable
            stream (``fnloop.data.batches``) has given so far, or the position
            a loader that keeps its own gave (``fnloop.data.resumable``).
        metrics: scalars recorded so far (``fnloop.Metrics``).
        hooks: hook name -> that hook's own state.
        extra: the user's own data (a frozen record or pytree).
        config: the run's configuration: the settings it was started with, as
            plain data (a dict of str, numbers, bools, ``None``, tuples and
            dicts). Given an attrs record, a dataclass or a mapping, it keeps
            that as such a dict (``fnloop.init(..., config=...)``; see
            ``docs/config.md``). Saved in every checkpoint, shown by ``fnloop
            inspect``; ``fnloop.checkpoint.resume`` names what changed.
        shards: how the state is split across ranks (a ``Shards``), or ``None``
            for a whole state. ``fnloop.init(..., shard=...)`` sets it; a
            checkpoint records it in its index, not in the state's entries.
        tensor: how the state's layers are split across a group of ranks
            (tensor parallelism, a ``TensorParallel``), or ``None``.
            ``fnloop.init(..., tensor=...)`` sets it.
        population: for a population's state (``fnloop.population``), its
            members (a ``Population``): the tensors then hold every member's,
            stacked on a new first dimension. ``None`` for a single run.
        clock: what the fold's clock read for the current phase (a ``Clock``:
            ``time``, ``data_time``, ``step_time``, also readable as
            ``state.time`` and so on). Like ``effects``, never saved: a
            checkpoint holds the run, not the wall clock.
        effects: effects requested in the current phase (cleared by the fold).

    Examples:
        >>> s = TrainState(max_iter=3)
        >>> s.iteration, s.max_iter
        (0, 3)
        >>> attrs.evolve(s, iteration=1).iteration
        1
    """

    max_iter: int = attrs.field(validator=non_negative_int)
    iteration: int = attrs.field(default=0, validator=non_negative_int)
    params: Mapping[str, torch.Tensor] = attrs.field(factory=dict, validator=_tensor_mapping)
    buffers: Mapping[str, torch.Tensor] = attrs.field(factory=dict, validator=_tensor_mapping)
    opt_state: Any = None
    rng: int = attrs.field(default=0, validator=non_negative_int)
    data: Any = 0
    metrics: Metrics = attrs.field(factory=Metrics, validator=_metrics)
    hooks: Mapping[str, Any] = attrs.field(factory=dict, validator=_str_mapping)
    extra: Any = None
    config: Mapping[str, Any] | None = attrs.field(default=None, converter=plain)
    shards: Shards | None = attrs.field(default=None, validator=_shards)
    tensor: TensorParallel | None = attrs.field(default=None, validator=_tensor)
    population: Population | None = attrs.field(default=None, validator=_population)
    clock: Clock = attrs.field(default=_STOPPED, validator=_clock)
    effects: tuple[Effect, ...] = attrs.field(default=(), validator=_effects)

    @property
    def time(self) -> float:
        """The fold's clock at the start of the current phase (``clock.time``)."""
        return self.clock.time

    @property
    def data_time(self) -> float:
        """The seconds the fold waited for this iteration's batch, in ``AFTER_STEP`` (``clock.data_time``)."""
        return self.clock.data_time

    @property
    def step_time(self) -> float:
        """The seconds of this iteration up to its ``AFTER_STEP`` (``clock.step_time``)."""
        return self.clock.step_time


def record(state: TrainState, **values: Scalar) -> TrainState:
    """``state`` with scalars recorded at ``state.iteration``.

    Examples:
        >>> record(TrainState(max_iter=1), loss=0.5).metrics.latest("loss")
        (0, 0.5)
    """
    return attrs.evolve(state, metrics=state.metrics.record(state.iteration, values))


def request(
    state: TrainState,
    perform: Callable[[TrainState], object],
    label: str = "",
    *,
    start: bool = False,
    claim: bool = False,
    everywhere: bool = False,
) -> TrainState:
    """``state`` with an effect requested for the end of the current phase.

    ``perform`` gets the state as the phase ends, or with ``start=True`` as it
    began; with ``claim=True`` it runs before the phase's other effects; with
    ``everywhere=True`` every rank performs it, not rank 0 alone (see ``Effect``).

    Examples:
        >>> s = request(TrainState(max_iter=1), print, "print")
        >>> [e.label for e in s.effects]
        ['print']
    """
    return attrs.evolve(state, effects=(*state.effects, Effect(perform, label, start, claim, everywhere)))


_MISSING: Any = object()


def hook_state(state: TrainState, name: str, default: Any = _MISSING) -> Any:
    """The state kept under hook ``name``, or ``default`` when it has none.

    A state read from a checkpoint and not yet claimed (``Unclaimed``) is
    built with ``default`` as its template.

    Raises:
        KeyError: no state under ``name`` and no ``default`` given.
    """
    try:
        value = state.hooks[name]
        if type(value) is Unclaimed and default is not _MISSING:
            return value.claim(default)
        return value
    except KeyError:
        if default is not _MISSING:
            return default
        raise KeyError(f"no hook state named {name!r}; states present: {sorted(state.hooks)}") from None


def with_hook_state(state: TrainState, name: str, value: Any) -> TrainState:
    """``state`` with ``value`` kept under hook ``name``."""
    return attrs.evolve(state, hooks={**state.hooks, name: value})


def unchecked(state: TrainState, **changes: Any) -> TrainState:
    """``state`` with ``changes``, skipping validation: for the library's own hot paths.

    Only for values the caller knows are valid (the fold's clock readings and
    cursor, a step's recorded metrics, a stateful hook's memory). Everything
    else changes a state with ``attrs.evolve``, which validates. A copy of the
    instance dictionary costs a tenth of rebuilding through ``__init__``.
    """
    new = _new(TrainState)
    _set(new, "__dict__", state.__dict__ | changes)
    return new
