"""The seed of each step: a function of the run's seed, the iteration and the rank (or the slice).

Run eagerly, a step draws from torch's generator seeded for it (``seeded``);
traced, from its seed as an input of the graph (``fnloop/_compile/seeding.py``).
A world-size-invariant step (``invariant.py``) draws each slice of the batch
from the slice's own seed, ``step_seed(seed, iteration, slice)``, whichever
rank runs it (``slice_seeded``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["seeded", "slice_seeded", "slice_seeds", "step_seed"]

_MASK = (1 << 64) - 1


def step_seed(seed: int, iteration: int, rank: int = 0) -> int:
    """The seed of step ``iteration`` of a run seeded ``seed``, on ``rank`` (splitmix64 of the three).

    Rank 0 draws what a single process draws; each other rank draws its own
    numbers (dropout masks differ across ranks, as their data does).

    Examples:
        >>> step_seed(0, 1) != step_seed(1, 0) != step_seed(0, 1, rank=1)
        True
    """
    if rank:
        seed = _finalize((seed * 0x9E3779B97F4A7C15 + rank) & _MASK)
    z = (seed * 0x9E3779B97F4A7C15 + iteration + 1) & _MASK
    return _finalize(z)


def _finalize(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def _generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index or 0]
    return torch.default_generator


_STEP: list[tuple[int, int]] = []
"""The ``(seed, iteration)`` of the steps being run eagerly inside ``seeded``, innermost last."""


@contextlib.contextmanager
def seeded(device: torch.device, seed: int, iteration: int, rank: int = 0) -> Iterator[None]:
    """The device's generator seeded for step ``iteration``, and put back as it was after."""
    # torch.manual_seed seeds every device (~110 us); one generator's own
    # manual_seed costs ~1 us.
    generator = _generator(device)
    saved = generator.get_state()
    generator.manual_seed(step_seed(seed, iteration, rank))
    _STEP.append((seed, iteration))
    try:
        yield
    finally:
        _STEP.pop()
        generator.set_state(saved)


def slice_seeds(seed: int, iteration: int, slices: int) -> list[int]:
    """The seeds of the ``slices`` slices of step ``iteration``: slice ``g`` draws from ``step_seed(seed, iteration, g)``.

    Examples:
        >>> slice_seeds(0, 3, 2) == [step_seed(0, 3), step_seed(0, 3, 1)]
        True
    """
    return [step_seed(seed, iteration, g) for g in range(slices)]


@contextlib.contextmanager
def slice_seeded(device: torch.device, g: int) -> Iterator[None]:
    """Inside an eager step (``seeded``), the generator seeded for slice ``g`` of it, whichever rank runs it."""
    if not _STEP:
        raise RuntimeError("slice_seeded: no step is being seeded (call it inside seeded(...))")
    generator = _generator(device)
    generator.manual_seed(step_seed(*_STEP[-1], g))
    yield
