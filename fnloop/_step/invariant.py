"""The world-size-invariant step: the same bits at any number of ranks that divides the slices.

``train_step(..., invariant=G)`` cuts every global batch into ``G`` fixed
slices of equal rows. Rank ``r`` of ``W`` holds rows ``r*B/W .. (r+1)*B/W``
of the global batch (what ``fnloop.data.batches`` gives it), which are
slices ``r*S .. r*S+S-1`` (``S = G/W``); it runs the gradient stage on each
of its slices in turn, at the slice's shape whatever ``W``, each from the
same buffers and each drawing its random numbers from the slice's own seed
(``slice_seeds``: dropout masks belong to the rows, not to the rank). Then every value the slices found (gradients, loss, metrics,
floating buffers) is summed over the ``G`` slices in one fixed tree, the same
at every ``W``:

* put end to end per dtype, each slice's values are cut into ``W`` chunks;
* an all-to-all gives rank ``r`` chunk ``r`` of every slice, ``[G, P/W]``;
* the rows are added pairwise in one fixed tree (``tree_sum``) and divided by ``G``;
* an all-gather gives every rank the whole mean.

Each element is the same sum of the same values in the same order at any
``W``, so the mean is the same bits, and the update that follows too. At
``W = 1`` there is nothing to exchange. Where ``G`` and ``W`` are powers of
two, a rank's slices are one subtree of the tree: it adds them itself and
sends one row, so a rank sends ``2 P`` bytes in all, as for an all-reduce;
otherwise it sends its slices' values once, plus the mean: ``(S + 1) P``.

A ``"full"`` state of a model in blocks, with ``G`` a power of two, adds its
slices in another fixed tree, which pairs them by their low bits first
(``slice_tree``): the ``j``-th slices of all ranks are then one subtree at any
``W``, and each slice's block gradients are added over the ranks inside that
slice's backward (``ranks_tree``, which the placement gives the blocks'
gathers as their reduction, ``blocks.py``), as its reduce-scatter would. Its
runs are the same bits at any world size as one another, not as a whole
state's (another tree).

A running buffer (BatchNorm's statistics) is the mean over the slices of
each slice's update from the same old buffer: not the sequential updates of
micro-batches. An integer buffer (a counter) is the first slice's: every
slice counts the same.

A sharded state (``init(..., shard=...)``) runs the same slices on the whole
parameters (a ``"full"`` state's gathered first, all at once, or block by
block as above). Of a sharded
parameter's gradient, rank ``r`` is sent the rows of its chunk of every
slice's, and keeps their tree sum: the all-to-all and the tree stand for the
reduce-scatter, and nothing is gathered back. The update's sums over the
whole model (a global norm's, the statistics') are each tensor's rows' sums
of squares, gathered from the ranks that hold them and added pairwise in one
order (``RowSquares``): every element of the state is then the same bits at
any world size, and (but block by block) the same as a whole state's.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
from torch.utils import _pytree as pytree

from fnloop._compile import Draws
from fnloop._core.messages import got
from fnloop._core.shards import Shards
from fnloop._core.tensor_parallel import TensorParallel
from fnloop._step import collectives
from fnloop._step.collectives import all_gather, all_to_all, done
from fnloop._step.kernel import Gradient, Grads, _device
from fnloop._step.rows import micro_batches
from fnloop._step.seeds import slice_seeded, slice_seeds, step_seed_of

__all__ = [
    "WHOLE",
    "RowSquares",
    "checked_slices",
    "checked_world",
    "divisors",
    "pairwise_sum",
    "power_of_two",
    "ranks_tree",
    "slice_tree",
    "sliced",
    "tree_sum",
]


WHOLE = Shards("full", world=1, rank=0, rows=())
"""The chunking of a whole state: no tensor is a chunk."""


def divisors(n: int) -> list[int]:
    """The world sizes a step of ``n`` slices runs at.

    Examples:
        >>> divisors(8)
        [1, 2, 4, 8]
    """
    return [d for d in range(1, n + 1) if n % d == 0]


def tree_sum(rows: list[torch.Tensor]) -> torch.Tensor:
    """The sum of ``rows`` in one fixed tree: the first half's sum plus the second's, down to single rows.

    Examples:
        >>> tree_sum([torch.tensor(1.0), torch.tensor(2.0), torch.tensor(3.0)])
        tensor(6.)
    """
    if len(rows) == 1:
        return rows[0]
    half = (len(rows) + 1) // 2
    return tree_sum(rows[:half]) + tree_sum(rows[half:])


def slice_tree(rows: list[torch.Tensor]) -> torch.Tensor:
    """The sum of the slices' ``rows`` (in slice order) in the tree of a ``"full"`` state in blocks.

    Where their count is a power of two, the tree pairs the slices by their
    low bits first: it is ``tree_sum`` of the rows in bit-reversed order. At
    any world size ``W`` (a power of two too) the slices ``j, S + j, 2S + j, ...``,
    the ``j``-th of each rank's ``S``, are then one subtree, and the tree is
    ``slice_tree`` over ``j`` of ``slice_tree`` over the ranks: a step can add
    each of its slices over the ranks as soon as that slice's backward is done
    (block by block, ``blocks.py``). Otherwise ``tree_sum`` of the rows in order.

    Examples:
        >>> slice_tree([torch.tensor(float(2**k)) for k in range(4)])  # (1 + 4) + (2 + 8)
        tensor(15.)
    """
    n = len(rows)
    if n == 1 or not power_of_two(n):
        return tree_sum(rows)
    bits = n.bit_length() - 1
    return tree_sum([rows[int(f"{i:0{bits}b}"[::-1], 2)] for i in range(n)])


def sliced(
    gradient: Gradient,
    slices: int,
    group: Any,
    chunks: Shards = WHOLE,
    summed: bool = False,
    low_bits: bool = False,
) -> Gradient:
    """``gradient`` run on this rank's slices of the global batch, and the mean of all ``slices`` slices' results.

    ``group``: the ranks (``None``: one process, every slice here). ``chunks``:
    which parameters' gradients this rank keeps its chunks of (a sharded
    state's names and rows; ``WHOLE``: none), the others' values every rank
    has whole. ``summed``: the
    gradient stage gives those chunks summed over the ranks already, each
    slice's (``slice_tree`` over the ranks, block by block). ``low_bits``: the
    slices are added in ``slice_tree``'s order (a ``"full"`` state in blocks'),
    else in ``tree_sum``'s, where a rank adds its own slices first.
    """
    world = 1 if group is None else torch.distributed.get_world_size(group)
    rank = 0 if group is None else torch.distributed.get_rank(group)
    per = slices // world

    def sliced_gradient(params: dict, buffers: dict, batch: Any, scale: torch.Tensor | None = None) -> Grads:
        _check_rows(batch, per, slices, world)
        drawing = _drawing(slices, _device(params))
        found = []
        for j, part in enumerate(micro_batches(batch, per)):
            with drawing(rank * per + j):
                found.append(gradient(params, {k: v.clone() for k, v in buffers.items()}, part, scale))
        return _mean(found, slices, group, chunks, summed, low_bits)

    return sliced_gradient


def _check_rows(batch: Any, per: int, slices: int, world: int) -> None:
    for leaf in pytree.tree_leaves(batch):
        if isinstance(leaf, torch.Tensor) and (leaf.ndim == 0 or leaf.shape[0] % per):
            rows = leaf.shape[0] if leaf.ndim else 0
            raise ValueError(
                f"train_step(invariant={slices}) at {world} rank(s): this rank's batch has a tensor of "
                f"{rows} rows, which does not cut into its {per} slice(s) of the global batch of "
                f"{rows * world}. Give a global batch size divisible by {slices} (every tensor of "
                "the batch has the batch's rows first)."
            )


def _drawing(slices: int, device: torch.device) -> Callable[[int], contextlib.AbstractContextManager[Any]]:
    """Where slice ``g`` draws its random numbers: traced, from the step's ``g``-th seed input; eager, from the generator seeded for it."""
    draws = Draws.current()
    if draws is None:  # eager: inside seeded, the generator holds the step's seed
        seeds = slice_seeds(step_seed_of(device), slices)
        return lambda g: slice_seeded(device, seeds[g])
    given = draws.seed
    if given.ndim != 1:
        raise RuntimeError(f"a world-size-invariant step traced with a seed of shape {tuple(given.shape)}")
    return lambda g: draws.from_(given[g])


