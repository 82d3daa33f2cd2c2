"""Adam's scaling: the first and second moments, bias-corrected, with the numbers of ``torch.optim.Adam``."""

from __future__ import annotations

import math
from typing import NamedTuple

import attrs
import torch

from fnloop.optim._base import (
    GradientTransformation,
    Params,
    _number,
    check_keys,
    zero_count,
)

__all__ = ["ScaleByAdamState", "scale_by_adam"]

_STATE_FIX = "Pass the state that init() or the previous update() returned for these params."


def _log(beta: float) -> float:
    return math.log(beta) if beta > 0.0 else -math.inf  # exp(t * -inf) is 0 == 0.0**t for t >= 1


class ScaleByAdamState(NamedTuple):
    """State of ``scale_by_adam``.

    Attributes:
        step: 0-d int64, how many updates have been made (torch's ``step``).
        mu: first moments (torch's ``exp_avg``), one per parameter.
        nu: second moments (torch's ``exp_avg_sq``), one per parameter.
    """

    step: torch.Tensor
    mu: Params
    nu: Params


@attrs.frozen(repr=False)
class _ScaleByAdam:
    b1: float
    b2: float
    eps: float
    fused: bool = True
    """Whether an update in place may run ``adam``'s or ``adamw``'s chain with torch's fused kernel (``_fused.py``)."""

    def init(self, params: Params, /) -> ScaleByAdamState:
        mu = {k: torch.zeros_like(p) for k, p in params.items()}
        nu = {k: torch.zeros_like(p) for k, p in params.items()}
        return ScaleByAdamState(zero_count(params), mu, nu)

    def update(
        self, updates: Params, state: ScaleByAdamState, params: Params, iteration: torch.Tensor, /
    ) -> tuple[Params, ScaleByAdamState]:
        check_keys("opt_state.mu", state.mu, updates, _STATE_FIX)
        check_keys("opt_state.nu", state.nu, updates, _STATE_FIX)
        mu = {k: torch.lerp(state.mu[k], u, 1 - self.b1) for k, u in updates.items()}
        nu = {k: torch.addcmul(state.nu[k] * self.b2, u, u, value=1 - self.b2) for k, u in updates.items()}
        step = state.step + 1
        # Bias corrections in float64, as torch.optim.Adam computes them in Python floats,
        # then rounded to the moments' compute dtype, as torch rounds a Python scalar
        # operand. b**t is written exp(t * log b) (equal to float64 rounding): inductor's
        # CPU code computes a scalar holding an exp once, where it recomputed two float64
        # pows for every vector of every parameter, 20% of a 2048-wide step.
        t = step.to(torch.float64)
        correction1 = 1 - torch.exp(t * _log(self.b1))
        correction2_sqrt = (1 - torch.exp(t * _log(self.b2))).sqrt()
        rounded: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        out = {}
        for k in updates:
            dtype = torch.promote_types(mu[k].dtype, torch.float32)
            if dtype not in rounded:
                rounded[dtype] = (correction1.to(dtype), correction2_sqrt.to(dtype))
            c1, c2 = rounded[dtype]
            out[k] = mu[k] / (nu[k].sqrt() / c2 + self.eps) / c1
        return out, ScaleByAdamState(step, mu, nu)

    def update_(
        self, updates: Params, state: ScaleByAdamState, params: Params, iteration: torch.Tensor, /
    ) -> Params:
        check_keys("opt_state.mu", state.mu, updates, _STATE_FIX)
        check_keys("opt_state.nu", state.nu, updates, _STATE_FIX)
        if not updates:
            state.step.add_(1)
            return updates
        keys = list(updates)
        us, mus, nus = [updates[k] for k in keys], [state.mu[k] for k in keys], [state.nu[k] for k in keys]
        torch._foreach_lerp_(mus, us, 1 - self.b1)
        torch._foreach_mul_(nus, self.b2)
        torch._foreach_addcmul_(nus, us, us, value=1 - self.b2)
        state.step.add_(1)
        t = state.step.to(torch.float64)
        correction1 = 1 - torch.exp(t * _log(self.b1))
        correction2_sqrt = (1 - torch.exp(t * _log(self.b2))).sqrt()
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, mu in enumerate(mus):
            by_dtype.setdefault(torch.promote_types(mu.dtype, torch.float32), []).append(i)
        for dtype, group in by_dtype.items():
            # The denominator is made in the updates' own tensors (no allocation: a fresh
            # tensor the size of the state costs page faults on every step), then mu / it.
            out = [us[i] for i in group]
            torch._foreach_copy_(out, [nus[i] for i in group])
            torch._foreach_sqrt_(out)
            torch._foreach_div_(out, correction2_sqrt.to(dtype))
            torch._foreach_add_(out, self.eps)
            for i, u in zip(group, out):
                torch.div(mus[i], u, out=u)
            torch._foreach_div_(out, correction1.to(dtype))
        return updates

    def __repr__(self) -> str:
        fused = "" if self.fused else ", fused=False"
        return f"scale_by_adam(betas=({self.b1!r}, {self.b2!r}), eps={self.eps!r}{fused})"


def scale_by_adam(
    betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, *, fused: bool = True
) -> GradientTransformation:
    """Rescale updates by Adam's bias-corrected moments: ``m_hat / (sqrt(v_hat) + eps)``.

    Args:
        betas: decay rates of the first and second moments, each in ``[0, 1)``.
        eps: added to the denominator; non-negative.
        fused: in ``adam``'s and ``adamw``'s chains, let the eager step
            (``train_step(..., compile=False)``) update with torch's fused
            kernel, the numbers of ``torch.optim.AdamW(fused=True)``; ``False``:
            with this formula, op by op (see ``adamw``).

    Returns:
        A transformation whose state is a ``ScaleByAdamState``.

    Raises:
        ValueError: ``betas`` is not a pair in ``[0, 1)``, or ``eps`` is negative.

    Examples:
        >>> adam = scale_by_adam()
        >>> p = {"w": torch.zeros(2)}
        >>> adam.update({"w": torch.tensor([0.5, -2.0])}, adam.init(p), p, torch.tensor(0))[0]
        {'w': tensor([ 1.0000, -1.0000])}
    """
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(
            f"'betas' must be a pair (beta1, beta2) of floats in [0, 1) (got {betas!r}); "
            "for example betas=(0.9, 0.999)."
        )
    b1 = _number("betas[0]", betas[0], below=1.0)
    b2 = _number("betas[1]", betas[1], below=1.0)
    return _ScaleByAdam(b1, b2, _number("eps", eps), bool(fused))
