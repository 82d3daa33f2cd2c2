"""The ready optimizers, ``sgd``, ``adam`` and ``adamw``, each a chain of transformations.

Their numbers match ``torch.optim.SGD``, ``Adam`` and ``AdamW`` (up to float
rounding) on the same problem, schedules included.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fnloop.optim._adam import scale_by_adam
from fnloop.optim._base import GradientTransformation, LearningRate, Optimizer, _number
from fnloop.optim._combining import chain
from fnloop.optim._learning_rate import scale_by_learning_rate
from fnloop.optim._transforms import add_decayed_weights, trace

__all__ = ["adam", "adamw", "exclude_bias_and_norm", "sgd"]

DecayMask = Callable[[str, torch.Tensor], bool]


def exclude_bias_and_norm(name: str, tensor: torch.Tensor) -> bool:
    """A ``decay_mask`` that decays weights with 2 or more dims, not biases or norm scales.

    Biases and the weights of normalization layers are 1-d (``ndim <= 1``), so
    the usual "no weight decay on biases and norms" needs no names.

    Args:
        name: the parameter's name (unused).
        tensor: the parameter.

    Returns:
        ``True`` if the parameter should be decayed.

    Examples:
        >>> exclude_bias_and_norm("fc.weight", torch.zeros(3, 2))
        True
        >>> exclude_bias_and_norm("fc.bias", torch.zeros(3))
        False
    """
    return tensor.ndim >= 2


def _decay(weight_decay: float, decay_mask: DecayMask | None) -> list[GradientTransformation]:
    value = _number("weight_decay", weight_decay)
    if not isinstance(value, torch.Tensor) and value == 0.0:  # an injected one may vary: always decay
        return []
    return [add_decayed_weights(weight_decay, decay_mask=decay_mask)]


def sgd(
    lr: LearningRate,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    *,
    decay_mask: DecayMask | None = None,
) -> Optimizer:
    """Stochastic gradient descent, with the options and numbers of ``torch.optim.SGD``.

    Args:
        lr: a non-negative float, or a schedule ``iteration -> lr``.
        momentum: momentum factor; 0 for none.
        dampening: dampening of the momentum.
        weight_decay: L2 penalty added to the gradients.
        nesterov: use Nesterov momentum.
        decay_mask: ``(name, tensor) -> bool``, true for the parameters that get
            weight decay; ``None`` decays all (see ``exclude_bias_and_norm``).

    Returns:
        The optimizer: ``chain(add_decayed_weights, trace, scale_by_learning_rate)``,
        leaving out the stages that would do nothing.

    Raises:
        TypeError: ``lr`` is neither a number nor a schedule.
        ValueError: a negative setting, or Nesterov without momentum or with dampening.

    Examples:
        >>> opt = sgd(0.1, momentum=0.9)
        >>> params = {"w": torch.tensor([1.0])}
        >>> new, state = opt.update({"w": torch.tensor([2.0])}, opt.init(params), params, torch.tensor(0))
        >>> new
        {'w': tensor([0.8000])}
    """
    step = scale_by_learning_rate(lr)
    momentum, dampening = _number("momentum", momentum), _number("dampening", dampening)
    moves = isinstance(momentum, torch.Tensor) or momentum or nesterov  # an injected momentum may vary
    moving = [trace(momentum, dampening=dampening, nesterov=nesterov)] if moves else []
    return Optimizer(chain(*_decay(weight_decay, decay_mask), *moving, step))


def adam(
    lr: LearningRate,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    decay_mask: DecayMask | None = None,
    fused: bool = True,
) -> Optimizer:
    """Adam, with the numbers of ``torch.optim.Adam``: weight decay is L2, added to the gradients.

    Args:
        lr: a non-negative float, or a schedule ``iteration -> lr``.
        betas: decay rates of the first and second moments, each in ``[0, 1)``.
        eps: added to the denominator.
        weight_decay: L2 penalty added to the gradients before the moments.
        decay_mask: ``(name, tensor) -> bool``, true for the parameters that get
            weight decay; ``None`` decays all (see ``exclude_bias_and_norm``).
        fused: the eager step (``train_step(..., compile=False)``) updates with
            torch's fused kernel, the numbers of ``torch.optim.Adam(fused=True)``
            bit for bit; ``False``: with this chain's formula, op by op, as
            ``update`` and the compiled step compute it (see ``adamw``).

    Returns:
        The optimizer: ``chain(add_decayed_weights, scale_by_adam, scale_by_learning_rate)``.

    Raises:
        TypeError: ``lr`` is neither a number nor a schedule.
        ValueError: a negative setting, or ``betas`` not a pair in ``[0, 1)``.

    Examples:
        >>> opt = adam(0.1)
        >>> params = {"w": torch.tensor([1.0])}
        >>> new, state = opt.update({"w": torch.tensor([5.0])}, opt.init(params), params, torch.tensor(0))
        >>> new, state[0].step
        ({'w': tensor([0.9000])}, tensor(1))
    """
    step = scale_by_learning_rate(lr)
    return Optimizer(chain(*_decay(weight_decay, decay_mask), scale_by_adam(betas, eps, fused=fused), step))


def adamw(
    lr: LearningRate,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    *,
    decay_mask: DecayMask | None = None,
    fused: bool = True,
) -> Optimizer:
    """AdamW, with the numbers of ``torch.optim.AdamW``: decoupled decay ``p -= lr * wd * p``.

    Args:
        lr: a non-negative float, or a schedule ``iteration -> lr``.
        betas: decay rates of the first and second moments, each in ``[0, 1)``.
        eps: added to the denominator.
        weight_decay: decoupled weight decay, scaled by the learning rate.
        decay_mask: ``(name, tensor) -> bool``, true for the parameters that get
            weight decay; ``None`` decays all. ``decay_mask=exclude_bias_and_norm``
            spares biases and norm weights.
        fused: the eager step (``train_step(..., compile=False)``) updates
            with torch's fused kernel (one pass over each tensor, 6x faster
            than the chain's dozen op by op), the numbers of
            ``torch.optim.AdamW(fused=True)`` bit for bit; ``False``: with the
            chain's formula, op by op, the bits of ``update``. The compiled
            step runs the chain's formula either way (inductor fuses it); the
            two agree to rounding.

    Returns:
        The optimizer: ``chain(scale_by_adam, add_decayed_weights, scale_by_learning_rate)``.

    Raises:
        TypeError: ``lr`` is neither a number nor a schedule.
        ValueError: a negative setting, or ``betas`` not a pair in ``[0, 1)``.

    Examples:
        >>> from fnloop.optim import cosine
        >>> opt = adamw(cosine(1e-3, max_iter=100), weight_decay=0.05, decay_mask=exclude_bias_and_norm)
        >>> params = {"w": torch.ones(2, 2), "b": torch.zeros(2)}
        >>> grads = {"w": torch.ones(2, 2), "b": torch.ones(2)}
        >>> new, state = opt.update(grads, opt.init(params), params, torch.tensor(0))
        >>> [round(v.item(), 6) for v in (new["w"][0, 0], new["b"][0])]  # w also decays, b does not
        [0.99895, -0.001]
    """
    step = scale_by_learning_rate(lr)
    return Optimizer(chain(scale_by_adam(betas, eps, fused=fused), *_decay(weight_decay, decay_mask), step))
