"""A batch as the compiled step takes it: its tensors, and a hashable structure of everything else."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["flatten_batch", "unflatten_batch"]

_TENSOR = "tensor"


def flatten_batch(batch: Any) -> tuple[list[torch.Tensor], Hashable]:
    """The batch's tensors, and a hashable structure with its other (static) values."""
    kind = type(batch)
    if kind is torch.Tensor:
        return [batch], _TENSOR
    if (kind is tuple or kind is list) and all(type(x) is torch.Tensor for x in batch):
        return list(batch), (kind, len(batch))
    leaves, spec = pytree.tree_flatten(batch)
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    static = tuple(_TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves)
    try:
        hash(static)
    except TypeError:
        odd = next(leaf for leaf in static if leaf is not _TENSOR and not _hashable(leaf))
        raise TypeError(
            f"a compiled step takes batches of tensors and of hashable static values (ints, strings...); "
            f"this batch holds {odd!r:.80} (a {type(odd).__name__}), which is neither. Convert it to a "
            "tensor or a tuple, or use compile=False."
        ) from None
    return tensors, (spec, static)


def _hashable(value: object) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def unflatten_batch(tensors: Sequence[torch.Tensor], structure: Any) -> Any:
    if structure is _TENSOR:
        return tensors[0]
    first, second = structure
    if first is tuple or first is list:
        return first(tensors)
    it = iter(tensors)
    return pytree.tree_unflatten([next(it) if leaf is _TENSOR else leaf for leaf in second], first)
