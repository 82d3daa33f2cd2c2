"""The layout of one call of the step: what the call is made of, read from the state and the batches.

A ``Layout`` says what a call of the step is made of: a single run or a
population's stacked members, a whole state or this rank's shards, one step
or several. ``inputs.py`` reads it from a call; the placement
(``placement.py``) chooses the transformations for it, once per layout.
"""

from __future__ import annotations

import attrs

from fnloop._core.shards import Shards
from fnloop._core.tensor_parallel import TensorParallel

__all__ = ["Layout"]


@attrs.frozen
class Layout:
    """What one call of the step is made of; hashable, part of a compiled graph's key.

    Args:
        members: a population's size (its tensors stacked, members first), or ``None``.
        shared: every member trains on the batch (else member ``m`` on row ``m``).
        shards: the state's layout across ranks, or ``None`` (whole on every rank).
        steps: how many steps one call runs (stacked batches, one loop).
        stop: a non-finite step stops the run (else it is skipped and counted).
        given: what the step is given beside the state, the iteration, the
            seeds and the batch, one tensor each, named for a message (a
            population's: which members train).
        tensor: the state's tensor-parallel layout, or ``None``.
    """

    members: int | None = None
    shared: bool = True
    shards: Shards | None = None
    steps: int = 1
    stop: bool = True
    given: tuple[str, ...] = ()
    tensor: TensorParallel | None = None
