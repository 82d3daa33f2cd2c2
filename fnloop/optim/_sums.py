"""The sums over the whole model a sharded or world-size-invariant step gives the optimizer's update.

A transformation that reduces over the whole model (a global norm) is given,
in a sharded step, one rank's chunks of the updates, and ``sum_`` to add its
partial values over the ranks (``over_shards``); a world-size-invariant step
gives a ``SquaresSum``, whose sums are the same bits at any world size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeAlias, runtime_checkable

import torch

__all__ = ["OverShards", "SquaresSum", "Sum", "over_shards"]


Sum: TypeAlias = Callable[[torch.Tensor], torch.Tensor]
"""The sum over the ranks of a value computed from one rank's chunks (an all-reduce, in a sharded step)."""


@runtime_checkable
class OverShards(Protocol):
    """A transformation that reduces over the whole model (a global norm), or holds one that does.

    A sharded step (``fnloop.init(..., shard=...)``) gives the update one
    rank's chunks of the updates. It updates with ``over_shards(sum_)``: the
    same transformation, computing its whole-model values with ``sum_``, the
    sum over the ranks of a value computed from one rank's chunks (an
    all-reduce in the step's graph). ``clip_by_global_norm`` offers it, and
    ``chain``, ``partition`` and ``inject`` pass it on to what they hold; a
    combinator of your own should too.
    """

    def over_shards(self, sum_: Sum, /) -> Any: ...


@runtime_checkable
class SquaresSum(Protocol):
    """A ``Sum`` that also gives each tensor's sum of squares over the whole model, the same bits however it is cut.

    A world-size-invariant step (``train_step(..., invariant=G)``) gives its
    update one (``fnloop/_step/invariant.py``): a global norm computed from it is
    the same number at any world size, sharded or not, where an all-reduce of
    each rank's partial sums would add them in an order that depends on the
    ranks. A transformation that reduces over the whole model takes its
    ``squares`` where it is given one.
    """

    def __call__(self, value: torch.Tensor, /) -> torch.Tensor: ...

    def squares(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype, /) -> torch.Tensor:
        """``[len(tensors)]``: each tensor's sum of squares in ``dtype``, over the whole model, in ``tensors``' order."""
        ...


def over_shards(transform: Any, sum_: Sum) -> Any:
    """``transform`` for a sharded step: its ``over_shards(sum_)``, or itself where it reduces over nothing."""
    return transform.over_shards(sum_) if isinstance(transform, OverShards) else transform
