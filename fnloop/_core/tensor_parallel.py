"""How a tensor-parallel state is split: ``TensorParallel``, plain data kept in ``TrainState.tensor``.

Each group of ``degree`` consecutive ranks holds one copy of the model with
its tensor-parallel layers split among them, Megatron-LM's layout: a
column-wise layer's output features (and bias), a row-wise layer's input
features, an embedding's vocabulary rows. Rank ``r`` of the group holds the
``r``-th of ``degree`` equal slices of each split dimension; a tensor made of
``parts`` projections side by side (GPT-2's fused query-key-value) holds the
``r``-th slice of each part, in order. The other tensors (norms, a row-wise
layer's bias) are whole on every rank. The groups are copies of one another:
data parallel across them.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from torch.utils import _pytree as pytree

from fnloop._core.shards import Shards

__all__ = ["SEQUENCE", "TensorParallel", "joined", "local_slice", "split_tensors", "whole_shape"]

SEQUENCE = ("sequence", "split", "gather")
"""The styles of sequence parallelism: with one of them in a plan, the activations between the layers are split on the sequence."""


@attrs.frozen(cache_hash=True)
class TensorParallel:
    """The layout of a tensor-parallel state: which layers are split, how, and which rank's slices this is.

    Args:
        degree: how many ranks split each layer (``T``); the world is
            ``degree`` times the number of copies.
        rank: this rank's place in its group, ``0 .. degree - 1``.
        layers: ``(module name, style, parts)`` for each split module: the
            style (``"colwise"``, ``"rowwise"``, ``"gathered"``, ``"vocab"``)
            says which dimension is split and which collective runs around it;
            under sequence parallelism, ``"sequence"`` for a module run on a
            slice of the sequence, ``"split"`` where the sequence is cut,
            ``"gather"`` where its slices are put together.
        divided: ``(module name, attribute)``: module attributes that count
            what is split (heads, a fused projection's width), divided by
            ``degree`` while the step runs.
        params: ``(parameter name, dimension, parts)`` for each split parameter.

    Examples:
        >>> t = TensorParallel(2, 1, (("fc", "colwise", 1),), (), (("fc.weight", 0, 1),))
        >>> t.split("fc.weight"), t.names
        ((0, 1), frozenset({'fc.weight'}))
    """

    degree: int
    rank: int
    layers: tuple[tuple[str, str, int], ...]
    divided: tuple[tuple[str, str], ...]
    params: tuple[tuple[str, int, int], ...]

    @property
    def names(self) -> frozenset[str]:
        """The split parameters' names."""
        return frozenset(name for name, _, _ in self.params)

    @property
    def sequence(self) -> bool:
        """Whether the activations between the layers are split on the sequence (sequence parallelism)."""
        return any(style in SEQUENCE for _, style, _ in self.layers)

    def split(self, name: str) -> tuple[int, int]:
        """``(dimension, parts)`` of the split parameter ``name``."""
        for n, dim, parts in self.params:
            if n == name:
                return dim, parts
        raise KeyError(name)

    def local_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of this rank's slice of the parameter ``name`` whose whole shape is ``shape``.

        Examples:
            >>> TensorParallel(2, 0, (), (), (("fc.weight", 1, 1),)).local_shape("fc.weight", (4, 6))
            (4, 3)
        """
        if name not in self.names:
            return tuple(shape)
        dim, _ = self.split(name)
        return (*shape[:dim], shape[dim] // self.degree, *shape[dim + 1 :])


def local_slice(whole: torch.Tensor, dim: int, parts: int, degree: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s slice of ``whole`` on ``dim``: the ``rank``-th of ``degree`` slices of each of its ``parts`` (a new tensor).

    Examples:
        >>> local_slice(torch.arange(12).view(2, 6), 1, 3, 2, 1)
        tensor([[ 1,  3,  5],
                [ 7,  9, 11]])
    """
    shape = whole.shape
    pieces = whole.reshape(*shape[:dim], parts, degree, shape[dim] // (parts * degree), *shape[dim + 1 :])
    mine = pieces.select(dim + 1, rank)
    return mine.reshape(*shape[:dim], shape[dim] // degree, *shape[dim + 1 :]).clone()


def joined(slices: list[torch.Tensor], dim: int, parts: int) -> torch.Tensor:
    """The whole tensor of every rank's slice (``local_slice``'s), in rank order.

    Examples:
        >>> whole = torch.arange(12).view(2, 6)
        >>> bool((joined([local_slice(whole, 1, 3, 2, r) for r in range(2)], 1, 3) == whole).all())
        True
    """
    pieces = [s.chunk(parts, dim) for s in slices]
    return torch.cat([pieces[r][p] for p in range(parts) for r in range(len(slices))], dim)


def whole_shape(
    t: torch.Tensor, tensor: TensorParallel, shards: Shards | None, split: str | None, chunked: str | None
) -> torch.Size:
    """The shape of the whole tensor ``t`` is a rank's part of: the rows of ``chunked``'s chunk put back
    (``shards``' padding cut), then the slices of ``split`` joined; ``None``: not a chunk, not a slice.

    Examples:
        >>> tp = TensorParallel(2, 0, (), (), (("w", 1, 1),))
        >>> whole_shape(torch.empty(3, 4), tp, Shards("full", 2, 0, {"w": 5}), "w", "w")
        torch.Size([5, 8])
    """
    shape = list(t.shape)
    if chunked is not None and shards is not None:
        shape[0] = shards.whole(chunked)
    if split is not None:
        dim, _ = tensor.split(split)
        shape[dim] *= tensor.degree
    return torch.Size(shape)


def split_tensors(
    params: Any, opt_state: Any, tensor: TensorParallel, shards: Shards | None = None
) -> dict[int, str]:
    """``id(tensor) -> parameter name`` for every tensor of ``params`` and ``opt_state`` that holds a slice.

    An optimizer state's leaf is one when it sits under a key naming a split
    parameter and has that slice's shape (``mu['fc.weight']``), or where the
    state is sharded too (``shards``), that of this rank's chunk of the slice.
    """
    split = tensor.names
    found = {id(params[name]): name for name in split if name in params}
    for path, leaf in pytree.tree_flatten_with_path(opt_state)[0]:
        if not isinstance(leaf, torch.Tensor) or leaf.ndim == 0:
            continue
        names = [k.key for k in path if isinstance(k, pytree.MappingKey) and k.key in split]
        if not names or names[-1] not in params:
            continue
        name, shape = names[-1], params[names[-1]].shape
        if shards is not None and name in shards.names:
            shape = torch.Size((shards.rows_per_rank(name), *shape[1:]))
        if leaf.shape == shape:
            found[id(leaf)] = name
    return found
