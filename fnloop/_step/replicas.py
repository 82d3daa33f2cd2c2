"""Data parallel: the gradient stage's results averaged over the replicas, inside the step's graph.

Every rank runs the whole step on its own batch; after the backward, one
all-reduce per dtype over the gradients, the loss, the metrics and the
floating buffers (BatchNorm's running statistics) put end to end gives every
rank the same averages, so the replicas stay identical without a broadcast.
A step pays the collective's latency once. Integer buffers (counters) agree
already.
"""

from __future__ import annotations

from typing import Any

import torch

from fnloop._step.kernel import Gradient, Grads

__all__ = ["averaged", "replicated"]


def replicated(gradient: Gradient, group: Any) -> Gradient:
    """``gradient`` averaged over the ranks of ``group``: each rank's result is the mean of all of theirs."""

    def replicated_gradient(
        params: dict, buffers: dict, batch: Any, scale: torch.Tensor | None = None
    ) -> Grads:
        return averaged(gradient(params, buffers, batch, scale), group)

    return replicated_gradient


def averaged(found: Grads, group: Any, grads: bool = True) -> Grads:
    """``found`` averaged over the ranks of ``group``; its gradients left as they are unless ``grads``."""
    import torch.distributed._functional_collectives as funcol

    size = torch.distributed.get_world_size(group)
    named = {
        **({("g", k): v for k, v in found.grads.items()} if grads else {}),
        ("l", ""): found.loss,
        **{("m", k): v.float() for k, v in found.metrics.items()},
        **{("b", k): v for k, v in found.buffers.items() if v.is_floating_point()},
    }
    by_dtype: dict[torch.dtype, list[tuple[Any, torch.Tensor]]] = {}
    for key, value in named.items():
        by_dtype.setdefault(value.dtype, []).append((key, value))
    out: dict[Any, torch.Tensor] = {}
    for entries in by_dtype.values():
        flat = torch.cat([v.reshape(-1) for _, v in entries])
        flat = funcol.all_reduce(flat, "sum", group) / size
        for (key, value), part in zip(entries, flat.split([v.numel() for _, v in entries])):
            out[key] = part.view(value.shape)
    return Grads(
        {k: out["g", k] for k in found.grads} if grads else found.grads,
        {k: out.get(("b", k), v) for k, v in found.buffers.items()},
        out["l", ""],
        {k: out["m", k] for k in found.metrics},
    )
