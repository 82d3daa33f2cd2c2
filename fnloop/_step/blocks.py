"""Block by block: a sharded step that gathers each block's parameters only while the block runs.

With ``shard="full"`` each rank holds its chunks of the parameters. The
gather-everything step (``sharding.py``) all-gathers every parameter before
the forward and keeps them for the whole step, so a rank's peak holds the
whole model. Here, as FSDP2 with ``fully_shard`` on each layer, the model is
cut into units: each block (``units_of``), and the root (what no block
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
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch

from fnloop._core.messages import got
from fnloop._core.shards import Shards
from fnloop._step.accumulate import accumulated
from fnloop._step.invariant import ranks_tree, sliced
from fnloop._step.kernel import Gradient, Grads, Kernel, _holding, value_and_grad
from fnloop._step.replicas import averaged
from fnloop._step.sharding import Groups, _by_dtype, _done, across_copies, all_reduced_mean

__all__ = ["Units", "blockwise_gradient", "blockwise_sliced", "gathered_together", "units_of"]

Blocks = Sequence[str | type[torch.nn.Module]] | None
"""What ``train_step(..., blocks=...)`` takes: module names or classes; ``None`` finds them; ``()`` none."""


@attrs.frozen
class Units:
    """The blocks a sharded step gathers one at a time: each block's module name and its parameters' names.

    A parameter belongs to a block when every name it goes by (tied
    weights have several) is inside the block; the others are the root's,
    gathered for the whole forward.
    """

    blocks: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def names(self) -> frozenset[str]:
        """Every parameter some block holds."""
        return frozenset(name for _, names in self.blocks for name in names)

    def __bool__(self) -> bool:
        return bool(self.blocks)


def units_of(model: torch.nn.Module, blocks: Blocks = None) -> Units:
    """The blocks of ``model``: those ``blocks`` names (module names, or classes), or else found.

    Found: the modules ``transformers`` names in ``model._no_split_modules``
    (its decoder layers), or else the children of each ``nn.ModuleList``;
    outermost only (a block inside a block is the outer one's).

    Examples:
        >>> layers = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(2))
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(layers))
        >>> [name for name, _ in units_of(model).blocks]
        ['1.0.0', '1.0.1']
        >>> units_of(model, [torch.nn.Linear]).blocks[0]
        ('0', ('0.weight', '0.bias'))
        >>> bool(units_of(model, ()))
        False
    """
    modules = dict(model.named_modules())
    chosen = _found(model, modules) if blocks is None else _named(blocks, modules)
    outermost = [m for m in chosen if not any(m.startswith(o + ".") for o in chosen if o != m)]
    aliases: dict[str, list[str]] = {}  # the name a parameter is kept under -> every name it goes by
    canonical = {id(p): n for n, p in model.named_parameters()}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(canonical[id(p)], []).append(name)
    units = []
    for block in outermost:
        inside = tuple(
            name for name, names in aliases.items() if all(alias.startswith(block + ".") for alias in names)
        )
        if inside:
            units.append((block, inside))
    return Units(tuple(units))


def _found(model: torch.nn.Module, modules: Mapping[str, torch.nn.Module]) -> list[str]:
    kinds = set(getattr(model, "_no_split_modules", None) or ())
    if kinds:
        named = [name for name, m in modules.items() if name and type(m).__name__ in kinds]
        if named:
            return named
    return [
        f"{name}.{child}" if name else child
        for name, m in modules.items()
        if isinstance(m, torch.nn.ModuleList)
        for child in m._modules
    ]


def _named(blocks: Sequence[Any], modules: Mapping[str, torch.nn.Module]) -> list[str]:
    if isinstance(blocks, (str, type)) or not isinstance(blocks, Sequence):
        raise TypeError(
            "train_step(blocks=...) must be a list of module names or module classes, () to gather "
            f"every parameter at once, or None to find the blocks ({got(blocks)})."
        )
    chosen: list[str] = []
    for block in blocks:
        if isinstance(block, str):
            if block not in modules or not block:
                near = [n for n in modules if n and n.split(".")[-1] == block.split(".")[-1]][:3]
                raise ValueError(
                    f"train_step(blocks=...): the model has no submodule named {block!r}"
                    + (f" (some it has: {near})" if near else "")
                    + "; name them as model.named_modules() does, for example 'layers.0'."
                )
            chosen.append(block)
        elif isinstance(block, type) and issubclass(block, torch.nn.Module):
            found = [n for n, m in modules.items() if n and isinstance(m, block)]
            if not found:
                raise ValueError(
                    f"train_step(blocks=...): the model has no submodule of class {block.__qualname__}."
                )
            chosen += found
        else:
            raise TypeError(
                f"train_step(blocks=...): each block is a module name or a module class ({got(block)})."
            )
    return list(dict.fromkeys(chosen))


class _Gather(torch.autograd.Function):
    """All-gather of a flat chunk whose gradient is the reduce-scatter (sum) of the whole's.

    ``tree``: the sum over the ranks in ``slice_tree``'s order instead
    (``ranks_tree``), the same bits at any world size (``invariant.py``).
    """

    @staticmethod
    def forward(ctx: Any, flat: torch.Tensor, group: Any, tree: bool) -> torch.Tensor:  # type: ignore[override]
        import torch.distributed._functional_collectives as funcol

        ctx.group, ctx.tree = group, tree
        gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
        return _done(gather(flat, 0, group))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        import torch.distributed._functional_collectives as funcol

        if ctx.tree:
            return ranks_tree(grad, ctx.group), None, None
        scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
        return _done(scatter(grad.contiguous(), "sum", 0, ctx.group)), None, None


def gathered_together(
    chunks: Mapping[str, torch.Tensor], shards: Shards, group: Any, tree: bool = False
) -> dict[str, torch.Tensor]:
    """The whole tensors of ``chunks``, in one all-gather per dtype of them all end to end (FSDP2's copy-in).

    Differentiable: the gradient of each chunk is this rank's rows of the sum
    over ranks of the whole's gradient, in one reduce-scatter per dtype.

    ``tree`` (a world-size-invariant step's): one gather per tensor, whose
    backward is an all-to-all and ``ranks_tree``'s fixed order. Each
    gradient then leaves the backward as its own tensor, computed as a whole
    state's is: put end to end with others, inductor compiled some of the
    reductions that make them otherwise (a few gradients of a GPT-2 about
    ``1e-9`` off the whole state's), and the run was no longer the same bits.
    """
    world = shards.world
    out = {}
    if tree:
        for name, chunk in chunks.items():
            whole = _Gather.apply(chunk.reshape(-1), group, True).view(
                world * chunk.shape[0], *chunk.shape[1:]
            )
            out[name] = whole[: shards.whole(name)]
        return out
    for names in _by_dtype(chunks).values():
        flat = torch.cat([chunks[n].reshape(-1) for n in names])
        by_rank = _Gather.apply(flat, group, False).view(world, -1)
        for name, part in zip(names, by_rank.split([chunks[n].numel() for n in names], dim=1)):
            shape = chunks[name].shape
            out[name] = part.reshape(world * shape[0], *shape[1:])[: shards.whole(name)]
    return out


def blockwise_gradient(kernel: Kernel, units: Units, shards: Shards, groups: Groups) -> Gradient:
    """The gradient stage of a ``"full"`` sharded state, block by block: ``(chunks, buffers, batch) -> Grads``.

    The gradients are this rank's chunks of the mean over ranks; the loss,
    the metrics and the floating buffers are averaged as data parallel's.
    """

    def hold(tensors: dict[str, torch.Tensor]) -> contextlib.AbstractContextManager[None]:
        return _held_by_blocks(kernel.model, units, shards, groups.shard, tensors)

    gradient = accumulated(value_and_grad(kernel.forward, kernel.fixed, hold=hold), kernel.accumulate)
    split = shards.names

    def gradient_of_chunks(
        params: dict, buffers: dict, batch: Any, scale: torch.Tensor | None = None
    ) -> Grads:
        found = averaged(gradient(params, buffers, batch, scale), groups.every, grads=False)
        # The chunks' gradients are sums within this copy (each gather's backward is a reduce-scatter).
        chunks = across_copies({k: g for k, g in found.grads.items() if k in split}, groups)
        whole = all_reduced_mean(
            {k: g for k, g in found.grads.items() if k not in split}, groups.every, groups.size
        )
        return found._replace(grads={k: chunks[k] if k in chunks else whole[k] for k in found.grads})

    return gradient_of_chunks


def blockwise_sliced(kernel: Kernel, units: Units, shards: Shards, groups: Groups) -> Gradient:
    """The gradient stage of a ``"full"`` sharded state, block by block, world-size-invariant (``invariant.py``).

    Each of this rank's slices runs block by block, and each block's gather's
    backward adds that slice's gradients over the ranks in ``slice_tree``'s
    order (``ranks_tree``) as soon as they exist, where the reduce-scatter
    would; the sums over this rank's slices of the chunks follow.
    """
    assert kernel.slices is not None

    def hold(tensors: dict[str, torch.Tensor]) -> contextlib.AbstractContextManager[None]:
        return _held_by_blocks(kernel.model, units, shards, groups.shard, tensors, tree=True)

    gradient = value_and_grad(kernel.forward, kernel.fixed, hold=hold)
    return sliced(gradient, kernel.slices, groups.every, shards, summed=True, low_bits=True)


@contextlib.contextmanager
def _held_by_blocks(
    model: torch.nn.Module,
    units: Units,
    shards: Shards,
    group: Any,
    tensors: dict[str, torch.Tensor],
    tree: bool = False,
) -> Iterator[None]:
    """``model`` holding ``tensors`` (chunks): the root's gathered now, each block's as it runs."""
    split, in_blocks = shards.names, units.names
    root = gathered_together(
        {k: v for k, v in tensors.items() if k in split and k not in in_blocks}, shards, group, tree
    )
    outer = {k: root.get(k, v) for k, v in tensors.items() if k not in in_blocks}
    with _holding(model, outer), contextlib.ExitStack() as stack:
        for block, names in units.blocks:
            module = model.get_submodule(block)
            stack.enter_context(_gathering(module, block, names, shards, group, tensors, tree))
        yield


@contextlib.contextmanager
def _gathering(
    module: torch.nn.Module,
    block: str,
    names: tuple[str, ...],
    shards: Shards,
    group: Any,
    tensors: dict[str, torch.Tensor],
    tree: bool,
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
            whole = {**{n: tensors[n] for n in names}, **gathered_together(split, shards, group, tree)}
            held.enter_context(_holding(module, {n[prefix:]: v for n, v in whole.items()}))
            return original(*args, **kwargs)

        module.forward = forward  # type: ignore[method-assign]
        try:
            yield
        finally:
            if own:
                module.forward = original  # type: ignore[method-assign]
            else:
                del module.forward
