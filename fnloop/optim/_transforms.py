"""Gradient transformations: the stages that optimizers are chained from.

Each state record sits right above the factory whose transformation keeps it (Adam's scaling is
``_adam.py``'s).
Every ``update`` is out of place and branches only on static facts (names,
shapes, configuration), never on a tensor's value, so it traces into one graph.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import attrs
import torch

from fnloop.optim._base import (
    EmptyState,
    GradientTransformation,
    Params,
    SquaresSum,
    Sum,
    _number,
    check_keys,
    describe,
    first_device,
    zero_count,
)

__all__ = [
    "ClipByGlobalNormState",
    "TraceState",
    "add_decayed_weights",
    "clip_by_global_norm",
    "trace",
]

_STATE_FIX = "Pass the state that init() or the previous update() returned for these params."


class ClipByGlobalNormState(NamedTuple):
    """What ``clip_by_global_norm`` measured.

    Attributes:
        global_norm: 0-d tensor, the L2 norm of all incoming gradients of the
            last update, before clipping (0 before the first update).
    """

    global_norm: torch.Tensor


def _norm_dtype(params: Params) -> torch.dtype:
    """The dtype of the global norm of gradients shaped like ``params`` (as torch computes it)."""
    dtypes = [t.dtype for t in params.values()]
    return functools.reduce(torch.promote_types, dtypes) if dtypes else torch.float32


def _global_norm(updates: Params, summed: Sum | None) -> torch.Tensor:
    """The L2 norm of all ``updates`` together; with ``summed``, of the whole model's: they are one rank's chunks."""
    if isinstance(summed, SquaresSum):  # a world-size-invariant step's: the same bits at any world size
        return summed.squares(updates, _norm_dtype(updates)).sum().sqrt()
    first = next(iter(updates.values())).device
    norms = [torch.linalg.vector_norm(u).to(first) for u in updates.values()]
    total = torch.linalg.vector_norm(torch.stack(norms))
    return total if summed is None else torch.sqrt(summed(total.square()))


@attrs.frozen(repr=False)
class _ClipByGlobalNorm:
    max_norm: float
    # A sharded step's sum over ranks (over_shards): the updates are this rank's chunks.
    summed: Sum | None = attrs.field(default=None, eq=False)

    def over_shards(self, sum_: Sum, /) -> _ClipByGlobalNorm:
        return attrs.evolve(self, summed=sum_)

    def init(self, params: Params, /) -> ClipByGlobalNormState:
        zero = torch.zeros((), dtype=_norm_dtype(params), device=first_device(params))
        return ClipByGlobalNormState(zero)

    def update(
        self, updates: Params, state: ClipByGlobalNormState, params: Params, iteration: torch.Tensor, /
    ) -> tuple[Params, ClipByGlobalNormState]:
        if not updates:
            return updates, state
        # The same arithmetic as torch.nn.utils.clip_grad_norm_, coefficient clamp included.
        total = _global_norm(updates, self.summed)
        coef = torch.clamp(self.max_norm / (total + 1e-6), max=1.0)
        return {k: u * coef for k, u in updates.items()}, ClipByGlobalNormState(total)

    def update_(
        self, updates: Params, state: ClipByGlobalNormState, params: Params, iteration: torch.Tensor, /
    ) -> Params:
        if not updates:
            return updates
        total = _global_norm(updates, self.summed)
        torch._foreach_mul_(list(updates.values()), torch.clamp(self.max_norm / (total + 1e-6), max=1.0))
        state.global_norm.copy_(total)
        return updates

    def __repr__(self) -> str:
        return f"clip_by_global_norm({self.max_norm!r})"


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale all updates together so that their global L2 norm is at most ``max_norm``.

    The numbers are those of ``torch.nn.utils.clip_grad_norm_``: the coefficient
    ``max_norm / (norm + 1e-6)``, clamped to 1, multiplies every update. The
    norm before clipping is kept in the state for logging.

    Args:
        max_norm: the largest global norm let through; positive.

    Returns:
        A stateful transformation; its state is a ``ClipByGlobalNormState``.

    Raises:
        ValueError: ``max_norm`` is not positive.

    Examples:
        >>> clip = clip_by_global_norm(1.0)
        >>> g = {"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}
        >>> updates, state = clip.update(g, clip.init(g), g, torch.tensor(0))
        >>> updates["a"], state.global_norm
        (tensor([0.6000]), tensor(5.))

    See Also:
        chain: put it before an optimizer, ``chain(clip_by_global_norm(1.0), adamw(1e-3))``.
    """
    max_norm = _number("max_norm", max_norm)
    if max_norm == 0.0:
        raise ValueError("'max_norm' must be positive (got 0.0); to drop all updates use lr=0.")
    return _ClipByGlobalNorm(max_norm)


def _mask_value(mask: Callable[[str, torch.Tensor], bool], name: str, tensor: torch.Tensor) -> bool:
    decide = mask(name, tensor)
    if type(decide) is not bool:
        raise TypeError(
            f"decay_mask must return a bool for each parameter (got {decide!r:.60} for {name!r}). "
            "Decide from the name and shape, never from tensor values, for example "
            "fnloop.optim.exclude_bias_and_norm."
        )
    return decide


