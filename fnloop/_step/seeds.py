"""The seed of each step: a function of the run's seed, the iteration and the rank (or the slice).

Run eagerly, a step draws from torch's generator seeded for it (``seeded``);
traced, from its seed as an input of the graph (``fnloop/_compile/seeding.py``).
A world-size-invariant step (``invariant.py``) draws each slice of the batch
from the slice's own seed, a function of the step's seed and the slice
(``slice_seeds``), whichever rank runs it. Run eagerly, it finds the step's
seed where ``seeded`` put it, in the generator (``step_seed_of``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["seeded", "slice_seeded", "slice_seeds", "step_seed", "step_seed_of"]

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


@contextlib.contextmanager
def seeded(device: torch.device, seed: int, iteration: int, rank: int = 0) -> Iterator[None]:
    """The device's generator seeded for step ``iteration``, and put back as it was after."""
    # torch.manual_seed seeds every device (~110 us); one generator's own
    # manual_seed costs ~1 us.
    generator = _generator(device)
    saved = generator.get_state()
    generator.manual_seed(step_seed(seed, iteration, rank))
    try:
        yield
    finally:
        generator.set_state(saved)


def slice_seeds(step: int, slices: int) -> list[int]:
    """The seeds of the ``slices`` slices of a step seeded ``step`` (its ``step_seed``): slice 0 draws what the whole step would.

    Examples:
        >>> seeds = slice_seeds(step_seed(0, 3), 4)
        >>> seeds[0] == step_seed(0, 3), len(set(seeds))
        (True, 4)
    """
    return [step if g == 0 else step_seed(step, 0, g) for g in range(slices)]


def step_seed_of(device: torch.device) -> int:
    """The seed the device's generator was last given: inside ``seeded``, the step's (``step_seed``).

    torch's own record of it (``Generator.initial_seed``), which the eager
    step's random ops draw from already: no other channel carries it.
    """
    return _generator(device).initial_seed()


@contextlib.contextmanager
def slice_seeded(device: torch.device, seed: int) -> Iterator[None]:
    """The device's generator seeded ``seed`` (a slice's, ``slice_seeds``) for the block; put back as it was after."""
    generator = _generator(device)
    saved = generator.get_state()
    generator.manual_seed(seed)
    try:
        yield
    finally:
        generator.set_state(saved)
