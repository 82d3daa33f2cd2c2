"""Data parallel: the gradient stage's results averaged over the replicas, inside the step's graph.

Every rank runs the whole step on its own batch; after the backward, one
all-reduce per dtype over the gradients, the loss, the metrics and the
floating buffers (BatchNorm's running statistics) put end to end gives every
rank the same averages (``collectives.averaged``), so the replicas stay
identical without a broadcast. A step pays the collective's latency once.
"""

from __future__ import annotations

from typing import Any

import torch

from fnloop._step.collectives import averaged
from fnloop._step.kernel import Gradient, Grads

__all__ = ["replicated"]


def replicated(gradient: Gradient, group: Any) -> Gradient:
    """``gradient`` averaged over the ranks of ``group``: each rank's result is the mean of all of theirs."""

    def replicated_gradient(
        params: dict, buffers: dict, batch: Any, scale: torch.Tensor | None = None
    ) -> Grads:
        return averaged(gradient(params, buffers, batch, scale), group)

    return replicated_gradient
