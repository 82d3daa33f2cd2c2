"""Randomness as a function of the run's seed and the step.

Run eagerly, a step draws from torch's generator, seeded for the step
(``_seeded``). Traced, its random ops draw from a seed the step takes as an
input (``drawing_from``): on a GPU through inductor's counter-based generator,
on the CPU through ``fnloop::drawn``, torch's own generator seeded from that
input (inductor's CPU generator cost a GPT-2 step about a tenth of its time).
The compiled graph is then a pure function of its inputs, and a loop of
several steps in one graph seeds each of them as single steps are seeded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = ["DrawOutsideMembers", "drawing_from", "drawn_decompositions", "recomputations", "step_seed"]


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
def _seeded(device: torch.device, seed: int, iteration: int, rank: int = 0) -> Iterator[None]:
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


class _Drawing:
    """While a step is traced: the tensor its random numbers are drawn from, and how many draws so far."""

    def __init__(self, seed: torch.Tensor) -> None:
        self.seed = seed
        self.count = 0

    def next_seed(self) -> torch.Tensor:
        # One seed per random op of the step: the step's seed with the op's index mixed in. The
        # counter-based generator behind inductor's GPU random ops keys on the seed's low 32 bits,
        # which an exclusive or with a small index keeps distinct.
        self.count += 1
        return torch.bitwise_xor(self.seed, self.count)


_DRAWING: list[_Drawing] = []


@contextlib.contextmanager
def drawing_from(seed: torch.Tensor) -> Iterator[None]:
    """While a step is traced inside, its random ops draw from ``seed`` (a 0-d int64), not the generator.

    The traced graph is then a function of its inputs alone: a compiled step
    given the same seed draws the same numbers, and a loop of several steps
    gives each step its own seed, as single steps get theirs. Random ops
    outside (none active) are left as they are.
    """
    drawing = _Drawing(seed)
    _DRAWING.append(drawing)
    try:
        with _replaying(drawing):
            yield
    finally:
        _DRAWING.pop()


_RESTORED = [0]


def recomputations() -> int:
    """How many times, in this process, a traced step set a saved generator state back.

    torch's checkpointing does so when it recomputes a region in the backward
    (and when it leaves it): a trace that raised this count recomputes.
    """
    return _RESTORED[0]


@contextlib.contextmanager
def _replaying(drawing: _Drawing) -> Iterator[None]:
    """torch's generator state carries the draw count too, while ``drawing`` is traced.

    Activation checkpointing (``torch.utils.checkpoint``) runs part of the
    forward again in the backward, and makes it draw the numbers it drew the
    first time by saving the generator's state (``torch.get_rng_state``) and
    setting it back (``torch.set_rng_state``). A traced step draws from its
    seed and a count of draws instead: here, setting a saved state back sets
    the count back to what it was when that state was saved, so a recomputed
    dropout draws the masks of the first forward.
    """
    get, put = torch.get_rng_state, torch.set_rng_state
    counts: dict[int, tuple[torch.Tensor, int]] = {}

    def get_rng_state() -> torch.Tensor:
        state = get()
        counts[id(state)] = (state, drawing.count)  # the state is kept, so its id stays its own
        return state

    def set_rng_state(new_state: torch.Tensor) -> None:
        put(new_state)
        saved = counts.get(id(new_state))
        if saved is not None and saved[0] is new_state:
            drawing.count = saved[1]
            _RESTORED[0] += 1

    torch.get_rng_state, torch.set_rng_state = get_rng_state, set_rng_state  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.get_rng_state, torch.set_rng_state = get, put  # type: ignore[assignment]


@torch.library.custom_op("fnloop::drawn", mutates_args=())
def _drawn_op(seed: torch.Tensor, size: list[int], mode: str) -> torch.Tensor:
    # A 1-d seed (a population's, one per member) draws each row of the first dimension from its own.
    draw = torch.rand if mode == "rand" else torch.randn
    rows = [seed] if seed.ndim == 0 else list(seed.unbind(0))
    shape = size if seed.ndim == 0 else size[1:]
    out = []
    for row in rows:
        generator = torch.Generator(device=seed.device)
        generator.manual_seed(int(row))
        out.append(draw(shape, generator=generator, device=seed.device))
    return out[0] if seed.ndim == 0 else torch.stack(out)


@_drawn_op.register_fake
def _drawn_fake(seed: torch.Tensor, size: list[int], mode: str) -> torch.Tensor:
    return torch.empty(size, device=seed.device)


class DrawOutsideMembers(ValueError):
    """A random op of a population's traced step draws outside the vmap over its members (one member's shape)."""


def _draw(shape: Sequence[int], device: torch.device, mode: str) -> torch.Tensor | None:
    if not _DRAWING:
        return None
    seed = _DRAWING[-1].next_seed().to(device)
    if seed.ndim == 1 and (not shape or shape[0] != seed.shape[0]):
        raise DrawOutsideMembers(
            f"a random op of a population's step draws a tensor of shape {tuple(shape)}, whose first "
            f"dimension is not the {seed.shape[0]} members; only the model's own random ops (run "
            "under the step's vmap, one draw per member) can draw in a population's step"
        )
    if device.type == "cpu":
        return torch.ops.fnloop.drawn(seed, list(shape), mode)
    from torch._inductor import inductor_prims

    if seed.ndim == 1:  # a population: each member's rows from its own seed
        return torch.stack([inductor_prims.random(list(shape[1:]), s, mode) for s in seed.unbind(0)])
    return inductor_prims.random(list(shape), seed, mode)


def _uniform(shape: Sequence[int], device: torch.device) -> torch.Tensor | None:
    return _draw(shape, device, "rand")


def _normal(shape: Sequence[int], device: torch.device) -> torch.Tensor | None:
    return _draw(shape, device, "randn")


def _dtype(dtype: torch.dtype | None) -> torch.dtype:
    return torch.get_default_dtype() if dtype is None else dtype


def _rand(size: Sequence[int], *, dtype: Any = None, device: Any = None, **_: Any) -> Any:
    drawn = _uniform(size, torch.device(device or "cpu"))
    return NotImplemented if drawn is None else drawn.to(_dtype(dtype))


def _randn(size: Sequence[int], *, dtype: Any = None, device: Any = None, **_: Any) -> Any:
    drawn = _normal(size, torch.device(device or "cpu"))
    return NotImplemented if drawn is None else drawn.to(_dtype(dtype))


def _rand_like(x: torch.Tensor, *, dtype: Any = None, **_: Any) -> Any:
    drawn = _uniform(x.shape, x.device)
    return NotImplemented if drawn is None else drawn.to(x.dtype if dtype is None else dtype)


def _randn_like(x: torch.Tensor, *, dtype: Any = None, **_: Any) -> Any:
    drawn = _normal(x.shape, x.device)
    return NotImplemented if drawn is None else drawn.to(x.dtype if dtype is None else dtype)


def _bernoulli_(x: torch.Tensor, p: Any = 0.5, *, generator: Any = None) -> Any:
    drawn = None if generator is not None else _uniform(x.shape, x.device)
    return NotImplemented if drawn is None else x.copy_(drawn < p)


def _bernoulli(x: torch.Tensor, p: Any = None, *, generator: Any = None) -> Any:
    # bernoulli(probs) and bernoulli(x, p): ones with probability probs (or p), in x's dtype.
    drawn = None if generator is not None else _uniform(x.shape, x.device)
    return NotImplemented if drawn is None else (drawn < (x if p is None else p)).to(x.dtype)


def _uniform_(x: torch.Tensor, low: float = 0.0, high: float = 1.0, *, generator: Any = None) -> Any:
    drawn = None if generator is not None else _uniform(x.shape, x.device)
    return NotImplemented if drawn is None else x.copy_(drawn * (high - low) + low)


def _normal_(x: torch.Tensor, mean: float = 0.0, std: float = 1.0, *, generator: Any = None) -> Any:
    drawn = None if generator is not None else _normal(x.shape, x.device)
    return NotImplemented if drawn is None else x.copy_(drawn * std + mean)


def drawn_decompositions() -> dict[Any, Callable[..., Any]]:
    """The random ops a traced step draws from its seed input (see ``drawing_from``)."""
    aten = torch.ops.aten
    return {
        aten.rand.default: _rand,
        aten.randn.default: _randn,
        aten.rand_like.default: _rand_like,
        aten.randn_like.default: _randn_like,
        aten.bernoulli_.float: _bernoulli_,
        aten.bernoulli_.Tensor: _bernoulli_,
        aten.bernoulli.default: _bernoulli,
        aten.bernoulli.p: _bernoulli,
        aten.uniform_.default: _uniform_,
        aten.normal_.default: _normal_,
    }
