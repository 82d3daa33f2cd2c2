"""Where a step's work is placed, chosen once per layout: the placement record and its one table.

``train_step`` is told how the work is cut (``Plan``: the model's blocks, the
world-size-invariant slices); each call brings its ``Layout`` (a population,
a sharded state, HSDP copies). ``Placement.of(plan, layout, group)`` puts them
together once, checks that they fit, and is the one place that decides which
transformations the step is made of. Its table has one row per way of
running the gradient stage::

    row               the gradient stage                                        for
    members           value_and_grad(loss vmapped) -> accumulated               a population (one process)
    whole             value_and_grad -> accumulated                             one process
    replicas          ... -> replicated                                         data parallel
    sharded           ... -> sharded_gradient (gather, reduce-scatter)          sharded, all at once
    blocks            value_and_grad(held by blocks) -> accumulated -> blockwise  "full", in blocks
    sliced            value_and_grad -> sliced (invariant.py)                   invariant
    sliced, gathered  ... -> on_whole_params                                    invariant, "full", at once
    sliced blocks     value_and_grad(held by blocks, tree) -> sliced(summed)    invariant, "full", in blocks
    tensor            value_and_grad(held in slices) -> accumulated [-> replicated]  tensor parallel [x copies]
    tensor, sharded   ... -> sharded_gradient (gather, reduce-scatter)          tensor parallel x shards, at once
    tensor blocks     value_and_grad(held in slices, by blocks) -> ... -> blockwise  tensor parallel x shards, "full", in blocks
    tensor, sliced    value_and_grad(held in slices) -> sliced                  tensor parallel, invariant [x copies or shards]
    tensor, sliced, gathered  ... -> on_whole_params                            tensor parallel, invariant, "full"

and hands out the rest from the same record: the update stage (the
optimizer's, with its sums over the model, ``total``; the statistics'
``Squares``; on this rank's chunks when sharded), the guard, and where the
eager step may write in place. A new parallelism is one transformation
module plus one row here (see ``docs/architecture.md#adding-a-parallelism``).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import attrs
import torch

from fnloop._core.shards import Shards
from fnloop._step.accumulate import accumulated
from fnloop._step.blocks import blockwise, held_by_blocks
from fnloop._step.collectives import Groups, all_ranks, groups_of, summed
from fnloop._step.invariant import WHOLE, RowSquares, checked_world, power_of_two, ranks_tree, sliced
from fnloop._step.kernel import Gradient, Kernel, UpdateStage, value_and_grad
from fnloop._step.layout import Layout
from fnloop._step.members import member_finite, member_gradient, member_rows, member_update
from fnloop._step.replicas import replicated
from fnloop._step.seeds import slice_seeds, step_seed
from fnloop._step.sharding import chunk_squares, on_whole_params, sharded_gradient, sharded_update
from fnloop._step.statistics import Squares, with_statistics
from fnloop._step.tensor import TensorSquares, tensor_hold, tensor_parallel_groups
from fnloop._step.units import Units
from fnloop.distributed import world_size

__all__ = ["Placement", "Plan"]


_WHOLE_UNDER_INVARIANT = (
    "train_step(invariant={slices}) on a shard='full' state: with a number of slices that is not a "
    "power of two, the slices run on the whole parameters, gathered all at once, not block by block, "
    "so a rank's peak holds the whole model (and its slices' gradients until they are exchanged). "
    "Choose invariant=2**k (for 1, 2, 4, ... ranks) to gather block by block, or pass "
    "train_step(..., blocks=()) to say that gathering at once is meant."
)

_TENSOR_WHOLE_UNDER_INVARIANT = (
    "train_step(invariant={slices}) on a tensor-parallel state sharded 'full': the slices run on this "
    "rank's slices of every layer gathered all at once, not block by block, so a rank's peak holds its "
    "1/T of the whole model. Pass train_step(..., blocks=()) to say that gathering at once is meant, "
    "or shard='optimizer' in init to keep the parameters' slices whole."
)

_GENERATOR_SLICES = (
    "train_step(invariant={slices}): the compiled step draws from torch's generator, where it "
    "cannot be seeded slice by slice, so its numbers would depend on the world size. Run it eagerly "
    "(compile=False), or leave invariant out."
)


@attrs.frozen
class Plan:
    """How ``train_step`` was told to cut the work, whatever the call: the model's blocks, and the invariant slices.

    Args:
        units: the blocks a ``"full"`` sharded step gathers one at a time
            (``units.py``); none: every parameter at once.
        slices: world-size invariance (``invariant.py``): the global batch's
            slices, each run alone and summed in one fixed tree; ``None``: the
            rank's batch at once, averaged over the ranks by an all-reduce.
    """

    units: Units = attrs.field(factory=Units)
    slices: int | None = None

    def check(self, layout: Layout) -> None:
        """A world-size-invariant step runs a single run's whole state, one sharded over every data-parallel rank, or split (``tensor=``) in either; refuse the rest."""
        if self.slices is None:
            return
        tensor = layout.tensor
        checked_world(self.slices, world_size() // (1 if tensor is None else tensor.degree), tensor)
        if layout.members is not None:
            raise ValueError(
                f"train_step(invariant={self.slices}) on a population: a population runs in one "
                "process, where the world size never changes. Leave invariant out for it."
            )
        if layout.shards is not None and layout.shards.replicas > 1:
            raise ValueError(
                f"train_step(invariant={self.slices}) on a state sharded with init(..., "
                f"replicate={layout.shards.replicas}): the invariant mode runs whole states and states "
                "sharded over every rank, not several copies of a sharded one. Leave replicate out of "
                "init (shard over every rank), or invariant out of train_step."
            )

    def seed_rank(self, rank: int) -> int:
        """The rank whose seed a step draws from: its own, or under invariant 0 (each slice draws from its own seed)."""
        return rank if self.slices is None else 0

    def seeds(self, rng: int, iteration: int, steps: int, device: torch.device) -> torch.Tensor | None:
        """The seeds a compiled invariant call is given: every slice's (``[G]``, or ``[steps, G]``); else ``None``."""
        if self.slices is None:
            return None
        seeds = [slice_seeds(step_seed(rng, iteration + j), self.slices) for j in range(steps)]
        return torch.tensor(seeds if steps > 1 else seeds[0], device=device)

    def refuse_generator(self) -> None:
        """Raise where a compiled step's random op draws from torch's generator and the run must not depend on the world size."""
        if self.slices is not None:
            raise RuntimeError(_GENERATOR_SLICES.format(slices=self.slices))


@attrs.frozen(eq=False)
class Placement:
    """Where one layout's work is placed: the plan, the call's layout, the process groups; built by ``of``.

    Args:
        plan: what ``train_step`` was told (``Plan``).
        layout: the call's ``Layout``.
        group: every rank's process group; ``None`` in one process.
        groups: the groups the step talks over (``collectives.Groups``; in one
            process, one rank's, which exchanges nothing).
    """

    plan: Plan
    layout: Layout
    group: Any
    groups: Groups

    @classmethod
    def of(cls, plan: Plan, layout: Layout, group: Any) -> Placement:
        """The placement of ``layout`` under ``plan``, checked once."""
        plan.check(layout)
        shards, tensor = layout.shards, layout.tensor
        if tensor is not None:
            groups = tensor_parallel_groups(tensor.degree, torch.distributed.get_world_size(group), shards)
        elif shards is not None:
            groups = groups_of(shards.replicas, shards.ranks, group)
        elif group is not None:
            groups = Groups(group, None, None, torch.distributed.get_world_size(group))
        else:
            groups = Groups()
        placement = cls(plan, layout, group, groups)
        if placement.row in ("sliced, gathered", "tensor, sliced, gathered") and plan.units:
            whole = _WHOLE_UNDER_INVARIANT if tensor is None else _TENSOR_WHOLE_UNDER_INVARIANT
            warnings.warn(whole.format(slices=plan.slices), stacklevel=3)
        return placement

    @property
    def chunks(self) -> Shards:
        """Which tensors are this rank's chunks of larger ones: the state's sharding, or none (``WHOLE``)."""
        return WHOLE if self.layout.shards is None else self.layout.shards

    @functools.cached_property
    def row(self) -> str:
        """The table's row: which gradient stage this placement runs (see the module's table)."""
        shards, slices = self.layout.shards, self.plan.slices
        many = self.group is not None
        if self.layout.members is not None:
            return "members"
        gathers = shards is not None and shards.params and many  # a "full" state's chunks, gathered
        if self.layout.tensor is not None:
            if slices is not None:  # the same masks and slices at any number of copies
                return "tensor, sliced, gathered" if gathers else "tensor, sliced"
            if shards is None:
                return "tensor"
            return "tensor blocks" if gathers and self.plan.units else "tensor, sharded"
        if slices is not None:
            if gathers and self.in_blocks:
                return "sliced blocks"
            return "sliced, gathered" if gathers else "sliced"
        if gathers and self.plan.units:
            return "blocks"
        if shards is not None and many:
            return "sharded"
        return "replicas" if many else "whole"

    @property
    def in_blocks(self) -> bool:
        """Whether an invariant step adds its slices block by block (``slice_tree``'s order): a ``"full"`` state in blocks, ``G`` a power of two.

        At any world size, in one process too, so that its runs are one run.
        """
        shards, slices = self.layout.shards, self.plan.slices
        return (
            slices is not None
            and shards is not None
            and shards.params
            and bool(self.plan.units)
            and power_of_two(slices)
        )

    def gradient(self, kernel: Kernel) -> Gradient:
        """The gradient stage of this placement: ``(params, buffers, batch, scale=None) -> Grads``."""
        return _GRADIENTS[self.row](self, kernel)

    @functools.cached_property
    def _sums(self) -> tuple[Callable[[torch.Tensor], torch.Tensor] | None, Squares]:
        """How this placement adds over the model: the update's ``total``, and the statistics' ``Squares``."""
        tensor, shards = self.layout.tensor, self.layout.shards
        if (
            self.plan.slices is not None and tensor is None
        ):  # each tensor's rows' squares, in one order at any W
            rows = RowSquares(self.chunks, None if self.layout.shards is None else self.group)
            return rows, Squares(rows.statistics)
        if tensor is not None:  # this rank's slices (or their chunks), and the whole tensors counted once
            squares = TensorSquares(tensor.names, tensor.rank == 0, self.groups.tensor)
            if shards is not None:
                squares = attrs.evolve(
                    squares, chunks=shards.names, first_shard=shards.rank == 0, shard_group=self.groups.shard
                )
            return squares, Squares(squares.statistics, squares)
        if self.layout.shards is not None and self.group is not None:  # this rank's chunks, all-reduced
            total = functools.partial(summed, group=self.groups.shard)
            names, world = self.chunks.names, float(self.chunks.world)
            return total, Squares(functools.partial(chunk_squares, names, world), total)
        return None, Squares()

    @property
    def total(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """What the update adds a value over the model with (``Kernel.update``'s ``total``): ``None`` where it is whole here."""
        return self._sums[0]

    @property
    def squares(self) -> Squares:
        """How the statistics add squares over the model (``statistics.Squares``)."""
        return self._sums[1]

    def update(self, kernel: Kernel) -> UpdateStage:
        """The update stage of this placement: ``(grads, opt_state, params, iteration) -> Updated``."""
        total = self.total
        # Eager on whole tensors, adam and adamw update with torch's fused kernel, as update_ does.
        stage = kernel.transformed_update(kernel.fused if kernel.eager and total is None else kernel.update)
        if kernel.stats is not None:
            stage = with_statistics(stage, kernel, kernel.stats, self.plan.units, self.squares)
        if self.layout.members is not None:
            return member_update(stage)
        given = _given_total(stage, total)
        shards = self.layout.shards
        return given if shards is None else sharded_update(given, shards, self.groups)

    def finite(self, kernel: Kernel) -> Callable[..., torch.Tensor]:
        """The guard: whether the loss and every gradient are finite (on every rank, where each saw its chunks)."""
        if self.layout.members is not None:
            return member_finite(kernel)
        if self.layout.shards is not None and self.group is not None:
            return lambda loss, grads: all_ranks(kernel.finite(loss, grads), self.group)
        if self.layout.tensor is not None:  # each rank of a copy saw its slices
            return lambda loss, grads: all_ranks(kernel.finite(loss, grads), self.groups.tensor)
        return kernel.finite

    def writes_in_place(self, kernel: Kernel) -> bool:
        """Whether an eager step may update the state in place: a whole state, with no sums of its own over the model."""
        whole = self.layout.shards is None and self.row in ("whole", "replicas")
        return whole and not (kernel.transforms or kernel.stats)


def _value_and_grad(kernel: Kernel) -> Gradient:
    return value_and_grad(kernel.forward, kernel.fixed, hold=kernel.holding)


def _members(p: Placement, kernel: Kernel) -> Gradient:
    shared = p.layout.shared
    return accumulated(member_gradient(kernel, shared), kernel.accumulate, member_rows(shared))


def _whole(p: Placement, kernel: Kernel) -> Gradient:
    return accumulated(_value_and_grad(kernel), kernel.accumulate)


def _replicas(p: Placement, kernel: Kernel) -> Gradient:
    return replicated(_whole(p, kernel), p.group)


def _sharded(p: Placement, kernel: Kernel) -> Gradient:
    assert p.layout.shards is not None
    return sharded_gradient(_whole(p, kernel), p.layout.shards, p.groups)


def _blocks(p: Placement, kernel: Kernel) -> Gradient:
    shards = p.layout.shards
    assert shards is not None
    hold = held_by_blocks(kernel.model, p.plan.units, shards, p.groups.shard)
    gradient = accumulated(value_and_grad(kernel.forward, kernel.fixed, hold=hold), kernel.accumulate)
    return blockwise(gradient, shards, p.groups)


def _held_in_slices(p: Placement, kernel: Kernel, by_blocks: bool = False) -> Gradient:
    tensor, shards = p.layout.tensor, p.layout.shards
    assert tensor is not None
    blocks = None
    if by_blocks and shards is not None:
        blocks = held_by_blocks(kernel.model, p.plan.units, shards, p.groups.shard)
    hold = tensor_hold(kernel.model, tensor, p.groups.tensor, blocks)
    return accumulated(value_and_grad(kernel.forward, kernel.fixed, hold=hold), kernel.accumulate)


def _tensor(p: Placement, kernel: Kernel) -> Gradient:
    gradient = _held_in_slices(p, kernel)
    return gradient if p.groups.every is None else replicated(gradient, p.groups.every)


def _tensor_sharded(p: Placement, kernel: Kernel) -> Gradient:
    assert p.layout.shards is not None
    return sharded_gradient(_held_in_slices(p, kernel), p.layout.shards, p.groups)


def _tensor_blocks(p: Placement, kernel: Kernel) -> Gradient:
    assert p.layout.shards is not None
    return blockwise(_held_in_slices(p, kernel, by_blocks=True), p.layout.shards, p.groups)


def _tensor_sliced(p: Placement, kernel: Kernel) -> Gradient:
    assert p.plan.slices is not None
    return sliced(_held_in_slices(p, kernel), p.plan.slices, p.groups.every, p.chunks)


def _tensor_sliced_gathered(p: Placement, kernel: Kernel) -> Gradient:
    assert p.layout.shards is not None
    return on_whole_params(_tensor_sliced(p, kernel), p.layout.shards, p.groups)


def _sliced(p: Placement, kernel: Kernel) -> Gradient:
    assert p.plan.slices is not None
    return sliced(_value_and_grad(kernel), p.plan.slices, p.group, p.chunks, low_bits=p.in_blocks)


def _sliced_gathered(p: Placement, kernel: Kernel) -> Gradient:
    assert p.layout.shards is not None
    return on_whole_params(_sliced(p, kernel), p.layout.shards, p.groups)


def _sliced_blocks(p: Placement, kernel: Kernel) -> Gradient:
    # Each slice's block gradients added over the ranks by its gathers' backward, in slice_tree's order.
    shards, slices = p.layout.shards, p.plan.slices
    assert shards is not None
    assert slices is not None
    hold = held_by_blocks(kernel.model, p.plan.units, shards, p.groups.shard, reduce=ranks_tree)
    gradient = value_and_grad(kernel.forward, kernel.fixed, hold=hold)
    return sliced(gradient, slices, p.group, shards, summed=True, low_bits=True)


_GRADIENTS: dict[str, Callable[[Placement, Kernel], Gradient]] = {
    "members": _members,
    "whole": _whole,
    "replicas": _replicas,
    "sharded": _sharded,
    "blocks": _blocks,
    "sliced": _sliced,
    "sliced, gathered": _sliced_gathered,
    "sliced blocks": _sliced_blocks,
    "tensor": _tensor,
    "tensor, sharded": _tensor_sharded,
    "tensor blocks": _tensor_blocks,
    "tensor, sliced": _tensor_sliced,
    "tensor, sliced, gathered": _tensor_sliced_gathered,
}
"""The table: each row's gradient stage."""


def _given_total(update: UpdateStage, total: Callable[[torch.Tensor], torch.Tensor] | None) -> UpdateStage:
    """``update`` given ``total`` (how it adds over the model), as the four-argument stage the step calls."""

    def update_with_total(grads: dict, opt_state: Any, params: dict, iteration: torch.Tensor) -> Any:
        return update(grads, opt_state, params, iteration, total)

    return update_with_total