def _mean(found: list[Grads], slices: int, group: Any, chunks: Shards, summed: bool, low_bits: bool) -> Grads:
    """The mean over the ``slices`` slices of the values ``found`` (this rank's slices), the same at any world size.

    A sharded parameter's gradient is this rank's chunk of the mean (its rows,
    zero-padded as the state's chunks are); every other value is whole.
    ``summed``: the chunks found are each slice's sum over the ranks already.
    """
    first = found[0]
    split = chunks.names
    world = 1 if group is None else torch.distributed.get_world_size(group)
    out: dict[tuple[str, str], torch.Tensor] = {}
    if summed:  # each slice's chunks summed over the ranks already: left, the tree over the slices
        for name in [k for k in first.grads if k in split]:
            out["g", name] = slice_tree([f.grads[name] for f in found]) / slices
        split = frozenset()
    keys: list[tuple[str, str]] = [
        *(("g", k) for k in first.grads if ("g", k) not in out),
        ("l", ""),
        *(("m", k) for k in first.metrics),
        *(("b", k) for k, v in first.buffers.items() if v.is_floating_point()),
    ]

    def value(f: Grads, key: tuple[str, str]) -> torch.Tensor:
        kind, name = key
        if kind == "g":
            return f.grads[name]
        if kind == "l":
            return f.loss
        if kind == "m":
            return f.metrics[name].float()
        return f.buffers[name]

    by_dtype: dict[torch.dtype, list[tuple[str, str]]] = {}
    for key in keys:
        by_dtype.setdefault(value(first, key).dtype, []).append(key)
    for entries in by_dtype.values():
        chunked = [k for k in entries if k[0] == "g" and k[1] in split]
        whole = [k for k in entries if k not in chunked]
        rows = [chunks.rows_per_rank(k[1]) for k in chunked]
        size = sum(value(first, k).numel() for k in whole)
        blocks = [
            _blocks([value(f, k) for k in chunked], rows, [value(f, k) for k in whole], world) for f in found
        ]
        mine = _exchanged_sum(blocks, slices, group, low_bits) / slices
        widths = [n * value(first, k)[0].numel() for k, n in zip(chunked, rows)]
        *parts, rest = mine.split([*widths, mine.numel() - sum(widths)])
        for key, part, n in zip(chunked, parts, rows):
            out[key] = part.view(n, *value(first, key).shape[1:])
        if group is not None and whole:
            rest = all_gather(rest, group)
        for key, part in zip(whole, rest[:size].split([value(first, k).numel() for k in whole])):
            out[key] = part.view(value(first, key).shape)
    return Grads(
        {k: out["g", k] for k in first.grads},
        {k: out.get(("b", k), v) for k, v in first.buffers.items()},
        out["l", ""],
        {k: out["m", k] for k in first.metrics},
    )


