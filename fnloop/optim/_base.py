"""The optimizer contract: types, the ``Optimizer`` record and ``apply_updates``.

A gradient transformation is a pair of pure functions, optax style:
``init(params) -> state`` and ``update(updates, state, params, iteration) ->
(updates, state)``. An ``Optimizer`` wraps one and adds the last step, turning
updates into new parameters. Everything here is written so that ``update`` can
be traced by ``torch.compile(fullgraph=True)``: states are dicts, tuples and
``NamedTuple``s of tensors, and nothing branches on a tensor's value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol, TypeAlias, runtime_checkable

import attrs
import torch
from torch.utils import _pytree as pytree

from fnloop._core.messages import describe
from fnloop.optim._helpers import (  # noqa: F401 - shared by the optimizers, imported from here
    _number,
    apply_updates,
    check_keys,
    first_device,
    is_setting,
    kept_unless,
    zero_count,
)
from fnloop.optim._sums import OverShards, SquaresSum, Sum, over_shards  # noqa: F401 - re-exported

__all__ = [
    "EmptyState",
    "GradientTransformation",
    "OverShards",
    "HasLearningRates",
    "InPlaceTransformation",
    "LearningRate",
    "OptState",
    "Optimizer",
    "RatesInState",
    "Params",
    "Schedule",
    "apply_updates",
    "learning_rates",
    "fixed_learning_rates",
    "check_keys",
    "describe",
    "first_device",
    "kept_unless",
    "update_in_place",
]

Params: TypeAlias = dict[str, torch.Tensor]
"""Parameters, gradients or updates: a dict from parameter name to tensor."""

OptState: TypeAlias = Any
"""An optimizer state: nested dicts, tuples and ``NamedTuple``s of tensors."""


class Schedule(Protocol):
    """A map from the 0-d int64 iteration tensor to a 0-d float tensor, the value at that step.

    Any function of that shape written with torch ops only (``torch.where``, not
    ``if``) is a schedule, so it traces into a compiled step. The library's
    (``constant``, ``cosine``, ``warmup``, ...) are frozen records that also
    pickle and compare equal.

    Examples:
        >>> from fnloop.optim import cosine
        >>> cosine(0.1, max_iter=10)(torch.tensor(5))
        tensor(0.0500, dtype=torch.float64)
    """

    def __call__(self, iteration: torch.Tensor, /) -> torch.Tensor: ...


LearningRate: TypeAlias = float | Schedule
"""A fixed learning rate, or a schedule giving the learning rate of each step."""


class EmptyState(NamedTuple):
    """The state of a transformation that keeps none.

    Examples:
        >>> EmptyState()
        EmptyState()
    """


@runtime_checkable
class GradientTransformation(Protocol):
    """Anything with pure ``init`` and ``update`` functions that turn gradients into updates.

    ``init(params)`` builds the state from the parameters. ``update(updates,
    state, params, iteration)`` returns the transformed updates and the new
    state; ``iteration`` is the 0-d int64 index of the current step. Neither
    may modify its arguments in place, and ``update`` must return a state with
    the same structure, shapes and dtypes as ``init`` does.

    Library transformations (``clip_by_global_norm``, ``scale_by_adam``, ...)
    are frozen records with these two methods; an object of your own, or a
    ``NamedTuple`` of two functions, works as well.

    Examples:
        >>> from fnloop.optim import clip_by_global_norm
        >>> isinstance(clip_by_global_norm(1.0), GradientTransformation)
        True
    """

    def init(self, params: Params, /) -> OptState: ...

    def update(
        self, updates: Params, state: OptState, params: Params, iteration: torch.Tensor, /
    ) -> tuple[Params, OptState]: ...


@runtime_checkable
class InPlaceTransformation(Protocol):
    """A gradient transformation that can also update in place: ``update_``, the same numbers, no copies.

    ``update_(updates, state, params, iteration)`` returns what ``update``
    returns as updates, and leaves in ``state``'s tensors what ``update``
    returns as the new state, bit for bit. It may write into ``updates``'s
    tensors (the caller gives them up, and reads only the returned ones)
    and never writes into ``params``. The library's transformations offer
    it; the eager step (``train_step(..., compile=False)``) calls it on the
    optimizer state it owns, so an update allocates no second state. A
    transformation without it is called as usual, its new state copied in.

    Examples:
        >>> from fnloop.optim import scale_by_adam
        >>> isinstance(scale_by_adam(), InPlaceTransformation)
        True
    """

    def update_(
        self, updates: Params, state: OptState, params: Params, iteration: torch.Tensor, /
    ) -> Params: ...


@runtime_checkable
class HasLearningRates(Protocol):
    """A transformation that says its learning rates: ``learning_rates(iteration)``, name -> rate.

    ``scale_by_learning_rate``, ``chain`` and ``partition`` do; so can one of
    your own. ``learning_rates(transform, iteration)`` asks it.
    """

    def learning_rates(self, iteration: torch.Tensor, /) -> Mapping[str, Any]: ...


@runtime_checkable
class RatesInState(Protocol):
    """A transformation whose learning rates its state holds (``inject``'s): known with the state only.

    ``learning_rates(transform, iteration, state)`` asks it
    ``state_learning_rates(iteration, state)``; without a state, it has none to give.
    """

    def state_learning_rates(self, iteration: torch.Tensor, state: OptState, /) -> Mapping[str, Any]: ...


def update_in_place(
    transform: GradientTransformation,
    updates: Params,
    state: OptState,
    params: Params,
    iteration: torch.Tensor,
) -> Params:
    """``transform``'s updates, its new state written into ``state``: by ``update_`` when it offers it."""
    if isinstance(transform, InPlaceTransformation):
        return transform.update_(updates, state, params, iteration)
    new_updates, new_state = transform.update(updates, state, params, iteration)
    (old, before), (new, after) = pytree.tree_flatten(state), pytree.tree_flatten(new_state)
    if before != after:
        raise ValueError(
            f"{describe(transform)}: update returned a state of another structure than the one it "
            f"was given ({after} for {before}), so it cannot be written into the given state in "
            "place (the eager step, train_step(..., compile=False), updates in place). Return the "
            "same structure every step, with the same shapes (as optax's transformations do), or "
            "give the transformation an update_ of its own."
        )
    if old:
        torch._foreach_copy_(old, new)
    # What a transformation of one's own returns may share storage with its state: a copy is safe to write into.
    return {k: u.clone() for k, u in new_updates.items()}


def learning_rates(
    transform: GradientTransformation | Optimizer, iteration: torch.Tensor, state: OptState = None
) -> dict[str, torch.Tensor | float]:
    """The learning rates ``transform`` applies at step ``iteration``: a float, or a schedule's 0-d tensor.

    ``{"lr": ...}`` for a transformation with one ``scale_by_learning_rate``
    stage; ``{"lr/<group>": ...}`` per group of a ``partition``; ``{}`` for a
    transformation that has no learning rate or does not say (one of your own
    can by offering a ``learning_rates(iteration)`` method); with ``state``, an
    ``inject``ed optimizer's rates, which its state holds. A fixed learning
    rate is the float it is; a schedule's value is computed with torch ops, so
    ``train_step`` records it from inside its compiled graph.

    Examples:
        >>> from fnloop.optim import sgd, cosine
        >>> learning_rates(sgd(cosine(0.1, max_iter=10)), torch.tensor(5))
        {'lr': tensor(0.0500, dtype=torch.float64)}
        >>> learning_rates(sgd(0.1), torch.tensor(5))
        {'lr': 0.1}
    """
    if isinstance(transform, Optimizer):
        state = None if state is None else transform.inner_state(state)
        transform = transform.transform
    if isinstance(transform, RatesInState):  # inject's: the rates its state holds, known with the state
        return {} if state is None else dict(transform.state_learning_rates(iteration, state))
    return dict(transform.learning_rates(iteration)) if isinstance(transform, HasLearningRates) else {}


def fixed_learning_rates(transform: GradientTransformation | Optimizer) -> dict[str, float]:
    """The learning rates of ``transform`` that are fixed numbers, known without running a step."""
    rates = learning_rates(transform, torch.zeros((), dtype=torch.int64))
    return {name: value for name, value in rates.items() if not isinstance(value, torch.Tensor)}


_ITERATION = (
    "update expected iteration as a 0-d int64 tensor, the index of the step (got {got!r:.40} "
    "that is a {kind}). A Python int would recompile a compiled step every time it changes; "
    "pass torch.tensor(i)."
)

_GRADS_FIX = "Compute grads over the same params dict, for example with torch.func.grad(loss)(params, ...)."


@attrs.frozen(repr=False)
class Optimizer:
    """A gradient transformation plus the step that applies its updates.

    Build one with ``sgd``, ``adam``, ``adamw``, ``chain`` or ``partition``, or
    wrap your own transformation: ``Optimizer(chain(trace(0.9),
    scale_by_learning_rate(0.1)))`` is SGD with momentum. It is created outside
    compiled code; ``init`` and ``update`` may be called inside it.

    Args:
        transform: turns gradients into the updates added to the parameters;
            its last stage is usually ``scale_by_learning_rate``.

    Examples:
        >>> from fnloop.optim import sgd
        >>> opt = sgd(0.5)
        >>> params = {"w": torch.tensor([1.0, 2.0])}
        >>> state = opt.init(params)
        >>> new, state = opt.update({"w": torch.tensor([1.0, 1.0])}, state, params, torch.tensor(0))
        >>> new
        {'w': tensor([0.5000, 1.5000])}
    """

    transform: GradientTransformation

    def init(self, params: Params, /) -> OptState:
        """The optimizer state for ``params``: tensors only, never aliasing ``params``.

        Args:
            params: the parameters to optimize, by name.

        Returns:
            The initial state (dicts, tuples and ``NamedTuple``s of tensors).
        """
        return self.transform.init(params)

    def update(
        self, grads: Params, state: OptState, params: Params, iteration: torch.Tensor, /
    ) -> tuple[Params, OptState]:
        """One optimization step: ``(new_params, new_state)``; nothing is modified in place.

        Args:
            grads: gradients, keyed like ``params``.
            state: what ``init`` or the previous ``update`` returned.
            params: the current parameters.
            iteration: 0-d int64 tensor, the index of this step (0 for the
                first); schedules read it.

        Returns:
            The new parameters and the new state, structured like the old ones.

        Raises:
            KeyError: ``grads`` and ``params`` have different keys.
            TypeError: ``iteration`` is not a 0-d tensor.
        """
        check_keys("grads", grads, params, _GRADS_FIX)
        if not isinstance(iteration, torch.Tensor) or iteration.ndim != 0:
            raise TypeError(_ITERATION.format(got=iteration, kind=type(iteration).__name__))
        updates, state = self.transform.update(grads, state, params, iteration)
        return apply_updates(params, updates), state

    def update_(self, grads: Params, state: OptState, params: Params, iteration: torch.Tensor, /) -> None:
        """``update`` in place: the new parameters into ``params``'s tensors, the new state into ``state``'s.

        The numbers are those of ``update``, bit for bit; ``grads``'s tensors
        may be overwritten. For a state nobody else holds: the eager step
        calls it on the state it was given to own.

        Args:
            grads: gradients, keyed like ``params``; given up to the update.
            state: the optimizer state, written into.
            params: the parameters, written into.
            iteration: 0-d int64 tensor, the index of this step.

        Examples:
            >>> from fnloop.optim import sgd
            >>> opt = sgd(0.5)
            >>> params = {"w": torch.tensor([1.0, 2.0])}
            >>> state = opt.init(params)
            >>> opt.update_({"w": torch.tensor([1.0, 1.0])}, state, params, torch.tensor(0))
            >>> params
            {'w': tensor([0.5000, 1.5000])}
        """
        check_keys("grads", grads, params, _GRADS_FIX)
        if not isinstance(iteration, torch.Tensor) or iteration.ndim != 0:
            raise TypeError(_ITERATION.format(got=iteration, kind=type(iteration).__name__))
        updates = update_in_place(self.transform, grads, state, params, iteration)
        check_keys("updates", updates, params, "Transformations must return one update per parameter.")
        same = [k for k, p in params.items() if p.dtype == updates[k].dtype]
        if same:  # p + u in p's dtype, as apply_updates computes it
            torch._foreach_add_([params[k] for k in same], [updates[k] for k in same])
        for k, p in params.items():
            if p.dtype != updates[k].dtype:
                p.copy_((p + updates[k]).to(p.dtype))

    def summing(self, sum_: Sum | None, /) -> Optimizer:
        """This optimizer with its sums over the model taken by ``sum_`` (``over_shards``); itself for ``None``."""
        return self if sum_ is None else self.over_shards(sum_)

    def over_shards(self, sum_: Sum, /) -> Optimizer:
        """This optimizer for a sharded step's update of one rank's chunks; ``sum_`` sums over the ranks.

        See ``OverShards``: a transformation that reduces over the whole model
        (``clip_by_global_norm``) then computes the whole model's value.
        """
        return Optimizer(over_shards(self.transform, sum_))

    def inner_state(self, state: OptState) -> OptState:
        """The part of ``state`` that ``transform`` keeps: all of it (a wrapper's, such as ``dynamic_loss_scale``'s, less)."""
        return state

    # What a wrapper of the whole optimizer (dynamic_loss_scale, skip_spikes) tells the step.

    @property
    def scales_loss(self) -> bool:
        """Whether the step multiplies the loss by ``loss_scale`` before the backward (``dynamic_loss_scale``)."""
        return False

    def loss_scale(self, state: OptState) -> torch.Tensor | None:
        """What the step's loss is multiplied by before the backward; ``None``: not scaled."""
        return None

    def given_loss(self, state: OptState, loss: torch.Tensor) -> OptState:
        """``state`` holding the step's ``loss``, for an optimizer that judges it (``skip_spikes``); else ``state``."""
        return state

    def loss_slot(self, state: OptState) -> torch.Tensor | None:
        """The tensor of ``state`` that ``given_loss`` fills, for a step that writes it in place; ``None``: none."""
        return None

    def snapshot(self, state: OptState) -> Any:
        """What ``metrics`` reads of the state before an update in place (copies); ``None`` for an optimizer with none."""
        return None

    def metrics(self, before: Any, after: OptState) -> dict[str, torch.Tensor]:
        """What the step records of this update, from the state ``before`` it (or its ``snapshot``) and ``after``."""
        return {}

    def __repr__(self) -> str:
        return f"Optimizer({self.transform!r})"
