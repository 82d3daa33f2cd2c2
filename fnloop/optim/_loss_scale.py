"""Dynamic loss scaling for float16 training: ``dynamic_loss_scale`` (``torch.amp.GradScaler`` as a value).

float16 keeps 5 exponent bits: a gradient below about 6e-8 rounds to zero.
A loss scaled up by ``S`` before the backward has gradients ``S`` times
larger, kept clear of that floor; they are divided by ``S`` before the
optimizer sees them. When some gradient overflows (is not finite) the update
is skipped and ``S`` halves; after ``growth_interval`` finite steps in a row
it doubles. These are ``torch.amp.GradScaler``'s rules and defaults.

Here ``S`` and the count of finite steps live in the optimizer state, so a
checkpoint holds them, a resume continues with them, and a replay repeats
them, and the compiled step decides everything inside its graph (no read of
a flag per step). The step (``train_step``) multiplies the loss by the
state's scale before its backward when the optimizer is one of these.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import attrs
import torch

from fnloop._core.messages import got
from fnloop.optim._base import Optimizer, OptState, Params, Sum, first_device, kept_unless

__all__ = ["LossScaleState", "LossScaled", "dynamic_loss_scale"]


class LossScaleState(NamedTuple):
    """The state of a ``dynamic_loss_scale`` optimizer.

    Args:
        inner: the wrapped optimizer's state (untouched by a skipped step).
        scale: 0-d float32, what the next step's loss is multiplied by.
        growth: 0-d int32, finite steps since the scale last changed
            (``GradScaler``'s growth tracker).
    """

    inner: OptState
    scale: torch.Tensor
    growth: torch.Tensor


@attrs.frozen(repr=False)
class LossScaled(Optimizer):
    """An optimizer whose updates are loss-scaled: built by ``dynamic_loss_scale``.

    ``inner`` is the wrapped optimizer, and ``transform`` its own, so its
    learning rates are read as before; the settings are ``GradScaler``'s.
    """

    inner: Optimizer = attrs.field(kw_only=True)
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    summed: Sum | None = attrs.field(default=None, eq=False)
    """A sharded step's sum over ranks: an overflow in any rank's chunk skips the step on all."""

    def init(self, params: Params, /) -> LossScaleState:
        device = first_device(params)
        return LossScaleState(
            self.inner.init(params),
            torch.full((), self.init_scale, dtype=torch.float32, device=device),
            torch.zeros((), dtype=torch.int32, device=device),
        )

    def update(
        self, grads: Params, state: OptState, params: Params, iteration: torch.Tensor, /
    ) -> tuple[Params, LossScaleState]:
        """Unscale ``grads``; where every one is finite, the wrapped update, else the state as it was; the new scale."""
        _check_state(state)
        unscaled = _unscaled(grads, state.scale)
        found = self._overflow(_peak(unscaled))
        new_params, inner = self.inner.update(unscaled, state.inner, params, iteration)
        kept, inner = kept_unless(found, new_params, params, inner, state.inner)
        return kept, LossScaleState(inner, *self._next(state.scale, state.growth, found))

    def update_(self, grads: Params, state: OptState, params: Params, iteration: torch.Tensor, /) -> None:
        """``update`` in place, reading on the host whether the step overflowed (the eager step's)."""
        _check_state(state)
        grads = dict(grads)
        if grads:
            inverse = _inverse(state.scale)
            torch._foreach_mul_(list(grads.values()), inverse)
        found = self._overflow(_peak(grads, eager=True))
        if not bool(found):
            self.inner.update_(grads, state.inner, params, iteration)
        scale, growth = self._next(state.scale, state.growth, found)
        state.scale.copy_(scale)
        state.growth.copy_(growth)

    def over_shards(self, sum_: Sum, /) -> LossScaled:
        inner = self.inner.over_shards(sum_)
        return attrs.evolve(self, transform=inner.transform, inner=inner, summed=sum_)

    def inner_state(self, state: OptState) -> OptState:
        return self.inner.inner_state(state.inner) if isinstance(state, LossScaleState) else state

    def given_loss(self, state: OptState, loss: torch.Tensor) -> OptState:
        return state._replace(inner=self.inner.given_loss(state.inner, loss))

    def loss_slot(self, state: OptState) -> torch.Tensor | None:
        return self.inner.loss_slot(state.inner)

    def snapshot(self, state: OptState) -> Any:
        return state._replace(inner=self.inner.snapshot(state.inner), scale=state.scale.clone())

    @property
    def scales_loss(self) -> bool:
        return True

    def loss_scale(self, state: OptState) -> torch.Tensor:
        """What this step's loss is multiplied by before the backward."""
        _check_state(state)
        return state.scale

    def metrics(self, before: Any, after: OptState) -> dict[str, torch.Tensor]:
        """The step's ``loss_scale`` (the scale its backward used) and ``overflow`` (1 where it was skipped)."""
        # Backoff is below 1, so the scale falls exactly when the step overflowed. A copy: the
        # compiled step writes the new scale into the tensor the state held.
        return {
            "loss_scale": before.scale.clone(),
            "overflow": (after.scale < before.scale).to(torch.int64),
            **self.inner.metrics(before.inner, after.inner),
        }

    def _overflow(self, peak: torch.Tensor) -> torch.Tensor:
        """A 0-d bool: some gradient element is not finite (on any rank, in a sharded step)."""
        found = ~torch.isfinite(peak)
        if self.summed is not None:
            found = self.summed(found.to(torch.float32)) > 0
        return found

    def _next(
        self, scale: torch.Tensor, growth: torch.Tensor, found: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``GradScaler``'s update of the scale: back off on an overflow, grow after ``growth_interval`` finite steps."""
        grown = growth + 1
        due = grown >= self.growth_interval
        bigger = scale * self.growth_factor
        scale = torch.where(
            found, scale * self.backoff_factor, torch.where(due & torch.isfinite(bigger), bigger, scale)
        )
        growth = torch.where(found | due, torch.zeros_like(grown), grown)
        return scale, growth

    def __repr__(self) -> str:
        settings = (
            f"init_scale={self.init_scale}, growth_factor={self.growth_factor}, "
            f"backoff_factor={self.backoff_factor}, growth_interval={self.growth_interval}"
        )
        return f"dynamic_loss_scale({self.inner!r}, {settings})"


_MOST = 2.0**64
"""The largest first scale: a float16 gradient overflows at 65504, so a scale beyond this is only backed off."""


def dynamic_loss_scale(
    optimizer: Optimizer,
    *,
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
) -> LossScaled:
    """``optimizer`` trained with a dynamically scaled loss, for float16 autocast: ``torch.amp.GradScaler``'s rules.

    The step multiplies the loss by the state's scale before its backward,
    and this optimizer divides the gradients by it. A step with a gradient
    that is not finite leaves the parameters and ``optimizer``'s state as they
    were and multiplies the scale by ``backoff_factor``; after
    ``growth_interval`` finite steps in a row the scale is multiplied by
    ``growth_factor``. The scale and that count are in the state
    (``LossScaleState``): saved, resumed and replayed with it. Each step
    records the metrics ``loss_scale`` (what its loss was multiplied by) and
    ``overflow`` (1 for a skipped step, else 0).

    A loss that is itself not finite is not an overflow that a smaller scale
    cures (the scale multiplies it only after the forward): the step treats it
    as any non-finite loss (``train_step(..., skip_nonfinite=...)``).

    Args:
        optimizer: the optimizer to wrap (``adamw(...)``, ``chain(...)``, ``inject(...)``).
        init_scale: the first scale; ``GradScaler``'s default, 2**16.
        growth_factor: the scale's factor after ``growth_interval`` finite steps; above 1.
        backoff_factor: its factor after an overflow; in (0, 1).
        growth_interval: finite steps in a row before the scale grows; a positive int.

    Examples:
        >>> import fnloop as fl
        >>> opt = fl.optim.dynamic_loss_scale(fl.optim.sgd(0.1), init_scale=4.0)
        >>> params = {"w": torch.ones(2)}
        >>> state = opt.init(params)
        >>> new, state = opt.update({"w": torch.tensor([4.0, float("inf")])}, state, params, torch.tensor(0))
        >>> new["w"], state.scale  # skipped, and the scale backed off
        (tensor([1., 1.]), tensor(2.))
        >>> new, state = opt.update({"w": torch.tensor([2.0, 2.0])}, state, params, torch.tensor(1))
        >>> new["w"]  # the gradient 2.0 / 2.0 = 1.0 applied
        tensor([0.9000, 0.9000])
    """
    if isinstance(optimizer, Optimizer) and optimizer.scales_loss:
        raise TypeError(
            f"dynamic_loss_scale() got {optimizer!r}, whose loss is scaled already; wrap the optimizer once."
        )
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            "dynamic_loss_scale() expected a fnloop.optim.Optimizer (adamw(...), chain(...), ...) "
            f"({got(optimizer)})."
        )
    for name, value, low in [("init_scale", init_scale, 0.0), ("growth_factor", growth_factor, 1.0)]:
        if type(value) not in (int, float) or not math.isfinite(value) or value <= low:
            raise ValueError(
                f"dynamic_loss_scale({name}=...) must be a finite number above {low} ({got(value)})."
            )
    if init_scale > _MOST:
        raise ValueError(
            f"dynamic_loss_scale(init_scale=...) must be a finite number above 0.0 and at most 2**64 "
            f"({got(init_scale)}): float16 gradients overflow far below that, so every step from there "
            "would be skipped while the scale backs off (past float32's 3.4e38 it never could). "
            "GradScaler's default is 2**16."
        )
    if type(backoff_factor) not in (int, float) or not 0.0 < backoff_factor < 1.0:
        raise ValueError(
            f"dynamic_loss_scale(backoff_factor=...) must lie strictly between 0 and 1 ({got(backoff_factor)})."
        )
    if type(growth_interval) is not int or growth_interval < 1:
        raise ValueError(
            f"dynamic_loss_scale(growth_interval=...) must be a positive int ({got(growth_interval)})."
        )
    return LossScaled(
        optimizer.transform,
        float(init_scale),
        float(growth_factor),
        float(backoff_factor),
        growth_interval,
        inner=optimizer,
    )


def _check_state(state: Any) -> None:
    if not isinstance(state, LossScaleState):
        raise TypeError(
            "a dynamic_loss_scale optimizer expected its own state, a LossScaleState, got a "
            f"{type(state).__name__}: build the state with the same optimizer "
            "(fnloop.init(model, fnloop.optim.dynamic_loss_scale(...), ...)) as the step."
        )


def _inverse(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale`` as ``GradScaler`` computes it (in float64, then float32)."""
    return scale.double().reciprocal().float()


def _unscaled(grads: Params, scale: torch.Tensor) -> Params:
    inverse = _inverse(scale)
    return {k: g * inverse for k, g in grads.items()}


def _peak(grads: Params, eager: bool = False) -> torch.Tensor:
    """A 0-d float32 that is finite exactly when every element of ``grads`` is (``kernel.all_finite``'s reductions)."""
    tensors = [g for g in grads.values() if g.numel()]
    if not tensors:
        return torch.zeros(())
    if eager:  # aminmax is fast op by op; the largest magnitude compiles better
        peaks = [torch.stack(torch.aminmax(g)).abs().amax().float() for g in tensors]
    else:
        peaks = [torch.linalg.vector_norm(g, math.inf).float() for g in tensors]
    return torch.stack(peaks).amax()
