"""Tensor parallelism's collectives as ``autograd.Function``s, so that the traced graph holds them, each way.

Megatron-LM's ``f`` and ``g`` (``Copy``, ``Reduce``) around a column-wise and a
row-wise layer, a head's logits gathered (``GatherLast``); and for
sequence parallelism (torch's ``SequenceParallel``): where a
plan has ``"sequence"`` or ``"split"`` modules (``tensor.py``), the sequence
(dimension 1 of ``[batch, sequence, features]``) is cut into one slice per
rank where the layers begin, the norms between the layers run on a slice,
the modules holding column-wise layers gather the slices of their input, and
each row-wise layer reduce-scatters its output into them.

Attention dropout on a rank's heads (``whole_masks``) draws the mask of every
head, as one process does, and keeps this rank's heads of it: the run draws
the single process's masks.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.nn.utils._named_member_accessor import swap_tensor
from torch.overrides import TorchFunctionMode

from fnloop._step.collectives import all_gather, done, reduce_scatter, summed

__all__ = [
    "Copy",
    "GatherLast",
    "module_hooks",
    "GatherSequence",
    "Reduce",
    "ScatterSequence",
    "SplitSequence",
    "summed_parameters",
    "whole_masks",
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
def module_hooks(
    modules: list[torch.nn.Module],
    before: Callable[..., Any] | None = None,
    after: Callable[..., Any] | None = None,
    *,
    with_kwargs: bool = False,
) -> Iterator[None]:
    """``before`` as each of ``modules``' forward pre-hook and ``after`` as its forward hook, for the block."""
    handles = []
    for module in modules:
        if before is not None:
            handles.append(module.register_forward_pre_hook(before, with_kwargs=with_kwargs))
        if after is not None:
            handles.append(module.register_forward_hook(after))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


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

    with module_hooks([module], before, after):
        yield


@contextlib.contextmanager
def whole_masks(attentions: list[torch.nn.Module], degree: int, rank: int) -> Iterator[None]:
    """``attentions`` (modules holding this rank's heads) drawing their dropout masks for every head, keeping their own.

    While one of them runs, ``scaled_dot_product_attention`` with dropout is
    computed as torch's math does (``_WholeMasks``), with the mask drawn for
    the ``degree`` times as many heads of the whole model, in one draw as one
    process's, and this rank's heads (the ``rank``-th block) kept. The mode is
    held for the block; the modules' hooks say when it acts.
    """
    mode = _WholeMasks(degree, rank)

    def before(m: torch.nn.Module, args: tuple) -> None:
        mode.depth += 1

    def after(m: torch.nn.Module, args: tuple, out: Any) -> None:
        mode.depth -= 1

    with module_hooks(attentions, before, after), mode:
        yield


class _WholeMasks(TorchFunctionMode):
    """``scaled_dot_product_attention`` with dropout on this rank's heads, its mask drawn for every head."""

    def __init__(self, degree: int, rank: int) -> None:
        super().__init__()
        self.degree, self.rank, self.depth = degree, rank, 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if (
            self.depth
            and func is torch.nn.functional.scaled_dot_product_attention
            and _dropout(*args, **kwargs)
        ):
            return self.attention(*args, **kwargs)
        return func(*args, **kwargs)

    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        """torch's math attention (``_scaled_dot_product_attention_math``), the dropout mask drawn whole."""
        if enable_gqa:
            key = key.repeat_interleave(query.size(-3) // key.size(-3), -3)
            value = value.repeat_interleave(query.size(-3) // value.size(-3), -3)
        root = math.sqrt(1.0 / math.sqrt(query.size(-1)) if scale is None else scale)
        weights = (query * root) @ (key.transpose(-2, -1) * root)
        length, keys = query.size(-2), key.size(-2)
        if is_causal:
            causal = torch.ones(length, keys, dtype=torch.bool, device=query.device).tril()
            weights = weights + torch.where(causal, 0.0, -math.inf).to(weights.dtype)
        if attn_mask is not None:
            weights = (
                weights.masked_fill(~attn_mask, -math.inf)
                if attn_mask.dtype == torch.bool
                else weights + attn_mask
            )
        weights = torch.ops.aten._safe_softmax(weights, -1)
        heads = weights.size(-3)
        shape = (*weights.shape[:-3], heads * self.degree, *weights.shape[-2:])
        mask = torch.empty(shape, dtype=weights.dtype, device=weights.device).bernoulli_(1 - dropout_p)
        mine = mask.narrow(-3, self.rank * heads, heads).div(1 - dropout_p)
        return (weights * mine) @ value


def _dropout(
    query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0, *args: Any, **kwargs: Any
) -> bool:
    """Whether a call of ``scaled_dot_product_attention`` drops out."""
    return dropout_p > 0.0
