"""Long-lived homes for the scalars a step records, reused once no metrics value holds them.

A step records its loss and metrics as tensors, so recording never syncs with
the device. Fresh 0-d tensors every step, each kept while the metrics window
holds it, scatter small long-lived blocks through glibc's heap, between the
large blocks inductor frees every step; the heap can then neither reuse nor
return those, and a CPU run's RSS grows by hundreds of MB (measured on
``benchmarks/bench_step.py wide``). So the step copies each value into a home
from this pool instead. A home is reused only when its reference count shows
that nothing but the pool holds it, so a ``Metrics`` value, once made, never
changes.

Why reference counts, measured (``bench_step.py wide-child fnloop``, fresh
processes taking turns): handing out places in large blocks instead, each
written once and freed with its block, needs none, and kept peak RSS lower
(611 to 689 MB against 611 to 948), but its steps took 99 to 106 ms against
77 to 85 for this pool's; the processes with the lower RSS were the slower
ones under either pool, glibc giving inductor's freed scratch back to the
system and faulting it in again every step.
"""

from __future__ import annotations

import sys

import torch

__all__ = ["ScalarPool"]

_LOOK_AHEAD = 8
"""Homes tried per value before a new one is made: homes free up in the order they were used."""


def _baseline() -> int:
    # A home held by the pool's list alone, counted exactly as `keep` counts:
    # the builtin on a local name, never through a Python function of ours
    # (dynamo's frame hook, once installed, adds a reference to the arguments
    # of Python calls). Measured, since interpreters count temporaries apart.
    homes = [torch.zeros(())]
    home = homes[0]
    return sys.getrefcount(home)


_FREE = _baseline()


def _row_baseline() -> int:
    # A row held by the pool's tuple alone, counted as `keep_rows` counts it.
    rows = [(torch.zeros(()),)]
    row = rows[0][0]
    return sys.getrefcount(row)


_FREE_ROW = _row_baseline()


class ScalarPool:
    """Homes for recorded scalars; ``keep(value)`` returns one holding ``value``'s value.

    Examples:
        >>> pool = ScalarPool()
        >>> first = pool.keep(torch.tensor(1.0))
        >>> second = pool.keep(torch.tensor(2.0))  # `first` is still held here: a new home
        >>> first.item(), second.item(), first is second
        (1.0, 2.0, False)
    """

    def __init__(self) -> None:
        self._homes: list[torch.Tensor] = []
        self._next = 0
        self._rows: list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = []
        self._next_rows = 0

    def keep(self, value: torch.Tensor) -> torch.Tensor:
        """A tensor nobody else holds, now holding ``value`` (same dtype, shape and device)."""
        homes = self._homes
        for _ in range(min(_LOOK_AHEAD, len(homes))):
            index = self._next
            self._next = (index + 1) % len(homes)
            home = homes[index]
            if (
                sys.getrefcount(home) <= _FREE
                and home.dtype == value.dtype
                and home.shape == value.shape
                and home.device == value.device
            ):
                return home.copy_(value)
        home = value.detach().clone()
        homes.insert(self._next, home)
        self._next = (self._next + 1) % len(homes)
        return home

    def keep_rows(self, value: torch.Tensor) -> list[torch.Tensor]:
        """``value``'s rows (a population's values, one per member), in a home: views nobody else holds.

        One copy for all the rows; the home is reused once no metrics value
        holds any of its rows (a row's view does not count as a reference to
        the home itself, so each row is counted).
        """
        homes = self._rows
        for _ in range(min(_LOOK_AHEAD, len(homes))):
            index = self._next_rows
            self._next_rows = (index + 1) % len(homes)
            home, rows = homes[index]
            if (
                home.dtype == value.dtype
                and home.shape == value.shape
                and home.device == value.device
                and all(sys.getrefcount(row) <= _FREE_ROW for row in rows)
            ):
                home.copy_(value)
                return list(rows)  # a list of the caller's own: what it keeps of it is counted
        home = value.detach().clone()
        rows = home.unbind(0)
        homes.insert(self._next_rows, (home, rows))
        self._next_rows = (self._next_rows + 1) % len(homes)
        return list(rows)
