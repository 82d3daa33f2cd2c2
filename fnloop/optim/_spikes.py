"""Skipping loss spikes: ``skip_spikes`` (OLMo-core's ``SkipStepOptimizer`` as a pure transformation).

A step whose loss or gradient norm lies more than ``threshold`` standard
deviations above the mean of the last ``window`` accepted steps leaves the
parameters and the optimizer's state as they were. The windows, the counts
and the step's loss live in the optimizer state, so a skip is saved, resumed
and replayed with the run; the decision is made inside the step's graph.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import attrs
import torch

from fnloop._core.messages import got
from fnloop.optim._base import (
    Optimizer,
    OptState,
    Params,
    SquaresSum,
    Sum,
    first_device,
    kept_unless,
    over_shards,
)

__all__ = ["SpikeState", "SkipsSpikes", "skip_spikes"]


class SpikeState(NamedTuple):
    """The state of a ``skip_spikes`` optimizer.

    Args:
        inner: the wrapped optimizer's state (untouched by a skipped step).
        losses: the last ``window`` accepted steps' losses (float32, a ring).
        norms: their gradient norms.
        seen: accepted steps so far (int64); the ring's next slot is ``seen % window``.
        in_a_row: steps skipped since the last accepted one (int64).
        skipped: steps skipped in the run (int64).
        loss: the loss of the step being taken, put here by the step before the update.
    """

    inner: OptState
    losses: torch.Tensor
    norms: torch.Tensor
    seen: torch.Tensor
    in_a_row: torch.Tensor
    skipped: torch.Tensor
    loss: torch.Tensor


@attrs.frozen(repr=False)
class SkipsSpikes(Optimizer):
    """An optimizer that skips steps whose loss or gradient norm is an outlier; built by ``skip_spikes``."""

    window: int = 128
    threshold: float = 6.0
    warmup: int = 16
    summed: Sum | None = attrs.field(default=None, eq=False)

    def init(self, params: Params, /) -> SpikeState:
        device = first_device(params)
        zeros = torch.zeros(self.window, dtype=torch.float32, device=device)
        count = torch.zeros((), dtype=torch.int64, device=device)
        return SpikeState(
            self.transform.init(params),
            zeros,
            zeros.clone(),
            count,
            count.clone(),
            count.clone(),
            torch.zeros((), dtype=torch.float32, device=device),
        )

    def update(
        self, grads: Params, state: OptState, params: Params, iteration: torch.Tensor, /
    ) -> tuple[Params, SpikeState]:
        _check_state(state)
        spike, norm = self._spike(grads, state)
        new_params, inner = Optimizer(self.transform).update(grads, state.inner, params, iteration)
        kept, inner = kept_unless(spike, new_params, params, inner, state.inner)
        return kept, self._next(state, inner, spike, norm)

    def update_(self, grads: Params, state: OptState, params: Params, iteration: torch.Tensor, /) -> None:
        _check_state(state)
        spike, norm = self._spike(grads, state)
        if not bool(spike):
            Optimizer(self.transform).update_(grads, state.inner, params, iteration)
        new = self._next(state, state.inner, spike, norm)
        for old, value in zip(state[1:], new[1:]):
            old.copy_(value)

    def over_shards(self, sum_: Sum, /) -> SkipsSpikes:
        return attrs.evolve(self, transform=over_shards(self.transform, sum_), summed=sum_)

    def inner_state(self, state: OptState) -> OptState:
        return state.inner if isinstance(state, SpikeState) else state

    def given_loss(self, state: OptState, loss: torch.Tensor) -> OptState:
        """``state`` holding the step's ``loss``, which the update judges."""
        _check_state(state)
        return state._replace(loss=loss.detach().to(state.loss.dtype).reshape(state.loss.shape))

    def loss_slot(self, state: OptState) -> torch.Tensor | None:
        return state.loss

    def metrics(self, before: Any, after: OptState) -> dict[str, torch.Tensor]:
        """``spikes`` (the steps skipped in the run, a running count) and ``spikes_in_a_row``."""
        # Copies: the compiled step writes the new state into the tensors the state held.
        return {"spikes": after.skipped.clone(), "spikes_in_a_row": after.in_a_row.clone()}

    def _spike(self, grads: Params, state: SpikeState) -> tuple[torch.Tensor, torch.Tensor]:
        """Whether this step is an outlier, and its gradient norm (over every rank, when sharded)."""
        if isinstance(self.summed, SquaresSum):  # a world-size-invariant step's: the same bits at any W
            total = self.summed.squares(grads, torch.float32).sum()
        else:
            squares = [
                torch.linalg.vector_norm(g, dtype=torch.float32).square() for g in grads.values() if g.numel()
            ]
            total = torch.stack(squares).sum() if squares else torch.zeros((), device=state.loss.device)
            if self.summed is not None:
                total = self.summed(total)
        norm = total.sqrt()
        n = state.seen.clamp(max=self.window)
        filled = torch.arange(self.window, device=n.device) < n
        count = n.clamp(min=1).to(torch.float32)

        def high(values: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
            mean = torch.where(filled, values, 0.0).sum() / count
            var = torch.where(filled, (values - mean).square(), 0.0).sum() / count
            return value > mean + self.threshold * var.sqrt()

        ready = n >= self.warmup
        # A loss or norm that is not finite is no spike here: the step's own guard judges those.
        spike = ready & (high(state.losses, state.loss) | high(state.norms, norm))
        return spike, norm

    def _next(self, state: SpikeState, inner: Any, spike: torch.Tensor, norm: torch.Tensor) -> SpikeState:
        slot = torch.arange(self.window, device=state.seen.device) == state.seen % self.window
        take = slot & ~spike
        return SpikeState(
            inner,
            torch.where(take, state.loss, state.losses),
            torch.where(take, norm, state.norms),
            state.seen + (~spike).to(torch.int64),
            torch.where(spike, state.in_a_row + 1, torch.zeros_like(state.in_a_row)),
            state.skipped + spike.to(torch.int64),
            state.loss,
        )

    def __repr__(self) -> str:
        return (
            f"skip_spikes({Optimizer(self.transform)!r}, window={self.window}, "
            f"threshold={self.threshold}, warmup={self.warmup})"
        )


_WIDEST = 100_000
"""The widest window: its losses and norms live in the state (saved with every checkpoint) and each step reads them."""


def skip_spikes(
    optimizer: Optimizer, *, window: int = 128, threshold: float = 6.0, warmup: int = 16
) -> SkipsSpikes:
    """``optimizer``, skipping each step whose loss or gradient norm is an outlier against a running window.

    A step is skipped (the parameters and ``optimizer``'s state left as they
    were) when its loss, or the global L2 norm of its gradients, exceeds the
    mean of the last ``window`` accepted steps' by more than ``threshold``
    standard deviations (a z-score above ``threshold``), once ``warmup``
    steps have been accepted. A skipped step's values do not enter the window.
    This is OLMo-core's ``SkipStepOptimizer`` rule. The windows and counts are
    in the state (``SpikeState``): saved, resumed and replayed with it. Each
    step records ``spikes`` (the steps skipped so far) and ``spikes_in_a_row``;
    ``fnloop.hooks.stop_on_spikes(n)`` stops the run after ``n`` in a row.

    With ``dynamic_loss_scale``, wrap this one in it
    (``dynamic_loss_scale(skip_spikes(adamw(...)))``): the norm judged is then
    that of the unscaled gradients, and an overflow is not counted here.

    Args:
        optimizer: the optimizer to wrap.
        window: how many accepted steps the mean and deviation are taken over; 2 to 100,000.
        threshold: the z-score above which a step is skipped; positive.
        warmup: accepted steps before any step is judged; between 2 and ``window``.

    Examples:
        >>> import fnloop as fl
        >>> opt = fl.optim.skip_spikes(fl.optim.sgd(0.1), window=4, threshold=3.0, warmup=2)
        >>> params = {"w": torch.zeros(1)}
        >>> state = opt.init(params)
        >>> for i, g in enumerate([1.0, 1.1, 0.9, 50.0]):
        ...     state = opt.given_loss(state, torch.tensor(1.0))
        ...     params, state = opt.update({"w": torch.tensor([g])}, state, params, torch.tensor(i))
        >>> int(state.skipped), params["w"]  # the norm of 50 was skipped
        (1, tensor([-0.3000]))
    """
    if not isinstance(optimizer, Optimizer) or isinstance(optimizer, SkipsSpikes):
        raise TypeError(
            "skip_spikes() expected a fnloop.optim.Optimizer that does not skip spikes already "
            f"({got(optimizer)})."
        )
    if optimizer.scales_loss:
        raise TypeError(
            f"skip_spikes() got {optimizer!r}; wrap the plain optimizer, and put dynamic_loss_scale "
            "outside: dynamic_loss_scale(skip_spikes(adamw(...)))."
        )
    if type(window) is not int or not 2 <= window <= _WIDEST:
        raise ValueError(
            f"skip_spikes(window=...) must be an int from 2 to {_WIDEST:,} ({got(window)}): the window's "
            "losses and norms are kept in the state, and every step reads them all (OLMo's is 128)."
        )
    if type(threshold) not in (int, float) or not math.isfinite(threshold) or threshold <= 0:
        raise ValueError(f"skip_spikes(threshold=...) must be a positive number ({got(threshold)}).")
    if type(warmup) is not int or not 2 <= warmup <= window:
        raise ValueError(f"skip_spikes(warmup=...) must be an int from 2 to window={window} ({got(warmup)}).")
    return SkipsSpikes(optimizer.transform, window, float(threshold), warmup)


def _check_state(state: Any) -> None:
    if not isinstance(state, SpikeState):
        raise TypeError(
            "a skip_spikes optimizer expected its own state, a SpikeState, got a "
            f"{type(state).__name__}: build the state with the same optimizer "
            "(fnloop.init(model, fnloop.optim.skip_spikes(...), ...)) as the step."
        )
