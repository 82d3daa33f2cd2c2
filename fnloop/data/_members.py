"""A population's data, each member in its own order: ``per_member``."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch.utils import _pytree as pytree

from fnloop._core.messages import got
from fnloop._core.population import PerMember
from fnloop._core.stream import ResumableBatches

__all__ = ["PerMemberBatches", "per_member"]


@attrs.frozen
class PerMemberBatches:
    """Resumable streams, one per member, given together as ``PerMember`` batches; build it with ``per_member``."""

    streams: tuple[Any, ...]

    def iter_from(self, cursor: int) -> Iterator[tuple[PerMember, int]]:
        """Every member's stream from ``cursor`` on: each step's batches stacked, member first."""
        for pairs in zip(*(s.iter_from(cursor) for s in self.streams)):
            cursors = {c for _, c in pairs}
            if len(cursors) != 1:
                raise ValueError(
                    f"per_member(...): the members' streams moved to different cursors ({sorted(cursors)}); "
                    "each must give one batch per step, as fnloop.data.batches does."
                )
            yield PerMember(_stacked([b for b, _ in pairs])), cursors.pop()

    def __iter__(self) -> Iterator[PerMember]:
        return (batch for batch, _ in self.iter_from(0))


def _stacked(batches: list[Any]) -> Any:
    first = pytree.tree_structure(batches[0])
    for m, batch in enumerate(batches[1:], 1):
        if pytree.tree_structure(batch) != first:
            raise ValueError(
                f"per_member(...): member {m}'s batch is structured unlike member 0's; the members' "
                "batches are stacked, so they need one structure and one shape."
            )
    return pytree.tree_map(lambda *leaves: torch.stack(leaves), *batches)


_EXPECTED = (
    "per_member(streams) expects a non-empty list of resumable streams, one per member of the "
    "population, such as [fnloop.data.batches(data, batch_size=32, seed=s) for s in seeds]"
)


def per_member(streams: Sequence[Any]) -> PerMemberBatches:
    """A population's batches, member ``m`` reading ``streams[m]``: each member in its own data order.

    Each stream is a resumable one (``fnloop.data.batches(..., seed=s)``, or
    anything with ``iter_from(cursor)``). Every step, the members' batches are
    stacked on a new first dimension and given as one ``PerMember`` batch, so
    member ``m`` trains on exactly what it would alone on ``streams[m]``; the
    cursor (``state.data``) is shared, and a resumed population continues each
    member's stream where it was. Without it a population's members all train
    on the same batches. There must be one stream per member: the step refuses
    batches for more or fewer members than the population has, and a single
    run's state, when the first batch comes.

    Raises:
        TypeError: ``streams`` is not a list, or one of them has no ``iter_from``.
        ValueError: ``streams`` is empty.

    Examples:
        >>> import fnloop as fl
        >>> data = torch.arange(8.0).reshape(8, 1)
        >>> stream = per_member([fl.data.batches(data, batch_size=2, seed=s) for s in (0, 1)])
        >>> batch, cursor = next(stream.iter_from(0))
        >>> batch.batch.shape, cursor
        (torch.Size([2, 2, 1]), 1)
    """
    if isinstance(streams, (str, bytes, Mapping)) or not isinstance(streams, Iterable):
        raise TypeError(f"{_EXPECTED} ({got(streams)}).")
    streams = tuple(streams)
    if not streams:
        raise ValueError(f"{_EXPECTED} (got an empty {type(streams).__name__}).")
    for m, stream in enumerate(streams):
        if not isinstance(stream, ResumableBatches):
            hint = (
                " Wrap a list or a DataLoader in fnloop.data.resumable(...)."
                if isinstance(stream, Iterable)
                else ""
            )
            raise TypeError(
                f"per_member(streams): streams[{m}] is not a resumable stream, with iter_from(cursor) "
                f"({got(stream)}).{hint} {_EXPECTED}."
            )
    return PerMemberBatches(streams)
