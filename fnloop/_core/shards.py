"""How a sharded state is split across ranks: ``Shards``, plain data kept in ``TrainState.shards``.

A sharded tensor is split on its first dimension, as FSDP2's ``Shard(0)``:
the rows are padded with zeros to a multiple of the world size, and rank
``r`` holds the ``r``-th of as many equal chunks (``rows_per_rank``). The
padding stays zero through training (its gradient is zero, and so is every
update of a zero row the library's optimizers make), so a chunk is exactly
the rows it names and nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch
from torch.utils import _pytree as pytree

from fnloop._core.messages import got

__all__ = ["MODES", "Shards", "chunk", "sharded_tensors"]

MODES = ("full", "optimizer")
"""``full``: parameters, gradients and optimizer state sharded (FSDP2's ``fully_shard``, ZeRO-3).
``optimizer``: gradients and optimizer state sharded, parameters whole on every rank (ZeRO-2)."""


def _pairs(rows: Mapping[str, int] | tuple[tuple[str, int], ...]) -> tuple[tuple[str, int], ...]:
    return tuple(rows.items()) if isinstance(rows, Mapping) else tuple(rows)


def _mode(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if value not in MODES:
        raise ValueError(f"'shard' must be one of {MODES} ({got(value)}).")


@attrs.frozen
class Shards:
    """The layout of a sharded state: which of its tensors hold this rank's rows of a larger one.

    Args:
        mode: ``"full"`` (parameters sharded too) or ``"optimizer"`` (parameters whole).
        world: how many ranks share the state.
        rank: the rank whose part this state is.
        rows: parameter name -> the number of rows (``shape[0]``) of the whole
            parameter, for every parameter that is sharded (floating, at least
            one dimension); the others are whole on every rank. Kept as
            ``(name, rows)`` pairs, so that a layout is hashable.
        replicas: how many copies of the sharded state the run keeps (HSDP,
            a 2-D mesh): ``world`` consecutive ranks share one copy, and the
            ranks of the same ``rank`` in each copy hold the same chunks.
            ``world`` and ``rank`` are then within one copy.
        replica: which copy this rank's part belongs to.

    Examples:
        >>> s = Shards("full", world=2, rank=1, rows={"w": 5})
        >>> s.rows_per_rank("w"), s.span("w"), s.whole("w")
        (3, (3, 5), 5)
        >>> hybrid = Shards("full", world=2, rank=1, rows={"w": 5}, replicas=2, replica=1)
        >>> hybrid.ranks, hybrid.global_rank
        (4, 3)
    """

    mode: str = attrs.field(validator=_mode)
    world: int
    rank: int
    rows: tuple[tuple[str, int], ...] = attrs.field(converter=_pairs)
    replicas: int = 1
    replica: int = 0

    @property
    def ranks(self) -> int:
        """How many ranks train the state: ``world`` in each of ``replicas`` copies."""
        return self.world * self.replicas

    @property
    def global_rank(self) -> int:
        """This part's rank in the whole run: copies are blocks of ``world`` consecutive ranks."""
        return self.replica * self.world + self.rank

    @property
    def names(self) -> frozenset[str]:
        """The sharded parameters' names."""
        return frozenset(name for name, _ in self.rows)

    def whole(self, name: str) -> int:
        """The rows of the whole parameter ``name``."""
        return dict(self.rows)[name]

    @property
    def params(self) -> bool:
        """Whether the parameters themselves are sharded (``mode == "full"``)."""
        return self.mode == "full"

    def rows_per_rank(self, name: str) -> int:
        """The rows of ``name`` each rank holds: the whole count over the world size, rounded up."""
        return -(-self.whole(name) // self.world)

    def span(self, name: str, rank: int | None = None) -> tuple[int, int]:
        """The rows ``[start, stop)`` of the whole ``name`` that ``rank`` (default: this one) holds, padding left out."""
        per = self.rows_per_rank(name)
        at = self.rank if rank is None else rank
        whole = self.whole(name)
        return min(at * per, whole), min((at + 1) * per, whole)

    def at(self, world: int, rank: int) -> Shards:
        """The same layout for another rank of another world size (one copy)."""
        return Shards(self.mode, world, rank, self.rows)


def chunk(whole: torch.Tensor, shards: Shards, name: str) -> torch.Tensor:
    """This rank's chunk of ``whole``: its rows, zero-padded to ``rows_per_rank`` (a new tensor)."""
    per = shards.rows_per_rank(name)
    start = shards.rank * per
    part = whole[start : start + per]
    if part.shape[0] == per:
        return part.clone()
    return torch.cat([part, whole.new_zeros((per - part.shape[0], *whole.shape[1:]))])


def sharded_tensors(params: Mapping[str, torch.Tensor], opt_state: Any, shards: Shards) -> dict[int, str]:
    """``id(tensor) -> parameter name`` for every tensor of ``params`` and ``opt_state`` that holds a chunk.

    A parameter is a chunk where ``shards.params`` says so; an optimizer
    state's leaf is one when it sits under a key naming a sharded parameter and
    has that chunk's row count (``mu['fc.weight']``, a momentum's trace): the
    optimizer built it from the chunk.
    """
    found = {}
    split = shards.names
    if shards.params:
        found.update({id(params[name]): name for name in split if name in params})
    for path, leaf in pytree.tree_flatten_with_path(opt_state)[0]:
        if not isinstance(leaf, torch.Tensor) or leaf.ndim == 0:
            continue
        names = [k.key for k in path if isinstance(k, pytree.MappingKey) and k.key in split]
        if names and leaf.shape[0] == shards.rows_per_rank(names[-1]):
            found[id(leaf)] = names[-1]
    return found
