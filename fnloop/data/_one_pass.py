"""One pass over batches, for a hook that reads a whole set: a stream's first epoch, any other iterable as it is."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

from fnloop.data._batches import Batch, Batches

__all__ = ["one_pass"]


def one_pass(batches: Iterable[Any], limit: int | None = None) -> Iterator[Batch]:
    """The batches of one pass over ``batches``, at most ``limit`` of them (``None``: all).

    A ``fnloop.data.batches`` stream is endless: one pass of it is its first
    epoch, from the start, whatever a run has consumed of it. Any other
    iterable (a list, a ``DataLoader``) is one pass as it is.

    Examples:
        >>> import torch
        >>> from fnloop.data import batches, one_pass
        >>> stream = batches(torch.arange(6), batch_size=2, seed=0, shuffle=False)
        >>> [b.tolist() for b in one_pass(stream)]
        [[0, 1], [2, 3], [4, 5]]
        >>> [b.tolist() for b in one_pass([torch.zeros(1)] * 5, limit=2)]
        [[0.0], [0.0]]
    """
    if isinstance(batches, Batches):
        count = batches.batches_per_epoch if limit is None else limit
        return (batch for batch, _ in itertools.islice(batches.iter_from(0), count))
    return itertools.islice(iter(batches), limit)
