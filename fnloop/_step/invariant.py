"""The world-size-invariant step: the same bits at any number of ranks that divides the slices.

``train_step(..., invariant=G)`` cuts every global batch into ``G`` fixed
slices of equal rows. Rank ``r`` of ``W`` holds rows ``r*B/W .. (r+1)*B/W``
of the global batch (what ``fnloop.data.batches`` gives it), which are
slices ``r*S .. r*S+S-1`` (``S = G/W``); it runs the gradient stage on each
of its slices in turn, at the slice's shape whatever ``W``, each from the
same buffers and each drawing its random numbers from the slice's own seed
(``step_seed(seed, iteration, slice)``: dropout masks belong to the rows, not
to the rank). Then every value the slices found (gradients, loss, metrics,
floating buffers) is summed over the ``G`` slices in one fixed tree, the same
at every ``W``:

* put end to end per dtype, each slice's values are cut into ``W`` chunks;
* an all-to-all gives rank ``r`` chunk ``r`` of every slice, ``[G, P/W]``;
* the rows are added pairwise in one fixed order (``tree_sum``) and divided by ``G``;
* an all-gather gives every rank the whole mean.

Each element is the same sum of the same values in the same order at any
``W``, so the mean is the same bits, and the update that follows too. At
``W = 1`` there is nothing to exchange. Where ``G`` and ``W`` are powers of
two, a rank's slices are one subtree of the tree: it adds them itself and
sends one row, so a rank sends ``2 P`` bytes in all, as for an all-reduce;
otherwise it sends its slices' values once, plus the mean: ``(S + 1) P``.

A running buffer (BatchNorm's statistics) is the mean over the slices of
each slice's update from the same old buffer: not the sequential updates of
micro-batches. An integer buffer (a counter) is the first slice's: every
slice counts the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

from fnloop._compile import Draws
from fnloop._step.accumulate import micro_batches
from fnloop._step.kernel import Gradient, Grads, _device
from fnloop._step.seeds import slice_seeded

__all__ = ["divisors", "sliced", "tree_sum"]


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


def sliced(gradient: Gradient, slices: int, group: Any) -> Gradient:
    """``gradient`` run on this rank's slices of the global batch, and the mean of all ``slices`` slices' results.

    ``group``: the ranks (``None``: one process, every slice here).
    """
    world = 1 if group is None else torch.distributed.get_world_size(group)
    rank = 0 if group is None else torch.distributed.get_rank(group)
    per = slices // world

    def sliced_gradient(params: dict, buffers: dict, batch: Any, scale: torch.Tensor | None = None) -> Grads:
        _check_rows(batch, per, slices, world)
        found = []
        for j, part in enumerate(micro_batches(batch, per)):
            with _drawing(rank * per + j, _device(params)):
                found.append(gradient(params, {k: v.clone() for k, v in buffers.items()}, part, scale))
        return _mean(found, slices, group)

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


@contextlib.contextmanager
def _drawing(g: int, device: torch.device) -> Iterator[None]:
    """Slice ``g``'s random numbers: traced, from the step's ``g``-th seed input; eager, from the generator seeded for it."""
    draws = Draws.current()
    if draws is None:
        with slice_seeded(device, g):
            yield
        return
    seeds = draws.seed
    if seeds.ndim != 1:
        raise RuntimeError(f"a world-size-invariant step traced with a seed of shape {tuple(seeds.shape)}")
    with draws.from_(seeds[g]):
        yield


def _mean(found: list[Grads], slices: int, group: Any) -> Grads:
    """The mean over the ``slices`` slices of the values ``found`` (this rank's slices), the same at any world size."""
    first = found[0]
    keys: list[tuple[str, str]] = [
        *(("g", k) for k in first.grads),
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
    out: dict[tuple[str, str], torch.Tensor] = {}
    for entries in by_dtype.values():
        rows = [torch.cat([value(f, k).reshape(-1) for k in entries]) for f in found]
        mean = _exchanged_sum(rows, slices, group) / slices
        shapes = [value(first, k) for k in entries]
        for key, part, like in zip(entries, mean.split([t.numel() for t in shapes]), shapes):
            out[key] = part.view(like.shape)
    return Grads(
        {k: out["g", k] for k in first.grads},
        {k: out.get(("b", k), v) for k, v in first.buffers.items()},
        out["l", ""],
        {k: out["m", k] for k in first.metrics},
    )


def _exchanged_sum(rows: list[torch.Tensor], slices: int, group: Any) -> torch.Tensor:
    """The tree sum over all ``slices`` slices of the flat values ``rows`` (this rank's slices, in order)."""
    if group is None:
        return tree_sum(rows)
    import torch.distributed._functional_collectives as funcol

    world = torch.distributed.get_world_size(group)
    if len(rows) > 1 and _power_of_two(slices) and _power_of_two(world):
        # This rank's slices are one subtree of the tree (both counts powers of two): its sum here is
        # the tree's own, and the ranks exchange one row each, the bytes of an all-reduce.
        rows = [tree_sum(rows)]
    size = rows[0].numel()
    chunk = -(-size // world)
    # [S, P] -> [W, S, P/W]: block k goes to rank k, holding chunk k of each of this rank's slices.
    mine = torch.stack([torch.nn.functional.pad(r, (0, chunk * world - size)) for r in rows])
    blocks = mine.view(len(rows), world, chunk).transpose(0, 1).contiguous()
    got = funcol.all_to_all_single(blocks.view(-1), None, None, group)
    # From rank k, its rows in order (its slices k*S .. k*S+S-1, or their sum): the tree's rows in order.
    mine_of_all = got.view(world * len(rows), chunk)
    summed = tree_sum(list(mine_of_all.unbind(0)))
    whole = funcol.all_gather_tensor(summed, 0, group)
    return whole[:size]


def _power_of_two(n: int) -> bool:
    return n & (n - 1) == 0
