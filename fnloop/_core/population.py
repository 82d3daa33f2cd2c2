"""What makes a state a population: ``Population``, plain data kept in ``TrainState.population``.

A population's state holds its members' tensors stacked on a new first
dimension (parameters, buffers, optimizer state), so that one step trains them
all; everything else (the iteration, the data cursor, ``max_iter``) they share.
What differs between members besides their tensors is here: each one's seed,
a label for its curves, and whether it has stopped. A member's metrics are
recorded under ``<name>/<member>`` (``loss/3``).
"""

from __future__ import annotations

from typing import Any

import attrs

from fnloop._core.messages import got

__all__ = ["PerMember", "Population", "member_metric", "split_member_metric"]


def _seeds(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if type(value) is not tuple or not value or not all(type(s) is int and s >= 0 for s in value):
        raise TypeError(f"'{attribute.name}' must be a non-empty tuple of seeds, ints >= 0 ({got(value)}).")


def _per_member(kind: type) -> Any:
    def check(instance: Population, attribute: attrs.Attribute, value: object) -> None:
        if (
            type(value) is not tuple
            or len(value) != len(instance.seeds)
            or not all(type(v) is kind for v in value)
        ):
            raise TypeError(
                f"'{attribute.name}' must be a tuple of {len(instance.seeds)} {kind.__name__}s, one per "
                f"member ({got(value)})."
            )

    return check


@attrs.frozen
class Population:
    """The members of a population state: their seeds, their labels, and which have stopped.

    Build a population with ``fnloop.population``; a step reads this record.

    Args:
        seeds: each member's run seed (its ``rng`` alone); the number of members.
        labels: a name for each member, for its curves: the hyperparameters it
            was built with (``"lr=0.001"``), or its index.
        stopped: for each member, ``-1`` while it trains, else the iteration
            count at which it stopped (``early_stop`` sets it): a stopped member's
            tensors no longer change, and ``fnloop.member`` gives it as it was then.

    Examples:
        >>> p = Population(seeds=(0, 1), labels=("lr=0.1", "lr=0.01"), stopped=(-1, 7))
        >>> p.size, p.training
        (2, (True, False))
    """

    seeds: tuple[int, ...] = attrs.field(validator=_seeds)
    labels: tuple[str, ...] = attrs.field(validator=_per_member(str))
    stopped: tuple[int, ...] = attrs.field(validator=_per_member(int))

    @property
    def size(self) -> int:
        """How many members."""
        return len(self.seeds)

    @property
    def training(self) -> tuple[bool, ...]:
        """For each member, whether it still trains."""
        return tuple(s < 0 for s in self.stopped)


@attrs.frozen
class PerMember:
    """A batch with one row per member on its first dimension: each member trains on its own.

    A population's step gives a plain batch to every member; a ``PerMember``
    batch's tensors have the members first (``[members, batch, ...]``), and
    member ``i`` trains on row ``i`` (``fnloop.data.batches(..., members=...)``
    makes such batches, each member's in its own order).
    """

    batch: Any


def member_metric(name: str, member: int) -> str:
    """The name a member's metric ``name`` is recorded under.

    Examples:
        >>> member_metric("loss", 3)
        'loss/3'
    """
    return f"{name}/{member}"


def split_member_metric(name: str, size: int) -> tuple[str, int] | None:
    """``(metric, member)`` for a member's metric name in a population of ``size``; ``None`` for another name.

    Examples:
        >>> split_member_metric("lr/3", 8), split_member_metric("lr/head", 8), split_member_metric("time", 8)
        (('lr', 3), None, None)
    """
    base, _, index = name.rpartition("/")
    if base and index.isdigit() and int(index) < size and str(int(index)) == index:
        return base, int(index)
    return None
