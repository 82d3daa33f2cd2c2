"""Randomness in a traced step: its random ops draw from a seed input, not from torch's generator.

A step's randomness is a function of the run's seed and the iteration
(``fnloop/_step/seeds.py``). Run eagerly, a step draws from torch's
generator, seeded for the step. Traced, its random ops draw from a seed the
step takes as an input (``Draws.from_``): on a GPU through inductor's counter-based generator,
on the CPU through ``fnloop::drawn``, torch's own generator seeded from that
input (inductor's CPU generator cost a GPT-2 step about a tenth of its time).
The compiled graph is then a pure function of its inputs, and a loop of
several steps in one graph seeds each of them as single steps are seeded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import torch

from fnloop._compile.patches import rng_state_hooks

__all__ = ["DrawOutsideMembers", "Draws"]


class _Drawing:
    """The tensor one step's random numbers are drawn from, and how many draws so far."""

    def __init__(self, seed: torch.Tensor) -> None:
        self.seed = seed
        self.count = 0

    def next_seed(self) -> torch.Tensor:
        # One seed per random op of the step: the step's seed with the op's index mixed in. The
        # counter-based generator behind inductor's GPU random ops keys on the seed's low 32 bits,
        # which an exclusive or with a small index keeps distinct.
        self.count += 1
        return torch.bitwise_xor(self.seed, self.count)


class Draws:
    """The random numbers of one trace: which seed its random ops draw from, and whether any was drawn again.

    ``trace`` makes one per graph and hands it to the function it traces,
    which says where each step's seed is (``from_``); ``decompositions()``
    are the random ops, drawn from that seed. ``restored`` counts the times
    torch's checkpointing set a saved generator state back: a trace that
    restored recomputes a region in its backward.
    """

    _tracing: ClassVar[list[Draws]] = []
    """The instances whose ``from_`` is open, innermost last (one trace at a time: the compiler's lock)."""

    def __init__(self, portable: bool = False) -> None:
        self._active: list[_Drawing] = []
        self.restored = 0
        self.drawn = 0
        """How many random ops drew from a seed input."""
        self.portable = portable
        """Draw through ``fnloop::drawn`` on every device, so the graph draws the same run op by op
        (``backend="graph"``); otherwise a GPU's draws are inductor's own, which only inductor seeds."""

    @classmethod
    def current(cls) -> Draws | None:
        """The ``Draws`` of the step being traced, inside its ``from_``; ``None`` when nothing is traced."""
        return cls._tracing[-1] if cls._tracing else None

    @property
    def seed(self) -> torch.Tensor:
        """The seed the random ops draw from now (the innermost ``from_``'s)."""
        return self._active[-1].seed

    @contextlib.contextmanager
    def from_(self, seed: torch.Tensor) -> Iterator[None]:
        """While a step is traced inside, its random ops draw from ``seed`` (int64), not the generator.

        ``seed`` is 0-d, or 1-d with one seed per member of a population (each
        member's rows drawn from its own). The traced graph is then a function
        of its inputs alone: a compiled step given the same seed draws the same
        numbers, and a loop of several steps gives each step its own seed, as
        single steps get theirs.

        torch's generator state carries the draw count too, inside:
        activation checkpointing (``torch.utils.checkpoint``) runs part of the
        forward again in the backward, and makes it draw the numbers it drew
        the first time by saving the generator's state (``torch.get_rng_state``)
        and setting it back. Here, setting a saved state back sets the count
        back to what it was when that state was saved, so a recomputed dropout
        draws the masks of the first forward.
        """
        drawing = _Drawing(seed)
        counts: dict[int, tuple[torch.Tensor, int]] = {}

        def saved(state: torch.Tensor) -> None:
            counts[id(state)] = (state, drawing.count)  # the state is kept, so its id stays its own

        def restored(state: torch.Tensor) -> None:
            found = counts.get(id(state))
            if found is not None and found[0] is state:
                drawing.count = found[1]
                self.restored += 1

        self._active.append(drawing)
        Draws._tracing.append(self)
        try:
            with rng_state_hooks(saved, restored):
                yield
        finally:
            Draws._tracing.pop()
            self._active.pop()

    def decompositions(self) -> dict[Any, Callable[..., Any]]:
        """The random ops a traced step draws from its seed input (see ``from_``)."""
        return _decompositions(self._draw)

    def _draw(self, shape: Sequence[int], device: torch.device, mode: str) -> torch.Tensor | None:
        if not self._active:
            return None
        self.drawn += 1
        return _drawn(self._active[-1].next_seed().to(device), shape, device, mode, self.portable)


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


