"""The learning rate: the stage that scales updates by it, and the check of what is given as one.

A learning rate is a number or a schedule (``fnloop.optim.cosine`` and the
like, computed inside the graph from the iteration tensor); a torch scheduler
or optimizer given in its place is refused with the fnloop equivalent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch

from fnloop.optim._base import (
    EmptyState,
    GradientTransformation,
    LearningRate,
    Params,
    _number,
    is_setting,
)

__all__ = ["check_lr", "scale_by_learning_rate"]


# torch's schedulers and the fnloop schedule that gives the same learning rates.
_EQUIVALENTS = {
    "CosineAnnealingLR": "fnloop.optim.cosine(base, max_iter=T_max, final=eta_min)",
    "StepLR": "fnloop.optim.multistep(base, milestones=(step_size, 2 * step_size, ...), gamma=gamma)",
    "MultiStepLR": "fnloop.optim.multistep(base, milestones, gamma=gamma)",
    "LinearLR": "fnloop.optim.linear_warmup(base, warmup_iters=total_iters, start_factor=start_factor)",
    "ConstantLR": "fnloop.optim.warmup(fnloop.optim.constant(base), total_iters, factor=factor, "
    "method='constant')",
}

_SCHEDULES = (
    "fnloop schedules are functions of the iteration, traced into the step: fnloop.optim.cosine(...), "
    "warmup(...), multistep(...), linear_warmup(...), constant(...), or any function of the 0-d "
    "iteration tensor"
)


def _torch_lr_mistake(lr: object) -> str | None:
    """Why ``lr``, a torch scheduler or optimizer, is no learning rate, and the fix; ``None`` otherwise."""
    kind = type(lr)
    if isinstance(lr, torch.optim.Optimizer):
        return (
            f"'lr' must be a float or a fnloop schedule, not a torch.optim.{kind.__name__}; "
            "fnloop's optimizers take the learning rate itself, e.g. fnloop.optim.adamw(1e-3). "
            f"{_SCHEDULES}."
        )
    schedulers = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    if not isinstance(lr, schedulers):
        return None
    same = _EQUIVALENTS.get(kind.__name__)
    here = f" Here: {same}." if same else ""
    return (
        f"'lr' must be a float or a fnloop schedule, not a torch.optim.lr_scheduler.{kind.__name__}: "
        f"a torch scheduler changes a torch optimizer in place, and fnloop has none to change. "
        f"{_SCHEDULES}.{here}"
    )


def check_lr(lr: object) -> LearningRate:
    """``lr`` as a float or a schedule; raise if it is neither or is negative."""
    if (mistake := _torch_lr_mistake(lr)) is not None:
        raise TypeError(mistake)
    if is_setting(lr):  # a state's (inject); one given by hand is refused by fnloop.init
        return lr  # type: ignore[return-value]
    if isinstance(lr, torch.Tensor):
        raise TypeError(
            f"'lr' must be a float or a schedule, not a tensor (got {lr!r}). A tensor would "
            "be baked into the compiled graph; use a float, or fnloop.optim.constant(value); a learning rate that differs by member of a "
            "population is fnloop.optim.inject(...)'s."
        )
    return lr if callable(lr) else _number("lr", lr)  # type: ignore[return-value]


def _scheduled(schedule: Callable[[torch.Tensor], Any], iteration: torch.Tensor) -> Any:
    """``schedule(iteration)``, refused unless it is one number (a 0-d tensor, or a float)."""
    value = schedule(iteration)
    if isinstance(value, torch.Tensor) and value.dim() != 0:
        raise TypeError(
            f"the schedule {schedule!r:.80} must return a 0-d tensor, got one of shape "
            f"{tuple(value.shape)}; a learning rate is one number per step (return a 0-d tensor, e.g. "
            "torch.where(...) of 0-d tensors, or .reshape(()) a one-element result)."
        )
    return value


@attrs.frozen(repr=False)
class _ScaleByLearningRate:
    lr: LearningRate

    def init(self, params: Params, /) -> EmptyState:
        return EmptyState()

    def update(
        self, updates: Params, state: EmptyState, params: Params, iteration: torch.Tensor, /
    ) -> tuple[Params, EmptyState]:
        step = -_scheduled(self.lr, iteration) if callable(self.lr) else -self.lr
        return {k: u * step for k, u in updates.items()}, state

    def update_(
        self, updates: Params, state: EmptyState, params: Params, iteration: torch.Tensor, /
    ) -> Params:
        if updates:
            step = -_scheduled(self.lr, iteration) if callable(self.lr) else -self.lr
            torch._foreach_mul_(list(updates.values()), step)
        return updates

    def learning_rates(self, iteration: torch.Tensor, /) -> dict[str, torch.Tensor | float]:
        return {"lr": _scheduled(self.lr, iteration) if callable(self.lr) else self.lr}

    def __repr__(self) -> str:
        return f"scale_by_learning_rate({self.lr!r})"


def scale_by_learning_rate(lr: LearningRate) -> GradientTransformation:
    """Multiply updates by ``-lr``, turning a descent direction into a step.

    Args:
        lr: a non-negative float, or a schedule mapping the 0-d iteration
            tensor to the learning rate of that step.

    Returns:
        A stateless transformation (its state is ``EmptyState()``).

    Raises:
        TypeError: ``lr`` is neither a number nor callable.
        ValueError: ``lr`` is negative.

    Examples:
        >>> from fnloop.optim import constant
        >>> s = scale_by_learning_rate(constant(0.5))
        >>> s.update({"w": torch.ones(1)}, s.init({}), {}, torch.tensor(3))[0]
        {'w': tensor([-0.5000])}
    """
    return _ScaleByLearningRate(check_lr(lr))
