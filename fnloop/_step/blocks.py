"""Block by block: a sharded step that gathers each block's parameters only while the block runs.

With ``shard="full"`` each rank holds its chunks of the parameters. The
gather-everything step (``sharding.py``) all-gathers every parameter before
the forward and keeps them for the whole step, so a rank's peak holds the
whole model. Here, as FSDP2 with ``fully_shard`` on each layer, the model is
cut into units: each block (``units.units_of``), and the root (what no block
holds). The root's chunks are gathered before the forward; a block's just
before the block runs, in one all-gather of its chunks put end to end. The
gather is a function of the chunks with a gradient (``_Gather``): its backward
is the block's reduce-scatter, one collective per block, run as soon as the
block's gradients exist.

The step is traced whole, forward and backward in one graph, so what the
forward gathered would stay alive until the backward used it again. The
compiler room's ``regathered`` pass gathers it anew instead, just before the
backward needs it (``fnloop/_compile/regather.py``), as torchtitan's SimpleFSDP
marks its gathers to be recomputed: at any moment a rank holds the root, the
block running and the one whose gather is arriving, not the model.

The chunks, the checkpoints and the results are those of the gather-everything
step: only when the parameters are whole changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from fnloop._core.shards import Shards
from fnloop._step.collectives import (
    Groups,
    across_copies,
    all_gather,
    all_reduced_mean,
    averaged,
    by_dtype,
    reduce_scatter,
)
from fnloop._step.holding import holding
from fnloop._step.kernel import Gradient, Grads
from fnloop._step.units import Units

__all__ = ["Reduction", "blockwise", "gathered_together", "held_by_blocks"]

Reduction = Callable[[torch.Tensor, Any], torch.Tensor]
"""How a block's gradient is added over the ranks of its gather: ``(grad [W * n], group) -> this rank's [n]``.

``None`` where it is taken: the reduce-scatter (a sum). A world-size-invariant
step gives its own (``invariant.ranks_tree``: the ranks' sum in one fixed order).
"""


class _Gather(torch.autograd.Function):
    """All-gather of a flat chunk whose gradient is its ``Reduction`` of the whole's: the reduce-scatter, or the one given."""

    @staticmethod
    def forward(ctx: Any, flat: torch.Tensor, group: Any, reduce: Reduction | None) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.reduce = group, reduce
        return all_gather(flat, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        if ctx.reduce is not None:
            return ctx.reduce(grad, ctx.group), None, None
        return reduce_scatter(grad.contiguous(), ctx.group), None, None


def gathered_together(
    chunks: Mapping[str, torch.Tensor], shards: Shards, group: Any, reduce: Reduction | None = None
) -> dict[str, torch.Tensor]:
    """The whole tensors of ``chunks``, in one all-gather per dtype of them all end to end (FSDP2's copy-in).

    Differentiable: the gradient of each chunk is this rank's rows of the sum
    over ranks of the whole's gradient, in one reduce-scatter per dtype.

    ``reduce`` (a world-size-invariant step's): one gather per tensor, whose
    backward is that reduction. Each gradient then leaves the backward as its
    own tensor, computed as a whole state's is: put end to end with others,
    inductor compiled some of the reductions that make them otherwise (a few
    gradients of a GPT-2 about ``1e-9`` off the whole state's), and the run
    was no longer the same bits.
    """
    world = shards.world
    out = {}
    if reduce is not None:
        for name, chunk in chunks.items():
            whole = _Gather.apply(chunk.reshape(-1), group, reduce).view(
                world * chunk.shape[0], *chunk.shape[1:]
            )
            out[name] = whole[: shards.whole(name)]
        return out
    for names in by_dtype(chunks).values():
        flat = torch.cat([chunks[n].reshape(-1) for n in names])
        by_rank = _Gather.apply(flat, group, None).view(world, -1)
        for name, part in zip(names, by_rank.split([chunks[n].numel() for n in names], dim=1)):
            shape = chunks[name].shape
            out[name] = part.reshape(world * shape[0], *shape[1:])[: shards.whole(name)]
    return out


def blockwise(gradient: Gradient, shards: Shards, groups: Groups) -> Gradient:
    """``gradient`` (holding the model by blocks, ``held_by_blocks``) of a ``"full"`` sharded state.

    Its gradients are this rank's chunks of the mean over ranks (each gather's
    backward summed the chunks' within one copy); the loss, the metrics and
    the floating buffers are averaged as data parallel's.
    """
    split = shards.names

    def gradient_of_chunks(
        params: dict, buffers: dict, batch: Any, scale: torch.Tensor | None = None
    ) -> Grads:
        found = averaged(gradient(params, buffers, batch, scale), groups.every, grads=False)
        chunks = across_copies({k: g for k, g in found.grads.items() if k in split}, groups)
        whole = all_reduced_mean(
            {k: g for k, g in found.grads.items() if k not in split}, groups.every, groups.size
        )
        return found._replace(grads={k: chunks[k] if k in chunks else whole[k] for k in found.grads})

    return gradient_of_chunks


def held_by_blocks(
    model: torch.nn.Module, units: Units, shards: Shards, group: Any, reduce: Reduction | None = None
) -> Callable[[dict[str, torch.Tensor]], contextlib.AbstractContextManager[None]]:
    """What holds ``model`` on a ``"full"`` state's chunks for a gradient stage (``value_and_grad``'s ``hold``): block by block."""

    def hold(tensors: dict[str, torch.Tensor]) -> contextlib.AbstractContextManager[None]:
        return _held_by_blocks(model, units, shards, group, tensors, reduce)

    return hold


@contextlib.contextmanager
def _held_by_blocks(
    model: torch.nn.Module,
    units: Units,
    shards: Shards,
    group: Any,
    tensors: dict[str, torch.Tensor],
    reduce: Reduction | None,
) -> Iterator[None]:
    """``model`` holding ``tensors`` (chunks): the root's gathered now, each block's as it runs."""
    split, in_blocks = shards.names, units.names
    root = gathered_together(
        {k: v for k, v in tensors.items() if k in split and k not in in_blocks}, shards, group, reduce
    )
    outer = {k: root.get(k, v) for k, v in tensors.items() if k not in in_blocks}
    with holding(model, outer), contextlib.ExitStack() as stack:
        for block, names in units.blocks:
            module = model.get_submodule(block)
            stack.enter_context(_gathering(module, block, names, shards, group, tensors, reduce))
        yield


@contextlib.contextmanager
def _gathering(
    module: torch.nn.Module,
    block: str,
    names: tuple[str, ...],
    shards: Shards,
    group: Any,
    tensors: dict[str, torch.Tensor],
    reduce: Reduction | None,
) -> Iterator[None]:
    """``module`` gathering its parameters' chunks each time it runs, and holding them from then on.

    Held until the step's hold ends, not only while the call runs: activation
    checkpointing runs the block's forward again inside the backward, without
    this wrapper (``transformers`` checkpoints a layer's ``forward`` itself), and
    reads the parameters the module holds then.
    """
    own = "forward" in module.__dict__
    original = module.forward
    prefix = len(block) + 1
    with contextlib.ExitStack() as held:

        def forward(*args: Any, **kwargs: Any) -> Any:
            split = {n: tensors[n] for n in names if n in shards.names}
            whole = {**{n: tensors[n] for n in names}, **gathered_together(split, shards, group, reduce)}
            held.enter_context(holding(module, {n[prefix:]: v for n, v in whole.items()}))
            return original(*args, **kwargs)

        module.forward = forward  # type: ignore[method-assign]
        try:
            yield
        finally:
            if own:
                module.forward = original  # type: ignore[method-assign]
            else:
                del module.forward
