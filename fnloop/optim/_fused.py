"""torch's own fused Adam and AdamW kernels, for an update in place (the eager step's).

``adam`` and ``adamw`` are chains of pure stages; run op by op, those stages
read and write every parameter's tensors a dozen times a step, where
``torch._fused_adam_`` and ``torch._fused_adamw_`` make one pass (about 6x
faster for a ResNet-18 on one CPU thread: ``benchmarks/bench_models.py``).
``fused_update_`` recognizes the two chains and runs them with those kernels;
the numbers are then ``torch.optim.Adam(fused=True)``'s and
``torch.optim.AdamW(fused=True)``'s, bit for bit, not the pure formula's
(they agree to rounding). The compiled step always runs the pure formula,
which inductor fuses itself.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.utils import _pytree as pytree

from fnloop.optim._adam import _ScaleByAdam
from fnloop.optim._base import Optimizer, Params
from fnloop.optim._combining import _Chain
from fnloop.optim._learning_rate import _ScaleByLearningRate, _scheduled
from fnloop.optim._transforms import _AddDecayedWeights, _ClipByGlobalNorm, _mask_value

__all__ = ["fused_update", "fused_update_"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_DEVICES = ("cpu", "cuda")
_CLIPS = 1
"""How many ``clip_by_global_norm`` stages may come first: they run in place, then the kernel."""


def fused_update_(
    optimizer: Optimizer, grads: Params, state: Any, params: Params, iteration: torch.Tensor
) -> bool:
    """``optimizer.update_`` by torch's fused kernel, where ``optimizer`` is ``adam`` or ``adamw``; else ``False``.

    Returns whether it updated: the optimizer is ``adam(...)`` or
    ``adamw(...)`` as the library builds it (``fused=True``, the default),
    after at most one ``clip_by_global_norm`` (which runs first, in place), with
    numbers for settings, and every parameter a floating tensor on a CPU or
    CUDA device, its gradient and moments of its own dtype. Nothing is
    written otherwise: the caller then runs ``update_``.
    """
    plan = _fusable(optimizer)
    if plan is None or not params or type(state) is not tuple or len(state) != len(plan.stages):
        return False
    stages, adam_at, adam, decay, lr_stage, decoupled = plan
    moments = state[adam_at]
    if not _fits(params, grads, moments.mu, moments.nu) or moments.step.dtype != torch.int64:
        return False
    grads = {k: _laid_out(g, params[k]) for k, g in grads.items()}
    for clip, clipped in zip(stages[:_CLIPS], state):  # chain(clip_by_global_norm(c), adamw(...))
        if not isinstance(clip, _ClipByGlobalNorm):
            break
        grads = clip.update_(grads, clipped, params, iteration)
    lr = _scheduled(lr_stage.lr, iteration) if callable(lr_stage.lr) else lr_stage.lr
    moments.step.add_(1)
    groups: dict[tuple[torch.device, torch.dtype, float], list[str]] = {}
    for k, p in params.items():
        wd = 0.0
        if decay is not None and (decay.mask is None or _mask_value(decay.mask, k, p)):
            wd = decay.weight_decay
        groups.setdefault((p.device, p.dtype, wd), []).append(k)
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    for (device, _, wd), keys in groups.items():
        # As torch.optim's: the step a float32 tensor per parameter, counted before the kernel reads it.
        step = moments.step.to(device=device, dtype=torch.float32)
        # A schedule's rate stays a tensor, as torch.optim passes one: the host never waits for it.
        rate = lr.to(device) if isinstance(lr, torch.Tensor) else lr
        kernel(
            [params[k] for k in keys],
            [grads[k] for k in keys],
            [moments.mu[k] for k in keys],
            [moments.nu[k] for k in keys],
            [],
            [step] * len(keys),
            lr=rate,
            beta1=adam.b1,
            beta2=adam.b2,
            weight_decay=wd,
            eps=adam.eps,
            amsgrad=False,
            maximize=False,
        )
    return True


def fused_update(
    optimizer: Optimizer, grads: Params, state: Any, params: Params, iteration: torch.Tensor
) -> tuple[Params, Any] | None:
    """``optimizer.update`` by torch's fused kernel, on copies: ``(new_params, new_state)``, or ``None``.

    For the eager step's pure layouts of a whole state (statistics, transforms
    of the update stage), so that they update with the numbers of the step in
    place (``fused_update_``). ``None`` where that does not apply, and under
    ``vmap`` (a population's members), which the kernels cannot take. Never
    for a sharded state's chunks or world-size-invariant slices: the kernel's
    vectorized body and its scalar tail round differently, so the same
    elements cut into other chunks would come out in other bits.
    """
    if torch._C._are_functorch_transforms_active() or _fusable(optimizer) is None:
        return None
    new_params = {k: p.clone() for k, p in params.items()}
    new_state = pytree.tree_map(torch.clone, state)
    grads = {k: g.clone() for k, g in grads.items()}  # a clip scales them in place
    if not fused_update_(optimizer, grads, new_state, new_params, iteration):
        return None
    return new_params, new_state


class _Plan(NamedTuple):
    """Where ``adam``'s or ``adamw``'s stages sit in a chain, and how the kernel applies them."""

    stages: tuple[Any, ...]
    adam_at: int
    adam: _ScaleByAdam
    decay: _AddDecayedWeights | None
    lr_stage: _ScaleByLearningRate
    decoupled: bool


def _fusable(optimizer: Optimizer) -> _Plan | None:
    """The plan of ``optimizer``'s chain, if it is ``adam``'s or ``adamw``'s (after at most one clip)."""
    if type(optimizer) is not Optimizer or not isinstance(optimizer.transform, _Chain):
        return None
    return _plan(optimizer.transform.transforms)


def _plan(stages: tuple[Any, ...]) -> _Plan | None:
    """``adam``'s or ``adamw``'s stages at the end of ``stages``, after at most one clip: (Adam's index, Adam's, the decay, the lr's, decoupled)."""
    kinds = [type(s) for s in stages]
    clips = 0
    while clips < len(kinds) and kinds[clips] is _ClipByGlobalNorm:
        clips += 1
    if clips > _CLIPS:
        return None
    kinds = kinds[clips:]
    if kinds == [_ScaleByAdam, _ScaleByLearningRate]:
        adam_at, decay, decoupled = clips, None, True
    elif kinds == [_AddDecayedWeights, _ScaleByAdam, _ScaleByLearningRate]:
        adam_at, decay, decoupled = clips + 1, stages[clips], False
    elif kinds == [_ScaleByAdam, _AddDecayedWeights, _ScaleByLearningRate]:
        adam_at, decay, decoupled = clips, stages[clips + 1], True
    else:
        return None
    adam, lr_stage = stages[adam_at], stages[-1]
    numbers = [adam.b1, adam.b2, adam.eps] + ([decay.weight_decay] if decay is not None else [])
    if not adam.fused or any(type(x) is not float for x in numbers):  # an injected setting is a tensor
        return None
    if not callable(lr_stage.lr) and type(lr_stage.lr) is not float:
        return None
    return _Plan(stages, adam_at, adam, decay, lr_stage, decoupled)


def _laid_out(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``grad`` in ``param``'s memory layout: the fused kernels pair their tensors' elements by memory offset.

    ``torch.autograd.grad`` hands a gradient back in whatever layout its
    backward made: a convolution's weight gradient came back channels-last
    (strides ``(32, 1, 16, 8)`` for a weight of strides ``(32, 4, 2, 1)``), and
    the kernel then updated each weight with another element's gradient.
    ``param.grad`` never shows this: autograd's accumulation copies a gradient
    into its parameter's layout, which is what this does.
    """
    if grad.shape != param.shape or _same_layout(grad, param):
        return grad
    return torch.empty_like(param).copy_(grad)


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (of one shape) hold their elements at the same offsets (a size-1 dimension's stride aside)."""
    return all(n == 1 or x == y for n, x, y in zip(a.shape, a.stride(), b.stride()))


def _fits(params: Params, grads: Params, mu: Params, nu: Params) -> bool:
    """Whether the kernel takes these tensors: floating, dense, on a CPU or GPU, each group of one dtype.

    The moments must share their parameter's memory layout (a gradient is put
    in it, ``_laid_out``): the kernel pairs elements by memory offset.
    """
    if not (params.keys() == grads.keys() == mu.keys() == nu.keys()):
        return False
    for k, p in params.items():
        if p.dtype not in _DTYPES or p.device.type not in _DEVICES or p.layout != torch.strided:
            return False
        for t in (grads[k], mu[k], nu[k]):
            if t.dtype != p.dtype or t.device != p.device or t.layout != torch.strided:
                return False
        if not (_same_layout(mu[k], p) and _same_layout(nu[k], p)):
            return False
    return True
