"""Long-lived homes for the scalars a step records: views into large blocks, handed out in turn.

A step records its loss and metrics as tensors, so recording never syncs with
the device. Fresh 0-d tensors every step, each kept while the metrics window
holds it, scatter small long-lived blocks through glibc's heap, between the
large blocks inductor frees every step; the heap can then neither reuse nor
return those, and a CPU run's RSS grows by hundreds of MB (measured on
``benchmarks/bench_step.py wide``). So the step copies each value into the
next free place of a large block instead, one block per dtype and device
at a time. A place is written once: a ``Metrics`` value, once made, never
changes, and a block is freed, whole, once no view of it is held.
"""

from __future__ import annotations

import torch

__all__ = ["ScalarPool"]

_BLOCK = 1 << 16
"""Elements per block (256 KiB of float32): large enough that the allocator maps it apart from its heap."""


class ScalarPool:
    """Homes for recorded scalars; ``keep(value)`` returns one holding ``value``'s value.

    Examples:
        >>> pool = ScalarPool()
        >>> first = pool.keep(torch.tensor(1.0))
        >>> second = pool.keep(torch.tensor(2.0))
        >>> first.item(), second.item(), first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
        (1.0, 2.0, True)
    """

    def __init__(self) -> None:
        self._blocks: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, int]] = {}

    def _place(self, value: torch.Tensor) -> torch.Tensor:
        """The next ``value.numel()`` unused elements of the block for ``value``'s dtype and device, shaped like it."""
        key, n = (value.dtype, value.device), value.numel()
        block, used = self._blocks.get(key, (None, 0))
        if block is None or used + n > block.numel():
            block, used = torch.empty(max(_BLOCK, n), dtype=value.dtype, device=value.device), 0
        self._blocks[key] = (block, used + n)
        return block[used : used + n].view(value.shape)

    def keep(self, value: torch.Tensor) -> torch.Tensor:
        """A tensor nobody else holds, now holding ``value`` (same dtype, shape and device)."""
        return self._place(value).copy_(value.detach())

    def keep_rows(self, value: torch.Tensor) -> list[torch.Tensor]:
        """``value``'s rows (a population's values, one per member), each in a home nobody else holds."""
        return list(self._place(value).copy_(value.detach()).unbind(0))