def _blocks(
    chunked: list[torch.Tensor], rows: list[int], whole: list[torch.Tensor], world: int
) -> torch.Tensor:
    """One slice's values as ``[W, n]``: block ``k`` is what rank ``k`` keeps the sum of.

    Its rows of each ``chunked`` gradient (``rows`` each, the chunks' padding
    zeros), then its part of the ``whole`` values put end to end.
    """
    rowed = [_padded(t, world * n).reshape(world, -1) for t, n in zip(chunked, rows)]
    flat = torch.cat([t.reshape(-1) for t in whole]) if whole else chunked[0].new_zeros(0)
    width = -(-flat.numel() // world)
    return torch.cat([*rowed, _padded(flat, world * width).view(world, width)], dim=1)


def _padded(value: torch.Tensor, rows: int) -> torch.Tensor:
    """``value`` with zero rows added up to ``rows``."""
    missing = rows - value.shape[0]
    return value if not missing else torch.cat([value, value.new_zeros((missing, *value.shape[1:]))])


def _exchanged_sum(blocks: list[torch.Tensor], slices: int, group: Any, low_bits: bool) -> torch.Tensor:
    """This rank's block of the tree sum over all ``slices`` slices, given this rank's slices' ``[W, n]`` blocks."""
    tree = slice_tree if low_bits else tree_sum
    if group is None:
        return tree([b[0] for b in blocks])
    world = torch.distributed.get_world_size(group)
    if not low_bits and len(blocks) > 1 and power_of_two(slices) and power_of_two(world):
        # This rank's slices are one subtree of tree_sum (both counts powers of two): its sum here is
        # the tree's own, and the ranks exchange one row each, the bytes of an all-reduce.
        blocks = [tree_sum(blocks)]
    # [S, W, n] -> [W, S, n]: rank k gets block k of each of this rank's slices.
    sent = torch.stack(blocks).transpose(0, 1).contiguous()
    got = all_to_all(sent.view(-1), group)
    # From rank k, its slices k*S .. k*S+S-1 (or their sum): the tree's rows, in slice order.
    return tree(list(got.view(world * len(blocks), -1).unbind(0)))


def ranks_tree(grad: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's chunk of the sum over the ranks of ``grad`` (``[W * n]``, rank ``k``'s chunk ``k``-th), in ``slice_tree``'s order.

    The reduce-scatter of a world-size-invariant step that adds one slice's
    gradients over the ranks as its backward runs: an all-to-all, then the
    ranks' rows added in the subtree ``slice_tree`` gives them.
    """
    world = torch.distributed.get_world_size(group)
    got = all_to_all(grad.contiguous(), group)
    return slice_tree(list(got.view(world, -1).unbind(0)))


@attrs.frozen(eq=False)
class RowSquares:
    """The sums over the whole model of a world-size-invariant step's update (``SquaresSum``).

    A tensor's sum of squares is the sum of its rows' sums of squares, and
    each row is whole on one rank: a sharded tensor's rows' sums are gathered
    from every rank, padding cut off, so the vector of rows, and the pairwise
    sum of it, is the same at any world size, sharded or not.

    ``chunks``: which tensors are chunks (``WHOLE``: none). ``group``: the
    ranks sharing the chunks (``None``: one process, or a whole state).
    """

    chunks: Shards
    group: Any

    def __call__(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed over the ranks holding chunks (a count of non-finite gradients, say)."""
        if self.group is None:
            return value
        return done(collectives.summed(value, self.group))

    def squares(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        rows = {k: _row_squares(t, dtype) for k, t in tensors.items()}
        chunked = [k for k in rows if k in self.chunks.names]
        if chunked and self.group is not None:
            every = all_gather(torch.cat([rows[k] for k in chunked]), self.group)
            by_rank = every.view(self.chunks.world, -1).split([rows[k].numel() for k in chunked], dim=1)
            for k, part in zip(chunked, by_rank):
                rows[k] = part.reshape(-1)[: self.chunks.whole(k)]
        return torch.stack([pairwise_sum(r) for r in rows.values()])

    def statistics(self, tensors: Mapping[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
        """For ``Squares``: each tensor's whole sum of squares, the same bits at any world size."""
        return dict(zip(names, self.squares({n: tensors[n] for n in names}, torch.float32).unbind()))


def _row_squares(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each row's sum of squares (a 0-d tensor is one row), in ``dtype``."""
    flat = tensor.to(dtype).reshape(tensor.shape[0] if tensor.ndim else 1, -1)
    return flat.square().sum(1) if flat.shape[1] else flat.new_zeros(flat.shape[0])


def pairwise_sum(values: torch.Tensor) -> torch.Tensor:
    """The sum of a vector's elements by halving it with elementwise adds: one fixed tree for a length.

    A reduction kernel's order of adds may change with how its input was laid
    out or fused; an elementwise add cannot.

    Examples:
        >>> pairwise_sum(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]))
        tensor(15.)
    """
    while values.numel() > 1:
        half = values.numel() // 2
        values = torch.cat([values[:half] + values[half : 2 * half], values[2 * half :]])
    return values.reshape(()) if values.numel() else values.new_zeros(())


def power_of_two(n: int) -> bool:
    """Whether ``n`` (positive) is a power of two: slices whose ``slice_tree`` lets each be summed over the ranks alone."""
    return n & (n - 1) == 0


def checked_world(slices: int, world: int, tensor: TensorParallel | None) -> None:
    """The ``slices`` shared out equally over the ``world`` data-parallel ranks (a ``tensor``-parallel copy is one)."""
    if slices % world == 0:
        return
    fit = divisors(slices)
    ranks = f"{world} ranks" if tensor is None else f"{world} data-parallel copies of T={tensor.degree}"
    size, sizes = (
        ("world size", "world sizes") if tensor is None else ("number of copies", "numbers of copies")
    )
    raise ValueError(
        f"train_step(invariant={slices}) at {ranks}: the {slices} slices of a batch cannot be "
        f"shared out equally, so this run runs at {sizes} {fit} only. Run at one of those, or "
        f"choose an invariant that every {size} the run will meet divides (here "
        f"{math.lcm(slices, world)}, the same in every launch)."
    )


def checked_slices(slices: object, accumulate: int) -> int:
    """``train_step(invariant=...)`` checked against ``accumulate`` (the world size is ``Plan.check``'s: a layout's)."""
    if type(slices) is not int or slices < 1:
        raise ValueError(f"'invariant' must be a positive int ({got(slices)}).")
    if accumulate != 1:
        raise ValueError(
            f"train_step(invariant={slices}, accumulate={accumulate}): under invariant, a rank runs its "
            "slices of the batch one after the other already, as micro-batches. Leave accumulate out, "
            "and raise invariant for smaller slices."
        )
    return slices