@attrs.frozen(repr=False)
class _AddDecayedWeights:
    weight_decay: float
    mask: Callable[[str, torch.Tensor], bool] | None

    def init(self, params: Params, /) -> EmptyState:
        return EmptyState()

    def update(
        self, updates: Params, state: EmptyState, params: Params, iteration: torch.Tensor, /
    ) -> tuple[Params, EmptyState]:
        check_keys("updates", updates, params, "Give one gradient per parameter.")
        # Products are written out: on torch 2.13, torch.add(g, x, alpha=c) applied to
        # a grad_and_value output drops `alpha` when compiled (tests/test_step.py).
        return {
            k: u + self.weight_decay * params[k]
            if self.mask is None or _mask_value(self.mask, k, params[k])
            else u
            for k, u in updates.items()
        }, state

    def update_(
        self, updates: Params, state: EmptyState, params: Params, iteration: torch.Tensor, /
    ) -> Params:
        check_keys("updates", updates, params, "Give one gradient per parameter.")
        for k, u in updates.items():
            if self.mask is None or _mask_value(self.mask, k, params[k]):
                # One parameter's product at a time: no state-sized copy.
                u.add_(self.weight_decay * params[k])
        return updates

    def __repr__(self) -> str:
        mask = "" if self.mask is None else f", decay_mask={describe(self.mask)}"
        return f"add_decayed_weights({self.weight_decay!r}{mask})"


def add_decayed_weights(
    weight_decay: float, *, decay_mask: Callable[[str, torch.Tensor], bool] | None = None
) -> GradientTransformation:
    """Add ``weight_decay * param`` to each update: L2 decay before a scaler, decoupled after.

    Args:
        weight_decay: the factor; non-negative.
        decay_mask: ``(name, tensor) -> bool``, true for the parameters to
            decay; ``None`` decays all. It may look at names and shapes only.

    Returns:
        A stateless transformation (its state is ``EmptyState()``).

    Raises:
        ValueError: ``weight_decay`` is negative.

    Examples:
        >>> decay = add_decayed_weights(0.1)
        >>> p = {"w": torch.tensor([2.0])}
        >>> decay.update({"w": torch.tensor([1.0])}, decay.init(p), p, torch.tensor(0))[0]
        {'w': tensor([1.2000])}
    """
    return _AddDecayedWeights(_number("weight_decay", weight_decay), decay_mask)


class TraceState(NamedTuple):
    """State of ``trace``: the momentum buffers.

    Attributes:
        step: 0-d int64, how many updates have been made (torch's ``step``).
        trace: one momentum buffer per parameter.
    """

    step: torch.Tensor
    trace: Params


@attrs.frozen(repr=False)
class _Trace:
    momentum: float
    dampening: float
    nesterov: bool

    def init(self, params: Params, /) -> TraceState:
        return TraceState(zero_count(params), {k: torch.zeros_like(p) for k, p in params.items()})

    def update(
        self, updates: Params, state: TraceState, params: Params, iteration: torch.Tensor, /
    ) -> tuple[Params, TraceState]:
        check_keys("opt_state.trace", state.trace, updates, _STATE_FIX)
        # torch.optim.SGD starts the buffer at the first gradient itself, undamped.
        first = state.step == 0
        trace = {
            k: torch.where(first, u, state.trace[k] * self.momentum + (1 - self.dampening) * u)
            for k, u in updates.items()
        }
        out = {k: u + self.momentum * trace[k] for k, u in updates.items()} if self.nesterov else dict(trace)
        return out, TraceState(state.step + 1, trace)

    def update_(
        self, updates: Params, state: TraceState, params: Params, iteration: torch.Tensor, /
    ) -> Params:
        check_keys("opt_state.trace", state.trace, updates, _STATE_FIX)
        if not updates:  # update counts the step all the same
            state.step.add_(1)
            return updates
        first = state.step == 0
        keys = list(updates)
        us, traces = [updates[k] for k in keys], [state.trace[k] for k in keys]
        moved = torch._foreach_add(
            torch._foreach_mul(traces, self.momentum), torch._foreach_mul(us, 1 - self.dampening)
        )
        for old, u, new in zip(traces, us, moved):
            old.copy_(torch.where(first, u, new))
        state.step.add_(1)
        if self.nesterov:
            torch._foreach_add_(us, torch._foreach_mul(traces, self.momentum))
        else:
            torch._foreach_copy_(us, traces)
        return updates

    def __repr__(self) -> str:
        return f"trace({self.momentum!r}, dampening={self.dampening!r}, nesterov={self.nesterov!r})"


def trace(momentum: float, *, dampening: float = 0.0, nesterov: bool = False) -> GradientTransformation:
    """Momentum, exactly as ``torch.optim.SGD`` keeps it.

    The buffer starts at the first update; afterwards ``buf = momentum * buf +
    (1 - dampening) * update``. The output is ``buf``, or ``update + momentum *
    buf`` with ``nesterov=True``.

    Args:
        momentum: how much of the buffer each step keeps; non-negative (often 0.9).
        dampening: how much of each new update is left out of the buffer.
        nesterov: use Nesterov momentum (needs ``momentum > 0`` and no dampening).

    Returns:
        A transformation whose state is a ``TraceState``.

    Raises:
        ValueError: a negative factor, or Nesterov with zero momentum or with dampening.

    Examples:
        >>> t = trace(0.9)
        >>> p = {"w": torch.zeros(1)}
        >>> u, s = t.update({"w": torch.ones(1)}, t.init(p), p, torch.tensor(0))
        >>> t.update({"w": torch.ones(1)}, s, p, torch.tensor(1))[0]
        {'w': tensor([1.9000])}
    """
    momentum = _number("momentum", momentum)
    dampening = _number("dampening", dampening)
    if nesterov and (momentum == 0.0 or dampening != 0.0):
        raise ValueError(
            f"Nesterov momentum needs momentum > 0 and dampening == 0 (got momentum={momentum!r}, "
            f"dampening={dampening!r}); set both, or nesterov=False."
        )
    return _Trace(momentum, dampening, bool(nesterov))