def _drawn(
    seed: torch.Tensor, shape: Sequence[int], device: torch.device, mode: str, portable: bool = False
) -> torch.Tensor:
    if seed.ndim == 1 and (not shape or shape[0] != seed.shape[0]):
        raise DrawOutsideMembers(
            f"a random op of a population's step draws a tensor of shape {tuple(shape)}, whose first "
            f"dimension is not the {seed.shape[0]} members; only the model's own random ops (run "
            "under the step's vmap, one draw per member) can draw in a population's step"
        )
    if device.type == "cpu" or portable:
        return torch.ops.fnloop.drawn(seed, list(shape), mode)
    from torch._inductor import inductor_prims

    if seed.ndim == 1:  # a population: each member's rows from its own seed
        return torch.stack([inductor_prims.random(list(shape[1:]), s, mode) for s in seed.unbind(0)])
    return inductor_prims.random(list(shape), seed, mode)


Draw = Callable[[Sequence[int], torch.device, str], "torch.Tensor | None"]


def _dtype(dtype: torch.dtype | None) -> torch.dtype:
    return torch.get_default_dtype() if dtype is None else dtype


def _decompositions(draw: Draw) -> dict[Any, Callable[..., Any]]:
    """torch's random ops drawn by ``draw(shape, device, mode)`` (``NotImplemented`` where it draws nothing)."""

    def uniform(shape: Sequence[int], device: torch.device) -> torch.Tensor | None:
        return draw(shape, device, "rand")

    def normal(shape: Sequence[int], device: torch.device) -> torch.Tensor | None:
        return draw(shape, device, "randn")

    def rand(size: Sequence[int], *, dtype: Any = None, device: Any = None, **_: Any) -> Any:
        drawn = uniform(size, torch.device(device or "cpu"))
        return NotImplemented if drawn is None else drawn.to(_dtype(dtype))

    def randn(size: Sequence[int], *, dtype: Any = None, device: Any = None, **_: Any) -> Any:
        drawn = normal(size, torch.device(device or "cpu"))
        return NotImplemented if drawn is None else drawn.to(_dtype(dtype))

    def rand_like(x: torch.Tensor, *, dtype: Any = None, **_: Any) -> Any:
        drawn = uniform(x.shape, x.device)
        return NotImplemented if drawn is None else drawn.to(x.dtype if dtype is None else dtype)

    def randn_like(x: torch.Tensor, *, dtype: Any = None, **_: Any) -> Any:
        drawn = normal(x.shape, x.device)
        return NotImplemented if drawn is None else drawn.to(x.dtype if dtype is None else dtype)

    def bernoulli_(x: torch.Tensor, p: Any = 0.5, *, generator: Any = None) -> Any:
        drawn = None if generator is not None else uniform(x.shape, x.device)
        return NotImplemented if drawn is None else x.copy_(drawn < p)

    def bernoulli(x: torch.Tensor, p: Any = None, *, generator: Any = None) -> Any:
        # bernoulli(probs) and bernoulli(x, p): ones with probability probs (or p), in x's dtype.
        drawn = None if generator is not None else uniform(x.shape, x.device)
        return NotImplemented if drawn is None else (drawn < (x if p is None else p)).to(x.dtype)

    def uniform_(x: torch.Tensor, low: float = 0.0, high: float = 1.0, *, generator: Any = None) -> Any:
        drawn = None if generator is not None else uniform(x.shape, x.device)
        return NotImplemented if drawn is None else x.copy_(drawn * (high - low) + low)

    def normal_(x: torch.Tensor, mean: float = 0.0, std: float = 1.0, *, generator: Any = None) -> Any:
        drawn = None if generator is not None else normal(x.shape, x.device)
        return NotImplemented if drawn is None else x.copy_(drawn * std + mean)

    aten = torch.ops.aten
    return {
        aten.rand.default: rand,
        aten.randn.default: randn,
        aten.rand_like.default: rand_like,
        aten.randn_like.default: randn_like,
        aten.bernoulli_.float: bernoulli_,
        aten.bernoulli_.Tensor: bernoulli_,
        aten.bernoulli.default: bernoulli,
        aten.bernoulli.p: bernoulli,
        aten.uniform_.default: uniform_,
        aten.normal_.default: normal_,
    }
