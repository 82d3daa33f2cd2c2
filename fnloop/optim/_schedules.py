"""Learning-rate schedules: pure maps from the iteration tensor to a 0-d float64 tensor.

A schedule is written with torch ops only, so it traces into the compiled step
and a changing learning rate never causes a recompile. Each is a small frozen
record: it compares equal, pickles, and its repr is the call that builds it.
Each equals the matching ``torch.optim.lr_scheduler`` stepped once per
iteration; schedule(t) is the learning rate of step ``t`` (0-based).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch

from fnloop._core.messages import got
from fnloop.optim._base import Schedule, is_setting

__all__ = ["constant", "cosine", "join", "linear_warmup", "multistep", "warmup", "warmup_multistep"]


def _as_iteration(iteration: torch.Tensor | int) -> torch.Tensor:
    return torch.as_tensor(iteration)


def _float(name: str, value: object) -> float:
    if is_setting(value):  # a state's hyperparameter (fnloop.optim.inject), checked as a float there
        return value  # type: ignore[return-value]
    if type(value) not in (int, float) or not math.isfinite(value):  # type: ignore[arg-type]
        raise TypeError(f"'{name}' must be a finite float ({got(value)}).")
    if value < 0:  # type: ignore[operator]
        # A schedule's values are learning rates (or factors of one): negative, they climb the loss.
        raise ValueError(f"'{name}' must be at least 0 ({got(value)}).")
    return float(value)  # type: ignore[arg-type]


def _count(name: str, value: object, *, positive: bool = False) -> int:
    low = 1 if positive else 0
    if type(value) is not int or value < low:
        kind = "positive" if positive else "non-negative"
        raise ValueError(f"'{name}' must be a {kind} int ({got(value)}).")
    return value


def _check_schedule(name: str, value: object) -> Schedule:
    if not callable(value):
        raise TypeError(
            f"'{name}' must be a schedule, a function iteration -> value such as "
            f"fnloop.optim.cosine(...) ({got(value)})."
        )
    return value  # type: ignore[return-value]


@attrs.frozen(repr=False)
class _Constant:
    value: float

    def __call__(self, iteration: torch.Tensor | int) -> torch.Tensor:
        device = _as_iteration(iteration).device
        if isinstance(self.value, torch.Tensor):  # injected: a state's hyperparameter
            return self.value.to(torch.float64, device)
        return torch.full((), self.value, dtype=torch.float64, device=device)

    def __repr__(self) -> str:
        return f"constant({self.value!r})"


def constant(value: float) -> Schedule:
    """The same value at every step.

    Args:
        value: the value.

    Returns:
        A schedule.

    Examples:
        >>> constant(0.1)(torch.tensor(7))
        tensor(0.1000, dtype=torch.float64)
    """
    return _Constant(_float("value", value))


@attrs.frozen(repr=False)
class _Warmup:
    schedule: Schedule
    warmup_iters: int
    factor: float
    method: str

    def __call__(self, iteration: torch.Tensor | int) -> torch.Tensor:
        iteration = _as_iteration(iteration)
        value = self.schedule(iteration)
        if self.warmup_iters == 0:
            return value
        if self.method == "constant":
            factor = torch.full_like(value, self.factor)
        else:
            alpha = iteration.to(torch.float64) / self.warmup_iters
            factor = self.factor * (1 - alpha) + alpha
        return torch.where(iteration >= self.warmup_iters, value, value * factor)

    def __repr__(self) -> str:
        return f"warmup({self.schedule!r}, {self.warmup_iters!r}, factor={self.factor!r}, method={self.method!r})"


def warmup(
    schedule: Schedule, warmup_iters: int, *, factor: float = 0.001, method: str = "linear"
) -> Schedule:
    """Multiply ``schedule`` by a warmup factor for the first ``warmup_iters`` steps.

    The factor is detectron2's: ``factor`` itself with ``method="constant"``, or
    with ``method="linear"`` ``factor * (1 - alpha) + alpha`` where ``alpha =
    iteration / warmup_iters``; it is 1 from step ``warmup_iters`` on.

    Args:
        schedule: the schedule to warm up.
        warmup_iters: how many steps the warmup lasts; 0 for none.
        factor: the factor at step 0.
        method: ``"linear"`` or ``"constant"``.

    Returns:
        A schedule.

    Raises:
        ValueError: an unknown method, or a negative ``warmup_iters``.

    Examples:
        >>> s = warmup(constant(1.0), 4, factor=0.2)
        >>> [round(float(s(t)), 2) for t in range(6)]
        [0.2, 0.4, 0.6, 0.8, 1.0, 1.0]
    """
    if method not in ("linear", "constant"):
        raise ValueError(f"warmup method must be 'linear' or 'constant' (got {method!r}).")
    return _Warmup(
        _check_schedule("schedule", schedule),
        _count("warmup_iters", warmup_iters),
        _float("factor", factor),
        method,
    )


def linear_warmup(base: float, warmup_iters: int, start_factor: float = 0.001) -> Schedule:
    """Rise linearly from ``base * start_factor`` to ``base`` over ``warmup_iters`` steps, then stay.

    Equals ``torch.optim.lr_scheduler.LinearLR(start_factor=start_factor,
    end_factor=1.0, total_iters=warmup_iters)`` (whose default start factor is
    1/3, not 0.001).

    Args:
        base: the value after warmup.
        warmup_iters: length of the warmup, in steps.
        start_factor: the fraction of ``base`` at step 0.

    Returns:
        A schedule.

    Raises:
        ValueError: a negative ``warmup_iters``.

    Examples:
        >>> s = linear_warmup(0.1, 2, start_factor=0.5)
        >>> [round(float(s(t)), 3) for t in range(4)]
        [0.05, 0.075, 0.1, 0.1]
    """
    return warmup(constant(base), warmup_iters, factor=start_factor)


@attrs.frozen(repr=False)
class _Cosine:
    base: float
    max_iter: int
    final: float

    def __call__(self, iteration: torch.Tensor | int) -> torch.Tensor:
        t = _as_iteration(iteration).to(torch.float64).clamp(max=self.max_iter)
        return self.final + (self.base - self.final) * (1 + torch.cos(math.pi * t / self.max_iter)) / 2

    def __repr__(self) -> str:
        return f"cosine({self.base!r}, {self.max_iter!r}, final={self.final!r})"


def cosine(base: float, max_iter: int, final: float = 0.0) -> Schedule:
    """Half a cosine from ``base`` at step 0 to ``final`` at step ``max_iter``, then ``final``.

    Equals ``CosineAnnealingLR(T_max=max_iter, eta_min=final)`` up to
    ``max_iter``; after it, this stays at ``final`` where torch's rises again.

    Args:
        base: the value at step 0.
        max_iter: the step at which ``final`` is reached; positive.
        final: the value from ``max_iter`` on.

    Returns:
        A schedule.

    Raises:
        ValueError: ``max_iter`` is not positive.

    Examples:
        >>> s = cosine(1.0, 4)
        >>> [round(float(s(t)), 3) for t in range(6)]
        [1.0, 0.854, 0.5, 0.146, 0.0, 0.0]
    """
    return _Cosine(_float("base", base), _count("max_iter", max_iter, positive=True), _float("final", final))


@attrs.frozen(repr=False)
class _MultiStep:
    base: float
    milestones: tuple[int, ...]
    gamma: float

    def __call__(self, iteration: torch.Tensor | int) -> torch.Tensor:
        iteration = _as_iteration(iteration)
        passed = torch.zeros((), dtype=torch.float64, device=iteration.device)
        for milestone in self.milestones:
            passed = passed + (iteration >= milestone).to(torch.float64)
        return self.base * self.gamma**passed

    def __repr__(self) -> str:
        return f"multistep({self.base!r}, {self.milestones!r}, gamma={self.gamma!r})"


def _milestones(milestones: Sequence[int], name: str = "milestones") -> tuple[int, ...]:
    values = tuple(milestones) if isinstance(milestones, Sequence) else None
    if (
        values is None
        or any(type(m) is not int or m <= 0 for m in values)
        or list(values) != sorted(set(values))
    ):
        raise ValueError(
            f"'{name}' must be increasing positive ints, the steps where the value changes "
            f"(got {milestones!r}). Sort them and remove duplicates."
        )
    return values


def multistep(base: float, milestones: Sequence[int], gamma: float = 0.1) -> Schedule:
    """``base``, multiplied by ``gamma`` at each milestone passed: ``base * gamma ** k``.

    ``k`` is the number of milestones ``<= iteration``. Equals
    ``MultiStepLR(milestones=milestones, gamma=gamma)``.

    Args:
        base: the value before the first milestone.
        milestones: increasing positive steps at which the value drops.
        gamma: the factor applied at each milestone.

    Returns:
        A schedule.

    Raises:
        ValueError: ``milestones`` are not increasing positive ints.

    Examples:
        >>> s = multistep(1.0, [2, 4], gamma=0.5)
        >>> [float(s(t)) for t in range(5)]
        [1.0, 1.0, 0.5, 0.5, 0.25]
    """
    return _MultiStep(_float("base", base), _milestones(milestones), _float("gamma", gamma))


def warmup_multistep(
    base: float,
    milestones: Sequence[int],
    gamma: float = 0.1,
    warmup_iters: int = 1000,
    warmup_factor: float = 0.001,
    warmup_method: str = "linear",
) -> Schedule:
    """detectron2's ``WarmupMultiStepLR``: a warmup factor times ``multistep``.

    The value at step ``t`` is ``base * warmup_factor(t) * gamma ** k(t)``,
    exactly as detectron2 computes it; see ``warmup`` and ``multistep``.

    Args:
        base: the learning rate after warmup and before the first milestone.
        milestones: increasing positive steps at which the value drops.
        gamma: the factor applied at each milestone.
        warmup_iters: length of the warmup, in steps.
        warmup_factor: the warmup factor at step 0.
        warmup_method: ``"linear"`` or ``"constant"``.

    Returns:
        A schedule.

    Raises:
        ValueError: bad milestones, a negative ``warmup_iters`` or an unknown method.

    Examples:
        >>> s = warmup_multistep(1.0, [3], gamma=0.1, warmup_iters=2, warmup_factor=0.5)
        >>> [round(float(s(t)), 3) for t in range(4)]
        [0.5, 0.75, 1.0, 0.1]
    """
    return warmup(
        multistep(base, milestones, gamma), warmup_iters, factor=warmup_factor, method=warmup_method
    )


@attrs.frozen(repr=False)
class _Join:
    schedules: tuple[Schedule, ...]
    boundaries: tuple[int, ...]

    def __call__(self, iteration: torch.Tensor | int) -> torch.Tensor:
        iteration = _as_iteration(iteration)
        starts = (0, *self.boundaries)
        # Every piece is evaluated; clamping keeps the unselected ones at valid iterations.
        value = self.schedules[-1]((iteration - starts[-1]).clamp(min=0))
        for schedule, start, end in reversed(list(zip(self.schedules, starts, self.boundaries))):
            value = torch.where(iteration < end, schedule((iteration - start).clamp(min=0)), value)
        return value

    def __repr__(self) -> str:
        return f"join({list(self.schedules)!r}, {list(self.boundaries)!r})"


def join(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """Run ``schedules`` one after another, each restarting its count at its boundary.

    Schedule ``i`` runs from ``boundaries[i - 1]`` (0 for the first) and sees
    ``iteration - boundaries[i - 1]``, as ``SequentialLR(milestones=boundaries)``
    and ``optax.join_schedules`` do.

    Args:
        schedules: ``n`` schedules.
        boundaries: ``n - 1`` increasing positive steps at which to switch.

    Returns:
        A schedule.

    Raises:
        TypeError: an entry is not callable.
        ValueError: the lengths do not match, or the boundaries are not increasing.

    Examples:
        >>> s = join([linear_warmup(1.0, 2, start_factor=0.5), cosine(1.0, 2)], [2])
        >>> [round(float(s(t)), 3) for t in range(5)]
        [0.5, 0.75, 1.0, 0.5, 0.0]
    """
    schedules = tuple(_check_schedule(f"schedules[{i}]", s) for i, s in enumerate(schedules))
    if not schedules or len(boundaries) != len(schedules) - 1:
        raise ValueError(
            f"join expected one boundary fewer than schedules (got {len(schedules)} schedules "
            f"and boundaries {list(boundaries)!r})."
        )
    bounds = _milestones(boundaries, "boundaries") if boundaries else ()
    return schedules[0] if len(schedules) == 1 else _Join(schedules, bounds)
