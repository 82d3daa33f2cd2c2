"""Accumulation: the gradient stage run on micro-batches, and their gradients averaged.

``train_step(..., accumulate=n)`` cuts each batch into ``n`` equal
micro-batches on their rows, runs the gradient stage on each in turn (the
forward's running statistics carried from one to the next, as ``n`` eager
forwards would), and averages the gradients, the losses and the metrics:
one optimizer update per batch, with the working memory of a micro-batch.
"""

from __future__ import annotations

from typing import Any

import torch

from fnloop._step.kernel import Gradient, Grads
from fnloop._step.rows import micro_batches

__all__ = ["accumulated"]


def accumulated(gradient: Gradient, n: int, dim: int = 0) -> Gradient:
    """``gradient`` averaged over ``n`` micro-batches, cut on the batch's dimension ``dim``.

    ``dim`` is 1 for a population whose members each have their own rows
    (members first, then each member's rows).
    """
    if n == 1:
        return gradient

    def accumulated_gradient(
        params: dict, buffers: dict, batch: Any, scale: torch.Tensor | None = None
    ) -> Grads:
        grads: dict[str, torch.Tensor] = {}
        losses, parts = [], []
        # A scaled loss is scaled by scale / n, as GradScaler's recipe scales loss / n: the sum of
        # the micro-batches' gradients is then the mean's, and overflows where that recipe's does.
        each = None if scale is None else scale / n
        for micro in micro_batches(batch, n, dim):
            found = gradient(params, buffers, micro, each)
            grads = {k: grads[k] + v for k, v in found.grads.items()} if grads else found.grads
            buffers = found.buffers
            losses.append(found.loss)
            parts.append(found.metrics)
        metrics = {k: torch.stack([m[k] for m in parts]).float().mean(0) for k in parts[0]}
        mean = grads if scale is not None else {k: v / n for k, v in grads.items()}
        return Grads(mean, buffers, torch.stack(losses).mean(0), metrics)

    return accumulated_gradient
