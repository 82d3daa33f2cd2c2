"""A batch cut on its rows: the micro-batches of accumulation, the slices of the world-size-invariant step."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["micro_batches"]


def micro_batches(batch: Any, n: int, dim: int = 0) -> list[Any]:
    """``batch`` cut into ``n`` equal parts on dimension ``dim`` of each of its tensors (views)."""
    flat, spec = pytree.tree_flatten(batch)
    for leaf in flat:
        if isinstance(leaf, torch.Tensor) and leaf.shape[dim] % n:
            raise ValueError(
                f"cannot split a batch of {leaf.shape[dim]} rows into accumulate={n} equal micro-batches; "
                "choose a batch size divisible by accumulate."
            )
    chunks = [leaf.chunk(n, dim) if isinstance(leaf, torch.Tensor) else [leaf] * n for leaf in flat]
    return [pytree.tree_unflatten([c[k] for c in chunks], spec) for k in range(n)]
