"""Tensor parallelism's collectives as ``autograd.Function``s, so that the traced graph holds them, each way.

Megatron-LM's ``f`` and ``g`` (``Copy``, ``Reduce``) around a column-wise and a
row-wise layer, a head's logits gathered (``GatherLast``); and for
sequence parallelism (torch's ``SequenceParallel``): where a
plan has ``"sequence"`` or ``"split"`` modules (``tensor.py``), the sequence
(dimension 1 of ``[batch, sequence, features]``) is cut into one slice per
rank where the layers begin, the norms between the layers run on a slice,
the modules holding column-wise layers gather the slices of their input, and
each row-wise layer reduce-scatters its output into them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.nn.utils._named_member_accessor import swap_tensor

from fnloop._step.collectives import all_gather, done, reduce_scatter, summed

__all__ = [
    "Copy",
    "GatherLast",
    "GatherSequence",
    "Reduce",
    "ScatterSequence",
    "SplitSequence",
    "summed_parameters",
]


class Copy(torch.autograd.Function):
    """Identity in the forward, all-reduce of the gradient in the backward: a column-wise layer's input (Megatron's f)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return done(summed(grad.contiguous(), ctx.group)), None


class Reduce(torch.autograd.Function):
    """All-reduce in the forward, identity in the backward: a row-wise layer's output (Megatron's g)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        return done(summed(x.contiguous(), group))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


class GatherLast(torch.autograd.Function):
    """Every rank's slice put together on the last dimension; the gradient: this rank's slice of it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, degree: int, rank: int) -> torch.Tensor:  # type: ignore[override]
        ctx.degree, ctx.rank = degree, rank
        every = all_gather(x.contiguous(), group)
        return torch.cat(every.chunk(degree, dim=0), dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        return grad.chunk(ctx.degree, dim=-1)[ctx.rank].contiguous(), None, None, None


def _on_sequence(
    collective: Callable[[torch.Tensor, Any], torch.Tensor], x: torch.Tensor, group: Any
) -> torch.Tensor:
    """``collective`` (on the first dimension) run on ``x``'s sequence, its second."""
    return collective(x.movedim(1, 0).contiguous(), group).movedim(0, 1).contiguous()


class GatherSequence(torch.autograd.Function):
    """Every rank's slice of the sequence put together; the gradient: this rank's slice of its sum (reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return _on_sequence(all_gather, x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return _on_sequence(reduce_scatter, grad, ctx.group), None


class ScatterSequence(torch.autograd.Function):
    """This rank's slice of the sequence of the sum over the ranks (reduce-scatter); the gradient all-gathered."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return _on_sequence(reduce_scatter, x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return _on_sequence(all_gather, grad, ctx.group), None


class SplitSequence(torch.autograd.Function):
    """This rank's slice of a whole sequence; the gradient: every rank's put together (all-gather)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, degree: int, rank: int) -> torch.Tensor:  # type: ignore[override]
        if x.ndim < 2 or x.shape[1] % degree:
            raise ValueError(
                f"sequence parallelism cuts the sequence (dimension 1 of the layers' input) into {degree} "
                f"slices, one per rank, and this input is of shape {tuple(x.shape)}. Give batches whose "
                f"sequence length {degree} divides (pad them), or leave 'sequence' and 'split' out of the plan."
            )
        ctx.group = group
        return x.chunk(degree, dim=1)[rank].contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        return _on_sequence(all_gather, grad, ctx.group), None, None, None


@contextlib.contextmanager
def summed_parameters(module: torch.nn.Module, group: Any) -> Iterator[None]:
    """A module run on a slice of the sequence: its own parameters' gradients summed over the ranks.

    Each parameter it holds when it runs passes through ``Copy`` for the call
    (identity, its gradient all-reduced), and is put back after.
    """
    held: list[dict[str, torch.Tensor]] = []

    def before(m: torch.nn.Module, args: tuple) -> None:
        own = {n: p for n, p in m._parameters.items() if p is not None}
        held.append({n: swap_tensor(m, n, Copy.apply(p, group)) for n, p in own.items()})

    def after(m: torch.nn.Module, args: tuple, out: Any) -> None:
        for n, p in held.pop().items():
            swap_tensor(m, n, p)

    handles = [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
