"""A call of the step as it comes: its ``Layout`` read from the state and the batches, refused where it does not fit.

The call's kind (``calls.py``) asks for its own: ``one_run_layout`` or ``members_layout``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from fnloop._compile import flatten_batch
from fnloop._core.population import PerMember, Population
from fnloop._core.shards import Shards
from fnloop._core.state import TrainState
from fnloop._core.tensor_parallel import TensorParallel
from fnloop._step.layout import Layout

__all__ = ["member_batch", "members_layout", "one_run_layout", "stacked"]


def one_run_layout(
    state: TrainState, batches: Sequence[Any], *, rank: int, world: int, scan: bool, stop: bool
) -> Layout:
    """The layout of a call of the step on a single run's ``state`` and ``batches``, checked.

    ``scan``: the call's steps may run as one (a compiled step's loop); else
    the layout is that of one step, and the caller runs them one by one.
    """
    for batch in batches:
        _not_per_member(batch)
    steps = len(batches) if scan else 1
    tensor = _split(state, rank, world)
    degree = (
        1 if tensor is None else tensor.degree
    )  # the shards are of one place in each tensor-parallel block
    return _layout(None, True, _sharded(state, rank // degree, world // degree), steps, stop, (), tensor)


def members_layout(state: TrainState, batches: Sequence[Any], *, world: int, stop: bool) -> Layout:
    """The layout of a call of the step on a population's ``state``, checked: one step, given which members train."""
    population = _population_of(state, world)
    shared = type(batches[0]) is not PerMember
    return _layout(population.size, shared, None, 1, stop, ("which members train",), None)


@functools.lru_cache(maxsize=256)
def _layout(
    members: int | None,
    shared: bool,
    shards: Shards | None,
    steps: int,
    stop: bool,
    given: tuple[str, ...],
    tensor: TensorParallel | None,
) -> Layout:
    # One object per distinct layout: a call's compiled graph is found by comparing it with the last call's.
    return Layout(members, shared, shards, steps, stop, given, tensor)


def member_batch(batch: Any, population: Population, i: int) -> Any:
    """What a population's step takes of ``batch``: itself, or a ``PerMember``'s tensors, checked."""
    return batch if type(batch) is not PerMember else _member_rows(batch, population.size, i)


def _sharded(state: TrainState, rank: int, world: int) -> Shards | None:
    """The state's ``Shards``, checked against the process group this process is in (its data-parallel rank and world)."""
    shards = state.shards
    if shards is None:
        return None
    if shards.ranks != world or shards.global_rank != rank:
        copies = f" in {shards.replicas} copies" if shards.replicas > 1 else ""
        raise ValueError(
            f"the state is rank {shards.global_rank}'s part of a state sharded over {shards.ranks} "
            f"rank(s){copies}, but this process is rank {rank} of {world}. A sharded state trains on the ranks it was "
            "built for: build it with fnloop.init(..., shard=...) on each rank, or load a checkpoint "
            "with a template built so (fnloop.checkpoint.resume reshards it to this world size)."
        )
    return shards


def _split(state: TrainState, rank: int, world: int) -> TensorParallel | None:
    """The state's ``TensorParallel`` layout, checked against the process group this process is in."""
    tensor = state.tensor
    if tensor is None:
        return None
    if world % tensor.degree or rank % tensor.degree != tensor.rank:
        raise ValueError(
            f"the state holds rank {tensor.rank}'s slices of a model split over {tensor.degree} ranks "
            f"(tensor parallelism), but this process is rank {rank} of {world}. A tensor-parallel "
            "state trains on the ranks it was built for: build it with fnloop.init(..., tensor=...) "
            "on each rank of this run."
        )
    return tensor


def _population_of(state: TrainState, world: int) -> Population:
    """The state's ``Population``, refused where a population's step does not run yet."""
    population = state.population
    assert population is not None
    if state.shards is not None or state.tensor is not None or world > 1:
        raise ValueError(
            "a population's step runs in a single process: its members are the batch of one step, "
            "not shards or replicas of one another. Train the population without torchrun and "
            "without fnloop.init(..., shard=...)."
        )
    return population


def _member_rows(batch: PerMember, size: int, i: int) -> Any:
    """The tensors of a per-member batch, refused unless each has one row per member, members first."""
    for path, leaf in pytree.tree_flatten_with_path(batch.batch)[0]:
        if isinstance(leaf, torch.Tensor) and (leaf.ndim == 0 or leaf.shape[0] != size):
            n = leaf.shape[0] if leaf.ndim else 0
            rows = "no member dimension" if leaf.ndim == 0 else f"rows for {n} member{'s' * (n != 1)}"
            raise ValueError(
                f"train_step at iteration {i}: a PerMember batch gives member m the row m of each of its "
                f"tensors, and the population has {size} members, but its tensor "
                f"batch{pytree.keystr(path)} of shape {tuple(leaf.shape)} has {rows}. Give "
                f"fnloop.data.per_member one stream per member, {size} in all, in the members' order."
            )
    return batch.batch


def _not_per_member(batch: Any) -> None:
    """Refuse a per-member batch given to a single run's step."""
    if type(batch) is PerMember:
        raise ValueError(
            "train_step: a PerMember batch (fnloop.data.per_member) gives each member of a population its own batch, "
            "but this state is a single run's (state.population is None). Give the run one stream itself "
            "(streams[m] of the list given to per_member), or train a population (fnloop.population)."
        )


def stacked(batches: Sequence[Any], iteration: int) -> tuple[list[torch.Tensor], Any]:
    """The batches' tensors stacked position by position, and their common structure."""
    flats = [flatten_batch(batch) for batch in batches]
    tensors, structure = flats[0]
    shapes = [t.shape for t in tensors]
    for j, (other, other_structure) in enumerate(flats[1:], 1):
        if other_structure != structure or [t.shape for t in other] != shapes:
            raise ValueError(
                f"steps_per_call={len(batches)}: the batches of one call are stacked into one input, so "
                f"they must share one structure and shapes, but the batch for iteration {iteration + j} "
                f"({_described(other, other_structure)}) differs from iteration {iteration}'s "
                f"({_described(tensors, structure)}). Give batches of one size (drop_last=True for a "
                "DataLoader)."
            )
    return [torch.stack(column) for column in zip(*(t for t, _ in flats))], structure


def _described(tensors: list[torch.Tensor], structure: Any) -> str:
    return f"{structure!r:.60}, shapes {[tuple(t.shape) for t in tensors]}"
